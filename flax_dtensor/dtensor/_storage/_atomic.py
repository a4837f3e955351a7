"""Atomic export directories: complete or absent, and nothing left behind.

An export is written into a hidden sibling whose name says who writes it
(`Writer`: host, pid and process start time) and renamed into place; an
old export is renamed aside first, under a name that says the same. So a
temporary is owned from the instant it exists: `recover` removes what dead
writers left, whatever moment they died at, and finishes an interrupted
swap. `check_writable` and `check_replaceable` refuse, before any byte is
written, places this process cannot write and what this package did not
write. In a multi-process run, process 0 does the filesystem work.

This layer knows nothing of what an export holds: the format's layer
passes `is_export`, which tells a directory it wrote (its manifest) from
anything else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import re
import secrets
import shutil
import socket
import stat
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import jax

from flax_dtensor import _errors, _interrupts
from flax_dtensor.dtensor import _processes

IsExport = Callable[[str], bool]
"""Whether a directory holds an export of this package, written for it.

Given by the format's layer (`_decode.is_export`): true for a directory
whose own manifest is valid and describes it, false for anything else.
"""

# Marks a temporary complete (all files written and flushed): its writer's
# identity and `COMPLETE`. Not part of the export.
MARKER = '.flax_dtensor-writer.json'
_TMP = '.tmp-'
_OLD = '.old-'
_STAGING = '.flax_dtensor-staging-'
# States a marker can hold. Only COMPLETE is written now; temporaries
# written by flax_dtensor before names carried the writer hold the others.
WRITING, COMPLETE, REPLACED = 'writing', 'complete', 'replaced'

# Temporaries this process is writing now (a pid alone cannot tell them
# apart from ones a failed save of this same process left).
_active: set[str] = set()
# Temporaries this process removed after a failure or an interrupt: a
# library's thread still writing there (Orbax's) may create them again;
# `abandon` removes them once more before the process ends.
_removed: set[str] = set()


# Writers and liveness
# ------------------------------------------------------------------------------


def _start_time(pid: int) -> str | None:
  """A process's start time (Linux), to tell a reused pid apart."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def _host_label(host: str) -> str:
  """`host` as it appears in a name: itself, or a prefix and its CRC.

  Names keep `[A-Za-z0-9.-]` and at most 40 characters as they are; any
  other host name gets a `~` and a CRC-32 of the whole name, so two hosts
  never share a label by truncation.
  """
  safe = re.sub(r'[^A-Za-z0-9.-]', '_', host)
  if safe == host and 0 < len(host) <= 40:
    return host
  return f'{safe[:31]}~{zlib.crc32(host.encode()):08x}'


# token-pid-start-host: all of a name after `.NAME.tmp-` (`.old-`, staging).
_TAG = re.compile(
  r'(?P<token>[0-9a-f]{8})-(?P<pid>[0-9]+)-(?P<started>[0-9]+)-'
  r'(?P<host>[A-Za-z0-9._~-]+)'
)


@dataclasses.dataclass(frozen=True)
class Writer:
  """Who writes (or wrote) a temporary directory."""

  pid: int
  host: str  # A host name or its label (`_host_label`).
  started: str | None  # The process start time, if known.

  @classmethod
  def on_this_host(cls, pid: int) -> Writer:
    """The process `pid` of this host, as a name records it."""
    return cls(pid, _host_label(socket.gethostname()), _start_time(pid))

  @classmethod
  def me(cls) -> Writer:
    return cls.on_this_host(os.getpid())

  @classmethod
  def from_name(cls, path: str, prefix: str) -> Writer | None:
    """The writer the name of `path` records after `prefix`, or None.

    None for a name of an older version (`.NAME.tmp-` and 8 hex digits).
    """
    name = os.path.basename(path)
    if not name.startswith(prefix):
      return None
    match = _TAG.fullmatch(name[len(prefix) :])
    if match is None:
      return None
    started = match['started']
    return cls(
      int(match['pid']), match['host'], None if started == '0' else started
    )

  def tag(self) -> str:
    """A fresh name suffix saying who writes: token-pid-start-host."""
    return f'{secrets.token_hex(4)}-{self.pid}-{self.started or 0}-{self.host}'

  def alive(self, path: str | None = None) -> bool | None:
    """True or False on this host; None (unknown) for another host.

    `path`, a temporary of this process, is alive while this process
    writes it.
    """
    if _host_label(self.host) != _host_label(socket.gethostname()):
      return None
    if self.pid == os.getpid() and self.started in (
      None,
      _start_time(self.pid),
    ):
      return path is None or path in _active
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


