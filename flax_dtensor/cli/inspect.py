"""``flax-dtensor inspect``: what an export holds, from its manifest.

Each variable's type, shape, dtype, JAX sharding and the DTensor layout it
was written with, and a SavedModel's signatures, come from the manifest
(`_decode.read`), read without JAX or TensorFlow. Only an export without
one (a checkpoint written by plain TensorFlow) is read with TensorFlow.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence
from typing import Annotated, Any

import typer

from flax_dtensor import _text
from flax_dtensor._rules import _partition_specs
from flax_dtensor.cli import _command, _run_folder


def sharding_texts(record: Any) -> tuple[str, str]:
  """(JAX sharding, DTensor layout) texts of a flax_dtensor.json record.

  The record is the ``sharding`` of a variable as `_decode.read` checked
  it (a `_model.ShardingRecord`: the JAX spec as mesh axes per
  dimension, the JAX mesh, and the DTensor layout it was written with),
  e.g. ``P('data', 'model') @ data=2,model=4`` and
  ``data,model @ data=2,model=4``. A dimension over two JAX axes is on a
  fused DTensor axis: ``P(('data', 'model'), None) @ data=2,model=4`` and
  ``data+model,unsharded @ data+model=8``. A record of an older
  flax_dtensor (a display string) is shown as it is, with no DTensor
  layout; a missing one as '-'.
  """
  if record is None or isinstance(record, str):
    return (record or '-'), '-'
  if record.kind == 'single_device':
    jax_text = 'one device'
  else:
    jax_text = (
      f'{_partition_specs.format_spec(record.spec)} @ {record.mesh.text()}'
    )
  specs = ','.join(record.dtensor_specs) or 'scalar'
  return jax_text, f'{specs} @ {record.dtensor_mesh.text()}'


def _read_manifest(path: pathlib.Path) -> Any:
  """The manifest of the export in `path` itself, or None."""
  from flax_dtensor import _errors
  from flax_dtensor.dtensor._format import _decode

  try:
    manifest = _decode.read(str(path))
  except _errors.ExportError as e:
    raise _command.BadInputError(str(e)) from e
  if manifest is None or manifest.root != os.path.abspath(path):
    return None
  return manifest


_LAYOUT_CAPTION = (
  'JAX sharding: the PartitionSpec @ the JAX mesh. DTensor layout: one '
  'sharding spec per dimension @ the DTensor mesh (an axis a+b fuses JAX '
  'axes a and b). From flax_dtensor.json.'
)

# One row of the variables: (variable, type, shape, dtype, JAX sharding,
# DTensor layout).
Row = tuple[str, str, str, str, str, str]
_VARIABLE_COLUMNS = (
  'variable',
  'type',
  'shape',
  'dtype',
  'JAX sharding',
  'DTensor layout',
)


def _manifest_rows(manifest: Any) -> list[Row]:
  from flax_dtensor.dtensor._conversion import _names

  rows = []
  for record in sorted(manifest.records, key=lambda r: r.key):
    dtype = record.dtype
    if dtype != record.stored_dtype:
      dtype = f'{dtype} (stored as {record.stored_dtype})'
    jax_text, dtensor_text = sharding_texts(record.sharding)
    rows.append(
      (
        _names.path_text(record.path),
        record.type,
        str(record.shape),
        dtype,
        jax_text,
        dtensor_text,
      )
    )
  return rows


def _tf_rows(items: Any) -> list[Row]:
  """Rows of (NNX path, shape, stored dtype) read by TF: no layouts."""
  from flax_dtensor.dtensor._conversion import _names

  return [
    (_names.path_text(p), '-', str(tuple(shape)), dtype, '-', '-')
    for p, shape, dtype in items
  ]


def inspect_checkpoint(path: pathlib.Path, width: int) -> list[Any]:
  """What to print for a DTensor checkpoint: a title, its variables."""
  manifest = _read_manifest(path)
  if manifest is not None:
    rows = _manifest_rows(manifest)
    caption = _LAYOUT_CAPTION
  else:
    rows = _tf_rows(_read_with_tf(path))
    caption = 'No flax_dtensor.json: no layouts; read with TensorFlow.'
  return [
    *_title('DTensor checkpoint', path, width),
    *_variables(rows, width),
    _caption(f'{_count(len(rows), "variable")}. {caption}'),
  ]


def _read_with_tf(path: pathlib.Path) -> list[tuple[Any, Any, str]]:
  from flax_dtensor.dtensor import _tf
  from flax_dtensor.dtensor._conversion import _names

  tf = _tf.tf()
  try:
    reader = tf.train.load_checkpoint(str(path))
  except Exception as e:
    raise _command.BadInputError(
      f'TensorFlow cannot read the checkpoint in {str(path)!r}: '
      f'{_command.one_line(str(e))[:200]}. Pass a directory written by '
      '`flax-dtensor export` or `flax-dtensor demo`.'
    ) from e
  from flax_dtensor.dtensor._checkpoints import _from_tf_files

  shapes = reader.get_variable_to_shape_map()
  dtypes = reader.get_variable_to_dtype_map()
  # By NNX path where the object graph says it (a SavedModel TF saved
  # again keys them its own way), else by TF's own name (a plain TF model).
  by_graph = _from_tf_files.paths_of_keys(reader, str(path))
  rows = []
  for key in sorted(shapes):
    if key == _names.OBJECT_GRAPH_KEY:
      continue
    found = _names.nnx_path(key) or by_graph.get(key)
    if found is None:
      found = (key.removesuffix(_names.ATTRIBUTES_SUFFIX),)
    rows.append((found, shapes[key], dtypes[key].name))
  return sorted(rows, key=lambda r: _names.path_text(r[0]))


def _versions(base: pathlib.Path) -> list[pathlib.Path]:
  """The SavedModels under TF Serving's base path `base` (``base/<N>``), by
  version number."""
  if not base.is_dir():
    return []
  found = [
    p
    for p in base.iterdir()
    if p.name.isdecimal() and (p / 'saved_model.pb').is_file()
  ]
  return sorted(found, key=lambda p: int(p.name))


def inspect_saved_model(path: pathlib.Path, width: int) -> list[Any]:
  """What to print for a SavedModel: its signatures and its variables."""
  from flax_dtensor import _text

  manifest = _read_manifest(path)
  signatures = dict(manifest.signatures) if manifest is not None else {}
  rows: list[Row] = []
  if manifest is None or not signatures:
    # No manifest, or one of an earlier flax_dtensor without signatures.
    loaded_signatures, variables = _load_with_tf(path)
    signatures = signatures or loaded_signatures
    if manifest is None:
      rows = _tf_rows(variables)
  if manifest is not None:
    rows = _manifest_rows(manifest)
    caption = _LAYOUT_CAPTION.replace(
      'flax_dtensor.json', 'assets/flax_dtensor.json'
    )
  else:
    caption = 'No assets/flax_dtensor.json: no layouts.'
  signature_rows = [
    (
      name,
      '\n'.join(f'{k}: {t.text()}' for k, t in sorted(sig.inputs.items())),
      '\n'.join(f'{k}: {t.text()}' for k, t in sorted(sig.outputs.items())),
    )
    for name, sig in sorted(signatures.items())
  ]
  return [
    *_title('SavedModel', path, width, 'signatures'),
    _text.table_or_stacked(
      ('signature', 'inputs', 'outputs'), signature_rows, width
    ),
    *_title('SavedModel', path, width, 'variables'),
    *_variables(rows, width),
    _caption(f'{_count(len(rows), "variable")}. {caption}'),
  ]


def _load_with_tf(path: pathlib.Path) -> tuple[dict[str, Any], list[Any]]:
  """(signatures, [(NNX path, shape, dtype)]) of a SavedModel, as TF has them.

  Read from its files, never loaded: `saved_model.pb` is parsed for the
  signatures and the variables' checkpoint index for their shapes, so no
  graph of the SavedModel runs (`tf.saved_model.load` would restore its
  functions).
  """
  from flax_dtensor.dtensor._serving import _saved_model

  try:
    signatures = _saved_model.written_signatures(str(path))
  except Exception as e:  # A protobuf error, a missing file, no graph.
    raise _command.BadInputError(
      f'TensorFlow cannot parse the SavedModel in {str(path)!r}: '
      f'{_command.one_line(str(e))[:200] or "an empty file"}. Expected '
      'saved_model.pb with one MetaGraph. Pass a directory written by '
      '`save_saved_model`, `flax-dtensor export --saved-model` or '
      '`flax-dtensor demo`.'
    ) from e
  return signatures, _read_with_tf(path / 'variables' / 'variables')


def verify_export(
  kind: str, path: pathlib.Path, width: int
) -> tuple[list[Any], bool]:
  """(What to print, whether intact) for `inspect --verify` of one export.

  Checks where every file the manifest names leads and every file's size
  and checksums (`_verify.problems_of`), without JAX or TensorFlow.
  """
  import concurrent.futures

  import rich.text

  from flax_dtensor.dtensor._format import _checksums, _verify

  what = 'DTensor checkpoint' if kind == 'checkpoint' else 'SavedModel'
  manifest = _read_manifest(path)
  if manifest is None:
    raise _command.BadInputError(
      f'{str(path)!r} holds no flax_dtensor manifest, so there is nothing to '
      'verify it against. Only exports written by flax_dtensor can be '
      'verified.'
    )
  with concurrent.futures.ThreadPoolExecutor(_checksums.THREADS) as pool:
    problems = _verify.problems_of(manifest, pool)
  title = _title(what, path, width)
  if not problems:
    size = _text.human_bytes(sum(f.size for f in manifest.files.values()))
    text = (
      f'intact: {_count(len(manifest.files), "file")}, {size}, checked '
      f'against {manifest.location}'
    )
    return [*title, rich.text.Text(text)], True
  lines = [
    rich.text.Text(f'damaged: {_count(len(problems), "problem")}'),
    *(
      # Paths in a problem break only after a '/', never inside a name.
      rich.text.Text(
        '\n'.join(_text.wrap_words(f'- {p}', width, hanging=2)),
        no_wrap=True,
        overflow='ignore',
      )
      for p in problems
    ),
  ]
  return [*title, *lines], False


def inspect_steps(
  directory: pathlib.Path, width: int, verify: bool
) -> tuple[list[Any], bool]:
  """(What to print, whether intact) for a `CheckpointManager`'s folder:
  each step, its size, and whether it is whole; with `verify`, each whole
  step checked against its manifest too."""
  import rich.box
  import rich.table
  import rich.text

  from flax_dtensor.dtensor._storage import _steps

  folders = _steps.folders(str(directory))
  whole = [f for f in folders if f.whole]
  named = _steps.latest_named(str(directory))
  latest = whole[-1].step if whole else None
  title = _title(
    'Checkpoints by step',
    directory,
    width,
    f'{_count(len(whole), "whole step")}'
    + (f', latest {latest}' if latest is not None else ''),
  )
  table = rich.table.Table(box=rich.box.SIMPLE_HEAD, pad_edge=False)
  for column in ('step', 'size', 'state'):
    table.add_column(column, justify='right' if column != 'state' else 'left')
  intact = True
  lines: list[Any] = []
  for folder in folders:
    if not folder.whole:
      state = (
        'not whole: being written, or left by a save that was stopped '
        '(the next save or restore of this step removes it)'
      )
    else:
      notes = ['whole']
      if folder.step == named:
        notes.append("latest (TensorFlow's checkpoint file names it)")
      state = ', '.join(notes)
      if verify:
        found, ok = verify_export('checkpoint', directory / folder.name, width)
        intact = intact and ok
        lines += found
    table.add_row(folder.name, _text.human_bytes(folder.bytes), state)
  if latest is not None and named != latest:
    lines.append(
      rich.text.Text(
        f"TensorFlow's checkpoint file names step {named}, not the latest "
        f'whole step {latest}: the manager writes it once a step is kept '
        '(a save was stopped in between).'
      )
    )
  return [*title, table, *lines], intact


# Printing
# ------------------------------------------------------------------------------


def _count(n: int, noun: str) -> str:
  from flax_dtensor import _text

  return _text.count(n, noun)


def _title(
  what: str, path: pathlib.Path, width: int, part: str = ''
) -> list[Any]:
  """'WHAT PATH[: PART]' in bold; a long path on lines of its own."""
  import rich.text

  from flax_dtensor import _text

  suffix = f': {part}' if part else ''
  text = f'{what} {path}{suffix}'
  if len(text) <= width:
    return [rich.text.Text(text, style='bold')]
  lines = [what, *_text.wrap_path(f'{path}{suffix}', width)]
  return [rich.text.Text(line, style='bold') for line in lines]


def _caption(text: str) -> Any:
  import rich.text

  return rich.text.Text(text, style='dim')


def _common_mesh(cells: Sequence[str]) -> str | None:
  """The mesh more than half the cells of a column are on
  ('data=2,model=4'), if one is."""
  meshes = [c.rsplit(' @ ', 1)[1] for c in cells if ' @ ' in c]
  for mesh in dict.fromkeys(meshes):
    if 2 * meshes.count(mesh) > len(cells):
      return mesh
  return None


def mesh_once(rows: Sequence[Row]) -> tuple[list[Row], str | None]:
  """(`rows` without the common meshes, the line that names them once).

  Each sharding column's mesh (that of more than half its rows) is named
  above the table
  ('JAX mesh data=2,model=4; DTensor mesh data=2,model=4') and left out
  of its cells; a cell on another mesh keeps its ``@ mesh``.
  """
  jax_mesh = _common_mesh([r[4] for r in rows])
  dtensor_mesh = _common_mesh([r[5] for r in rows])

  def strip(cell: str, mesh: str | None) -> str:
    if mesh is not None and cell.endswith(f' @ {mesh}'):
      return cell[: -len(f' @ {mesh}')]
    return cell

  out = [
    (*r[:4], strip(r[4], jax_mesh), strip(r[5], dtensor_mesh)) for r in rows
  ]
  parts = []
  if jax_mesh is not None:
    parts.append(f'JAX mesh {jax_mesh}')
  if dtensor_mesh is not None:
    parts.append(f'DTensor mesh {dtensor_mesh}')
  if not parts:
    return list(rows), None
  others = any(
    ' @ ' in r[4] or ' @ ' in r[5] for r in out
  )  # A variable on another mesh says it.
  line = '; '.join(parts) + (' (others in their rows)' if others else '')
  return out, line


def _variables(rows: Sequence[Row], width: int) -> list[Any]:
  """The variables' table (or stacked lines): the meshes named once above
  it, and the type too when every variable has the same."""
  import rich.box
  import rich.text

  from flax_dtensor import _text

  rows, meshes = mesh_once(rows)
  lines = [] if meshes is None else [meshes]
  columns = list(_VARIABLE_COLUMNS)
  kinds = {r[1] for r in rows}
  table_rows: list[Sequence[str]] = list(rows)
  if len(kinds) == 1 and '-' not in kinds:
    lines.append(f'Every variable is a {next(iter(kinds))}.')
    columns.remove('type')
    table_rows = [(r[0], *r[2:]) for r in rows]

  def details(row: Sequence[str]) -> list[str]:
    cells = dict(zip(columns, row, strict=True))
    first = '  '.join(
      cells[c] for c in ('type', 'shape', 'dtype') if c in cells
    )
    return [
      first,
      f'JAX      {cells["JAX sharding"]}',
      f'DTensor  {cells["DTensor layout"]}',
    ]

  return [
    *(rich.text.Text(line) for line in lines),
    _text.table_or_stacked(
      columns,
      table_rows,
      width,
      paths=('variable',),
      details=details,
      box=rich.box.SIMPLE_HEAD,
    ),
  ]


def inspect(
  directory: Annotated[
    pathlib.Path,
    typer.Argument(
      metavar='DIR',
      help=(
        'A directory written by `export` or `demo` (holding checkpoint/ '
        'and saved_model/), one checkpoint or SavedModel directory, or a '
        "CheckpointManager's directory (one folder per step)."
      ),
      show_default=False,
    ),
  ],
  verify: Annotated[
    bool,
    typer.Option(
      '--verify',
      help=(
        'Check every file against the manifest (sizes, checksums, and that '
        'no path leaves the directory), and that the parts of an output '
        'folder come from one run, instead of listing the variables. Exit 0 '
        'intact, 1 damaged or mixed (each problem listed), 2 no or a '
        'malformed manifest.'
      ),
    ),
  ] = False,
  debug: _command.DebugOption = False,
) -> None:
  """List every variable's name, shape, dtype and DTensor layout.

  A CheckpointManager's directory is listed by step instead: each step's
  size and whether it is whole (with `--verify`, each checked too).

  Everything comes from the manifest (flax_dtensor.json) an export writes
  next to a checkpoint, or in a SavedModel's assets: the layouts (the JAX
  PartitionSpec and mesh, and the DTensor layout written, whose mesh axis
  a+b fuses JAX axes a and b) and a SavedModel's serving signatures. It is
  read without JAX or TensorFlow; a checkpoint without one (written by
  plain TensorFlow) is read with TensorFlow. The manifest is shown, not
  checked: restoring verifies the data against it, and so does `--verify`
  (without JAX or TensorFlow), e.g. on a download before trusting it.
  """
  with _command.handle_errors(debug):
    if not directory.is_dir():
      raise _command.BadInputError(
        f'{str(directory)!r} is not a directory. Pass a directory written '
        'by `flax-dtensor export` or `flax-dtensor demo`.'
      )
    from flax_dtensor.dtensor._storage import _steps

    if _steps.is_manager_folder(str(directory)):
      console = _command.console()
      lines, intact = inspect_steps(directory, console.width, verify)
      for item in lines:
        console.print(item, highlight=False)
      if not intact:
        raise typer.Exit(_command.EXIT_FINDINGS)
      return
    found: list[tuple[str, pathlib.Path]] = []
    for candidate in (directory, directory / 'checkpoint'):
      if (candidate / 'checkpoint').is_file() or any(candidate.glob('*.index')):
        found.append(('checkpoint', candidate))
        break
    for candidate in (directory, directory / 'saved_model'):
      if (candidate / 'saved_model.pb').is_file():
        found.append(('saved_model', candidate))
        break
      versions = _versions(candidate)
      if versions:  # TF Serving's base path (`export --version`).
        found.extend(('saved_model', v) for v in versions)
        break
    if not found:
      raise _command.BadInputError(
        f'{str(directory)!r} holds no TF checkpoint or SavedModel. Pass a '
        'directory written by `flax-dtensor export` or `flax-dtensor demo`.'
      )
    console = _command.console()
    if verify:
      intact = True
      for kind, path in found:
        lines, ok = verify_export(kind, path, console.width)
        intact = intact and ok
        for item in lines:
          console.print(item, highlight=False)
      if any(path != directory for _, path in found):
        # An output folder of demo or export: are its parts one run's?
        mixed = _run_folder.problems(directory)
        for item in _title('Output folder', directory, console.width):
          console.print(item, highlight=False)
        console.print(
          '\n'.join(mixed) or 'one run: every part carries the same identifier'
          if any(
            _run_folder.run_of(directory / p) for p in os.listdir(directory)
          )
          else 'no run identifiers (written by an older flax-dtensor)',
          highlight=False,
          markup=False,
        )
        intact = intact and not mixed
      if not intact:
        raise typer.Exit(_command.EXIT_FINDINGS)
      return
    for kind, path in found:
      view = inspect_checkpoint if kind == 'checkpoint' else inspect_saved_model
      for item in view(path, console.width):
        console.print(item, highlight=False)
