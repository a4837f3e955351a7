"""What the CLI tests share: running a command, reading its output, and the
checkpoints they export from (the user model's built in `user_placement`).
"""

from __future__ import annotations

import contextlib
import json
import pathlib

import numpy as np
from flax import nnx

import flax_dtensor.dtensor as fdt_tf
from flax_dtensor.cli import _loading
from support import output_util

SUPPORT_DIR = pathlib.Path(__file__).resolve().parent
DEMO_TARGET = 'flax_dtensor.demo.model:make_model'
TIMEOUT = 300


def clean_env(**overrides: str | None) -> dict[str, str]:
  """`processes.clean_env`: the environment of a process a test starts."""
  from support import processes

  return processes.clean_env(**overrides)


def run_cli(*args: str, env: dict[str, str | None] | None = None):
  """Runs `flax-dtensor ARGS` in this process (`cli_runner.run`).

  Piped, the CLI prints at COLUMNS (80 when unset); unless `env` says
  otherwise, 200 columns keep one table row per line to parse.
  """
  from support import cli_runner

  return cli_runner.run(*args, env={'COLUMNS': '200', **(env or {})})


def run_cli_process(*args: str, env: dict[str, str] | None = None):
  """Runs `python -m flax_dtensor ARGS`; returns the CompletedProcess."""
  from support import processes

  if env is None:
    env = clean_env(COLUMNS='200')
  return processes.run_python(
    '-m', 'flax_dtensor', *args, env=env, timeout=TIMEOUT
  )


def ok(proc) -> str:
  assert proc.returncode == 0, (
    f'exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}'
  )
  return proc.stdout


def assert_fits(text: str, width: int, paths=()) -> None:

  output_util.assert_fits(text, width, paths)


def bad_input(proc, *fragments: str) -> str:
  """Asserts exit status 2, one `error:` line naming `fragments`.

  Only our own line is looked at: what other libraries print is not ours.
  """
  assert proc.returncode == 2, (
    f'exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}'
  )
  assert 'Traceback' not in proc.stderr, proc.stderr
  errors = [
    line for line in proc.stderr.splitlines() if line.startswith('error')
  ]
  assert len(errors) == 1, proc.stderr
  (line,) = errors
  assert line.startswith('error: '), line
  for fragment in fragments:
    assert fragment in line, (fragment, line)
  return line


def run_python(script: str, *args: str, timeout: float = TIMEOUT) -> str:
  from support import processes

  proc = processes.run_python('-c', script, *args, timeout=timeout)
  assert proc.returncode == 0, proc.stderr
  return proc.stdout


@contextlib.contextmanager
def user_placement():
  """Where the user model is built: on an (8,) 'data' mesh, 'features'
  sharded over it."""
  import jax

  import flax_dtensor as fdt

  mesh = jax.make_mesh((8,), ('data',))
  with (
    jax.set_mesh(mesh),
    fdt.logical_axis_rules(
      [('features', 'data'), ('hidden', None), ('classes', None)]
    ),
  ):
    yield


def make_checkpoint(
  target: str, tmp: pathlib.Path
) -> tuple[pathlib.Path, dict]:
  """An Orbax checkpoint of nnx.state(TARGET()) in `tmp`, and its values.

  The values (and, for the demo model, logits on fixed tokens) are also
  kept in an .npz file. The user model is built sharded on a (8,) mesh, so
  `export` restores it onto another layout.
  """
  import orbax.checkpoint as ocp

  factory = _loading.load_target(target)
  if target.endswith('make_model'):
    model = factory()
  else:
    with user_placement():
      model = factory()
  state = nnx.state(model)
  path = tmp / 'orbax'
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, state)
    checkpointer.wait_until_finished()
  arrays = {
    '/'.join(map(str, k)): np.asarray(v.get_value())
    for k, v in nnx.to_flat_state(state)
  }
  if target.endswith('make_model'):
    tokens = (np.arange(2 * 128).reshape(2, 128) * 7 % 256).astype(np.int32)
    arrays['__tokens__'] = tokens
    arrays['__logits__'] = np.asarray(model(tokens))
  np.savez(
    tmp / 'expected.npz', **{k.replace('/', '|'): v for k, v in arrays.items()}
  )
  return path, arrays


def check_checkpoint(directory: pathlib.Path, expected: dict) -> dict:
  """A DTensor checkpoint read with TensorFlow, against `expected` values."""
  saved = {
    '/'.join(map(str, k)): v
    for k, v in fdt_tf.read_checkpoint(directory).items()
  }
  expected = {k: v for k, v in expected.items() if not k.startswith('__')}
  manifest = json.loads((directory / 'flax_dtensor.json').read_text())
  return {
    'missing': sorted(set(expected) - set(saved)),
    'extra': sorted(set(saved) - set(expected)),
    'max_abs_diff': max(
      float(np.max(np.abs(saved[k] - v)))
      for k, v in expected.items()
      if k in saved
    ),
    'layouts': {
      '/'.join(map(str, v['path'])): v['sharding']
      for v in manifest['variables']
    },
  }


# Runs the CLI's `main` in a fresh process for each argv (after `setup`);
# prints [[exit status, stdout] per argv, `report` evaluated at the end].
IN_PROCESS = """
import contextlib, io, json, os, sys
SETUP
from flax_dtensor.cli import _app
results = []
for argv in json.loads(sys.argv[1]):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    try:
      _app.main(argv)
    except SystemExit as e:
      results.append([e.code, out.getvalue()])
print(json.dumps([results, REPORT]))
"""


# JAX, Flax, NumPy and TensorFlow made unimportable: any import of them fails.
NO_HEAVY_LIBRARIES = """
for name in ('jax', 'flax', 'numpy', 'tensorflow', 'optax', 'orbax'):
  sys.modules[name] = None
"""


def _cli_in_process(*argvs, setup='', report='None'):
  """([(exit status, stdout)] per argv, the value of `report`)."""
  script = IN_PROCESS.replace('SETUP', setup).replace('REPORT', report)
  out = run_python(script, json.dumps(argvs))
  results, reported = json.loads(out.splitlines()[-1])
  return [tuple(r) for r in results], reported


def _without_heavy_libraries(*argvs):
  return _cli_in_process(*argvs, setup=NO_HEAVY_LIBRARIES)[0]
