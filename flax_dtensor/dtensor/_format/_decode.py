"""The manifest, ``flax_dtensor.json``: what was written, checked when read.

It records every variable (its exact NNX path, checkpoint key, NNX type,
dtype, stored dtype, shape, layout, and a CRC-32 of each saved shard's
bytes: the shards are the blocks of a grid its layout implies, `_grid`,
so a shard costs 4 bytes) and every file of the export (size and a CRC-32
per 64 MiB chunk).
`read` is the one reader (restore, `read_checkpoint` and the CLI use it),
strict about the document's shape and the paths it names;
`verify_files` checks where the files lead and their bytes before
TensorFlow reads them (`problems_of` lists what is wrong, for `--verify`);
`verify_index` checks the variables against TF's index; `verify_read`
checks every value read back, and `crc` is the one hash of values.
Reading (`read`) imports neither JAX nor TensorFlow: the command line's
``inspect`` shows an export from its manifest alone.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import re
import threading
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from flax_dtensor import _errors
from flax_dtensor._rules import _partition_specs
from flax_dtensor.dtensor._conversion import _names
from flax_dtensor.dtensor._format import _grid, _paths
from flax_dtensor.dtensor._layout import _index

if TYPE_CHECKING:
  import jax
  import numpy as np

FILE = 'flax_dtensor.json'
CHECKPOINT_FORMAT = 'flax_dtensor.checkpoint'
SAVED_MODEL_FORMAT = 'flax_dtensor.saved_model'
# 3: exact paths, per-shard and per-file checksums, each shard a record.
# 4: the shards implied by each variable's layout (the blocks of a grid),
# their checksums one base64 string of 4 bytes a shard.
VERSION = 4
# The versions read, each with the name of its checksum: the key of the
# per-file and per-shard checksums, and the manifest's `checksum`. Version 2
# (no checksums) was never released, and is refused.
READABLE = {3: 'crc32', 4: 'crc32'}
# What a manifest may be: at most this large, and nested this deep.
MAX_BYTES = 256 * 2**20
MAX_DEPTH = 64
# Sizes, shapes and offsets are below this; checksums are 32-bit.
_MAX_INT = 2**63
CHUNK_BYTES = 64 * 2**20
# Where a SavedModel keeps the manifest.
SAVED_MODEL_ASSETS = 'assets'
THREADS = max(2, min(8, os.cpu_count() or 2))

Index = _index.Index


@dataclasses.dataclass(frozen=True)
class FileSum:
  """A file's size and the CRC-32 of each `CHUNK_BYTES` chunk."""

  size: int
  crc32: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class MeshAxes:
  """A mesh's axis names and sizes, as the manifest records them."""

  names: tuple[str, ...]
  sizes: tuple[int, ...]

  def text(self) -> str:
    """'data=2,model=4'."""
    return ','.join(
      f'{n}={s}' for n, s in zip(self.names, self.sizes, strict=True)
    )

  def to_json(self) -> dict[str, Any]:
    return {'axis_names': list(self.names), 'axis_sizes': list(self.sizes)}


@dataclasses.dataclass(frozen=True)
class ShardingRecord:
  """How a variable was laid out when saved (`sharding_record`).

  Attributes:
    kind: 'named' (a `NamedSharding`) or 'single_device'.
    spec: The JAX mesh axes of each dimension (``(('data', 'model'), ())``
      for ``P(('data', 'model'), None)``).
    mesh: The JAX mesh.
    dtensor_specs: The DTensor layout's sharding spec of each dimension
      (a fused axis 'data+model' for the spec above).
    dtensor_mesh: The DTensor mesh.
  """

  kind: str
  spec: tuple[tuple[str, ...], ...]
  mesh: MeshAxes
  dtensor_specs: tuple[str, ...]
  dtensor_mesh: MeshAxes

  def to_json(self) -> dict[str, Any]:
    """The record as the manifest stores it."""
    return {
      'kind': self.kind,
      'spec': [list(d) for d in self.spec],
      'mesh': self.mesh.to_json(),
      'dtensor_layout': {
        'sharding_specs': list(self.dtensor_specs),
        'mesh': self.dtensor_mesh.to_json(),
      },
    }


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
  # A display string in the records of early flax_dtensor versions.
  sharding: ShardingRecord | str | None
  # The saved shards: iterates as (global slice, CRC-32 of its bytes).
  shards: _grid.ShardGrid


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
    files: Relative path -> FileSum.
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


