"""Atomic export directories: complete or absent, and nothing left behind.

An export is written into a hidden, marked sibling (`MARKER`: the writer's
pid, host and start time) and renamed into place; an old export is renamed
aside first. `recover` finishes what a killed writer left; `check_replaceable`
refuses to overwrite what this package did not write. In a multi-process
run, process 0 does the filesystem work and the others wait at barriers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import secrets
import shutil
import socket
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from flax_dtensor import _errors
from flax_dtensor.dtensor import _manifest

MARKER = '.flax_dtensor-writer.json'
_TMP = '.tmp-'
_OLD = '.old-'
WRITING, COMPLETE, REPLACED = 'writing', 'complete', 'replaced'

# Broadcast status codes (process 0 decides, every process acts alike).
_OK, _EXISTS, _FAILED = 0, 1, 2


# Markers and liveness
# ------------------------------------------------------------------------------


def _start_time(pid: int) -> str | None:
  """A process's start time (Linux), to tell a reused pid apart."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[19]
  except (OSError, IndexError):
    return None


@dataclasses.dataclass(frozen=True)
class Marker:
  """Who writes (or wrote) a directory, and how far they got."""

  pid: int
  host: str
  started: str | None
  state: str

  @classmethod
  def mine(cls, state: str) -> Marker:
    pid = os.getpid()
    return cls(pid, socket.gethostname(), _start_time(pid), state)

  def alive(self) -> bool | None:
    """True or False on this host; None (unknown) for another host."""
    if self.host != socket.gethostname():
      return None
    try:
      os.kill(self.pid, 0)
    except ProcessLookupError:
      return False
    except PermissionError:
      pass
    started = _start_time(self.pid)
    return started is None or self.started is None or started == self.started

  def describe(self) -> str:
    return f'pid {self.pid} on host {self.host}'


