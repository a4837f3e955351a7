"""Saves that finish in the background: `SaveHandle` and their bookkeeping.

A save with `blocking=False` copies the state on the caller's thread and
writes it on a thread of its own. This module owns that thread and the
thread pools the write uses, all started on the caller's thread (Python
3.12 refuses to start a thread once the interpreter's exit has begun), the
handle that reports its outcome, the rule that a save to a path first waits
for a pending save to the same path, and the wait for every pending save
when the interpreter exits (before `concurrent.futures` stops taking work),
whose failure makes the exit status 1.
"""

from __future__ import annotations

import concurrent.futures.thread  # Its exit hook is registered first.
import os
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

# {directory: the pending save writing it}.
_pending: dict[str, SaveHandle] = {}
_lock = threading.Lock()
_exit_hook_installed = False
# Every handle not yet asked for its outcome (reported at exit if failed).
_unasked: weakref.WeakSet[SaveHandle] = weakref.WeakSet()


class SaveHandle:
  """A checkpoint save running in the background.

  `save_checkpoint(..., blocking=False)` returns one as soon as the state
  is copied: training may then overwrite or donate its arrays. The files
  are written, checked, flushed and moved into place on a thread of their
  own; the interpreter waits for it at exit.

  Attributes:
    directory: The absolute path of the checkpoint being written.

  Example:
    >>> handle = save_checkpoint(model, '/tmp/ckpt', blocking=False)
    ... # doctest: +SKIP
    >>> handle.wait()  # doctest: +SKIP
  """

  def __init__(self, directory: str) -> None:
    self.directory = directory
    self._done = threading.Event()
    self._value: Any = None
    self._error: BaseException | None = None

  def done(self) -> bool:
    """Whether the save finished (written, or failed)."""
    return self._done.is_set()

  def wait(self, timeout: float | None = None) -> None:
    """Waits until the checkpoint is complete on disk.

    Args:
      timeout: Seconds to wait at most; None waits as long as it takes.

    Raises:
      ExportError: The error a blocking save would have raised (a
        `DiskFullError`, a `PeerError`, a failed write, ...); the directory
        then holds what it held before.
      TimeoutError: If `timeout` passed before the save finished.
    """
    _unasked.discard(self)
    if not self._done.wait(timeout):
      raise TimeoutError(
        f'The save to {self.directory!r} did not finish within {timeout} s; '
        'call wait() again, or wait() without a timeout.'
      )
    if self._error is not None:
      raise self._error

  def result(self, timeout: float | None = None) -> Any:
    """Waits as `wait` does; returns what a blocking save returns.

    Args:
      timeout: Seconds to wait at most; None waits as long as it takes.

    Returns:
      The checkpoint's absolute path; with `single_mesh=True`, the pair
      `(path, SingleMeshReport)`.

    Raises:
      ExportError: As `wait`.
      TimeoutError: As `wait`.
    """
    self.wait(timeout)
    return self._value

  def __repr__(self) -> str:
    if not self.done():
      state = 'writing'
    else:
      state = 'failed' if self._error is not None else 'done'
    return f'SaveHandle({self.directory!r}, {state})'


def wait_for(directory: str) -> None:
  """Waits for a pending save to `directory`, whatever its outcome."""
  with _lock:
    handle = _pending.get(directory)
  if handle is not None:
    handle._done.wait()


class StartedPool(concurrent.futures.ThreadPoolExecutor):
  """A thread pool whose threads have all started when it is constructed.

  A `ThreadPoolExecutor` starts a thread when work arrives and no thread is
  idle; once the interpreter's exit has begun, Python 3.12 refuses that
  (RuntimeError: can't create new thread at interpreter shutdown), and the
  save would fail. So every thread starts here, on the caller's thread.
  """

  def __init__(self, workers: int, name: str) -> None:
    super().__init__(workers, thread_name_prefix=name)
    started = threading.Barrier(workers + 1)
    # Each task holds its thread until all have started: `workers` threads.
    for _ in range(workers):
      self.submit(started.wait)
    started.wait()


def start(
  directory: str,
  work: Callable[..., Any],
  *,
  pools: Sequence[int] = (),
) -> SaveHandle:
  """Runs `work` on a thread of its own; returns the handle of its outcome.

  The caller has waited for any pending save to `directory` (`wait_for`).
  Every thread the save uses starts here: its own, and one `StartedPool`
  of each size in `pools`, passed to `work` in that order and shut down
  when it returns.
  """
  _install_exit_hook()
  handle = SaveHandle(directory)
  started = [
    StartedPool(n, f'flax_dtensor save to {directory} ({i})')
    for i, n in enumerate(pools)
  ]

  def run() -> None:
    try:
      handle._value = work(*started)
    except BaseException as e:  # Re-raised by `wait`.
      handle._error = e
    finally:
      for pool in started:
        pool.shutdown()
      with _lock:
        if _pending.get(directory) is handle:
          del _pending[directory]
      handle._done.set()

  with _lock:
    _pending[directory] = handle
    _unasked.add(handle)
  try:
    threading.Thread(
      target=run, name=f'flax_dtensor save to {directory}', daemon=False
    ).start()
  except BaseException:
    with _lock:
      del _pending[directory]
      _unasked.discard(handle)
    for pool in started:
      pool.shutdown()
    raise
  return handle


def wait_all() -> None:
  """Waits for every pending save (outcomes stay with their handles)."""
  while True:
    with _lock:
      handles = list(_pending.values())
    if not handles:
      return
    for handle in handles:
      handle._done.wait()


def _install_exit_hook() -> None:
  """Makes interpreter exit wait for pending saves.

  `threading` runs its exit hooks last-registered first, before it joins
  the remaining threads; `concurrent.futures` registers one that refuses
  new work from then on. Registered after it (its module is imported
  above), this wait runs first, so a save finishing at exit can still use
  thread pools.
  """
  global _exit_hook_installed
  with _lock:
    if _exit_hook_installed:
      return
    _exit_hook_installed = True
  threading._register_atexit(_at_exit)


EXIT_STATUS = 1
"""The exit status of a process whose background save failed at exit."""


def _at_exit() -> None:
  """Waits for pending saves; a failure nobody asked about ends the process.

  A save that failed, and whose handle nobody waited on, lost the
  checkpoint the program asked for: it is reported on stderr, and the
  process ends with `EXIT_STATUS` at once (the status of a normal exit is
  fixed before exit handlers run, so nothing else can change it). Exit
  handlers registered with `atexit` then do not run.
  """
  wait_all()
  failed = [h for h in list(_unasked) if h._error is not None]
  if not failed:
    return
  for handle in failed:
    print(
      f'flax_dtensor: the background save to {handle.directory!r} failed '
      f'and nobody called wait() on it: {handle._error}. The process exits '
      f'with status {EXIT_STATUS}.',
      file=sys.stderr,
    )
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError, AttributeError):
      pass
  os._exit(EXIT_STATUS)
