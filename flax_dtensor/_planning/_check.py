"""Rule linting: findings about rules, a model and a mesh, for CI.

Each finding has a stable code, so a project can allow one deliberately
(``allow=('unused-rule',)``), and the report is readable JSON. Logical
rules, path rules and the variables they leave whole are all checked:
the findings about the rules are `_check_rules`', those about the
variables `_check_model`'s, the report `_check_report`'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax

from flax_dtensor import _errors
from flax_dtensor._placement import _abstract_build, _trees
from flax_dtensor._planning import (
  _check_model,
  _check_report,
  _check_rules,
  _plan_build,
)
from flax_dtensor._rules import _context, _logical, _meshes, _missing_axes

DEFAULT_MIN_BYTES = 2**20
"""Variables from this size on are reported when replicated (1 MiB)."""


def check(
  module_or_state: Any,
  rules: _logical.RulesLike | None = None,
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
  *,
  min_bytes: int = DEFAULT_MIN_BYTES,
  budget: int | None = None,
  allow: Iterable[str] = (),
) -> _check_report.CheckReport:
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
  unknown = sorted(set(allow) - set(_check_report.CODES))
  if unknown:
    raise _errors.LogicalRulesError(
      f'allow= names unknown finding codes {unknown}; expected some of '
      f'{sorted(_check_report.CODES)}.'
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
      target = _abstract_build.build_abstract(
        target, mesh=mesh_, rules=planning
      )
    result = _plan_build.plan(target, mesh=mesh_, rules=planning)
  used = {
    a for e in result.entries for a in (e.logical_axes or ()) if a is not None
  }
  findings = _check_rules.rule_findings(rules_, used, sizes)
  findings += _check_rules.unknown_name_findings(rules_, result.entries)
  if isinstance(rules_, _logical.LogicalRules) and rules_.path_rules:
    findings += _check_rules.path_rule_findings(
      rules_, _check_rules.subjects(target)
    )
  findings += _check_model.eager_off_findings(result)
  findings += _check_model.unplaced_when_built(target, result)
  findings += _check_model.short_annotation_findings(target)
  findings += _check_model.activation_clash_findings(
    planning, used, result.entries, mesh_
  )
  findings += _check_model.replicated_findings(result, min_bytes, sizes)
  findings += _check_model.over_budget_findings(result, budget)
  return _check_report.CheckReport(
    findings=tuple(f for f in findings if f.code not in allow),
    allowed=allow,
  )
