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
import rich.table

from flax_dtensor import _plan_view


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
    out: The output directory (created; its outputs replaced).
    steps: Training steps.
    seed: Seed of init and data.
    batch_size: Sequences per step.
    console: Where to print (default: stdout).

  Returns:
    The summary, also written to `out/summary.json`.
  """
  console = console or rich.console.Console()
  timer = _Timer()
  start = time.perf_counter()
  rules_ = rules

  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  import flax_dtensor as fdt  # pylint: disable=g-import-not-at-top
  from flax_dtensor import dtensor  # pylint: disable=g-import-not-at-top
  from flax_dtensor.demo import data, train, verify  # pylint: disable=g-import-not-at-top
  from flax_dtensor.demo import model as model_lib  # pylint: disable=g-import-not-at-top

  mesh_ = mesh
  mesh_text = ','.join(
    f'{n}={s}' for n, s in zip(mesh.axis_names, mesh.axis_sizes, strict=True)
  )
  console.print(
    f'[bold]flax-dtensor demo[/]: {jax.device_count()} '
    f'{jax.default_backend()} devices, mesh {mesh_text}, {steps} steps, '
    f'batch {batch_size}, seed {seed}',
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
    console.print(fdt.plan(model))
    tokens_per_step = batch_size * length
    with timer('train (incl. compile)'):
      with _training_bar(console) as progress:
        # Until the first step ends there is neither a loss nor a rate.
        task = progress.add_task('train', total=steps, status='compiling…')
        last = time.perf_counter()
        rate = 0.0
        for step in range(steps):
          loss = float(train.train_step(model, optimizer, next_batch(batches)))
          now = time.perf_counter()
          losses.append(loss)
          current = tokens_per_step / max(now - last, 1e-9)
          # Smoothed; the first step (compilation) does not count.
          rate = current if step == 1 else 0.9 * rate + 0.1 * current
          progress.update(task, advance=1, status=_status(loss, step, rate))
          last = now
    with timer('held-out logits (JAX)'):
      forward = nnx.jit(lambda m, x: m(x))
      jax_logits = np.asarray(
        forward(model, train.shard_batch(held_out)), np.float32
      )

  # Exports, outside the rules context: the SavedModel then has no sharding
  # constraints and runs on one TF device.
  out.mkdir(parents=True, exist_ok=True)
  paths = {
    'orbax': out / 'orbax',
    'checkpoint': out / 'checkpoint',
    'saved_model': out / 'saved_model',
  }
  with timer('write Orbax checkpoint'):
    if paths['orbax'].exists():
      shutil.rmtree(paths['orbax'])
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(paths['orbax'].absolute(), nnx.state(model))
    checkpointer.wait_until_finished()
  with timer('write DTensor checkpoint'):
    dtensor.save_checkpoint(model, paths['checkpoint'], overwrite=True)
  with timer('write SavedModel'):
    tf = sys.modules['tensorflow']
    dtensor.save_saved_model(
      model,
      paths['saved_model'],
      input_signature=[tf.TensorSpec([None, length], tf.int32, name='tokens')],
      overwrite=True,
    )
  (out / 'rules.yaml').write_text(rules_text)
  with timer('verify in TF-only subprocess'):
    tf_logits, report = verify.verify_saved_model(
      paths['saved_model'], held_out
    )
  diff = float(np.max(np.abs(tf_logits - jax_logits)))
  scale = float(np.max(np.abs(jax_logits)))
  total = time.perf_counter() - start

  summary = {
    'mesh': dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True)),
    'devices': jax.device_count(),
    'steps': steps,
    'batch_size': batch_size,
    'seed': seed,
    'loss_first': losses[0],
    'loss_last': losses[-1],
    'loss_min': min(losses),
    'losses': losses,
    'max_abs_logits_diff': diff,
    'max_abs_logits': scale,
    'held_out_shape': list(held_out.shape),
    'tf_subprocess': report,
    'files': {k: str(v) for k, v in paths.items()},
    'bytes': {k: _disk_usage(v) for k, v in paths.items()},
    'seconds': timer.phases,
    'total_seconds': total,
  }
  (out / 'summary.json').write_text(json.dumps(summary, indent=1) + '\n')
  _print_summary(console, summary, out)
  return summary


def next_batch(batches: Any) -> Any:
  from flax_dtensor.demo import train  # pylint: disable=g-import-not-at-top

  return train.shard_batch(next(batches))


def _print_summary(
  console: rich.console.Console, summary: dict[str, Any], out: pathlib.Path
) -> None:
  files = rich.table.Table(title='Files written', title_justify='left')
  files.add_column('what', overflow='fold')
  files.add_column('path', overflow='fold')
  files.add_column('size', justify='right')
  labels = {
    'orbax': 'Orbax checkpoint (JAX)',
    'checkpoint': 'DTensor checkpoint (TF)',
    'saved_model': 'SavedModel (TF serving)',
  }
  for key, label in labels.items():
    files.add_row(
      label,
      summary['files'][key],
      _plan_view.human_bytes(summary['bytes'][key]),
    )
  files.add_row('summary', str(out / 'summary.json'), '')
  timings = rich.table.Table(title='Timings', title_justify='left')
  timings.add_column('phase', overflow='fold')
  timings.add_column('seconds', justify='right')
  for phase, seconds in summary['seconds'].items():
    timings.add_row(phase, f'{seconds:.1f}')
  timings.add_row('[bold]total', f'[bold]{summary["total_seconds"]:.1f}')
  results = rich.table.Table(title='Results', title_justify='left')
  results.add_column('measure', overflow='fold')
  results.add_column('value', justify='right', overflow='fold')
  losses = summary['losses']
  results.add_row(
    'train loss, first -> last (nats/byte)',
    f'{losses[0]:.3f} -> {losses[-1]:.3f}',
  )
  results.add_row('train loss, minimum', f'{summary["loss_min"]:.3f}')
  stride = max(1, len(losses) // 8)
  results.add_row(
    f'train loss every {stride} steps',
    ' '.join(f'{x:.2f}' for x in losses[::stride]),
  )
  results.add_row(
    'max |logits TF - logits JAX| (held-out batch '
    f'{tuple(summary["held_out_shape"])})',
    f'{summary["max_abs_logits_diff"]:.2e}',
  )
  results.add_row('max |logits JAX|', f'{summary["max_abs_logits"]:.2f}')
  results.add_row(
    'TF subprocess imported JAX',
    str(summary['tf_subprocess']['jax_imported']),
  )
  console.print(files)
  console.print(timings)
  console.print(results)
