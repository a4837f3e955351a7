"""Logical-axis rules: the rule set, its thread-local context, and resolution.

A rule set is an ordered sequence of ``(logical_name, target)`` pairs. The
target is a mesh axis name, a tuple of mesh axis names (one array dimension
sharded over their product), or ``None`` (replicate). Resolution follows Flax
Linen's ``logical_to_mesh_axes`` priority semantics, extended with knowledge of
the mesh and of the array's shape: rules are scanned in order, and a rule
claims its array dimension when that dimension is still unassigned, none of its
mesh axes is used by another dimension of the same array, every mesh axis it
names exists in the mesh, and the product of their sizes divides the
dimension. A rule that fails one of the last two checks is a *skipped
candidate*; the next rule for the same logical name is its fallback.

The rules live in Flax's own thread-local rules holder
(``flax.core.spmd.logical_axis_rules``), so there is a single source of truth:
Flax Linen's ``nn.logical_to_mesh_axes`` and Flax NNX read the same rules.
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import functools
import math
import os
import pathlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar

import jax
import yaml
from flax.core import spmd as core_spmd
from jax.sharding import PartitionSpec

from flax_dtensor import _errors

Target = str | tuple[str, ...] | None
LogicalAxes = Sequence[str | None]
Unknown = Literal['error', 'replicate']

_UNKNOWN_CHOICES = ('error', 'replicate')

RULES_FIX_MSG = (
  'Each rule is a pair (logical_name, target) where logical_name is a str '
  'and target is a mesh axis name, a list/tuple of mesh axis names, or None '
  "(replicate), e.g. [('batch', 'data'), ('embed', ('data', 'model')), "
  "('vocab', None)]."
)


def _normalize_target(target: Any, where: str) -> Target:
  """Returns a target as a str, a tuple of >= 2 str, or None."""
  if target is None or isinstance(target, str):
    return target
  if isinstance(target, collections.abc.Sequence) and not isinstance(
    target, bytes
  ):
    if not all(isinstance(t, str) for t in target):
      raise _errors.RuleTargetTypeError(
        f'{where}: expected a mesh axis name, a sequence of mesh axis names, '
        f'or None; got a sequence containing non-str items: {target!r}. '
        f'{RULES_FIX_MSG}'
      )
    if len(target) == 0:
      return None
    if len(target) == 1:
      return target[0]
    if len(set(target)) != len(target):
      raise _errors.LogicalRulesError(
        f'{where}: target {target!r} names a mesh axis more than once. '
        'A mesh axis can shard a dimension only once; remove the repeat.'
      )
    return tuple(target)
  raise _errors.RuleTargetTypeError(
    f'{where}: expected a mesh axis name, a sequence of mesh axis names, or '
    f'None; got {type(target).__name__} {target!r}. {RULES_FIX_MSG}'
  )


def target_axes(target: Target) -> tuple[str, ...]:
  """Returns the mesh axes a normalized target names, in order."""
  if target is None:
    return ()
  if isinstance(target, str):
    return (target,)
  return target


class LogicalRules(tuple):
  """An immutable, ordered set of logical-to-mesh axis rules.

  A logical name may appear several times: the first entry is its preferred
  target and later entries are fallbacks, tried when an earlier candidate
  names a mesh axis the mesh lacks, does not divide the dimension, or uses a
  mesh axis already taken by another dimension of the same array.

  ``LogicalRules`` is a tuple of ``(name, target)`` pairs, so Flax Linen's
  ``nn.logical_to_mesh_axes`` and Flax's rules context accept it unchanged.

  Args:
    pairs: A sequence of ``(logical_name, target)`` pairs, a mapping from
      logical names to targets, or another ``LogicalRules``.
    unknown: What to do with a logical name that no rule mentions:
      ``'error'`` (the default) raises `UnknownLogicalAxisError`,
      ``'replicate'`` leaves that dimension unsharded (Linen's behaviour).
    strict: If true, a dimension whose every candidate was skipped raises
      `ShardingResolutionError` instead of staying unsharded.

  Raises:
    LogicalRulesError: If a pair is malformed or an option is invalid.
    RuleTargetTypeError: If a target is not a str, a sequence of str or None.

  Example:
    >>> import flax_dtensor as fdt
    >>> rules = fdt.LogicalRules([('embed', 'fsdp'), ('mlp', 'model'),
    ...                           ('mlp', 'data'), ('vocab', None)])
    >>> rules.candidates('mlp')
    ('model', 'data')
  """

  __unknown: Unknown
  __strict: bool

  def __new__(
    cls,
    pairs: Sequence[tuple[str, Any]] | Mapping[str, Any] = (),
    *,
    unknown: Unknown | None = None,
    strict: bool | None = None,
  ) -> LogicalRules:
    if isinstance(pairs, LogicalRules):
      unknown = pairs.unknown if unknown is None else unknown
      strict = pairs.strict if strict is None else strict
    if unknown is None:
      unknown = 'error'
    if strict is None:
      strict = False
    if unknown not in _UNKNOWN_CHOICES:
      raise _errors.LogicalRulesError(
        f'`unknown` must be one of {_UNKNOWN_CHOICES}; got {unknown!r}.'
      )
    if not isinstance(strict, bool):
      raise _errors.LogicalRulesError(
        f'`strict` must be a bool; got {strict!r}.'
      )
    if isinstance(pairs, Mapping):
      items = list(pairs.items())
    elif isinstance(pairs, (str, bytes)) or not isinstance(
      pairs, collections.abc.Iterable
    ):
      raise _errors.LogicalRulesError(
        f'Expected a sequence of (logical_name, target) pairs or a dict; '
        f'got {type(pairs).__name__} {pairs!r}. {RULES_FIX_MSG}'
      )
    else:
      items = list(pairs)
    normalized = []
    for i, pair in enumerate(items):
      where = f'rule {i} {pair!r}'
      if (
        isinstance(pair, (str, bytes))
        or not isinstance(pair, collections.abc.Sequence)
        or len(pair) != 2
      ):
        raise _errors.LogicalRulesError(
          f'{where}: expected a (logical_name, target) pair. {RULES_FIX_MSG}'
        )
      name, target = pair
      if not isinstance(name, str) or not name:
        raise _errors.LogicalRulesError(
          f'{where}: the logical name must be a non-empty str; got '
          f'{name!r}. {RULES_FIX_MSG}'
        )
      normalized.append((name, _normalize_target(target, where)))
    self = super().__new__(cls, normalized)
    object.__setattr__(self, '_LogicalRules__unknown', unknown)
    object.__setattr__(self, '_LogicalRules__strict', strict)
    return self

  def __setattr__(self, name: str, value: Any) -> None:
    raise AttributeError('LogicalRules is immutable; use `.replace(...)`.')

  def __delattr__(self, name: str) -> None:
    raise AttributeError('LogicalRules is immutable.')

  def __reduce__(self):
    return (
      _rebuild,
      (tuple(self), self.unknown, self.strict),
    )

  @property
  def unknown(self) -> Unknown:
    """What happens to a logical name no rule mentions."""
    return self.__unknown

  @property
  def strict(self) -> bool:
    """Whether a dimension with no fitting candidate raises."""
    return self.__strict

  @property
  def names(self) -> tuple[str, ...]:
    """The logical names the rules mention, in first-mention order."""
    return tuple(dict.fromkeys(name for name, _ in self))

  def candidates(self, name: str) -> tuple[Target, ...]:
    """Returns the targets for `name`, in priority order."""
    return tuple(target for n, target in self if n == name)

  def replace(
    self, *, unknown: Unknown | None = None, strict: bool | None = None
  ) -> LogicalRules:
    """Returns a copy with some options changed."""
    return LogicalRules(self, unknown=unknown, strict=strict)

  def prepend(self, pairs: Sequence[tuple[str, Any]]) -> LogicalRules:
    """Returns rules where `pairs` take priority over these rules."""
    if not pairs:
      return self
    return LogicalRules(
      [*LogicalRules(pairs), *self], unknown=self.unknown, strict=self.strict
    )

  def __eq__(self, other: object) -> bool:
    if isinstance(other, LogicalRules):
      return (
        tuple(self) == tuple(other)
        and self.unknown == other.unknown
        and self.strict == other.strict
      )
    return tuple.__eq__(self, other)

  def __ne__(self, other: object) -> bool:
    return not self == other

  def __hash__(self) -> int:
    # Hash like the plain tuple of pairs, which compares equal to it.
    return tuple.__hash__(self)

  def __repr__(self) -> str:
    options = ''
    if self.unknown != 'error':
      options += f', unknown={self.unknown!r}'
    if self.strict:
      options += ', strict=True'
    return f'LogicalRules({list(self)!r}{options})'

  @classmethod
  def from_yaml(
    cls,
    path_or_text: str | os.PathLike[str],
    *,
    unknown: Unknown | None = None,
    strict: bool | None = None,
  ) -> LogicalRules:
    """Reads rules in MaxText's format with YAML's safe loader.

    Accepts a document with a ``logical_axis_rules`` key (MaxText's
    ``base.yml``) or a bare list of pairs::

      logical_axis_rules: [['batch', ['data', 'fsdp']],
                           ['embed', 'fsdp'],
                           ['vocab', []]]

    Args:
      path_or_text: A path to a YAML file, or the YAML text itself.
      unknown: See `LogicalRules`.
      strict: See `LogicalRules`.

    Returns:
      The rules.

    Raises:
      LogicalRulesError: If the file is not valid YAML or holds no rules.
    """
    text = None
    source = 'YAML text'
    if isinstance(path_or_text, os.PathLike):
      path = pathlib.Path(path_or_text)
    elif '\n' not in path_or_text and (
      path_or_text.endswith(('.yml', '.yaml'))
      or pathlib.Path(path_or_text).is_file()
    ):
      path = pathlib.Path(path_or_text)
    else:
      path = None
      text = path_or_text
    if path is not None:
      source = str(path)
      try:
        text = path.read_text()
      except OSError as e:
        raise _errors.LogicalRulesError(
          f'Cannot read rules file {source!r}: {e.strerror}. Pass the path '
          'of a YAML file or the YAML text itself.'
        ) from e
    try:
      document = yaml.safe_load(text)
    except yaml.YAMLError as e:
      raise _errors.LogicalRulesError(
        f"{source} is not valid YAML: {e}. Expected MaxText's format, e.g. "
        "logical_axis_rules: [['batch', 'data'], ['embed', 'fsdp']]."
      ) from e
    if isinstance(document, Mapping):
      if 'logical_axis_rules' not in document:
        raise _errors.LogicalRulesError(
          f'{source} has no `logical_axis_rules` key (keys: '
          f"{sorted(map(str, document))}). Expected MaxText's format, e.g. "
          "logical_axis_rules: [['batch', 'data'], ['embed', 'fsdp']]."
        )
      document = document['logical_axis_rules']
    if path is None and isinstance(document, str) and '\n' not in text:
      raise _errors.LogicalRulesError(
        f'No rules file {path_or_text!r}: expected the path of an existing '
        'YAML file or YAML text holding a list of [logical_name, target] '
        'pairs. Check the path (it was read as YAML text because no such '
        'file exists).'
      )
    if not isinstance(document, list):
      raise _errors.LogicalRulesError(
        f'{source}: expected a list of [logical_name, target] pairs; got '
        f'{type(document).__name__} {document!r}. {RULES_FIX_MSG}'
      )
    return cls(document, unknown=unknown, strict=strict)


def _rebuild(pairs, unknown, strict) -> LogicalRules:
  return LogicalRules(pairs, unknown=unknown, strict=strict)


RulesLike = LogicalRules | Sequence[tuple[str, Any]] | Mapping[str, Any]


# Context
# ------------------------------------------------------------------------------


def current_rules() -> LogicalRules | None:
  """Returns the rules in effect in this thread, or None.

  Rules set with Flax's own ``nnx.logical_axis_rules`` are read too and
  returned as `LogicalRules`.
  """
  rules = core_spmd.get_logical_axis_rules()
  if isinstance(rules, LogicalRules):
    return rules
  if not rules:
    return None
  return LogicalRules(rules)


def active_rules() -> LogicalRules | None:
  """Returns the rules if a flax_dtensor context is active, else None.

  Unlike `current_rules`, rules set with Flax's own context do not count:
  those keep Flax's own semantics.
  """
  rules = core_spmd.get_logical_axis_rules()
  return rules if isinstance(rules, LogicalRules) else None


def get_logical_axis_rules() -> LogicalRules | None:
  """Returns the logical-axis rules in effect in this thread, or None.

  Example:
    >>> import flax_dtensor as fdt
    >>> with fdt.logical_axis_rules([('embed', 'data')]):
    ...   fdt.get_logical_axis_rules()
    LogicalRules([('embed', 'data')])
    >>> fdt.get_logical_axis_rules() is None
    True
  """
  return current_rules()


def set_logical_axis_rules(rules: RulesLike | None) -> None:
  """Sets the logical-axis rules of this thread until changed again.

  Prefer the `logical_axis_rules` context manager, which restores the outer
  rules on exit. ``None`` clears the rules.

  Args:
    rules: The rules, or None.

  Raises:
    LogicalRulesError: If the rules are malformed.
    RuleTargetTypeError: If a target is not a str, a sequence of str or None.
  """
  if rules is None:
    core_spmd.set_logical_axis_rules(())
    return
  core_spmd.set_logical_axis_rules(LogicalRules(rules))


@contextlib.contextmanager
def logical_axis_rules(rules: RulesLike) -> Iterator[LogicalRules]:
  """Sets the logical-axis rules of the current thread within a block.

  The rules are thread-local: other threads never see them (use `propagate`
  to hand them to a worker). Nesting replaces the outer rules and restores
  them on exit, also when the block raises. While the block is active, NNX
  variables annotated with logical axes (``nnx.with_partitioning``) are
  placed at creation by these rules, and Flax's ``nnx.get_partition_spec``
  reports the same placement.

  Args:
    rules: A `LogicalRules`, or anything its constructor accepts.

  Yields:
    The rules as `LogicalRules`.

  Raises:
    LogicalRulesError: If the rules are malformed.
    RuleTargetTypeError: If a target is not a str, a sequence of str or None.

  Example:
    >>> import flax_dtensor as fdt
    >>> with fdt.logical_axis_rules([('batch', 'data'), ('mlp', 'model')]):
    ...   fdt.logical_to_mesh_axes(('batch', 'mlp'))
    P('data', 'model')
  """
  rules = LogicalRules(rules)
  with core_spmd.logical_axis_rules(rules):
    yield rules


def resolve_rules(rules: RulesLike | None) -> LogicalRules | None:
  """Returns `rules` as LogicalRules, or the current rules when None."""
  if rules is None:
    return current_rules()
  return LogicalRules(rules)


# Mesh helpers
# ------------------------------------------------------------------------------

MeshLike = jax.sharding.Mesh | jax.sharding.AbstractMesh


def _mesh_context() -> tuple[
  jax.sharding.AbstractMesh | None, jax.sharding.Mesh | None
]:
  """The (abstract, concrete) meshes of this thread's context, or None."""
  abstract = jax.sharding.get_abstract_mesh()
  try:
    concrete = jax.sharding.get_mesh()
  except ValueError:  # Inside jit only the abstract mesh is known.
    concrete = None
  return (
    None if abstract.empty else abstract,
    None if concrete is None or concrete.empty else concrete,
  )


def current_mesh() -> MeshLike | None:
  """Returns the mesh set by ``jax.set_mesh`` (abstract inside jit), or None.

  The concrete mesh when it is the one in effect, else the abstract mesh
  (inside ``jit``, or under ``jax.sharding.use_abstract_mesh``).
  """
  abstract, concrete = _mesh_context()
  if abstract is None:
    return None
  if concrete is not None and concrete.abstract_mesh == abstract:
    return concrete
  return abstract


def mesh_axis_sizes(mesh: MeshLike) -> dict[str, int]:
  return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))


