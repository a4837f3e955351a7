"""The files beside a manager's steps, and where a damaged step goes.

TensorFlow's state file (``checkpoint``) names the latest whole step and
every step kept; the metrics file (``flax_dtensor_steps.json``) holds the
metrics each save was given, read back when a manager opens its directory
(`read_metrics`) after they are checked (`checked_metrics`). Both are
replaced atomically (`write_files`). A damaged step is moved aside to a
name no reader lists as a step (`aside`).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from flax_dtensor import _errors
from flax_dtensor.dtensor._checkpoints import _checkpoint
from flax_dtensor.dtensor._storage import _steps, _temporaries

METRICS_MAX_BYTES = 16 << 20
"""The largest metrics file read (a run of a million steps fits)."""


def replace_file(path: str, text: str) -> None:
  """Writes `text` to `path` atomically: a reader sees the old or the new."""
  folder = os.path.dirname(path)
  fd, tmp = tempfile.mkstemp(
    prefix=f'.{os.path.basename(path)}.tmp-', dir=folder
  )
  try:
    with os.fdopen(fd, 'w') as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise
  _temporaries.fsync_dir(folder)


def read_metrics(directory: str) -> dict[int, dict[str, float]]:
  """{step: metrics} from the manager's metrics file ({} without one).

  Raises:
    MalformedExportError: If the file is not what `save` writes.
  """
  path = os.path.join(directory, _steps.METRICS_FILE)
  try:
    with open(path, 'rb') as f:
      data = f.read(METRICS_MAX_BYTES + 1)
  except FileNotFoundError:
    return {}
  fix = (
    'Expected {"steps": {"STEP": {"NAME": number}}}, as '
    'CheckpointManager.save writes; remove the file to keep every step by '
    'its number alone.'
  )
  if len(data) > METRICS_MAX_BYTES:
    raise _errors.MalformedExportError(
      f'{path!r} is over {METRICS_MAX_BYTES} bytes. {fix}'
    )
  try:
    parsed = json.loads(data)
  except (ValueError, RecursionError) as e:
    raise _errors.MalformedExportError(
      f'{path!r} is not JSON ({e}). {fix}'
    ) from None
  steps = parsed.get('steps') if isinstance(parsed, dict) else None
  if not isinstance(steps, dict):
    raise _errors.MalformedExportError(f'{path!r} has no "steps" object. {fix}')
  out = {}
  for key, metrics in steps.items():
    if not _steps.STEP.fullmatch(key) or not isinstance(metrics, dict):
      raise _errors.MalformedExportError(
        f'{path!r}: step {key!r} is not a step number with an object of '
        f'metrics. {fix}'
      )
    for name, value in metrics.items():
      if isinstance(value, bool) or not isinstance(value, int | float):
        raise _errors.MalformedExportError(
          f'{path!r}: step {key}, metric {name!r} is '
          f'{type(value).__name__}, not a number. {fix}'
        )
    out[int(key)] = metrics
  return out


def checked_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float]:
  if metrics is None:
    return {}
  if not isinstance(metrics, Mapping):
    raise _errors.CheckpointManagerError(
      f'metrics must be a mapping of names to numbers; got '
      f'{type(metrics).__name__}. Pass e.g. metrics={{"loss": 0.25}}.'
    )
  out = {}
  for name, value in metrics.items():
    try:
      number = float(value)
    except (TypeError, ValueError):
      raise _errors.CheckpointManagerError(
        f'metrics[{name!r}] is {type(value).__name__}, not a number. Pass '
        'numbers (a JAX scalar is read with float()).'
      ) from None
    if not math.isfinite(number):
      raise _errors.CheckpointManagerError(
        f'metrics[{name!r}] is {number}; the best steps are kept by finite '
        'numbers. Pass a finite value, or leave the metric out of this step.'
      )
    out[str(name)] = number
  return out


def write_files(
  directory: str, kept: list[int], metrics: dict[int, dict[str, float]]
) -> None:
  """Replaces TF's state file (naming the steps `kept`, the latest last)
  and the metrics file (`metrics` by step); no state file without a step."""
  if kept:
    lines = [f'model_checkpoint_path: "{kept[-1]}/{_checkpoint.PREFIX}"']
    lines += [
      f'all_model_checkpoint_paths: "{s}/{_checkpoint.PREFIX}"' for s in kept
    ]
    replace_file(
      os.path.join(directory, _steps.STATE_FILE), '\n'.join(lines) + '\n'
    )
  replace_file(
    os.path.join(directory, _steps.METRICS_FILE),
    json.dumps(
      {'steps': {str(s): m for s, m in sorted(metrics.items())}},
      indent=1,
    )
    + '\n',
  )


def aside(directory: str, step: int) -> str:
  """Where a damaged step is moved aside: ``STEP.damaged`` (``-2``, ... if
  taken), a name no reader lists as a step."""
  path = os.path.join(directory, f'{step}.damaged')
  n = 1
  while os.path.lexists(path):
    n += 1
    path = os.path.join(directory, f'{step}.damaged-{n}')
  return path
