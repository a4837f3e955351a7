"""The one place TensorFlow is imported, lazily, with an install hint.

`import flax_dtensor` and `import flax_dtensor.dtensor` never import
TensorFlow: every function of `flax_dtensor.dtensor` that needs it calls
`tf()` or `dtensor()` here when it runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import importlib
import mmap
import os
import re
import sys
import tempfile
import threading
import types
from collections.abc import Iterator
from typing import Any

from flax_dtensor import _output

INSTALL_HINT = (
  'flax_dtensor.dtensor needs TensorFlow, which could not be imported. '
  'Install it with: pip install "flax-dtensor[tf]"'
)


def tf() -> types.ModuleType:
  """Imports and returns the `tensorflow` module.

  TensorFlow's C++ logging is set to errors only (`TF_CPP_MIN_LOG_LEVEL=2`)
  unless the variable is already set. That level only applies once TF's
  logging is initialized: during the import itself, on CPUs where oneDNN
  is on, TF prints an INFO line about oneDNN and absl's "All log messages
  before absl::InitializeLog()" notice whatever the level. Those two are
  dropped here (see `cpp_noise_dropped`); oneDNN stays on, so TF
  keeps its speed. Anything else TF prints at import is passed on.

  Returns:
    The `tensorflow` module.

  Raises:
    ImportError: If TensorFlow is not installed.
  """
  module = sys.modules.get('tensorflow')
  if module is not None:
    return module
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  try:
    with cpp_noise_dropped():
      import tensorflow
  except ImportError as e:
    raise ImportError(f'{INSTALL_HINT} ({e})') from e
  return tensorflow


# TF's start-up lines: glog-style INFO/WARNING lines (I0000 00:00:...) and
# absl's notice about messages logged before its initialization.
_NOISE = re.compile(
  r'^([IW]\d{4} [\d:.]+\s+\d+ [\w./-]+:\d+\] |WARNING: All log messages '
  r'before absl::InitializeLog\(\) is called)'
)


_captured = 0  # Blocks inside `cpp_noise_dropped` (of any thread).
_capture_lock = threading.Lock()
_capture: tuple[int, Any, Any] | None = None  # (saved fd 2, file, route)


def _stderr_is_fd_2() -> bool:
  try:
    return sys.stderr.fileno() == 2
  except (AttributeError, OSError, ValueError):  # A notebook's stream.
    return False


def _begin_capture() -> bool:
  """Points descriptor 2 at a temporary file (the outermost block only)."""
  global _captured, _capture
  with _capture_lock:
    _captured += 1
    if _captured > 1:
      return True
    try:
      sys.stderr.flush()
      saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # No usable descriptor 2.
      _captured -= 1
      return False
    capture = tempfile.TemporaryFile()
    os.dup2(capture.fileno(), 2)
    # Our own messages and progress bars stay live on the real stderr.
    routed = None
    if _output.stream() is sys.stderr and _stderr_is_fd_2():
      own = os.fdopen(
        os.dup(saved), 'w', buffering=1, encoding='utf-8', errors='replace'
      )
      routed = (own, _output.route(own))
    _capture = (saved, capture, routed)
    return True


def _end_capture() -> None:
  """Restores descriptor 2 (the outermost block) and passes on what was
  written there, all but TF's glog-style INFO and WARNING lines."""
  global _captured, _capture
  with _capture_lock:
    _captured -= 1
    if _captured > 0 or _capture is None:
      return
    saved, capture, routed = _capture
    _capture = None
    try:
      sys.stderr.flush()
    except (OSError, ValueError):
      pass
    os.dup2(saved, 2)
    os.close(saved)
    if routed is not None:
      own, previous = routed
      _output.route(previous)
      own.close()
    with capture:
      capture.seek(0)
      text = capture.read().decode('utf-8', errors='replace')
  kept = [
    line for line in text.splitlines(keepends=True) if not _NOISE.match(line)
  ]
  if kept:
    sys.stderr.write(''.join(kept))
    sys.stderr.flush()


