"""A run's output folder: its parts, written aside and replaced whole.

The command line's ``demo`` and ``export`` build their whole ``--out``
folder aside and swap it in (`writing`, through
`_atomic.atomic_directory`): interrupted or failed, the folder holds the
previous run's output as it was. Every part carries the run's identifier
(`Run`): a directory part holds ``flax_dtensor_run.json``, a JSON file a
``"run"`` key, a text file a last line ``# flax-dtensor COMMAND run ID``.
`foreign` finds what no run wrote; `problems` finds parts of different
runs (a folder mixed by hand) for ``inspect --verify``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import re
import secrets
import time
from collections.abc import Iterator, Sequence

PART_FILE = 'flax_dtensor_run.json'
# What the demo and export wrote before parts carried the run's identifier.
LEGACY_PARTS = frozenset(
  {'orbax', 'checkpoint', 'saved_model', 'rules.yaml', 'summary.json'}
)
_TEXT_STAMP = re.compile(r'# flax-dtensor [a-z]+ run (\S+)')
# Hidden entries of ours an older version could leave in an output folder:
# a part's temporaries, the command line's scratch directories.
_OURS_HIDDEN = re.compile(
  r'\.(?:(?:orbax|checkpoint|saved_model)\.(?:tmp|old)-|flax_dtensor-staging-)'
)


@dataclasses.dataclass(frozen=True)
class Run:
  """One run of a command: its identifier and the parts it writes."""

  id: str
  command: str
  parts: tuple[str, ...]

  @classmethod
  def new(cls, command: str, parts: Sequence[str]) -> Run:
    """A run with a fresh identifier: UTC time and 8 random hex digits."""
    stamp = time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())
    return cls(f'{stamp}-{secrets.token_hex(4)}', command, tuple(parts))

  def stamp(self, directory: pathlib.Path) -> None:
    """Marks the directory part `directory` as this run's."""
    (directory / PART_FILE).write_text(
      json.dumps(
        {
          'run': self.id,
          'command': self.command,
          'part': directory.name,
          'parts': list(self.parts),
        }
      )
      + '\n'
    )

  def text_stamp(self) -> str:
    """The last line of a text part (a YAML comment)."""
    return f'# flax-dtensor {self.command} run {self.id}\n'


def run_of(path: pathlib.Path) -> str | None:
  """The run identifier `path` (a part) carries, or None."""
  try:
    if path.is_dir():
      raw = json.loads((path / PART_FILE).read_text())
    elif path.suffix == '.json':
      raw = json.loads(path.read_text())
    else:
      lines = path.read_text().strip().splitlines()
      match = _TEXT_STAMP.fullmatch(lines[-1].strip()) if lines else None
      return match[1] if match else None
  except (OSError, ValueError, UnicodeDecodeError):
    return None
  run = raw.get('run') if isinstance(raw, dict) else None
  return run if isinstance(run, str) else None


def _parts_named(path: pathlib.Path) -> list[str]:
  """What the run of part `path` wrote, if its stamp says."""
  try:
    raw = json.loads((path / PART_FILE).read_text())
    parts = raw.get('parts') if isinstance(raw, dict) else None
  except (OSError, ValueError):
    return []
  if isinstance(parts, list) and all(isinstance(p, str) for p in parts):
    return parts
  return []


def foreign(folder: pathlib.Path) -> list[str]:
  """The entries of `folder` that no run of demo or export wrote."""
  out = []
  for entry in sorted(os.listdir(folder)):
    if entry in LEGACY_PARTS or _OURS_HIDDEN.match(entry):
      continue
    if run_of(folder / entry) is not None:
      continue
    out.append(entry)
  return out


def is_run_folder(folder: str) -> bool:
  """Whether `folder` is an output folder of demo or export (or empty)."""
  path = pathlib.Path(folder)
  return path.is_dir() and not path.is_symlink() and not foreign(path)


@contextlib.contextmanager
def writing(out: pathlib.Path) -> Iterator[pathlib.Path]:
  """Yields an empty sibling of `out` to write into; then swaps it in.

  Check first that `out` may be replaced (no foreign entries: `foreign`).
  When the block ends, the sibling replaces `out`
  (`_atomic.atomic_directory`); if it raises or is interrupted, the
  sibling is removed and `out` is left as it was.
  """
  # Late: `inspect` reads run folders without JAX, which `_atomic` imports.
  from flax_dtensor.dtensor._files import _atomic

  out = out.absolute()
  out.parent.mkdir(parents=True, exist_ok=True)
  with _atomic.atomic_directory(
    str(out), is_export=is_run_folder, overwrite=True
  ) as tmp:
    yield pathlib.Path(tmp)


def problems(folder: pathlib.Path) -> list[str]:
  """'mixed: …' when `folder`'s parts come from different runs, and
  'incomplete: …' when a part its run wrote is missing.

  A folder none of whose parts carries an identifier (an older version's)
  has none.
  """
  entries = [
    e
    for e in sorted(os.listdir(folder))
    if not e.startswith('.') and e != PART_FILE
  ]
  runs = {e: run_of(folder / e) for e in entries}
  known = {r for r in runs.values() if r is not None}
  if not known:
    return []
  found = []
  if len(known) > 1 or None in runs.values():
    groups: dict[str | None, list[str]] = {}
    for entry, run in runs.items():
      name = entry + '/' if (folder / entry).is_dir() else entry
      groups.setdefault(run, []).append(name)
    described = '; '.join(
      f'{", ".join(names)} from '
      + (f'run {run}' if run else 'no run (no identifier)')
      for run, names in sorted(groups.items(), key=lambda g: str(g[0]))
    )
    found.append(f'mixed: parts of {len(groups)} runs: {described}')
  for entry in entries:
    for part in _parts_named(folder / entry):
      if part not in runs:
        found.append(
          f'incomplete: run {runs[entry]} wrote {part}, which is missing'
        )
  return sorted(set(found), key=found.index)
