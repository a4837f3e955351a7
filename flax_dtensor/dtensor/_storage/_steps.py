"""A `CheckpointManager` folder as files: its steps, read without JAX or TF.

`CheckpointManager` writes through these names, and ``flax-dtensor
inspect`` lists a run's steps with them (the command line imports neither
JAX nor TensorFlow to do so).
"""

from __future__ import annotations

import dataclasses
import os
import re

PREFIX = 'ckpt'
"""A checkpoint's file prefix in its folder (`_checkpoint.PREFIX`)."""
STATE_FILE = 'checkpoint'
"""TensorFlow's name for the file naming a directory's latest checkpoint."""
METRICS_FILE = 'flax_dtensor_steps.json'
STEP = re.compile(r'[0-9]{1,18}')
"""A folder named by a step, and only it."""
# A step's folder being written (or left by a killed save): the hidden
# siblings of `_temporaries`, `.STEP.tmp-...` and `.STEP.old-...`.
UNFINISHED = re.compile(r'\.([0-9]{1,18})\.(tmp|old)-.*')


def is_whole(directory: str, name: str) -> bool:
  """Whether `name` in `directory` is a step's folder, whole."""
  return bool(STEP.fullmatch(name)) and os.path.isfile(
    os.path.join(directory, name, PREFIX + '.index')
  )


def whole_steps(directory: str) -> list[int]:
  """The whole steps in `directory`, oldest first ([] if there is none)."""
  try:
    names = os.listdir(directory)
  except (FileNotFoundError, NotADirectoryError):
    return []
  return sorted(int(n) for n in names if is_whole(directory, n))


def is_manager_folder(directory: str) -> bool:
  """Whether `directory` is a `CheckpointManager`'s: step folders, or its
  metrics file, beside TensorFlow's state file or none."""
  try:
    names = os.listdir(directory)
  except (FileNotFoundError, NotADirectoryError):
    return False
  if METRICS_FILE in names:
    return True
  return any(is_whole(directory, n) for n in names)


@dataclasses.dataclass(frozen=True)
class StepFolder:
  """One entry of a manager's folder, for `inspect`."""

  name: str  # '100', or '.100.tmp-...'
  step: int
  bytes: int
  whole: bool


def _size(path: str) -> int:
  total = 0
  for root, _, files in os.walk(path):
    for f in files:
      try:
        total += os.lstat(os.path.join(root, f)).st_size
      except OSError:
        pass
  return total


def folders(directory: str) -> list[StepFolder]:
  """Every step's folder, whole or not, by step then name."""
  out = []
  for name in os.listdir(directory):
    path = os.path.join(directory, name)
    if not os.path.isdir(path) or os.path.islink(path):
      continue
    if is_whole(directory, name):
      out.append(StepFolder(name, int(name), _size(path), True))
      continue
    unfinished = UNFINISHED.fullmatch(name)
    if unfinished or STEP.fullmatch(name):
      step = int(unfinished.group(1) if unfinished else name)
      out.append(StepFolder(name, step, _size(path), False))
  return sorted(out, key=lambda f: (f.step, f.name))


def latest_named(directory: str) -> int | None:
  """The step TensorFlow's state file names as the latest, if any."""
  try:
    with open(os.path.join(directory, STATE_FILE), encoding='utf-8') as f:
      text = f.read(1 << 20)
  except (OSError, UnicodeDecodeError):
    return None
  found = re.search(
    r'^model_checkpoint_path: "([0-9]{1,18})/' + PREFIX + '"$', text, re.M
  )
  return int(found.group(1)) if found else None