def _axes(names: Iterable[Any], sizes: Iterable[Any]) -> MeshAxes:
  return MeshAxes(tuple(str(n) for n in names), tuple(int(s) for s in sizes))


def sharding_record(
  sharding: jax.sharding.Sharding, layout: Any, ndim: int
) -> ShardingRecord:
  """A variable's layout as data: the JAX spec and mesh, the DTensor layout.

  `spec` lists the JAX mesh axes of each dimension (`[['data', 'model'],
  []]` for `P(('data', 'model'), None)`); `dtensor_layout` is the layout it
  was written with (a fused DTensor axis 'data+model' of size 8 there).
  """
  import jax

  if isinstance(sharding, jax.sharding.NamedSharding):
    entries = (*sharding.spec, *([None] * (ndim - len(sharding.spec))))
    kind = 'named'
    spec = tuple(tuple(_partition_specs.axes_of(entry)) for entry in entries)
    mesh = _axes(sharding.mesh.axis_names, sharding.mesh.axis_sizes)
  else:
    kind = 'single_device'
    spec = tuple(() for _ in range(ndim))
    mesh = _axes([], [])
  return ShardingRecord(
    kind=kind,
    spec=spec,
    mesh=mesh,
    dtensor_specs=tuple(str(s) for s in layout.sharding_specs),
    dtensor_mesh=_axes(layout.mesh.dim_names, layout.mesh.shape()),
  )


def blocks_of(
  sharding: ShardingRecord, shape: Sequence[int]
) -> tuple[int, ...]:
  """The grid of saved shards a recorded layout implies, per dimension.

  A dimension sharded over mesh axes is cut into as many equal blocks as
  the product of their sizes (one block if it is empty); others are whole.

  Raises:
    ValueError: Saying why the layout implies no grid over `shape`.
  """
  if sharding.kind == 'single_device':
    return (1,) * len(shape)
  if len(sharding.spec) != len(shape):
    raise ValueError(
      f'its layout has {len(sharding.spec)} dimensions, its shape {len(shape)}'
    )
  sizes = dict(zip(sharding.mesh.names, sharding.mesh.sizes, strict=True))
  used = [axis for axes in sharding.spec for axis in axes]
  if len(set(used)) != len(used) or not set(used) <= set(sizes):
    raise ValueError(
      f'its layout shards over mesh axes {used}, which are not distinct '
      f'axes of its mesh {sharding.mesh.text()}'
    )
  out = []
  for axes, n in zip(sharding.spec, shape, strict=True):
    count = 1
    for axis in axes:
      count *= sizes[axis]
    if n % count:
      raise ValueError(
        f'its layout cuts a dimension of {n} into {count} blocks, unevenly'
      )
    out.append(count if n else 1)
  return tuple(out)


def shard_grid(
  sharding: ShardingRecord,
  shape: Sequence[int],
  shards: Sequence[tuple[Index, int]],
) -> _grid.ShardGrid:
  """The grid of a variable's saved shards, from their (slice, CRC-32)s.

  For the writers: every distinct shard of the array, each once, as the
  layout implies (an internal invariant, checked even under `python -O`).
  """
  try:
    grid = _grid.from_shards(tuple(shape), shards)
    implied = blocks_of(sharding, shape)
  except ValueError as e:
    raise AssertionError(
      f'flax_dtensor internal error: the shards written of an array of shape '
      f'{tuple(shape)} {e}. Please report this with its sharding.'
    ) from e
  if grid.blocks != implied:
    raise AssertionError(
      f'flax_dtensor internal error: the shards written of an array of shape '
      f'{tuple(shape)} are {grid.blocks} blocks, its layout implies '
      f'{implied}. Please report this with its sharding.'
    )
  return grid


# Elements narrowed at a time by `crc`: a bounded scratch copy.
_NARROW_CHUNK = 2**22


