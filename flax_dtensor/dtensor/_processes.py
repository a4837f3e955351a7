"""The other processes of a multi-process save or restore, waited for boundedly.

A save or restore meets the other processes at a few points (`sync`) and
hears process 0's decisions (`share`), through the key-value store of JAX's
coordination service, never through device collectives, so a background
save may meet them from a thread of its own (`begin` numbers a session on
the caller's thread, `joined` runs it on any). Every process beats a
heartbeat there, so a process that stops (killed, or hung) is named in a
`PeerError` after `peer_timeout()` seconds of silence, and a process that
fails tells the others at once; nobody waits for a dead peer forever.
`exchange` gives every process each one's value (DTensor's addresses).

Process 0 hosts JAX's coordination service (and TF DTensor's), and JAX ends
every other process (SIGABRT, "the JAX distributed service detected fatal
errors") once that service is gone. So a process 0 that fails holds its
error until every other live process has left the session with its own
(`_hold`): a caller's process 0 that then exits at once takes no other
process down with it.

It stays one module past 600 lines: the heartbeats, the sessions and the
waits share one state (the client, the beating thread, the live sessions)
and one layout of keys in the store, which every part reads and writes.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax._src import distributed  # The client; JAX has no public accessor.
from jax.experimental import multihost_utils

from flax_dtensor import _errors

TIMEOUT_ENV = 'FLAX_DTENSOR_PEER_TIMEOUT'
"""Seconds of silence after which another process counts as stopped."""
DEFAULT_TIMEOUT = 60.0
_ROOT = 'flax_dtensor'
# How long one blocking read of the store lasts before the heartbeats and
# failures are looked at again (at most; a tenth of the timeout if less).
_SLICE = 1.0
# How often a failing process 0 looks whether the others left (`_hold`).
_HOLD_POLL = 0.05


def peer_timeout() -> float:
  """The bound, in seconds: `FLAX_DTENSOR_PEER_TIMEOUT`, else 60.

  Raises:
    ExportError: If the variable is set to anything but a positive number.
  """
  raw = os.environ.get(TIMEOUT_ENV)
  if raw is None or not raw.strip():
    return DEFAULT_TIMEOUT
  try:
    value = float(raw)
  except ValueError:
    value = float('nan')
  if not value > 0 or value == float('inf'):
    raise _errors.ExportError(
      f'Expected {TIMEOUT_ENV} to be a positive number of seconds, got '
      f'{raw!r}. Set it to e.g. 60, or unset it for the default '
      f'({DEFAULT_TIMEOUT:g} s).'
    )
  return value


def _client() -> Any:
  """JAX's distributed client, or None (one process, or no service)."""
  if jax.process_count() == 1:
    return None
  return distributed.global_state.client


# Heartbeats
# ------------------------------------------------------------------------------


def _beat_key(process: int) -> str:
  return f'{_ROOT}/beat/{process}'


class _Heart:
  """This process's heartbeat: a counter in the store, bumped in a thread."""

  def __init__(self) -> None:
    self.lock = threading.Lock()
    self.thread: threading.Thread | None = None
    self.stop = threading.Event()

  def start(self, client: Any) -> None:
    with self.lock:
      if self.thread is not None and self.thread.is_alive():
        return
      self.stop.clear()
      self.thread = threading.Thread(
        target=self._run,
        args=(client, jax.process_index()),
        name='flax_dtensor-heartbeat',
        daemon=True,
      )
      self.thread.start()

  def _run(self, client: Any, process: int) -> None:
    count = 0
    while True:
      count += 1
      try:
        client.key_value_set(
          _beat_key(process), str(count), allow_overwrite=True
        )
        interval = min(5.0, max(0.1, peer_timeout() / 10))
      except Exception:  # The service is gone (shutdown), or a bad setting.
        return
      if self.stop.wait(interval):
        return

  def halt(self) -> None:
    self.stop.set()
    thread = self.thread
    if thread is not None:
      thread.join(timeout=10)


_heart = _Heart()
# Before JAX's client goes away at exit, the thread stops using it.
atexit.register(_heart.halt)


