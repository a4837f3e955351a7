"""`suggest_rules`: rules proposed for a model, from what it says.

The model is built abstractly and read: the logical names its annotations
carry get logical rules (`_Names`, chosen by the bytes each device holds);
the variables without them are read by their paths and shapes: a preset
(`_presets`) recognised from the paths, or the generic proposal (the
largest dimension that divides on the fsdp-like axis, the next on the
model axis), sharded further until a memory budget fits. Given inputs,
the forward is traced on them too (`_forward_names`): the logical names it
constrains activations with and no variable has (``'batch'``) get rules of
their own. `RulesSuggestion` holds the rules, the plan under them, and why
each variable goes where.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import os
import pathlib
import re
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from flax_dtensor import _errors, _text
from flax_dtensor._placement import _init, _trees
from flax_dtensor._planning import _plan, _presets
from flax_dtensor._rules import (
  _context,
  _logical,
  _meshes,
  _missing_axes,
  _partition_specs,
  _path_rules,
  _resolution,
)

DEFAULT_MIN_BYTES = 2**16
"""Variables below this size are replicated unless a budget needs them."""

MODEL_AXIS_NAMES = ('model', 'tp', 'tensor', 'mp')
"""Mesh axis names taken for the model (tensor-parallel) axis, in order."""

FSDP_AXIS_NAMES = ('fsdp', 'data', 'dp', 'batch')
"""Mesh axis names taken for the fsdp-like axis, in order."""

CATCH_ALL = '.*'

# Which mesh axes each logical name of the presets tries, by role, in
# order. The names' order is the rules' priority: the names with the fewest
# ways to divide choose first; `embed` takes what is left (both axes where
# nothing else could take the model axis, as GPT-2's vocabulary of 50257);
# `head_dim` only the model axis if nothing else of its array took it
# (Gemma's single key/value head).
_ROLES = {
  'kv_heads': (('model',), ('fsdp',)),
  'heads': (('model',), ('fsdp',)),
  'vocab': (('model',), ('fsdp',)),
  'mlp': (('model',), ('fsdp',)),
  'embed': (('fsdp', 'model'), ('fsdp',), ('model',)),
  'head_dim': (('model',),),
}


@dataclasses.dataclass(frozen=True)
class _Variable:
  """What the proposal sees of one variable (not the optimizer's)."""

  path: str
  shape: tuple[int, ...]
  bytes: int
  annotated: bool


@dataclasses.dataclass
class _Family:
  """Variables one rule covers: one path pattern, one shape."""

  pattern: str
  members: list[_Variable]
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


@dataclasses.dataclass(frozen=True, repr=False)
class RulesSuggestion:
  """Rules proposed by `suggest_rules`, and why each variable goes where.

  Print it for the report, write it (`write`) for a rules file that
  ``flax-dtensor plan --rules`` and `LogicalRules.from_yaml` read.

  Attributes:
    rules: The proposed `LogicalRules`: path rules (each with a note that
      says where it comes from, shown in the plan's `source` column), the
      logical rules a preset's targets need, and the threshold.
    plan: The plan under `rules`, the optimizer's state included when one
      was given.
    preset: The preset used (``'hf_llama'``, ``'gemma'``, ``'gpt2'``), or
      None for the generic proposal.
    recognition: How the preset was chosen, or why none was.
    axes: The mesh axes taken as ``{'fsdp': ..., 'model': ...}`` (None
      where the mesh has no axis for that role).
    reasons: ``{path: why}`` for every variable of the model (the
      optimizer's state follows its parameter).
    budget: The budget in bytes per device, or None.
    notes: What else the proposal did: preset rules left out, thresholds
      lowered.
    logical_names: ``{name: its targets, in priority order}`` for each
      logical name the model's annotations use, for which the rules were
      proposed (empty when no variable is annotated).
    forward_names: ``{name: its targets}`` for each logical name that only
      the forward uses (an activation's ``with_logical_constraint``, found
      by tracing it on `inputs`): a batch name on the fsdp-like axis then
      None, any other None.
    traced_on: The inputs the forward was traced on, as text
      (``'int32[16,128]'``), or None when it was not traced (no `inputs`):
      then the names only the forward uses are unknown here.
  """

  rules: _logical.LogicalRules
  plan: _plan.ShardingPlan
  preset: str | None
  recognition: str
  axes: dict[str, str | None]
  reasons: dict[str, str]
  budget: int | None
  notes: tuple[str, ...]
  logical_names: dict[str, tuple[Any, ...]] = dataclasses.field(
    default_factory=dict
  )
  forward_names: dict[str, tuple[Any, ...]] = dataclasses.field(
    default_factory=dict
  )
  traced_on: str | None = None

  @property
  def bytes_per_device(self) -> int:
    """What one device holds under `rules` (the plan's count)."""
    return self.plan.bytes_per_device

  @property
  def fits(self) -> bool | None:
    """Whether `bytes_per_device` is within the budget (None without)."""
    if self.budget is None:
      return None
    return self.bytes_per_device <= self.budget

  def budget_text(self) -> str:
    """One sentence on the budget: met, or the smallest total found."""
    total = _text.human_bytes(self.bytes_per_device)
    ideal = _text.human_bytes(math.ceil(self.plan.ideal_bytes_per_device))
    if self.budget is None:
      return f'{total} per device (ideal {ideal}); no budget given.'
    budget = _text.human_bytes(self.budget)
    if self.fits:
      return f'{total} per device fits the budget of {budget} (ideal {ideal}).'
    why = (
      f'even the ideal (every byte split over every device) is {ideal}'
      if self.plan.ideal_bytes_per_device > self.budget
      else f'the ideal is {ideal}, which no layout reaches where '
      'dimensions do not divide'
    )
    return (
      f'Does not fit: the smallest total found is {total} per device '
      f'({self.bytes_per_device:,} bytes), above the budget of {budget} '
      f'({self.budget:,} bytes); {why}. Use more devices, a smaller '
      'optimizer state, or a larger budget.'
    )

  def to_yaml(self) -> str:
    """The rules file: a comment header, then `LogicalRules.to_yaml_text`."""
    where = ', '.join(
      f'{k}={v}' for k, v in (self.plan.mesh_axes or {}).items()
    )
    # The file says what its rules are for; why no preset applied (each
    # preset's missing names) is the report's, not the rules file's.
    source = (
      self.recognition
      if self.preset is not None
      else (
        "from the model's own annotations"
        if self.logical_names
        else 'the generic proposal (no naming preset applies)'
      )
    )
    lines = [
      '# Rules proposed by flax_dtensor.suggest_rules: edit them freely.',
      f'# Mesh {where}; {source}.',
      f'# {self.budget_text()}',
    ]
    if self.traced_on is None and self.logical_names:
      lines += [f'# {line}' for line in _text.wrap_words(_UNTRACED_TEXT, 78)]
    body = self.rules.to_yaml_text()
    if self.forward_names:
      # Above the rules of the names only the forward uses (listed first).
      comment = ''.join(
        f'  # {line}\n' for line in _text.wrap_words(self.forward_text(), 76)
      )
      head, sep, rest = body.partition('logical_axis_rules:\n')
      body = head + sep + comment + rest
    return '\n'.join(lines) + '\n' + body

  def forward_text(self) -> str:
    """One sentence on the names only the forward uses (found at run time,
    by tracing it), and what their rules do; '' if there are none."""
    if not self.forward_names:
      return ''
    names = '; '.join(
      f'{name!r} -> '
      + ', '.join(_partition_specs.format_entry(t) for t in targets)
      for name, targets in self.forward_names.items()
    )
    return (
      "Logical names found only at run time, in the forward's activation "
      f'constraints (traced on {self.traced_on}), not on any variable: '
      f'{names}. Each ends in a rule to None (replicated); a batch name '
      'goes on the fsdp-like axis first (data parallelism).'
    )

  def write(self, path: str | os.PathLike[str]) -> pathlib.Path:
    """Writes `to_yaml` to `path` and returns the path.

    Raises:
      LogicalRulesError: If the file cannot be written.
    """
    target = pathlib.Path(path)
    try:
      target.write_text(self.to_yaml())
    except OSError as e:
      raise _errors.LogicalRulesError(
        f'Cannot write the rules file {str(target)!r}: '
        f'{e.strerror or e}. Expected a writable path, e.g. rules.yaml in '
        'an existing directory.'
      ) from e
    return target

  def summary(self) -> str:
    """The report without its per-variable lines: the preset or why none,
    the mesh axes taken, the budget, and the notes."""
    lines = [
      f'Suggested rules: {self.recognition}.',
      f'Mesh axes: fsdp-like {self.axes["fsdp"]!r}, model '
      f'{self.axes["model"]!r}.',
    ]
    if self.logical_names:
      lines.append(
        "Logical names from the model's annotations: "
        + '; '.join(
          f'{name!r} -> '
          + ', '.join(_partition_specs.format_entry(t) for t in targets)
          for name, targets in self.logical_names.items()
        )
        + '.'
      )
    if self.forward_names:
      lines.append(self.forward_text())
    elif self.traced_on is None and self.logical_names:
      lines.append(_UNTRACED_TEXT)
    lines += [
      self.budget_text(),
    ]
    lines += [f'Note: {note}' for note in self.notes]
    return '\n'.join(lines)

  def __str__(self) -> str:
    lines = [self.summary()]
    by_path = {e.path: e for e in self.plan.entries}
    width = max((len(p) for p in self.reasons), default=0)
    for path, why in self.reasons.items():
      e = by_path[path]
      lines.append(
        f'  {path:<{width}}  {_partition_specs.format_spec(e.spec)}  '
        f'{_text.human_bytes(e.bytes_per_device)}  {why}'
      )
    return '\n'.join(lines)

  __repr__ = __str__


def _options(budget: Any, min_bytes: Any, style: Any) -> None:
  for name, value, low in (('budget', budget, 1), ('min_bytes', min_bytes, 0)):
    if value is None and name == 'budget':
      continue
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
      raise _errors.LogicalRulesError(
        f'`{name}` must be an int >= {low} (bytes'
        + (' per device' if name == 'budget' else '')
        + f'); got {value!r}.'
      )
  if style is not None:
    _presets.by_style(style)


def _roles(sizes: dict[str, int]) -> dict[str, str | None]:
  """Which mesh axis is the fsdp-like one and which the model one."""
  usable = [a for a, n in sizes.items() if n > 1]
  model = next((a for a in MODEL_AXIS_NAMES if a in usable), None)
  if model is None and len(usable) > 1:
    model = usable[-1]
  rest = [a for a in usable if a != model]
  fsdp = next((a for a in FSDP_AXIS_NAMES if a in rest), None)
  if fsdp is None and rest:
    fsdp = rest[0]
  return {'fsdp': fsdp, 'model': model}


def _abstract(target: Any, mesh: Any, optimizer: Any) -> tuple[Any, Any]:
  """(model, optimizer) as abstract values, whatever was given."""
  lenient = _logical.LogicalRules([], unknown='replicate')
  if _trees.is_array_tree(target):
    tree = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), target
    )
    return tree, optimizer
  if _plan._is_factory(target):
    target = _init.build_abstract(target, mesh=mesh, rules=lenient)
  elif nnx.graph.is_node(target):
    node = (
      (target, optimizer) if isinstance(optimizer, nnx.Optimizer) else target
    )
    graphdef, state = nnx.split(node)
    state = jax.tree.map(
      lambda x: (
        jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, 'shape') else x
      ),
      state,
    )
    node = nnx.merge(graphdef, state)
    target, optimizer = (
      node if isinstance(optimizer, nnx.Optimizer) else (node, optimizer)
    )
  if optimizer is not None and not isinstance(target, nnx.State):
    optimizer = _plan._optimizer_of(target, optimizer, mesh, lenient)
  return target, optimizer


