"""Ctrl-C and SIGTERM: a prompt stop that leaves no half-written output.

`install` (the command line's first act) makes SIGINT and SIGTERM raise
`Interrupted` in the main thread, and starts a watchdog thread woken by
the signal itself (`signal.set_wakeup_fd`, written by the C handler even
while the main thread is inside a long C call). An interrupt raised where
Python ignores exceptions (JAX's garbage-collection callback, a
``__del__``) is lost; the watchdog raises it again until the command
acknowledges it (`acknowledge`). If the process has not exited
`HARD_EXIT_SECONDS` after the first signal, the watchdog runs the
registered cleanups (`on_exit_now`: the temporaries this process writes)
and ends the process with `os._exit` and status 128 + the signal.

`deferred` holds an interrupt back while the main thread runs a block that
must not stop midway (renames of a swap, removal of a temporary); `swap`
also keeps the watchdog's cleanup out until the block ends. Without
`install`, both only take a lock. See docs/cli.md (Ctrl-C).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

HARD_EXIT_SECONDS = 1.5
"""After the first signal, the watchdog ends the process at the latest."""
REDELIVER_SECONDS = 0.2
"""How often an interrupt nobody acknowledged is raised again."""
# The cleanup before an exit at once: passes until two find nothing to
# undo, this many at most, this far apart (about 0.4 s at the most).
CLEANUP_PASSES = 8
CLEANUP_PAUSE_SECONDS = 0.05
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
  """SIGINT or SIGTERM arrived; `status` is the exit status it calls for."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum

  @property
  def status(self) -> int:
    return 128 + self.signum


_lock = threading.Lock()
_swap_lock = threading.RLock()
_cleanups: list[Callable[[], None]] = []
_notes: list[Callable[[], str | None]] = []
_installed = False
_signum: int | None = None  # The first signal received.
_received_at = 0.0
_acknowledged = False
_depth = 0  # Main-thread `deferred` blocks entered.
_pending = False  # A signal arrived inside a `deferred` block.


def received() -> int | None:
  """The first signal received since `install`, or None."""
  return _signum


def status(default: int = 130) -> int:
  """The exit status for the signal received (`default` if none)."""
  return default if _signum is None else 128 + _signum


def acknowledge() -> None:
  """The command has caught the interrupt: no more raising it again."""
  global _acknowledged
  _acknowledged = True


def on_exit_now(cleanup: Callable[[], bool | None]) -> None:
  """Registers `cleanup` to run when an interrupted process exits at once.

  It runs on the main thread (`exit_now`) or on the watchdog's, maybe
  while the main thread still runs: it must tolerate what it removes being
  removed already. It runs again while any cleanup returns True (it found
  something to undo), a few times at most.
  """
  with _lock:
    if cleanup not in _cleanups:
      _cleanups.append(cleanup)


def on_interrupted(note: Callable[[], str | None]) -> None:
  """Registers `note`: the line said after 'interrupted', or None for none.

  A command tells there how to go on (the demo: ``--resume``). It runs
  when the interrupt is told, maybe on the watchdog's thread.
  """
  with _lock:
    if note not in _notes:
      _notes.append(note)


def say_interrupted() -> None:
  """Says 'interrupted' on our stderr stream, then each note's line."""
  from flax_dtensor import _output

  _output.say('interrupted')
  for note in list(_notes):
    try:
      line = note()
    except Exception:  # Stopping: a note that fails is left out.
      continue
    if line:
      _output.say(line)


def _on_main_thread() -> bool:
  return threading.current_thread() is threading.main_thread()