def start() -> None:
  """Starts this process's heartbeat (idempotent; multi-process runs only).

  `initialize()` and every save or restore call it, so a peer that has
  started flax_dtensor is judged by its heartbeat from then on.
  """
  client = _client()
  if client is not None:
    _heart.start(client)


# Sessions: one save or restore, met at barriers
# ------------------------------------------------------------------------------


@dataclasses.dataclass
class Session:
  """One multi-process operation: its key prefix and what it is doing.

  Opened by `begin` on the caller's thread, so that every process numbers
  its sessions in the same order, and run by `joined` on that thread or
  another (a background save runs the rest of its session on its own
  thread).
  """

  client: Any
  prefix: str
  what: str
  aftermath: str
  error: type[Exception] = _errors.PeerError
  rounds: int = 0
  left: bool = False

  def key(self, name: str) -> str:
    self.rounds += 1
    return f'{self.prefix}/{self.rounds}-{name}'

  def fail(self, e: BaseException) -> None:
    """Tells the other processes that this one failed (best effort).

    A failure that is another process having stopped (`_stopped`) is told
    as that process's stop, so that every process names the root cause,
    whichever saw it first.
    """
    stop = getattr(e, _STOP, None)
    if stop is None:
      key = f'{self.prefix}/failed/{jax.process_index()}'
      value = f'{type(e).__name__}: {e}'
    else:
      process, value, seen_by = stop
      key = f'{self.prefix}/failed/{seen_by}-saw-{process}'
    with contextlib.suppress(Exception):
      self.client.key_value_set(key, value, allow_overwrite=True)

  def leave(self) -> None:
    """Records that this process is done with the session's keys."""
    if self.left:
      return
    self.left = True
    with contextlib.suppress(Exception):
      self.client.key_value_set(
        f'{self.prefix}/left/{jax.process_index()}', '', allow_overwrite=True
      )


class _Sessions(threading.local):
  current: Session | None = None


_local = _Sessions()
_lock = threading.Lock()
_counter = iter(range(1, 2**63))
# Process 0: the key prefixes of sessions not yet deleted.
_unswept: list[str] = []


def _new_session(
  client: Any, what: str, aftermath: str, *, swept: bool = True
) -> Session:
  """A session numbered in this process's order; swept once all left it."""
  with _lock:
    session = Session(client, f'{_ROOT}/s{next(_counter)}', what, aftermath)
    if swept and jax.process_index() == 0:
      _unswept.append(session.prefix)
  return session


# The attribute `_stopped` sets on its error, for `fail`: (the process that
# stopped, why, the process that saw it).
_STOP = '_flax_dtensor_stop'


def _stopped(
  session: Session, process: int, why: str, *, seen_by: int | None = None
) -> Exception:
  """The error naming `process` as stopped; `seen_by` another that saw it."""
  relayed = (
    ''
    if seen_by is None
    else f'Process {seen_by} saw it first; this process stops too. '
  )
  error = session.error(
    f'Process {process} of {jax.process_count()} stopped during '
    f'{session.what}: {why}. {relayed}{session.aftermath} Restart every '
    'process of the job, then try again.'
  )
  seen_by = jax.process_index() if seen_by is None else seen_by
  setattr(error, _STOP, (process, why, seen_by))
  return error


def stopped(process: int, why: str) -> Exception:
  """The error naming `process` as stopped, in this operation's words."""
  current = _local.current or Session(None, '', 'an export', '')
  return _stopped(current, process, why)


def _failed(session: Session, process: int, message: str) -> Exception:
  """The error telling that `process` failed with `message` ('Type: text').

  A condition of the export itself that it found (a full disk, a damaged
  export, ...) is raised as the same kind here (`shared_kind`); anything
  else as the session's error, a `PeerError` for a save or restore.
  """
  kind = session.error
  if kind is _errors.PeerError:
    kind = shared_kind(message.partition(':')[0])
  return kind(
    f'Process {process} of {jax.process_count()} failed during '
    f'{session.what}, so this process stops too. {session.aftermath} '
    f'Its error: {message}'
  )


