"""The suite's cost per test file, from one run's `--suite-profile` file.

    python -m pytest -n auto --suite-profile run.jsonl
    python tools/suite_profile.py run.jsonl [--top 40] [--limit 180]
    python tools/suite_profile.py run.jsonl [more.jsonl ...] --write-costs


Prints a Markdown table, most expensive file first: its tests, the worker
seconds it held (setup + call + teardown), how much of that was fixture
set-up, its slowest test, the most that any one worker spent on it (a
file split into parts spreads over the workers), the fresh processes it
started, the scripts it
ran in the warm pool's forks, the XLA compilations in the test process
(and those the persistent cache served), and whether it imported
TensorFlow. Then the totals, and a warning line for each file over
`--limit` seconds of one worker's time (a warning, never a failure: these
machines are shared, and timing fails no test). `tests/README.md` says
how to profile; the tables of past runs are in its git history.

`--write-costs` writes each file's seconds (the mean over the runs given)
to tests/support/costs.json, which pytest-xdist's scheduling reads to hand
out the dearest files first (tests/support/scheduling.py).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import pathlib
import sys

COLUMNS = (
  'file',
  'tests',
  'seconds',
  'setup s',
  'slowest test s',
  'one worker s',
  'processes',
  'forks',
  'compiles',
  'cache hits',
  'TF imports',
)


def read(path: pathlib.Path) -> tuple[dict, list[dict]]:
  """The run's header and its rows (one a test)."""
  lines = path.read_text(encoding='utf-8').splitlines()
  if not lines:
    raise SystemExit(f'{path}: empty; was the run given --suite-profile?')
  header = json.loads(lines[0])
  return header, [json.loads(line) for line in lines[1:] if line.strip()]


def by_file(rows: list[dict]) -> list[dict]:
  """One summary a test file, most worker seconds first."""
  files: dict[str, dict] = collections.defaultdict(
    lambda: dict.fromkeys(COLUMNS[1:], 0)
  )
  # A file split into parts (tests/support/scheduling.py) spreads over the
  # workers: 'one worker s' is the most that any one worker spent on it.
  on_worker: dict[tuple[str, str], float] = collections.Counter()
  for row in rows:
    f = files[row['file']]
    seconds = row['setup'] + row['call'] + row['teardown']
    on_worker[row['file'], row.get('worker', 'main')] += seconds
    f['tests'] += 1
    f['seconds'] += seconds
    f['setup s'] += row['setup']
    f['slowest test s'] = max(f['slowest test s'], seconds)
    f['processes'] += row.get('processes', 0)
    f['forks'] += row.get('forks', 0)
    # JAX's compile event wraps the persistent cache's look-up too.
    f['compiles'] += row.get('compiles', 0) - row.get('cache_hits', 0)
    f['cache hits'] += row.get('cache_hits', 0)
    f['TF imports'] += row.get('tf_import', 0)
  for (name, _), seconds in on_worker.items():
    files[name]['one worker s'] = max(files[name]['one worker s'], seconds)
  table = [{'file': name, **f} for name, f in files.items()]
  return sorted(table, key=lambda f: -f['seconds'])


def markdown(table: list[dict], *, top: int | None = None) -> str:
  def cell(value) -> str:
    text = f'{value:.1f}' if isinstance(value, float) else str(value)
    return text.replace('|', '/')

  shown = table if top is None else table[:top]
  lines = [
    '| ' + ' | '.join(COLUMNS) + ' |',
    '|' + '|'.join('---' if c == 'file' else '---:' for c in COLUMNS) + '|',
  ]
  for f in shown:
    lines.append('| ' + ' | '.join(cell(f[c]) for c in COLUMNS) + ' |')
  if top is not None and len(table) > top:
    rest = table[top:]
    lines.append(
      f'| ({len(rest)} more files) | {sum(f["tests"] for f in rest)} | '
      f'{sum(f["seconds"] for f in rest):.1f} |' + ' |' * 8
    )
  return '\n'.join(lines)


