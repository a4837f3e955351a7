"""What runs once, when the first `LogicalRules` of the process is made.

The hook routes module construction through itself only from then on
(`when_first_made`): nothing else needs it, so a process that never makes
rules of ours builds its modules at Flax's cost. The rules' constructor
calls `made` while callbacks wait.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class _FirstMade:
  """The callbacks waiting for the first rules, and whether they are made."""

  def __init__(self) -> None:
    self.waiting: list[Callable[[], None]] = []
    self.made = False
    self.lock = threading.Lock()

  def call(self) -> None:
    # Under the lock: rules made at the same time in another thread are
    # returned only once every callback ran (none of them makes rules).
    with self.lock:
      for callback in self.waiting:
        callback()
      self.waiting = []
      self.made = True


_first_made = _FirstMade()


def when_first_made(callback: Callable[[], None]) -> None:
  """Calls `callback` when the first `LogicalRules` is made (now if made)."""
  with _first_made.lock:
    if not _first_made.made:
      _first_made.waiting.append(callback)
      return
  callback()


def made() -> None:
  """Rules were made: runs the callbacks still waiting (cheap once none
  wait)."""
  if _first_made.waiting:
    _first_made.call()
