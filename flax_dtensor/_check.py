"""Rule linting: findings about rules, a model and a mesh, for CI.

Each finding has a stable code, so a project can allow one deliberately
(``allow=('unused-rule',)``), and the report is readable JSON.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from collections.abc import Iterable
from typing import Any

import jax

from flax_dtensor import _errors, _meshes, _plan, _plan_view, _rules, _specs

CODES = {
  'unused-rule': 'a logical name in the rules that no variable uses',
  'shadowed-rule': 'a rule that an earlier rule for its name always beats',
  'unknown-mesh-axis': 'a rule naming a mesh axis the mesh lacks',
  'replicated-large': 'a large variable every device holds whole',
  'over-budget': 'bytes per device above the budget',
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


def _rule_text(name: str, target: Any) -> str:
  return f'({name!r}, {_specs.format_entry(target)})'


def _rule_findings(
  rules: _rules.LogicalRules, used: set[str], sizes: dict[str, int] | None
) -> list[Finding]:
  out = []
  for name in rules.names:
    if name not in used:
      out.append(
        Finding(
          'unused-rule',
          repr(name),
          f'no variable has the logical axis {name!r}. Remove its rules, '
          "or allow 'unused-rule' if activations use it "
          '(with_logical_constraint).',
        )
      )
  seen: dict[str, list[Any]] = {}
  for name, target in rules:
    earlier = seen.setdefault(name, [])
    winners = [t for t in earlier if t is None or t == target]
    if winners:
      winner = winners[0]
      why = (
        'replicates, which always fits'
        if winner is None
        else 'is the same rule, and is tried first'
      )
      out.append(
        Finding(
          'shadowed-rule',
          _rule_text(name, target),
          f'the earlier rule {_rule_text(name, winner)} {why}, so this one '
          'never applies. Remove it, or move it before that rule.',
        )
      )
    earlier.append(target)
    if sizes is not None:
      for axis in _specs.axes_of(target):
        if axis not in sizes:
          close = difflib.get_close_matches(axis, list(sizes), n=1)
          hint = f' Did you mean {close[0]!r}?' if close else ''
          out.append(
            Finding(
              'unknown-mesh-axis',
              _rule_text(name, target),
              f'the mesh has no axis {axis!r} (axes: {list(sizes)}), so '
              f'this rule is always skipped.{hint} Fix the name, or remove '
              'the rule if the fallback is meant.',
            )
          )
  return out


def _could_shard(entry: _plan.PlanEntry, sizes: dict[str, int] | None) -> str:
  if not sizes:
    return 'no mesh axes'
  options = []
  for i, dim in enumerate(entry.shape):
    fits = [a for a, n in sizes.items() if n > 1 and dim % n == 0]
    if fits:
      options.append(f'dim {i} ({dim}) by {", ".join(map(repr, fits))}')
  return '; '.join(options) or 'no mesh axis divides any dimension'


def check(
  module_or_state: Any,
  rules: _rules.RulesLike | None = None,
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
  - ``unknown-mesh-axis``: a rule naming an axis the mesh lacks (a typo
    like ``'modle'`` silently replicates), with a "did you mean";
  - ``replicated-large``: a variable of at least `min_bytes` that every
    device holds whole, with the mesh axes that could shard it;
  - ``over-budget``: bytes per device above `budget`.

  Args:
    module_or_state: What `plan` takes: a module, state, or a factory
      (built abstractly, allocating nothing).
    rules: The rules; defaults to the rules in effect.
    mesh: The mesh; defaults to the one set by ``jax.set_mesh``.
    min_bytes: The size from which a replicated variable is reported.
    budget: Bytes per device not to exceed (parameters and every other
      variable of `module_or_state`), or None.
    allow: Codes not to report.

  Returns:
    The report: false when there are no findings.

  Raises:
    LogicalRulesError: If `allow` holds an unknown code, or no rules are
      given or in effect.

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
    [('unknown-mesh-axis', "('mlp', 'modle')")]
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
  rules_ = _rules.rules_in_effect(rules)
  if not isinstance(rules_, _rules.LogicalRules):
    if not rules_.pairs:
      raise _errors.LogicalRulesError(
        'check() needs rules: pass rules=, or call it under '
        'fdt.logical_axis_rules(rules).'
      )
    rules_ = _rules.LogicalRules(rules_.pairs)
  mesh_ = _meshes.mesh_for(mesh=mesh)
  sizes = _meshes.axis_sizes(mesh_) if mesh_ is not None else None
  result = _plan.plan(
    module_or_state, mesh=mesh_, rules=rules_.replace(unknown='replicate')
  )
  used = {
    a for e in result.entries for a in (e.logical_axes or ()) if a is not None
  }
  findings = _rule_findings(rules_, used, sizes)
  for e in sorted(result.entries, key=lambda e: (-e.bytes, e.path)):
    if (
      result.num_devices > 1
      and e.bytes >= min_bytes
      and e.bytes_per_device == e.bytes
    ):
      findings.append(
        Finding(
          'replicated-large',
          e.path,
          f'{_plan_view.shape_text(e)} ({_plan_view.human_bytes(e.bytes)}) '
          f'is whole on each of the {_plan_view.count(result.num_devices, "device")}. It could '
          f'be sharded on {_could_shard(e, sizes)}: annotate it, or add '
          'rules for its logical axes.',
        )
      )
  if budget is not None and result.bytes_per_device > budget:
    findings.append(
      Finding(
        'over-budget',
        'per device',
        f'{_plan_view.human_bytes(result.bytes_per_device)} '
        f'({result.bytes_per_device:,} bytes) per device is above the budget '
        f'of {_plan_view.human_bytes(budget)} ({budget:,} bytes; ideal '
        f'{_plan_view.human_bytes(math.ceil(result.ideal_bytes_per_device))}'
        '). Shard the largest replicated variables, or use more devices.',
      )
    )
  return CheckReport(
    findings=tuple(f for f in findings if f.code not in allow),
    allowed=allow,
  )
