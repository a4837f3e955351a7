"""The command line's start-up, each command a fresh process timed from
outside, against the bare interpreter and a process that only imports JAX
and Flax (group `cli`).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import harness

# What each method runs, in a fresh process: the CLI, and its peers (the
# interpreter alone; what a command line importing JAX and Flax at start-up
# could not go below).
_COMMANDS = {
  'python': ['-c', 'pass'],
  'import_jax_flax': ['-c', 'import jax, flax.nnx'],
  'help': ['-m', 'flax_dtensor', '--help'],
  'version': ['-m', 'flax_dtensor', '--version'],
  'plan_help': ['-m', 'flax_dtensor', 'plan', '--help'],
  'inspect': ['-m', 'flax_dtensor', 'inspect', '{export}'],
}
# Top-level packages that would show a command paying for more than it
# needs, as `python -X importtime` lists them.
_HEAVY = ('jax', 'jaxlib', 'flax', 'tensorflow', 'numpy', 'optax', 'orbax')


_DEMO_EXPORT = """
import os, sys
import jax
jax.config.update('jax_num_cpu_devices', 8)
import flax_dtensor as fdt
from flax_dtensor import dtensor as fdt_tf
from flax_dtensor.demo import model, train
fdt_tf.initialize()
import tensorflow as tf
auto = (jax.sharding.AxisType.Auto,) * 2
mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=auto)
with jax.set_mesh(mesh), fdt.logical_axis_rules(train.default_rules()):
  lm = model.make_model()
fdt_tf.save_checkpoint(lm, os.path.join(sys.argv[1], 'checkpoint'))
fdt_tf.save_saved_model(lm, os.path.join(sys.argv[1], 'saved_model'),
    input_signature=[tf.TensorSpec([None, 128], tf.int32, name='tokens')])
"""


def _demo_export(root: str) -> str:
  """The demo model's export (checkpoint and SavedModel), as the demo
  writes it, in a fresh directory under `root`. Written by another process:
  this one stays as small as a shell, so the measured child's peak RSS is
  its own."""
  import subprocess

  out = tempfile.mkdtemp(prefix='fdt_bench_cli_', dir=root)
  subprocess.run(
    [sys.executable, '-c', _DEMO_EXPORT, out],
    check=True,
    capture_output=True,
    timeout=600,
  )
  return out


def cli(method: str) -> dict:
  """Wall seconds of one command in a fresh process (the machine's own
  start-up included, as a user waits for it), its peak RSS, and, from a
  second run under ``python -X importtime``, the seconds spent importing
  and which heavy packages it imported."""
  import subprocess

  args = list(_COMMANDS[method])
  export = None
  if '{export}' in args:
    export = _demo_export(os.environ.get('BENCH_DIR') or tempfile.gettempdir())
    args = [a.replace('{export}', export) for a in args]
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  env['COLUMNS'] = '80'
  # Elsewhere than a checkout, so that `-m flax_dtensor` is the one on
  # PYTHONPATH (run.py --repo), not one in the current directory.
  cwd = tempfile.mkdtemp(prefix='fdt_bench_cwd_')
  with tempfile.TemporaryFile() as err:
    start = time.perf_counter()
    proc = subprocess.Popen(
      [sys.executable, *args],
      stdout=subprocess.DEVNULL,
      stderr=err,
      env=env,
      cwd=cwd,
    )
    _, status, usage = os.wait4(proc.pid, 0)  # This child's own peak RSS.
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
      err.seek(0)
      raise RuntimeError(err.read().decode()[-500:])
  peak = usage.ru_maxrss / 1024
  traced = subprocess.run(
    [sys.executable, '-X', 'importtime', *args],
    capture_output=True,
    env=env,
    cwd=cwd,
    timeout=600,
    check=False,
  )
  import_us, heavy = 0, set()
  for line in traced.stderr.decode().splitlines():
    # "import time: self [us] | cumulative | imported package"
    parts = line.split('|')
    if len(parts) != 3 or not line.startswith('import time:'):
      continue
    name = parts[2].rstrip()
    if name == name.lstrip() or not parts[1].strip().isdigit():
      continue
    if len(name) - len(name.lstrip()) == 1:  # A top-level import.
      import_us += int(parts[1])
    if name.strip().split('.')[0] in _HEAVY:
      heavy.add(name.strip().split('.')[0])
  if export is not None:
    shutil.rmtree(export, ignore_errors=True)
  shutil.rmtree(cwd, ignore_errors=True)
  return {
    'seconds': seconds,
    'rss_before_mib': 0.0,
    'rss_peak_mib': peak,
    'import_seconds': import_us / 1e6,
    'heavy_imports': sorted(heavy),
  }


# The command line: each command in a fresh process, against the bare
# interpreter (the floor) and a process that only imports JAX and Flax (what
# a command line importing them at start-up could not go below).
_CLI_CASE = harness.case(
  'cli',
  {},
  {
    'help': 'help',
    'version': 'version',
    'plan_help': 'plan_help',
    'inspect': 'inspect',
    'floor': 'python',
    'peer': 'import_jax_flax',
  },
  [('help', 'floor'), ('help', 'peer'), ('inspect', 'peer')],
  repeat=5,
  note='`flax-dtensor --help`, `--version`, `plan --help`, and `inspect` of '
  "the demo's export (checkpoint and SavedModel), COLUMNS=80",
)


CASES = {'cli': cli}


def full():
  return {'cli': [_CLI_CASE]}


def quick():
  return {'cli': [_CLI_CASE]}