@dataclasses.dataclass(frozen=True)
class Marker:
  """A temporary's marker file: its writer, and how far it got."""

  writer: Writer
  state: str


def write_marker(directory: str, state: str) -> None:
  path = os.path.join(directory, MARKER)
  me = Writer.me()
  with open(path + '.new', 'w') as f:
    json.dump(
      {'pid': me.pid, 'host': me.host, 'started': me.started, 'state': state},
      f,
    )
    f.flush()
    os.fsync(f.fileno())
  os.replace(path + '.new', path)


def read_marker(directory: str) -> Marker | None:
  """The marker of `directory`, else its half-written `.new`, else None."""
  for name in (MARKER, MARKER + '.new'):
    try:
      with open(os.path.join(directory, name)) as f:
        raw = json.load(f)
      started = raw.get('started')
      writer = Writer(
        int(raw['pid']),
        str(raw['host']),
        None if started is None else str(started),
      )
      return Marker(writer, str(raw['state']))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
      continue
  return None


def owner(path: str, prefix: str) -> Writer | None:
  """Who writes the temporary `path`: its name says, else its marker."""
  writer = Writer.from_name(path, prefix)
  if writer is None:
    marker = read_marker(path)
    writer = marker.writer if marker is not None else None
  return writer


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
  return os.path.join(parent, f'.{name}{infix}{Writer.me().tag()}')


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


@dataclasses.dataclass(frozen=True)
class _Temporary:
  path: str
  writer: Writer | None  # None: an unmarked temporary of an older name.
  complete: bool

  @property
  def alive(self) -> bool | None:
    return None if self.writer is None else self.writer.alive(self.path)


def _temporaries(directory: str) -> list[_Temporary]:
  out = []
  name = os.path.basename(directory)
  for path in siblings(directory):
    infix = (
      _TMP if os.path.basename(path).startswith(f'.{name}{_TMP}') else _OLD
    )
    writer = owner(path, f'.{name}{infix}')
    marker = read_marker(path)
    complete = marker is not None and marker.state == COMPLETE
    out.append(_Temporary(path, writer, complete))
  return out


def recover(directory: str, *, writing: bool, is_export: IsExport) -> None:
  """Finishes or undoes what a killed writer left at `directory`.

  If `directory` is missing and a dead writer left a complete new export,
  it is moved into place; else a renamed-aside old export is moved back.
  Temporaries of dead writers on this host are removed, never those of a
  live writer (or of another host, whose liveness cannot be known here).
  Call on process 0 only.

  Args:
    directory: The export directory.
    writing: Whether a save follows (a live writer is then an error).
    is_export: Whether a directory holds an export (an old one renamed
      aside is moved back only then).

  Raises:
    SaveInProgressError: If another writer is alive, or the export is
      missing and only another host's writer could say where it is.
  """
  temporaries = _temporaries(directory)
  live = [t for t in temporaries if t.alive is True]
  unknown = [t for t in temporaries if t.writer is not None and t.alive is None]
  exists = os.path.lexists(directory)
  changed = False
  if live and (writing or not exists):
    raise _errors.SaveInProgressError(
      f'Another save to {directory!r} is in progress '
      f'({live[0].writer.describe()}, writing {live[0].path!r}). Wait for it '
      'to finish, or save elsewhere.'
    )
  if not exists and not live:
    complete = [t for t in temporaries if _TMP in t.path and t.complete]
    old = [t for t in temporaries if _OLD in t.path and is_export(t.path)]
    chosen = (complete or old or [None])[-1]
    if chosen is None and unknown:
      raise _errors.SaveInProgressError(
        f'{directory!r} does not exist, and a writer on another host left '
        f'{[t.path for t in unknown]!r}. Check that host; a complete export '
        'there holds its flax_dtensor.json and can be renamed into place.'
      )
    if chosen is not None:
      os.rename(chosen.path, directory)
      with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(directory, MARKER))
      temporaries.remove(chosen)
      changed = True
  stray = read_marker(directory) if os.path.isdir(directory) else None
  if stray is not None and stray.writer.alive() is False:
    for name in (MARKER, MARKER + '.new'):
      with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(directory, name))
  for t in temporaries:
    if t.writer is None:
      with contextlib.suppress(OSError):
        os.rmdir(t.path)  # Only an empty one: whose it was, nothing says.
        changed = True
    elif t.alive is False:
      _remove(t.path)
      changed = True
  if changed:
    _fsync_dir(os.path.dirname(directory))


