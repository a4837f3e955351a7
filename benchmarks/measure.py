"""One measurement, in a fresh process: ``python measure.py CASE METHOD ARGS``.

Prints one JSON line: wall seconds of the measured step, and the process's
peak RSS from the OS (``resource.getrusage``) before the step (the runtime's
baseline: Python, JAX, the backend, TF where used) and after it. `run.py`
calls it (`harness.measure`); each case, in its group's module under
`groups/`, compares flax_dtensor with its peer and with the machine's limit,
measured the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
warnings.simplefilter('ignore')

import groups  # noqa: E402  (after the environment above)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('case', choices=sorted(groups.CASES))
  parser.add_argument('method')
  parser.add_argument('params', help='JSON object of keyword arguments')
  args = parser.parse_args()
  result = groups.CASES[args.case](args.method, **json.loads(args.params))
  print(json.dumps(result))


if __name__ == '__main__':
  main()
