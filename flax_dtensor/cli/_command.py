"""What every command shares: its console, its errors, its exit statuses.

`handle_errors` wraps a command's body: bad input (our own errors and
`BadInputError`) ends with exit status 2 and one ``error:`` line, anything
else with status 1; other libraries' output on stderr goes to a log
(`own_messages_only`) unless ``--debug`` is given.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pathlib
import shutil
import sys
import tempfile
import traceback
from collections.abc import Iterator

import rich.console
import typer

EXIT_BAD_INPUT = 2
EXIT_FAILURE = 1
DEBUG_HELP = 'Show the traceback of an error.'


class BadInputError(Exception):
  """Bad command-line input: exit status 2 and a one-line message."""


def console(*, stderr: bool = False) -> rich.console.Console:
  from flax_dtensor import _output  # pylint: disable=g-import-not-at-top

  file = _output.stream() if stderr else sys.stdout
  console = rich.console.Console(file=file)
  if not console.is_terminal:
    # Piped or captured: COLUMNS if set, else 80 (never a guess).
    console = rich.console.Console(
      file=file, width=shutil.get_terminal_size((80, 24)).columns
    )
  return console


def one_line(text: str) -> str:
  return ' '.join(str(text).split())


# Set by `main` (a real process): the capture of other libraries' output
# then lasts until the process exits, so that their exit-time logs are
# captured too.
capture_until_exit = False


@contextlib.contextmanager
def _own_messages_only(debug: bool) -> Iterator[str | None]:
  """Within the block, stderr holds only our own messages.

  Everything written to file descriptor 2 (TensorFlow's and XLA's C++
  logs, absl, Python warnings of other libraries) goes to a log file;
  flax_dtensor's messages and progress bars go to the real stderr. With
  `debug`, nothing is redirected.

  Yields:
    The log file's path, or None with `debug`.
  """
  from flax_dtensor import _output  # pylint: disable=g-import-not-at-top

  if debug:
    yield None
    return
  sys.stderr.flush()
  own = os.fdopen(
    os.dup(2), 'w', buffering=1, encoding='utf-8', errors='replace'
  )
  log = tempfile.NamedTemporaryFile(
    prefix='flax-dtensor-', suffix='.log', delete=False
  )
  os.dup2(log.fileno(), 2)
  log.close()
  previous = _output.route(own)
  try:
    yield log.name
  finally:
    own.flush()
    if not capture_until_exit:
      sys.stderr.flush()
      os.dup2(own.fileno(), 2)
      _output.route(previous)
      own.close()


@contextlib.contextmanager
def handle_errors(debug: bool) -> Iterator[None]:
  """Turns exceptions into one-line messages and exit statuses.

  Also keeps other libraries' output off stderr (see `_own_messages_only`).
  """
  from flax_dtensor import _output  # pylint: disable=g-import-not-at-top

  with _own_messages_only(debug) as log:
    keep_log = False
    try:
      yield
    except (typer.Exit, typer.Abort):
      raise
    except KeyboardInterrupt:
      print('interrupted', file=_output.stream(), flush=True)
      raise typer.Exit(130) from None
    except Exception as e:  # pylint: disable=broad-except
      from flax_dtensor import _errors  # pylint: disable=g-import-not-at-top

      if isinstance(e, BadInputError):
        message, status = str(e), EXIT_BAD_INPUT
      elif isinstance(e, _errors.UnknownLogicalAxisError):
        # The command line's fix, not the Python one.
        rules = ', '.join(f'[{n!r}, null]' for n in e.names)
        message = (
          f'{type(e).__name__}: {e.problem} Add a rule for each to the rules '
          f'file (--rules), e.g. {rules} to replicate, or a mesh axis to '
          'shard over.'
        )
        status = EXIT_BAD_INPUT
      elif isinstance(e, _errors.FlaxDTensorError):
        message, status = f'{type(e).__name__}: {e}', EXIT_BAD_INPUT
      else:
        message = f'{type(e).__name__}: {e}'
        if not debug:
          message += ' (rerun with --debug for the traceback'
          if log is not None:
            keep_log = True
            message += f"; other libraries' output is in {log}"
          message += ')'
        status = EXIT_FAILURE
      if debug:
        traceback.print_exc()
      print(f'error: {one_line(message)}', file=_output.stream(), flush=True)
      raise typer.Exit(status) from None
    finally:
      if log is not None and not keep_log:
        atexit.register(_remove, log)


def _remove(path: str) -> None:
  with contextlib.suppress(OSError):
    os.remove(path)


def human_bytes(n: float) -> str:
  from flax_dtensor import _plan_view  # pylint: disable=g-import-not-at-top

  return _plan_view.human_bytes(n)


def disk_usage(path: pathlib.Path) -> int:
  if path.is_file():
    return path.stat().st_size
  return sum(p.stat().st_size for p in path.rglob('*') if p.is_file())


# Parsing
# ------------------------------------------------------------------------------