def crc(data: Any, as_dtype: Any = None) -> int:
  """CRC-32 of an array's bytes in C order (any dtype, ml_dtypes too).

  With `as_dtype`, of the bytes of its values converted to that dtype: a
  copy stored widened is hashed as the saved dtype it was widened from (an
  exact conversion), a bounded chunk at a time.
  """
  import numpy as np

  flat = np.ascontiguousarray(data).reshape(-1)
  if as_dtype is None or np.dtype(as_dtype) == flat.dtype:
    return zlib.crc32(flat.view(np.uint8))
  value = 0
  for start in range(0, flat.size, _NARROW_CHUNK):
    part = flat[start : start + _NARROW_CHUNK].astype(as_dtype)
    value = zlib.crc32(part.view(np.uint8), value)
  return value


def _global_index(index: Sequence[slice], shape: Sequence[int]) -> Index:
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
      index = _global_index(shard.index, value.shape)
      if index not in seen:
        seen[index] = crc(shard.data)
    return sorted(seen.items())

  return [pool.submit(work, v) for v in values]


def _file_chunks(path: str, size: int) -> list[tuple[int, int]]:
  return [(o, min(CHUNK_BYTES, size - o)) for o in range(0, size, CHUNK_BYTES)]


# Files are hashed through one small buffer per thread, reused: reading a
# 64 MiB chunk into a fresh bytes object costs more in first-touch page
# faults than the read and the CRC together. (Not mmap: a file truncated
# while mapped kills the process with SIGBUS.)
_READ_BLOCK = 2**20
_buffers = threading.local()


def _crc_chunk(path: str, offset: int, length: int) -> int:
  block = getattr(_buffers, 'block', None)
  if block is None:
    block = _buffers.block = memoryview(bytearray(_READ_BLOCK))
  crc = 0
  done = 0
  with open(path, 'rb', buffering=0) as f:
    f.seek(offset)
    while done < length:
      n = f.readinto(block[: min(_READ_BLOCK, length - done)])
      if not n:
        break
      crc = zlib.crc32(block[:n], crc)
      done += n
  if done != length:
    raise OSError(f'read {done} of {length} bytes at offset {offset}')
  return crc


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
        'sharding': (
          r.sharding.to_json()
          if isinstance(r.sharding, ShardingRecord)
          else r.sharding
        ),
        'shards': {
          'blocks': list(r.shards.blocks),
          'crc32': r.shards.to_text(),
        },
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


def _malformed(file: str, problem: str) -> _errors.MalformedExportError:
  return _errors.MalformedExportError(
    f'{file!r} is not a valid flax_dtensor manifest: {problem}. Expected the '
    'JSON file save_checkpoint or save_saved_model writes. Re-export the '
    'checkpoint, or get an intact copy (`flax-dtensor inspect --verify '
    'PATH` checks one). Without its manifest the checkpoint reads as plain '
    'TF data, with no checks of the data and no dtype information: move '
    'the file away only for a checkpoint you trust.'
  )


def _int_list(
  value: Any, what: str, file: str, *, bound: int = _MAX_INT
) -> tuple[int, ...]:
  if not isinstance(value, list) or not all(
    isinstance(v, int) and not isinstance(v, bool) and 0 <= v < bound
    for v in value
  ):
    raise _malformed(
      file, f'{what} is {value!r:.80}, expected a list of ints in [0, {bound})'
    )
  return tuple(value)


def _checksum(value: Any, what: str, file: str) -> int:
  if isinstance(value, bool) or not isinstance(value, int):
    raise _malformed(file, f'{what} is {value!r:.80}, expected an int')
  if not 0 <= value < 2**32:
    raise _malformed(file, f'{what} is {value}, not a 32-bit checksum')
  return value


def _listed_shards(
  raw: Any, path: _names.Path, shape: tuple[int, ...], checksum: str, file: str
) -> _grid.ShardGrid:
  """Version 3's shards, one record each, as their grid (or our error)."""
  if not isinstance(raw, list):
    raise _malformed(file, f'the shards of {list(path)!r:.80} are {raw!r:.80}')
  shards = [_shard(s, checksum, file) for s in raw]
  try:
    return _grid.from_shards(shape, shards)
  except _grid.NotAGrid as e:
    raise _uncovered(file, path, e) from None


def _uncovered(
  file: str, path: _names.Path, e: _grid.NotAGrid
) -> _errors.MalformedExportError:
  name = _names.path_text(path)
  if e.uncovered is not None:
    return _malformed(
      file,
      f'the shards recorded for {name} do not cover '
      f'[{_grid.text(e.uncovered)}], so those values were never saved or '
      'their records are lost',
    )
  return _malformed(file, f'the shards recorded for {name} {e}')


