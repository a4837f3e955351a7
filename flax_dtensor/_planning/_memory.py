"""Memory per device of a training step: the static estimate beside XLA's.

The estimate is the plan's (parameters, optimizer state, other variables)
plus the batch's shards; XLA's figures come from compiling the step ahead
of time (``compiled.memory_analysis()``), which nothing else needs to run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from flax_dtensor import _errors, _text
from flax_dtensor._planning import _plan_build


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """One device's memory for a training step, estimated and compiled.

  Attributes:
    estimate: Bytes per device by what they hold: ``params``,
      ``optimizer``, ``other`` variables, and the ``batch``.
    xla: XLA's own figures for the compiled step, per device:
      ``arguments``, ``outputs``, ``temporaries``, ``generated_code`` and
      ``aliased`` (arguments whose buffers the outputs reuse).
  """

  estimate: dict[str, int]
  xla: dict[str, int]

  @property
  def estimated_arguments(self) -> int:
    """The estimate's total: what the step takes as arguments."""
    return sum(self.estimate.values())

  def __str__(self) -> str:
    width = max(map(len, [*self.estimate, *self.xla, 'total']))
    lines = ['Memory per device', '  static estimate (arguments):']
    lines += [
      f'    {k:<{width}}  {_text.human_bytes(v):>10}'
      for k, v in self.estimate.items()
    ]
    lines.append(
      f'    {"total":<{width}}  '
      f'{_text.human_bytes(self.estimated_arguments):>10}'
    )
    lines.append('  compiled by XLA:')
    lines += [
      f'    {k:<{width}}  {_text.human_bytes(v):>10}'
      for k, v in self.xla.items()
    ]
    return '\n'.join(lines)

  __repr__ = __str__


def _batch_bytes(batch: Any) -> int:
  total = 0
  for x in jax.tree.leaves(batch):
    if not isinstance(x, jax.Array):
      raise _errors.NotAModelError(
        f'memory_report() expected the batch as (a pytree of) jax.Arrays, '
        f'placed as the step takes them; got {type(x).__name__}. Place it '
        'with jax.device_put(batch, sharding).'
      )
    shard = x.sharding.shard_shape(x.shape)
    total += math.prod(shard) * x.dtype.itemsize
  return total


def memory_report(
  train_step: Callable[..., Any],
  model: nnx.Module,
  optimizer: nnx.Optimizer,
  batch: Any,
) -> MemoryReport:
  """Compiles `train_step` ahead of time and reports its memory per device.

  Nothing runs: the step is lowered and compiled for the model's, the
  optimizer's and the batch's shardings. Call it under the mesh the step
  runs on (``jax.set_mesh``).

  Args:
    train_step: ``train_step(model, optimizer, batch)``, as written for
      ``nnx.jit`` (it may already be one).
    model: The model, placed.
    optimizer: Its ``nnx.Optimizer``.
    batch: A batch (a pytree of jax.Arrays), placed as the step takes it.

  Returns:
    The static estimate (the plan's bytes per device by category, and the
    batch's) beside XLA's compiled figures. Their argument totals are equal.

  Raises:
    NotAModelError: If `model` or `optimizer` is not what it should be, or
      the batch holds something other than jax.Arrays.
  """
  if not isinstance(model, nnx.Module):
    raise _errors.NotAModelError(
      f'memory_report() expected the model as an nnx.Module; got '
      f'{type(model).__name__}.'
    )
  if not isinstance(optimizer, nnx.Optimizer):
    raise _errors.NotAModelError(
      f'memory_report() expected an nnx.Optimizer; got '
      f'{type(optimizer).__name__}. Pass nnx.Optimizer(model, tx, '
      'wrt=nnx.Param).'
    )
  planned = _plan_build.plan(model, optimizer=optimizer)
  estimate = planned.bytes_per_device_by_category()
  estimate['batch'] = _batch_bytes(batch)
  graphdef, state = nnx.split((model, optimizer))

  def step(state, batch):
    m, o = nnx.merge(graphdef, state)
    out = train_step(m, o, batch)
    return out, nnx.state((m, o))

  compiled = jax.jit(step, donate_argnums=0).lower(state, batch).compile()
  stats = compiled.memory_analysis()
  xla = {
    'arguments': int(stats.argument_size_in_bytes),
    'outputs': int(stats.output_size_in_bytes),
    'temporaries': int(stats.temp_size_in_bytes),
    'generated_code': int(stats.generated_code_size_in_bytes),
    'aliased': int(stats.alias_size_in_bytes),
  }
  return MemoryReport(estimate=estimate, xla=xla)