def write_marker(directory: str, state: str) -> None:
  path = os.path.join(directory, MARKER)
  with open(path + '.new', 'w') as f:
    json.dump(dataclasses.asdict(Marker.mine(state)), f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(path + '.new', path)


def read_marker(directory: str) -> Marker | None:
  try:
    with open(os.path.join(directory, MARKER)) as f:
      raw = json.load(f)
    return Marker(
      int(raw['pid']), str(raw['host']), raw.get('started'), str(raw['state'])
    )
  except (OSError, ValueError, KeyError, TypeError):
    return None


def _fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def flush_files(path: str) -> None:
  """Flushes every file under `path` to disk (not the directories).

  A file removed after the listing (another process's part of a manifest,
  merged and deleted by process 0) has nothing left to flush.
  """
  for root, _, files in os.walk(path):
    for name in files:
      try:
        fd = os.open(os.path.join(root, name), os.O_RDONLY)
      except FileNotFoundError:
        continue
      try:
        os.fsync(fd)
      finally:
        os.close(fd)


def _fsync_tree(path: str) -> None:
  """Flushes every file under `path`, then the directories, to disk."""
  flush_files(path)
  for root, _, _ in os.walk(path):
    _fsync_dir(root)


def _sibling(directory: str, infix: str) -> str:
  parent, name = os.path.split(directory)
  return os.path.join(parent, f'.{name}{infix}{secrets.token_hex(4)}')


def siblings(directory: str) -> list[str]:
  """The hidden temporaries of `directory`: new ones, then old ones."""
  parent, name = os.path.split(directory)
  found = []
  for infix in (_TMP, _OLD):
    pattern = os.path.join(glob.escape(parent), f'.{glob.escape(name)}{infix}*')
    found += sorted(p for p in glob.glob(pattern) if os.path.isdir(p))
  return found


# Recovery
# ------------------------------------------------------------------------------


def _remove(path: str) -> None:
  """Deletes a temporary, its marker last: a kill midway leaves it marked."""
  if os.path.islink(path) or not os.path.isdir(path):
    os.remove(path)
    return
  for name in os.listdir(path):
    if name != MARKER:
      child = os.path.join(path, name)
      if os.path.isdir(child) and not os.path.islink(child):
        shutil.rmtree(child)
      else:
        os.remove(child)
  with contextlib.suppress(FileNotFoundError):
    os.remove(os.path.join(path, MARKER))
  os.rmdir(path)


def recover(directory: str, *, writing: bool) -> None:
  """Finishes or undoes what a killed writer left at `directory`.

  If `directory` is missing and a dead writer left a complete new export,
  it is moved into place; else a renamed-aside old export is moved back.
  Temporaries of dead writers on this host are removed, never those of a
  live writer. Call on process 0 only.

  Args:
    directory: The export directory.
    writing: Whether a save follows (a live writer is then an error).

  Raises:
    ExportError: If another writer is alive, or the export is missing and
      only another host's writer could say where it is.
  """
  temporaries = [(p, read_marker(p)) for p in siblings(directory)]
  live = [(p, m) for p, m in temporaries if m is not None and m.alive()]
  unknown = [
    (p, m) for p, m in temporaries if m is not None and m.alive() is None
  ]
  exists = os.path.lexists(directory)
  changed = False
  if live and (writing or not exists):
    path, marker = live[0]
    raise _errors.ExportError(
      f'Another save to {directory!r} is in progress ({marker.describe()}, '
      f'writing {path!r}). Wait for it to finish, or save elsewhere.'
    )
  if live:
    return
  if not exists:
    complete = [
      p
      for p, m in temporaries
      if _TMP in p and m is not None and m.state == COMPLETE
    ]
    old = [p for p, m in temporaries if _OLD in p and _manifest.locate(p)]
    chosen = (complete or old or [None])[-1]
    if chosen is None and unknown:
      raise _errors.ExportError(
        f'{directory!r} does not exist, and a writer on another host left '
        f'{[p for p, _ in unknown]!r}. Check that host; a complete export '
        'there holds its flax_dtensor.json and can be renamed into place.'
      )
    if chosen is not None:
      os.rename(chosen, directory)
      with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(directory, MARKER))
      temporaries = [(p, m) for p, m in temporaries if p != chosen]
      changed = True
  stray = read_marker(directory) if os.path.isdir(directory) else None
  if stray is not None and stray.alive() is False:
    os.remove(os.path.join(directory, MARKER))
  for path, marker in temporaries:
    if marker is None:
      with contextlib.suppress(OSError):
        os.rmdir(path)  # Only an empty one: the writer died at once.
        changed = True
    elif marker.alive() is False:
      _remove(path)
      changed = True
  if changed:
    _fsync_dir(os.path.dirname(directory))


# Overwriting only what is ours
# ------------------------------------------------------------------------------


def _is_within(path: str, ancestor: str) -> bool:
  return path == ancestor or path.startswith(ancestor.rstrip(os.sep) + os.sep)


def check_replaceable(directory: str) -> None:
  """Raises unless `directory` is an export this package wrote (or empty).

  Raises:
    ExportError: For the filesystem root, the home directory, the current
      directory or one of its ancestors, a file or symlink, or a non-empty
      directory without a flax_dtensor manifest.
  """
  real = os.path.realpath(directory)
  cwd = os.path.realpath(os.getcwd())
  home = os.path.realpath(os.path.expanduser('~'))
  why = None
  if real == os.path.realpath(os.sep):
    why = 'it is the filesystem root'
  elif real == home:
    why = 'it is the home directory'
  elif _is_within(cwd, real):
    why = 'it is the current directory or one of its ancestors'
  elif os.path.islink(directory):
    why = 'it is a symbolic link'
  elif not os.path.isdir(directory):
    why = 'it is a file, not an export directory'
  elif os.listdir(directory):
    try:
      manifest = _manifest.read(directory)
    except _errors.ExportError:
      manifest = None
    if manifest is None or manifest.root != os.path.abspath(directory):
      why = (
        'it is a non-empty directory without a flax_dtensor.json manifest, '
        'so not an export of this package'
      )
  if why is not None:
    raise _errors.ExportError(
      f'Refusing to overwrite {directory!r}: {why}. `overwrite=True` only '
      'replaces an export written by flax_dtensor (a checkpoint or '
      'SavedModel directory with its flax_dtensor.json), or an empty '
      'directory. Choose a new directory for the export.'
    )


# The atomic write
# ------------------------------------------------------------------------------