def _generalized(path: str) -> str:
  """'(^|/)layers/\\d+/mlp/up/kernel$' for 'layers/3/mlp/up/kernel'."""
  parts = [r'\d+' if p.isdigit() else re.escape(p) for p in path.split('/')]
  return '(^|/)' + '/'.join(parts) + '$'


def _exact(path: str) -> str:
  return '^' + re.escape(path) + '$'


def _families(variables: Sequence[_Variable], small: bool) -> list[_Family]:
  """One family per generalized path, or per path where shapes differ."""
  groups: dict[str, list[_Variable]] = {}
  for v in variables:
    groups.setdefault(_generalized(v.path), []).append(v)
  out = []
  for pattern, members in groups.items():
    if len({m.shape for m in members}) == 1:
      out.append(_Family(pattern, members, small))
    else:
      out += [_Family(_exact(m.path), [m], small) for m in members]
  return out


def _anchor_greedy(families: list[_Family], others: list[_Variable]) -> None:
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


def _logical_rules(
  names: set[str], roles: dict[str, str | None]
) -> list[tuple[str, Any]]:
  out = []
  for name, order in _ROLES.items():
    if name not in names:
      continue
    before = len(out)
    for wanted in order:
      axes = tuple(roles[r] for r in wanted if roles[r] is not None)
      if len(axes) == len(wanted):
        out.append((name, axes if len(axes) > 1 else axes[0]))
    if len(out) == before:  # No axis for it on this mesh: replicated.
      out.append((name, None))
  return out


