"""``flax-dtensor export``: an Orbax checkpoint, onto a mesh, to TensorFlow."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pathlib
import time
from collections.abc import Iterator, Sequence
from typing import Annotated, Any

import typer

from flax_dtensor.cli import _command, _loading, _options, _parsing, _served


def export(
  target: Annotated[
    str,
    typer.Argument(
      metavar='TARGET',
      help='package.module:factory building the model (see `plan`).',
      show_default=False,
    ),
  ],
  checkpoint: Annotated[
    pathlib.Path,
    typer.Option(
      metavar='DIR',
      help=(
        'Checkpoint of nnx.state(model) to restore: an Orbax checkpoint, '
        "or a CheckpointManager's directory (its latest whole step, or "
        '--step).'
      ),
      show_default=False,
    ),
  ],
  out: Annotated[
    pathlib.Path,
    typer.Option(metavar='DIR', help='Output directory.', show_default=False),
  ],
  step: Annotated[
    int | None,
    typer.Option(
      min=0,
      metavar='N',
      help=(
        "The step to export from a CheckpointManager's directory "
        '(default: its latest whole step).'
      ),
    ),
  ] = None,
  part: Annotated[
    str | None,
    typer.Option(
      metavar='NAME',
      help=(
        'The group of the checkpoint that holds the model, when it holds '
        'other state beside it: e.g. model, for a training state saved as '
        'model/ and optimizer/ (as demo saves its steps). Default: the '
        "whole checkpoint if it holds the model's variables, else the one "
        'group that does (the output says which).'
      ),
      show_default=False,
    ),
  ] = None,
  allow_extra: Annotated[
    bool,
    typer.Option(
      '--allow-extra',
      help=(
        'Ignore variables of the checkpoint (of its --part) that the model '
        'does not have, rather than refusing it.'
      ),
    ),
  ] = False,
  mesh: _options.MeshOption = _options.DEFAULT_MESH,
  rules: _options.RulesOption = None,
  mesh_axis_names: _options.MeshAxisNamesOption = False,
  axis_types: _options.AxisTypesOption = 'auto',
  saved_model: Annotated[
    bool,
    typer.Option(
      '--saved-model',
      help='Also write a SavedModel (needs --input-shape or --signature).',
    ),
  ] = False,
  input_shape: Annotated[
    list[str] | None,
    typer.Option(
      metavar='NAME:DIMS:DTYPE',
      help=(
        'NAME:DIMS:DTYPE of a positional input of the served method, e.g. '
        'x:1,128:int32, or NAME:none to pass None (e.g. cache:none); repeat '
        'for each positional parameter, in order. The first dimension is '
        'exported as a polymorphic batch dimension b. A dimension named by '
        'letters is polymorphic, one size wherever its name appears (e.g. '
        'tokens:b,t:int32 and mask:b,t,t:bool); ? is one of its own.'
      ),
    ),
  ] = None,
  static_batch: Annotated[
    bool,
    typer.Option(
      '--static-batch', help='Keep the first dimension of --input-shape fixed.'
    ),
  ] = False,
  method: Annotated[
    str,
    typer.Option(
      metavar='NAME',
      help=(
        "The module method that --input-shape's signature "
        "('serving_default') serves."
      ),
    ),
  ] = '__call__',
  signature: Annotated[
    list[str] | None,
    typer.Option(
      metavar='KEY=METHOD:INPUT',
      help=(
        'Also serve METHOD as the signature KEY, on its own inputs: each '
        'INPUT as --input-shape takes it, several joined by +, e.g. '
        'embed=embed:ids:1,8:int32 or score=score:x:1,16:float32+'
        "mask:1,16:bool. Repeat for each signature (the model's variables "
        'are saved once). KEY may be serving_default when no --input-shape '
        'is given.'
      ),
    ),
  ] = None,
  version: Annotated[
    str | None,
    typer.Option(
      metavar='N',
      help=(
        'Write the SavedModel into OUT/saved_model/N, a positive integer: '
        "TF Serving's layout (--model_base_path=OUT/saved_model serves its "
        'highest version).'
      ),
      show_default=False,
    ),
  ] = None,
  trainable: Annotated[
    bool,
    typer.Option(
      '--trainable',
      help=(
        "Make the SavedModel's nnx.Param variables trainable TF variables "
        'that TF differentiates (tf.GradientTape, Keras fine-tuning); '
        'default: serve only.'
      ),
    ),
  ] = False,
  verify: Annotated[
    bool,
    typer.Option(
      '--verify',
      help=(
        'Serve the written SavedModel in a fresh TensorFlow-only process on '
        "inputs of each signature's shapes, compare every output with JAX's "
        'and print the differences and latencies; exit with status 1 if one '
        'is beyond the tolerance.'
      ),
    ),
  ] = False,
  single_mesh: Annotated[
    bool,
    typer.Option(
      '--single-mesh',
      help=(
        'Write every variable of the checkpoint from one DTensor mesh '
        'mirroring --mesh, so that TF programs read it into variables on '
        'one mesh: a dimension sharded over several mesh axes is moved by '
        'JAX onto the largest of them. Prints what moved.'
      ),
    ),
  ] = False,
  overwrite: Annotated[
    bool,
    typer.Option(
      '--overwrite', help="Replace an earlier run's output folder as a whole."
    ),
  ] = False,
  cpu_devices: Annotated[
    int | None,
    typer.Option(
      min=1,
      metavar='N',
      help=_options.CPU_DEVICES_HELP
      + ' Default: the size of --mesh, on the CPU (an accelerator, if JAX '
      'has one, is kept).',
    ),
  ] = None,
  debug: _command.DebugOption = False,
) -> None:
  """Restore an Orbax checkpoint onto a mesh and export it to TF DTensor.

  Builds TARGET abstractly, restores the checkpoint with every array sharded
  by the rules on the mesh, then writes OUT/checkpoint (a TF checkpoint of
  DTensor variables, readable by plain TensorFlow; with --single-mesh, all
  from one DTensor mesh) and, with --saved-model, OUT/saved_model (with
  --version N, OUT/saved_model/N).
  """
  with _command.handle_errors(debug):
    axes = _parsing.parse_mesh(mesh)
    types = _parsing.parse_axis_types(axis_types, axes)
    rules_ = _loading.load_rules(
      rules, mesh_axes=[n for n, _ in axes] if mesh_axis_names else None
    )
    served = _served_signatures(
      input_shape, method, signature, saved_model, static_batch=static_batch
    )
    served_as = _saved_model_options(saved_model, version, trainable, verify)
    source = _find_source(checkpoint, step, part)
    factory = _loading.load_target(target)
    _parsing.check_out(out, overwrite=overwrite, flag=True, reads=source.path)
    names = ['checkpoint', *(['saved_model'] if saved_model else [])]
    outputs = {name: out / name for name in names}
    _set_up_devices(cpu_devices, axes)
    job = _Job(
      target,
      _loading.make_mesh(axes, mesh, types),
      rules_,
      source,
      allow_extra=allow_extra,
    )
    start = time.perf_counter()
    abstract, choice = _build_target(job, factory)
    model = _restore(job, abstract, choice, served)
    restored = time.perf_counter()
    relaid = _write_outputs(
      model, out, outputs, served, served_as, single_mesh=single_mesh
    )
    written = time.perf_counter()
    console = _command.console()
    console.print(
      f'Restored onto mesh {mesh} in {restored - start:.1f} s; exported in '
      f'{written - restored:.1f} s.',
      highlight=False,
      markup=False,
    )
    _print_outputs(console, source, choice, outputs, served_as)
    if relaid is not None:
      console.print(str(relaid), highlight=False, markup=False, soft_wrap=True)
    if served_as.verify:
      report = _verify(model, served_as.directory(out), served, job.mesh)
      console.print(report)
      if not report.ok:
        raise typer.Exit(_command.EXIT_FINDINGS)


def _set_up_devices(cpu_devices: int | None, axes: Sequence[Any]) -> None:
  """``--cpu-devices`` virtual CPU devices, else as many as the mesh needs
  on the CPU, as `demo` does, without leaving an accelerator."""
  if cpu_devices is not None:
    _loading.configure_cpu_devices(cpu_devices)
  else:
    _loading.configure_cpu_devices(
      math.prod(s for _, s in axes), only_cpu=False
    )


def _served_signatures(
  input_shape: list[str] | None,
  method: str,
  signature: list[str] | None,
  saved_model: bool,
  *,
  static_batch: bool,
) -> list[_served.Signature]:
  """The signatures of ``--input-shape`` and ``--signature``, which
  ``--saved-model`` needs and nothing else takes.

  Raises:
    BadInputError: If one is given without the other, or an entry is
      malformed.
  """
  served = _served.signatures(
    input_shape or [], method, signature or [], static_batch=static_batch
  )
  if saved_model and not served:
    raise _command.BadInputError(
      '--saved-model needs the shape of the served inputs: pass '
      '--input-shape NAME:DIMS:DTYPE, e.g. --input-shape x:1,128:int32, or '
      '--signature KEY=METHOD:INPUT, e.g. --signature '
      'embed=embed:ids:1,8:int32.'
    )
  if served and not saved_model:
    flag = '--input-shape' if input_shape else '--signature'
    raise _command.BadInputError(
      f'{flag} only applies with --saved-model; add --saved-model or drop '
      f'{flag}.'
    )
  return served


@dataclasses.dataclass(frozen=True)
class _SavedModelOptions:
  """How the SavedModel is written: its ``--version`` (None: OUT/saved_model
  itself) and whether ``--trainable``."""

  version: int | None
  trainable: bool
  verify: bool = False

  def directory(self, folder: pathlib.Path) -> pathlib.Path:
    """The SavedModel's directory in the run folder `folder`."""
    base = folder / 'saved_model'
    return base if self.version is None else base / str(self.version)


