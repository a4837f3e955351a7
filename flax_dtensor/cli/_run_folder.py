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
import errno
import json
import os
import pathlib
import re
import secrets
import shutil
import time
from collections.abc import Iterator, Sequence

from flax_dtensor import _errors, _interrupts

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


def ours(entry: str) -> bool:
  """Whether `entry` of an output folder is a hidden temporary of ours."""
  return bool(_OURS_HIDDEN.match(entry))


def foreign(folder: pathlib.Path) -> list[str]:
  """The entries of `folder` that no run of demo or export wrote."""
  out = []
  for entry in sorted(os.listdir(folder)):
    if entry in LEGACY_PARTS or ours(entry):
      continue
    if run_of(folder / entry) is not None:
      continue
    out.append(entry)
  return out


def is_run_folder(folder: str) -> bool:
  """Whether `folder` is an output folder of demo or export (or empty)."""
  path = pathlib.Path(folder)
  return path.is_dir() and not path.is_symlink() and not foreign(path)


def holds_cwd(out: pathlib.Path) -> bool:
  """Whether `out` is the current directory or one of its ancestors."""
  return pathlib.Path.cwd().resolve().is_relative_to(out.resolve())


# The OS's errors that stop a write, besides no room (`_tf_errors`), and
# how to fix each.
_WRITE_FIXES = {
  errno.EACCES: 'choose a --out you may write in, or change its permissions',
  errno.EPERM: 'choose a --out you may write in, or change its permissions',
  errno.EROFS: 'choose a --out on a writable filesystem',
  errno.EIO: 'check the disk, then run again',
}
# TensorStore (Orbax) puts the OS's errno in its message.
_TS_ERRNO = re.compile(r"os_error_code='(\d+)'")


def _os_error_code(e: BaseException | None) -> int | None:
  """An errno of `_WRITE_FIXES` that `e` or one of its causes reports: an
  ``OSError``'s, or one named in a library's text (TensorStore's
  ``os_error_code='13'``, TensorFlow's ``Permission denied``)."""
  return _errors.errno_in(
    e, _WRITE_FIXES, lambda text: map(int, _TS_ERRNO.findall(text))
  )


def _part_named(e: BaseException, tmp: pathlib.Path | None) -> str:
  """ " (its part 'orbax')" when the error names a path in the temporary."""
  if tmp is None:
    return ''
  found = re.search(re.escape(str(tmp)) + r'/([^/\'"\s]+)', str(e))
  return f' (its part {found[1]!r})' if found else ''


def _in_our_words(
  e: BaseException, out: pathlib.Path, tmp: pathlib.Path | None, needed: int
) -> Exception | None:
  """`e`, a failure of the run's writing, as an `ExportError` naming `out`,
  or None for an error that is not a write's."""
  from flax_dtensor.dtensor import _tf_errors

  if isinstance(e, _errors.ExportError):
    if tmp is None or str(tmp) not in str(e):
      return None
    # The same error, the run's temporary named as what the user asked for.
    return type(e)(str(e).replace(str(tmp), str(out)))
  if isinstance(e, _errors.FlaxDTensorError):
    return None
  code = _tf_errors.out_of_room(e)
  if code is not None:
    return _errors.DiskFullError(
      _tf_errors.no_room_message(str(out), needed, code)
    )
  code = _os_error_code(e)
  if code is None:
    return None
  return _errors.ExportError(
    f'Writing the output folder {str(out)!r} failed{_part_named(e, tmp)}: '
    f'{os.strerror(code)}. The previous output there, if any, is unchanged, '
    f'and the partial one was removed. To fix it, {_WRITE_FIXES[code]}.'
  )


