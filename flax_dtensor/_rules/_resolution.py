"""Resolution: logical axes to a PartitionSpec, under the rules in effect.

`resolve_dims` is flax_dtensor's semantics (for `LogicalRules`): Linen's
priority scan, skipping a rule whose mesh axes are taken, absent from the
mesh or do not divide the dimension (recorded, with the reason), so the
next rule for the name is the fallback. `resolve_flax` is Flax NNX's (for
plain rules set with Flax's context): a dict. `resolve` picks one.
`fit_spec` fits a path rule's mesh axes to the mesh and shape by the same
checks, replicating a dimension whose axes do not fit.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from flax.core import spmd as core_spmd
from jax.sharding import PartitionSpec

from flax_dtensor import _errors
from flax_dtensor._rules import (
  _context,
  _logical,
  _meshes,
  _missing_axes,
  _partition_specs,
)

FLAX_SEMANTICS = 'flax'
FDT_SEMANTICS = 'flax_dtensor'
ANNOTATION = 'annotation'


@dataclasses.dataclass(frozen=True)
class SkippedCandidate:
  """A rule that could not shard a dimension, and why."""

  target: _logical.Target
  reason: str

  def __str__(self) -> str:
    return f'{_partition_specs.format_entry(self.target)}: {self.reason}'


@dataclasses.dataclass(frozen=True)
class DimResolution:
  """How one array dimension was resolved."""

  logical_name: str | None
  target: _logical.Target
  skipped: tuple[SkippedCandidate, ...] = ()

  @property
  def fell_back(self) -> bool:
    """Whether a preferred candidate was skipped for this dimension."""
    return bool(self.skipped)


@dataclasses.dataclass(frozen=True)
class Resolution:
  """The resolved PartitionSpec of one array and the reasons behind it.

  Attributes:
    logical_axes: The logical axes resolved, one per dimension.
    shape: The array's shape, if known.
    dims: How each dimension was resolved.
    semantics: Whose semantics applied: ``'flax_dtensor'`` or ``'flax'``.
    source: What decided it: ``'annotation'`` (the variable's own logical
      axes or sharding), or a path rule (``"path rule #2 'q/kernel$'"``).
    mesh_axes: Whether `logical_axes` are a path rule's mesh axes, fitted
      by `fit_spec`, rather than logical names.
  """

  logical_axes: tuple[Any, ...]
  shape: tuple[int, ...] | None
  dims: tuple[DimResolution, ...]
  semantics: str = FDT_SEMANTICS
  source: str = ANNOTATION
  mesh_axes: bool = False

  @property
  def by_path_rule(self) -> bool:
    """Whether a path rule (not an annotation) decided the placement."""
    return self.source != ANNOTATION

  @property
  def spec(self) -> PartitionSpec:
    return PartitionSpec(*(d.target for d in self.dims))

  @property
  def skipped(self) -> tuple[tuple[int, SkippedCandidate], ...]:
    """Every skipped candidate, with the index of its dimension."""
    return tuple((i, s) for i, d in enumerate(self.dims) for s in d.skipped)


def where(path: str | None) -> str:
  """' at layers/0/kernel' for messages, or ''."""
  return f' at {path}' if path else ''


def _context_text(
  logical_axes: Any,
  shape: Sequence[int] | None,
  rules: Any,
  mesh: _meshes.MeshLike | None,
) -> str:
  shape_text = f', shape {tuple(shape)}' if shape is not None else ''
  return (
    f'(logical axes {tuple(logical_axes)!r}{shape_text}, rules '
    f'{list(rules) if rules is not None else None!r}, '
    f'{_meshes.describe(mesh)})'
  )


def padded(
  axes: tuple[Any, ...], shape: Sequence[int] | None, where_: str = ''
) -> tuple[Any, ...]:
  """`axes`, one per dimension of `shape`: the missing trailing ones None.

  Flax and JAX read an annotation shorter than the rank as a
  PartitionSpec does (``('C',)`` on a matrix is ``P('C', None)``), and so
  does resolution. More names than dimensions is an error.

  Raises:
    ShardingResolutionError: If there are more logical axes than
      dimensions.
  """
  if shape is None or len(axes) == len(shape):
    return axes
  if len(axes) < len(shape):
    return axes + (None,) * (len(shape) - len(axes))
  raise _errors.ShardingResolutionError(
    f'Expected at most one logical axis per dimension{where_}: the array '
    f'has shape {tuple(shape)} (rank {len(shape)}) but got {len(axes)} '
    f'logical axes {axes!r}. Fix the annotation, e.g. '
    f'nnx.with_partitioning(init, {tuple(["..."] * len(shape))!r}) (names '
    'left out at the end are None).'
  )


class _Recording(threading.local):
  def __init__(self) -> None:
    self.found: list[tuple[tuple[Any, ...], tuple[int, ...] | None]] | None = (
      None
    )


_recording = _Recording()


@contextlib.contextmanager
def recorded() -> Iterator[list[tuple[tuple[Any, ...], Any]]]:
  """Within the block (this thread), every resolution of logical axes under
  `LogicalRules` is recorded: yields the list of (logical axes, shape) it
  fills, e.g. for the names a traced forward constrains activations with."""
  previous = _recording.found
  _recording.found = found = []
  try:
    yield found
  finally:
    _recording.found = previous


def resolve_dims(
  logical_axes: _logical.LogicalAxes | PartitionSpec,
  shape: Sequence[int] | None = None,
  *,
  mesh: _meshes.MeshLike | None = None,
  rules: _logical.LogicalRules,
  path: str | None = None,
) -> Resolution:
  """Resolves logical axes with flax_dtensor's semantics (module docstring).

  Args:
    logical_axes: One entry per array dimension: a logical name, or None.
      Fewer entries than dimensions: the missing trailing ones are None.
    shape: The array's shape; enables the divisibility check.
    mesh: The mesh; enables the existence check. None skips it.
    rules: The rules.
    path: The variable path, for error messages.

  Returns:
    The resolution, with every skipped candidate and its reason.

  Raises:
    ShardingResolutionError: If a logical name repeats, there are more
      logical axes than dimensions, an entry is not a str or None, or (in
      strict mode) a dimension has no fitting candidate.
    UnknownLogicalAxisError: If a logical name is in no rule and
      ``rules.unknown == 'error'``.
  """
  axes = tuple(logical_axes)
  if _recording.found is not None:
    _recording.found.append((axes, None if shape is None else tuple(shape)))
  where_ = where(path)
  axes = padded(axes, shape, where_)
  for a in axes:
    if not (
      a is None or isinstance(a, str) or a is PartitionSpec.UNCONSTRAINED
    ):
      raise _errors.ShardingResolutionError(
        f'Expected each logical axis{where_} to be a str or None; got {a!r} '
        f'in {axes!r}. Name one logical axis per dimension; map a logical '
        f'name to several mesh axes in the rules instead, e.g. '
        f"('embed', ('data', 'model'))."
      )
  counts = collections.Counter(a for a in axes if isinstance(a, str))
  dups = sorted(a for a, c in counts.items() if c > 1)
  if dups:
    raise _errors.ShardingResolutionError(
      f'Logical axis name(s) {dups} occur more than once{where_} '
      f'{_context_text(axes, shape, rules, mesh)}. A mesh axis can shard '
      'only one dimension of an array: give each dimension its own logical '
      "name, e.g. ('embed', 'embed_out')."
    )
  known = set(rules.names)
  unknown = [a for a in axes if isinstance(a, str) and a not in known]
  if unknown and rules.unknown == 'replicate':
    _missing_axes.check_unknown_names(rules, unknown)
  if unknown and rules.unknown == 'error':
    suggestions = ', '.join(f'({a!r}, None)' for a in unknown)
    hints = ''.join(
      f' {a!r}: did you mean {meant!r}?'
      for a in unknown
      for meant in [_missing_axes.likely_meant(a, rules.names)]
      if meant is not None
    )
    problem = (
      f'Logical axis name(s) {unknown} are not mentioned by any rule{where_} '
      f'{_context_text(axes, shape, rules, mesh)}.{hints}'
    )
    raise _errors.UnknownLogicalAxisError(
      f'{problem} Add a rule for each, e.g. {suggestions} to replicate, or '
      'pass `unknown="replicate"` to LogicalRules to replicate every '
      'unmentioned name.',
      names=unknown,
      problem=problem,
    )
  sizes = _meshes.axis_sizes(mesh) if mesh is not None else None

  targets: list[_logical.Target] = [None] * len(axes)
  assigned = [not isinstance(a, str) for a in axes]
  skipped: list[list[SkippedCandidate]] = [[] for _ in axes]
  for name, target in rules:
    if name not in axes:
      continue
    pos = axes.index(name)
    if assigned[pos]:
      continue
    reason = _unfit(target, pos, targets, assigned, axes, shape, sizes)
    if reason is not None:
      skipped[pos].append(SkippedCandidate(target, reason))
      continue
    targets[pos] = target
    assigned[pos] = True

  if rules.strict:
    for pos, name in enumerate(axes):
      if isinstance(name, str) and not assigned[pos] and skipped[pos]:
        reasons = '; '.join(map(str, skipped[pos]))
        raise _errors.ShardingResolutionError(
          f'No rule fits dim {pos} ({name!r}){where_} '
          f'{_context_text(axes, shape, rules, mesh)}: {reasons}. Add a '
          f'fallback rule for {name!r} (a target that exists in the mesh and '
          f'divides the dimension, or None to replicate), or drop '
          '`strict=True` to leave it unsharded.'
        )
  dims = tuple(
    DimResolution(
      logical_name=name if isinstance(name, str) else None,
      target=(name if name is PartitionSpec.UNCONSTRAINED else targets[pos]),
      skipped=tuple(skipped[pos]),
    )
    for pos, name in enumerate(axes)
  )
  return Resolution(
    logical_axes=axes,
    shape=tuple(shape) if shape is not None else None,
    dims=dims,
  )


def _unfit(
  target: _logical.Target,
  pos: int,
  targets: Sequence[_logical.Target],
  assigned: Sequence[bool],
  labels: Sequence[Any],
  shape: Sequence[int] | None,
  sizes: dict[str, int] | None,
) -> str | None:
  """Why `target` cannot shard dim `pos`, or None if it can.

  Its mesh axes must not shard another (assigned) dim already, must exist
  in the mesh and must divide the dimension (when mesh and shape are known).
  """
  wanted = _partition_specs.axes_of(target)
  used_by = {
    m: i
    for i, t in enumerate(targets)
    if assigned[i] and i != pos
    for m in _partition_specs.axes_of(t)
  }
  clash = [m for m in wanted if m in used_by]
  if clash:
    i = used_by[clash[0]]
    return f'mesh axis {clash[0]!r} already shards dim {i} ({labels[i]!r})'
  if sizes is None:
    return None
  missing = [m for m in wanted if m not in sizes]
  if missing:
    return missing_reason(missing[0], sizes)
  if shape is not None:
    product = math.prod(sizes[m] for m in wanted)
    if shape[pos] % product:
      return (
        f'dim size {shape[pos]} is not divisible by {product} '
        f'(mesh axes {list(wanted)})'
      )
  return None


def missing_reason(axis: str, sizes: dict[str, int]) -> str:
  """Why a rule naming `axis`, which the mesh lacks, was skipped; with the
  mesh axis it likely meant (`_missing_axes.likely_meant`)."""
  reason = f'the mesh has no axis {axis!r} (axes: {list(sizes)})'
  meant = _missing_axes.likely_meant(axis, list(sizes))
  if meant is not None:
    reason += f', {_missing_axes.TYPO_REASON} {meant!r}'
  return reason


def fit_spec(
  entries: Sequence[_logical.Target],
  shape: Sequence[int] | None = None,
  *,
  mesh: _meshes.MeshLike | None = None,
  strict: bool = False,
  source: str = ANNOTATION,
  path: str | None = None,
) -> Resolution:
  """Fits mesh axes (one entry per dimension) to the mesh and the shape.

  By the checks of `resolve_dims`, in dimension order: an entry whose mesh
  axes the mesh lacks, do not divide the dimension, or already shard an
  earlier dimension replicates its dimension instead, recorded with the
  reason (eformer's ``get_corrected_named_sharding`` corrects the same
  way, silently).

  Raises:
    ShardingResolutionError: In strict mode, if an entry does not fit.
  """
  entries = tuple(entries)
  sizes = _meshes.axis_sizes(mesh) if mesh is not None else None
  labels = [f'spec {_partition_specs.format_entry(e)}' for e in entries]
  targets: list[_logical.Target] = [None] * len(entries)
  assigned = [False] * len(entries)
  skipped: list[tuple[SkippedCandidate, ...]] = [() for _ in entries]
  for pos, entry in enumerate(entries):
    if entry is None:
      continue
    reason = _unfit(entry, pos, targets, assigned, labels, shape, sizes)
    if reason is None:
      targets[pos], assigned[pos] = entry, True
      continue
    if strict:
      raise _errors.ShardingResolutionError(
        f'The mesh axes {_partition_specs.format_entry(entry)} of {source} cannot '
        f'shard dim {pos}{where(path)} (shape '
        f'{tuple(shape) if shape is not None else None}, '
        f"{_meshes.describe(mesh)}): {reason}. Change the rule's "
        'PartitionSpec, or drop `strict=True` to replicate that dimension.'
      )
    skipped[pos] = (SkippedCandidate(entry, reason),)
  return Resolution(
    logical_axes=entries,
    shape=tuple(shape) if shape is not None else None,
    dims=tuple(
      DimResolution(None, t, s) for t, s in zip(targets, skipped, strict=True)
    ),
    source=source,
    mesh_axes=True,
  )


FLAX_FIX_MSG = (
  "These rules were set with Flax's own context (a plain tuple), so Flax's "
  'semantics apply: the last rule for a name wins and a name no rule '
  'mentions is used as a mesh axis. Add or fix the rule, or set the rules '
  'with `fdt.logical_axis_rules(...)` for priority, fallbacks and checks.'
)
NO_RULES_FIX_MSG = (
  "No rules are in effect, so Flax's semantics apply: each name in an "
  "annotation is used as a mesh axis name. Annotate with the mesh's axis "
  'names, or set rules for the logical names with '
  '`fdt.logical_axis_rules(...)` (`fdt.LogicalRules.for_mesh_axes(mesh)` '
  'when the annotations already name mesh axes).'
)


def flax_fix(rules: _context.FlaxRules) -> str:
  """The fix for a resolution error under Flax's semantics."""
  return FLAX_FIX_MSG if rules.pairs else NO_RULES_FIX_MSG