def _names_of(rule: _path_rules.PathRule) -> set[str]:
  if rule.kind != _path_rules.LOGICAL:
    return set()
  return {e for e in rule.entries if e is not None}


class _Proposal:
  """The rules for one state of the search: which families are sharded
  further, and the threshold."""

  def __init__(
    self,
    *,
    variables: list[_Variable],
    candidates: list[_Variable],
    preset: _presets.Preset | None,
    roles: dict[str, str | None],
    sizes: dict[str, int],
    min_bytes: int,
    names: _Names | None = None,
  ) -> None:
    self.variables = variables
    self.names = names
    self.preset = preset
    self.roles = roles
    self.sizes = sizes
    self.min_bytes = min_bytes
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

  def _usable_preset_rules(self, candidates: list[_Variable]) -> list[int]:
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

  def reason(self, f: _Family) -> str:
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
      named + [p for p in _logical_rules(names, self.roles) if p[0] not in own],
      path_rules=path_rules,
      min_bytes=self.threshold(),
      # Annotations keep their place; names these rules lack replicate.
      unknown='replicate' if any(v.annotated for v in self.variables) else None,
    )
    return rules, {v.path: why[v.path] for v in self.variables}


# Logical names of annotated models
# ------------------------------------------------------------------------------

# The orders a logical name's targets may take, by role: model axis first,
# fsdp-like axis first, both axes on one dimension first (for a budget).
_NAME_ORDERS = {
  'model': (('model',), ('fsdp',)),
  'fsdp': (('fsdp',), ('model',)),
  'both': (('fsdp', 'model'), ('fsdp',), ('model',)),
}


