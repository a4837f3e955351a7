"""Rule linting: findings about rules, a model and a mesh, for CI.

Each finding has a stable code, so a project can allow one deliberately
(``allow=('unused-rule',)``), and the report is readable JSON. Logical
rules, path rules and the variables they leave whole are all checked.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import jax

from flax_dtensor import _errors, _text
from flax_dtensor._placement import _init, _placing, _trees, _variables
from flax_dtensor._planning import (
  _plan,
  _plan_build,
  _plan_view,
  _suggest_forward,
)
from flax_dtensor._rules import (
  _context,
  _logical,
  _meshes,
  _missing_axes,
  _partition_specs,
  _path_rules,
  _resolution,
  _spec,
)

CODES = {
  'unused-rule': 'a logical name in the rules that no variable uses',
  'shadowed-rule': 'a rule that an earlier rule for its name always beats',
  'unknown-mesh-axis': (
    'a rule naming a mesh axis the mesh lacks (a fallback the rules intend)'
  ),
  'mesh-axis-typo': (
    'a rule naming a mesh axis the mesh lacks, spelled like one it has'
  ),
  'unknown-logical-name': (
    'a logical name a variable has that no rule mentions (replicated)'
  ),
  'replicated-large': 'a large variable the rules leave whole on every device',
  'over-budget': 'bytes per device above the budget',
  'unmatched-path-rule': 'a path rule whose pattern matches no variable',
  'shadowed-path-rule': (
    'a path rule every variable it matches is taken by an earlier path '
    'rule or an annotation'
  ),
  'unannotated-replicated': (
    'a large variable that neither an annotation nor a path rule covers'
  ),
  'eager-sharding-off': (
    'a variable the rules shard, created unplaced (or, built from a '
    'factory, to be created unplaced) because eager sharding is off'
  ),
  'activation-axis-clash': (
    "an Explicit mesh axis that the activations' batch name and a "
    "variable's last (output) dimension both take: a matmul of the two is "
    'illegally sharded under JAX'
  ),
  'short-annotation': (
    'an annotation with fewer logical names than dimensions (the missing '
    'trailing ones are None)'
  ),
}
"""Every finding's code, and what it means."""

DEFAULT_MIN_BYTES = 2**20
"""Variables from this size on are reported when replicated (1 MiB)."""


@dataclasses.dataclass(frozen=True)
class Finding:
  """One finding.

  Attributes:
    code: Its stable code (a key of `CODES`).
    subject: What it is about: a rule ``('mlp', 'data')``, a variable path,
      or ``'per device'``.
    message: What is wrong and how to fix it.
  """

  code: str
  subject: str
  message: str

  def to_dict(self) -> dict[str, str]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class CheckReport:
  """The findings of `check`; false when there are none.

  Attributes:
    findings: Every finding not allowed, rules first, then variables.
    allowed: The codes that were allowed (not reported).
  """

  findings: tuple[Finding, ...]
  allowed: tuple[str, ...] = ()

  def __bool__(self) -> bool:
    return bool(self.findings)

  def codes(self) -> tuple[str, ...]:
    """The codes found, each once, in order."""
    return tuple(dict.fromkeys(f.code for f in self.findings))

  def to_dict(self) -> dict[str, Any]:
    return {
      'findings': [f.to_dict() for f in self.findings],
      'allowed': list(self.allowed),
    }

  def to_json(self, **kwargs: Any) -> str:
    return json.dumps(self.to_dict(), **kwargs)

  def __str__(self) -> str:
    if not self.findings:
      return 'No findings.'
    lines = [f'{len(self.findings)} findings:']
    lines += [f'  [{f.code}] {f.subject}: {f.message}' for f in self.findings]
    return '\n'.join(lines)

  __repr__ = __str__

  def render(self, width: int) -> str:
    """`str(self)` in lines of at most `width` columns: each finding broken
    at its spaces, its later lines indented under its text."""
    lines = str(self).splitlines()
    out = lines[:1]
    for line in lines[1:]:
      out += _text.hanging_lines(line.strip(), width, indent=2, hanging=6)
    return '\n'.join(out)


