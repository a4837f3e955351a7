"""One measurement, in a fresh process: ``python measure.py CASE METHOD ARGS``.

Prints one JSON line: wall seconds of the measured step, and the process's
peak RSS from the OS (``resource.getrusage``) before the step (the runtime's
baseline: Python, JAX, the backend, TF where used) and after it. `run.py`
calls it (`harness.measure`); each case, in its group's module under
`groups/`, compares flax_dtensor with its peer and with the machine's limit,
measured the same way.

``python measure.py --jobs JOBS`` runs several measurements in this one
process instead (``run.py --one-process``, `harness.measure_in_one`): JOBS
is a JSON list of ``[CASE, METHOD, ARGS]``, and each one's result (or its
error) is printed on a line of its own, after `JOB`, in their order.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
import warnings

os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
warnings.simplefilter('ignore')

import groups  # noqa: E402  (after the environment above)

# What each of `--jobs`' results is printed after.
JOB = 'JOB '


def _jobs(jobs: list) -> None:
  for case, method, params in jobs:
    try:
      result = groups.CASES[case](method, **params)
    except Exception as e:  # One job's failure is its result, not the run's.
      traceback.print_exc()
      result = {'error': f'{type(e).__name__}: {e}'[:300]}
    print(JOB + json.dumps(result), flush=True)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--jobs', help='JSON list of [case, method, params]')
  parser.add_argument('case', nargs='?', choices=sorted(groups.CASES))
  parser.add_argument('method', nargs='?')
  parser.add_argument('params', nargs='?', help='JSON object of arguments')
  args = parser.parse_args()
  if args.jobs is not None:
    _jobs(json.loads(args.jobs))
    return
  if args.params is None:
    parser.error('expected CASE METHOD PARAMS, or --jobs')
  result = groups.CASES[args.case](args.method, **json.loads(args.params))
  print(json.dumps(result))


if __name__ == '__main__':
  main()