def describe_mesh(mesh: MeshLike | None) -> str:
  if mesh is None:
    return 'no mesh'
  sizes = ', '.join(f'{n}={s}' for n, s in mesh_axis_sizes(mesh).items())
  types = ', '.join(str(t).rsplit('.', 1)[-1] for t in mesh.axis_types)
  return f'mesh({sizes}; {types})'


# Resolution
# ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SkippedCandidate:
  """A rule that could not shard a dimension, and why."""

  target: Target
  reason: str

  def __str__(self) -> str:
    return f'{_format_target(self.target)}: {self.reason}'


@dataclasses.dataclass(frozen=True)
class DimResolution:
  """How one array dimension was resolved."""

  logical_name: str | None
  target: Target
  skipped: tuple[SkippedCandidate, ...] = ()
  rule_found: bool = True

  @property
  def fell_back(self) -> bool:
    """Whether a preferred candidate was skipped for this dimension."""
    return bool(self.skipped)


@dataclasses.dataclass(frozen=True)
class Resolution:
  """The resolved PartitionSpec of one array and the reasons behind it."""

  logical_axes: tuple[Any, ...]
  shape: tuple[int, ...] | None
  dims: tuple[DimResolution, ...]

  @property
  def spec(self) -> PartitionSpec:
    return PartitionSpec(*(d.target for d in self.dims))

  @property
  def skipped(self) -> tuple[tuple[int, SkippedCandidate], ...]:
    """Every skipped candidate, with the index of its dimension."""
    return tuple((i, s) for i, d in enumerate(self.dims) for s in d.skipped)


