"""TensorFlow's and the OS's exceptions, told in our own words.

`translated` wraps the body of a public function: an ``OSError`` or a TF
``OpError`` leaving it becomes an `ExportError` naming the action, the path
and the fix. `describe` gives a TF error's cause on one line (DTensor runs
its ops asynchronously; the op that fails may only report a
``CancelledError`` while the cause waits in TF's executors).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from flax_dtensor import _errors


def _op_error_type() -> type | None:
  tf = sys.modules.get('tensorflow')
  errors = getattr(getattr(tf, 'errors', None), 'OpError', None)
  return errors if isinstance(errors, type) else None


def describe(e: BaseException) -> str:
  """'Type: message' of a TF or OS error, on one line."""
  op_error = _op_error_type()
  tf = sys.modules.get('tensorflow')
  if op_error is not None and isinstance(e, tf.errors.CancelledError):
    try:
      from flax_dtensor.dtensor import _tf

      _tf.internal('tensorflow.python.eager.context').context().sync_executors()
    except op_error as cause:
      e = cause
    except Exception:  # pragma: no cover - TF moved it.
      pass
  if isinstance(e, OSError) and e.strerror:
    text = e.strerror + (f': {e.filename!r}' if e.filename else '')
  else:
    text = str(getattr(e, 'message', None) or e)
  text = ' '.join(text.split())
  return f'{type(e).__name__}: {text[:500]}'


@contextlib.contextmanager
def translated(action: str, path: str, fix: str) -> Iterator[None]:
  """Re-raises OS and TF errors from the block as `ExportError`.

  Args:
    action: What was being done, e.g. 'Writing the checkpoint'.
    path: The path it was done to.
    fix: How to fix it, one sentence.
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
      raise _errors.ExportError(
        f'{action} {path!r} failed in TensorFlow: {describe(e)}. {fix}'
      ) from e
    raise
