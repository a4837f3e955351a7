"""The manifest, ``flax_dtensor.json``: what was written, checked when read.

It records every variable (its exact NNX path, checkpoint key, NNX type,
dtype, stored dtype, shape, layout, and a CRC-32 of each saved shard's
bytes) and every file of the export (size and a CRC-32 per 64 MiB chunk).
`read` is the one reader (restore, `read_checkpoint` and the CLI use it);
`verify_files` checks the files before TensorFlow reads them;
`verify_index` checks the variables against TF's index; `verify_read`
checks every value read back, and `_crc` is the one hash of values.
Reading (`read`) imports neither JAX nor TensorFlow: the command line's
``inspect`` shows an export from its manifest alone.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from flax_dtensor import _errors, _specs
from flax_dtensor.dtensor import _names

if TYPE_CHECKING:
  import jax
  import numpy as np

FILE = 'flax_dtensor.json'
CHECKPOINT_FORMAT = 'flax_dtensor.checkpoint'
SAVED_MODEL_FORMAT = 'flax_dtensor.saved_model'
# 3: exact paths, per-shard and per-file checksums (2: a path-keyed dict of
# records with structured shardings; still read, without checksums).
VERSION = 3
CHUNK_BYTES = 64 * 2**20
# Where a SavedModel keeps the manifest.
SAVED_MODEL_ASSETS = 'assets'
THREADS = max(2, min(8, os.cpu_count() or 2))

Index = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class FileSum:
  """A file's size and the CRC-32 of each `CHUNK_BYTES` chunk."""

  size: int
  crc32: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Record:
  """One variable of the manifest."""

  path: _names.Path
  key: str
  type: str
  dtype: str
  stored_dtype: str
  shape: tuple[int, ...]
  key_impl: str | None
  sharding: Mapping[str, Any] | None
  shards: tuple[tuple[Index, int], ...]  # (global slice, CRC-32 of bytes)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """A serving input or output: its shape (None: any size) and dtype."""

  shape: tuple[int | None, ...] | None  # None: unknown rank.
  dtype: str

  def text(self) -> str:
    """'[None, 128] int32', as ``tf.TensorSpec`` shows shape and dtype."""
    shape = '<unknown>' if self.shape is None else list(self.shape)
    return f'{shape} {self.dtype}'


@dataclasses.dataclass(frozen=True)
class Signature:
  """A SavedModel signature: named inputs and outputs."""

  inputs: Mapping[str, TensorSpec]
  outputs: Mapping[str, TensorSpec]


@dataclasses.dataclass(frozen=True)
class Manifest:
  """A parsed manifest.

  Attributes:
    kind: CHECKPOINT_FORMAT or SAVED_MODEL_FORMAT.
    version: The format version read.
    root: The export directory the manifest describes.
    prefix: The TF checkpoint prefix, relative to `root`.
    files: Relative path -> FileSum (empty for version 2).
    records: One per variable, in saved order.
    signatures: A SavedModel's serving signatures, as TensorFlow reads them
      from ``saved_model.pb``: name -> ``{'inputs': {name: TensorSpec},
      'outputs': {...}}`` (empty for a checkpoint, or a SavedModel written
      before they were recorded).
  """

  kind: str
  version: int
  root: str
  prefix: str
  files: Mapping[str, FileSum]
  records: tuple[Record, ...]
  signatures: Mapping[str, Signature] = dataclasses.field(default_factory=dict)

  @property
  def by_key(self) -> dict[str, Record]:
    return {r.key: r for r in self.records}

  @property
  def where(self) -> str:
    return os.path.join(self.root, self.location)

  @property
  def location(self) -> str:
    if self.kind == SAVED_MODEL_FORMAT:
      return os.path.join(SAVED_MODEL_ASSETS, FILE)
    return FILE


# Writing
# ------------------------------------------------------------------------------


def _axes(names: Iterable[Any], sizes: Iterable[Any]) -> dict[str, Any]:
  return {'axis_names': [str(n) for n in names], 'axis_sizes': list(sizes)}


