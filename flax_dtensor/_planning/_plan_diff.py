"""Golden layouts: what changed between two plans.

`diff` says, variable by variable, what moved (its spec), what changed size
per device, which fallbacks changed, what decides its placement now (its
source: an annotation, a path rule, nothing), and what appeared or
disappeared. (A plan is written and read back by `ShardingPlan.to_json` /
`from_json`.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax_dtensor import _text
from flax_dtensor._planning import _plan, _plan_view
from flax_dtensor._rules import _partition_specs


@dataclasses.dataclass(frozen=True)
class Change:
  """One variable in both plans, placed or sized differently.

  Attributes:
    path: The variable's path.
    before: Its entry in the other (golden) plan.
    after: Its entry in this plan.
  """

  path: str
  before: _plan.PlanEntry
  after: _plan.PlanEntry

  @property
  def moved(self) -> bool:
    """Whether its placement changed: which mesh axes split which dimension.

    Each spec is read on its plan's mesh, where axes of size 1 split
    nothing: a spec that gained or lost only such axes did not move.
    """
    b, a = self.before, self.after
    return len(b.shape) != len(a.shape) or _partition_specs.placement(
      b.spec, len(b.shape), b.mesh_axes
    ) != _partition_specs.placement(a.spec, len(a.shape), a.mesh_axes)

  @property
  def resized(self) -> bool:
    """Whether its bytes per device changed (shape, dtype or sharding)."""
    return self.before.bytes_per_device != self.after.bytes_per_device

  @property
  def fallbacks_changed(self) -> bool:
    return set(self.before.fallbacks) != set(self.after.fallbacks)

  @property
  def source_changed(self) -> bool:
    """Whether another annotation or path rule decides it now.

    Not for a golden layout written before plans had sources.
    """
    return (
      self.before.source is not None
      and self.after.source is not None
      and self.before.source != self.after.source
    )

  def lines(self) -> list[str]:
    b, a = self.before, self.after
    out = []
    if self.moved:
      out.append(
        f'  spec {_partition_specs.format_spec(b.display_spec)} -> '
        f'{_partition_specs.format_spec(a.display_spec)}'
      )
    if (b.shape, b.dtype) != (a.shape, a.dtype):
      out.append(f'  {_plan_view.shape_text(b)} -> {_plan_view.shape_text(a)}')
    if self.source_changed:
      out.append(f'  source {b.source} -> {a.source}')
    if self.resized:
      out.append(
        f'  per device {_text.human_bytes(b.bytes_per_device)} -> '
        f'{_text.human_bytes(a.bytes_per_device)}'
      )
    for f in sorted(set(b.fallbacks) - set(a.fallbacks)):
      out.append(f'  - fallback {f}')
    for f in sorted(set(a.fallbacks) - set(b.fallbacks)):
      out.append(f'  + fallback {f}')
    return out


@dataclasses.dataclass(frozen=True)
class PlanDiff:
  """What changed from one plan (the golden one) to another.

  False when nothing did: ``if plan.diff(golden): ...``.

  Attributes:
    added: Paths only in the new plan.
    removed: Paths only in the golden plan.
    changed: The variables in both whose spec, size per device, shape,
      dtype, fallbacks or source differ.
    mesh: (golden mesh axes, new mesh axes) when they differ, else None.
    bytes_per_device: (golden, new) bytes one device holds.
  """

  added: tuple[str, ...]
  removed: tuple[str, ...]
  changed: tuple[Change, ...]
  mesh: tuple[Any, Any] | None
  bytes_per_device: tuple[int, int]

  def __bool__(self) -> bool:
    return bool(self.added or self.removed or self.changed or self.mesh)

  @property
  def moved(self) -> tuple[str, ...]:
    """Paths whose placement changed (see `Change.moved`)."""
    return tuple(c.path for c in self.changed if c.moved)

  @property
  def resized(self) -> tuple[str, ...]:
    """Paths whose bytes per device changed."""
    return tuple(c.path for c in self.changed if c.resized)

  @property
  def fallbacks_changed(self) -> tuple[str, ...]:
    """Paths whose fallbacks changed."""
    return tuple(c.path for c in self.changed if c.fallbacks_changed)

  @property
  def source_changed(self) -> tuple[str, ...]:
    """Paths now placed by another annotation or path rule, or none."""
    return tuple(c.path for c in self.changed if c.source_changed)

  def __str__(self) -> str:
    if not self:
      return 'No change: every variable is placed as in the golden layout.'
    before, after = self.bytes_per_device
    lines = [
      f'{len(self.changed)} changed, {len(self.added)} added, '
      f'{len(self.removed)} removed; per device '
      f'{_text.human_bytes(before)} -> {_text.human_bytes(after)}'
    ]
    if self.mesh is not None:
      lines.append(f'mesh {self.mesh[0]} -> {self.mesh[1]}')
    for c in self.changed:
      lines.append(c.path)
      lines.extend(c.lines())
    lines.extend(f'+ {p}' for p in self.added)
    lines.extend(f'- {p}' for p in self.removed)
    return '\n'.join(lines)

  __repr__ = __str__

  def to_dict(self) -> dict[str, Any]:
    return {
      'changed': [
        {
          'path': c.path,
          'before': c.before.to_dict(),
          'after': c.after.to_dict(),
          'moved': c.moved,
          'resized': c.resized,
          'fallbacks_changed': c.fallbacks_changed,
          'source_changed': c.source_changed,
        }
        for c in self.changed
      ],
      'added': list(self.added),
      'removed': list(self.removed),
      'mesh': list(self.mesh) if self.mesh is not None else None,
      'bytes_per_device': list(self.bytes_per_device),
    }


def diff(new: _plan.ShardingPlan, golden: _plan.ShardingPlan) -> PlanDiff:
  """What changed from `golden` to `new`, variable by variable."""
  old = {e.path: e for e in golden.entries}
  now = {e.path: e for e in new.entries}
  changed = []
  for e in new.entries:
    if e.path not in old:
      continue
    c = Change(e.path, old[e.path], e)
    if (
      c.moved
      or c.resized
      or c.fallbacks_changed
      or c.source_changed
      or (c.before.shape, c.before.dtype) != (e.shape, e.dtype)
    ):
      changed.append(c)
  mesh = (
    (golden.mesh_axes, new.mesh_axes)
    if (golden.mesh_axes or None) != (new.mesh_axes or None)
    else None
  )
  return PlanDiff(
    added=tuple(p for p in now if p not in old),
    removed=tuple(p for p in old if p not in now),
    changed=tuple(changed),
    mesh=mesh,
    bytes_per_device=(golden.bytes_per_device, new.bytes_per_device),
  )
