"""The `flax-dtensor` command line run in this process, as a shell sees it.

`run(*args)` calls `flax_dtensor.cli.main` (the entry point itself) and
returns what a shell would get from ``python -m flax_dtensor ARGS``: the
exit status, and what reached file descriptors 1 and 2. Click's and Typer's
`CliRunner` swap only `sys.stdout` and `sys.stderr`, but the command line
works at the level of file descriptors (it moves other libraries' output
off descriptor 2 into a log, and prints its own messages on a duplicate of
it), so this runner points descriptors 1 and 2 at files for the call and
reads them back.

Around the call, the process looks like a user's: the environment is this
one with `env` applied (None removes a variable) and restored afterwards
(a command may set ``XLA_FLAGS``), Python's warnings are shown rather than
raised (pytest's ``error`` filter is the suite's, not a user's), and the
command line's routing of our messages is undone.

What it cannot show, because this process already imported JAX and
TensorFlow: what a command imports (``--help`` without JAX), what a
library prints when it is first imported or when the process exits, and
device counts other than the suite's 8. Tests of those start a process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator, Mapping


@dataclasses.dataclass(frozen=True)
class Result:
  """As `subprocess.CompletedProcess`: the exit status and the output."""

  returncode: int
  stdout: str
  stderr: str


@contextlib.contextmanager
def _environment(env: Mapping[str, str | None]) -> Iterator[None]:
  saved = dict(os.environ)
  for key, value in env.items():
    if value is None:
      os.environ.pop(key, None)
    else:
      os.environ[key] = value
  try:
    yield
  finally:
    os.environ.clear()
    os.environ.update(saved)


@contextlib.contextmanager
def _descriptors_to_files() -> Iterator[tuple[io.BufferedRandom, ...]]:
  """Descriptors 1 and 2 (and sys.stdout, sys.stderr on them) to files."""
  sys.stdout.flush()
  sys.stderr.flush()
  saved_streams = sys.stdout, sys.stderr
  saved_fds = os.dup(1), os.dup(2)
  with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    streams = [
      open(fd, 'w', encoding='utf-8', errors='replace', closefd=False)
      for fd in (1, 2)
    ]
    sys.stdout, sys.stderr = streams
    try:
      yield out, err
    finally:
      for stream in streams:
        stream.flush()
        stream.close()
      sys.stdout, sys.stderr = saved_streams
      for fd, saved in zip((1, 2), saved_fds, strict=True):
        os.dup2(saved, fd)
        os.close(saved)


def _show_warning(message, category, filename, lineno, file=None, line=None):
  """As Python shows a warning: on sys.stderr (pytest records them)."""
  del file
  sys.stderr.write(
    warnings.formatwarning(message, category, filename, lineno, line)
  )


def _read(file: io.BufferedRandom) -> str:
  file.seek(0)
  return file.read().decode('utf-8', errors='replace')


def run(
  *args: str | os.PathLike[str], env: Mapping[str, str | None] | None = None
) -> Result:
  """Runs ``flax-dtensor ARGS`` here; returns its status and output.

  Args:
    *args: The command line's arguments.
    env: Environment variables for the call (e.g. ``COLUMNS``); None as a
      value removes one.
  """
  from flax_dtensor import _output, cli
  from flax_dtensor.cli import _command

  argv = [os.fspath(a) for a in args]
  code: object = 0
  with (
    _environment(env or {}),
    warnings.catch_warnings(),
    _descriptors_to_files() as (out, err),
  ):
    warnings.resetwarnings()
    warnings.simplefilter('default')
    warnings.showwarning = _show_warning
    try:
      try:
        cli.main(argv)
      except SystemExit as e:
        code = e.code
    finally:
      # `main` keeps other libraries' output captured until the process
      # exits; here the call is the process: undo it.
      _command.capture_until_exit = False
      own = _output.route(None)
      if own is not None:
        own.close()
    sys.stdout.flush()
    sys.stderr.flush()
    stdout, stderr = _read(out), _read(err)
  if code is None:
    code = 0
  elif not isinstance(code, int):  # sys.exit('message'): printed, status 1.
    stderr += f'{code}\n'
    code = 1
  return Result(code, stdout, stderr)