def sharding_record(
  sharding: jax.sharding.Sharding, layout: Any, ndim: int
) -> dict[str, Any]:
  """A variable's layout as data: the JAX spec and mesh, the DTensor layout.

  `spec` lists the JAX mesh axes of each dimension (`[['data', 'model'],
  []]` for `P(('data', 'model'), None)`); `dtensor_layout` is the layout it
  was written with (a fused DTensor axis 'data+model' of size 8 there).
  """
  import jax  # pylint: disable=g-import-not-at-top

  if isinstance(sharding, jax.sharding.NamedSharding):
    entries = (*sharding.spec, *([None] * (ndim - len(sharding.spec))))
    kind = 'named'
    spec = [list(_specs.axes_of(entry)) for entry in entries]
    mesh = _axes(sharding.mesh.axis_names, sharding.mesh.axis_sizes)
  else:
    kind = 'single_device'
    spec = [[] for _ in range(ndim)]
    mesh = _axes([], [])
  return {
    'kind': kind,
    'spec': spec,
    'mesh': mesh,
    'dtensor_layout': {
      'sharding_specs': list(layout.sharding_specs),
      'mesh': _axes(
        layout.mesh.dim_names, (int(s) for s in layout.mesh.shape())
      ),
    },
  }


def _crc(data: Any) -> int:
  """CRC-32 of an array's bytes in C order (any dtype, ml_dtypes too)."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  return zlib.crc32(np.ascontiguousarray(data).reshape(-1).view(np.uint8))


def _index(index: Sequence[slice], shape: Sequence[int]) -> Index:
  out = []
  for s, size in zip(index, shape, strict=True):
    start, stop, _ = s.indices(size)
    out.append((start, stop))
  return tuple(out)


def shard_checksums(
  values: Sequence[jax.Array], pool: concurrent.futures.Executor
) -> list[concurrent.futures.Future]:
  """Starts hashing each array's distinct addressable shards in `pool`.

  Returns one future per array, of `[(global slice, CRC-32)]`. zlib
  releases the GIL, so the hashing runs beside TF's write.
  """

  def work(value: jax.Array) -> list[tuple[Index, int]]:
    seen: dict[Index, int] = {}
    for shard in value.addressable_shards:
      index = _index(shard.index, value.shape)
      if index not in seen:
        seen[index] = _crc(shard.data)
    return sorted(seen.items())

  return [pool.submit(work, v) for v in values]


def _file_chunks(path: str, size: int) -> list[tuple[int, int]]:
  return [(o, min(CHUNK_BYTES, size - o)) for o in range(0, size, CHUNK_BYTES)]


def _crc_chunk(path: str, offset: int, length: int) -> int:
  with open(path, 'rb') as f:
    f.seek(offset)
    data = f.read(length)
  if len(data) != length:
    raise OSError(f'read {len(data)} of {length} bytes at offset {offset}')
  return zlib.crc32(data)


def file_sums(
  root: str, names: Sequence[str], pool: concurrent.futures.Executor
) -> dict[str, FileSum]:
  """Size and chunk CRCs of `names` (relative to `root`), chunks in parallel."""
  jobs = {}
  sizes = {}
  for name in names:
    path = os.path.join(root, name)
    sizes[name] = os.path.getsize(path)
    jobs[name] = [
      pool.submit(_crc_chunk, path, o, n)
      for o, n in _file_chunks(path, sizes[name])
    ]
  return {
    name: FileSum(sizes[name], tuple(f.result() for f in futures))
    for name, futures in jobs.items()
  }


def files_under(root: str) -> list[str]:
  """Every file below `root`, relative, except the manifest itself."""
  out = []
  for directory, _, names in os.walk(root):
    for name in names:
      rel = os.path.relpath(os.path.join(directory, name), root)
      if os.path.basename(rel) != FILE:
        out.append(rel)
  return sorted(out)


def to_json(manifest: Manifest) -> dict[str, Any]:
  return {
    'format': manifest.kind,
    'version': VERSION,
    'checkpoint_prefix': manifest.prefix,
    'checksum': 'crc32',
    'chunk_bytes': CHUNK_BYTES,
    'files': {
      name: {'bytes': s.size, 'crc32': list(s.crc32)}
      for name, s in sorted(manifest.files.items())
    },
    'variables': [
      {
        'path': list(r.path),
        'key': r.key,
        'type': r.type,
        'dtype': r.dtype,
        'stored_dtype': r.stored_dtype,
        'shape': list(r.shape),
        'key_impl': r.key_impl,
        'sharding': r.sharding,
        'shards': [
          {'index': [list(d) for d in index], 'crc32': crc}
          for index, crc in r.shards
        ],
      }
      for r in manifest.records
    ],
  } | (
    {
      'signatures': {
        name: {
          side: {
            k: {
              'shape': None if t.shape is None else list(t.shape),
              'dtype': t.dtype,
            }
            for k, t in sorted(getattr(sig, side).items())
          }
          for side in ('inputs', 'outputs')
        }
        for name, sig in sorted(manifest.signatures.items())
      }
    }
    if manifest.signatures
    else {}
  )


def write(manifest: Manifest) -> None:
  """Writes the manifest into its root, flushed to disk."""
  path = manifest.where
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w') as f:
    json.dump(to_json(manifest), f, indent=1)
    f.write('\n')
    f.flush()
    os.fsync(f.fileno())


# Reading
# ------------------------------------------------------------------------------


def locate(path: str) -> tuple[str, str] | None:
  """(root, manifest file) for an export directory or a checkpoint prefix."""
  here = os.path.abspath(path)
  candidates = [
    (here, os.path.join(here, FILE)),
    (here, os.path.join(here, SAVED_MODEL_ASSETS, FILE)),
  ]
  parent = os.path.dirname(here)  # `path` is a prefix: root/ckpt.
  candidates += [
    (parent, os.path.join(parent, FILE)),
    (
      os.path.dirname(parent),  # root/variables/variables.
      os.path.join(os.path.dirname(parent), SAVED_MODEL_ASSETS, FILE),
    ),
  ]
  for root, file in candidates:
    if os.path.isfile(file):
      return root, file
  return None


def _malformed(file: str, problem: str) -> _errors.ExportError:
  return _errors.ExportError(
    f'{file!r} is not a valid flax_dtensor manifest: {problem}. Expected the '
    'JSON file save_checkpoint or save_saved_model writes. Re-export the '
    'checkpoint; to read the TF checkpoint without it (no checks of the '
    'data, no dtype information), move the file away.'
  )


def _int_list(value: Any, what: str, file: str) -> tuple[int, ...]:
  if not isinstance(value, list) or not all(
    isinstance(v, int) and not isinstance(v, bool) for v in value
  ):
    raise _malformed(file, f'{what} is {value!r:.80}, expected a list of ints')
  return tuple(value)


def _record(raw: Any, file: str, path: _names.Path | None = None) -> Record:
  if not isinstance(raw, dict):
    raise _malformed(file, f'a variable record is {raw!r:.80}')
  try:
    if path is None:
      path = tuple(raw['path'])
    for key in path:
      if isinstance(key, bool) or not isinstance(key, int | str):
        raise TypeError(f'path {list(path)!r}')
    key = raw.get('key') or _names.checkpoint_key(path)
    dtype, stored = raw['dtype'], raw.get('stored_dtype', raw['dtype'])
    if not isinstance(dtype, str) or not isinstance(stored, str):
      raise TypeError('dtype')
    shards = tuple(
      (
        tuple(tuple(_int_list(d, 'a shard index', file)) for d in s['index']),
        int(s['crc32']),
      )
      for s in raw.get('shards', ())
    )
    return Record(
      path=path,
      key=str(key),
      type=str(raw.get('type', '-')),
      dtype=dtype,
      stored_dtype=stored,
      shape=_int_list(raw['shape'], 'a shape', file),
      key_impl=raw.get('key_impl'),
      sharding=raw.get('sharding'),
      shards=shards,
    )
  except (KeyError, TypeError, ValueError) as e:
    raise _malformed(
      file, f'a variable record lacks or garbles {e}: {raw!r:.120}'
    ) from e


def read(path: str) -> Manifest | None:
  """The manifest of the export at `path` (directory or prefix), or None.

  Raises:
    ExportError: If the file is unreadable or not a valid manifest.
  """
  found = locate(path)
  if found is None:
    return None
  root, file = found
  try:
    with open(file) as f:
      raw = json.load(f)
  except (OSError, ValueError) as e:
    raise _malformed(file, f'{type(e).__name__}: {e}') from e
  if not isinstance(raw, dict):
    raise _malformed(file, f'the document is a {type(raw).__name__}')
  kind = raw.get('format')
  if kind not in (CHECKPOINT_FORMAT, SAVED_MODEL_FORMAT):
    raise _malformed(file, f'its format is {kind!r}')
  version = raw.get('version')
  if version not in (2, VERSION):
    raise _malformed(
      file, f'its version is {version!r}; this flax_dtensor reads 2 and 3'
    )
  prefix = raw.get('checkpoint_prefix')
  if not isinstance(prefix, str):
    raise _malformed(file, 'it has no checkpoint_prefix')
  variables = raw.get('variables')
  if version == 2:
    if not isinstance(variables, dict):
      raise _malformed(file, '`variables` is not a dict of records')
    records = tuple(
      _record(v, file, _names.parse_path(name)) for name, v in variables.items()
    )
    files: dict[str, FileSum] = {}
  else:
    if not isinstance(variables, list):
      raise _malformed(file, '`variables` is not a list of records')
    records = tuple(_record(v, file) for v in variables)
    raw_files = raw.get('files')
    if not isinstance(raw_files, dict):
      raise _malformed(file, '`files` is not a dict')
    files = {}
    for name, s in raw_files.items():
      if not isinstance(s, dict) or not isinstance(s.get('bytes'), int):
        raise _malformed(file, f'the record of file {name!r} is {s!r:.80}')
      files[name] = FileSum(s['bytes'], _int_list(s.get('crc32'), name, file))
  keys = [r.key for r in records]
  if len(set(keys)) != len(keys):
    raise _malformed(file, 'two variables share a checkpoint key')
  signatures = _signatures(raw.get('signatures', {}), file)
  return Manifest(kind, version, root, prefix, files, records, signatures)


def _signatures(raw: Any, file: str) -> dict[str, Signature]:
  if not isinstance(raw, dict):
    raise _malformed(file, f'`signatures` is {raw!r:.80}, expected a dict')
  out = {}
  for name, sig in raw.items():
    if not isinstance(sig, dict):
      raise _malformed(file, f'signature {name!r} is {sig!r:.80}')
    sides = {}
    for side in ('inputs', 'outputs'):
      specs = sig.get(side)
      if not isinstance(specs, dict):
        raise _malformed(file, f'signature {name!r} has no {side} dict')
      sides[side] = {k: _tensor_spec(v, file, name) for k, v in specs.items()}
    out[str(name)] = Signature(**sides)
  return out


def _tensor_spec(raw: Any, file: str, signature: str) -> TensorSpec:
  shape = raw.get('shape', ()) if isinstance(raw, dict) else ()
  dtype = raw.get('dtype') if isinstance(raw, dict) else None
  if not isinstance(dtype, str) or not (
    shape is None
    or (
      isinstance(shape, list)
      and all(
        d is None or (isinstance(d, int) and not isinstance(d, bool))
        for d in shape
      )
    )
  ):
    raise _malformed(
      file, f'a tensor of signature {signature!r} is {raw!r:.80}'
    )
  return TensorSpec(None if shape is None else tuple(shape), dtype)


# Verifying
# ------------------------------------------------------------------------------


def _damaged(
  manifest: Manifest, problems: list[str], *, read: bool = False
) -> _errors.ExportError:
  shown = '; '.join(problems[:4]) + (
    f'; and {len(problems) - 4} more' if len(problems) > 4 else ''
  )
  if read:
    return _errors.ExportError(
      f'The export at {manifest.root!r} is damaged: {shown} (expected what '
      f'its manifest {manifest.location} records; found in the bytes read, '
      'so the files may also have changed during the read). Nothing was '
      'restored: the target is unchanged. Restore from an intact copy, or '
      're-export it; if another process was saving to that path, read again '
      'once it is done.'
    )
  return _errors.ExportError(
    f'The export at {manifest.root!r} is damaged: {shown} (expected what its '
    f'manifest {manifest.location} records). Nothing was read into '
    'TensorFlow. Restore from an intact copy, or re-export it.'
  )


def verify_files(manifest: Manifest, pool: concurrent.futures.Executor) -> None:
  """Checks every recorded file's size and CRCs, before TF reads any.

  Raises:
    ExportError: Naming every missing, resized or changed file.
  """
  problems: list[str] = []
  jobs = []
  for name, expected in sorted(manifest.files.items()):
    path = os.path.join(manifest.root, name)
    try:
      size = os.path.getsize(path)
    except OSError:
      problems.append(f'{name} is missing')
      continue
    if size != expected.size:
      problems.append(f'{name} has {size} bytes, not {expected.size}')
      continue
    chunks = _file_chunks(path, size)
    if len(chunks) != len(expected.crc32):
      problems.append(f'{name} has {len(chunks)} chunks recorded wrongly')
      continue
    for i, (offset, length) in enumerate(chunks):
      jobs.append(
        (
          name,
          i,
          expected.crc32[i],
          pool.submit(_crc_chunk, path, offset, length),
        )
      )
  for name, i, crc, future in jobs:
    try:
      got = future.result()
    except OSError as e:
      problems.append(f'{name} cannot be read ({e})')
      continue
    if got != crc:
      problems.append(
        f'{name} bytes {i * CHUNK_BYTES}..{(i + 1) * CHUNK_BYTES} changed '
        f'(CRC-32 {got:08x}, recorded {crc:08x})'
      )
  if problems:
    raise _damaged(manifest, sorted(set(problems), key=problems.index))


def verify_index(
  manifest: Manifest, shapes: Mapping[str, Any], dtypes: Mapping[str, Any]
) -> None:
  """Checks TF's index (key -> shape, dtype) against the manifest.

  Raises:
    ExportError: If a variable is missing on either side, or its shape or
      stored dtype differs.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top

  from flax_dtensor.dtensor import _dtypes  # pylint: disable=g-import-not-at-top

  held = {k for k in shapes if _names.nnx_path(k) is not None}
  recorded = manifest.by_key
  problems = []
  for key in sorted(set(recorded) - held):
    problems.append(
      f'{_names.path_text(recorded[key].path)} is not in the data'
    )
  for key in sorted(held - set(recorded)):
    problems.append(
      f'the data holds {_names.path_text(_names.nnx_path(key))}, which the '
      'manifest does not list'
    )
  for key in sorted(held & set(recorded)):
    r = recorded[key]
    name = _names.path_text(r.path)
    if tuple(shapes[key]) != r.shape:
      problems.append(
        f'{name} has shape {tuple(shapes[key])} in the data, {r.shape} in '
        'the manifest'
      )
    stored = np.dtype(dtypes[key].as_numpy_dtype)
    if stored.name != r.stored_dtype:
      problems.append(
        f'{name} is stored as {stored} in the data, as {r.stored_dtype} in '
        'the manifest'
      )
    saved = _dtypes.from_name(r.dtype, manifest.where)
    if _dtypes.stored(saved).name != r.stored_dtype:
      problems.append(
        f'{name} is recorded as {r.dtype} stored as {r.stored_dtype}, but '
        f'{r.dtype} is stored as {_dtypes.stored(saved)}'
      )
  if problems:
    raise _damaged(manifest, problems)


