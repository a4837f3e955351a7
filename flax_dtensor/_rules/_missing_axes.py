"""Names the rules or the mesh lack: intended fallbacks and likely typos.

`missing_axes` lists every rule (logical rules, and path rules' mesh axes)
naming an axis the mesh lacks, each with the mesh axis it likely meant
(`likely_meant`, the similarity rule). `check_on_mesh` is what resolution
calls when rules meet a mesh: it raises under ``missing_mesh_axes='error'``
and warns `LikelyTypoWarning` once per rules and mesh otherwise, unless
the caller reports the typos itself (`reported_elsewhere`). The same rule
finds the logical name an unknown one likely meant (`meant_hint`), which
`check_unknown_names` warns of once per rules and name.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from flax_dtensor import _errors, _output
from flax_dtensor._rules import _logical, _partition_specs, _path_rules

TYPO_REASON = 'a likely typo of'
"""In a skipped rule's reason: its mesh axis looks like a typo of the one
named next (`_resolution.missing_reason`)."""

MIN_TYPO_LENGTH = 3
"""Names this long or longer are compared one edit apart."""


def _edits(a: str, b: str) -> int:
  """The optimal string alignment distance: insertions, deletions,
  substitutions and swaps of adjacent characters."""
  previous2: list[int] = []
  previous = list(range(len(b) + 1))
  for i in range(1, len(a) + 1):
    row = [i] + [0] * len(b)
    for j in range(1, len(b) + 1):
      cost = a[i - 1] != b[j - 1]
      row[j] = min(row[j - 1] + 1, previous[j] + 1, previous[j - 1] + cost)
      if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
        row[j] = min(row[j], previous2[j - 2] + 1)
    previous2, previous = previous, row
  return previous[len(b)]


def likely_meant(axis: str, mesh_axes: Sequence[str]) -> str | None:
  """The mesh axis that `axis` (missing from the mesh) is likely a typo of.

  Compared without regard to case: the same name, or, when both have at
  least `MIN_TYPO_LENGTH` characters, names one edit apart (a character
  inserted, deleted or changed, or two adjacent characters swapped). The
  first such axis in mesh order, or None: ``'dta'`` and ``'modle'`` are
  typos of ``'data'`` and ``'model'``; ``'fsdp'`` of neither, nor of
  ``'dp'``; ``'tp'`` not of ``'dp'`` (too short to tell).
  """
  wanted = axis.lower()
  for name in mesh_axes:
    other = name.lower()
    if other == wanted:
      return name
    if (
      min(len(wanted), len(other)) >= MIN_TYPO_LENGTH
      and _edits(wanted, other) == 1
    ):
      return name
  return None


@dataclasses.dataclass(frozen=True)
class MissingAxis:
  """A rule naming a mesh axis the mesh lacks.

  Attributes:
    rule: The rule as messages show it: ``('embed', 'dta')``, or a path
      rule's description.
    axis: The missing mesh axis.
    meant: The mesh axis it is likely a typo of, or None (an intended
      fallback).
    mesh_axes: The mesh's axis names.
  """

  rule: str
  axis: str
  meant: str | None
  mesh_axes: tuple[str, ...]

  @property
  def typo(self) -> bool:
    return self.meant is not None

  def __str__(self) -> str:
    text = f'{self.rule} names mesh axis {self.axis!r}, which the mesh lacks'
    if self.meant is not None:
      text += f' (did you mean {self.meant!r}?)'
    return text


def rule_text(name: str, target: Any) -> str:
  """ "('embed', 'data')": a logical rule as messages show it."""
  return f'({name!r}, {_partition_specs.format_entry(target)})'


def missing_axes(
  rules: _logical.LogicalRules, mesh_axes: Sequence[str]
) -> tuple[MissingAxis, ...]:
  """Every rule of `rules` naming a mesh axis not in `mesh_axes`, in order:
  the logical rules, then the path rules whose targets are mesh axes."""
  names = tuple(mesh_axes)
  present = set(names)
  out = []
  seen = set()
  found = [(rule_text(n, t), _partition_specs.axes_of(t)) for n, t in rules]
  found += [
    (
      rule.describe(k),
      tuple(a for e in rule.entries for a in _partition_specs.axes_of(e)),
    )
    for k, rule in enumerate(rules.path_rules)
    if rule.kind == _path_rules.MESH
  ]
  for text, axes in found:
    for axis in axes:
      if axis not in present and (text, axis) not in seen:
        seen.add((text, axis))
        out.append(MissingAxis(text, axis, likely_meant(axis, names), names))
  return tuple(out)


def likely_typos(
  rules: Any, mesh_axes: Sequence[str] | None
) -> tuple[MissingAxis, ...]:
  """The rules' missing axes that look like typos (none for Flax's rules
  or without a mesh)."""
  if not isinstance(rules, _logical.LogicalRules) or mesh_axes is None:
    return ()
  return tuple(m for m in missing_axes(rules, mesh_axes) if m.typo)


def error_message(found: Sequence[MissingAxis]) -> str:
  mesh = list(found[0].mesh_axes)
  listed = '; '.join(map(str, found))
  return (
    f'The rules name mesh axes the mesh lacks (mesh axes {mesh}), and they '
    f"say missing_mesh_axes='error': {listed}. Fix the names, remove those "
    "rules, or let such rules fall back (missing_mesh_axes='fallback', the "
    'default).'
  )


def warning_message(typos: Sequence[MissingAxis]) -> str:
  listed = '; '.join(map(str, typos))
  return (
    f'Likely typo in the rules: {listed}. Such a rule is skipped, so its '
    'logical name falls back to its next rule (often replication). Fix the '
    "name, or pass missing_mesh_axes='error' to make any rule naming a "
    'missing mesh axis an error.'
  )


class _State(threading.local):
  def __init__(self) -> None:
    self.quiet = 0


_state = _State()
_lock = threading.Lock()
# {(id(rules), mesh axes): (rules, what they miss)}: the rules kept alive,
# so that an id is not reused while its entry lives. The oldest go first.
_known: collections.OrderedDict[tuple[int, tuple[str, ...]], Any] = (
  collections.OrderedDict()
)
_KEEP = 256
_warned: set[tuple[int, tuple[str, ...]]] = set()


@contextlib.contextmanager
def reported_elsewhere() -> Iterator[None]:
  """Within the block (in this thread), likely typos are not warned: the
  caller reports them itself (a plan's headline, a check's finding)."""
  _state.quiet += 1
  try:
    yield
  finally:
    _state.quiet -= 1


def check_on_mesh(rules: _logical.LogicalRules, sizes: dict[str, int]) -> None:
  """What resolution does when `rules` meet a mesh of axes `sizes`.

  Raises:
    MissingMeshAxisError: If the rules say ``missing_mesh_axes='error'``
      and a rule names a mesh axis the mesh lacks.
  """
  key = (id(rules), tuple(sizes))
  with _lock:
    known = _known.get(key)
    if known is None or known[0] is not rules:
      known = (rules, missing_axes(rules, key[1]))
      _known[key] = known
      _warned.discard(key)
      while len(_known) > _KEEP:
        old, _ = _known.popitem(last=False)
        _warned.discard(old)
    found = known[1]
    if not found:
      return
    if rules.missing_mesh_axes == 'error':
      raise _errors.MissingMeshAxisError(error_message(found))
    typos = [m for m in found if m.typo]
    if not typos or _state.quiet or key in _warned:
      return
    _warned.add(key)
  _output.warn(warning_message(typos), _errors.LikelyTypoWarning)


def meant_hint(name: str, known: Sequence[str]) -> str:
  """ " (did you mean 'embed'?)" for a logical name that no rule mentions,
  spelled like one of `known` (`likely_meant`'s rule); else ''."""
  meant = likely_meant(name, [k for k in known if k != name])
  return f' (did you mean {meant!r}?)' if meant is not None else ''


# {(id(rules), name): rules} warned of: the rules kept alive, so that an id
# is not reused while its entry lives. The oldest go first.
_warned_names: collections.OrderedDict[tuple[int, str], Any] = (
  collections.OrderedDict()
)


def check_unknown_names(
  rules: _logical.LogicalRules, names: Sequence[str]
) -> None:
  """Warns `LikelyTypoWarning` once per rules and name for each of `names`
  (in no rule, so replicated under ``unknown='replicate'``) spelled like a
  name the rules have, unless the caller reports it itself."""
  known = rules.names
  found = []
  with _lock:
    for name in names:
      hint = meant_hint(name, known)
      key = (id(rules), name)
      if not hint or _state.quiet or _warned_names.get(key) is rules:
        continue
      _warned_names[key] = rules
      while len(_warned_names) > _KEEP:
        _warned_names.popitem(last=False)
      found.append(f'{name!r}{hint}')
  if found:
    _output.warn(
      f'Likely typo: the logical axis name(s) {", ".join(found)} are in no '
      "rule, so the rules' unknown='replicate' replicates them. Fix the "
      'name, or add a rule for it.',
      _errors.LikelyTypoWarning,
    )