def _reported(session: Session, failures: list[tuple[str, str]]) -> Exception:
  """The error for what other processes reported (`Session.fail`).

  A process that stopped, as another saw it, comes first and in the words
  this process would have used had it seen the stop itself.
  """
  reports = sorted(
    (name.rsplit('/', 1)[1].split('-saw-'), value) for name, value in failures
  )
  for leaf, why in reports:
    if len(leaf) == 2:
      return _stopped(session, int(leaf[1]), why, seen_by=int(leaf[0]))
  leaf, message = reports[0]
  return _failed(session, int(leaf[0]), message)


def _wait(session: Session, key: str, watched: list[int]) -> str:
  """The value at `key` once set; an error if a watched process stops.

  Reads the store in slices; between them, raises as soon as a process of
  the session reported a failure, or a watched process's heartbeat has not
  changed for `peer_timeout()` seconds.
  """
  client = session.client
  timeout = peer_timeout()
  slice_ms = max(1, int(min(_SLICE, timeout / 10) * 1000))
  began = time.monotonic()
  seen: dict[int, tuple[str | None, float]] = {
    p: (None, began) for p in watched
  }
  while True:
    try:
      try:
        return client.blocking_key_value_get(key, slice_ms)
      except jax.errors.JaxRuntimeError as e:
        if 'DEADLINE_EXCEEDED' not in str(e):
          raise
      failures = client.key_value_dir_get(f'{session.prefix}/failed/')
      beats = {p: _beat(client, p) for p in watched}
    except jax.errors.JaxRuntimeError as e:
      # The coordination service runs in process 0.
      raise _stopped(
        session,
        0,
        f"JAX's coordination service, which runs in process 0, is "
        f'unreachable ({e})',
      ) from e
    if failures:
      raise _reported(session, failures)
    now = time.monotonic()
    for p, (last, since) in seen.items():
      if beats[p] != last:
        seen[p] = (beats[p], now)
      elif now - since > timeout:
        raise _stopped(
          session,
          p,
          f'no heartbeat from it for {timeout:g} s (it died, or hangs; '
          f'{TIMEOUT_ENV} sets this bound, {DEFAULT_TIMEOUT:g} s by default)',
        )


def _leave_failed(session: Session, e: BaseException) -> None:
  """Tells the others of `e`, leaves `session`; process 0 waits for them."""
  session.fail(e)
  session.leave()
  _hold(session, e)


def _hosts_service() -> bool:
  """Whether JAX's coordination service runs in this process (process 0)."""
  return getattr(distributed.global_state, 'service', None) is not None


def _hold(session: Session, e: BaseException) -> None:
  """In process 0, returns once the other live processes left `session`.

  Process 0's exit ends JAX's coordination service, and JAX then aborts
  every process still connected to it. A process 0 that fails therefore
  waits, before raising, for each other process to have left the session
  (`Session.leave`, which a failing process calls before raising): those
  in a wait hear of the failure within one slice, those elsewhere at their
  next wait. A process that stopped (named by `e` or by another's report)
  is not waited for, nor one that never beat (it never started
  flax_dtensor) or whose heartbeat is silent for `peer_timeout()` seconds;
  the hold lasts at most that long.
  """
  if not (
    isinstance(e, Exception) and _hosts_service() and session.client is not None
  ):
    return  # Not process 0, or stopped by the user (KeyboardInterrupt).
  client = session.client
  timeout = peer_timeout()
  stop = getattr(e, _STOP, None)
  stopped = None if stop is None else stop[0]
  try:
    # One that never beat never started flax_dtensor: it waits for nothing.
    waiting = {
      p
      for p in range(1, jax.process_count())
      if p != stopped and _beat(client, p) is not None
    }
  except jax.errors.JaxRuntimeError:
    return
  began = time.monotonic()
  seen: dict[int, tuple[str | None, float]] = {
    p: (None, began) for p in waiting
  }
  while waiting and time.monotonic() - began < timeout:
    try:
      left = client.key_value_dir_get(f'{session.prefix}/left/')
      failures = client.key_value_dir_get(f'{session.prefix}/failed/')
      beats = {p: _beat(client, p) for p in waiting}
    except jax.errors.JaxRuntimeError:
      return  # The service is going away anyway.
    waiting -= {int(k.rsplit('/', 1)[1]) for k, _ in left}
    # Processes another saw stop ('<seen>-saw-<stopped>').
    waiting -= {
      int(k.rsplit('-saw-', 1)[1]) for k, _ in failures if '-saw-' in k
    }
    now = time.monotonic()
    for p in list(waiting):
      last, since = seen[p]
      if beats[p] != last:
        seen[p] = (beats[p], now)
      elif now - since > timeout:
        waiting.discard(p)
    if waiting:
      time.sleep(_HOLD_POLL)


