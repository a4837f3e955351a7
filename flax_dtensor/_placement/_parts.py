"""Which part of a checkpoint holds a model: the group its paths fall in.

A checkpoint of a training state holds the model beside other state
(``model/...`` and ``optimizer/...``, as the demo saves them). `choose`
picks the part a restore reads: the one named (``--part``), else the whole
checkpoint when it holds every variable of the model by path, else the one
top-level group that does. `inside` gives what that part holds, by the
model's own paths. Paths only: shapes and dtypes are checked afterwards
(`_sources`), in the model's words.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from flax_dtensor import _errors
from flax_dtensor._placement import _variables

V = TypeVar('V')


@dataclasses.dataclass(frozen=True)
class Choice:
  """The part of a checkpoint a restore reads.

  Attributes:
    part: Its path (``('model',)``); ``()`` for the whole checkpoint.
    matched: Whether it was found by the model's paths (not named).
    groups: Each top-level group of the checkpoint and how many variables
      it holds, in order.
    near: With no part chosen and the whole checkpoint not the model's,
      the groups holding some of the model's variables by path (a part
      that may be meant, for the fix of the mismatch).
  """

  part: tuple[str, ...]
  matched: bool
  groups: Mapping[str, int]
  near: tuple[str, ...] = ()

  def hint(self, flag: str = '--part') -> str:
    """', or pass --part NAME ...' for the fix of a mismatch, or ''."""
    if not self.near:
      return ''
    shown = {g: n for g, n in self.groups.items() if g in self.near}
    return (
      f', or pass {flag} NAME for the group holding the model (it may be '
      f'{listing(shown)})'
    )

  @property
  def prefix(self) -> str:
    """``'model/'``, or ``''`` for the whole checkpoint."""
    return ''.join(f'{p}/' for p in self.part)


def parse(text: str, flag: str = '--part') -> tuple[str, ...]:
  """``'model'`` or ``'state/model'`` as a path of names.

  Raises:
    ExportError: If `text` is empty or has an empty name.
  """
  names = tuple(text.strip().strip('/').split('/'))
  if not text.strip().strip('/') or any(not n for n in names):
    raise _errors.ExportError(
      f'Malformed {flag} {text!r}: expected the name of a group of the '
      'checkpoint, e.g. model (or a path of them, e.g. state/model).'
    )
  return names


def groups(held: Iterable[tuple[Any, ...]]) -> dict[str, int]:
  """Each top-level group of `held` paths (with more than one name), and
  how many variables it holds."""
  out: dict[str, int] = {}
  for path in held:
    if len(path) > 1:
      out[str(path[0])] = out.get(str(path[0]), 0) + 1
  return out


def listing(counts: Mapping[str, int]) -> str:
  """ "model/ (24 variables), optimizer/ (51)"."""
  shown = [
    f'{g}/ ({n} variable{"s" * (n != 1)})' if i == 0 else f'{g}/ ({n})'
    for i, (g, n) in enumerate(counts.items())
  ]
  return _variables.listing(shown)


def inside(
  held: Mapping[tuple[Any, ...], V], part: tuple[str, ...]
) -> dict[tuple[Any, ...], V]:
  """What `held` holds under `part`, by the paths below it."""
  k = len(part)
  return {
    path[k:]: value
    for path, value in held.items()
    if len(path) > k and tuple(map(str, path[:k])) == part
  }


def choose(
  held: Iterable[tuple[Any, ...]],
  target: Any,
  part: tuple[str, ...] | None,
  source: str,
  flag: str = '--part',
) -> Choice:
  """The part of a checkpoint holding `target`'s variables.

  Args:
    held: The paths of the checkpoint's variables.
    target: The model (or its state).
    part: The part named by the caller, or None to find it.
    source: The checkpoint, as the subject of a sentence.
    flag: How the caller names a part, for messages.

  Returns:
    `part` if named; else the whole checkpoint if it holds every variable
    of `target` by path (or no top-level group does), else the one group
    that does (`Choice.matched`).

  Raises:
    ExportError: If the named part holds no variable, or several groups
      each hold every variable of `target`; the message lists the groups.
  """
  held = [tuple(p) for p in held]
  counts = groups(held)
  if part is not None:
    if not inside(dict.fromkeys(held), part):
      raise _errors.ExportError(
        f'{flag} {"/".join(part)}: {source} holds no variable under '
        f'{"/".join(part)}/. Its groups: {listing(counts) or "none"}. Pass '
        f'{flag} one of them, or no {flag} for the whole checkpoint.'
      )
    return Choice(part, False, counts)
  wanted = {
    _variables.path_str(p) for p, _ in _variables.iter_variables(target)
  }
  names = {_variables.path_str(p) for p in held}
  if wanted <= names:
    return Choice((), False, counts)
  by_group = {
    group: {
      _variables.path_str(p) for p in inside(dict.fromkeys(held), (group,))
    }
    for group in counts
  }
  found = [group for group, paths in by_group.items() if wanted <= paths]
  if len(found) > 1:
    raise _errors.ExportError(
      f'{source} holds the variables of the model under '
      f'{len(found)} groups: {_variables.listing([g + "/" for g in found])}. '
      f'Pass {flag} NAME to choose one (e.g. {flag} {found[0]}).'
    )
  if found:
    return Choice((found[0],), True, counts)
  near = tuple(g for g, paths in by_group.items() if wanted & paths)
  return Choice((), False, counts, near)