def _grid_shards(
  raw: Any,
  path: _names.Path,
  shape: tuple[int, ...],
  sharding: ShardingRecord | str | None,
  checksum: str,
  file: str,
) -> _grid.ShardGrid:
  """Version 4's shards: the grid its layout implies, and their CRCs."""
  name = _names.path_text(path)
  if not isinstance(sharding, ShardingRecord):
    raise _malformed(
      file, f'{name} has no recorded layout, which implies its shards'
    )
  blocks = raw.get('blocks') if isinstance(raw, dict) else None
  text = raw.get(checksum) if isinstance(raw, dict) else None
  if not isinstance(text, str) or not isinstance(blocks, list):
    raise _malformed(
      file,
      f'the shards of {name} are {raw!r:.80}, expected blocks and {checksum}',
    )
  blocks = _int_list(blocks, f'the blocks of {name}', file)
  try:
    implied = blocks_of(sharding, shape)
  except ValueError as e:
    raise _malformed(
      file, f'the layout of {name} implies no shards: {e}'
    ) from None
  if blocks != implied:
    raise _malformed(
      file,
      f'the shards of {name} are {list(blocks)} blocks, where its layout '
      f'({_layout_text(sharding)}) cuts its shape {shape} into '
      f'{list(implied)}',
    )
  try:
    crcs = _grid.decode(text)
  except ValueError as e:
    raise _malformed(
      file, f'the {checksum} of the shards of {name} are {e}'
    ) from None
  count = 1
  for b in blocks:
    count *= b
  if len(crcs) != count:
    raise _malformed(
      file,
      f'{name} has {len(crcs)} shard checksum{"s" * (len(crcs) != 1)}, '
      f'where its layout ({_layout_text(sharding)}) implies {count} '
      f'shard{"s" * (count != 1)}',
    )
  return _grid.ShardGrid(shape, blocks, crcs)


def _layout_text(sharding: ShardingRecord) -> str:
  if sharding.kind == 'single_device':
    return 'one device'
  return f'{list(map(list, sharding.spec))} over {sharding.mesh.text()}'


def _shard(raw: Any, checksum: str, file: str) -> Any:
  if not isinstance(raw, dict) or not isinstance(raw.get('index'), list):
    raise _malformed(file, f'a shard record is {raw!r:.80}')
  index = tuple(_int_list(d, 'a shard index', file) for d in raw['index'])
  if not all(len(d) == 2 and d[0] <= d[1] for d in index):
    raise _malformed(
      file,
      f'the shard index {raw["index"]!r:.80} is not a list of [start, stop] '
      'pairs',
    )
  crc = _checksum(raw.get(checksum), f'the {checksum} of a shard', file)
  return tuple(index), crc


def _strings(value: Any) -> bool:
  return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _mesh_axes(raw: Any) -> MeshAxes | None:
  """The `MeshAxes` of a recorded mesh, or None if it is not one."""
  if not isinstance(raw, dict):
    return None
  names, sizes = raw.get('axis_names'), raw.get('axis_sizes')
  if (
    not _strings(names)
    or not isinstance(sizes, list)
    or len(sizes) != len(names)
    or not all(
      isinstance(s, int) and not isinstance(s, bool) and 0 < s < _MAX_INT
      for s in sizes
    )
  ):
    return None
  return MeshAxes(tuple(names), tuple(sizes))