def _rule_findings(
  rules: _logical.LogicalRules | _context.FlaxRules,
  used: set[str],
  sizes: dict[str, int] | None,
) -> list[Finding]:
  """Findings about the rules themselves, under their own semantics."""
  flax = isinstance(rules, _context.FlaxRules)
  pairs = [(n, _flax_target(t)) for n, t in rules.pairs] if flax else rules
  out = []
  names = list(dict.fromkeys(n for n, _ in pairs))
  for name in names:
    if name not in used:
      # A variable's name spelled like this rule's: a typo on one side.
      hint = _missing_axes.meant_hint(name, sorted(used - set(names)))
      out.append(
        Finding(
          'unused-rule',
          repr(name),
          f'no variable has the logical axis {name!r}{hint}. Remove its '
          "rules, or allow 'unused-rule' if activations use it "
          '(with_logical_constraint).',
        )
      )
  missing = _missing_axis_findings(rules, sizes)
  last = {name: i for i, (name, _) in enumerate(pairs)}
  seen: dict[str, list[Any]] = {}
  for i, (name, target) in enumerate(pairs):
    earlier = seen.setdefault(name, [])
    if flax and last[name] != i:
      out.append(
        Finding(
          'shadowed-rule',
          _missing_axes.rule_text(name, target),
          f'the later rule {_missing_axes.rule_text(name, pairs[last[name]][1])} wins: '
          "these rules were set with Flax's own context, which applies them "
          'as a dict (the last rule for a name wins, no fallbacks), so this '
          'one never applies. Remove it, or set the rules with '
          '`fdt.logical_axis_rules(...)` for priority and fallbacks.',
        )
      )
    winners = [t for t in earlier if t is None or t == target]
    if winners and not flax:
      winner = winners[0]
      why = (
        'replicates, which always fits'
        if winner is None
        else 'is the same rule, and is tried first'
      )
      out.append(
        Finding(
          'shadowed-rule',
          _missing_axes.rule_text(name, target),
          f'the earlier rule {_missing_axes.rule_text(name, winner)} {why}, so this one '
          'never applies. Remove it, or move it before that rule.',
        )
      )
    earlier.append(target)
    if sizes is not None and flax:
      for axis in _partition_specs.axes_of(target):
        if axis not in sizes:
          meant = _missing_axes.likely_meant(axis, list(sizes))
          hint = f' Did you mean {meant!r}?' if meant else ''
          out.append(
            Finding(
              'unknown-mesh-axis',
              _missing_axes.rule_text(name, target),
              f'the mesh has no axis {axis!r} (axes: {list(sizes)}), so '
              f'Flax will fail to create a variable with it.{hint} Fix the '
              'name, or remove the rule.',
            )
          )
    if not flax:  # Where the rule is, among the findings.
      out += missing.pop(_missing_axes.rule_text(name, target), [])
  # Those of path rules.
  out += [f for found in missing.values() for f in found]
  return out


def _unknown_name_findings(
  rules: Any, entries: Sequence[_plan.PlanEntry]
) -> list[Finding]:
  """An `unknown-logical-name` for each logical name that no rule mentions
  (our semantics: replicated, or an error unless ``unknown='replicate'``),
  with "did you mean" for one spelled like a rule's."""
  out = []
  for name, paths in _plan_build.unknown_names(entries, rules).items():
    hint = _missing_axes.meant_hint(name, rules.names)
    fails = (
      'creating it fails' if rules.unknown == 'error' else 'it is replicated'
    )
    out.append(
      Finding(
        'unknown-logical-name',
        repr(name),
        f'{_text.count(len(paths), "variable")} (e.g. {paths[0]}) '
        f'{"has" if len(paths) == 1 else "have"} the logical axis {name!r}, '
        f'which no rule mentions, so {fails}{hint}. '
        f'Fix the name, or add a rule for it (e.g. ({name!r}, None) to '
        'replicate).',
      )
    )
  return out