def _format_target(target: Target) -> str:
  if target is None:
    return 'None'
  if isinstance(target, str):
    return repr(target)
  return '(' + ', '.join(map(repr, target)) + ')'


def _where(path: str | None) -> str:
  return f' at {path}' if path else ''


def _context_text(
  logical_axes: Any,
  shape: Sequence[int] | None,
  rules: LogicalRules | None,
  mesh: MeshLike | None,
) -> str:
  shape_text = f', shape {tuple(shape)}' if shape is not None else ''
  return (
    f'(logical axes {tuple(logical_axes)!r}{shape_text}, rules '
    f'{list(rules) if rules is not None else None!r}, {describe_mesh(mesh)})'
  )


def resolve(
  logical_axes: LogicalAxes | PartitionSpec,
  shape: Sequence[int] | None = None,
  *,
  mesh: MeshLike | None = None,
  rules: LogicalRules,
  path: str | None = None,
) -> Resolution:
  """Resolves logical axes to mesh axes; see the module docstring.

  Args:
    logical_axes: One entry per array dimension: a logical name, or None.
    shape: The array's shape; enables the divisibility check.
    mesh: The mesh; enables the existence check. None skips it.
    rules: The rules.
    path: The variable path, for error messages.

  Returns:
    The resolution, with every skipped candidate and its reason.

  Raises:
    ShardingResolutionError: If a logical name repeats, the number of logical
      axes does not match the rank, an entry is not a str or None, or (in
      strict mode) a dimension has no fitting candidate.
    UnknownLogicalAxisError: If a logical name is in no rule and
      ``rules.unknown == 'error'``.
  """
  axes = tuple(logical_axes)
  where = _where(path)
  if shape is not None and len(axes) != len(shape):
    raise _errors.ShardingResolutionError(
      f'Expected one logical axis per dimension{where}: the array has shape '
      f'{tuple(shape)} (rank {len(shape)}) but got {len(axes)} logical axes '
      f'{axes!r}. Fix the annotation, e.g. nnx.with_partitioning(init, '
      f'{tuple(["..."] * len(shape))!r}).'
    )
  for a in axes:
    if not (
      a is None or isinstance(a, str) or a is PartitionSpec.UNCONSTRAINED
    ):
      raise _errors.ShardingResolutionError(
        f'Expected each logical axis{where} to be a str or None; got {a!r} '
        f'in {axes!r}. Name one logical axis per dimension; map a logical '
        f'name to several mesh axes in the rules instead, e.g. '
        f"('embed', ('data', 'model'))."
      )
  counts = collections.Counter(a for a in axes if isinstance(a, str))
  dups = sorted(a for a, c in counts.items() if c > 1)
  if dups:
    raise _errors.ShardingResolutionError(
      f'Logical axis name(s) {dups} occur more than once{where} '
      f'{_context_text(axes, shape, rules, mesh)}. A mesh axis can shard '
      'only one dimension of an array: give each dimension its own logical '
      "name, e.g. ('embed', 'embed_out')."
    )
  known = set(rules.names)
  unknown = [a for a in axes if isinstance(a, str) and a not in known]
  if unknown and rules.unknown == 'error':
    suggestions = ', '.join(f'({a!r}, None)' for a in unknown)
    raise _errors.UnknownLogicalAxisError(
      f'Logical axis name(s) {unknown} are not mentioned by any rule{where} '
      f'{_context_text(axes, shape, rules, mesh)}. Add a rule for each, e.g. '
      f'{suggestions} to replicate, or pass `unknown="replicate"` to '
      'LogicalRules to replicate every unmentioned name.'
    )
  sizes = mesh_axis_sizes(mesh) if mesh is not None else None

  targets: list[Target] = [None] * len(axes)
  assigned = [not isinstance(a, str) for a in axes]
  skipped: list[list[SkippedCandidate]] = [[] for _ in axes]
  for name, target in rules:
    if name not in axes:
      continue
    pos = axes.index(name)
    if assigned[pos]:
      continue
    wanted = target_axes(target)
    used_by = {
      m: i
      for i, t in enumerate(targets)
      if assigned[i] and i != pos
      for m in target_axes(t)
    }
    clash = [m for m in wanted if m in used_by]
    if clash:
      i = used_by[clash[0]]
      reason = f'mesh axis {clash[0]!r} already shards dim {i} ({axes[i]!r})'
      skipped[pos].append(SkippedCandidate(target, reason))
      continue
    if sizes is not None:
      missing = [m for m in wanted if m not in sizes]
      if missing:
        reason = f'the mesh has no axis {missing[0]!r} (axes: {list(sizes)})'
        skipped[pos].append(SkippedCandidate(target, reason))
        continue
      if shape is not None:
        product = math.prod(sizes[m] for m in wanted)
        if shape[pos] % product:
          reason = (
            f'dim size {shape[pos]} is not divisible by {product} '
            f'(mesh axes {list(wanted)})'
          )
          skipped[pos].append(SkippedCandidate(target, reason))
          continue
    targets[pos] = target
    assigned[pos] = True

  if rules.strict:
    for pos, name in enumerate(axes):
      if isinstance(name, str) and not assigned[pos] and skipped[pos]:
        reasons = '; '.join(map(str, skipped[pos]))
        raise _errors.ShardingResolutionError(
          f'No rule fits dim {pos} ({name!r}){where} '
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
      rule_found=not isinstance(name, str) or name in known,
    )
    for pos, name in enumerate(axes)
  )
  return Resolution(
    logical_axes=axes,
    shape=tuple(shape) if shape is not None else None,
    dims=dims,
  )


