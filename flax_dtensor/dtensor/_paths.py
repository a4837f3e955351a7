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