def _saved_model_options(
  saved_model: bool, version: str | None, trainable: bool, verify: bool
) -> _SavedModelOptions:
  """``--version``, ``--trainable`` and ``--verify``, which only
  ``--saved-model`` takes.

  Raises:
    BadInputError: If one is given without ``--saved-model``, or the
      version is not a positive integer.
  """
  given = {
    '--version': version is not None,
    '--trainable': trainable,
    '--verify': verify,
  }
  for flag in (f for f, on in given.items() if on and not saved_model):
    raise _command.BadInputError(
      f'{flag} only applies with --saved-model; add --saved-model (and '
      f'--input-shape or --signature) or drop {flag}.'
    )
  number = None if version is None else _parsing.parse_version(version)
  return _SavedModelOptions(number, trainable, verify)


def _sample_inputs(
  signature: _served.Signature, batch: int, seed: int
) -> list[Any]:
  """Inputs of `signature`'s shapes and dtypes for ``--verify``: `batch`
  for each dimension of no size (one size per name), values a model of
  any vocabulary takes (integers 0 and 1, normal floats)."""
  import jax.numpy as jnp
  import numpy as np

  rng = np.random.default_rng(seed)
  sizes: dict[str, int] = {}
  arrays = []
  for spec in signature.specs:
    if spec.dims is None:
      continue
    shape = tuple(
      d
      if isinstance(d, int)
      else sizes.setdefault(d, batch)
      if isinstance(d, str)
      else batch
      for d in spec.dims
    )
    dtype = np.dtype(jnp.dtype(spec.dtype))
    if dtype.kind == 'b':
      arrays.append(rng.integers(0, 2, shape).astype(bool))
    elif dtype.kind in 'iu':
      arrays.append(rng.integers(0, 2, shape).astype(dtype))
    else:
      arrays.append(rng.standard_normal(shape).astype(dtype))
  return arrays


