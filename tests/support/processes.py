"""Fresh processes started by the tests: one environment policy, one runner.

`clean_env()` is the environment of every process a test starts: this
process's (conftest.py's 8 CPU devices included), without a `DTENSOR_*`
variable (a DTensor client's setup, left by an in-process `initialize()`,
must not leak into another process) or a `FDT_MP_*` one (multiprocess_util's
worker setup), on the CPU backend, with the repository first on PYTHONPATH.
`reader_env()` is a reader's: none of the suite's device settings either.

`run_python(*args)` runs `python ARGS` in such a process: text, captured,
stdin closed, always bounded by a timeout; it returns the CompletedProcess
and leaves checking the exit status to the test. `run(argv)` does the same
for another program (TensorFlow's `saved_model_cli`, `unshare`).

A script reports to the test with one line, `print(RESULT + json.dumps(x))`;
`result(stdout)` reads it back. A reader's script that must prove it needs
no JAX starts with `NO_JAX`.

Long-lived processes a test talks to (multiprocess_util's workers, the
zygote of kill_test.py) keep `subprocess.Popen`, with `env=clean_env(...)`.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
SUPPORT_DIR = pathlib.Path(__file__).resolve().parent
WORKERS_DIR = SUPPORT_DIR / 'workers'

# Variables no started process inherits: DTensor's client setup and the
# multi-process workers' own.
DROPPED_PREFIXES = ('DTENSOR_', 'FDT_MP_')
# The suite's device settings (conftest.py), which a reader does not have.
SUITE_SETTINGS = ('XLA_FLAGS', 'JAX_PLATFORMS', 'TF_CPP_MIN_LOG_LEVEL')

TIMEOUT = 300

# What a script prints before the JSON it reports.
RESULT = 'RESULT '
# The first lines of a plain-TensorFlow reader's script: importing JAX fails
# (TF imports it when it can), so the script proves it needs none.
NO_JAX = """\
import sys
sys.modules['jax'] = None
sys.modules['jaxlib'] = None
"""


def clean_env(
  *, support: bool = False, **overrides: str | None
) -> dict[str, str]:
  """The environment of a process a test starts.

  Args:
    support: Put tests/ on PYTHONPATH too (after the repository), so the
      process imports the helpers as the package ``support``, as the tests
      do.
    **overrides: Variables to set; None removes one.
  """
  env = {
    k: v for k, v in os.environ.items() if not k.startswith(DROPPED_PREFIXES)
  }
  env['JAX_PLATFORMS'] = 'cpu'
  env['PYTHONPATH'] = os.pathsep.join(
    [str(REPO_ROOT)]
    + ([str(SUPPORT_DIR.parent)] if support else [])
    + [p for p in [os.environ.get('PYTHONPATH')] if p]
  )
  for key, value in overrides.items():
    if value is None:
      env.pop(key, None)
    else:
      env[key] = value
  return env


def reader_env(**overrides: str | None) -> dict[str, str]:
  """A reader's environment: `clean_env` without the suite's settings."""
  return clean_env(**{**dict.fromkeys(SUITE_SETTINGS), **overrides})


def run(
  argv: Sequence[str | os.PathLike[str]],
  *,
  cwd: str | os.PathLike[str] | None = None,
  env: dict[str, str] | None = None,
  timeout: float = TIMEOUT,
  input: str | None = None,
) -> subprocess.CompletedProcess[str]:
  """Runs `argv` to its end (at most `timeout` seconds: else TimeoutExpired).

  The environment is `env` as given, or `clean_env()`; stdout and stderr are
  captured as text; stdin is `input`, or closed.
  """
  return subprocess.run(
    [str(a) for a in argv],
    cwd=cwd,
    env=clean_env() if env is None else env,
    input=input,
    stdin=subprocess.DEVNULL if input is None else None,
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )


def run_python(
  *args: str | os.PathLike[str],
  cwd: str | os.PathLike[str] | None = None,
  env: dict[str, str] | None = None,
  timeout: float = TIMEOUT,
  input: str | None = None,
) -> subprocess.CompletedProcess[str]:
  """Runs `python ARGS` (a script and its arguments, `-c CODE`, `-m NAME`).

  As `run`: in `env` or `clean_env()`, captured, bounded by `timeout`.
  """
  return run(
    [sys.executable, *args], cwd=cwd, env=env, timeout=timeout, input=input
  )


def result(stdout: str, *, merge: bool = False, context: str = '') -> Any:
  """The JSON a script reported: its last `RESULT` line's.

  Args:
    stdout: What the script printed.
    merge: Merge the dicts of every `RESULT` line instead (later keys win).
    context: Added to the error (the exit status, stderr), if there is none.

  Raises:
    RuntimeError: The script reported nothing; the message has its output.
  """
  found = [
    json.loads(line[len(RESULT) :])
    for line in stdout.splitlines()
    if line.startswith(RESULT)
  ]
  if not found:
    raise RuntimeError(
      f'no {RESULT.strip()} line in:\n{stdout[-5000:]}\n{context}'
    )
  if not merge:
    return found[-1]
  merged: dict[str, Any] = {}
  for part in found:
    merged.update(part)
  return merged


def checked_result(proc: subprocess.CompletedProcess[str]) -> Any:
  """`result(proc.stdout)`, if the process exited with 0; else RuntimeError."""
  context = f'exit {proc.returncode}; stderr:\n{proc.stderr[-5000:]}'
  if proc.returncode != 0:
    raise RuntimeError(f'{context}\nstdout:\n{proc.stdout[-3000:]}')
  return result(proc.stdout, context=context)
