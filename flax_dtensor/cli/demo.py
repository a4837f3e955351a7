"""``flax-dtensor demo``: parses its flags and runs `flax_dtensor.demo.run`."""

from __future__ import annotations

import math
import pathlib
from typing import Annotated

import typer

from flax_dtensor import _interrupts
from flax_dtensor.cli import _command, _loading, _options, _parsing

DEFAULT_OUT = 'flax_dtensor_out'


def demo(
  steps: Annotated[
    int, typer.Option(min=1, metavar='N', help='Training steps.')
  ] = 300,
  mesh: _options.MeshOption = _options.DEFAULT_MESH,
  rules: _options.RulesOption = None,
  out: Annotated[
    pathlib.Path,
    typer.Option(
      metavar='DIR',
      help=(
        'Output directory: created, or an earlier output replaced as a '
        'whole (never a mix of two runs).'
      ),
    ),
  ] = pathlib.Path(DEFAULT_OUT),
  seed: Annotated[
    int, typer.Option(metavar='N', help='Seed of init and data.')
  ] = 0,
  batch_size: Annotated[
    int, typer.Option(min=1, metavar='N', help='Sequences per step.')
  ] = 16,
  cpu_devices: Annotated[
    int | None,
    typer.Option(
      min=1,
      metavar='N',
      help=_options.CPU_DEVICES_HELP + ' Default: the size of --mesh.',
    ),
  ] = None,
  save_every: Annotated[
    int,
    typer.Option(
      min=0,
      metavar='N',
      help=(
        'Save the model and optimizer every N training steps, and the '
        'last, into --steps-dir (the newest three kept; 0: none).'
      ),
    ),
  ] = 100,
  steps_dir: Annotated[
    pathlib.Path | None,
    typer.Option(
      metavar='DIR',
      help=(
        "The training's checkpoints by step, each a TF checkpoint. "
        'Default: the --out directory\'s name with "-steps", beside it.'
      ),
    ),
  ] = None,
  resume: Annotated[
    bool,
    typer.Option(
      '--resume',
      help=(
        'Go on from the latest whole step in --steps-dir (given the flags '
        'of the run that wrote it, the values equal an uninterrupted '
        "run's). Without it, a run starts over, removing earlier steps."
      ),
    ),
  ] = False,
  quiet: Annotated[
    bool,
    typer.Option(
      '--quiet',
      '-q',
      help=(
        "No progress: neither the training's (a line every few seconds "
        "when piped) nor the writes' (a line as each starts)."
      ),
    ),
  ] = False,
  debug: _command.DebugOption = False,
) -> None:
  """Train a small Transformer LM on a sharded mesh and export it to TF.

  On virtual CPU devices: builds the demo model with its params sharded by
  the rules, trains it with optax on the shipped corpus, prints the plan,
  writes an Orbax checkpoint, a DTensor checkpoint and a SavedModel, then
  loads the SavedModel in a fresh TensorFlow-only process and compares its
  logits on held-out text with JAX's. While it trains, it saves the model
  and optimizer every --save-every steps into --steps-dir, from which
  --resume goes on.
  """
  with _command.handle_errors(debug):
    axes = _parsing.parse_mesh(mesh)
    rules_ = _loading.load_rules(rules)
    _loading.configure_cpu_devices(cpu_devices or math.prod(s for _, s in axes))
    _parsing.check_out(out, overwrite=True, flag=False)
    steps_dir_ = steps_dir or out.parent / f'{out.absolute().name}-steps'
    if steps_dir_.exists() and not steps_dir_.is_dir():
      raise _command.BadInputError(
        f'--steps-dir {str(steps_dir_)!r} is a file; expected a folder of '
        'training steps (or none yet). Pass another --steps-dir.'
      )
    if resume:  # Said before JAX starts.
      _check_resumable(steps_dir_, steps)
    elif not save_every:  # No steps to save or restore: no folder.
      steps_dir_ = None
    if steps_dir_ is not None:
      _interrupts.on_interrupted(lambda: _how_to_go_on(steps_dir_, steps))
    mesh_ = _loading.make_mesh(axes, mesh)
    _loading.initialize_dtensor()  # Before any other TF operation.
    from flax_dtensor.demo import run, train

    run.run(
      mesh=mesh_,
      rules=rules_,
      rules_text=(
        pathlib.Path(rules).read_text() if rules else train.rules_text()
      ),
      out=out,
      steps=steps,
      seed=seed,
      batch_size=batch_size,
      console=_command.console(),
      progress=not quiet,
      steps_dir=steps_dir_,
      save_every=save_every,
      resume=resume,
    )


def _how_to_go_on(steps_dir: pathlib.Path, steps: int) -> str | None:
  """The line an interrupted run ends with: how ``--resume`` goes on.

  None unless `steps_dir` holds a whole step before `steps` (no JAX, no TF).
  """
  from flax_dtensor.dtensor._storage import _steps

  try:
    done = _steps.whole_steps(str(steps_dir))
  except OSError:
    return None
  if not done or done[-1] >= steps:
    return None
  return (
    f'Steps up to {done[-1]} of {steps} are saved in {str(steps_dir)!r}: '
    '`flax-dtensor demo --resume`, with the same flags, goes on from there.'
  )


def _check_resumable(steps_dir: pathlib.Path, steps: int) -> None:
  """Refuses a `--resume` with no whole step to go on from, or none left.

  A damaged step is passed over, as the restore passes over it (it goes on
  from the newest good step, and says so): only an intact step at or past
  `steps` leaves nothing to train.
  """
  from flax_dtensor.dtensor._storage import _steps

  done = _steps.whole_steps(str(steps_dir))
  if not done:
    raise _command.BadInputError(
      f'--resume: {str(steps_dir)!r} holds no whole step to go on from. '
      'Run without --resume to start the training, or pass --steps-dir the '
      'folder a run saved its steps in.'
    )
  for step in reversed(done):
    if step < steps:
      return
    if _intact(steps_dir / str(step)):
      raise _command.BadInputError(
        f'--resume: {str(steps_dir)!r} holds step {step}, and --steps is '
        f'{steps}: nothing is left to train. Pass the --steps of the run '
        'that wrote it (larger than its latest step).'
      )


def _intact(step_dir: pathlib.Path) -> bool:
  """Whether a step's files are what its manifest records (no JAX, no TF)."""
  import concurrent.futures

  from flax_dtensor import _errors
  from flax_dtensor.dtensor._format import _checksums, _decode, _verify

  try:
    manifest = _decode.read(str(step_dir))
  except _errors.ExportError:
    return False
  if manifest is None:  # Nothing to check against: read as it is.
    return True
  with concurrent.futures.ThreadPoolExecutor(_checksums.THREADS) as pool:
    return not _verify.problems_of(manifest, pool)