def abandon() -> bool:
  """Undoes what this process is writing, for a process about to end.

  Registered with `_interrupts.on_exit_now`: run while no swap is under
  way, maybe on another thread than the writer's. An old export renamed
  aside goes back if its place is empty (else it is the replaced one and
  goes); temporaries being written are removed. Each is remembered, so
  that a next pass removes it again should a library's thread still
  writing (Orbax's) have made it again; what is made after the last pass
  is a dead writer's, removed by the next `recover`.

  Returns:
    Whether this pass found anything to undo.
  """
  found = False
  for path in sorted(
    list(_active) + list(_removed), key=lambda p: _OLD not in p
  ):
    parent, name = os.path.split(path)
    target = None
    if name.startswith('.') and _OLD in name:
      target = os.path.join(parent, name[1:].rsplit(_OLD, 1)[0])
    found = found or os.path.lexists(path)
    try:
      if target is not None and not os.path.lexists(target):
        os.rename(path, target)
        with contextlib.suppress(FileNotFoundError):
          os.remove(os.path.join(target, MARKER))
      elif os.path.lexists(path):
        _remove(path)
    except OSError:
      pass
    _active.discard(path)
    if target is None:
      _removed.add(path)  # Looked at again by the next pass.
  return found


_interrupts.on_exit_now(abandon)


# Where we may write, and overwriting only what is ours
# ------------------------------------------------------------------------------


def _is_within(path: str, ancestor: str) -> bool:
  return path == ancestor or path.startswith(ancestor.rstrip(os.sep) + os.sep)


def _who_may_write(path: str) -> str:
  """Why this process cannot write in the directory `path`, for messages."""
  try:
    if os.statvfs(path).f_flag & os.ST_RDONLY:
      return 'it is on a read-only filesystem'
    info = os.stat(path)
  except OSError as e:
    return f'it cannot be inspected ({e.strerror})'
  return (
    f'this process (uid {os.geteuid()}) may not write in it (owner uid '
    f'{info.st_uid}, mode {stat.filemode(info.st_mode)})'
  )


def check_writable(directory: str) -> None:
  """Raises unless this process can create `directory`'s temporaries.

  Checked before anything is written: the parent is an existing directory
  this process may create and rename entries in (permissions, a read-only
  filesystem). `os.access` answers for the real user, root included.

  Raises:
    ExportError: Naming the parent, what it is, and the fix.
  """
  parent = os.path.dirname(directory)
  if not os.path.lexists(parent):
    raise _errors.ExportError(
      f'The parent directory of export target {directory!r} does not '
      'exist; create it first.'
    )
  if not os.path.isdir(parent):
    what = 'a file' if os.path.isfile(parent) else 'not a directory either'
    raise _errors.ExportError(
      f'The parent of export target {directory!r} is not a directory: '
      f'{parent!r} is {what}. Expected a path inside a directory; choose '
      'another path.'
    )
  if not os.access(parent, os.W_OK | os.X_OK):
    raise _errors.ExportError(
      f'Cannot write export target {directory!r}: its parent directory '
      f'{parent!r} is not writable ({_who_may_write(parent)}). An export is '
      'written beside its target and renamed into place, so the parent '
      'must be writable: choose a directory you may write in, or change its '
      'permissions.'
    )


def _check_removable(directory: str) -> None:
  """Raises unless this process can rename `directory` and delete it all."""
  parent = os.path.dirname(directory)
  try:
    parent_info, info = os.stat(parent), os.lstat(directory)
  except OSError:
    return
  euid = os.geteuid()
  if parent_info.st_mode & stat.S_ISVTX and euid not in (
    0,
    info.st_uid,
    parent_info.st_uid,
  ):
    raise _errors.ExportError(
      f'Cannot replace {directory!r}: it belongs to uid {info.st_uid}, and '
      f'its parent {parent!r} has the sticky bit, so only its owner may '
      'rename it. Save to a new directory, or ask its owner to remove it.'
    )
  for root, dirs, _ in os.walk(directory):
    for path in [root] + [os.path.join(root, d) for d in dirs]:
      if not os.path.islink(path) and not os.access(path, os.W_OK | os.X_OK):
        raise _errors.ExportError(
          f'Cannot replace {directory!r}: {path!r} is not writable '
          f'({_who_may_write(path)}), so the old export could not be deleted '
          'once the new one is in place. Save to a new directory, or ask '
          'its owner to change its permissions or remove it.'
        )