def _missing_axis_findings(
  rules: Any, sizes: dict[str, int] | None
) -> dict[str, list[Finding]]:
  """{rule: a `mesh-axis-typo` for each mesh axis it names that the mesh
  lacks, spelled like one it has, an `unknown-mesh-axis` for any other}."""
  out: dict[str, list[Finding]] = {}
  if sizes is None or not isinstance(rules, _logical.LogicalRules):
    return out
  for m in _missing_axes.missing_axes(rules, list(sizes)):
    found = out.setdefault(m.rule, [])
    lacks = f'the mesh has no axis {m.axis!r} (axes: {list(sizes)}), so'
    if m.typo:
      found.append(
        Finding(
          'mesh-axis-typo',
          m.rule,
          f'{lacks} this rule is always skipped and its variables fall '
          f'back (often to replication). Did you mean {m.meant!r}? Fix the '
          'name.',
        )
      )
    else:
      found.append(
        Finding(
          'unknown-mesh-axis',
          m.rule,
          f'{lacks} this rule is always skipped. Fix the name, or remove '
          'the rule if the fallback is meant (or allow '
          "'unknown-mesh-axis' for rules shared by several meshes).",
        )
      )
  return out


def _flax_target(target: Any) -> Any:
  """A Flax rule's target as ours spell it (a list is a tuple of axes)."""
  if isinstance(target, list | tuple):
    return tuple(target) if len(target) > 1 else (target[0] if target else None)
  return target


@dataclasses.dataclass(frozen=True)
class _Subject:
  """What path rules see of a variable (or an array of a plain tree)."""

  path: str
  type: type | None
  annotated: bool


def _subjects(target: Any) -> list[_Subject]:
  if _trees.is_array_tree(target):
    keyed = jax.tree_util.tree_flatten_with_path(target)[0]
    return [_Subject(_variables.keypath_str(k), None, False) for k, _ in keyed]
  return [
    _Subject(
      _variables.path_str(path),
      type(v),
      _spec.logical_axes_of(v) is not None
      or _spec.concrete_sharding_of(v) is not None,
    )
    for path, v in _variables.iter_variables(target)
  ]


def _path_rule_findings(
  rules: _logical.LogicalRules, subjects: Sequence[_Subject]
) -> list[Finding]:
  out = []
  examples = ', '.join(repr(s.path) for s in subjects[:3])
  first = {
    s.path: _path_rules.first_match(rules.path_rules, s.path, s.type)
    for s in subjects
  }
  for k, rule in enumerate(rules.path_rules):
    subject = rule.describe(k)
    matched = [s for s in subjects if rule.matches(s.path, s.type)]
    if not matched:
      kind = f' of type {rule.type.__name__}' if rule.type else ''
      out.append(
        Finding(
          'unmatched-path-rule',
          subject,
          f'the pattern matches no variable path{kind} (paths look like '
          f'{examples}), so the rule does nothing. Fix the pattern (a '
          "regular expression searched in the '/'-joined path), or remove "
          'the rule.',
        )
      )
      continue
    earlier = [s for s in matched if first[s.path][0] < k]
    annotated = [
      s
      for s in matched
      if first[s.path][0] == k and s.annotated and not rule.override
    ]
    if len(earlier) + len(annotated) < len(matched):
      continue
    if earlier:
      j, winner = first[earlier[0].path]
      why = (
        f'{len(earlier)} of the {len(matched)} variables it matches are '
        f'taken by earlier path rules (e.g. {earlier[0].path!r} by '
        f'{winner.describe(j)}; the first match wins)'
      )
    else:
      why = ''
    if annotated:
      why += (' and ' if why else '') + (
        f'{len(annotated)} are annotated with logical axes (e.g. '
        f'{annotated[0].path!r}), which win unless the rule says '
        'override=True'
      )
    out.append(
      Finding(
        'shadowed-path-rule',
        subject,
        f'it never applies: {why}. Remove it, move it before the rules '
        'that take its variables, or set override=True.',
      )
    )
  return out