def read_sharding(
  raw: Any, file: str, path: _names.Path
) -> ShardingRecord | str | None:
  """A variable's recorded sharding, checked once, as it is read.

  None or a display string (early flax_dtensor versions) is kept as it
  is; anything else must be what `sharding_record` writes.
  """
  if raw is None or isinstance(raw, str):
    return raw
  layout = raw.get('dtensor_layout') if isinstance(raw, dict) else None
  spec = raw.get('spec') if isinstance(raw, dict) else None
  kind = raw.get('kind') if isinstance(raw, dict) else None
  mesh = _mesh_axes(raw.get('mesh')) if isinstance(raw, dict) else None
  dtensor_mesh = (
    _mesh_axes(layout.get('mesh')) if isinstance(layout, dict) else None
  )
  dtensor_specs = (
    layout.get('sharding_specs') if isinstance(layout, dict) else None
  )
  if (
    kind not in ('named', 'single_device')
    or not isinstance(spec, list)
    or not all(_strings(d) for d in spec)
    or mesh is None
    or dtensor_mesh is None
    or not _strings(dtensor_specs)
  ):
    raise _malformed(
      file,
      f'the sharding of {list(path)!r:.80} is {raw!r:.200}, expected its '
      'kind, spec, mesh and dtensor_layout',
    )
  return ShardingRecord(
    kind=kind,
    spec=tuple(tuple(d) for d in spec),
    mesh=mesh,
    dtensor_specs=tuple(dtensor_specs),
    dtensor_mesh=dtensor_mesh,
  )


def _record(raw: Any, file: str, checksum: str, version: int) -> Record:
  if not isinstance(raw, dict):
    raise _malformed(file, f'a variable record is {raw!r:.80}')
  path = raw.get('path')
  if (
    not isinstance(path, list)
    or not path
    or not all(
      isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool))
      for k in path
    )
  ):
    raise _malformed(file, f'a variable path is {path!r:.80}')
  path = tuple(path)
  text = {}
  for name in ('key', 'type', 'dtype', 'stored_dtype', 'key_impl'):
    value = raw.get(name)
    if not isinstance(value, str) and not (
      value is None and name in ('key', 'type', 'stored_dtype', 'key_impl')
    ):
      raise _malformed(
        file, f'the {name} of {list(path)!r:.80} is {value!r:.80}'
      )
    text[name] = value
  shape = _int_list(raw.get('shape'), 'a shape', file)
  sharding = read_sharding(raw.get('sharding'), file, path)
  if version == 3:
    shards = _listed_shards(raw.get('shards', []), path, shape, checksum, file)
  else:
    shards = _grid_shards(
      raw.get('shards'), path, shape, sharding, checksum, file
    )
  try:
    key = text['key'] or _names.checkpoint_key(path)
  except (TypeError, ValueError) as e:
    raise _malformed(
      file, f'the path {list(path)!r:.80} is invalid: {e}'
    ) from e
  return Record(
    path=path,
    key=key,
    type=text['type'] or '-',
    dtype=text['dtype'],
    stored_dtype=text['stored_dtype'] or text['dtype'],
    shape=shape,
    key_impl=text['key_impl'],
    sharding=sharding,
    shards=shards,
  )


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
  out = {}
  for key, value in pairs:
    if key in out:
      raise ValueError(f'the key {key!r:.80} appears twice in one object')
    out[key] = value
  return out


def _no_constant(name: str) -> Any:
  raise ValueError(f'{name} is not a JSON number')


def _depth(value: Any) -> int:
  """How deep `value` nests (iteratively: a deep one breaks no stack)."""
  if type(value) is not dict and type(value) is not list:
    return 0
  deepest = 0
  todo = [(value, 1)]
  while todo:
    item, depth = todo.pop()
    deepest = max(deepest, depth)
    if depth > MAX_DEPTH:
      break
    items = item.values() if type(item) is dict else item
    todo.extend(
      (v, depth + 1) for v in items if type(v) is dict or type(v) is list
    )
  return deepest


def _load(file: str) -> Any:
  """The JSON document in `file`, strictly parsed, or our error."""
  try:
    with open(file, 'rb') as f:
      size = os.fstat(f.fileno()).st_size
      if size > MAX_BYTES:
        raise _malformed(
          file, f'it has {size} bytes, more than a manifest ({MAX_BYTES})'
        )
      # What fstat says, and a byte more to see it grew: `read(n)` first
      # allocates n bytes, whatever the file holds.
      data = f.read(size + 1)
  except FileNotFoundError as e:
    # `locate` saw the file an instant ago: the export is being replaced.
    raise _errors.SaveInProgressError(
      f'failed to read the manifest {file!r}: it vanished after it was '
      f'found ({e.strerror}). Expected the export to stay in place while '
      'it is read; another process may be replacing it. Retry once that '
      'write is done.'
    ) from e
  except OSError as e:
    raise _errors.ExportError(
      f'failed to read the manifest {file!r}: {type(e).__name__}: {e}. '
      'Expected a readable file. Check the path and its permissions.'
    ) from e
  if len(data) > MAX_BYTES:
    raise _malformed(file, f'it has more than {MAX_BYTES} bytes')
  try:
    text = data.decode('utf-8')
  except UnicodeDecodeError as e:
    raise _malformed(
      file, f'it is not UTF-8 ({e.reason} at byte {e.start})'
    ) from None
  try:
    raw = json.loads(
      text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant
    )
  except RecursionError:
    raise _malformed(file, 'it nests deeper than Python parses') from None
  except ValueError as e:
    raise _malformed(file, f'{type(e).__name__}: {e!s:.200}') from e
  if _depth(raw) > MAX_DEPTH:
    raise _malformed(file, f'it nests more than {MAX_DEPTH} levels deep')
  return raw