def verify_read(
  manifest: Manifest,
  record: Record,
  read: Mapping[Index, np.ndarray],
) -> None:
  """Checks every byte TF read of one variable against the saved CRCs.

  This is the one check of values: whatever happened to the files after
  `verify_files` (a byte flipped, a file truncated, the whole export
  replaced by another save), a restore places only bytes that match what
  was saved. `read` maps each global slice TF returned to its host array,
  in the saved dtype: the whole variable, or whole saved shards. Each saved
  shard found in a slice is hashed (`_crc`) and compared; a slice that the
  recorded shards do not cover whole is refused too. A record without
  shard CRCs (manifest version 2) is not checked.

  Raises:
    ExportError: If a shard's bytes differ from what was saved, or the
      recorded shards leave part of a slice read unchecked.
  """
  if not record.shards:
    return
  for held, data in read.items():
    checked = 0
    for index, crc in record.shards:
      if contains(held, index):
        _check_shard(manifest, record, index, crc, data, held)
        checked += _volume(index)
    if checked != _volume(held):
      raise _damaged(
        manifest,
        [
          f'the shards recorded for {_names.path_text(record.path)} do not '
          f'cover [{_slices(held)}], so its bytes cannot be checked'
        ],
        read=True,
      )


def _volume(index: Index) -> int:
  import numpy as np  # pylint: disable=g-import-not-at-top

  return int(np.prod([b - a for a, b in index], dtype=np.int64))


def contains(held: Index, index: Index) -> bool:
  """Whether the global slice `held` contains the global slice `index`."""
  return all(
    h0 <= i0 and i1 <= h1
    for (i0, i1), (h0, h1) in zip(index, held, strict=True)
  )


def _check_shard(
  manifest: Manifest,
  record: Record,
  index: Index,
  crc: int,
  data: Any,
  held: Index,
) -> None:
  local = tuple(
    slice(i0 - h0, i1 - h0)
    for (i0, i1), (h0, _) in zip(index, held, strict=True)
  )
  import numpy as np  # pylint: disable=g-import-not-at-top

  got = _crc(np.asarray(data)[local])
  if got != crc:
    raise _damaged(
      manifest,
      [
        f'{_names.path_text(record.path)}[{_slices(index)}] read back '
        f'with CRC-32 {got:08x}, recorded {crc:08x}'
      ],
      read=True,
    )


def _slices(index: Index) -> str:
  return ', '.join(f'{a}:{b}' for a, b in index)