def _name_targets(
  order: str | None, roles: dict[str, str | None]
) -> tuple[Any, ...]:
  """A name's targets for `order` (a key of `_NAME_ORDERS`, or None to
  replicate), ending in None (replicate where nothing fits)."""
  out: list[Any] = []
  for wanted in _NAME_ORDERS[order] if order else ():
    axes = tuple(roles[r] for r in wanted if roles[r] is not None)
    if len(axes) == len(wanted):
      target = axes if len(axes) > 1 else axes[0]
      if target not in out:
        out.append(target)
  return (*out, None)


def _start_order(name: str) -> str | None:
  """Where a name starts, by its role in the presets' vocabulary."""
  first = _ROLES.get(name, ((),))[0]
  if first == ('model',):
    return 'model'
  if 'fsdp' in first:
    return 'fsdp'
  return None


class _Names:
  """The proposal for the logical names of annotated variables: each
  name's order of targets, chosen to lower the bytes per device.

  The variables (the optimizer's state included) are resolved directly
  by the rules, without a plan: a name at a time, the one on the most
  bytes first, the orders are tried and the one holding the fewest bytes
  per device kept (a name's variables all below `min_bytes` stay
  replicated, unless a budget needs them).
  """

  def __init__(
    self,
    entries: Sequence[_plan.PlanEntry],
    mesh: Any,
    roles: dict[str, str | None],
    min_bytes: int,
  ) -> None:
    self.entries = [e for e in entries if e.logical_axes]
    # Layers repeat: each kind of array resolved once, counted as often.
    self.kinds = collections.Counter(
      (e.logical_axes, e.shape, _path_rules.itemsize(e.dtype))
      for e in self.entries
    )
    self.mesh = mesh
    self.sizes = _meshes.axis_sizes(mesh)
    self.roles = roles
    weight: dict[str, int] = {}
    largest: dict[str, int] = {}
    for e in self.entries:
      for name in e.logical_axes or ():
        if name is not None:
          weight[name] = weight.get(name, 0) + e.bytes
          largest[name] = max(largest.get(name, 0), e.bytes)
    self.names = sorted(weight, key=lambda n: (-weight[n], n))
    self.small = {n for n in self.names if largest[n] < min_bytes}
    self.orders: dict[str, str | None] = {
      n: None if n in self.small else _start_order(n) for n in self.names
    }

  def pairs(self, orders: dict[str, str | None] | None = None) -> list[Any]:
    orders = self.orders if orders is None else orders
    return [
      (name, target)
      for name in self.names
      for target in _name_targets(orders[name], self.roles)
    ]

  def bytes_per_device(self, orders: dict[str, str | None]) -> int:
    rules = _logical.LogicalRules(self.pairs(orders), unknown='replicate')
    total = 0
    for (axes, shape, itemsize), count in self.kinds.items():
      spec = _resolution.resolve_dims(
        axes, shape, mesh=self.mesh, rules=rules
      ).spec
      shard = _plan._shard_shape(shape, spec, self.sizes)
      total += math.prod(shard) * itemsize * count
    return total

  def improve(self, choices: Sequence[str | None], names: Sequence[str]) -> int:
    """Tries `choices` for each of `names` in turn, keeping what holds
    fewer bytes; returns the bytes per device."""
    best = self.bytes_per_device(self.orders)
    for name in names:
      for choice in choices:
        if choice == self.orders[name]:
          continue
        trial = {**self.orders, name: choice}
        held = self.bytes_per_device(trial)
        if held < best:
          best, self.orders = held, trial
    return best

  def search(self, budget: int | None, others: int) -> None:
    """The orders: the names' roles improved, then, if `others` (the bytes
    per device of the variables without logical axes) and the names' do
    not fit `budget`, both axes on a dimension and the small names too."""
    large = [n for n in self.names if n not in self.small]
    held = self.improve(('model', 'fsdp', None), large)
    if budget is None or held + others <= budget:
      return
    held = self.improve(('both', 'model', 'fsdp'), large)
    if held + others <= budget:
      return
    self.improve(('model', 'fsdp', 'both'), sorted(self.small))

  def targets(self) -> dict[str, tuple[Any, ...]]:
    return {n: _name_targets(self.orders[n], self.roles) for n in self.names}


