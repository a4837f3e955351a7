"""Runs a command beside CPU-bound busy loops: the tests on a loaded machine.

Usage (from the repository root)::

  python tests/support/busy.py -- python -m pytest
  python tests/support/busy.py --loops 2 --repeat 20 -- \\
      python -m pytest tests/bridge/storage/kill_test.py \\
      tests/bridge/checkpoints/multiprocess_export_test.py

Starts LOOPS processes that each keep one core busy (pure Python
arithmetic, at normal priority), runs the command REPEAT times, stops the
loops, prints one line per run and a count of passes, and exits non-zero if
any run failed. A test whose outcome depends on timing must pass under it,
as CI machines and shared workstations are rarely idle.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

_SPIN = 'x = 0\nwhile True:\n  x = (x * 1103515245 + 12345) % 2147483648\n'


@contextlib.contextmanager
def busy_loops(count: int) -> Iterator[list[subprocess.Popen]]:
  """`count` processes spinning on a core each, killed on exit."""
  loops = [
    subprocess.Popen([sys.executable, '-c', _SPIN], stdin=subprocess.DEVNULL)
    for _ in range(count)
  ]
  try:
    yield loops
  finally:
    for loop in loops:
      loop.kill()
    for loop in loops:
      loop.wait(timeout=60)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__.split('\n\n')[0],
    usage='%(prog)s [--loops N] [--repeat N] -- COMMAND...',
  )
  parser.add_argument('--loops', type=int, default=2, help='busy loops (2)')
  parser.add_argument('--repeat', type=int, default=1, help='runs (1)')
  parser.add_argument('command', nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ['--'] else args.command
  if not command:
    parser.error('give the command to run after --')
  passed = 0
  with busy_loops(args.loops):
    for run in range(1, args.repeat + 1):
      start = time.monotonic()
      status = subprocess.run(command, check=False).returncode
      passed += status == 0
      print(
        f'busy.py: run {run}/{args.repeat} '
        f'{"passed" if status == 0 else f"FAILED (exit {status})"} in '
        f'{time.monotonic() - start:.0f} s beside {args.loops} busy loops',
        flush=True,
      )
  print(f'busy.py: {passed} of {args.repeat} runs passed', flush=True)
  return 0 if passed == args.repeat else 1


if __name__ == '__main__':
  sys.exit(main())