def _verify(
  model: Any,
  directory: pathlib.Path,
  served: Sequence[_served.Signature],
  mesh: Any,
) -> Any:
  """``--verify``: the SavedModel served by TF against JAX, on inputs of
  every signature's shapes; a dimension of no size is as large as the
  mesh, a multiple of every axis it may be split over."""
  import math

  from flax_dtensor import dtensor

  batch = math.prod(mesh.devices.shape)
  return dtensor.verify_saved_model(
    model,
    directory,
    {s.key: _sample_inputs(s, batch, i) for i, s in enumerate(served)},
    signatures={s.key: s.serving_signature() for s in served},
  )


@dataclasses.dataclass(frozen=True)
class _Source:
  """The checkpoint to export: its folder, whether it is a step of a
  CheckpointManager's run (`ours`), and the ``--part`` asked for."""

  path: pathlib.Path
  ours: bool
  part: Any


def _find_source(
  checkpoint: pathlib.Path, step: int | None, part: str | None
) -> _Source:
  """The checkpoint ``--checkpoint`` (and ``--step``, ``--part``) names.

  Raises:
    BadInputError: If ``--step`` is given for an Orbax checkpoint, or
      names no whole step; or there is no checkpoint there.
  """
  from flax_dtensor._placement import _parts
  from flax_dtensor.dtensor._checkpoints import _orbax
  from flax_dtensor.dtensor._storage import _steps

  part_ = None if part is None else _parts.parse(part)
  if _steps.is_manager_folder(str(checkpoint)):
    return _Source(_manager_step(checkpoint, step), True, part_)
  if step is not None:
    raise _command.BadInputError(
      f'--step applies to a CheckpointManager directory (one folder per '
      f'step); {str(checkpoint)!r} is not one. Drop --step, or pass the '
      "manager's directory."
    )
  return _Source(_orbax.find_checkpoint(checkpoint), False, part_)


