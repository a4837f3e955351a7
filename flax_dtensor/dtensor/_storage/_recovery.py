"""Recovery: what killed or interrupted writers left, finished or undone.

`recover` moves a dead writer's complete export into place, or a
renamed-aside old export back, and removes the temporaries of dead
writers (never a live one's); `recover_for_reading` runs it on process 0
before a read, the others waiting. `abandon` undoes what this process is
writing when it is about to end (registered with `_interrupts`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import jax

from flax_dtensor import _errors, _interrupts
from flax_dtensor.dtensor import _processes
from flax_dtensor.dtensor._storage import _temporaries


@dataclasses.dataclass(frozen=True)
class _Temporary:
  path: str
  # None: an unmarked temporary of an older name.
  writer: _temporaries.Writer | None
  complete: bool

  @property
  def alive(self) -> bool | None:
    return None if self.writer is None else self.writer.alive(self.path)


def _left_by_writers(directory: str) -> list[_Temporary]:
  out = []
  name = os.path.basename(directory)
  for path in _temporaries.siblings(directory):
    infix = (
      _temporaries.TMP
      if os.path.basename(path).startswith(f'.{name}{_temporaries.TMP}')
      else _temporaries.OLD
    )
    writer = _temporaries.owner(path, f'.{name}{infix}')
    marker = _temporaries.read_marker(path)
    complete = marker is not None and marker.state == _temporaries.COMPLETE
    out.append(_Temporary(path, writer, complete))
  return out


def recover(
  directory: str, *, writing: bool, is_export: _temporaries.IsExport
) -> None:
  """Finishes or undoes what a killed writer left at `directory`.

  If `directory` is missing and a dead writer left a complete new export,
  it is moved into place; else a renamed-aside old export is moved back.
  Temporaries of dead writers on this host are removed, never those of a
  live writer (or of another host, whose liveness cannot be known here).
  Call on process 0 only.

  Args:
    directory: The export directory.
    writing: Whether a save follows (a live writer is then an error).
    is_export: Whether a directory holds an export (an old one renamed
      aside is moved back only then).

  Raises:
    SaveInProgressError: If another writer is alive, or the export is
      missing and only another host's writer could say where it is.
  """
  temporaries = _left_by_writers(directory)
  live = [t for t in temporaries if t.alive is True]
  unknown = [t for t in temporaries if t.writer is not None and t.alive is None]
  exists = os.path.lexists(directory)
  changed = False
  if live and (writing or not exists):
    raise _errors.SaveInProgressError(
      f'Another save to {directory!r} is in progress '
      f'({live[0].writer.describe()}, writing {live[0].path!r}). Wait for it '
      'to finish, or save elsewhere.'
    )
  if not exists and not live:
    complete = [
      t for t in temporaries if _temporaries.TMP in t.path and t.complete
    ]
    old = [
      t for t in temporaries if _temporaries.OLD in t.path and is_export(t.path)
    ]
    chosen = (complete or old or [None])[-1]
    if chosen is None and unknown:
      raise _errors.SaveInProgressError(
        f'{directory!r} does not exist, and a writer on another host left '
        f'{[t.path for t in unknown]!r}. Check that host; a complete export '
        'there holds its flax_dtensor.json and can be renamed into place.'
      )
    if chosen is not None:
      os.rename(chosen.path, directory)
      with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(directory, _temporaries.MARKER))
      temporaries.remove(chosen)
      changed = True
  stray = (
    _temporaries.read_marker(directory) if os.path.isdir(directory) else None
  )
  if stray is not None and stray.writer.alive() is False:
    for name in (_temporaries.MARKER, _temporaries.MARKER + '.new'):
      with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(directory, name))
  for t in temporaries:
    if t.writer is None:
      with contextlib.suppress(OSError):
        os.rmdir(t.path)  # Only an empty one: whose it was, nothing says.
        changed = True
    elif t.alive is False:
      _temporaries.remove(t.path)
      changed = True
  if changed:
    _temporaries.fsync_dir(os.path.dirname(directory))


def abandon() -> bool:
  """Undoes what this process is writing, for a process about to end.

  Registered with `_interrupts.on_exit_now`: run while no swap is under
  way, maybe on another thread than the writer's. An old export renamed
  aside goes back if its place is empty (else it is the replaced one and
  goes); temporaries being written are removed. Each is remembered, so
  that a next pass removes it again should a library's thread still
  writing (Orbax's) have made it again; what is made after the last pass
  is a dead writer's, removed by the next `recover`.

  Returns:
    Whether this pass found anything to undo.
  """
  found = False
  for path in sorted(
    list(_temporaries.active) + list(_temporaries.removed),
    key=lambda p: _temporaries.OLD not in p,
  ):
    parent, name = os.path.split(path)
    target = None
    if name.startswith('.') and _temporaries.OLD in name:
      target = os.path.join(parent, name[1:].rsplit(_temporaries.OLD, 1)[0])
    found = found or os.path.lexists(path)
    try:
      if target is not None and not os.path.lexists(target):
        os.rename(path, target)
        with contextlib.suppress(FileNotFoundError):
          os.remove(os.path.join(target, _temporaries.MARKER))
      elif os.path.lexists(path):
        _temporaries.remove(path)
    except OSError:
      pass
    _temporaries.active.discard(path)
    if target is None:
      _temporaries.removed.add(path)  # Looked at again by the next pass.
  return found


_interrupts.on_exit_now(abandon)


def recover_for_reading(
  directory: str, *, is_export: _temporaries.IsExport
) -> None:
  """`recover` before a read, on process 0; the others wait for it.

  Raises:
    SaveInProgressError: If another writer is alive and the export is
      missing.
    PeerError: If another process stopped.
    ExportError: If recovering fails otherwise.
  """
  error: BaseException | None = None
  if jax.process_index() == 0:
    try:
      recover(directory, writing=False, is_export=is_export)
    except OSError as e:
      error = _errors.ExportError(
        f'Checking {directory!r} for an interrupted save failed: {e}. '
        'Check the path and its permissions.'
      )
      error.__cause__ = e
    except _errors.ExportError as e:
      error = e
  shared = _processes.share(
    None
    if error is None
    else {'kind': type(error).__name__, 'error': str(error)}
  )
  if error is not None:
    raise error
  if shared is not None:
    raise _errors.export_error_named(shared['kind'])(shared['error'])
