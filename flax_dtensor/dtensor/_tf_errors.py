"""TensorFlow's and the OS's exceptions, told in our own words.

`translated` wraps the body of a public function: an ``OSError`` or a TF
``OpError`` leaving it becomes an `ExportError` naming the action, the path
and the fix; `space_checked` does the same for a full disk or file-size
limit (a `DiskFullError`), wherever in a write it struck (TF reports one as an ``OpError``
whose text holds the OS's words). `describe` gives a TF error's cause on
one line (DTensor runs its ops asynchronously; the op that fails may only
report a ``CancelledError`` while the `cause` waits in TF's executors).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Iterator

from flax_dtensor import _errors, _text

try:
  import resource
except ImportError:  # pragma: no cover - not on Windows.
  resource = None

# The OS errors of a write that found no room, by errno.
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _op_error_type() -> type | None:
  tf = sys.modules.get('tensorflow')
  errors = getattr(getattr(tf, 'errors', None), 'OpError', None)
  return errors if isinstance(errors, type) else None


def cause(e: BaseException) -> BaseException:
  """The error behind a TF ``CancelledError``, else `e` itself.

  DTensor runs ops asynchronously: the op that fails may only report that
  it was cancelled, while the cause waits in TF's executors.
  """
  op_error = _op_error_type()
  tf = sys.modules.get('tensorflow')
  if op_error is not None and isinstance(e, tf.errors.CancelledError):
    try:
      from flax_dtensor.dtensor import _tf

      _tf.internal('tensorflow.python.eager.context').context().sync_executors()
    except op_error as found:
      return found
    except Exception:  # pragma: no cover - TF moved it.
      pass
  return e


def describe(e: BaseException) -> str:
  """'Type: message' of a TF or OS error (or its `cause`), on one line."""
  e = cause(e)
  if isinstance(e, OSError) and e.strerror:
    text = e.strerror + (f': {e.filename!r}' if e.filename else '')
  else:
    text = str(getattr(e, 'message', None) or e)
  text = ' '.join(text.split())
  return f'{type(e).__name__}: {text[:500]}'


@contextlib.contextmanager
def translated(
  action: str,
  path: str,
  fix: str,
  tf_kind: type[_errors.ExportError] = _errors.ExportError,
) -> Iterator[None]:
  """Re-raises OS and TF errors from the block as `ExportError`.

  Args:
    action: What was being done, e.g. 'Writing the checkpoint'.
    path: The path it was done to.
    fix: How to fix it, one sentence.
    tf_kind: The class of the error a TF error becomes (e.g.
      `DamagedExportError` where TF can only fail on damaged data).
  """
  try:
    yield
  except _errors.FlaxDTensorError:
    raise
  except OSError as e:
    raise _errors.ExportError(
      f'{action} {path!r} failed: {describe(e)}. {fix}'
    ) from e
  except Exception as e:
    op_error = _op_error_type()
    if op_error is not None and isinstance(e, op_error):
      raise tf_kind(
        f'{action} {path!r} failed in TensorFlow: {describe(e)}. {fix}'
      ) from e
    raise


def out_of_room(e: BaseException) -> int | None:
  """ENOSPC, EDQUOT or EFBIG if `e` or one of its causes reports it.

  An ``OSError`` carries the errno; TensorFlow's ``OpError`` only the OS's
  words (``...tempstate123; File too large``), so its text is searched for
  them, as is that of an error another process reported.
  """
  return _errors.errno_in(e, _NO_ROOM)


def _free_bytes(path: str) -> int | None:
  """Bytes free for this user on the filesystem holding `path`."""
  while path and not os.path.exists(path):
    path = os.path.dirname(path)
  try:
    info = os.statvfs(path or os.sep)
  except OSError:
    return None
  return info.f_bavail * info.f_frsize


def no_room_message(path: str, needed: int, code: int) -> str:
  """Why a write of about `needed` bytes to `path` found no room, and the fix.

  The bytes free come from `os.statvfs` of the filesystem holding `path`;
  for EFBIG, the limit is this process's `RLIMIT_FSIZE` (`ulimit -f`), or
  else the filesystem's largest file.
  """
  parent = os.path.dirname(path)
  free = _free_bytes(parent)
  space = (
    f'{_text.exact_bytes(free)} are free on the filesystem of {parent!r}'
    if free is not None
    else f'the free space on {parent!r} is unknown'
  )
  wants = f"the export's variables alone take {_text.exact_bytes(needed)}"
  kept = (
    f'The previous export at {path!r}, if any, is unchanged, and the '
    'partial one was removed.'
  )
  if code == errno.EFBIG:
    limit = None
    if resource is not None:
      limit, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if limit is not None and limit != resource.RLIM_INFINITY:
      why = (
        f'this process may write files of at most {_text.exact_bytes(limit)}, its '
        'RLIMIT_FSIZE (`ulimit -f`)'
      )
      fix = (
        "Raise the limit (`ulimit -f unlimited`, or the job scheduler's "
        'file-size limit), then save again.'
      )
    else:
      why = 'a file grew past the largest size its filesystem allows'
      fix = 'Save to a filesystem that allows larger files.'
    return (
      f'Writing {path!r} failed: {os.strerror(code)}: {why}; {wants}, '
      f'and {space}. {kept} {fix}'
    )
  if code == errno.EDQUOT:
    return (
      f'Writing {path!r} failed: {os.strerror(code)}: {wants}, and this '
      f"user's disk quota is used up ({space}). {kept} Free space within the "
      'quota, raise it, or save elsewhere.'
    )
  return (
    f'Writing {path!r} failed: {os.strerror(code)}: {wants}, and {space}. '
    f'{kept} Free space or save elsewhere: an overwrite needs room for the '
    'old export and the new one until the new one is complete.'
  )


@contextlib.contextmanager
def space_checked(path: str, needed: int) -> Iterator[None]:
  """Re-raises a full disk or file-size limit in the block as `DiskFullError`.

  Wrap the whole write, outside the atomic directory (so the partial export
  is gone when the free space is measured).

  Args:
    path: The export being written.
    needed: About how many bytes it takes.
  """
  try:
    yield
  except Exception as e:
    code = out_of_room(e)
    if code is None:
      raise
    raise _errors.DiskFullError(no_room_message(path, needed, code)) from e
