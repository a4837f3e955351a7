"""Interrupting `demo` and `export` at random moments, and judging what is left.

A sweep runs a command once to the end over an empty folder (the old run:
its file tree and hashes are the snapshot, its duration the run's length),
then reruns it over a copy of that folder for each moment, seeded and
spread over the whole run (one random moment in each of `n` equal slices of
1.1 times the length), and sends the signal to the rerun's process group
at that moment. Each moment records the exit status, the seconds from the
signal to the exit, and what the folder holds: exactly the old run
(`'old'`), one whole new run that verifies (`'new'`), or anything else
(`'broken: ...'`), and the temporaries left beside it.

    python tests/support/signal_sweep.py [--moments 20] [--seed N]

runs the long sweep (the demo's defaults, 20 moments per command; see
docs/cli.md, "Ctrl-C") in forks of a warm pool and prints one line per
moment and the counts. ``tests/cli/interrupt_test.py`` runs a short one.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence

from support import processes

CLI_MAIN = processes.WORKERS_DIR / 'cli_main.py'
DEMO_TARGET = 'flax_dtensor.demo.model:make_model'
# The demo on small inputs: the normal suite's (a few steps, one sequence).
SMALL_DEMO = ('--steps', '2', '--batch-size', '1')
EXIT_TIMEOUT = 120  # A process that outlives a signal this long has hung.
_OURS = re.compile(r'\.(.+)\.(tmp|old)-|\.flax_dtensor-staging-')


def snapshot(folder: pathlib.Path) -> dict[str, str] | None:
  """{relative path: sha256 (files) or 'dir'} of `folder`, or None."""
  if not folder.exists():
    return None
  tree = {}
  for path in sorted(folder.rglob('*')):
    name = str(path.relative_to(folder))
    if path.is_dir():
      tree[name] = 'dir'
    else:
      tree[name] = hashlib.sha256(path.read_bytes()).hexdigest()
  return tree


def leftovers(folder: pathlib.Path) -> list[str]:
  """Hidden temporaries of ours beside `folder` (or inside it)."""
  found = []
  for where in (folder.parent, folder):
    if where.is_dir():
      found += [
        str(where / n) for n in sorted(os.listdir(where)) if _OURS.match(n)
      ]
  return found


def whole_run_problems(folder: pathlib.Path, parts: Sequence[str]) -> list:
  """What keeps `folder` from being one whole run that verifies."""
  from flax_dtensor.cli import _run_folder
  from flax_dtensor.dtensor._format import _decode, _verify

  problems = list(_run_folder.problems(folder))
  present = sorted(n for n in os.listdir(folder) if not n.startswith('.'))
  if present != sorted(parts):
    problems.append(f'holds {present}, not {sorted(parts)}')
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    for part in ('checkpoint', 'saved_model'):
      if not (folder / part).is_dir():
        continue
      manifest = _decode.read(str(folder / part))
      if manifest is None:
        problems.append(f'{part} has no manifest')
        continue
      problems += [f'{part}: {p}' for p in _verify.problems_of(manifest, pool)]
  if len({_run_folder.run_of(folder / p) for p in present}) != 1:
    problems.append('parts of several runs')
  return problems


@dataclasses.dataclass
class Moment:
  command: str
  index: int
  at: float  # Seconds after the start the signal was sent.
  status: int | None = None
  seconds_to_exit: float | None = None
  outcome: str = ''
  left: list[str] = dataclasses.field(default_factory=list)
  ended_before: bool = False  # The process had ended before the signal.
  finished_before: bool = False  # Its last line was out before the signal.

  def line(self) -> str:
    exit_s = (
      '-' if self.seconds_to_exit is None else f'{self.seconds_to_exit:.2f}'
    )
    return (
      f'{self.command} #{self.index:02d} at {self.at:6.2f} s: exit '
      f'{self.status} after {exit_s} s, {self.outcome}'
      + (f', LEFT {self.left}' if self.left else '')
      + (' (ended before the signal)' if self.ended_before else '')
    )


@dataclasses.dataclass
class Command:
  """A command to interrupt: its name, arguments (with OUT), and parts."""

  name: str
  args: Callable[[pathlib.Path], list[str]]
  parts: tuple[str, ...]


def demo_command(*extra: str) -> Command:
  return Command(
    'demo',
    lambda out: ['demo', '--out', str(out), '-q', *extra],
    ('orbax', 'checkpoint', 'saved_model', 'rules.yaml', 'summary.json'),
  )


def export_command(checkpoint: pathlib.Path, *extra: str) -> Command:
  return Command(
    'export',
    lambda out: [
      'export',
      DEMO_TARGET,
      '--checkpoint',
      str(checkpoint),
      '--out',
      str(out),
      '--overwrite',
      '--saved-model',
      '--input-shape',
      'tokens:1,128:int32',
      '--cpu-devices',
      '8',
      *extra,
    ],
    ('checkpoint', 'saved_model'),
  )


class _Lines:
  """Reads a pipe on a thread; the time the last line was read."""

  def __init__(self, pipe):
    self.text = []
    self.last = 0.0
    self._thread = threading.Thread(target=self._read, args=(pipe,))
    self._thread.start()

  def _read(self, pipe) -> None:
    for line in iter(pipe.readline, b''):
      self.text.append(line.decode(errors='replace'))
      self.last = time.monotonic()
    pipe.close()

  def join(self) -> str:
    self._thread.join(EXIT_TIMEOUT)
    return ''.join(self.text)


def start(pool, args: Sequence[str], cwd: pathlib.Path, *, real: bool):
  """`flax-dtensor ARGS` in its own process group: a fork, or `python -m`."""
  env = processes.clean_env(COLUMNS='100')
  if real:
    return subprocess.Popen(
      [sys.executable, '-m', 'flax_dtensor', *args],
      cwd=cwd,
      env=env,
      stdin=subprocess.DEVNULL,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      start_new_session=True,
    )
  env.pop('XLA_FLAGS', None)
  return pool.start(
    CLI_MAIN,
    *args,
    cwd=cwd,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
  )


def run_once(pool, command: Command, out: pathlib.Path) -> float:
  """Runs `command` to its end into `out`; its duration in seconds."""
  began = time.monotonic()
  case = start(pool, command.args(out), out.parent, real=False)
  err = _Lines(case.stderr)
  _Lines(case.stdout).join()
  status = case.wait(EXIT_TIMEOUT * 10)
  if status != 0:
    raise AssertionError(f'{command.name} failed ({status}): {err.join()}')
  return time.monotonic() - began


def interrupt(
  pool,
  command: Command,
  out: pathlib.Path,
  at: float,
  *,
  index: int = 0,
  sig: int = signal.SIGINT,
  real: bool = False,
  old: dict[str, str] | None,
  writing: bool = False,
) -> Moment:
  """Reruns `command` over `out` and signals its process group at `at` s.

  With `writing`, the moment is instead the one its new folder appears
  beside `out` (polled every 5 ms): a stop that must keep the old run,
  however quick the rerun is against the old run's length.
  """
  moment = Moment(command.name, index, at)
  began = time.monotonic()
  case = start(pool, command.args(out), out.parent, real=real)
  stdout, stderr = _Lines(case.stdout), _Lines(case.stderr)
  if writing:
    deadline = began + EXIT_TIMEOUT * 10
    while not (leftovers(out) or case.poll() is not None):
      if time.monotonic() > deadline:
        break
      time.sleep(0.005)
    moment.at = round(time.monotonic() - began, 3)
  else:
    time.sleep(max(0.0, began + at - time.monotonic()))
  moment.ended_before = case.poll() is not None
  sent = time.monotonic()
  try:
    os.killpg(case.pid, sig)
  except ProcessLookupError:
    moment.ended_before = True
  try:
    moment.status = case.wait(EXIT_TIMEOUT)
  except subprocess.TimeoutExpired:
    os.killpg(case.pid, signal.SIGKILL)
    case.wait(EXIT_TIMEOUT)
    moment.outcome = 'broken: did not exit'
    return moment
  moment.seconds_to_exit = time.monotonic() - sent
  stdout.join()
  # Its last line (the end of the summary) was out before the signal.
  moment.finished_before = bool(stdout.text) and 0 < stdout.last < sent
  stderr_text = stderr.join()
  now = snapshot(out)
  if now == old:
    moment.outcome = 'old'
  elif now is None:
    moment.outcome = 'broken: the folder is gone'
  else:
    problems = whole_run_problems(out, command.parts)
    moment.outcome = 'new' if not problems else f'broken: {problems}'
  moment.left = leftovers(out)
  if moment.status not in (0, 128 + sig) and moment.status != -sig:
    moment.outcome += f' (stderr: {stderr_text.strip()[-300:]})'
  return moment


def moments(seed: int, n: int, length: float) -> list[float]:
  """One random moment in each of `n` equal slices of 1.1 x `length`."""
  rng = random.Random(seed)
  span = 1.1 * length / n
  return [round((i + rng.random()) * span, 3) for i in range(n)]


def acceptable(moment: Moment, sig: int = signal.SIGINT) -> str | None:
  """Why `moment` breaks the promise of docs/cli.md, or None.

  The exit status is 128 + the signal (or death by the signal, before the
  command line installed its handler: a shell shows 130 too); 0 only if
  the run had finished (its last line printed) before the signal. The folder holds the old run or one whole
  new run, and no temporary is left.
  """
  if moment.outcome not in ('old', 'new'):
    return moment.outcome
  if moment.left:
    return f'left {moment.left}'
  if moment.status in (128 + sig, -sig):
    return None
  # 0: the run was done (its last line out) as the signal came, or it
  # ended within the promised 2 s of it (the last line read late).
  done = moment.ended_before or moment.finished_before
  if moment.status == 0 and (done or moment.seconds_to_exit <= 2.0):
    return None if moment.outcome == 'new' else 'exit 0 with the old run'
  return f'exit status {moment.status}'


def sweep(
  pool,
  command: Command,
  root: pathlib.Path,
  *,
  seed: int,
  n: int,
  calibrate: bool = False,
  report: Callable[[str], None] = print,
) -> list[Moment]:
  """The old run, then `n` interrupted reruns over copies of it.

  The moments spread over the old run's length, or, with `calibrate`, over
  that of one more rerun to the end (the longer sweep's choice).
  """
  reference = root / f'{command.name}-old'
  length = run_once(pool, command, reference)
  old = snapshot(reference)
  if calibrate:
    # A rerun over the old output, timed: reruns can be quicker than the
    # first run (warm caches), and moments past their end interrupt nothing.
    again = root / f'{command.name}-calibration' / 'out'
    again.parent.mkdir()
    shutil.copytree(reference, again)
    length = run_once(pool, command, again)
    shutil.rmtree(again.parent, ignore_errors=True)
  ats = moments(seed, n, length)
  report(
    f'{command.name}: run of {length:.1f} s, seed {seed}, moments {ats}, '
    f'load {os.getloadavg()[0]:.1f}'
  )
  done = []
  for i, at in enumerate(ats):
    moment = interrupt_over_a_copy(
      pool, command, reference, root, at, index=i, old=old
    )
    report(moment.line())
    done.append(moment)
  return done


def interrupt_over_a_copy(
  pool,
  command: Command,
  reference: pathlib.Path,
  root: pathlib.Path,
  at: float,
  *,
  index: int,
  old: dict[str, str] | None,
  writing: bool = False,
) -> Moment:
  """Reruns `command` over a copy of the old run `reference`, signalled at
  `at` s or as it begins writing (see `interrupt`); the copy is removed
  afterwards."""
  out = root / f'{command.name}-{index:02d}' / 'out'
  out.parent.mkdir()
  try:
    shutil.copytree(reference, out)
    return interrupt(
      pool, command, out, at, index=index, old=old, writing=writing
    )
  finally:
    shutil.rmtree(out.parent, ignore_errors=True)


def summary(done: Sequence[Moment]) -> str:
  """Counts: moments, exits 130, max seconds to exit, whole runs."""
  by_command: dict[str, list[Moment]] = {}
  for m in done:
    by_command.setdefault(m.command, []).append(m)
  lines = []
  for name, ms in by_command.items():
    times = [m.seconds_to_exit for m in ms if m.seconds_to_exit is not None]
    lines.append(
      f'{name}: {len(ms)} moments, '
      f'{sum(m.status == 130 for m in ms)} exits 130, '
      f'{sum(m.status == 0 for m in ms)} exits 0 (ended before), '
      f'max {max(times):.2f} s to exit, '
      f'{sum(m.outcome == "old" for m in ms)} old + '
      f'{sum(m.outcome == "new" for m in ms)} new whole runs, '
      f'{sum(acceptable(m) is not None for m in ms)} broken'
    )
  return '\n'.join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--moments', type=int, default=20)
  parser.add_argument('--seed', type=int, default=int(time.time()) % 10000)
  parser.add_argument('--commands', default='demo,export')
  parser.add_argument(
    '--small', action='store_true', help="The normal suite's small demo."
  )
  flags = parser.parse_args()
  from support import warm

  pool = warm.Pool()
  root = pathlib.Path(tempfile.mkdtemp(prefix='fdt-signal-sweep-'))
  done = []
  try:
    demo = demo_command(*(SMALL_DEMO if flags.small else ()))
    commands = flags.commands.split(',')
    if 'demo' in commands:
      done += sweep(
        pool, demo, root, seed=flags.seed, n=flags.moments, calibrate=True
      )
    if 'export' in commands:
      # It reads the old demo run's Orbax checkpoint (outside its --out).
      source = root / 'demo-old'
      if not source.exists():
        run_once(pool, demo_command(*SMALL_DEMO), source)
      export = export_command(source / 'orbax')
      done += sweep(
        pool,
        export,
        root,
        seed=flags.seed + 1,
        n=flags.moments,
        calibrate=True,
      )
  finally:
    pool.close()
    shutil.rmtree(root, ignore_errors=True)
  print(summary(done))
  print(f'load average {os.getloadavg()}')
  broken = [m for m in done if acceptable(m) is not None]
  sys.exit(1 if broken else 0)


if __name__ == '__main__':
  main()
