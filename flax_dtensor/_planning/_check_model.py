"""`check`'s findings about a model's variables under the rules:
short annotations, activation axes that clash with a variable's, variables
created unplaced (eager sharding off), large ones left whole on every
device, a budget exceeded."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import jax

from flax_dtensor import _errors, _text
from flax_dtensor._placement import _placing, _trees, _variables
from flax_dtensor._planning import (
  _check_report,
  _plan,
  _plan_view,
  _suggest_forward,
)
from flax_dtensor._rules import (
  _context,
  _logical,
  _meshes,
  _missing_axes,
  _partition_specs,
  _resolution,
  _spec,
)


def short_annotation_findings(target: Any) -> list[_check_report.Finding]:
  """A `short-annotation` for each annotation with fewer logical names than
  its variables have dimensions, with how many variables have it: Flax's
  reading (the missing trailing names are None) applies, and is said."""
  if _trees.is_array_tree(target):
    return []
  where: dict[tuple[tuple[Any, ...], int], list[str]] = {}
  for path, v in _variables.iter_variables(target):
    axes = _spec.logical_axes_of(v)
    rank = len(getattr(_spec.value_of(v), 'shape', ()))
    if axes is not None and len(axes) < rank:
      where.setdefault((axes, rank), []).append(_variables.path_str(path))
  out = []
  for (axes, rank), paths in where.items():
    full = axes + (None,) * (rank - len(axes))
    out.append(
      _check_report.Finding(
        'short-annotation',
        repr(axes),
        f'{_text.count(len(paths), "variable")} of rank {rank} (e.g. '
        f'{paths[0]}) {"is" if len(paths) == 1 else "are"} annotated with '
        f'{_text.count(len(axes), "logical name")}, so the missing trailing '
        f'names are None, as Flax reads it: {full!r}. Write them out to '
        "say so, or allow 'short-annotation'.",
      )
    )
  return out


def activation_clash_findings(
  rules: _logical.LogicalRules | _context.FlaxRules,
  used: set[str],
  entries: Sequence[_plan.PlanEntry],
  mesh: _meshes.MeshLike | None,
) -> list[_check_report.Finding]:
  """An `activation-axis-clash` for each Explicit mesh axis that a batch
  name no variable has (``'batch'``, ``'activation_batch'``: an
  activation's, as ``with_logical_constraint`` uses it) resolves to, and
  that a variable's last dimension (a kernel's output features, an
  embedding's) is sharded over too.

  JAX types a matmul's result with both operands' shardings: an activation
  sharded over 'data' times such a variable would be sharded over 'data'
  on two dimensions, which JAX refuses on Explicit axes, eagerly and under
  jit alike (``ShardingTypeError: ... illegally sharded result``). Auto
  axes are XLA's to resolve, and are not reported.
  """
  if mesh is None:
    return []
  explicit = {
    n
    for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
    if t == jax.sharding.AxisType.Explicit
  }
  if not explicit:
    return []
  pairs = rules.pairs if isinstance(rules, _context.FlaxRules) else rules
  activations = [
    n
    for n in dict.fromkeys(n for n, _ in pairs)
    if n not in used and _suggest_forward.batch_like(n)
  ]
  out = []
  for name in activations:
    try:
      with _missing_axes.reported_elsewhere():  # As findings.
        spec = _resolution.resolve((name,), None, mesh=mesh, rules=rules).spec
    except _errors.FlaxDTensorError:
      continue
    taken = set(_partition_specs.axes_of(spec[0])) & explicit
    for axis in sorted(taken):
      hits = [
        e
        for e in entries
        if len(e.shape) >= 2
        and e.logical_axes is not None
        and e.logical_axes[-1] != name
        and axis in _partition_specs.canonical(e.spec, len(e.shape))[-1]
      ]
      if not hits:
        continue
      e = hits[0]
      last = len(e.shape) - 1
      dim_name = e.logical_axes[-1]
      fell_back = any(f.startswith(f'dim {last} (') for f in e.fallbacks)
      how = (
        ' (by a fallback: the rules before it do not fit this mesh)'
        if fell_back
        else ''
      )
      out.append(
        _check_report.Finding(
          'activation-axis-clash',
          repr(axis),
          f'the batch name {name!r}, which no variable has (an '
          "activation's, as with_logical_constraint uses it), goes to the "
          f'Explicit mesh axis {axis!r}, and so does the last dimension '
          f'({dim_name!r}) of {_text.count(len(hits), "variable")} (e.g. '
          f'{e.path}: {_partition_specs.format_spec(e.spec)}){how}. A matmul of an '
          f'activation sharded so with such a variable gives a result '
          f'sharded over {axis!r} on two dimensions, which JAX refuses, '
          'eagerly and under jit (ShardingTypeError: ... illegally sharded '
          f'result). Give {dim_name!r} or {name!r} another mesh axis in the '
          'rules, or reshard one of them in the forward.',
        )
      )
  return out


def _suggested_pattern(path: str) -> str:
  """'layers/\\d+/mlp/up/kernel$' for 'layers/3/mlp/up/kernel'."""
  parts = [r'\d+' if p.isdigit() else re.escape(p) for p in path.split('/')]
  return '/'.join(parts) + '$'


def _could_shard(entry: _plan.PlanEntry, sizes: dict[str, int] | None) -> str:
  if not sizes:
    return 'no mesh axes'
  options = []
  for i, dim in enumerate(entry.shape):
    fits = [a for a, n in sizes.items() if n > 1 and dim % n == 0]
    if fits:
      options.append(f'dim {i} ({dim}) by {", ".join(map(repr, fits))}')
  return '; '.join(options) or 'no mesh axis divides any dimension'


def unplaced_when_built(
  target: Any, result: _plan.ShardingPlan
) -> list[_check_report.Finding]:
  """``eager-sharding-off`` predicted for an abstract build (a factory).

  An abstract build carries the rules' shardings whatever the flag says,
  so nothing in it is misplaced; but the variables whose `eager_sharding`
  metadata is False (the flag was off, or the variable said so) are
  created unplaced when the factory is called. Those the rules shard are
  reported, each with how many others there are.
  """
  if _trees.is_array_tree(target):
    return []
  off = {
    _variables.path_str(path)
    for path, v in _variables.iter_variables(target)
    if not v.get_metadata('eager_sharding', True)
    and _spec.placed_spec(_spec.value_of(v)) is None
  }
  unplaced = [
    e
    for e in result.entries
    if e.path in off
    and not _partition_specs.same_placement(
      jax.sharding.PartitionSpec(), e.spec, len(e.shape), e.mesh_axes
    )
  ]
  others = (
    f' (and {_text.count(len(unplaced) - 1, "other variable")})'
    if len(unplaced) > 1
    else ''
  )
  return [
    _check_report.Finding(
      'eager-sharding-off',
      e.path,
      f'the rules say {_partition_specs.format_spec(e.display_spec)}, but calling the '
      f'factory (building the model eagerly) creates it unplaced{others}: '
      f'{_EAGER_OFF_WHEN_BUILT}',
    )
    for e in unplaced
  ]


_EAGER_OFF_WHEN_BUILT = (
  'Flax leaves a variable where it is created when its `eager_sharding` '
  'metadata is False (flax_always_shard_variable was off when it was made, '
  'as some libraries set when imported, or it said eager_sharding=False). '
  '`fdt.init(factory, ...)` places every variable whatever the flag, and so '
  'does calling the factory inside `with nnx.use_eager_sharding(True):`.'
)


def eager_off_findings(
  result: _plan.ShardingPlan,
) -> list[_check_report.Finding]:
  """An ``eager-sharding-off`` for each variable created unplaced because
  Flax's eager sharding was off."""
  findings: list[_check_report.Finding] = []
  for e in result.entries:
    if e.misplaced and (e.misplaced_reason or '').startswith(
      _placing.EAGER_OFF_REASON
    ):
      findings.append(
        _check_report.Finding(
          'eager-sharding-off',
          e.path,
          f'placed {_partition_specs.format_spec(e.display_placed or ())}, but the '
          f'rules say {_partition_specs.format_spec(e.display_spec)}: '
          f'{_placing.EAGER_OFF_REASON}. {_placing.EAGER_OFF_FIX}',
        )
      )
  return findings


def replicated_findings(
  result: _plan.ShardingPlan, min_bytes: int, sizes: dict[str, int] | None
) -> list[_check_report.Finding]:
  """An ``unannotated-replicated`` or ``replicated-large`` for each variable
  of at least `min_bytes` whole on every device, largest first."""
  findings: list[_check_report.Finding] = []
  for e in sorted(result.entries, key=lambda e: (-e.bytes, e.path)):
    if not (
      result.num_devices > 1
      and e.bytes >= min_bytes
      and e.bytes_per_device == e.bytes
    ):
      continue
    whole = (
      f'{_plan_view.shape_text(e)} ({_text.human_bytes(e.bytes)}) '
      'is whole on each of the '
      f'{_text.count(result.num_devices, "device")}.'
    )
    if (e.source or '').startswith('none'):
      findings.append(
        _check_report.Finding(
          'unannotated-replicated',
          e.path,
          f'{whole} No annotation or path rule covers it ({e.source}). It '
          f'could be sharded on {_could_shard(e, sizes)}: add a path rule '
          f"such as (r'{_suggested_pattern(e.path)}', P(...)), or annotate "
          'it.',
        )
      )
    else:
      findings.append(
        _check_report.Finding(
          'replicated-large',
          e.path,
          f'{whole} ({e.source or "annotation"} leaves it replicated.) It '
          f'could be sharded on {_could_shard(e, sizes)}: annotate it, or '
          'add rules for its logical axes or its path.',
        )
      )
  return findings


def over_budget_findings(
  result: _plan.ShardingPlan, budget: int | None
) -> list[_check_report.Finding]:
  """An ``over-budget`` if one device holds more than `budget`."""
  findings: list[_check_report.Finding] = []
  if budget is not None and result.bytes_per_device > budget:
    findings.append(
      _check_report.Finding(
        'over-budget',
        'per device',
        f'{_text.human_bytes(result.bytes_per_device)} '
        f'({result.bytes_per_device:,} bytes) per device is above the budget '
        f'of {_text.human_bytes(budget)} ({budget:,} bytes; ideal '
        f'{_text.human_bytes(math.ceil(result.ideal_bytes_per_device))}'
        '). Shard the largest replicated variables, or use more devices.',
      )
    )
  return findings
