"""`check`'s report: every finding's stable code (`CODES`), a `Finding`,
the `CheckReport` (readable JSON, text at any width).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from flax_dtensor import _text

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
