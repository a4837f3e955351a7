"""Every benchmark of flax_dtensor, each measurement in a fresh process.

Usage::

  python benchmarks/run.py                      # everything (~1 hour)
  python benchmarks/run.py --only init,plan --repeat 5
  python benchmarks/run.py --quick              # small sizes, 1 repeat
  python benchmarks/run.py --repo /old/checkout --label before --roles ours

Each case measures flax_dtensor, its peer and the machine's limit in the
same run, on the same state (`groups/`, one module per group), the repeats taking turns between
them, and reports min / median / max of the repeats and the ratios of the medians (flax_dtensor's time divided
by the other's: below 1 is faster). Memory is the OS's peak RSS
(``resource.getrusage``) above the process's baseline before the measured
step. Results go to ``--out`` as JSON, under ``--label`` (the docs'
benchmarks page reads ``benchmarks/results.json``: ``current``, and
``before`` if present), and to the terminal. ``--repo`` measures another
checkout of flax_dtensor (its package first on ``PYTHONPATH``).

``--one-process`` runs each case's measurements in one fresh process
instead of one each (`harness.measure_in_one`): a check that the groups
run, not a benchmark of memory (no device peak is claimed, and each RSS
window starts over what the methods before it left); the suite runs the
`gpu` group so (tests/core/gpu_benchmark_test.py).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import groups as benchmark_groups
import harness

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--only', help='Comma-separated groups (default: all).')
  parser.add_argument('--repeat', type=int, default=3)
  parser.add_argument('--quick', action='store_true')
  parser.add_argument('--repo', default=str(REPO))
  parser.add_argument('--label', default='current')
  parser.add_argument(
    '--roles', help='Comma-separated roles to measure (default: all).'
  )
  parser.add_argument('--timeout', type=float, default=3600)
  parser.add_argument(
    '--one-process',
    action='store_true',
    help="Each case's measurements in one process (no memory peaks).",
  )
  parser.add_argument('--out', default=str(HERE / 'results.json'))
  args = parser.parse_args()
  groups = benchmark_groups.grids(quick=args.quick)
  if args.only:
    wanted = args.only.split(',')
    unknown = sorted(set(wanted) - set(groups))
    if unknown:
      parser.error(f'unknown groups {unknown}; expected some of {list(groups)}')
    groups = {k: v for k, v in groups.items() if k in wanted}
  repeat = 1 if args.quick else args.repeat
  roles = set(args.roles.split(',')) if args.roles else None
  print(
    f'{"group":<13} {"params":<48} {"role":<11} {"method":<16} '
    f'{"min":>8} {"median":>8} {"max":>8}     peak RSS above baseline'
  )
  report = harness.run(
    groups,
    repeat,
    args.repo,
    args.timeout,
    args.label,
    roles,
    one_process=args.one_process,
  )
  out = pathlib.Path(args.out)
  previous = json.loads(out.read_text()) if out.exists() else {}
  if args.only and args.label in previous:
    # Keep the other groups of an earlier run under the same label, and its
    # date and command (each entry says when it was measured).
    earlier = previous[args.label]
    kept = [r for r in earlier['results'] if r['group'] not in groups]
    for r in kept:
      r.setdefault(
        'measured',
        {
          'date': earlier['date'],
          'command': earlier['command'],
          'repeat': earlier['repeat'],
        },
      )
    report['results'] = kept + report['results']
    report['growth'] = harness.growth(report['results'])
    for key in ('date', 'command', 'repeat'):
      report[key] = earlier[key]
  previous[args.label] = report
  out.write_text(json.dumps(previous, indent=1) + '\n')
  print(f'wrote {out} ({args.label})')


if __name__ == '__main__':
  main()