def _confined_name(name: Any, what: str, file: str) -> str:
  problem = _paths.name_problem(name)
  if problem is not None:
    raise _malformed(
      file,
      f'{what} {name!r:.120} is refused: {problem} (a manifest names paths '
      'relative to its export, normalized, without `..`, inside it)',
    )
  return name


def read(path: str) -> Manifest | None:
  """The manifest of the export at `path` (directory or prefix), or None.

  Reads only the manifest file, and only once it resolves inside its
  export. Every path it names (the checkpoint prefix, each file) must be
  relative, normalized and free of `..`; `verify_files` checks where they
  lead on disk.

  Raises:
    MalformedExportError: If the file is not a valid manifest, or it
      resolves outside its export (a symbolic link).
    SaveInProgressError: If it vanished once found (being replaced).
    ExportError: If the file is unreadable.
  """
  found = locate(path)
  if found is None:
    return None
  root, file = found
  escape = _paths.escape_problem(root, os.path.relpath(file, root))
  if escape is not None:
    raise _malformed(file, f'the manifest itself is refused: {escape}')
  raw = _load(file)
  if not isinstance(raw, dict):
    raise _malformed(file, f'the document is a {type(raw).__name__}')
  kind = raw.get('format')
  if kind not in (CHECKPOINT_FORMAT, SAVED_MODEL_FORMAT):
    raise _malformed(file, f'its format is {kind!r:.80}')
  version = raw.get('version')
  if isinstance(version, bool) or not isinstance(version, int):
    version = repr(version)[:80]
  if version not in READABLE:
    readable = ', '.join(map(str, READABLE))
    raise _malformed(
      file,
      f'its version is {version}; this flax_dtensor reads version '
      f'{readable} (version 2, without checksums, is not read: re-save the '
      'model with save_checkpoint or save_saved_model)',
    )
  checksum = READABLE[version]
  if raw.get('checksum', checksum) != checksum:
    raise _malformed(
      file,
      f'its checksum is {raw.get("checksum")!r:.80}; version {version} '
      f'uses {checksum!r}',
    )
  prefix = _confined_name(
    raw.get('checkpoint_prefix'), 'the checkpoint_prefix', file
  )
  variables = raw.get('variables')
  if not isinstance(variables, list):
    raise _malformed(file, '`variables` is not a list of records')
  records = tuple(_record(v, file, checksum, version) for v in variables)
  raw_files = raw.get('files')
  if not isinstance(raw_files, dict):
    raise _malformed(file, '`files` is not a dict')
  files = {}
  for name, s in raw_files.items():
    _confined_name(name, 'the file', file)
    size = s.get('bytes') if isinstance(s, dict) else None
    if isinstance(size, bool) or not isinstance(size, int):
      raise _malformed(file, f'the record of file {name!r} is {s!r:.80}')
    sums = _int_list(
      s.get(checksum), f'the {checksum} of {name}', file, bound=2**32
    )
    if not 0 <= size < _MAX_INT:
      raise _malformed(file, f'file {name!r} has {size} bytes')
    files[name] = FileSum(size, sums)
  keys = [r.key for r in records]
  if len(set(keys)) != len(keys):
    raise _malformed(file, 'two variables share a checkpoint key')
  signatures = _signatures(raw.get('signatures', {}), file)
  return Manifest(kind, version, root, prefix, files, records, signatures)