def resolve_flax(
  logical_axes: _logical.LogicalAxes | PartitionSpec,
  shape: Sequence[int] | None = None,
  *,
  mesh: _meshes.MeshLike | None = None,
  rules: _context.FlaxRules,
  local_rules: Sequence[Any] | None = None,
  path: str | None = None,
) -> Resolution:
  """Resolves logical axes exactly as Flax NNX does, then checks the result.

  Flax composes the context rules with a variable's own ``sharding_rules``
  and maps each name through them as a dict (names without a rule pass
  through). Flax would fail, later and inside JAX, on a result naming a mesh
  axis the mesh lacks, one that does not divide its dimension, or a mesh
  axis used twice; these raise here, with the path.

  Raises:
    LogicalRulesError: If the context and the variable's rules disagree.
    UnknownLogicalAxisError: If the result names a mesh axis the mesh lacks.
    ShardingResolutionError: If there are more logical axes than
      dimensions, or a mesh axis does not divide its dimension or is used
      twice.
  """
  axes = tuple(logical_axes)
  where_ = where(path)
  axes = padded(axes, shape, where_)
  context = tuple(rules.pairs)
  local = tuple(local_rules or ())
  if context or local:
    try:
      composed = core_spmd.composite_rules(context, local)
    except ValueError as e:
      raise _errors.LogicalRulesError(
        f'The variable{where_} has `sharding_rules` {list(local)!r} that '
        f'contradict the context rules {list(context)!r}: {e}. Flax requires '
        'them to agree; fix one of them.'
      ) from e
    mapped = core_spmd.from_sharding_rules(axes, composed)
  else:
    mapped = axes
  targets = [tuple(t) if isinstance(t, list) else t for t in mapped]
  resolution = Resolution(
    logical_axes=axes,
    shape=tuple(shape) if shape is not None else None,
    dims=tuple(
      DimResolution(a if isinstance(a, str) else None, t)
      for a, t in zip(axes, targets, strict=True)
    ),
    semantics=FLAX_SEMANTICS,
  )
  if mesh is None:
    return resolution
  sizes = _meshes.axis_sizes(mesh)
  seen: dict[str, int] = {}
  for pos, target in enumerate(targets):
    if target is PartitionSpec.UNCONSTRAINED:
      continue
    wanted = _partition_specs.axes_of(target)
    missing = [m for m in wanted if m not in sizes]
    if missing:
      raise _errors.UnknownLogicalAxisError(
        f'Dim {pos} ({axes[pos]!r}){where_} maps to {missing[0]!r}, which is '
        f'not an axis of the mesh {_context_text(axes, shape, context, mesh)}'
        f'. {flax_fix(rules)}'
      )
    for m in wanted:
      if m in seen:
        raise _errors.ShardingResolutionError(
          f'Mesh axis {m!r} shards both dim {seen[m]} and dim {pos}{where_} '
          f'{_context_text(axes, shape, context, mesh)}. {flax_fix(rules)}'
        )
      seen[m] = pos
    if shape is not None:
      product = math.prod(sizes[m] for m in wanted)
      if shape[pos] % product:
        raise _errors.ShardingResolutionError(
          f'Dim {pos} ({axes[pos]!r}){where_} has size {shape[pos]}, which '
          f'{_partition_specs.format_entry(target)} (size {product}) does not divide '
          f'{_context_text(axes, shape, context, mesh)}. {flax_fix(rules)}'
        )
  return resolution