def _exists_message(directory: str) -> str:
  return (
    f'Export target {directory!r} already exists. Pass `overwrite=True` to '
    'replace it, or choose another directory.'
  )


def sync(name: str) -> None:
  """A barrier of every process (a no-op in one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f'flax_dtensor:{name}')


def broadcast(values: tuple[int, int]) -> tuple[int, int]:
  """Process 0's `values` on every process."""
  if jax.process_count() == 1:
    return values
  out = multihost_utils.broadcast_one_to_all(np.asarray(values, np.int32))
  return int(out[0]), int(out[1])


# The most bytes of process 0's error message every process raises.
_MESSAGE_BYTES = 2048


def agree(error: Exception | None, what: str) -> None:
  """Every process raises if process 0 failed; process 0 its own error.

  For work process 0 does alone while the others wait: its outcome, and
  the start of its message, are broadcast, so that no process goes on to a
  collective that another has left.

  Raises:
    ExportError: On the other processes, if process 0 failed.
  """
  if jax.process_count() == 1:
    if error is not None:
      raise error
    return
  data = np.zeros(_MESSAGE_BYTES + 1, np.uint8)
  if error is not None:
    text = f'{type(error).__name__}: {error}'.encode()[:_MESSAGE_BYTES]
    data[0] = 1
    data[1 : 1 + len(text)] = np.frombuffer(text, np.uint8)
  data = np.asarray(multihost_utils.broadcast_one_to_all(data))
  if jax.process_index() == 0:
    if error is not None:
      raise error
    return
  if data[0]:
    message = bytes(data[1:]).rstrip(b'\0').decode('utf-8', 'replace')
    raise _errors.ExportError(
      f'{what} failed: {message.rstrip(".")}. Every process stops here: fix '
      "the cause (process 0's log has the details) and run the export again."
    )


def _move_into_place(tmp: str, directory: str) -> None:
  """Renames `tmp` to `directory`, an existing export aside first."""
  parent = os.path.dirname(directory)
  write_marker(tmp, COMPLETE)
  _fsync_dir(tmp)
  old = None
  if os.path.lexists(directory):
    old = _sibling(directory, _OLD)
    write_marker(directory, REPLACED)
    os.rename(directory, old)
  try:
    os.rename(tmp, directory)
  except BaseException:
    if old is not None:
      os.rename(old, directory)  # Put the previous export back.
      os.remove(os.path.join(directory, MARKER))
    raise
  os.remove(os.path.join(directory, MARKER))
  _fsync_dir(directory)
  _fsync_dir(parent)
  if old is not None:
    _remove(old)
    _fsync_dir(parent)


@contextlib.contextmanager
def atomic_directory(
  directory: str, *, overwrite: bool = False
) -> Iterator[str]:
  """Yields a temporary directory that becomes `directory` on success.

  Args:
    directory: The final directory (absolute). Its parent must exist.
    overwrite: Whether to replace an existing export at `directory`.

  Yields:
    The path of an empty temporary directory to write into (the same path on
    every process). Its marker file is not part of the export.

  Raises:
    ExportError: If `directory` exists and `overwrite` is false, is not an
      export of this package, its parent does not exist, or another save to
      it is in progress.

  Example:
    >>> import os, tempfile
    >>> root = tempfile.mkdtemp()
    >>> with atomic_directory(os.path.join(root, 'out')) as tmp:
    ...   open(os.path.join(tmp, 'a.txt'), 'w').close()
    >>> os.listdir(os.path.join(root, 'out'))
    ['a.txt']
  """
  directory = os.path.abspath(os.fspath(directory))
  parent = os.path.dirname(directory)
  lead = jax.process_index() == 0
  status, token, error = _OK, 0, None
  if lead:
    try:
      if not os.path.isdir(parent):
        raise _errors.ExportError(
          f'The parent directory of export target {directory!r} does not '
          'exist; create it first.'
        )
      recover(directory, writing=True)
      if os.path.lexists(directory):
        if not overwrite:
          status = _EXISTS
        else:
          check_replaceable(directory)
      if status == _OK:
        token = secrets.randbits(31)
        tmp = os.path.join(
          parent, f'.{os.path.basename(directory)}{_TMP}{token:08x}'
        )
        os.mkdir(tmp)
        write_marker(tmp, WRITING)
    except (_errors.ExportError, OSError) as e:
      status, error = _FAILED, e
  status, token = broadcast((status, token))
  if status == _EXISTS:
    raise _errors.ExportError(_exists_message(directory))
  if status == _FAILED:
    if isinstance(error, _errors.ExportError):
      raise error
    raise _errors.ExportError(
      f'Preparing to write {directory!r} failed'
      + (f': {type(error).__name__}: {error}' if error else ' on process 0')
      + '. Check the path and its permissions.'
    ) from error
  tmp = os.path.join(parent, f'.{os.path.basename(directory)}{_TMP}{token:08x}')
  try:
    sync('atomic-start')
    yield tmp
    sync('atomic-written')
    error, status = None, _OK
    if lead:
      try:
        _fsync_tree(tmp)
        _move_into_place(tmp, directory)
      except Exception as e:  # Re-raised below, after telling the others.
        error, status = e, _FAILED
    status, _ = broadcast((status, 0))
    if error is not None:
      raise error
    if status != _OK:
      raise _errors.ExportError(
        f'Process 0 could not move the finished export into {directory!r}; '
        'see its log for the cause.'
      )
  except BaseException:
    if lead:
      with contextlib.suppress(OSError):
        _remove(tmp)
    raise