def check_replaceable(directory: str, *, is_export: IsExport) -> None:
  """Raises unless `directory` is an export this package wrote (or empty).

  Also raises if this process could not remove it after writing the new
  one (someone else's directory). `is_export` tells an export of this
  package (its manifest) from any other non-empty directory.

  Raises:
    ExportError: For the filesystem root, the home directory, the current
      directory or one of its ancestors, a file or symlink, a non-empty
      directory without a flax_dtensor manifest, or one this process may not
      delete.
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
  elif os.listdir(directory) and not is_export(os.path.abspath(directory)):
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
  _check_removable(directory)


# The atomic write
# ------------------------------------------------------------------------------


def _exists_message(directory: str) -> str:
  return (
    f'Export target {directory!r} already exists. Pass `overwrite=True` to '
    'replace it, or choose another directory.'
  )


def _move_into_place(tmp: str, directory: str) -> None:
  """Renames `tmp` to `directory`, an existing export aside first.

  Killed at any point, `recover` finds the old export (aside, under a name
  that says this process wrote it), the complete new one, or both.
  """
  parent = os.path.dirname(directory)
  write_marker(tmp, COMPLETE)
  _fsync_dir(tmp)
  old = None
  # An interrupt waits for both renames (or the undoing of the first).
  with _interrupts.swap():
    if os.path.lexists(directory):
      old = _sibling(directory, _OLD)
      os.rename(directory, old)
      _active.add(old)
    try:
      os.rename(tmp, directory)
    except BaseException:
      if old is not None:
        os.rename(old, directory)  # Put the previous export back.
        _active.discard(old)
      raise
    _active.discard(tmp)
    os.remove(os.path.join(directory, MARKER))
  # And for the old one's removal: forgotten (`_active`) only once removed,
  # so that `abandon` removes it if the process ends first.
  with _interrupts.deferred():
    _fsync_dir(directory)
    _fsync_dir(parent)
    if old is not None:
      try:
        _remove(old)
      finally:
        _active.discard(old)
      _fsync_dir(parent)


def _prepare(directory: str, overwrite: bool, is_export: IsExport) -> str:
  """Process 0's part before writing: checks, recovery; the temporary."""
  check_writable(directory)
  recover(directory, writing=True, is_export=is_export)
  if os.path.lexists(directory):
    if not overwrite:
      raise _errors.ExportError(_exists_message(directory))
    check_replaceable(directory, is_export=is_export)
  tmp = _sibling(directory, _TMP)
  _active.add(tmp)
  os.mkdir(tmp)
  return tmp


@contextlib.contextmanager
def atomic_directory(
  directory: str, *, is_export: IsExport, overwrite: bool = False
) -> Iterator[str]:
  """Yields a temporary directory that becomes `directory` on success.

  Args:
    directory: The final directory (absolute). Its parent must exist.
    is_export: Whether a directory holds an export of this package (only
      one is replaced, or moved back after an interrupted save).
    overwrite: Whether to replace an existing export at `directory`.

  Yields:
    The path of an empty temporary directory to write into (the same path on
    every process).

  Raises:
    SaveInProgressError: If another save to it is in progress.
    PeerError: If another process stopped or failed.
    ExportError: If `directory` exists and `overwrite` is false, is not an
      export of this package, or its parent does not exist or is not
      writable.

  Example:
    >>> import os, tempfile
    >>> root = tempfile.mkdtemp()
    >>> out = os.path.join(root, 'out')
    >>> with atomic_directory(out, is_export=lambda path: False) as tmp:
    ...   open(os.path.join(tmp, 'a.txt'), 'w').close()
    >>> os.listdir(os.path.join(root, 'out'))
    ['a.txt']
  """
  directory = os.path.abspath(os.fspath(directory))
  lead = jax.process_index() == 0
  tmp, error = None, None
  if lead:
    try:
      tmp = _prepare(directory, overwrite, is_export)
    except _errors.ExportError as e:
      error = e
    except OSError as e:
      error = _errors.ExportError(
        f'Preparing to write {directory!r} failed: {type(e).__name__}: '
        f'{e}. Check the path and its permissions.'
      )
      error.__cause__ = e
  shared = _processes.share(
    {
      'tmp': tmp,
      'error': error and str(error),
      'kind': error and type(error).__name__,
    }
  )
  if error is not None:
    raise error
  if shared['error'] is not None:
    raise _errors.export_error_named(shared['kind'])(shared['error'])
  tmp = shared['tmp']
  try:
    yield tmp
    _processes.sync('atomic-written')
    outcome: dict[str, Any] = {}
    error = None
    if lead:
      try:
        _fsync_tree(tmp)
        _move_into_place(tmp, directory)
      except Exception as e:  # Re-raised below, after telling the others.
        error, outcome = e, {'error': f'{type(e).__name__}: {e}'}
    outcome = _processes.share(outcome)
    if error is not None:
      raise error
    if 'error' in outcome:
      kind = _processes.shared_kind(outcome['error'].partition(':')[0])
      raise kind(
        f'Process 0 could not move the finished export into {directory!r}: '
        f'{outcome["error"]}'
      )
  except BaseException:
    if lead:
      # Forgotten only once removed: an interrupt before the removal
      # leaves it to `abandon`.
      with _interrupts.deferred():
        with contextlib.suppress(OSError):
          _remove(tmp)
        _removed.add(tmp)
        _active.discard(tmp)
    raise
  _active.discard(tmp)