def resolve(
  logical_axes: _logical.LogicalAxes | PartitionSpec,
  shape: Sequence[int] | None = None,
  *,
  mesh: _meshes.MeshLike | None = None,
  rules: _logical.LogicalRules | _context.FlaxRules,
  local_rules: Sequence[Any] | None = None,
  path: str | None = None,
) -> Resolution:
  """Resolves with the semantics `rules` call for (see `rules_in_effect`).

  Args:
    logical_axes: One entry per array dimension: a logical name, or None.
    shape: The array's shape; enables the divisibility check.
    mesh: The mesh; enables the existence check.
    rules: The rules in effect.
    local_rules: A variable's own ``sharding_rules`` metadata: ahead of
      `rules` (flax_dtensor), or composed with them (Flax).
    path: The variable path, for error messages.
  """
  if isinstance(rules, _context.FlaxRules):
    if isinstance(local_rules, _logical.LogicalRules) and not rules.pairs:
      rules = local_rules
      local_rules = None
    else:
      return resolve_flax(
        logical_axes,
        shape,
        mesh=mesh,
        rules=rules,
        local_rules=local_rules,
        path=path,
      )
  if mesh is not None:
    _missing_axes.check_on_mesh(rules, _meshes.axis_sizes(mesh))
  if local_rules:
    rules = rules.prepend(tuple(local_rules))
  return resolve_dims(logical_axes, shape, mesh=mesh, rules=rules, path=path)