def _short_annotation_findings(target: Any) -> list[Finding]:
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
      Finding(
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


def _activation_clash_findings(
  rules: _logical.LogicalRules | _context.FlaxRules,
  used: set[str],
  entries: Sequence[_plan.PlanEntry],
  mesh: _meshes.MeshLike | None,
) -> list[Finding]:
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
        Finding(
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


def _unplaced_when_built(
  target: Any, result: _plan.ShardingPlan
) -> list[Finding]:
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
    Finding(
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


def check(
  module_or_state: Any,
  rules: _logical.RulesLike | None = None,
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
  *,
  min_bytes: int = DEFAULT_MIN_BYTES,
  budget: int | None = None,
  allow: Iterable[str] = (),
) -> CheckReport:
  """Lints the rules against a model and a mesh.

  Reports, each with a stable code (see `CODES`):

  - ``unused-rule``: a logical name in the rules that no variable uses;
  - ``shadowed-rule``: a rule that an earlier rule for the same name always
    beats (an earlier ``None``, or the same rule twice);
  - ``unknown-logical-name``: a logical name of a variable that no rule
    mentions (so creating it fails, or, with ``unknown='replicate'``, it is
    replicated), with a "did you mean" for one spelled like a rule's name
    (``'embedd'`` for ``'embed'``);
  - ``mesh-axis-typo``: a rule naming an axis the mesh lacks, spelled like
    one it has (``'modle'`` for ``'model'``: a typo silently replicates),
    with a "did you mean" (the similarity rule of `LikelyTypoWarning`);
  - ``unknown-mesh-axis``: a rule naming any other axis the mesh lacks
    (an ``'fsdp'`` rule on a mesh without one: a fallback the rules
    intend, reported so that it is allowed knowingly);
  - ``replicated-large``: a variable of at least `min_bytes` that the
    rules (its annotation or a path rule) leave whole on every device,
    with the mesh axes that could shard it;
  - ``over-budget``: bytes per device above `budget`;
  - ``unmatched-path-rule``: a path rule whose pattern matches no
    variable (a typo in a pattern silently replicates);
  - ``shadowed-path-rule``: a path rule that never applies, because every
    variable it matches is taken by an earlier path rule (the first match
    wins) or annotated (annotations win unless ``override=True``);
  - ``unannotated-replicated``: a variable of at least `min_bytes` that
    neither an annotation nor a path rule covers, so every device holds it
    whole, with a path rule that would cover it;
  - ``activation-axis-clash``: an Explicit mesh axis that a batch name no
    variable has (an activation's, ``'batch'``) and a variable's last
    dimension both take, so that a matmul of the two is illegally sharded
    under JAX;
  - ``short-annotation``: an annotation with fewer logical names than
    its variable has dimensions, read as Flax reads it (the missing
    trailing names are None);
  - ``eager-sharding-off``: a variable the rules shard that was created
    unplaced because Flax's eager sharding was off (another library may
    have turned ``flax_always_shard_variable`` off), with the fix. For a
    factory (or an abstract model), predicted: the variables whose
    ``eager_sharding`` metadata is False, which calling the factory
    creates unplaced.

  Args:
    module_or_state: What `plan` takes: a module, state, a factory (built
      abstractly, allocating nothing), or a pytree of arrays.
    rules: The rules; defaults to the rules in effect.
    mesh: The mesh; defaults to the one set by ``jax.set_mesh``.
    min_bytes: The size from which a replicated variable is reported.
    budget: Bytes per device not to exceed (parameters and every other
      variable of `module_or_state`), or None.
    allow: Codes not to report.

  Returns:
    The report: false when there are no findings.

  Rules set with Flax's own context, and no rules at all, are checked
  under Flax's semantics, as creation applies them: the last rule for a
  name wins (earlier ones are ``shadowed-rule``), and with no rules the
  annotations' names are mesh axes.

  Raises:
    LogicalRulesError: If `allow` holds an unknown code.
    UnknownLogicalAxisError: Under Flax's semantics, if an annotation names
      a mesh axis the mesh lacks (as creation would fail).

  Example:
    >>> import jax, flax_dtensor as fdt
    >>> from flax import nnx
    >>> init = nnx.with_partitioning(nnx.initializers.ones, ('embed', 'mlp'))
    >>> mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
    >>> rules = [('embed', 'data'), ('mlp', 'modle'), ('batch', 'data')]
    >>> report = fdt.check(
    ...     lambda: nnx.Linear(8, 16, kernel_init=init, rngs=nnx.Rngs(0)),
    ...     rules, mesh, allow=['unused-rule'])
    >>> [(f.code, f.subject) for f in report.findings]
    [('mesh-axis-typo', "('mlp', 'modle')")]
    >>> "Did you mean 'model'?" in report.findings[0].message
    True
  """
  allow = tuple(allow)
  unknown = sorted(set(allow) - set(CODES))
  if unknown:
    raise _errors.LogicalRulesError(
      f'allow= names unknown finding codes {unknown}; expected some of '
      f'{sorted(CODES)}.'
    )
  rules_ = _context.rules_in_effect(rules)
  mesh_ = _meshes.mesh_for(mesh=mesh)
  sizes = _meshes.axis_sizes(mesh_) if mesh_ is not None else None
  # The semantics creation takes: ours (unknown names replicated, so that
  # every variable is planned), or Flax's (rules set with its own context,
  # or none at all: then the names are mesh axes).
  # Rules naming missing mesh axes are findings here, not errors.
  planning = (
    rules_.replace(unknown='replicate', missing_mesh_axes='fallback')
    if isinstance(rules_, _logical.LogicalRules)
    else rules_
  )
  target = module_or_state
  with _missing_axes.reported_elsewhere():  # As findings.
    if _plan_build.is_factory(target) and not _trees.is_array_tree(target):
      target = _init.build_abstract(target, mesh=mesh_, rules=planning)
    result = _plan_build.plan(target, mesh=mesh_, rules=planning)
  used = {
    a for e in result.entries for a in (e.logical_axes or ()) if a is not None
  }
  findings = _rule_findings(rules_, used, sizes)
  findings += _unknown_name_findings(rules_, result.entries)
  if isinstance(rules_, _logical.LogicalRules) and rules_.path_rules:
    findings += _path_rule_findings(rules_, _subjects(target))
  for e in result.entries:
    if e.misplaced and (e.misplaced_reason or '').startswith(
      _placing.EAGER_OFF_REASON
    ):
      findings.append(
        Finding(
          'eager-sharding-off',
          e.path,
          f'placed {_partition_specs.format_spec(e.display_placed or ())}, but the '
          f'rules say {_partition_specs.format_spec(e.display_spec)}: '
          f'{_placing.EAGER_OFF_REASON}. {_placing.EAGER_OFF_FIX}',
        )
      )
  findings += _unplaced_when_built(target, result)
  findings += _short_annotation_findings(target)
  findings += _activation_clash_findings(planning, used, result.entries, mesh_)
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
        Finding(
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
        Finding(
          'replicated-large',
          e.path,
          f'{whole} ({e.source or "annotation"} leaves it replicated.) It '
          f'could be sharded on {_could_shard(e, sizes)}: annotate it, or '
          'add rules for its logical axes or its path.',
        )
      )
  if budget is not None and result.bytes_per_device > budget:
    findings.append(
      Finding(
        'over-budget',
        'per device',
        f'{_text.human_bytes(result.bytes_per_device)} '
        f'({result.bytes_per_device:,} bytes) per device is above the budget '
        f'of {_text.human_bytes(budget)} ({budget:,} bytes; ideal '
        f'{_text.human_bytes(math.ceil(result.ideal_bytes_per_device))}'
        '). Shard the largest replicated variables, or use more devices.',
      )
    )
  return CheckReport(
    findings=tuple(f for f in findings if f.code not in allow),
    allowed=allow,
  )
