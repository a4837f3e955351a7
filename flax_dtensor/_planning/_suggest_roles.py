"""Roles for `suggest_rules`: which mesh axis is which, and each logical
name's targets on them.

A mesh's axes take two roles, the fsdp-like one and the model one
(`roles`). A logical name's targets follow an order of roles (`ORDERS`,
the one table of them): the presets' names each have one (`PRESET_NAMES`,
the logical rules a preset's targets need), and the names of an annotated
model's variables are chosen among them to lower the bytes each device
holds (`Names`).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from typing import Any

from flax_dtensor._planning import _plan
from flax_dtensor._rules import _logical, _meshes, _path_rules, _resolution

MODEL_AXIS_NAMES = ('model', 'tp', 'tensor', 'mp')
"""Mesh axis names taken for the model (tensor-parallel) axis, in order."""

FSDP_AXIS_NAMES = ('fsdp', 'data', 'dp', 'batch')
"""Mesh axis names taken for the fsdp-like axis, in order."""

# The orders a logical name's targets may take, by role: model axis first,
# fsdp-like axis first, both axes on one dimension first (for a budget),
# the model axis alone.
ORDERS = {
  'model': (('model',), ('fsdp',)),
  'fsdp': (('fsdp',), ('model',)),
  'both': (('fsdp', 'model'), ('fsdp',), ('model',)),
  'model alone': (('model',),),
}

# The presets' logical names: (the order of their rules in a preset, the
# order an annotation's name starts from), keys of `ORDERS`. The names'
# order is the rules' priority: the names with the fewest ways to divide
# choose first; `embed` takes what is left (both axes where nothing else
# could take the model axis, as GPT-2's vocabulary of 50257); `head_dim`
# only the model axis if nothing else of its array took it (Gemma's single
# key/value head).
PRESET_NAMES = {
  'kv_heads': ('model', 'model'),
  'heads': ('model', 'model'),
  'vocab': ('model', 'model'),
  'mlp': ('model', 'model'),
  'embed': ('both', 'fsdp'),
  'head_dim': ('model alone', 'model'),
}


def roles(sizes: dict[str, int]) -> dict[str, str | None]:
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


def _targets(order: str, roles_: dict[str, str | None]) -> list[Any]:
  """The targets of `order` (a key of `ORDERS`) this mesh has axes for."""
  out: list[Any] = []
  for wanted in ORDERS[order]:
    axes = tuple(roles_[r] for r in wanted if roles_[r] is not None)
    if len(axes) == len(wanted):
      target = axes if len(axes) > 1 else axes[0]
      if target not in out:
        out.append(target)
  return out


def preset_rules(
  names: set[str], roles_: dict[str, str | None]
) -> list[tuple[str, Any]]:
  """The logical rules for the presets' `names` (None where no axis of the
  mesh fits: replicated)."""
  return [
    (name, target)
    for name, (order, _) in PRESET_NAMES.items()
    if name in names
    for target in _targets(order, roles_) or [None]
  ]


def name_targets(
  order: str | None, roles_: dict[str, str | None]
) -> tuple[Any, ...]:
  """A name's targets for `order` (a key of `ORDERS`, or None to
  replicate), ending in None (replicate where nothing fits)."""
  return (*(_targets(order, roles_) if order else ()), None)


class Names:
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
    roles_: dict[str, str | None],
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
    self.roles = roles_
    weight: dict[str, int] = {}
    largest: dict[str, int] = {}
    for e in self.entries:
      for name in e.logical_axes or ():
        if name is not None:
          weight[name] = weight.get(name, 0) + e.bytes
          largest[name] = max(largest.get(name, 0), e.bytes)
    self.names = sorted(weight, key=lambda n: (-weight[n], n))
    self.small = {n for n in self.names if largest[n] < min_bytes}
    # A name starts where the presets start it; any other, replicated.
    self.orders: dict[str, str | None] = {
      n: None if n in self.small else PRESET_NAMES.get(n, (None, None))[1]
      for n in self.names
    }

  def pairs(self, orders: dict[str, str | None] | None = None) -> list[Any]:
    orders = self.orders if orders is None else orders
    return [
      (name, target)
      for name in self.names
      for target in name_targets(orders[name], self.roles)
    ]

  def bytes_per_device(self, orders: dict[str, str | None]) -> int:
    rules = _logical.LogicalRules(self.pairs(orders), unknown='replicate')
    total = 0
    for (axes, shape, itemsize), count in self.kinds.items():
      spec = _resolution.resolve_dims(
        axes, shape, mesh=self.mesh, rules=rules
      ).spec
      shard = _plan.shard_shape(shape, spec, self.sizes)
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
    return {n: name_targets(self.orders[n], self.roles) for n in self.names}