def totals(header: dict, rows: list[dict], table: list[dict]) -> str:
  workers = collections.Counter()
  for row in rows:
    workers[row.get('worker', 'main')] += (
      row['setup'] + row['call'] + row['teardown']
    )
  busy = ', '.join(f'{w} {s:.0f} s' for w, s in sorted(workers.items()))
  failed = sum(1 for r in rows if r.get('outcome') not in ('passed', None))
  return (
    f'{len(rows)} tests in {len(table)} files, {failed} not passed; '
    f'{sum(f["seconds"] for f in table):.0f} worker seconds '
    f'({busy}); {header.get("wall_seconds", 0):.0f} s of wall time; '
    f'{sum(f["processes"] for f in table)} processes, '
    f'{sum(f["forks"] for f in table)} forks, '
    f'{sum(f["compiles"] for f in table)} compilations '
    f'({sum(f["cache hits"] for f in table)} from the persistent cache), '
    f'{sum(f["TF imports"] for f in table)} TensorFlow imports'
  )


COSTS_FILE = (
  pathlib.Path(__file__).resolve().parents[1]
  / 'tests'
  / 'support'
  / 'costs.json'
)


def write_costs(
  runs: list[tuple[dict, list[dict]]], path: pathlib.Path
) -> None:
  """Each file's mean seconds over `runs`, for tests/support/scheduling."""
  sys.path.insert(0, str(COSTS_FILE.parents[1]))  # tests/, for `support`.
  from support import scheduling  # How the scheduler splits files.

  seconds: dict[str, list[float]] = collections.defaultdict(list)
  parts: dict[str, list[float]] = collections.defaultdict(list)
  for _, rows in runs:
    for f in by_file(rows):
      seconds[f['file']].append(f['seconds'])
    split: dict[str, float] = collections.defaultdict(float)
    for row in rows:
      if row['file'] in scheduling.SPLIT:
        scope = scheduling.SPLIT[row['file']](row['nodeid'])
        split[scope] += row['setup'] + row['call'] + row['teardown']
    for scope, value in split.items():
      parts[scope].append(value)

  def mean(table: dict[str, list[float]]) -> dict[str, float]:
    return {
      name: round(sum(values) / len(values), 1)
      for name, values in sorted(table.items())
    }

  costs = mean(seconds)
  path.write_text(
    json.dumps(
      {
        'measured': datetime.date.today().isoformat(),
        'runs': [
          {k: header.get(k) for k in ('python', 'jax', 'flax', 'wall_seconds')}
          for header, _ in runs
        ],
        'seconds_by_file': costs,
        # The parts of the files the scheduler hands out apart.
        'seconds_by_part': mean(parts),
      },
      indent=1,
    )
    + '\n',
    encoding='utf-8',
  )


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('profile', type=pathlib.Path, nargs='+')
  parser.add_argument('--top', type=int, default=None, metavar='N')
  parser.add_argument(
    '--limit',
    type=float,
    default=180.0,
    metavar='SECONDS',
    help='warn of any file over this many seconds of one worker (180)',
  )
  parser.add_argument(
    '--write-costs',
    action='store_true',
    help=f"write the files' seconds to {COSTS_FILE.name} (mean of the runs)",
  )
  args = parser.parse_args(argv)
  runs = [read(path) for path in args.profile]
  if args.write_costs:
    write_costs(runs, COSTS_FILE)
  header, rows = runs[-1]
  table = by_file(rows)
  print(markdown(table, top=args.top))
  print()
  print(totals(header, rows, table))
  for f in table:
    if f['one worker s'] > args.limit:
      print(
        f'warning: {f["file"]} held a worker {f["one worker s"]:.0f} s '
        f'(over {args.limit:.0f} s): split it or make it cheaper',
        file=sys.stderr,
      )
  return 0


if __name__ == '__main__':
  sys.exit(main())
