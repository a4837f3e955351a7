"""``flax-dtensor inspect``: what an export holds, read with TensorFlow.

The tables show each variable's type, shape, dtype, JAX sharding and the
DTensor layout it was written with, from the manifest (`_manifest.read`).
"""

from __future__ import annotations

import pathlib
from typing import Annotated, Any

import rich.table
import typer

from flax_dtensor import _specs
from flax_dtensor.cli import _command


def _axes_text(mesh: dict[str, Any]) -> str:
  names, sizes = mesh.get('axis_names', []), mesh.get('axis_sizes', [])
  return ','.join(f'{n}={s}' for n, s in zip(names, sizes, strict=True))


def sharding_texts(record: Any) -> tuple[str, str]:
  """(JAX sharding, DTensor layout) texts of a flax_dtensor.json record.

  The record is the structured ``sharding`` of a variable (the JAX spec as
  mesh axes per dimension, the JAX mesh, and the DTensor layout it was
  written with), e.g. ``P('data', 'model') @ data=2,model=4`` and
  ``data,model @ data=2,model=4``. A dimension over two JAX axes is on a
  fused DTensor axis: ``P(('data', 'model'), None) @ data=2,model=4`` and
  ``data+model,unsharded @ data+model=8``. A record of an older
  flax_dtensor (a display string) is shown as it is, with no DTensor
  layout; a missing one as '-'.
  """
  if not isinstance(record, dict):
    return (str(record) if record else '-'), '-'
  try:
    if record['kind'] == 'single_device':
      jax_text = 'one device'
    else:
      spec = _specs.format_spec(_specs.from_axes(record['spec']))
      jax_text = f'{spec} @ {_axes_text(record["mesh"])}'
    layout = record['dtensor_layout']
    specs = ','.join(layout['sharding_specs']) or 'scalar'
    dtensor_text = f'{specs} @ {_axes_text(layout["mesh"])}'
  except (KeyError, TypeError, ValueError) as e:
    raise _command.BadInputError(
      f'Malformed sharding record in flax_dtensor.json: {record!r:.200} '
      f'({type(e).__name__}: {e}). Re-export the checkpoint.'
    ) from e
  return jax_text, dtensor_text


def _read_manifest(path: pathlib.Path) -> dict[str, Any]:
  """{variable path text: manifest record}, or {} without a manifest."""
  from flax_dtensor import _errors  # pylint: disable=g-import-not-at-top
  from flax_dtensor.dtensor import _manifest, _names  # pylint: disable=g-import-not-at-top

  try:
    manifest = _manifest.read(str(path))
  except _errors.ExportError as e:
    raise _command.BadInputError(str(e)) from e
  if manifest is None or manifest.root != str(path.absolute()):
    return {}
  return {_names.path_text(r.path): r for r in manifest.records}


_LAYOUT_CAPTION = (
  'JAX sharding: the PartitionSpec @ the JAX mesh. DTensor layout: one '
  'sharding spec per dimension @ the DTensor mesh (an axis a+b fuses JAX '
  'axes a and b). From flax_dtensor.json.'
)


def inspect_checkpoint(path: pathlib.Path) -> rich.table.Table:
  """A table of a DTensor checkpoint's variables, read with TensorFlow."""
  from flax_dtensor import dtensor  # pylint: disable=g-import-not-at-top
  from flax_dtensor.dtensor import _tf  # pylint: disable=g-import-not-at-top

  tf = _tf.tf()
  metadata = _read_manifest(path)
  try:
    reader = tf.train.load_checkpoint(str(path))
  except Exception as e:
    raise _command.BadInputError(
      f'TensorFlow cannot read the checkpoint in {str(path)!r}: '
      f'{_command.one_line(str(e))[:200]}. Pass a directory written by '
      '`flax-dtensor export` or `flax-dtensor demo`.'
    ) from e
  shapes = reader.get_variable_to_shape_map()
  dtypes = reader.get_variable_to_dtype_map()
  rows = [
    (dtensor.nnx_path(key), tuple(shapes[key]), dtypes[key].name)
    for key in sorted(shapes)
    if dtensor.nnx_path(key) is not None
  ]
  return _variables_table(
    f'DTensor checkpoint {path}', rows, metadata, _LAYOUT_CAPTION
  )


def _variables_table(
  title: str,
  rows: list[tuple[Any, tuple[int, ...], str]],
  metadata: dict[str, Any],
  caption: str,
) -> rich.table.Table:
  """One row per (NNX path, shape, stored dtype), with the manifest's say."""
  from flax_dtensor.dtensor import _names  # pylint: disable=g-import-not-at-top

  table = rich.table.Table(title=title, title_justify='left')
  for column in _VARIABLE_COLUMNS:
    # Narrow terminals wrap a cell; nothing is ever cut to an ellipsis.
    table.add_column(column, overflow='fold')
  for nnx_path, shape, stored in rows:
    name = _names.path_text(nnx_path)
    table.add_row(name, *_variable_row(metadata.get(name), shape, stored))
  table.caption = f'{len(rows)} variables. {caption}'
  return table