def _beat(client: Any, process: int) -> str | None:
  """`process`'s heartbeat counter, or None before its first beat."""
  try:
    return client.key_value_try_get(_beat_key(process))
  except jax.errors.JaxRuntimeError as e:
    if 'NOT_FOUND' not in str(e):
      raise
    return None


def _sweep(client: Any) -> None:
  """Deletes the keys of sessions every process has left (process 0)."""
  with _lock:
    prefixes = list(_unswept)
  done = []
  for prefix in prefixes:
    with contextlib.suppress(jax.errors.JaxRuntimeError):
      left = client.key_value_dir_get(f'{prefix}/left/')
      if len(left) == jax.process_count():
        client.key_value_delete(prefix)
        done.append(prefix)
  with _lock:
    _unswept[:] = [p for p in _unswept if p not in done]


def begin(what: str, aftermath: str) -> Session | None:
  """Opens a session on this thread, for `joined` to run (here or on another).

  Every process must begin the same sessions in the same order (as they
  call the same functions). None in one process, or inside a session of
  this thread (a session inside a session is part of it).

  Args:
    what: The operation, for messages ('the save to /ckpt').
    aftermath: What a failure leaves, one sentence for messages.
  """
  peer_timeout()  # A bad setting is an error in a single process too.
  client = _client()
  if client is None or _local.current is not None:
    return None
  start()
  return _new_session(client, what, aftermath)


@contextlib.contextmanager
def joined(session: Session | None, *, last: bool = True) -> Iterator[None]:
  """Runs the block as part of `session` (from `begin`), on this thread.

  If the block raises, the other processes hear of it at their next wait,
  and raise too, rather than wait for this one; the session is then over
  for this process. With `last`, it is over when the block ends (a
  session run in two parts, on two threads, joins with `last=False` first).
  None (one process, or a nested session) runs the block as it is.
  """
  if session is None:
    yield
    return
  _local.current = session
  try:
    yield
  except BaseException as e:
    _leave_failed(session, e)
    raise
  finally:
    _local.current = None
  if last:
    session.leave()


@contextlib.contextmanager
def session(what: str, aftermath: str) -> Iterator[None]:
  """Groups this thread's `sync` and `share` calls into one operation.

  `begin` then `joined`, on this thread: every process must enter the same
  sessions in the same order; if the block raises, the other processes
  hear of it at their next wait, and raise too.

  Args:
    what: The operation, for messages ('the save to /ckpt').
    aftermath: What a failure leaves, one sentence for messages.
  """
  with joined(begin(what, aftermath)):
    yield


def _current() -> Session:
  if _local.current is not None:
    return _local.current
  # A single wait outside any session: nobody leaves it, it is not swept.
  return _new_session(_client(), 'an export', '', swept=False)


def sync(name: str) -> None:
  """Returns once every process got here (a no-op in one process).

  Each process reports to process 0, which waits for all and then lets
  them go; a process that stopped or failed is named in a PeerError on
  every process.

  Raises:
    PeerError: If a process stops (no heartbeat for `peer_timeout()` s)
      or fails before getting here.
  """
  if jax.process_count() == 1:
    return
  if _client() is None:
    multihost_utils.sync_global_devices(f'flax_dtensor:{name}')
    return
  session = _current()
  base = session.key(name)
  me, client = jax.process_index(), session.client
  if me != 0:
    client.key_value_set(f'{base}/at/{me}', '')
    told = json.loads(_wait(session, f'{base}/go', [0]))
    if told:
      raise _heard(session, told)
    return
  try:
    for p in range(1, jax.process_count()):
      _wait(session, f'{base}/at/{p}', [p])
  except _errors.ExportError as e:
    client.key_value_set(f'{base}/go', json.dumps(_told(e)))
    raise
  client.key_value_set(f'{base}/go', json.dumps(None))
  _sweep(client)


