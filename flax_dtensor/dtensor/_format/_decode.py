"""Reading the manifest: an untrusted JSON document, checked as it is read.

`read` is the one reader (restore, `read_checkpoint` and the CLI use
it), strict about the document's shape, its size and depth, and the
paths it names (each record checked once, its sharding a
`_model.ShardingRecord`, its shards the grid its layout implies); every
problem is our `MalformedExportError`. `locate` finds an export's
manifest, `is_export` says whether a directory is one. Reading imports
neither JAX nor TensorFlow: the command line's ``inspect`` shows an
export from its manifest alone.
"""

from __future__ import annotations

import json
import os
from typing import Any

from flax_dtensor import _errors
from flax_dtensor.dtensor._conversion import _names
from flax_dtensor.dtensor._format import _grid, _model, _paths

# What a manifest may be: at most this large, and nested this deep.
MAX_BYTES = 256 * 2**20
MAX_DEPTH = 64
# Sizes, shapes and offsets are below this; checksums are 32-bit.
_MAX_INT = 2**63


def locate(path: str) -> tuple[str, str] | None:
  """(root, manifest file) for an export directory or a checkpoint prefix."""
  here = os.path.abspath(path)
  candidates = [
    (here, os.path.join(here, _model.FILE)),
    (here, os.path.join(here, _model.SAVED_MODEL_ASSETS, _model.FILE)),
  ]
  parent = os.path.dirname(here)  # `path` is a prefix: root/ckpt.
  candidates += [
    (parent, os.path.join(parent, _model.FILE)),
    (
      os.path.dirname(parent),  # root/variables/variables.
      os.path.join(
        os.path.dirname(parent), _model.SAVED_MODEL_ASSETS, _model.FILE
      ),
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
  sharding: _model.ShardingRecord | str | None,
  checksum: str,
  file: str,
) -> _grid.ShardGrid:
  """Version 4's shards: the grid its layout implies, and their CRCs."""
  name = _names.path_text(path)
  if not isinstance(sharding, _model.ShardingRecord):
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
    implied = _model.blocks_of(sharding, shape)
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


def _layout_text(sharding: _model.ShardingRecord) -> str:
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


def _mesh_axes(raw: Any) -> _model.MeshAxes | None:
  """The `_model.MeshAxes` of a recorded mesh, or None if it is not one."""
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
  return _model.MeshAxes(tuple(names), tuple(sizes))


def read_sharding(
  raw: Any, file: str, path: _names.Path
) -> _model.ShardingRecord | str | None:
  """A variable's recorded sharding, checked once, as it is read.

  None or a display string (early flax_dtensor versions) is kept as it
  is; anything else must be what `_encode.sharding_record` writes.
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
  return _model.ShardingRecord(
    kind=kind,
    spec=tuple(tuple(d) for d in spec),
    mesh=mesh,
    dtensor_specs=tuple(dtensor_specs),
    dtensor_mesh=dtensor_mesh,
  )


def _record(raw: Any, file: str, checksum: str, version: int) -> _model.Record:
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
  return _model.Record(
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


def read(path: str) -> _model.Manifest | None:
  """The manifest of the export at `path` (directory or prefix), or None.

  Reads only the manifest file, and only once it resolves inside its
  export. Every path it names (the checkpoint prefix, each file) must be
  relative, normalized and free of `..`; `_verify.verify_files` checks
  where they lead on disk.

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
  if kind not in (_model.CHECKPOINT_FORMAT, _model.SAVED_MODEL_FORMAT):
    raise _malformed(file, f'its format is {kind!r:.80}')
  version = raw.get('version')
  if isinstance(version, bool) or not isinstance(version, int):
    version = repr(version)[:80]
  if version not in _model.READABLE:
    readable = ', '.join(map(str, _model.READABLE))
    raise _malformed(
      file,
      f'its version is {version}; this flax_dtensor reads version '
      f'{readable} (version 2, without checksums, is not read: re-save the '
      'model with save_checkpoint or save_saved_model)',
    )
  checksum = _model.READABLE[version]
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
    files[name] = _model.FileSum(size, sums)
  keys = [r.key for r in records]
  if len(set(keys)) != len(keys):
    raise _malformed(file, 'two variables share a checkpoint key')
  signatures = _signatures(raw.get('signatures', {}), file)
  return _model.Manifest(
    kind, version, root, prefix, files, records, signatures
  )


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


def _signatures(raw: Any, file: str) -> dict[str, _model.Signature]:
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
    out[str(name)] = _model.Signature(**sides)
  return out


def _tensor_spec(raw: Any, file: str, signature: str) -> _model.TensorSpec:
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
  return _model.TensorSpec(None if shape is None else tuple(shape), dtype)
