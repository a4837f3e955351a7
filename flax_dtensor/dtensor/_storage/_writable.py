"""Where an export may be written, and overwriting only what is ours.

`check_writable` refuses, before any byte is written, a place this process
cannot write (a file in the way of its parents, an ancestor not writable:
`who_may_write` says why); `make_parents` then creates its missing parents,
as TensorFlow's and Orbax's saves do, and `remove_parents` removes them
again after a failed write; `check_replaceable` refuses to replace what
this package did not write, or what this process could not remove.
"""

from __future__ import annotations

import os
import stat

from flax_dtensor import _errors
from flax_dtensor.dtensor._storage import _temporaries


def _is_within(path: str, ancestor: str) -> bool:
  return path == ancestor or path.startswith(ancestor.rstrip(os.sep) + os.sep)


def who_may_write(path: str) -> str:
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


def _nearest_existing(directory: str) -> str:
  """The nearest ancestor of `directory` that exists (or is a link)."""
  parent = os.path.dirname(os.path.abspath(directory))
  while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
    parent = os.path.dirname(parent)
  return parent


def check_writable(directory: str) -> None:
  """Raises unless this process can create `directory`'s temporaries.

  Checked before anything is written: the nearest existing ancestor of
  `directory` (its parent, or the one below which `make_parents` creates
  the missing ones) is a directory this process may create and rename
  entries in (permissions, a read-only filesystem). `os.access` answers
  for the real user, root included.

  Raises:
    ExportError: Naming the ancestor, what it is, and the fix.
  """
  parent = os.path.dirname(os.path.abspath(directory))
  existing = _nearest_existing(directory)
  if not os.path.isdir(existing):
    if not os.path.exists(existing):
      what = 'a symbolic link to nothing'
    elif os.path.isfile(existing):
      what = 'a file'
    else:
      what = 'not a directory either'
    where = 'The parent' if existing == parent else 'An ancestor'
    raise _errors.ExportError(
      f'{where} of export target {directory!r} is not a directory: '
      f'{existing!r} is {what}, so the directories the export goes in cannot '
      'be created. Expected a path inside a directory; move that file '
      'away, or choose another path.'
    )
  if not os.access(existing, os.W_OK | os.X_OK):
    if existing == parent:
      where = f'its parent directory {parent!r} is not writable'
      why = (
        'An export is written beside its target and renamed into place, '
        'so the parent must be writable'
      )
    else:
      where = (
        f'its parent {parent!r} does not exist, and {existing!r}, where it '
        'would be created, is not writable'
      )
      why = 'The missing parent directories are created first'
    raise _errors.ExportError(
      f'Cannot write export target {directory!r}: {where} '
      f'({who_may_write(existing)}). {why}: choose a directory you may '
      'write in, or change its permissions.'
    )


def make_parents(directory: str) -> list[str]:
  """Creates the missing parent directories of `directory`.

  Call `check_writable` first. Nothing but the parents is created.

  Returns:
    The directories created, the outermost first (for `remove_parents`).

  Raises:
    ExportError: If one cannot be created (something appeared in the way,
      a permission), naming it and the OS's reason.
  """
  missing = []
  parent = os.path.dirname(os.path.abspath(directory))
  while not os.path.lexists(parent):
    missing.append(parent)
    parent = os.path.dirname(parent)
  created: list[str] = []
  for path in reversed(missing):
    try:
      os.mkdir(path)
    except FileExistsError:
      if os.path.isdir(path):
        continue  # Another writer made it meanwhile: not ours to remove.
      error: OSError = NotADirectoryError(f'{path!r} is not a directory')
    except OSError as e:
      error = e
    else:
      created.append(path)
      continue
    remove_parents(created)
    raise _errors.ExportError(
      f'Cannot create {path!r}, a parent directory of export target '
      f'{directory!r}: {error.strerror or error}. Create it yourself, or '
      'choose a directory you may write in.'
    ) from error
  return created


def remove_parents(created: list[str]) -> None:
  """Removes the parents `make_parents` created, innermost first, where
  they are still empty (nothing of anyone else's is removed)."""
  for path in reversed(created):
    try:
      os.rmdir(path)
    except OSError:
      return  # Not empty (someone wrote there) or gone: keep the rest.


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
          f'({who_may_write(path)}), so the old export could not be deleted '
          'once the new one is in place. Save to a new directory, or ask '
          'its owner to change its permissions or remove it.'
        )


def check_replaceable(
  directory: str, *, is_export: _temporaries.IsExport
) -> None:
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
