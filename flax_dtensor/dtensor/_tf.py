"""The one place TensorFlow is imported, lazily, with an install hint.

`import flax_dtensor` and `import flax_dtensor.dtensor` never import
TensorFlow: every function of `flax_dtensor.dtensor` that needs it calls
`tf()` or `dtensor()` here when it runs.
"""

from __future__ import annotations

import importlib
import os
import sys
import types

INSTALL_HINT = (
  'flax_dtensor.dtensor needs TensorFlow, which could not be imported. '
  'Install it with: pip install "flax-dtensor[tf]"'
)


def tf() -> types.ModuleType:
  """Imports and returns the `tensorflow` module.

  TensorFlow's C++ logging is silenced (`TF_CPP_MIN_LOG_LEVEL=2`, errors only)
  unless the variable is already set.

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
    import tensorflow
  except ImportError as e:
    raise ImportError(f'{INSTALL_HINT} ({e})') from e
  return tensorflow


def dtensor() -> types.ModuleType:
  """Returns the `tf.experimental.dtensor` module, importing TF if needed.

  Returns:
    The `tensorflow.experimental.dtensor` module.

  Raises:
    ImportError: If TensorFlow is not installed.
  """
  return tf().experimental.dtensor


def accelerator_util() -> types.ModuleType:
  """Returns TF's DTensor `accelerator_util` module (initialization state).

  `tf.experimental.dtensor` has no public `is_initialized`; this module holds
  it.

  Returns:
    The `tensorflow.dtensor.python.accelerator_util` module.

  Raises:
    ImportError: If TensorFlow is not installed.
  """
  tf()
  return importlib.import_module('tensorflow.dtensor.python.accelerator_util')


def is_imported() -> bool:
  """Returns whether TensorFlow has been imported, without importing it."""
  return sys.modules.get('tensorflow') is not None
