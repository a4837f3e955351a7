"""The search of `suggest_rules` for the variables without logical names:
one rule per family of variables (`Family`: one path pattern, one shape),
from a preset or the generic proposal (`Proposal`), and, for a budget,
families sharded further until the plan fits (`fit_budget`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from jax.sharding import PartitionSpec

from flax_dtensor import _errors
from flax_dtensor._planning import _plan, _presets, _suggest_roles
from flax_dtensor._rules import _logical, _partition_specs, _path_rules

CATCH_ALL = '.*'


@dataclasses.dataclass(frozen=True)
class Variable:
  """What the proposal sees of one variable (not the optimizer's)."""

  path: str
  shape: tuple[int, ...]
  bytes: int
  annotated: bool


@dataclasses.dataclass
class Family:
  """Variables one rule covers: one path pattern, one shape."""

  pattern: str
  members: list[Variable]
  small: bool
  base: tuple[Any, ...] = ()  # The generic spec (no preset covers them).
  covered_by: int | None = None  # The preset rule's index, if one does.

  @property
  def shape(self) -> tuple[int, ...]:
    return self.members[0].shape

  @property
  def specificity(self) -> tuple[Any, ...]:
    """Sorts deeper paths first: a shorter pattern never takes a longer
    path's variables (the first match wins)."""
    depth = self.members[0].path.count('/')
    return (-depth, self.pattern.startswith('^'), self.pattern)


def variables_of(entries: Sequence[_plan.PlanEntry]) -> list[Variable]:
  """What the proposal sees of the plan's variables (not the optimizer's)."""
  return [
    Variable(
      e.path, e.shape, e.bytes, (e.source or '').startswith('annotation')
    )
    for e in entries
    if e.category != 'optimizer'
  ]


def _generalized(path: str) -> str:
  """'(^|/)layers/\\d+/mlp/up/kernel$' for 'layers/3/mlp/up/kernel'."""
  parts = [r'\d+' if p.isdigit() else re.escape(p) for p in path.split('/')]
  return '(^|/)' + '/'.join(parts) + '$'


def _exact(path: str) -> str:
  return '^' + re.escape(path) + '$'


def _families(variables: Sequence[Variable], small: bool) -> list[Family]:
  """One family per generalized path, or per path where shapes differ."""
  groups: dict[str, list[Variable]] = {}
  for v in variables:
    groups.setdefault(_generalized(v.path), []).append(v)
  out = []
  for pattern, members in groups.items():
    if len({m.shape for m in members}) == 1:
      out.append(Family(pattern, members, small))
    else:
      out += [Family(_exact(m.path), [m], small) for m in members]
  return out


def _anchor_greedy(families: list[Family], others: list[Variable]) -> None:
  """Anchors a family's pattern at the start where it would also match a
  variable of another family (a top-level 'w' against 'layers/0/w'): then
  it matches its own variables only (their optimizer state then follows
  the later rules)."""
  for f in families:
    own = {m.path for m in f.members}
    regex = re.compile(f.pattern)
    if any(regex.search(v.path) for v in others if v.path not in own):
      f.pattern = '^' + f.pattern.removeprefix('(^|/)')


def _generic_spec(
  shape: tuple[int, ...], sizes: dict[str, int], roles: dict[str, str | None]
) -> tuple[Any, ...]:
  """The largest dimension that divides on the fsdp-like axis, the largest
  other that divides on the model axis; where no other divides, both axes
  on the one dimension if it divides by both."""
  order = sorted(range(len(shape)), key=lambda i: (-shape[i], i))
  spec: list[Any] = [None] * len(shape)
  placed: dict[str, int] = {}
  for role in ('fsdp', 'model'):
    axis = roles[role]
    if axis is None:
      continue
    dim = next(
      (
        i
        for i in order
        if i not in placed.values() and shape[i] % sizes[axis] == 0
      ),
      None,
    )
    if dim is not None:
      spec[dim] = axis
      placed[role] = dim
  if len(placed) == 1 and all(roles.values()):
    (dim,) = placed.values()
    if shape[dim] % (sizes[roles['fsdp']] * sizes[roles['model']]) == 0:
      spec[dim] = (roles['fsdp'], roles['model'])
  return tuple(spec)


def _max_spec(
  shape: tuple[int, ...], sizes: dict[str, int], current: Sequence[Any]
) -> tuple[Any, ...]:
  """The spec splitting an array of `shape` over the most devices (each
  mesh axis on at most one dimension, each product dividing its
  dimension); of those, the one closest to `current`."""
  axes = [a for a, n in sizes.items() if n > 1]
  now = {
    a: i for i, e in enumerate(current) for a in _partition_specs.axes_of(e)
  }
  best, best_key = None, None
  for choice in itertools.product(range(-1, len(shape)), repeat=len(axes)):
    products = [1] * len(shape)
    for axis, dim in zip(axes, choice, strict=True):
      if dim >= 0:
        products[dim] *= sizes[axis]
    if any(s % p for s, p in zip(shape, products, strict=True)):
      continue
    kept = sum(now.get(a) == d for a, d in zip(axes, choice, strict=True))
    key = (math.prod(products), kept)
    if best_key is None or key > best_key:
      best, best_key = choice, key
  spec: list[Any] = [None] * len(shape)
  for dim in range(len(shape)):
    on = [a for a, d in zip(axes, best, strict=True) if d == dim]
    on.sort(key=lambda a: (now.get(a) != dim, axes.index(a)))
    spec[dim] = None if not on else on[0] if len(on) == 1 else tuple(on)
  return tuple(spec)


def _names_of(rule: _path_rules.PathRule) -> set[str]:
  if rule.kind != _path_rules.LOGICAL:
    return set()
  return {e for e in rule.entries if e is not None}


@dataclasses.dataclass(eq=False)
class Proposal:
  """The rules for one state of the search: which families are sharded
  further, and the threshold."""

  variables: list[Variable]
  preset: _presets.Preset | None
  roles: dict[str, str | None]
  sizes: dict[str, int]
  min_bytes: int
  names: _suggest_roles.Names | None = None

  def __post_init__(self) -> None:
    variables, sizes, roles = self.variables, self.sizes, self.roles
    candidates = [
      v
      for v in variables
      if not v.annotated and v.shape and v.bytes >= self.min_bytes
    ]
    self.notes: list[str] = []
    self.active = self._usable_preset_rules(candidates)
    generic = [v for v in candidates if self._first_preset(v.path) is None]
    uncovered = set(generic)
    covered = [v for v in candidates if v not in uncovered]
    self.families = _families(covered, small=False)
    for f in self.families:
      f.covered_by = self._first_preset(f.members[0].path)
    for f in _families(generic, small=False):
      f.base = _generic_spec(f.shape, sizes, roles)
      self.families.append(f)
    chosen = set(candidates)
    small = [
      v for v in variables if not v.annotated and v.shape and v not in chosen
    ]
    self.small = _families(small, small=True)
    everything = self.families + self.small
    _anchor_greedy(everything, variables)
    self.sharded_further: dict[int, tuple[Any, ...]] = {}  # id(family)

  def _usable_preset_rules(self, candidates: list[Variable]) -> list[int]:
    """The preset's rules that are the first match of some candidate and
    fit its rank; notes the ones left out."""
    if self.preset is None:
      return []
    active = list(range(len(self.preset.rules)))
    changed = True
    while changed:
      changed = False
      for v in candidates:
        i = next(
          (i for i in active if self.preset.rules[i].matches(v.path)), None
        )
        if i is None:
          continue
        try:
          _path_rules.entries_for(self.preset.rules[i], i, v.shape, v.path)
        except _errors.ShardingResolutionError:
          self.notes.append(
            f'preset {self.preset.name} rule #{i} '
            f'{self.preset.rules[i].pattern!r} left out: it matches '
            f'{v.path!r} of shape {v.shape}, which its target '
            f'{_path_rules._text(self.preset.rules[i], True)} does not fit.'
          )
          active.remove(i)
          changed = True
          break
    return active

  def _first_preset(self, path: str) -> int | None:
    for i in self.active:
      if self.preset is not None and self.preset.rules[i].matches(path):
        return i
    return None

  def reason(self, f: Family) -> str:
    if f.small:
      return (
        f'replicated below the threshold ({f.members[0].bytes} bytes < '
        f'min_bytes={self.min_bytes})'
      )
    if f.covered_by is not None:
      assert self.preset is not None
      rule = self.preset.rules[f.covered_by]
      return f'preset {self.preset.name} rule #{f.covered_by}: {rule.note}'
    if not any(f.base):
      return f'replicated: no dimension of {f.shape} divides by ' + ' or '.join(
        f'{a!r} ({self.sizes[a]})' for a in self.roles.values() if a
      )
    return (
      'generic largest-dimension: largest dimension that divides on '
      f'{self.roles["fsdp"]!r}, the next on {self.roles["model"]!r}'
    )

  def used_preset_rules(self) -> set[int]:
    """The preset rules that place a family not sharded further."""
    return {
      f.covered_by
      for f in self.families
      if f.covered_by is not None and id(f) not in self.sharded_further
    }

  def left_out(self) -> list[str]:
    """Notes on the preset rules that place nothing."""
    if self.preset is None:
      return []
    used = self.used_preset_rules()
    return [
      f'preset {self.preset.name} rule #{i} {self.preset.rules[i].pattern!r} '
      f'left out: it places no variable of at least min_bytes='
      f'{self.min_bytes}'
      + (
        ' that is not sharded further'
        if any(f.covered_by == i for f in self.families)
        else ''
      )
      + '.'
      for i in self.active
      if i not in used
    ]

  def threshold(self) -> int:
    small = [
      f.members[0].bytes for f in self.small if id(f) in self.sharded_further
    ]
    return min([self.min_bytes, *small])

  def rules(self) -> tuple[_logical.LogicalRules, dict[str, str]]:
    """The rules of this state, and {path: why} for every variable."""
    further = [
      f for f in self.families + self.small if id(f) in self.sharded_further
    ]
    further.sort(key=lambda f: f.specificity)
    path_rules: list[_path_rules.PathRule] = []
    why: dict[str, str] = {}
    for f in further:
      spec = self.sharded_further[id(f)]
      text = f'sharded further for the budget (was: {self.reason(f)})'
      if not any(spec):
        text = f'replicated: no dimension of {f.shape} divides by a mesh axis'
      path_rules.append(
        _path_rules.PathRule(f.pattern, PartitionSpec(*spec), note=text)
      )
      why.update({m.path: text for m in f.members})
    names: set[str] = set()
    if self.preset is not None:
      used = self.used_preset_rules()
      for i in self.active:
        if i not in used:
          continue
        rule = self.preset.rules[i]
        names |= _names_of(rule)
        path_rules.append(
          _path_rules.PathRule(
            rule.pattern,
            rule.target,
            type=rule.type,
            override=rule.override,
            note=f'preset {self.preset.name} rule #{i}: {rule.note}',
          )
        )
    for f in self.families:
      if id(f) in self.sharded_further:
        continue
      why.update({m.path: self.reason(f) for m in f.members})
    generic = [
      f
      for f in self.families
      if f.covered_by is None
      and any(f.base)
      and id(f) not in self.sharded_further
    ]
    generic.sort(key=lambda f: f.specificity)
    for f in generic:
      path_rules.append(
        _path_rules.PathRule(
          f.pattern,
          PartitionSpec(*f.base),
          note='generic: the largest dimension that divides on '
          f'{self.roles["fsdp"]}, the next on {self.roles["model"]}',
        )
      )
    for f in self.small:
      if id(f) not in self.sharded_further:
        why.update({m.path: self.reason(f) for m in f.members})
    annotated_why = (
      'annotated: its logical names placed by the rules proposed for them'
      if self.names is not None and self.names.names
      else 'annotated: its annotation places it'
    )
    for v in self.variables:
      if v.annotated:
        why[v.path] = annotated_why
      elif not v.shape:
        why[v.path] = 'replicated: a scalar'
    if any(
      _path_rules.first_match(path_rules, v.path, None) is None
      for v in self.variables
      if not v.annotated
    ):
      path_rules.append(
        _path_rules.PathRule(
          CATCH_ALL,
          None,
          note='the rest: replicated (below the threshold, a scalar, or no '
          'dimension divides)',
        )
      )
    named = self.names.pairs() if self.names is not None else []
    own = {n for n, _ in named}
    rules = _logical.LogicalRules(
      named
      + [
        p
        for p in _suggest_roles.preset_rules(names, self.roles)
        if p[0] not in own
      ],
      path_rules=path_rules,
      min_bytes=self.threshold(),
      # Annotations keep their place; names these rules lack replicate.
      unknown='replicate' if any(v.annotated for v in self.variables) else None,
    )
    return rules, {v.path: why[v.path] for v in self.variables}


def _copies(path: str, entries: Sequence[_plan.PlanEntry]) -> list[Any]:
  return [e for e in entries if e.path == path or e.path.endswith('/' + path)]


def _saving(
  f: Family,
  spec: Sequence[Any],
  entries: Sequence[_plan.PlanEntry],
  sizes: dict[str, int],
) -> int:
  """Bytes per device saved by placing the family's variables (and their
  optimizer state of the same shape) at `spec`."""
  n = math.prod(sizes[a] for e in spec for a in _partition_specs.axes_of(e))
  saved = 0
  for m in f.members:
    for e in _copies(m.path, entries):
      if e.shape == f.shape:
        saved += max(0, e.bytes_per_device - e.bytes // n)
  return saved


Planned = tuple[_logical.LogicalRules, dict[str, str], _plan.ShardingPlan]
"""A state's rules, {path: why} and the plan under them."""


def fit_budget(
  proposal: Proposal,
  names: _suggest_roles.Names,
  budget: int | None,
  plan_of: Callable[[_logical.LogicalRules], _plan.ShardingPlan],
) -> Planned:
  """The proposal's rules, {path: why} and plan (`plan_of` the rules), for
  `budget`: over it, the annotated variables first (their names' rules),
  then the families sharded further."""

  def planned() -> Planned:
    rules, why = proposal.rules()
    return rules, why, plan_of(rules)

  done = planned()
  if budget is None or done[2].bytes_per_device <= budget:
    return done
  if names.names:
    # The annotated variables first: their names' rules, for the budget.
    others = done[2].bytes_per_device - names.bytes_per_device(names.orders)
    names.search(budget, others)
    done = planned()
  # First the variables above the threshold, those that save the most
  # first; then, if need be, those below it, largest first (so that the
  # lowered threshold exempts only arrays smaller than every one sharded).
  for small in (False, True):
    if done[2].bytes_per_device <= budget:
      break
    done = _shard_further(proposal, small, budget, planned, done)
  return done


def _shard_further(
  proposal: Proposal,
  small: bool,
  budget: int,
  planned: Callable[[], Planned],
  done: Planned,
) -> Planned:
  """Shards further the families above the threshold (below it, with
  `small`), one at a time, until the plan fits `budget`."""
  result = done[2]
  now = {e.path: e for e in result.entries}
  steps = []
  for f in proposal.small if small else proposal.families:
    spec = now[f.members[0].path].spec
    current = tuple(spec) + (None,) * (len(f.shape) - len(spec))
    further = _max_spec(f.shape, proposal.sizes, current)
    saved = _saving(f, further, result.entries, proposal.sizes)
    if saved > 0 or small:
      steps.append((saved, f, further))
  steps.sort(
    key=(lambda s: -s[1].members[0].bytes) if small else (lambda s: -s[0])
  )
  estimate = result.bytes_per_device
  for k, (saved, f, further) in enumerate(steps):
    proposal.sharded_further[id(f)] = further
    estimate -= saved
    if estimate <= budget or k == len(steps) - 1:
      done = planned()
      if done[2].bytes_per_device <= budget:
        break
      estimate = done[2].bytes_per_device
  return done