def logical_to_mesh_axes(
  logical_axes: _logical.LogicalAxes | PartitionSpec,
  shape: Sequence[int] | None = None,
  *,
  mesh: _meshes.MeshLike | None = None,
  rules: _logical.RulesLike | None = None,
) -> PartitionSpec:
  """Resolves logical axis names to a `PartitionSpec` of mesh axes.

  Rules are scanned in order; a rule claims its dimension when the dimension
  is still unassigned and none of its mesh axes is used by another dimension
  (Flax Linen's priority semantics). With a mesh, a rule naming a mesh axis
  the mesh lacks is skipped; with a shape, a rule whose mesh-axis product does
  not divide the dimension is skipped. The next rule for the same name is the
  fallback. A dimension with no fitting rule stays unsharded (or raises, with
  ``strict=True`` rules).

  Args:
    logical_axes: One entry per dimension: a logical name or None.
    shape: The array's shape, for the divisibility check.
    mesh: The mesh to resolve against. Defaults to the mesh set by
      ``jax.set_mesh``, if any.
    rules: The rules. Defaults to the rules in effect: those of
      `logical_axis_rules`, or, when they were set with Flax's own context,
      Flax's semantics (see the concepts page).

  Returns:
    The PartitionSpec, with None for unsharded dimensions.

  Raises:
    UnknownLogicalAxisError: If a name is in no rule (see `LogicalRules`).
    ShardingResolutionError: If a name repeats, there are more names than
      dimensions, or in strict mode no rule fits a dimension.
    MissingMeshAxisError: If the rules say ``missing_mesh_axes='error'``
      and one names a mesh axis the mesh lacks.

  Warns:
    LikelyTypoWarning: Once per rules and mesh, if a rule names a mesh axis
      the mesh lacks, spelled like one it has.

  Example:
    >>> import jax, flax_dtensor as fdt
    >>> rules = [('mlp', 'model'), ('mlp', 'data'), ('embed', None)]
    >>> mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
    >>> fdt.logical_to_mesh_axes(('embed', 'mlp'), (512, 6), mesh=mesh,
    ...                          rules=rules)
    P(None, 'data')
  """
  mesh = _meshes.mesh_for(mesh=mesh)
  resolution = resolve(
    logical_axes, shape, mesh=mesh, rules=_context.rules_in_effect(rules)
  )
  return resolution.spec