@dataclasses.dataclass(frozen=True)
class _Job:
  """What is exported where: TARGET, the mesh and rules, the source."""

  target: str
  mesh: Any
  rules: Any
  source: _Source
  allow_extra: bool

  @contextlib.contextmanager
  def placed(self) -> Iterator[None]:
    """The mesh and the rules in context."""
    import jax

    import flax_dtensor as fdt

    with jax.set_mesh(self.mesh), fdt.logical_axis_rules(self.rules):
      yield


def _build_target(job: _Job, factory: Any) -> tuple[Any, Any]:
  """TARGET built abstractly, planned, and checked against the source.

  Every variable resolves under the rules (else an error naming it), and
  the checkpoint (or the part of it holding the model) holds the model's
  variables and shapes (else an error naming the variable), before
  TensorFlow starts. Prints the plan's likely typos, and which part holds
  the model when the source holds more.

  Returns:
    The abstract model, and the choice of what in the source to restore.
  """
  import flax_dtensor as fdt
  from flax_dtensor._placement import _parts
  from flax_dtensor.dtensor._checkpoints import _orbax, _part_restore

  source = job.source
  with job.placed():
    abstract = _loading.build_abstract(factory, job.target)
    planned = fdt.plan(abstract, mesh=job.mesh, rules=job.rules)
    part, extra = source.part, job.allow_extra
    if source.ours:
      choice = _part_restore.check(
        str(source.path),
        abstract,
        part=part,
        allow_extra=extra,
        rebuild=_orbax.REBUILD,
      )
    else:
      choice = _orbax.check_matches(
        source.path, abstract, part=part, allow_extra=extra
      )
  console = _command.console()
  for typo in planned.likely_typos:
    console.print(f'Likely typo: {typo}', highlight=False, markup=False)
  if choice.matched:
    console.print(
      f'note: {str(source.path)!r} holds {_parts.listing(choice.groups)}; '
      f"exporting {choice.prefix}, which holds {job.target}'s variables "
      '(--part chooses another).',
      highlight=False,
      markup=False,
    )
  return abstract, choice