def _handler(signum: int, frame: object) -> None:
  del frame
  global _signum, _received_at, _pending
  if _signum is None:
    _signum, _received_at = signum, time.monotonic()
  if _depth:
    _pending = True
    return
  raise Interrupted(_signum)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
  """Within the block, an interrupt of the main thread waits for its end.

  On other threads (which signals do not interrupt) it does nothing.
  """
  global _depth, _pending
  if not _on_main_thread():
    yield
    return
  _depth += 1
  try:
    yield
  finally:
    _depth -= 1
    # Raised unless an exception already leaves the block (then the
    # watchdog raises it again if it was lost).
    if not _depth and _pending and sys.exc_info()[1] is None:
      _pending = False
      raise Interrupted(_signum or signal.SIGINT)


@contextlib.contextmanager
def swap() -> Iterator[None]:
  """`deferred`, and the watchdog's cleanup waits for the block's end."""
  with _swap_lock, deferred():
    yield


def finishing() -> None:
  """The command is done: a signal from now on ends the process at exit.

  It is no longer raised (it would break the exit midway); exit handlers
  end the process with its status (`exit_now`) if one has arrived.
  """
  global _depth
  if _installed and _on_main_thread():
    _depth += 1


def _exit_if_received() -> None:
  """The last exit handler: a signal that came during the exit counts."""
  if _signum is not None:
    exit_now(128 + _signum)


def install() -> None:
  """Makes SIGINT and SIGTERM stop this process promptly (main thread only).

  Idempotent; does nothing off the main thread.
  """
  global _installed
  if _installed or not _on_main_thread():
    return
  read, write = os.pipe()
  os.set_blocking(write, False)
  for signum in SIGNALS:
    signal.signal(signum, _handler)
  signal.set_wakeup_fd(write, warn_on_full_buffer=False)
  atexit.register(_exit_if_received)  # The first registered runs last.
  _installed = True
  threading.Thread(
    target=_watch, args=(read,), name='flax_dtensor interrupts', daemon=True
  ).start()


def _watch(read: int) -> None:
  """The watchdog: raises a lost interrupt again, ends a stuck process."""
  main = threading.main_thread().ident
  while True:
    try:
      woken = os.read(read, 64)
    except InterruptedError:
      continue
    if not woken:
      return
    signum = _signum
    if signum is None:  # The C handler ran; Python's has not yet.
      signum = woken[0]
      if signum not in SIGNALS:
        continue
    start = _received_at or time.monotonic()
    deadline = start + HARD_EXIT_SECONDS
    while time.monotonic() < deadline:
      time.sleep(min(REDELIVER_SECONDS, max(0.0, deadline - time.monotonic())))
      if not _acknowledged and not _depth and time.monotonic() < deadline:
        # A real signal, to the main thread: it also ends a blocking call
        # (`_thread.interrupt_main` would wait for it to return).
        signal.pthread_kill(main, _signum or signum)
    exit_now(128 + (_signum or signum), message=True)


def exit_now(code: int, *, message: bool = False) -> None:
  """Cleans up (`on_exit_now`) and ends the process with `code`, at once.

  Waits for a `swap` in progress, skips exit handlers, interpreter
  shutdown and the joining of threads (a library's background writer).
  """
  from flax_dtensor import _output

  global _acknowledged, _depth
  _acknowledged = True
  if _on_main_thread():
    _depth += 1  # A signal now is only recorded.
  _swap_lock.acquire()  # Never released: no swap starts after this.
  # Until two passes in a row find nothing to undo (within a bound): a
  # library's thread still writing (Orbax's, TensorFlow's in a main thread
  # stuck in C) may create again what a pass removed.
  quiet = 0
  for attempt in range(CLEANUP_PASSES):
    if attempt:
      time.sleep(CLEANUP_PAUSE_SECONDS)
    found = False
    for cleanup in list(_cleanups):
      try:
        found = bool(cleanup()) or found
      except Exception:  # Exiting: the others still run.
        found = True
    quiet = 0 if found else quiet + 1
    if quiet == 2:
      break
  if message:
    with contextlib.suppress(Exception):
      say_interrupted()
  for stream in (sys.stdout, sys.stderr, _output.stream()):
    with contextlib.suppress(Exception):
      stream.flush()
  os._exit(code)