@contextlib.contextmanager
def writing(out: pathlib.Path, *, needed: int) -> Iterator[pathlib.Path]:
  """Yields an empty directory to write the run into; then swaps it in.

  Check first that `out` may be replaced (no foreign entries: `foreign`).
  The directory is a sibling of `out`; when the block ends, it replaces
  `out` (`_atomic.atomic_directory`). If the block raises or is
  interrupted, it is removed and `out` is left as it was. For an empty
  `out` that is the current directory (which cannot be renamed), it is a
  hidden directory inside `out`, whose parts are moved into `out` at the
  end.

  Every failure of the writing is an `ExportError` naming `out` (never the
  temporary): a full disk, a quota or a file-size limit a `DiskFullError`
  (whoever wrote: TensorFlow, Orbax's TensorStore, this package), and a
  permission, a read-only filesystem or an I/O error an `ExportError`.

  Args:
    out: The output folder.
    needed: About how many bytes the run's variables take (for a full
      disk's message).

  Raises:
    DiskFullError: If the disk, a quota or a file-size limit stops a write.
    ExportError: If a write fails otherwise, or `out` cannot be made.
  """
  # Late: `inspect` reads run folders without JAX, which `_atomic` imports.
  from flax_dtensor.dtensor._storage import _atomic

  out = out.absolute()
  tmp: pathlib.Path | None = None
  try:
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.is_dir() and holds_cwd(out):
      with _atomic.staging_directory(str(out)) as staged:
        tmp = pathlib.Path(staged)
        yield tmp
        _move_parts(tmp, out)
    else:
      with _atomic.atomic_directory(
        str(out), is_export=is_run_folder, overwrite=True
      ) as staged:
        tmp = pathlib.Path(staged)
        yield tmp
  except Exception as e:
    left = None
    if tmp is not None and _interrupts.received() is None:
      # (Interrupted, the exit comes first: within its promised 2 s.)
      if not _removed_after_late_writes(tmp):
        left = tmp
    ours = _in_our_words(e, out, tmp, needed)
    if left is not None:
      if ours is None:
        e.add_note(_left_behind('', left))
        raise
      ours = type(ours)(_left_behind(str(ours), left))
    if ours is None:
      raise
    raise ours from e


_REMOVED = 'and the partial one was removed.'


def _left_behind(message: str, tmp: pathlib.Path) -> str:
  """`message`, saying that the partial output `tmp` is still there."""
  left = (
    f'the partial one may be left at {str(tmp)!r} (something kept writing '
    'there, or it could not be deleted): delete it if it is there.'
  )
  if _REMOVED in message:
    return message.replace(_REMOVED, 'and ' + left)
  return f'{message} {left[0].upper()}{left[1:]}'.strip()


# As a failed write surfaces, another library's threads may still be
# writing into the run's temporary: Orbax's TensorStore writes go on after
# the first one fails, and make their folders again after the temporary is
# removed. It is removed again until it has stayed away this long.
_LATE_WRITES_SECONDS = 1.0
_LATE_WRITES_LIMIT_SECONDS = 10.0


def _removed_after_late_writes(tmp: pathlib.Path) -> bool:
  """Removes `tmp` again as long as late writes bring it back (bounded).

  Returns whether it is gone for good: false when writes still came
  after `_LATE_WRITES_LIMIT_SECONDS`, or when it cannot be deleted (a
  permission error).
  """
  start = quiet_since = time.monotonic()
  while True:
    now = time.monotonic()
    if os.path.lexists(tmp):
      quiet_since = now
      try:
        shutil.rmtree(tmp)
      except (FileNotFoundError, NotADirectoryError):
        pass
      except OSError as e:
        if e.errno != errno.ENOTEMPTY:  # Not a write racing the removal.
          return not os.path.lexists(tmp)
    elif now - quiet_since >= _LATE_WRITES_SECONDS:
      return True
    if now - start >= _LATE_WRITES_LIMIT_SECONDS:
      return False  # Still written to within the last second.
    time.sleep(0.05)


def _move_parts(staged: pathlib.Path, out: pathlib.Path) -> None:
  """Moves the parts written in `staged` (inside `out`) into `out`.

  `out` must still hold nothing of its own: it is the current directory,
  empty when the run began. An interrupt waits for every move.

  Raises:
    ExportError: If something appeared in `out` meanwhile.
  """
  parts = sorted(os.listdir(staged))
  there = [
    e for e in os.listdir(out) if e != staged.name and not e.startswith('.')
  ]
  if there:
    raise _errors.ExportError(
      f'{str(out)!r} was empty when the run began, and now holds '
      f'{", ".join(map(repr, there[:5]))}: the run does not mix its output '
      'with those. Run again with --out a new directory.'
    )
  with _interrupts.swap():
    for part in parts:
      os.rename(staged / part, out / part)


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