def is_export(directory: str) -> bool:
  """Whether `directory` is an export this package wrote, for itself.

  Its own manifest (not an enclosing export's) is valid and names it as
  its root. What the atomic layer (`_atomic`) asks before it replaces a
  directory, or moves an old export back into place.
  """
  try:
    manifest = read(directory)
  except _errors.ExportError:
    return False
  return manifest is not None and manifest.root == os.path.abspath(directory)


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


def damaged(
  manifest: Manifest,
  problems: list[str],
  *,
  read: bool = False,
  kind: type[_errors.ExportError] = _errors.DamagedExportError,
) -> _errors.ExportError:
  """The error naming what is wrong with an export's files.

  `kind` is `DamagedExportError` (bytes changed, a file truncated or
  missing) or `MalformedExportError` (a file outside the export or not in
  the manifest; a manifest that disagrees with TF's index).
  """
  shown = '; '.join(problems[:4]) + (
    f'; and {len(problems) - 4} more' if len(problems) > 4 else ''
  )
  if read:
    return kind(
      f'The export at {manifest.root!r} is damaged: {shown} (expected what '
      f'its manifest {manifest.location} records; found in the bytes read, '
      'so the files may also have changed during the read). Nothing was '
      'restored: the target is unchanged. Restore from an intact copy, or '
      're-export it; if another process was saving to that path, read again '
      'once it is done.'
    )
  return kind(
    f'The export at {manifest.root!r} is damaged: {shown} (expected what its '
    f'manifest {manifest.location} records). Nothing was read into '
    'TensorFlow. Restore from an intact copy, or re-export it.'
  )


_DATA = re.compile(r'\.data-(\d{5})-of-(\d{5})$')


def confinement_problems(manifest: Manifest) -> list[str]:
  """What breaks the rules of where an export's files may be, on disk.

  Every file the manifest lists must resolve inside the export (a symbolic
  link may point inside it, not out of it). TensorFlow's reader opens
  ``PREFIX.index`` and ``PREFIX.data-I-of-N`` for I < N: the manifest must
  list the index and every data file of one N, no other file on disk may
  match the prefix, and the prefix itself must not exist (TF would read a
  directory there as a checkpoint directory, following its ``checkpoint``
  file anywhere). Nothing is opened: only names and links are looked at.
  """
  problems = [
    f'{name} is refused: {escape}'
    for name, escape in _escapes(manifest).items()
  ]
  prefix = os.path.join(manifest.root, manifest.prefix)
  if os.path.lexists(prefix):
    problems.append(
      f'the checkpoint prefix {manifest.prefix} is a file or directory on '
      'disk (TensorFlow would read it as a checkpoint directory)'
    )
  base = os.path.basename(manifest.prefix)
  if f'{manifest.prefix}.index' not in manifest.files:
    problems.append(f'the manifest does not list {manifest.prefix}.index')
  counts = set()
  shards = set()
  for name in manifest.files:
    if name.startswith(f'{manifest.prefix}.data-'):
      match = _DATA.search(name[len(manifest.prefix) :])
      if match is None or match.start() != 0:
        problems.append(f'{name} is not a TF data file name')
        continue
      shards.add(int(match.group(1)))
      counts.add(int(match.group(2)))
  if len(counts) > 1 or (counts and shards != set(range(max(counts)))):
    problems.append(
      f'the data files listed for {manifest.prefix} are not one complete '
      f'set (shards {sorted(shards)} of {sorted(counts)})'
    )
  directory = os.path.dirname(prefix)
  try:
    present = os.listdir(directory)
  except OSError:
    present = []
  for entry in sorted(present):
    if entry.startswith(f'{base}.index') or entry.startswith(f'{base}.data-'):
      name = os.path.join(os.path.dirname(manifest.prefix), entry)
      if name not in manifest.files:
        problems.append(
          f'{name} is on disk but not in the manifest (TensorFlow may read '
          'it unverified)'
        )
  return problems


def _escapes(manifest: Manifest) -> dict[str, str]:
  """{name: why} of the prefix and files resolving outside the export."""
  out = {}
  for name in (manifest.prefix, *sorted(manifest.files)):
    escape = _paths.escape_problem(manifest.root, name)
    if escape is not None:
      out[name] = escape
  return out