@contextlib.contextmanager
def staging_directory(parent: str) -> Iterator[str]:
  """A scratch directory in `parent`, named by its writer, removed on exit.

  For commands that write several exports and move them into place only
  when all are complete (`commit`); one process only. Scratch directories
  that dead writers left in `parent` are removed first.
  """
  for path in glob.glob(os.path.join(glob.escape(parent), _STAGING + '*')):
    writer = owner(path, _STAGING)
    if writer is not None and writer.alive(path) is False:
      _remove(path)
  path = os.path.join(parent, _STAGING + Writer.me().tag())
  _active.add(path)
  try:
    os.mkdir(path)
    yield path
  finally:
    with _interrupts.deferred():
      with contextlib.suppress(OSError):
        _remove(path)
      _active.discard(path)


def commit(
  staged: str, directory: str, *, overwrite: bool, is_export: IsExport
) -> None:
  """Moves a complete export into place, as `atomic_directory` does.

  Raises:
    SaveInProgressError: If another save to `directory` is in progress.
    ExportError: If `directory` exists and `overwrite` is false, or it is
      not an export of this package.
  """
  check_writable(directory)
  recover(directory, writing=True, is_export=is_export)
  if os.path.lexists(directory):
    if not overwrite:
      raise _errors.ExportError(_exists_message(directory))
    check_replaceable(directory, is_export=is_export)
  _move_into_place(staged, directory)


@contextlib.contextmanager
def all_or_nothing(
  parent: str,
  names: Iterator[str] | list[str],
  *,
  overwrite: bool,
  is_export: IsExport,
) -> Iterator[dict[str, str]]:
  """Yields scratch paths for several exports in `parent`; commits all.

  Each export is written to its scratch path; when the block ends, each is
  moved into place (`commit`). If anything fails, nothing of this run is
  left: no export, no scratch directory, and no `parent` if this created
  it. One process only.
  """
  parent = os.path.abspath(parent)
  names = list(names)
  created = not os.path.exists(parent)
  if created:
    check_writable(parent)
  os.makedirs(parent, exist_ok=True)
  try:
    for name in names:
      target = os.path.join(parent, name)
      check_writable(target)
      if os.path.lexists(target) and overwrite:
        check_replaceable(target, is_export=is_export)
    with staging_directory(parent) as staging:
      staged = {name: os.path.join(staging, name) for name in names}
      yield staged
      for name, path in staged.items():
        commit(
          path,
          os.path.join(parent, name),
          overwrite=overwrite,
          is_export=is_export,
        )
  except BaseException:
    if created:
      with _interrupts.deferred(), contextlib.suppress(OSError):
        os.rmdir(parent)  # Only if empty: nothing else was there.
    raise


def recover_for_reading(directory: str, *, is_export: IsExport) -> None:
  """`recover` before a read, on process 0; the others wait for it.

  Raises:
    SaveInProgressError: If another writer is alive and the export is
      missing.
    PeerError: If another process stopped.
    ExportError: If recovering fails otherwise.
  """
  error: BaseException | None = None
  if jax.process_index() == 0:
    try:
      recover(directory, writing=False, is_export=is_export)
    except OSError as e:
      error = _errors.ExportError(
        f'Checking {directory!r} for an interrupted save failed: {e}. '
        'Check the path and its permissions.'
      )
      error.__cause__ = e
    except _errors.ExportError as e:
      error = e
  shared = _processes.share(
    None
    if error is None
    else {'kind': type(error).__name__, 'error': str(error)}
  )
  if error is not None:
    raise error
  if shared is not None:
    raise _errors.export_error_named(shared['kind'])(shared['error'])
