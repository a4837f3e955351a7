"""The demo's run: train on a mesh, export to TensorFlow, serve and compare.

`run` is what ``flax-dtensor demo`` calls once it has parsed its flags.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import shutil
import sys
import time
from collections.abc import Iterator
from typing import Any

import rich.console
import rich.progress
import rich.text

from flax_dtensor import _interrupts, _output, _text
from flax_dtensor.cli import _run_folder


def _disk_usage(path: pathlib.Path) -> int:
  if path.is_file():
    return path.stat().st_size
  return sum(p.stat().st_size for p in path.rglob('*') if p.is_file())


@dataclasses.dataclass
class _Timer:
  """Wall-clock seconds per phase, in order."""

  phases: dict[str, float] = dataclasses.field(default_factory=dict)

  @contextlib.contextmanager
  def __call__(self, name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
      yield
    finally:
      self.phases[name] = time.perf_counter() - start


def _training_bar(console: rich.console.Console) -> rich.progress.Progress:
  return rich.progress.Progress(
    rich.progress.TextColumn('[bold]train'),
    rich.progress.BarColumn(),
    rich.progress.MofNCompleteColumn(),
    rich.progress.TextColumn('{task.fields[status]}'),
    rich.progress.TimeElapsedColumn(),
    rich.progress.TimeRemainingColumn(),
    console=console,
  )


def _status(loss: float, step: int, rate: float) -> str:
  """'loss 2.345  12,345 tokens/s' (no rate yet after the compiling step)."""
  if step == 0:
    return f'loss {loss:.3f}  measuring speed…'
  return f'loss {loss:.3f}  {rate:,.0f} tokens/s'


PIPED_EVERY_SECONDS = 10.0
"""Piped, a progress line is printed at most this often (and at the end)."""


def progress_line(
  step: int,
  steps: int,
  loss: float,
  rate: float,
  elapsed: float,
  *,
  first: int = 0,
) -> str:
  """'train step 40/300  loss 2.345  12,345 tokens/s  8 s' (piped output).

  `step` counts from 0, over the whole training (a resumed run's too); the
  `first` step this run trains compiles, so it has no rate yet.
  """
  speed = 'compiled' if step == first else f'{rate:,.0f} tokens/s'
  return (
    f'train step {step + 1}/{steps}  loss {loss:.3f}  {speed}  {elapsed:.0f} s'
  )


class _Progress:
  """Training progress: rich's bar on a terminal, plain lines when piped.

  Piped (a log, CI, ``| tee``), nothing is animated: a `progress_line`
  after the first step, then at most every `every` seconds, and after the
  last step. With `show` false, nothing at all. Steps are the training's
  (a resumed run's start at `first`, the step it goes on from).
  """

  def __init__(
    self,
    console: rich.console.Console,
    steps: int,
    *,
    show: bool,
    first: int = 0,
    every: float = PIPED_EVERY_SECONDS,
    clock: Any = time.perf_counter,
  ):
    self._console = console
    self._steps = steps
    self._first = first
    self._every = every
    self._clock = clock
    self._bar = _training_bar(console) if show and console.is_terminal else None
    self._lines = show and not console.is_terminal
    self._start = self._last = 0.0

  def __enter__(self) -> _Progress:
    self._start = self._clock()
    self._last = -float('inf')
    if self._bar is not None:
      self._bar.__enter__()
      # Until the first step ends there is neither a loss nor a rate.
      self._task = self._bar.add_task(
        'train', total=self._steps, completed=self._first, status='compiling…'
      )
    return self

  def __exit__(self, *exc: Any) -> None:
    if self._bar is not None:
      self._bar.__exit__(*exc)

  def update(self, step: int, loss: float, rate: float) -> None:
    if self._bar is not None:
      status = _status(loss, step - self._first, rate)
      self._bar.update(self._task, advance=1, status=status)
    if not self._lines:
      return
    now = self._clock()
    if (
      step in (self._first, self._steps - 1) or now - self._last >= self._every
    ):
      self._last = now
      self._console.print(
        progress_line(
          step, self._steps, loss, rate, now - self._start, first=self._first
        ),
        highlight=False,
        markup=False,
      )


def run(
  *,
  mesh: Any,
  rules: Any,
  rules_text: str,
  out: pathlib.Path,
  steps: int = 300,
  seed: int = 0,
  batch_size: int = 16,
  console: rich.console.Console | None = None,
  progress: bool = True,
  steps_dir: pathlib.Path | None = None,
  save_every: int = 0,
  resume: bool = False,
) -> dict[str, Any]:
  """Trains the demo model on `mesh`, exports it, and checks it in TF.

  Builds the model with its params sharded by `rules`, trains it with optax
  on the shipped corpus, prints the plan, writes an Orbax checkpoint, a
  DTensor checkpoint and a SavedModel into `out`, then loads the SavedModel
  in a fresh TensorFlow-only process and compares its logits on held-out
  text with JAX's. Call `flax_dtensor.dtensor.initialize()` first.

  Args:
    mesh: A concrete `jax.sharding.Mesh` (Auto axes).
    rules: The `flax_dtensor.LogicalRules`.
    rules_text: The rules as YAML, copied to `out/rules.yaml`.
    out: The output directory: created, or replaced as a whole (written
      aside and swapped in; check it first, as the command line's
      `_inputs.check_out` does).
    steps: Training steps.
    seed: Seed of init and data.
    batch_size: Sequences per step.
    console: Where to print (default: stdout).
    progress: Whether to show progress: the training's (a bar on a
      terminal, a line every few seconds otherwise), and each write's and
      the verification's while it runs (a spinner, or a line as it starts).
    steps_dir: Where the training's checkpoints go, by step (a
      `flax_dtensor.dtensor.CheckpointManager` folder: the model and the
      optimizer, each step a TF checkpoint). None: no checkpoints.
    save_every: Save every this many steps, and the last (0: never).
    resume: Go on from the latest whole step in `steps_dir` (the newest
      good one, if it is damaged; the values then equal an uninterrupted
      run's with the same arguments). Without it, steps an earlier run left
      in `steps_dir` are removed first.

  Returns:
    The summary, also written to `out/summary.json`.
  """
  console = console or rich.console.Console()
  timer = _Timer()
  start = time.perf_counter()
  rules_ = rules

  import jax
  import orbax.checkpoint as ocp
  from flax import nnx

  import flax_dtensor as fdt
  from flax_dtensor import dtensor
  from flax_dtensor.demo import data, train
  from flax_dtensor.demo import model as model_lib

  mesh_ = mesh
  mesh_text = ','.join(
    f'{n}={s}' for n, s in zip(mesh.axis_names, mesh.axis_sizes, strict=True)
  )
  console.print(
    f'[bold]flax-dtensor demo[/] on '
    f'{_text.count(jax.device_count(), "device")} '
    f'({jax.default_backend()}), mesh {mesh_text}',
    highlight=False,
  )
  console.print(
    f'{_text.count(steps, "step")} of '
    f'{_text.count(batch_size, "sequence")}, seed {seed}',
    highlight=False,
  )

  length = model_lib.Config().max_length
  train_tokens, _ = data.split_tokens()
  batches = data.Batches(train_tokens, batch_size, length, seed=seed)
  held_out = data.held_out_batch(8, length)[:, :length]
  losses: list[float] = []
  with jax.set_mesh(mesh_), fdt.logical_axis_rules(rules_):
    with timer('build model + optimizer'):
      model = model_lib.make_model(seed=seed)
      optimizer = train.make_optimizer(model, steps=steps)
      state = train.TrainState(model, optimizer)
    manager, done = _steps_manager(
      dtensor,
      state,
      steps_dir,
      resume=resume,
      steps=steps,
      save_every=save_every,
      console=console,
    )
    console.print(fdt.plan(model))
    tokens_per_step = batch_size * length
    for _ in range(done):  # The batches the steps done already took.
      next(batches)
    with timer('train (incl. compile)'):
      with _Progress(console, steps, first=done, show=progress) as bar:
        last = time.perf_counter()
        rate = 0.0
        for step in range(done, steps):
          loss = float(train.train_step(model, optimizer, next_batch(batches)))
          now = time.perf_counter()
          losses.append(loss)
          current = tokens_per_step / max(now - last, 1e-9)
          # Smoothed; the first step (compilation) does not count.
          rate = current if step == done + 1 else 0.9 * rate + 0.1 * current
          bar.update(step, loss, rate)
          last = now
          if manager is not None and save_every:
            # In the background: training goes on while it is written.
            manager.save(
              step + 1,
              state,
              metrics={'loss': loss},
              force=step + 1 == steps,
            )
      if manager is not None:
        manager.wait()
        manager.close()

  # Exports, outside the rules context: the SavedModel then has no sharding
  # constraints and runs on one TF device. The whole folder is written
  # aside and swapped in: interrupted, `out` keeps the previous run's.
  names = ('orbax', 'checkpoint', 'saved_model')
  run_ = _run_folder.Run.new('demo', (*names, 'rules.yaml', 'summary.json'))
  needed = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))

  # Each phase is timed and, unless quiet, shown while it runs (a spinner
  # on a terminal, a line when piped): together they take ~12 s.
  def phase(name: str) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    stack.enter_context(timer(name))
    stack.enter_context(_output.step(name, show=progress, console=console))
    return stack

  with _run_folder.writing(out, needed=needed) as tmp:
    paths = {name: tmp / name for name in names}
    # Orbax writes on threads of its own: an interrupt waits for them (the
    # watchdog's 1.5 s at the most) rather than remove the folder while
    # they write into it.
    with phase('write Orbax checkpoint'), _interrupts.deferred():
      checkpointer = ocp.StandardCheckpointer()
      checkpointer.save(paths['orbax'].absolute(), nnx.state(model))
      checkpointer.wait_until_finished()
    with phase('write DTensor checkpoint'):
      dtensor.save_checkpoint(model, paths['checkpoint'])
    tf = sys.modules['tensorflow']
    signature = [tf.TensorSpec([None, length], tf.int32, name='tokens')]
    with phase('write SavedModel'):
      dtensor.save_saved_model(
        model, paths['saved_model'], input_signature=signature
      )
    end = '' if rules_text.endswith('\n') or not rules_text else '\n'
    (tmp / 'rules.yaml').write_text(rules_text + end + run_.text_stamp())
    # The held-out logits served by TF without JAX, against JAX's.
    with phase('verify in TF-only subprocess'):
      verified = dtensor.verify_saved_model(
        model,
        paths['saved_model'],
        {'serving_default': held_out},
        input_signature=signature,
        calls=3,
      )
    for path in paths.values():
      run_.stamp(path)
    (served,) = verified.signatures
    (logits,) = served.outputs
    report = {
      'load_seconds': verified.tf_load_seconds,
      'tf_call_seconds': served.tf_seconds,
      'jax_call_seconds': served.jax_seconds,
      'tensorflow': verified.tensorflow,
      'jax_imported': verified.jax_imported,
    }
    total = time.perf_counter() - start

    summary = {
      'run': run_.id,
      'mesh': dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True)),
      'devices': jax.device_count(),
      'steps': steps,
      'resumed_from': done if resume else None,
      'steps_dir': None if manager is None else str(steps_dir),
      'saved_steps': [] if manager is None else manager.all_steps(),
      'batch_size': batch_size,
      'seed': seed,
      'loss_first': losses[0],
      'loss_last': losses[-1],
      'loss_min': min(losses),
      'losses': losses,
      'max_abs_logits_diff': logits.max_abs_diff,
      'max_abs_logits': logits.max_abs_reference,
      'held_out_shape': list(held_out.shape),
      'tf_subprocess': report,
      'files': {k: str(out / k) for k in paths},
      'bytes': {k: _disk_usage(v) for k, v in paths.items()},
      'seconds': timer.phases,
      'total_seconds': total,
    }
    (tmp / 'summary.json').write_text(json.dumps(summary, indent=1) + '\n')
  _print_summary(console, summary, out)
  return summary


def _steps_manager(
  dtensor: Any,
  state: Any,
  steps_dir: pathlib.Path | None,
  *,
  resume: bool,
  steps: int,
  save_every: int,
  console: rich.console.Console,
) -> tuple[Any, int]:
  """The checkpoint manager of `steps_dir` (None without one), and the
  step the training starts from: the step restored into `state` with
  `resume` (the latest whole one, or the newest good one before a damaged
  one), else 0 (an earlier run's steps removed)."""
  from flax import nnx

  if steps_dir is None:
    return None, 0
  if not resume and steps_dir.is_dir() and any(steps_dir.iterdir()):
    console.print(
      f'starting over: removing the steps an earlier run left in '
      f'{steps_dir} (--resume goes on from them)',
      highlight=False,
      markup=False,
    )
    shutil.rmtree(steps_dir)
  # Kept: the newest three steps. The RNG state is saved too, so that a
  # resumed run draws what an uninterrupted one draws.
  manager = dtensor.CheckpointManager(
    steps_dir,
    save_interval_steps=max(save_every, 1),
    max_to_keep=3,
    exclude=nnx.Nothing,
  )
  if not resume:
    return manager, 0
  latest = manager.latest_step()
  if latest is None:
    manager.close()
    raise dtensor.ExportNotFoundError(
      f'--resume: {str(steps_dir)!r} holds no whole step to go on from. '
      'Run without --resume to start the training, or pass --steps-dir the '
      'folder a run saved its steps in.'
    )
  manager.restore(state)
  # A damaged latest step is passed over: the run goes on from the step
  # restored (the manager says which), not from `latest`.
  restored = manager.restored_step
  if restored >= steps:
    manager.close()
    raise dtensor.CheckpointManagerError(
      f'--resume: {str(steps_dir)!r} holds step {restored}, and --steps is '
      f'{steps}: nothing is left to train. Pass the --steps of the run that '
      'wrote it (larger than its latest step).'
    )
  damaged = [s for s in manager.all_steps() if s > restored]
  console.print(
    f'resumed from step {restored} of {steps} ({steps_dir})'
    + (
      f'; passed over the damaged step{"s" if len(damaged) > 1 else ""} '
      f'{", ".join(map(str, damaged))} (moved aside, as '
      f'{", ".join(f"{s}.damaged" for s in damaged)}, by the next save)'
      if damaged
      else ''
    ),
    highlight=False,
    markup=False,
  )
  return manager, restored


def next_batch(batches: Any) -> Any:
  from flax_dtensor.demo import train

  return train.shard_batch(next(batches))


def _print_summary(
  console: rich.console.Console, summary: dict[str, Any], out: pathlib.Path
) -> None:
  labels = {
    'orbax': 'Orbax checkpoint (JAX)',
    'checkpoint': 'DTensor checkpoint (TF)',
    'saved_model': 'SavedModel (TF serving)',
  }
  files = [
    (
      label,
      summary['files'][key],
      _text.human_bytes(summary['bytes'][key]),
    )
    for key, label in labels.items()
  ]
  if summary.get('steps_dir'):
    saved = summary['saved_steps']
    files.append(
      (
        f'training steps {", ".join(map(str, saved))} (TF checkpoints)'
        if saved
        else 'training steps (none saved)',
        summary['steps_dir'],
        _text.human_bytes(_disk_usage(pathlib.Path(summary['steps_dir']))),
      )
    )
  rules = out / 'rules.yaml'
  files.append(
    (
      'rules (YAML, for --rules)',
      str(rules),
      _text.human_bytes(rules.stat().st_size) if rules.is_file() else '',
    )
  )
  files.append(('summary', str(out / 'summary.json'), ''))
  timings = [(p, f'{s:.1f}') for p, s in summary['seconds'].items()]
  timings.append(('total', f'{summary["total_seconds"]:.1f}'))
  losses = summary['losses']
  # Eight losses, evenly spaced from the first step to the last.
  points = sorted({round(i * (len(losses) - 1) / 7) for i in range(8)})
  results = [
    (
      'train loss, first -> last',
      f'{losses[0]:.3f} -> {losses[-1]:.3f} nats/byte',
    ),
    ('train loss, minimum', f'{summary["loss_min"]:.3f}'),
    ('train loss over time', ' '.join(f'{losses[i]:.2f}' for i in points)),
    (
      'max |logits TF - JAX|',
      f'{summary["max_abs_logits_diff"]:.2e} (held-out batch '
      f'{tuple(summary["held_out_shape"])})',
    ),
    ('max |logits JAX|', f'{summary["max_abs_logits"]:.2f}'),
    (
      'TF process imported JAX',
      str(summary['tf_subprocess']['jax_imported']),
    ),
  ]
  width = console.width
  for title, columns, rows, options in (
    ('Files written', ('what', 'path', 'size'), files, {'paths': ('path',)}),
    ('Timings', ('phase', 'seconds'), timings, {'right': ('seconds',)}),
    ('Results', ('measure', 'value'), results, {}),
  ):
    console.print(rich.text.Text(title, style='bold'))
    console.print(
      _text.table_or_stacked(columns, rows, width, **options),
      highlight=False,
    )
