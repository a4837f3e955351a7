"""Numbered checkpoints of a training run: `CheckpointManager`.

A manager's directory holds one `save_checkpoint` export per step, in a
folder named by the step (``100/``, as orbax-checkpoint names them), and
TensorFlow's own state file, ``checkpoint``, naming the latest whole step
(``model_checkpoint_path: "100/ckpt"``), so that
``tf.train.latest_checkpoint(directory)`` finds it. A step's folder appears
whole or not at all (the export is renamed into place once written), so
every step listed is whole; the state file is replaced atomically once a
step is. The metrics a save is given (for keeping the best steps) are in
``flax_dtensor_steps.json``. Process 0 writes both files (`_step_files`)
and applies the retention, each once its step is whole.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
from flax import nnx
from flax.nnx import filterlib

from flax_dtensor import _errors, _output
from flax_dtensor.dtensor import _processes
from flax_dtensor.dtensor._checkpoints import (
  _checkpoint,
  _restore,
  _step_files,
)
from flax_dtensor.dtensor._storage import _background, _steps, _temporaries

_REMOVING = re.compile(r'\.[0-9]{1,18}\.removing-[0-9]+')


def _is_process_0() -> bool:
  return jax.process_index() == 0


class CheckpointManager:
  """Checkpoints of a training run by step, kept by a retention policy.

  Shaped like orbax-checkpoint's ``CheckpointManager``, and written as
  `save_checkpoint` writes: each step is a TF checkpoint of DTensor
  variables that plain TensorFlow reads (``tf.train.latest_checkpoint(
  directory)`` names the latest whole step, ``tf.train.load_checkpoint``
  reads it), and `restore` places on any mesh and process count.

  Saves run in the background by default (`save_checkpoint`'s
  ``blocking=False``: the call returns once the state is copied to host
  memory). Two saves never overlap: a save that starts while one is being
  written waits for it (``when_busy='wait'``) or is skipped with a
  `CheckpointStepWarning` (``when_busy='skip'``).

  Retention: a step is kept if any rule keeps it, and the latest whole step
  is always kept. ``max_to_keep`` keeps the newest that many; ``keep_period``
  keeps every step divisible by it; ``best_fn`` with ``keep_best`` keeps that
  many steps with the best ``best_fn(metrics)`` (``best_mode`` 'max' or
  'min'). With none of them, every step is kept. Steps being restored by
  this manager are never removed.

  In a multi-process run every process makes the same manager and calls the
  same methods with the same arguments; process 0 writes the state file
  and the metrics and removes old steps.

  Args:
    directory: A local directory (created, with its parents, if missing).
    save_interval_steps: `should_save` is true for steps divisible by it.
    max_to_keep: Keep the newest this many steps (None: no such limit).
    keep_period: Keep every step divisible by this, whatever else applies.
    best_fn: Scores a step's metrics (the dict passed to `save`), e.g.
      ``lambda m: m['accuracy']``.
    best_mode: 'max' keeps the highest scores, 'min' the lowest.
    keep_best: Keep this many best-scored steps (needs `best_fn`).
    blocking: Whether `save` returns only once the step is whole on disk.
    when_busy: 'wait' or 'skip', for a save that starts while another is
      being written.
    include: NNX filter of the variables saved and restored.
    exclude: NNX filter of the variables left out (default: RNG state).
    save_on_preemption: Watch for a preemption notice (SIGTERM): from then
      on `reached_preemption` is true and `save` saves its step whatever the
      interval, and waits until it is whole. In a multi-process run JAX's
      preemption service decides the step all processes save at
      (``multihost_utils.reached_preemption_sync_point``; a notice to any
      one process reaches them all; `initialize()` keeps SIGTERM JAX's
      after TensorFlow's set-up); in one process, the manager's own
      SIGTERM handler.
    preemption_seconds: With `save_on_preemption` in one process: the
      process ends (exit status 143) this many seconds after the notice at
      the latest, if the loop has not ended it by then (None: no bound).
      The latest whole step stays restorable either way.

  Attributes:
    restored_step: The step the latest `restore` loaded (None before one).
      A resumed loop goes on from it, not from `latest_step()`: with the
      latest step damaged, `restore` loads an earlier one.

  Example:
    >>> manager = CheckpointManager('/tmp/run', max_to_keep=3)  # doctest: +SKIP
    >>> start = 1  # doctest: +SKIP
    >>> if manager.latest_step() is not None:  # doctest: +SKIP
    ...   manager.restore(optimizer)  # the newest good step
    ...   start = manager.restored_step + 1
    >>> for step in range(start, 1001):  # doctest: +SKIP
    ...   loss = train_step(model, optimizer, batch)
    ...   manager.save(step, optimizer, metrics={'loss': loss})
    >>> manager.wait()  # doctest: +SKIP
  """

  def __init__(
    self,
    directory: str | os.PathLike[str],
    *,
    save_interval_steps: int = 1,
    max_to_keep: int | None = None,
    keep_period: int | None = None,
    best_fn: Callable[[Mapping[str, float]], float] | None = None,
    best_mode: Literal['max', 'min'] = 'max',
    keep_best: int | None = None,
    blocking: bool = False,
    when_busy: Literal['wait', 'skip'] = 'wait',
    include: filterlib.Filter = ...,
    exclude: filterlib.Filter = nnx.RngState,
    save_on_preemption: bool = False,
    preemption_seconds: float | None = 30.0,
  ) -> None:
    from flax_dtensor.dtensor._format import _paths

    for name, value in (
      ('save_interval_steps', save_interval_steps),
      ('max_to_keep', max_to_keep),
      ('keep_period', keep_period),
      ('keep_best', keep_best),
    ):
      if value is None and name != 'save_interval_steps':
        continue
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _errors.CheckpointManagerError(
          f'{name} must be a positive int; got {value!r}.'
          + (
            ' Pass None for no such limit.'
            if name != 'save_interval_steps'
            else ''
          )
        )
    if best_mode not in ('max', 'min'):
      raise _errors.CheckpointManagerError(
        f"best_mode must be 'max' or 'min'; got {best_mode!r}."
      )
    if (keep_best is None) != (best_fn is None):
      raise _errors.CheckpointManagerError(
        "keep_best and best_fn go together: best_fn scores a step's "
        f'metrics and keep_best says how many to keep; got keep_best='
        f'{keep_best!r} and best_fn={best_fn!r}.'
      )
    if when_busy not in ('wait', 'skip'):
      raise _errors.CheckpointManagerError(
        f"when_busy must be 'wait' or 'skip'; got {when_busy!r}."
      )
    if preemption_seconds is not None and not preemption_seconds > 0:
      raise _errors.CheckpointManagerError(
        f'preemption_seconds must be a positive number or None; got '
        f'{preemption_seconds!r}.'
      )
    self.directory = _paths.local(directory, 'checkpoint manager directory')
    os.makedirs(self.directory, exist_ok=True)  # Each process: its view.
    self.save_interval_steps = save_interval_steps
    self.max_to_keep = max_to_keep
    self.keep_period = keep_period
    self.best_fn = best_fn
    self.best_mode = best_mode
    self.keep_best = keep_best
    self.blocking = blocking
    self.when_busy = when_busy
    self._include = include
    self._exclude = exclude
    self._lock = threading.Lock()
    self._reading: dict[int, int] = {}  # {step: restores in progress}
    self.restored_step: int | None = None
    # Damaged steps the latest restore went past: moved aside by the next
    # save, as the run goes on from the step restored.
    self._damaged: list[int] = []
    self._metrics = (
      _step_files.read_metrics(self.directory) if _is_process_0() else {}
    )
    self._pending: concurrent.futures.Future[Any] | None = None
    self.save_on_preemption = save_on_preemption
    self.preemption_seconds = preemption_seconds
    self._preempted_at: float | None = None
    self._previous_handler: Any = None
    if save_on_preemption and jax.process_count() == 1:
      self._watch_for_preemption()
    # Started here, on the caller's thread (see `_background.StartedPool`).
    self._finisher = _background.StartedPool(
      1, f'flax_dtensor manager of {self.directory}'
    )

  # Steps
  # ----------------------------------------------------------------------

  def step_directory(self, step: int) -> str:
    """The folder of `step` (whether or not it exists)."""
    return os.path.join(self.directory, str(_checked_step(step)))

  def all_steps(self) -> list[int]:
    """The whole steps on disk, oldest first."""
    return _steps.whole_steps(self.directory)

  def latest_step(self) -> int | None:
    """The newest whole step, or None before the first.

    A whole step can still be damaged, and `restore` then loads an earlier
    one: a resumed loop goes on from `restored_step`, not from this.
    """
    steps = self.all_steps()
    return steps[-1] if steps else None

  def should_save(self, step: int) -> bool:
    """Whether `save(step, ...)` would save (every `save_interval_steps`)."""
    return _checked_step(step) % self.save_interval_steps == 0

  # Preemption
  # ----------------------------------------------------------------------

  def _watch_for_preemption(self) -> None:
    if threading.current_thread() is not threading.main_thread():
      raise _errors.CheckpointManagerError(
        'save_on_preemption=True installs a SIGTERM handler, which Python '
        'allows on the main thread only; make the manager there.'
      )
    self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

  def _on_sigterm(self, signum: int, frame: Any) -> None:
    if self._preempted_at is not None:
      return
    self._preempted_at = time.monotonic()
    if self.preemption_seconds is not None:
      timer = threading.Timer(self.preemption_seconds, self._out_of_time)
      timer.daemon = True
      timer.start()

  def _out_of_time(self) -> None:
    latest = self.latest_step()
    print(
      f'flax_dtensor: preempted (SIGTERM) {self.preemption_seconds} s ago '
      f'and not yet ended: exiting now. The latest whole step of '
      f'{self.directory!r} is {latest}. Check reached_preemption(step) in '
      'the loop to save the current step first, or raise '
      'preemption_seconds.',
      file=sys.stderr,
      flush=True,
    )
    os._exit(128 + signal.SIGTERM)

  def reached_preemption(self, step: int) -> bool:
    """Whether the run was told it will be preempted, and `step` is the
    step to save at (every process agrees on it).

    Always false without ``save_on_preemption=True``.
    """
    step = _checked_step(step)
    if not self.save_on_preemption:
      return False
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils

      return bool(multihost_utils.reached_preemption_sync_point(step))
    return self._preempted_at is not None

  # Saving
  # ----------------------------------------------------------------------

  def save(
    self,
    step: int,
    module_or_state: Any,
    *,
    metrics: Mapping[str, Any] | None = None,
    force: bool = False,
  ) -> bool:
    """Saves `module_or_state` as step `step`, if `should_save(step)` or
    `force`.

    Returns once the state is copied (or, with ``blocking=True``, once the
    step is whole on disk). The step becomes visible, to `all_steps` and
    to TensorFlow, once whole; then the retention applies.

    Args:
      step: The step number (a non-negative int), above every saved one.
      module_or_state: An NNX module, `nnx.Optimizer` or `nnx.State`.
      metrics: Numbers describing the step, for ``best_fn``.
      force: Save even if `should_save(step)` is false.

    Returns:
      Whether a save was started (False: not a step to save, or skipped
      while the previous save is written, with ``when_busy='skip'``).

    Raises:
      CheckpointManagerError: If `step` is not a non-negative int above the
        latest saved step, or `metrics` are not finite numbers.
      ExportError: As `save_checkpoint`; and a failure of the previous
        background save, raised here if nobody waited for it.
    """
    step = _checked_step(step)
    preempted = self.reached_preemption(step)
    if not (force or preempted or self.should_save(step)):
      return False
    checked = _step_files.checked_metrics(metrics)
    previous = self._pending
    if previous is not None and self.when_busy == 'skip':
      busy = not previous.done()
      if (
        jax.process_count() > 1
      ):  # Every process skips, or none: process 0's view.
        with _processes.session(
          f'the save of step {step}', 'Nothing was saved.'
        ):
          busy = _processes.share(busy)
      if busy:
        _output.warn(
          f'Step {step} was not saved: the save before it is still being '
          f'written to {self.directory!r} (when_busy="skip"). Pass '
          'when_busy="wait" to wait for it instead, or save less often.',
          _errors.CheckpointStepWarning,
        )
        return False
    self.wait()  # The previous save's outcome, raised if it failed.
    self._move_damaged_aside()
    latest = self.latest_step()
    if latest is not None and step <= latest:
      raise _errors.CheckpointManagerError(
        f'Step {step} is not above the latest saved step, {latest}, in '
        f'{self.directory!r}. Save a later step, or restore from {latest} '
        'and go on from there.'
      )
    saved = _checkpoint.save_checkpoint(
      module_or_state,
      self.step_directory(step),
      # Above the latest whole step, a folder of this step is what a
      # stopped save left (an export of ours, or refused as not one).
      overwrite=True,
      include=self._include,
      exclude=self._exclude,
      blocking=self.blocking,
    )
    if self.blocking:
      self._finish(step, checked)
    else:
      self._pending = self._finisher.submit(
        self._finish_after, saved, step, checked
      )
      if preempted:  # Whole before the loop goes on to end the process.
        self.wait()
    return True

  def _move_damaged_aside(self) -> None:
    """Renames the damaged steps the latest restore went past to
    ``STEP.damaged``: the run goes on from the step restored, and they are
    kept for a look, out of `all_steps` and TensorFlow's state file."""
    damaged, self._damaged = self._damaged, []
    if not damaged:
      return
    if _is_process_0():
      with self._lock:
        for step in damaged:
          path = os.path.join(self.directory, str(step))
          if os.path.isdir(path):
            os.rename(path, _step_files.aside(self.directory, step))
        _temporaries.fsync_dir(self.directory)
        self._write_files(self.all_steps())
    if jax.process_count() > 1:  # Gone for every process before the save.
      with _processes.session(
        f'the damaged steps of {self.directory!r}', 'Nothing was saved.'
      ):
        _processes.sync('damaged steps moved aside')

  def _finish_after(
    self, handle: _background.SaveHandle, step: int, metrics: dict[str, float]
  ) -> None:
    handle.wait()
    self._finish(step, metrics)

  def _finish(self, step: int, metrics: dict[str, float]) -> None:
    """Once `step` is whole: its metrics, the state file, the retention."""
    if not _is_process_0():
      return
    with self._lock:
      if metrics:
        self._metrics[step] = metrics
      steps = self.all_steps()
      kept = self._kept(steps)
      self._metrics = {s: m for s, m in self._metrics.items() if s in kept}
      # The files first: what they name stays until they are replaced.
      self._write_files(sorted(kept))
      for old in steps:
        if old not in kept:
          self._remove(old)
      for name in os.listdir(self.directory):  # A removal a kill stopped.
        if _REMOVING.fullmatch(name):
          shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  def _kept(self, steps: list[int]) -> set[int]:
    if not steps:
      return set()
    if self.max_to_keep is None and self.keep_best is None:
      return set(steps)
    kept = {steps[-1]}
    if self.max_to_keep is not None:
      kept |= set(steps[-self.max_to_keep :])
    if self.keep_period is not None:
      kept |= {s for s in steps if s % self.keep_period == 0}
    if self.keep_best is not None and self.best_fn is not None:
      scored = [
        (float(self.best_fn(self._metrics[s])), s)
        for s in steps
        if s in self._metrics
      ]
      scored.sort(reverse=self.best_mode == 'max')
      kept |= {s for _, s in scored[: self.keep_best]}
    kept |= {s for s, n in self._reading.items() if n > 0}
    return kept

  def _remove(self, step: int) -> None:
    """Removes a step: renamed aside first, so no reader sees it in part."""
    path = os.path.join(self.directory, str(step))
    aside = os.path.join(self.directory, f'.{step}.removing-{os.getpid()}')
    try:
      os.rename(path, aside)
    except FileNotFoundError:
      return
    shutil.rmtree(aside, ignore_errors=True)

  def _write_files(self, kept: list[int]) -> None:
    _step_files.write_files(self.directory, kept, self._metrics)

  def wait(self) -> None:
    """Waits until the pending save is whole on disk and its step kept.

    Raises:
      ExportError: What the pending save failed with (once).
    """
    pending, self._pending = self._pending, None
    if pending is not None:
      pending.result()  # A failed save fails on every process (agreed).
    if jax.process_count() > 1:
      # Process 0 has kept or removed the steps: every process sees them.
      with _processes.session(
        f'the steps of {self.directory!r}', 'The latest step is whole.'
      ):
        _processes.sync('steps kept')

  wait_until_finished = wait  # orbax-checkpoint's name.

  def close(self) -> None:
    """Waits for the pending save; the manager takes no more."""
    try:
      self.wait()
    finally:
      self._finisher.shutdown()
      if self._previous_handler is not None:
        signal.signal(signal.SIGTERM, self._previous_handler)
        self._previous_handler = None

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()

  # Restoring
  # ----------------------------------------------------------------------

  def restore(self, target: Any, step: int | None = None, **kwargs: Any) -> Any:
    """Restores step `step` into `target` (`restore_checkpoint`'s rules).

    With no step, the latest whole one; if it is damaged, the newest good
    one before it, with a `CheckpointStepWarning` naming the damage.

    Args:
      target: The NNX module, `nnx.Optimizer` or state to fill.
      step: The step to restore (None: the latest whole step).
      **kwargs: More arguments of `restore_checkpoint` (`mesh`, `rules`, ...).

    Returns:
      `target`, restored. The step it was restored from is then
      `restored_step`: a resumed loop goes on from ``restored_step + 1``.
      After a fall back, the next `save` moves the damaged steps aside (to
      ``STEP.damaged``), so that the run goes on from the step restored.

    Raises:
      ExportNotFoundError: If the directory holds no whole step, or not
        `step`.
      DamagedExportError: If `step` (given) is damaged, or every step is.
    """
    self.wait()
    kwargs.setdefault('include', self._include)
    kwargs.setdefault('exclude', self._exclude)
    if step is not None:
      step = _checked_step(step)
      if step not in self.all_steps():
        raise _errors.ExportNotFoundError(
          f'{self.directory!r} holds no whole step {step}; it holds '
          f'{_listed(self.all_steps())}. Pass one of those, or no step for '
          'the latest.'
        )
      restored = self._restore_step(step, target, kwargs)
      self.restored_step = step
      return restored
    steps = self.all_steps()
    if not steps:
      raise _errors.ExportNotFoundError(
        f'{self.directory!r} holds no whole step to restore. Expected a '
        'folder named by a step, written by CheckpointManager.save; start '
        'from a fresh model instead, or pass the directory a run wrote.'
      )
    skipped = []
    for candidate in reversed(steps):
      try:
        restored = self._restore_step(candidate, target, kwargs)
      except (_errors.DamagedExportError, _errors.MalformedExportError) as e:
        skipped.append((candidate, e))
        continue
      self.restored_step = candidate
      self._damaged = [s for s, _ in skipped]
      if skipped:
        aside = ', '.join(
          repr(os.path.basename(_step_files.aside(self.directory, s)))
          for s, _ in skipped
        )
        _output.warn(
          f'Restored step {candidate} of {self.directory!r}, not the latest: '
          + '; '.join(f'step {s} is damaged ({e})' for s, e in skipped)
          + '. The damaged steps are left as they are for a look; the next '
          f'save moves them aside, to {aside}, as the run goes on from step '
          f'{candidate}: resume from `manager.restored_step + 1`, not from '
          '`latest_step()`.',
          _errors.CheckpointStepWarning,
        )
      return restored
    raise skipped[0][1]

  def _restore_step(
    self, step: int, target: Any, kwargs: dict[str, Any]
  ) -> Any:
    with self._lock:
      self._reading[step] = self._reading.get(step, 0) + 1
    try:
      return _restore.restore_checkpoint(
        self.step_directory(step), target, **kwargs
      )
    finally:
      with self._lock:
        self._reading[step] -= 1

  def metrics(self, step: int) -> dict[str, float]:
    """The metrics saved with `step` ({} if none, or not on process 0)."""
    return dict(self._metrics.get(_checked_step(step), {}))

  def __repr__(self) -> str:
    return f'CheckpointManager({self.directory!r}, steps={_listed(self.all_steps())})'


def _checked_step(step: Any) -> int:
  if isinstance(step, bool) or not hasattr(step, '__index__'):
    raise _errors.CheckpointManagerError(
      f'A step is a non-negative int; got {type(step).__name__} {step!r}.'
    )
  value = step.__index__()
  if value < 0 or value >= 10**18:
    raise _errors.CheckpointManagerError(
      f'A step is a non-negative int below 10**18; got {value}.'
    )
  return value


def _listed(steps: list[int]) -> str:
  if not steps:
    return 'none'
  if len(steps) > 8:
    return (
      ', '.join(map(str, steps[:3]))
      + ', ..., '
      + ', '.join(map(str, steps[-3:]))
    )
  return ', '.join(map(str, steps))
