"""`check`'s findings about the rules themselves: logical rules that no
variable uses or an earlier one beats, names no rule mentions, mesh axes
the mesh lacks, path rules that match nothing or never apply."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from flax_dtensor import _text
from flax_dtensor._placement import _trees, _variables
from flax_dtensor._planning import _check_report, _plan, _plan_build
from flax_dtensor._rules import (
  _context,
  _logical,
  _missing_axes,
  _partition_specs,
  _path_rules,
  _spec,
)


def rule_findings(
  rules: _logical.LogicalRules | _context.FlaxRules,
  used: set[str],
  sizes: dict[str, int] | None,
) -> list[_check_report.Finding]:
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
        _check_report.Finding(
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
        _check_report.Finding(
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
        _check_report.Finding(
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
            _check_report.Finding(
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


def unknown_name_findings(
  rules: Any, entries: Sequence[_plan.PlanEntry]
) -> list[_check_report.Finding]:
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
      _check_report.Finding(
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
) -> dict[str, list[_check_report.Finding]]:
  """{rule: a `mesh-axis-typo` for each mesh axis it names that the mesh
  lacks, spelled like one it has, an `unknown-mesh-axis` for any other}."""
  out: dict[str, list[_check_report.Finding]] = {}
  if sizes is None or not isinstance(rules, _logical.LogicalRules):
    return out
  for m in _missing_axes.missing_axes(rules, list(sizes)):
    found = out.setdefault(m.rule, [])
    lacks = f'the mesh has no axis {m.axis!r} (axes: {list(sizes)}), so'
    if m.typo:
      found.append(
        _check_report.Finding(
          'mesh-axis-typo',
          m.rule,
          f'{lacks} this rule is always skipped and its variables fall '
          f'back (often to replication). Did you mean {m.meant!r}? Fix the '
          'name.',
        )
      )
    else:
      found.append(
        _check_report.Finding(
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


def subjects(target: Any) -> list[_Subject]:
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


def path_rule_findings(
  rules: _logical.LogicalRules, subjects: Sequence[_Subject]
) -> list[_check_report.Finding]:
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
        _check_report.Finding(
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
      _check_report.Finding(
        'shadowed-path-rule',
        subject,
        f'it never applies: {why}. Remove it, move it before the rules '
        'that take its variables, or set override=True.',
      )
    )
  return out