def _copies(path: str, entries: Sequence[_plan.PlanEntry]) -> list[Any]:
  return [e for e in entries if e.path == path or e.path.endswith('/' + path)]


def _saving(
  f: _Family,
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


_UNTRACED_TEXT = (
  'The forward was not traced (no inputs given), so the logical names it '
  "constrains activations with (such as 'batch') have no rules here: "
  'pass inputs= (the command line: --input-shape) to trace it, or add a '
  "rule for each, e.g. ['batch', 'data']."
)


def batch_like(name: str) -> bool:
  """Whether a logical name is a batch dimension's ('batch',
  'activation_batch', 'batch_size')."""
  return 'batch' in name.lower()


def _forward_targets(
  name: str, roles: dict[str, str | None]
) -> tuple[Any, ...]:
  """A name only the forward uses: a batch name on the fsdp-like axis (data
  parallelism), then None; any other name None."""
  if batch_like(name) and roles['fsdp'] is not None:
    return (roles['fsdp'], None)
  return (None,)


def _as_inputs(inputs: Any) -> tuple[Any, ...]:
  """`inputs` as abstract arguments: ``jax.ShapeDtypeStruct`` for anything
  with a shape and a dtype (nothing is computed), None kept.

  Raises:
    LogicalRulesError: For anything else.
  """
  items = (inputs,) if hasattr(inputs, 'shape') else inputs
  if not isinstance(items, tuple | list):
    raise _errors.LogicalRulesError(
      '`inputs` must be the positional arguments of the forward: a list of '
      'jax.ShapeDtypeStruct (or arrays, or None), e.g. '
      '[jax.ShapeDtypeStruct((16, 128), jnp.int32)]; got '
      f'{type(inputs).__name__} {inputs!r:.80}.'
    )
  out = []
  for i, x in enumerate(items):
    if x is None:
      out.append(None)
    elif hasattr(x, 'shape') and hasattr(x, 'dtype'):
      out.append(jax.ShapeDtypeStruct(tuple(x.shape), x.dtype))
    else:
      raise _errors.LogicalRulesError(
        f'`inputs[{i}]` must be a jax.ShapeDtypeStruct, an array or None '
        f'(an argument of the forward); got {type(x).__name__} {x!r:.80}.'
      )
  return tuple(out)


def _inputs_text(inputs: Sequence[Any]) -> str:
  """'int32[16,128]' for the inputs' shapes and dtypes."""
  return ', '.join(
    'None' if x is None else f'{x.dtype}[{",".join(str(d) for d in x.shape)}]'
    for x in inputs
  )


def _forward_names(
  model: Any, inputs: Sequence[Any], method: str, mesh: Any
) -> list[str]:
  """The logical names `method` of the abstract `model` resolves (its
  activations' ``with_logical_constraint``), in order: traced on `inputs`
  under a mesh and lenient rules, nothing computed.

  Raises:
    LogicalRulesError: If the model has no such method, or tracing it on
      the inputs fails (the message gives the inputs and the error).
  """
  forward = getattr(model, method, None)
  if not callable(forward):
    raise _errors.LogicalRulesError(
      f'`method` must name a method of the model that takes `inputs`; '
      f'{type(model).__name__} has no method {method!r}.'
    )
  abstract = mesh if isinstance(mesh, AbstractMesh) else mesh.abstract_mesh
  lenient = _logical.LogicalRules([], unknown='replicate')

  def call(m: Any, *xs: Any) -> Any:
    return getattr(m, method)(*xs)

  try:
    with (
      jax.sharding.use_abstract_mesh(abstract),
      _context.logical_axis_rules(lenient),
      _missing_axes.reported_elsewhere(),
      _resolution.recorded() as found,
    ):
      nnx.eval_shape(call, model, *inputs)
  except _errors.FlaxDTensorError:
    raise
  except Exception as e:
    raise _errors.LogicalRulesError(
      f'Tracing {type(model).__name__}.{method} on the inputs given '
      f'({_inputs_text(inputs)}) failed with {type(e).__name__}: '
      f'{" ".join(str(e).split())[:300]}. Pass `inputs` as the forward '
      'takes them: one jax.ShapeDtypeStruct per positional argument, in '
      'order, batch dimension first (the command line: one --input-shape '
      'NAME:DIMS:DTYPE each).'
    ) from e
  names = (n for axes, _ in found for n in axes if isinstance(n, str))
  return list(dict.fromkeys(names))


def suggest_rules(
  model_or_factory: Any,
  mesh: Mesh | AbstractMesh,
  *,
  budget: int | None = None,
  optimizer: Any = None,
  style: str | None = None,
  min_bytes: int = DEFAULT_MIN_BYTES,
  inputs: Any = None,
  method: str = '__call__',
) -> RulesSuggestion:
  """Proposes rules for a model, from what it says, with the reasons.

  The model is built abstractly (nothing is allocated) and read:

  - **The logical names of its annotations** (``nnx.with_partitioning``)
    each get logical rules: targets in priority order, the model axis or
    the fsdp-like axis first (by the name's role in the presets where it
    has one), the other next, then None. A name at a time, the one on the
    most bytes first, the order holding the fewest bytes per device is
    kept; with a budget not met, both axes on one dimension too, and the
    names of small arrays last. `RulesSuggestion.logical_names` lists them.
  - **The logical names of its forward**, given `inputs`: the forward is
    traced on them (abstractly, under the mesh), and every name it
    constrains an activation with (``with_logical_constraint``) that no
    variable has gets rules of its own, listed first: a batch name
    (``'batch'``, ``'activation_batch'``) on the fsdp-like axis (data
    parallelism), then None; any other name None (replicated).
    `RulesSuggestion.forward_names` lists them, and the written file says
    so in a comment. Without `inputs` such names have no rules (the
    report and the file say so).

  The variables without logical names are read by their paths and shapes:

  - **A preset** for a known naming convention, recognised from the paths
    (or named by `style`): Hugging Face-style Llama, Mistral and Qwen
    (``hf_llama``: ``q_proj``, ``gate_proj``, ``embed_tokens``,
    ``lm_head``), Gemma-style (``gemma``: ``q_einsum``, ``kv_einsum``,
    ``input_embedding``), GPT-2-style (``gpt2``: ``c_attn``, ``c_fc``,
    ``wte``). The presets are YAML files in the package, in the
    ``path_rules:`` form; their logical axes are mapped to the mesh
    (``embed`` on the fsdp-like axis, ``heads``, ``kv_heads``, ``mlp`` and
    ``vocab`` on the model axis, each falling back to the other).
  - **Otherwise, the generic proposal**: every variable of at least
    `min_bytes` gets a rule putting its largest dimension that divides on
    the fsdp-like axis and the largest other that divides on the model
    axis. Smaller arrays, and those no axis divides, stay replicated.
    Variables a preset does not cover get the generic proposal too.
  - **With a budget**, variables are sharded further, those that save the
    most bytes first (over every mesh axis that divides, several on one
    dimension if need be), and then, if it still does not fit, the arrays
    below the threshold, largest first, until the plan's bytes per device
    (`ShardingPlan.bytes_per_device`, the optimizer's state included when
    `optimizer` is given) fit. If nothing fits, the report says so with
    the smallest total found.

  The fsdp-like axis is the first mesh axis named ``fsdp``, ``data``,
  ``dp`` or ``batch``; the model axis the first named ``model``, ``tp``,
  ``tensor`` or ``mp`` (else the last axis). Axes of size 1 are not used.

  Args:
    model_or_factory: An NNX module (concrete or abstract), a factory
      taking no arguments that builds one, or a pytree of arrays (a weights
      dict).
    mesh: The mesh (concrete or abstract).
    budget: Bytes per device not to exceed, or None.
    optimizer: Count the optimizer's state too: an optax transformation
      (``nnx.Optimizer(model, tx, wrt=nnx.Param)`` is built abstractly) or
      the model's ``nnx.Optimizer``; as `plan` counts it.
    style: None to recognise the naming convention from the paths; a
      preset's name (``'hf_llama'``, ``'gemma'``, ``'gpt2'``) to use it
      whatever the paths; ``'generic'`` for the generic proposal.
    min_bytes: Variables below this size stay replicated (unless the
      budget needs them sharded).
    inputs: The forward's positional arguments, as ``jax.ShapeDtypeStruct``
      (or arrays, or None), e.g. ``[jax.ShapeDtypeStruct((16, 128),
      jnp.int32)]``; nothing is computed. None not to trace it.
    method: The method of the model that `inputs` are for.

  Returns:
    The `RulesSuggestion`: ``.rules`` for `plan`, `init`, `check` and the
    command line, ``.plan`` under them, ``.reasons`` per variable, and
    ``.write(path)`` for an editable rules file.

  Raises:
    MeshError: If `mesh` is not a mesh.
    LogicalRulesError: If `budget`, `min_bytes`, `style`, `inputs` or
      `method` is invalid, or the forward fails on `inputs`.
    NotAModelError: If `model_or_factory` or `optimizer` is not what it
      should be.

  Example:
    >>> import jax, flax_dtensor as fdt
    >>> from flax import nnx
    >>> mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
    >>> s = fdt.suggest_rules(lambda: nnx.Linear(256, 512, rngs=nnx.Rngs(0)),
    ...                       mesh)
    >>> s.plan['kernel'].spec
    P('model', 'data')
    >>> s.reasons['bias']
    'replicated below the threshold (2048 bytes < min_bytes=65536)'
  """
  if not isinstance(mesh, Mesh | AbstractMesh):
    raise _errors.MeshError(
      f'Expected a mesh for `suggest_rules` (jax.make_mesh or '
      f'jax.sharding.AbstractMesh), got {type(mesh).__name__} {mesh!r:.80}.'
    )
  _options(budget, min_bytes, style)
  abstract_inputs = None if inputs is None else _as_inputs(inputs)
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
  roles = _roles(sizes)
  target, opt = _abstract(model_or_factory, mesh, optimizer)
  forward: list[str] = []
  if abstract_inputs is not None:
    if not isinstance(target, nnx.Module):
      raise _errors.LogicalRulesError(
        "`inputs` are for tracing a model's forward; got "
        f'{type(target).__name__}, which has none. Pass the model (or its '
        'factory), or leave `inputs` out.'
      )
    forward = _forward_names(target, abstract_inputs, method, mesh)
  lenient = _logical.LogicalRules([], unknown='replicate')
  entries = _plan.plan(target, mesh=mesh, rules=lenient, optimizer=opt).entries
  variables = [
    _Variable(
      e.path, e.shape, e.bytes, (e.source or '').startswith('annotation')
    )
    for e in entries
    if e.category != 'optimizer'
  ]
  if style is None:
    preset, recognition = _presets.recognise(v.path for v in variables)
  else:
    preset = _presets.by_style(style)
    if preset is None:
      recognition = "the generic proposal, as style='generic' asks"
    else:
      missing = preset.missing(
        part for v in variables for part in v.path.split('/')
      )
      recognition = f'preset {preset.name}, as style={style!r} asks' + (
        f' (the paths lack {", ".join(missing)})' if missing else ''
      )
  candidates = [
    v for v in variables if not v.annotated and v.shape and v.bytes >= min_bytes
  ]
  names = _Names(entries, mesh, roles, min_bytes)
  names.search(None, 0)
  proposal = _Proposal(
    variables=variables,
    candidates=candidates,
    preset=preset,
    roles=roles,
    sizes=sizes,
    min_bytes=min_bytes,
    names=names,
  )
  if preset is not None and not proposal.used_preset_rules():
    recognition += '; none of its rules matches, so the proposal is generic'

  def planned() -> tuple[_logical.LogicalRules, dict[str, str], Any]:
    rules, why = proposal.rules()
    result = _plan.plan(target, mesh=mesh, rules=rules, optimizer=opt)
    return rules, why, result

  rules, why, result = planned()
  if budget is not None and result.bytes_per_device > budget and names.names:
    # The annotated variables first: their names' rules, for the budget.
    others = result.bytes_per_device - names.bytes_per_device(names.orders)
    names.search(budget, others)
    rules, why, result = planned()
  if budget is not None and result.bytes_per_device > budget:
    # First the variables above the threshold, those that save the most
    # first; then, if need be, those below it, largest first (so that the
    # lowered threshold exempts only arrays smaller than every one sharded).
    for small in (False, True):
      now = {e.path: e for e in result.entries}
      steps = []
      for f in proposal.small if small else proposal.families:
        spec = now[f.members[0].path].spec
        current = tuple(spec) + (None,) * (len(f.shape) - len(spec))
        further = _max_spec(f.shape, sizes, current)
        saved = _saving(f, further, result.entries, sizes)
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
          rules, why, result = planned()
          if result.bytes_per_device <= budget:
            break
          estimate = result.bytes_per_device
      if result.bytes_per_device <= budget:
        break
  notes = proposal.notes + proposal.left_out()
  annotated = [v.path for v in variables if v.annotated]
  if annotated and names.names:
    notes.append(
      f'{len(annotated)} annotated variables (e.g. {annotated[0]!r}) keep '
      'their logical names; the logical rules are proposed for the names '
      f'they use ({", ".join(map(repr, names.names))}).'
    )
  elif annotated:
    notes.append(
      f'{len(annotated)} annotated variables (e.g. {annotated[0]!r}) keep '
      'their annotations (they name no logical axis: their own sharding '
      'places them).'
    )
  if proposal.threshold() < min_bytes:
    notes.append(
      f'min_bytes lowered from {min_bytes} to {proposal.threshold()}: '
      'arrays below the threshold are sharded too, for the budget.'
    )
  # The names only the forward uses, first: in an activation a batch name
  # takes the fsdp-like axis before the names the variables share with it.
  known = set(rules.names)
  forward_names = {
    n: _forward_targets(n, roles) for n in forward if n not in known
  }
  rules = rules.prepend(
    [(n, t) for n, targets in forward_names.items() for t in targets]
  )
  return RulesSuggestion(
    rules=rules,
    plan=result,
    preset=(
      None
      if preset is None or not proposal.used_preset_rules()
      else preset.name
    ),
    recognition=recognition,
    axes=roles,
    reasons=why,
    budget=budget,
    notes=tuple(notes),
    logical_names=names.targets(),
    forward_names=forward_names,
    traced_on=(
      None if abstract_inputs is None else _inputs_text(abstract_inputs)
    ),
  )
