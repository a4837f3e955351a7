"""Atomic export directories: complete or absent, and nothing left behind.

An export is written into a hidden sibling named by its writer
(`_temporaries`) and renamed into place; an old export is renamed aside
first. So `_recovery` can finish or undo whatever a killed writer left,
whatever moment it died at, and `_writable` refuses first what may not be
written or replaced. `atomic_directory` is the write, in a multi-process
run agreed by every process (process 0 does the filesystem work);
`staging_directory`, `commit` and `all_or_nothing` write several exports
and move them into place only when all are complete.

This layer (these four modules) knows nothing of what an export holds:
the format's layer passes `is_export`, which tells a directory it wrote
(its manifest) from anything else.
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterator
from typing import Any

import jax

from flax_dtensor import _errors, _interrupts
from flax_dtensor.dtensor import _processes
from flax_dtensor.dtensor._storage import _recovery, _temporaries, _writable


def _make_way(
  directory: str, overwrite: bool, is_export: _temporaries.IsExport
) -> list[str]:
  """Process 0's checks and recovery before an export goes to `directory`.

  Its missing parents are created (as TensorFlow's own save does).

  Returns:
    The parent directories created (`_writable.make_parents`).

  Raises:
    SaveInProgressError: If another save to `directory` is in progress.
    ExportError: If its parent is not writable or cannot be created, or
      `directory` exists and `overwrite` is false, or it is not an export of
      this package.
  """
  _writable.check_writable(directory)
  created = _writable.make_parents(directory)
  try:
    _recovery.recover(directory, writing=True, is_export=is_export)
    if os.path.lexists(directory):
      if not overwrite:
        raise _errors.ExportError(
          f'Export target {directory!r} already exists. Pass '
          '`overwrite=True` to replace it, or choose another directory.'
        )
      _writable.check_replaceable(directory, is_export=is_export)
  except BaseException:
    _writable.remove_parents(created)
    raise
  return created


def _move_into_place(tmp: str, directory: str) -> None:
  """Renames `tmp` to `directory`, an existing export aside first.

  Killed at any point, `_recovery.recover` finds the old export (aside,
  under a name that says this process wrote it), the complete new one, or
  both.
  """
  parent = os.path.dirname(directory)
  _temporaries.write_marker(tmp, _temporaries.COMPLETE)
  _temporaries.fsync_dir(tmp)
  old = None
  # An interrupt waits for both renames (or the undoing of the first).
  with _interrupts.swap():
    if os.path.lexists(directory):
      old = _temporaries.sibling(directory, _temporaries.OLD)
      os.rename(directory, old)
      _temporaries.active.add(old)
    try:
      os.rename(tmp, directory)
    except BaseException:
      if old is not None:
        os.rename(old, directory)  # Put the previous export back.
        _temporaries.active.discard(old)
      raise
    _temporaries.active.discard(tmp)
    os.remove(os.path.join(directory, _temporaries.MARKER))
  # And for the old one's removal: forgotten (`_temporaries.active`) only
  # once removed, so that `_recovery.abandon` removes it if the process ends
  # first.
  with _interrupts.deferred():
    _temporaries.fsync_dir(directory)
    _temporaries.fsync_dir(parent)
    if old is not None:
      try:
        _temporaries.remove(old)
      finally:
        _temporaries.active.discard(old)
      _temporaries.fsync_dir(parent)


def _prepare(
  directory: str, overwrite: bool, is_export: _temporaries.IsExport
) -> tuple[str, list[str]]:
  """Process 0's part before writing: checks, recovery, the missing
  parents; the temporary, and the parents created."""
  created = _make_way(directory, overwrite, is_export)
  tmp = _temporaries.sibling(directory, _temporaries.TMP)
  _temporaries.active.add(tmp)
  try:
    os.mkdir(tmp)
  except BaseException:
    _temporaries.active.discard(tmp)
    _writable.remove_parents(created)
    raise
  return tmp, created


@contextlib.contextmanager
def atomic_directory(
  directory: str, *, is_export: _temporaries.IsExport, overwrite: bool = False
) -> Iterator[str]:
  """Yields a temporary directory that becomes `directory` on success.

  Args:
    directory: The final directory (absolute). Its missing parents are
      created (by process 0), and removed again if the write fails.
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
      export of this package, or its parent is not writable or cannot be
      created (a file in the way, a permission).

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
  tmp, error, created = None, None, []
  if lead:
    try:
      tmp, created = _prepare(directory, overwrite, is_export)
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
        _temporaries.fsync_tree(tmp)
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
      # leaves it to `_recovery.abandon`.
      with _interrupts.deferred():
        with contextlib.suppress(OSError):
          _temporaries.remove(tmp)
        _temporaries.removed.add(tmp)
        _temporaries.active.discard(tmp)
        _writable.remove_parents(created)
    raise
  _temporaries.active.discard(tmp)


@contextlib.contextmanager
def staging_directory(parent: str) -> Iterator[str]:
  """A scratch directory in `parent`, named by its writer, removed on exit.

  For commands that write several exports and move them into place only
  when all are complete (`commit`); one process only. Scratch directories
  that dead writers left in `parent` are removed first.
  """
  for path in glob.glob(
    os.path.join(glob.escape(parent), _temporaries.STAGING + '*')
  ):
    writer = _temporaries.owner(path, _temporaries.STAGING)
    if writer is not None and writer.alive(path) is False:
      _temporaries.remove(path)
  path = os.path.join(
    parent, _temporaries.STAGING + _temporaries.Writer.me().tag()
  )
  _temporaries.active.add(path)
  try:
    os.mkdir(path)
    yield path
  finally:
    with _interrupts.deferred():
      with contextlib.suppress(OSError):
        _temporaries.remove(path)
      _temporaries.active.discard(path)


def commit(
  staged: str,
  directory: str,
  *,
  overwrite: bool,
  is_export: _temporaries.IsExport,
) -> None:
  """Moves a complete export into place, as `atomic_directory` does.

  Raises:
    SaveInProgressError: If another save to `directory` is in progress.
    ExportError: If `directory` exists and `overwrite` is false, or it is
      not an export of this package.
  """
  _make_way(directory, overwrite, is_export)
  _move_into_place(staged, directory)


@contextlib.contextmanager
def all_or_nothing(
  parent: str,
  names: Iterator[str] | list[str],
  *,
  overwrite: bool,
  is_export: _temporaries.IsExport,
) -> Iterator[dict[str, str]]:
  """Yields scratch paths for several exports in `parent`; commits all.

  Each export is written to its scratch path; when the block ends, each is
  moved into place (`commit`). If anything fails, nothing of this run is
  left: no export, no scratch directory, and no `parent` (nor its
  parents) if this created it. One process only.
  """
  parent = os.path.abspath(parent)
  names = list(names)
  created: list[str] = []
  if not os.path.exists(parent):
    _writable.check_writable(parent)
    created = _writable.make_parents(parent)
    try:
      os.mkdir(parent)
    except OSError as e:
      _writable.remove_parents(created)
      raise _errors.ExportError(
        f'Cannot create the directory {parent!r}: {e.strerror}. Create it '
        'yourself, or choose a directory you may write in.'
      ) from e
    created.append(parent)
  try:
    for name in names:
      target = os.path.join(parent, name)
      _writable.check_writable(target)
      if os.path.lexists(target) and overwrite:
        _writable.check_replaceable(target, is_export=is_export)
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
    with _interrupts.deferred():
      _writable.remove_parents(created)  # Only where still empty.
    raise
