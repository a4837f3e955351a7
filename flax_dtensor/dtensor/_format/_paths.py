"""What an export path may be: a local (or locally mounted) filesystem path.

Exports rename directories into place and fsync them, which needs POSIX
semantics; object stores (``gs://``, ``s3://``, ...) have neither, so a URL
other than ``file://`` is refused up front, before anything is written.
"""

from __future__ import annotations

import os
import re
from typing import Any

from flax_dtensor import _errors

SUPPORTED = (
  'a local filesystem path (relative or absolute), a network filesystem '
  'mounted locally (e.g. NFS, shared by every process of a multi-host run), '
  'or a file:// URL'
)
_SCHEME = re.compile(r'^([A-Za-z][A-Za-z0-9+.\-]*)://')


def local(path: Any, what: str) -> str:
  """The absolute local path `path` names; ExportError for anything else.

  Args:
    path: A str or os.PathLike.
    what: What the path is for, for messages ('checkpoint directory').
  """
  try:
    text = os.fspath(path)
  except TypeError:
    raise _errors.ExportError(
      f'Expected the {what} as a str or os.PathLike, got '
      f'{type(path).__name__}: {path!r:.100}. Supported: {SUPPORTED}.'
    ) from None
  if isinstance(text, bytes):
    text = os.fsdecode(text)
  match = _SCHEME.match(text)
  if match:
    if match.group(1).lower() != 'file':
      raise _errors.ExportError(
        f'Expected the {what} on a filesystem, got the URL {text!r} '
        f'({match.group(1)}://). flax_dtensor writes atomically, by renaming '
        'directories and syncing them, which object stores do not support. '
        f'Supported: {SUPPORTED}. Write locally, then copy the directory '
        '(e.g. with gsutil -m cp -r or tf.io.gfile).'
      )
    text = text[len(match.group(0)) :]
    if not text.startswith('/'):
      text = '/' + text
  if not text:
    raise _errors.ExportError(
      f'Expected a {what}, got an empty path. Supported: {SUPPORTED}.'
    )
  return os.path.abspath(text)


# Paths an export names (its manifest's checkpoint prefix and files)
# ------------------------------------------------------------------------------

_DRIVE = re.compile(r'^[A-Za-z]:')


def name_problem(name: Any) -> str | None:
  """Why `name` is not a relative, normalized path below its root, or None.

  The rules: a non-empty str of '/'-separated components, none of them
  empty, '.' or '..'; no NUL character, no backslash, no leading '/', no
  drive letter. Only the text is checked here: `escape_problem` checks
  where the path leads on disk.
  """
  if not isinstance(name, str):
    return f'it is not a string but a {type(name).__name__}'
  if not name:
    return 'it is empty'
  if '\0' in name:
    return 'it contains a NUL character'
  if _DRIVE.match(name):
    return 'it starts with a drive letter'
  if name.startswith('/') or os.path.isabs(name):
    return 'it is absolute'
  if '\\' in name:
    return 'it contains a backslash'
  parts = name.split('/')
  if '..' in parts:
    return 'it has a `..` component'
  if '.' in parts or '' in parts:
    return 'it is not normalized'
  return None


def escape_problem(root: str, name: str) -> str | None:
  """Why `root`/`name` resolves outside `root` on disk, or None.

  Symbolic links are followed (`os.path.realpath`): a link whose target
  stays inside the root is allowed, one that leaves it is not.
  """
  top = os.path.realpath(root)
  real = os.path.realpath(os.path.join(root, name))
  if real == top or real.startswith(top.rstrip(os.sep) + os.sep):
    return None
  lexical = os.path.normpath(os.path.join(os.path.abspath(root), name))
  if lexical.startswith(os.path.abspath(root).rstrip(os.sep) + os.sep):
    return f'it resolves to {real!r}, outside the export (a symbolic link)'
  return f'it resolves to {real!r}, outside the export'