_VARIABLE_COLUMNS = (
  'variable',
  'type',
  'shape',
  'dtype',
  'JAX sharding',
  'DTensor layout',
)


def _variable_row(
  record: Any, shape: tuple[int, ...], stored: str
) -> tuple[str, ...]:
  """type, shape, dtype, JAX sharding and DTensor layout cells."""
  if record is None:
    return ('-', str(shape), stored, '-', '-')
  dtype = record.dtype
  if dtype != stored:
    dtype = f'{dtype} (stored as {stored})'
  jax_text, dtensor_text = sharding_texts(record.sharding)
  return (record.type, str(shape), dtype, jax_text, dtensor_text)


def inspect_saved_model(path: pathlib.Path) -> list[rich.table.Table]:
  """Tables of a SavedModel's signatures and variables, read with TF."""
  from flax_dtensor import dtensor  # pylint: disable=g-import-not-at-top
  from flax_dtensor.dtensor import _tf  # pylint: disable=g-import-not-at-top

  tf = _tf.tf()
  try:
    loaded = tf.saved_model.load(str(path))
  except Exception as e:
    raise _command.BadInputError(
      f'TensorFlow cannot load the SavedModel in {str(path)!r}: '
      f'{_command.one_line(str(e))[:200]}. Pass a directory written by '
      '`flax-dtensor export --saved-model` or `flax-dtensor demo`.'
    ) from e
  signatures = rich.table.Table(
    title=f'SavedModel {path}: signatures', title_justify='left'
  )
  for column in ('signature', 'inputs', 'outputs'):
    signatures.add_column(column, overflow='fold')

  def describe(specs: Any) -> str:
    return '\n'.join(
      f'{k}: {list(s.shape)} {s.dtype.name}' for k, s in sorted(specs.items())
    )

  for name, fn in sorted(loaded.signatures.items()):
    signatures.add_row(
      name,
      describe(fn.structured_input_signature[1]),
      describe(fn.structured_outputs),
    )
  metadata = _read_manifest(path)
  rows = [
    (nnx_path, tuple(v.shape), v.dtype.name)
    for nnx_path, v in dtensor.flat_variables(loaded).items()
  ]
  caption = (
    _LAYOUT_CAPTION.replace('flax_dtensor.json', 'assets/flax_dtensor.json')
    if metadata
    else 'No assets/flax_dtensor.json: no layouts.'
  )
  return [
    signatures,
    _variables_table(f'SavedModel {path}: variables', rows, metadata, caption),
  ]


def inspect(
  directory: Annotated[
    pathlib.Path,
    typer.Argument(
      help=(
        'A directory written by `export` or `demo` (holding checkpoint/ '
        'and saved_model/), or one checkpoint or SavedModel directory.'
      ),
      show_default=False,
    ),
  ],
  debug: Annotated[
    bool, typer.Option('--debug', help=_command.DEBUG_HELP)
  ] = False,
) -> None:
  """List every variable's name, shape, dtype and DTensor layout.

  Read with TensorFlow (plain TF, no JAX involved in reading). The layouts
  (JAX PartitionSpec and mesh, and the DTensor layout written, whose mesh
  axis a+b fuses JAX axes a and b) come from the flax_dtensor.json next to
  a checkpoint, or in a SavedModel's assets; a SavedModel also shows its
  serving signatures.
  """
  with _command.handle_errors(debug):
    if not directory.is_dir():
      raise _command.BadInputError(
        f'{str(directory)!r} is not a directory. Pass a directory written '
        'by `flax-dtensor export` or `flax-dtensor demo`.'
      )
    found: list[tuple[str, pathlib.Path]] = []
    for candidate in (directory, directory / 'checkpoint'):
      if (candidate / 'checkpoint').is_file() or any(candidate.glob('*.index')):
        found.append(('checkpoint', candidate))
        break
    for candidate in (directory, directory / 'saved_model'):
      if (candidate / 'saved_model.pb').is_file():
        found.append(('saved_model', candidate))
        break
    if not found:
      raise _command.BadInputError(
        f'{str(directory)!r} holds no TF checkpoint or SavedModel. Pass a '
        'directory written by `flax-dtensor export` or `flax-dtensor demo`.'
      )
    console = _command.console()
    for kind, path in found:
      if kind == 'checkpoint':
        console.print(inspect_checkpoint(path))
      else:
        for table in inspect_saved_model(path):
          console.print(table)
