"""Serving the demo's SavedModel in a process that has TensorFlow only.

`verify_saved_model` runs the SavedModel on a batch in a fresh interpreter
where JAX cannot be imported, and returns its logits, so the demo can
compare them with JAX's.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
from typing import Any

TIMEOUT_SECONDS = 300

# Runs in a fresh interpreter that imports TensorFlow and NumPy only. JAX is
# blocked: TF would otherwise import it when installed (tensorflow.lite
# tries `from jax import jit`), and the SavedModel must not need it.
VERIFY_SCRIPT = """\
import json, os, sys, time
for blocked in ('jax', 'jaxlib', 'flax', 'flax_dtensor'):
  sys.modules[blocked] = None  # `import jax` now raises ImportError.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
import numpy as np
import tensorflow as tf
saved_model, tokens_path, logits_path = sys.argv[1:4]
start = time.perf_counter()
serve = tf.saved_model.load(saved_model).signatures['serving_default']
(name,) = serve.structured_input_signature[1]
outputs = serve(**{name: tf.constant(np.load(tokens_path))})
(logits,) = outputs.values()
np.save(logits_path, logits.numpy())
print(json.dumps({
  'seconds': time.perf_counter() - start,
  'tensorflow': tf.__version__,
  'jax_imported': any(
    sys.modules.get(m) is not None for m in ('jax', 'jaxlib', 'flax')),
}))
"""


def verify_saved_model(
  saved_model: pathlib.Path,
  tokens: Any,
  *,
  timeout: float = TIMEOUT_SECONDS,
) -> tuple[Any, dict[str, Any]]:
  """Runs a SavedModel in a fresh TensorFlow-only process.

  Args:
    saved_model: The SavedModel directory (one input, one output).
    tokens: The input batch (a NumPy array).
    timeout: Seconds before the subprocess is killed.

  Returns:
    The logits (NumPy) and the subprocess's report.

  Raises:
    RuntimeError: If the subprocess fails or times out.
  """
  import numpy as np

  with tempfile.TemporaryDirectory(prefix='flax_dtensor_verify_') as tmp:
    tokens_path = os.path.join(tmp, 'tokens.npy')
    logits_path = os.path.join(tmp, 'logits.npy')
    np.save(tokens_path, np.asarray(tokens))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES='-1', TF_CPP_MIN_LOG_LEVEL='2')
    try:
      proc = subprocess.run(
        [
          sys.executable,
          '-c',
          VERIFY_SCRIPT,
          str(saved_model),
          tokens_path,
          logits_path,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
        check=False,
      )
    except subprocess.TimeoutExpired as e:
      raise RuntimeError(
        f'Loading the SavedModel in a fresh TensorFlow process took longer '
        f'than {timeout:.0f} s; it was stopped.'
      ) from e
    if proc.returncode != 0:
      tail = proc.stderr.strip().splitlines()[-1:] or ['(no output)']
      raise RuntimeError(
        f'Loading the SavedModel in a fresh TensorFlow process failed (exit '
        f'status {proc.returncode}): {tail[0]}'
      )
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return np.load(logits_path), report
