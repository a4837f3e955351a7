"""Every benchmark of flax_dtensor, each measurement in a fresh process.

Usage::

  python benchmarks/run.py                      # all, 3 repeats
  python benchmarks/run.py --only init,plan --repeat 5
  python benchmarks/run.py --quick              # small sizes, 1 repeat
  python benchmarks/run.py --repo /other/checkout --label before

Each case measures flax_dtensor, its peer and the machine's limit in the
same run, on the same state, and reports min / median / max of the repeats
and the ratios of the medians (flax_dtensor / peer, flax_dtensor / limit).
Memory is the OS's peak RSS (``resource.getrusage``) above the process's
baseline before the measured step. Results go to ``--out`` as JSON (the docs'
benchmarks page reads ``benchmarks/results.json``) and to the terminal.
``--repo`` measures another checkout of flax_dtensor (its package on
``PYTHONPATH``), to record a before/after.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent

# (case, params, {role: method}); roles: ours, peer, limit, other.
FULL = {
  'init': [
    (
      'init',
      {'layers': 24, 'width': 1024},
      {
        'ours': 'fdt_init',
        'peer': 'flax_eager',
        'limit': 'unsharded',
        'ours_eager': 'fdt_eager',
      },
    ),
  ],
  'init_scaling': [
    ('init', {'layers': layers, 'width': 1024}, {'ours': 'fdt_init'})
    for layers in (6, 12, 24, 48)
  ]
  + [
    ('init', {'layers': layers, 'width': 1024}, {'ours_eager': 'fdt_eager'})
    for layers in (6, 12, 24)
  ],
  'plan': [
    ('plan', {'variables': n}, {'ours': 'fdt_plan_factory'})
    for n in (1000, 2500, 5000, 10000)
  ]
  + [
    ('plan', {'variables': n}, {'peer': 'flax_eval_shape'})
    for n in (250, 500, 1000)
  ],
  'to_tf': [
    (
      'to_tf',
      {'arrays': 32, 'mib': 16},
      {'ours': 'fdt', 'peer': 'orbax', 'limit': 'pack'},
    ),
  ],
  'checkpoint': [
    (
      'checkpoint',
      {'arrays': 32, 'mib': 16},
      {'ours': 'save', 'limit': 'raw_write', 'peer': 'tf_write'},
    ),
    (
      'checkpoint',
      {'arrays': 32, 'mib': 16},
      {'ours': 'restore', 'limit': 'raw_read'},
    ),
  ],
}
QUICK = {
  'init': [
    (
      'init',
      {'layers': 2, 'width': 256},
      {
        'ours': 'fdt_init',
        'peer': 'flax_eager',
        'limit': 'unsharded',
        'ours_eager': 'fdt_eager',
      },
    )
  ],
  'plan': [
    ('plan', {'variables': 200}, {'ours': 'fdt_plan_factory'}),
    ('plan', {'variables': 100}, {'peer': 'flax_eval_shape'}),
  ],
  'to_tf': [
    (
      'to_tf',
      {'arrays': 8, 'mib': 1},
      {'ours': 'fdt', 'peer': 'orbax', 'limit': 'pack'},
    )
  ],
  'checkpoint': [
    (
      'checkpoint',
      {'arrays': 8, 'mib': 1},
      {'ours': 'save', 'limit': 'raw_write', 'peer': 'tf_write'},
    ),
    (
      'checkpoint',
      {'arrays': 8, 'mib': 1},
      {'ours': 'restore', 'limit': 'raw_read'},
    ),
  ],
}


def _measure(case, method, params, repo, timeout):
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join(
    [str(repo)] + [p for p in [env.get('PYTHONPATH')] if p]
  )
  proc = subprocess.run(
    [sys.executable, str(HERE / 'cases.py'), case, method, json.dumps(params)],
    capture_output=True,
    text=True,
    timeout=timeout,
    env=env,
    check=False,
  )
  if proc.returncode:
    tail = (proc.stderr.strip().splitlines() or ['(no output)'])[-1]
    return {'error': f'exit {proc.returncode}: {tail[:300]}'}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _summary(runs):
  ok = [r for r in runs if 'error' not in r]
  if not ok:
    return {'error': runs[-1]['error']}
  seconds = [r['seconds'] for r in ok]
  extra = sorted(
    r['rss_peak_mib'] - r['rss_before_mib'] for r in ok if 'rss_peak_mib' in r
  )
  out = {
    'seconds': {
      'min': min(seconds),
      'median': statistics.median(seconds),
      'max': max(seconds),
    },
    'rss_above_baseline_mib': {
      'min': extra[0],
      'median': statistics.median(extra),
      'max': extra[-1],
    },
    'runs': len(ok),
  }
  for key in ('param_bytes', 'bytes', 'variables', 'shard_shape'):
    if key in ok[0]:
      out[key] = ok[0][key]
  return out


def _machine():
  mem = 0
  try:
    with open('/proc/meminfo') as f:
      mem = int(f.readline().split()[1]) // 1024
  except OSError:
    pass
  versions = {}
  for name in ('jax', 'flax', 'tensorflow-cpu', 'orbax-export', 'numpy'):
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  return {
    'cpus': os.cpu_count(),
    'memory_mib': mem,
    'platform': platform.platform(),
    'python': platform.python_version(),
    'devices': '8 virtual CPU devices (XLA_FLAGS)',
    'versions': versions,
  }


def run(groups, repeat, repo, timeout, label):
  results = []
  for group, cases in groups.items():
    for case, params, methods in cases:
      entry = {'group': group, 'case': case, 'params': params, 'methods': {}}
      for role, method in methods.items():
        runs = [
          _measure(case, method, params, repo, timeout) for _ in range(repeat)
        ]
        entry['methods'][role] = {'method': method} | _summary(runs)
        _print_line(group, params, role, entry['methods'][role])
      ours = entry['methods'].get('ours', {}).get('seconds', {}).get('median')
      for role in ('peer', 'limit'):
        theirs = entry['methods'].get(role, {}).get('seconds', {}).get('median')
        if ours and theirs:
          entry[f'time_vs_{role}'] = ours / theirs
      results.append(entry)
  return {
    'label': label,
    'date': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
    'repeat': repeat,
    'machine': _machine(),
    'results': results,
  }


def _print_line(group, params, role, summary):
  if 'error' in summary:
    print(
      f'{group:<13} {json.dumps(params):<34} {role:<11} ERROR {summary["error"]}'
    )
    return
  s = summary['seconds']
  mem = summary['rss_above_baseline_mib']['median']
  print(
    f'{group:<13} {json.dumps(params):<34} {role:<11} {summary["method"]:<20} '
    f'{s["min"]:8.2f} {s["median"]:8.2f} {s["max"]:8.2f} s  '
    f'+{mem:7.0f} MiB',
    flush=True,
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--only', help='Comma-separated groups (default: all).')
  parser.add_argument('--repeat', type=int, default=3)
  parser.add_argument('--quick', action='store_true')
  parser.add_argument('--repo', default=str(REPO))
  parser.add_argument('--label', default='current')
  parser.add_argument('--timeout', type=float, default=3600)
  parser.add_argument('--out', default=str(HERE / 'results.json'))
  args = parser.parse_args()
  groups = QUICK if args.quick else FULL
  if args.only:
    groups = {k: v for k, v in groups.items() if k in args.only.split(',')}
  repeat = 1 if args.quick else args.repeat
  print(
    f'{"group":<13} {"params":<34} {"role":<11} {"method":<20} '
    f'{"min":>8} {"median":>8} {"max":>8}     peak RSS above baseline'
  )
  report = run(groups, repeat, args.repo, args.timeout, args.label)
  out = pathlib.Path(args.out)
  previous = json.loads(out.read_text()) if out.exists() else {}
  previous[args.label] = report
  out.write_text(json.dumps(previous, indent=1) + '\n')
  print(f'wrote {out} ({args.label})')


if __name__ == '__main__':
  main()