_STAGING = '.flax_dtensor-staging-'


@contextlib.contextmanager
def staging_directory(parent: str) -> Iterator[str]:
  """A marked scratch directory in `parent`, removed on exit (one process).

  For commands that write several exports and move them into place only
  when all are complete (`commit`). Scratch directories that dead writers
  left in `parent` are removed first.
  """
  for path in glob.glob(os.path.join(glob.escape(parent), _STAGING + '*')):
    marker = read_marker(path)
    if marker is not None and marker.alive() is False:
      _remove(path)
  path = os.path.join(parent, _STAGING + secrets.token_hex(4))
  os.mkdir(path)
  try:
    write_marker(path, WRITING)
    yield path
  finally:
    with contextlib.suppress(OSError):
      _remove(path)


def commit(staged: str, directory: str, *, overwrite: bool) -> None:
  """Moves a complete export into place, as `atomic_directory` does.

  Raises:
    ExportError: If `directory` exists and `overwrite` is false, or it is
      not an export of this package.
  """
  recover(directory, writing=True)
  if os.path.lexists(directory):
    if not overwrite:
      raise _errors.ExportError(_exists_message(directory))
    check_replaceable(directory)
  _move_into_place(staged, directory)


@contextlib.contextmanager
def all_or_nothing(
  parent: str, names: Iterator[str] | list[str], *, overwrite: bool
) -> Iterator[dict[str, str]]:
  """Yields scratch paths for several exports in `parent`; commits all.

  Each export is written to its scratch path; when the block ends, each is
  moved into place (`commit`). If anything fails, nothing of this run is
  left: no export, no scratch directory, and no `parent` if this created
  it. One process only.
  """
  parent = os.path.abspath(parent)
  created = not os.path.exists(parent)
  os.makedirs(parent, exist_ok=True)
  try:
    with staging_directory(parent) as staging:
      staged = {name: os.path.join(staging, name) for name in names}
      yield staged
      for name, path in staged.items():
        commit(path, os.path.join(parent, name), overwrite=overwrite)
  except BaseException:
    if created:
      with contextlib.suppress(OSError):
        os.rmdir(parent)  # Only if empty: nothing else was there.
    raise


def recover_for_reading(directory: str) -> None:
  """`recover` before a read, on process 0; the others wait for it."""
  error: Any = None
  if jax.process_index() == 0:
    try:
      recover(directory, writing=False)
    except (_errors.ExportError, OSError) as e:
      error = e
  status, _ = broadcast((_FAILED if error else _OK, 0))
  if isinstance(error, OSError):
    raise _errors.ExportError(
      f'Checking {directory!r} for an interrupted save failed: {error}. '
      'Check the path and its permissions.'
    ) from error
  if error is not None:
    raise error
  if status != _OK:
    raise _errors.ExportError(
      f'Process 0 could not recover {directory!r}; see its log for the cause.'
    )
