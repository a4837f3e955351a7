"""Atomic directory writes, single- and multi-process.

An export is written into a temporary sibling of its target (same parent, so
the final `os.replace` stays on one filesystem), named
``.{name}.tmp-{8 hex digits}``, and renamed into place only after every file
is complete. An export interrupted by an exception leaves no directory at the
target (the temporary directory is removed); one interrupted by a crash
leaves only a hidden ``.{name}.tmp-*`` sibling, which never looks like a
finished export.

Overwriting (``overwrite=True``) is as atomic as POSIX allows: the old
directory is renamed aside to ``.{name}.old-{hex}``, the new one renamed in,
then the old one deleted. Between the two renames the target is briefly
absent, but it is never partially written.

In a multi-process run (``jax.process_count() > 1``) every process must call
`atomic_directory` together, as they must call the TF checkpoint write it
wraps. Process 0 alone creates the temporary directory, renames it into place
and cleans up; it broadcasts the temporary name to the others and all
processes meet at barriers (`jax.experimental.multihost_utils`) before the
write starts and before anyone returns. The filesystem must be shared by all
processes (a network filesystem, or one machine's local disk), as TF's own
multi-client checkpoint writer already requires.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils

from flax_dtensor import _errors

_TMP_INFIX = '.tmp-'
_OLD_INFIX = '.old-'

# Broadcast status codes (process 0 decides, every process acts alike).
_OK = 0
_EXISTS = 1
_FAILED = 2


def _sibling(directory: str, infix: str, token: int) -> str:
  parent, name = os.path.split(directory)
  return os.path.join(parent, f'.{name}{infix}{token:08x}')


def _make_tmp(directory: str) -> tuple[str, int]:
  """Creates a fresh temporary sibling of `directory`; returns it and token."""
  for _ in range(100):
    token = secrets.randbits(31)
    path = _sibling(directory, _TMP_INFIX, token)
    try:
      os.mkdir(path)
    except FileExistsError:
      continue
    return path, token
  raise _errors.ExportError(  # pragma: no cover - 100 collisions in 2**31.
    f'Could not create a temporary directory next to {directory!r}.'
  )


def _exists_message(directory: str) -> str:
  return (
    f'Export target {directory!r} already exists. Pass `overwrite=True` to '
    'replace it, or choose another directory.'
  )


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(f'flax_dtensor:{name}')


def _broadcast(values: tuple[int, int]) -> tuple[int, int]:
  """Process 0's `values` on every process."""
  if jax.process_count() == 1:
    return values
  out = multihost_utils.broadcast_one_to_all(np.asarray(values, np.int32))
  return int(out[0]), int(out[1])


def _move_into_place(tmp: str, directory: str, *, overwrite: bool) -> None:
  """Renames `tmp` to `directory`, putting an existing target aside first."""
  if not os.path.lexists(directory):
    # os.rename onto a missing name; refuses (rather than merges) if a
    # directory appeared meanwhile and is not empty.
    try:
      os.rename(tmp, directory)
      return
    except OSError:
      if not os.path.lexists(directory):
        raise
  if not overwrite:
    raise _errors.ExportError(_exists_message(directory))
  old = _sibling(directory, _OLD_INFIX, secrets.randbits(31))
  os.rename(directory, old)
  try:
    os.rename(tmp, directory)
  except BaseException:
    os.rename(old, directory)  # Put the previous export back.
    raise
  if os.path.isdir(old) and not os.path.islink(old):
    shutil.rmtree(old, ignore_errors=True)
  else:
    os.remove(old)


def _fsync_tree(path: str) -> None:
  """Flushes every file under `path`, then the directories, to disk."""
  for root, _, files in os.walk(path):
    for name in files:
      fd = os.open(os.path.join(root, name), os.O_RDONLY)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)
    fd = os.open(root, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)


@contextlib.contextmanager
def atomic_directory(
  directory: str | os.PathLike[str], *, overwrite: bool = False
) -> Iterator[str]:
  """Yields a temporary directory that becomes `directory` on success.

  Args:
    directory: The final directory. Its parent must exist.
    overwrite: Whether to replace an existing `directory`.

  Yields:
    The path of an empty temporary directory to write into (the same path on
    every process).

  Raises:
    ExportError: If `directory` exists and `overwrite` is false, or its parent
      directory does not exist.

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
  tmp, token, status = None, 0, _OK
  if lead:
    if not os.path.isdir(parent):
      status = _FAILED
    elif os.path.lexists(directory) and not overwrite:
      status = _EXISTS
    else:
      tmp, token = _make_tmp(directory)
  status, token = _broadcast((status, token))
  if status == _EXISTS:
    raise _errors.ExportError(_exists_message(directory))
  if status == _FAILED:
    raise _errors.ExportError(
      f'The parent directory of export target {directory!r} does not exist; '
      'create it first.'
    )
  tmp = _sibling(directory, _TMP_INFIX, token)
  try:
    _sync('atomic-start')
    yield tmp
    _sync('atomic-written')
    error, status = None, _OK
    if lead:
      try:
        _fsync_tree(tmp)
        _move_into_place(tmp, directory, overwrite=overwrite)
      except Exception as e:  # Re-raised below, after telling the others.
        error, status = e, _FAILED
    status, _ = _broadcast((status, 0))
    if error is not None:
      raise error
    if status != _OK:
      raise _errors.ExportError(
        f'Process 0 could not move the finished export into {directory!r}; '
        'see its log for the cause.'
      )
  except BaseException:
    if lead:
      shutil.rmtree(tmp, ignore_errors=True)
    raise