def problems_of(
  manifest: Manifest, pool: concurrent.futures.Executor, *, data: bool = True
) -> list[str]:
  """Everything wrong with an export's files against its manifest.

  First where they are (`confinement_problems`); then the size and chunk
  checksums of every file, except those resolving outside the export: they
  are never opened. With `data=False`, TF's data files (`PREFIX.data-*`)
  are checked for their size only: a reader that checks every byte it
  reads (`verify_read`) need not read them twice.
  """
  problems = confinement_problems(manifest)
  outside = _escapes(manifest)
  jobs = []
  for name, expected in sorted(manifest.files.items()):
    if name in outside:
      continue
    path = os.path.join(manifest.root, name)
    try:
      size = os.path.getsize(path)
    except OSError:
      problems.append(f'{name} is missing')
      continue
    if size != expected.size:
      problems.append(f'{name} has {size} bytes, not {expected.size}')
      continue
    if not data and _DATA.search(name):
      continue
    chunks = _file_chunks(path, size)
    if len(chunks) != len(expected.crc32):
      problems.append(f'{name} has {len(chunks)} chunks recorded wrongly')
      continue
    for i, (offset, length) in enumerate(chunks):
      jobs.append(
        (
          name,
          offset,
          length,
          expected.crc32[i],
          pool.submit(_crc_chunk, path, offset, length),
        )
      )
  for name, offset, length, crc, future in jobs:
    try:
      got = future.result()
    except OSError as e:
      problems.append(f'{name} cannot be read ({e})')
      continue
    if got != crc:
      problems.append(
        f'{name} bytes {offset}..{offset + length} changed '
        f'(CRC-32 {got:08x}, recorded {crc:08x})'
      )
  return sorted(set(problems), key=problems.index)


def verify_files(
  manifest: Manifest, pool: concurrent.futures.Executor, *, data: bool = True
) -> None:
  """Checks where every file is, then its size and CRCs, before TF reads.

  With `data=False` the data files' contents are left to the read, which
  checks every byte it reads (TF's index and every other file are still
  checked whole first).

  Raises:
    MalformedExportError: Naming every file outside the export or
      unlisted (and any other problem found), if there is one.
    DamagedExportError: Naming every file missing, resized or changed.
  """
  problems = problems_of(manifest, pool, data=data)
  if problems:
    untrusted = bool(confinement_problems(manifest))
    raise damaged(
      manifest,
      problems,
      kind=(
        _errors.MalformedExportError
        if untrusted
        else _errors.DamagedExportError
      ),
    )


def verify_index(
  manifest: Manifest, shapes: Mapping[str, Any], dtypes: Mapping[str, Any]
) -> None:
  """Checks TF's index (key -> shape, dtype) against the manifest.

  Raises:
    MalformedExportError: If a variable is missing on either side, or its
      shape or stored dtype differs.
  """
  import numpy as np

  from flax_dtensor.dtensor._layout import _dtypes

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
    raise damaged(manifest, problems, kind=_errors.MalformedExportError)


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
  in the saved dtype: whole saved shards (a box of whole blocks of the
  grid, `ShardGrid.hull`), each of which is hashed (`crc`) and compared. A
  slice that is not whole blocks is refused.

  Raises:
    DamagedExportError: If a shard's bytes differ from what was saved.
    MalformedExportError: If a slice read is not made of whole shards.
  """
  import numpy as np

  grid = record.shards
  for held, data in read.items():
    if not grid.aligned(held):
      raise damaged(
        manifest,
        [
          f'the shards recorded for {_names.path_text(record.path)} do not '
          f'cover [{_grid.text(held)}] whole, so its bytes cannot be checked'
        ],
        read=True,
        kind=_errors.MalformedExportError,
      )
    data = np.asarray(data)
    if held == grid.whole and len(grid) == 1:
      _check_shard(manifest, record, held, grid.crcs[0], data, held)
      continue
    for index, expected in grid.inside(held):
      _check_shard(manifest, record, index, expected, data, held)


def _check_shard(
  manifest: Manifest,
  record: Record,
  index: Index,
  expected: int,
  data: Any,
  held: Index,
) -> None:
  got = crc(data[_index.local(index, held)])
  if got != expected:
    raise damaged(
      manifest,
      [
        f'{_names.path_text(record.path)}[{_grid.text(index)}] read back '
        f'with CRC-32 {got:08x}, recorded {expected:08x}'
      ],
      read=True,
    )