def logical_to_mesh_axes(
  logical_axes: LogicalAxes | PartitionSpec,
  shape: Sequence[int] | None = None,
  *,
  mesh: MeshLike | None = None,
  rules: RulesLike | None = None,
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
    rules: The rules. Defaults to those of the current `logical_axis_rules`
      context.

  Returns:
    The PartitionSpec, with None for unsharded dimensions.

  Raises:
    UnknownLogicalAxisError: If a name is in no rule (see `LogicalRules`).
    ShardingResolutionError: If a name repeats, the rank does not match, or
      in strict mode no rule fits a dimension.

  Example:
    >>> import jax, flax_dtensor as fdt
    >>> rules = [('mlp', 'model'), ('mlp', 'data'), ('embed', None)]
    >>> mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
    >>> fdt.logical_to_mesh_axes(('embed', 'mlp'), (512, 6), mesh=mesh,
    ...                          rules=rules)
    P(None, 'data')
  """
  resolved_rules = resolve_rules(rules)
  if resolved_rules is None:
    resolved_rules = LogicalRules(())
  if mesh is None:
    mesh = current_mesh()
  return resolve(logical_axes, shape, mesh=mesh, rules=resolved_rules).spec


# Threads
# ------------------------------------------------------------------------------

C = TypeVar('C', bound=Callable[..., Any])


def propagate(fn: C) -> C:
  """Wraps `fn` so it runs with the caller's rules and mesh in any thread.

  Rules and ``jax.set_mesh`` meshes are thread-local: a new thread starts
  with none. ``propagate`` captures both when it is called and re-enters
  them around every call of the wrapper, so a worker thread sees exactly
  the caller's context (and nothing leaks back).

  Args:
    fn: The callable to run in another thread.

  Returns:
    A wrapper with the same signature.

  Example:
    >>> import concurrent.futures, flax_dtensor as fdt
    >>> with fdt.logical_axis_rules([('embed', 'data')]):
    ...   work = fdt.propagate(fdt.get_logical_axis_rules)
    >>> with concurrent.futures.ThreadPoolExecutor() as pool:
    ...   pool.submit(work).result()
    LogicalRules([('embed', 'data')])
  """
  rules = core_spmd.get_logical_axis_rules()
  abstract, concrete = _mesh_context()

  @functools.wraps(fn)
  def wrapper(*args: Any, **kwargs: Any) -> Any:
    with contextlib.ExitStack() as stack:
      if concrete is not None:
        stack.enter_context(jax.set_mesh(concrete))
      if abstract is not None and (
        concrete is None or concrete.abstract_mesh != abstract
      ):
        stack.enter_context(jax.sharding.use_abstract_mesh(abstract))
      stack.enter_context(core_spmd.logical_axis_rules(rules))
      return fn(*args, **kwargs)

  return wrapper  # type: ignore[return-value]
