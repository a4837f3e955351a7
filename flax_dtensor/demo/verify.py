"""The demo's SavedModel served in a process that has TensorFlow only.

`verify_saved_model` returns the logits the SavedModel serves for a batch
of tokens, in a fresh interpreter where JAX cannot be imported
(`flax_dtensor.dtensor.verify_saved_model`'s server, without the JAX
reference), for a caller that compares them itself.
"""

from __future__ import annotations

import pathlib
from typing import Any

TIMEOUT_SECONDS = 300


def verify_saved_model(
  saved_model: pathlib.Path,
  tokens: Any,
  *,
  timeout: float = TIMEOUT_SECONDS,
) -> tuple[Any, dict[str, Any]]:
  """Runs a SavedModel of one input and one output in a TF-only process.

  Args:
    saved_model: The SavedModel directory: its 'serving_default' takes one
      input and serves one output.
    tokens: The input batch (a NumPy array).
    timeout: Seconds before the subprocess is stopped.

  Returns:
    The logits (NumPy), and what the process reports: 'seconds' (the load
    and one call), 'tensorflow' (its version), 'jax_imported'.

  Raises:
    ExportError: If the subprocess fails or takes longer than `timeout`.
  """
  from flax_dtensor.dtensor._serving import _saved_model, _verify

  key = 'serving_default'
  (name,) = _saved_model.written_signatures(str(saved_model))[key].inputs
  served = _verify.serve_in_tf(
    saved_model, {key: {name: tokens}}, calls=0, timeout=timeout
  )
  (logits,) = served.outputs[key].values()
  report = {
    'seconds': served.load_seconds + served.first_seconds[key],
    'tensorflow': served.tensorflow,
    'jax_imported': served.jax_imported,
  }
  return logits, report