def _told(error: Exception) -> dict[str, Any]:
  """What process 0 tells the others at a `sync` it failed: its words, and
  the process that stopped if that was the cause (`_stopped`)."""
  stop = getattr(error, _STOP, None)
  return {'message': str(error), 'stop': None if stop is None else [*stop]}


def _heard(session: Session, told: dict[str, Any]) -> Exception:
  """The error a process raises for what process 0 told it (`_told`).

  A stop stays a stop (`_stopped`, with who saw it), so that this process,
  should it report the error in turn (`Session.fail`), names the process
  that stopped, not process 0, whichever report the others read first.
  """
  if told['stop'] is None:
    return _errors.PeerError(told['message'])
  process, why, seen_by = told['stop']
  return _stopped(session, process, why, seen_by=seen_by)


def share(value: Any) -> Any:
  """Process 0's `value` (JSON-able) on every process.

  Raises:
    PeerError: If process 0 stops or fails before sharing it.
  """
  if jax.process_count() == 1:
    return value
  if _client() is None:  # Without JAX's service: two broadcasts.
    raw = json.dumps(value).encode() if jax.process_index() == 0 else b''
    size = multihost_utils.broadcast_one_to_all(np.int64(len(raw)))
    data = np.zeros(int(size), np.uint8)
    data[: len(raw)] = np.frombuffer(raw, np.uint8)
    out = multihost_utils.broadcast_one_to_all(data)
    return json.loads(np.asarray(out).tobytes().decode())
  session = _current()
  key = session.key('share')
  if jax.process_index() == 0:
    session.client.key_value_set(key, json.dumps(value))
    return value
  return json.loads(_wait(session, key, [0]))


def shared_kind(name: str) -> type[_errors.ExportError]:
  """The class to raise on every process for process 0's error class `name`.

  A condition of the export itself (a full disk, a damaged or malformed
  export, none there, another save in progress) is the same for every
  process; anything else is, for the others, a peer that failed.
  """
  kind = _errors.export_error_named(name)
  if kind in (_errors.ExportError, _errors.PeerError):
    return _errors.PeerError
  return kind


def agree(error: Exception | None, what: str) -> None:
  """Every process raises if process 0 failed; process 0 its own error.

  For work process 0 does alone while the others wait (`share`): its
  outcome and message reach every process, so that no process goes on to a
  collective that another has left, and a process 0 that stops is named
  after `peer_timeout()` seconds.

  Raises:
    PeerError: On the other processes, if process 0 stopped or failed.
    ExportError: On the other processes, the kind process 0 raised when it
      is one of the export's own condition (`DiskFullError`,
      `DamagedExportError`, ...), as every process finds it alike.
  """
  message = share(None if error is None else f'{type(error).__name__}: {error}')
  if error is not None:
    raise error
  if message is not None:
    raise shared_kind(message.partition(':')[0])(
      f'{what} failed: {message.rstrip(".")}. Every process stops here: fix '
      "the cause (process 0's log has the details) and run the export again."
    )


def exchange(
  name: str,
  value: str,
  *,
  what: str,
  aftermath: str,
  error: type[Exception],
) -> list[str]:
  """Every process's `value` (a str), in process order (multi-process only).

  Each process sets its own key under `name` and reads the others', each
  waited for as `sync` waits: a process that never arrives is named in an
  `error` after `peer_timeout()` seconds without a heartbeat from it.

  Args:
    name: The exchange's name, unique in the job ('dtensor-jobs').
    value: This process's value.
    what: The operation, for messages ('setting up TF DTensor').
    aftermath: What a failure leaves, one sentence for messages.
    error: The class of the error raised.
  """
  client = _client()
  me = jax.process_index()
  session = Session(client, f'{_ROOT}/{name}', what, aftermath, error)
  client.key_value_set(f'{session.prefix}/{me}', value, allow_overwrite=True)
  try:
    values = [
      value if p == me else _wait(session, f'{session.prefix}/{p}', [p])
      for p in range(jax.process_count())
    ]
  except BaseException as e:
    _leave_failed(session, e)
    raise
  session.leave()
  return values