def _restore(
  job: _Job,
  abstract: Any,
  choice: Any,
  served: Sequence[_served.Signature],
) -> Any:
  """The model restored from the source onto the mesh, after TensorFlow
  DTensor starts and the served inputs (if any) are checked.

  An Orbax checkpoint's values cannot be checked: a note says so, before
  anything is written.
  """
  from flax_dtensor.dtensor._checkpoints import _orbax, _part_restore

  source = job.source
  dtensor = _loading.initialize_dtensor()  # Before any other TF op.
  with job.placed():
    for signature in served:
      _served.check_signature(abstract, signature)
    path, mesh, rules, extra = source.path, job.mesh, job.rules, job.allow_extra
    if source.ours and choice.part:
      model = _part_restore.restore(
        str(path), abstract, choice.part, mesh=mesh, rules=rules
      )
    elif source.ours:
      model = dtensor.restore_checkpoint(
        path, abstract, mesh=mesh, rules=rules, allow_extra=extra
      )
    else:
      model = _orbax.restore(
        path, abstract, mesh, part=choice.part, allow_extra=extra
      )
  if not source.ours:
    _command.console().print(
      f'note: {_orbax.unverified(source.path)}', highlight=False, markup=False
    )
  return model


def _write_outputs(
  model: Any,
  out: pathlib.Path,
  outputs: dict[str, pathlib.Path],
  served: Sequence[_served.Signature],
  served_as: _SavedModelOptions,
  *,
  single_mesh: bool,
) -> Any:
  """Writes OUT/checkpoint and, with signatures to serve, OUT/saved_model
  (or OUT/saved_model/VERSION), swapped in whole at the end.

  Returns:
    What moved onto one mesh with `single_mesh`, else None.
  """
  import jax
  from flax import nnx

  from flax_dtensor import dtensor
  from flax_dtensor.cli import _run_folder

  run = _run_folder.Run.new('export', list(outputs))
  needed = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
  with _run_folder.writing(out, needed=needed) as tmp:
    relaid = None
    if single_mesh:
      _, relaid = dtensor.save_checkpoint(
        model, tmp / 'checkpoint', single_mesh=True
      )
    else:
      dtensor.save_checkpoint(model, tmp / 'checkpoint')
    if served:
      dtensor.save_saved_model(
        model,
        served_as.directory(tmp),
        signatures={s.key: s.serving_signature() for s in served},
        trainable=nnx.Param if served_as.trainable else False,
      )
    for name in outputs:
      run.stamp(tmp / name)
  return relaid


def _print_outputs(
  console: Any,
  source: _Source,
  choice: Any,
  outputs: dict[str, pathlib.Path],
  served_as: _SavedModelOptions,
) -> None:
  """The table of what was read and written, with their sizes."""
  from flax_dtensor import _text

  what = f'restored {choice.prefix}' if choice.part else 'restored'
  shown = {
    name: served_as.directory(path.parent) if name == 'saved_model' else path
    for name, path in outputs.items()
  }
  rows = [(what, str(source.path), '')] + [
    (name, str(path), _text.human_bytes(_command.disk_usage(path)))
    for name, path in shown.items()
  ]
  console.print(
    _text.table_or_stacked(
      ('what', 'path', 'size'),
      rows,
      console.width,
      paths=('path',),
      right=('size',),
    )
  )


def _manager_step(directory: pathlib.Path, step: int | None) -> pathlib.Path:
  """The folder of `step` (None: the latest whole one) of a manager's run."""
  from flax_dtensor.dtensor._storage import _steps

  steps = _steps.whole_steps(str(directory))
  if not steps:
    raise _command.BadInputError(
      f'{str(directory)!r} holds no whole step yet: nothing to export. Wait '
      'for the run to save one, or pass another --checkpoint.'
    )
  chosen = steps[-1] if step is None else step
  if chosen not in steps:
    held = ', '.join(map(str, steps[-8:]))
    raise _command.BadInputError(
      f'--step {chosen}: {str(directory)!r} holds no whole step {chosen}; '
      f'its latest steps are {held}. Pass one of those, or no --step for '
      'the latest.'
    )
  return directory / str(chosen)