@contextlib.contextmanager
def cpp_noise_dropped() -> Iterator[None]:
  """Captures file descriptor 2 in the block; re-emits all but TF's noise.

  TF's C++ code writes to the process's stderr directly, so redirecting
  `sys.stderr` is not enough: the descriptor itself points to a temporary
  file within the block. What else was written there (Python's warnings,
  TF's errors) is written to stderr when the outermost block ends; our own
  messages and progress bars stay live. Used where TF logs through its own
  copy of absl, which no log level reaches: at import, and around the reads
  of a checkpoint (a damaged file's failed op logs a WARNING and an INFO
  line before our error).
  """
  began = _begin_capture()
  try:
    yield
  finally:
    if began:
      _end_capture()


# absl's `SetMinLogLevel(absl::LogSeverityAtLeast)`, as TF's framework
# library exports it (in absl's versioned inline namespace, e.g. lts_20250814).
_SET_MIN_LOG_LEVEL = re.compile(
  rb'_ZN4absl(?:12lts_[0-9]{8})?14SetMinLogLevelENS[0-9]*_18LogSeverityAtLeastE'
)
_ERRORS_ONLY = 2  # TF_CPP_MIN_LOG_LEVEL's and absl's level of ERROR.
_quiet_level: int | None = None


def quiet_cpp_logs() -> int | None:
  """Sets TF's C++ log level for the rest of the process, once TF is in.

  TF reads ``TF_CPP_MIN_LOG_LEVEL`` when it is imported, so when the
  program imported TensorFlow before flax_dtensor, setting the variable
  later changes nothing: DTensor then logs a "cache key lookup missed" line
  (INFO) for each function it compiles. TF logs through absl, whose level
  can still be changed: this sets it to the user's own
  ``TF_CPP_MIN_LOG_LEVEL`` if set (so ``TF_CPP_MIN_LOG_LEVEL=0`` keeps every
  line), else to errors only. Errors are never hidden.

  Returns:
    The level set, or None when TF's framework library does not expose
    absl's setter (another platform or build): TF's logging is left as it
    is.
  """
  global _quiet_level
  try:
    level = int(os.environ.get('TF_CPP_MIN_LOG_LEVEL', _ERRORS_ONLY))
  except ValueError:
    level = _ERRORS_ONLY
  if _quiet_level == level:
    return level
  setter = _absl_min_log_level_setter()
  if setter is None:
    return None
  setter(ctypes.c_int(level))
  _quiet_level = level
  return level


@functools.cache
def _absl_min_log_level_setter() -> Any:
  """absl's ``SetMinLogLevel`` in the TF framework library loaded, or None."""
  root = os.path.dirname(tf().__file__)
  for library in sorted(
    glob.glob(os.path.join(root, 'libtensorflow_framework*'))
  ):
    try:
      with (
        open(library, 'rb') as f,
        mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data,
      ):
        found = _SET_MIN_LOG_LEVEL.search(data)
        name = found and bytes(found.group()).decode()
      if not name:
        continue
      # RTLD_NOLOAD: the copy TF already loaded, never a second one.
      loaded = ctypes.CDLL(library, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
      setter = getattr(loaded, name)
    except (OSError, AttributeError, ValueError):
      continue
    setter.restype = None
    setter.argtypes = [ctypes.c_int]
    return setter
  return None


def dtensor() -> types.ModuleType:
  """Returns the `tf.experimental.dtensor` module, importing TF if needed.

  Returns:
    The `tensorflow.experimental.dtensor` module.

  Raises:
    ImportError: If TensorFlow is not installed.
  """
  return tf().experimental.dtensor


def internal(name: str) -> types.ModuleType:
  """Returns one of TensorFlow's own modules, importing TF if needed.

  For what TF offers only there: `tensorflow.dtensor.python.
  accelerator_util` (whether DTensor is initialized), `tensorflow.dtensor.
  python.api` (its reset), `tensorflow.python.eager.context` (the cause of
  a cancelled op) and `tensorflow.compiler.tf2xla.python.xla` (the calling
  conventions TF runs).

  Args:
    name: The module's full name, starting with 'tensorflow.'.

  Raises:
    ImportError: If TensorFlow (or that module) is not installed.
  """
  tf()
  return importlib.import_module(name)


def accelerator_util() -> types.ModuleType:
  """Returns TF's DTensor `accelerator_util` module (initialization state)."""
  return internal('tensorflow.dtensor.python.accelerator_util')


def is_imported() -> bool:
  """Returns whether TensorFlow has been imported, without importing it."""
  return sys.modules.get('tensorflow') is not None
