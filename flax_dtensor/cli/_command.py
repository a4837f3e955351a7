"""What every command shares: its console, its errors, its exit statuses.

`handle_errors` wraps a command's body and maps what ends it to the exit
statuses of docs/cli.md: 0 ok, 1 findings or differences (`EXIT_FINDINGS`,
like ``diff``), 2 bad input (our own errors and `BadInputError`: one
``error:`` line), 3 an unexpected failure (a bug: where to report it).
Other libraries' output on stderr goes to a log (`_own_messages_only`)
unless ``--debug`` is given. Nothing here imports JAX, and rich only when a
console is asked for, so that ``--help`` answers at once.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import pathlib
import shutil
import sys
import tempfile
import traceback
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any, TextIO

import typer

if TYPE_CHECKING:
  import rich.console

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_BAD_INPUT = 2
EXIT_FAILURE = 3
DEBUG_HELP = 'Show the traceback of an error.'
# Every command's --debug, declared once.
DebugOption = Annotated[bool, typer.Option('--debug', help=DEBUG_HELP)]
REPORT_MSG = (
  'This is a bug in flax-dtensor or a library it uses: please report it '
  'with the output of the same command run with --debug, and of '
  '`flax-dtensor --version`.'
)


class BadInputError(Exception):
  """Bad command-line input: exit status 2 and a one-line message."""


class _TrimmedLines(io.TextIOBase):
  """Writes to `target` without the spaces rich pads lines with."""

  def __init__(self, target: TextIO):
    self._target = target
    self._pending = ''

  def write(self, text: str) -> int:
    lines = (self._pending + text).split('\n')
    self._pending = lines.pop()
    if lines:
      self._target.write(''.join(line.rstrip() + '\n' for line in lines))
    return len(text)

  def flush(self) -> None:
    if self._pending:  # A line still being written: as it is, so far.
      self._target.write(self._pending)
      self._pending = ''
    self._target.flush()

  def isatty(self) -> bool:
    return False


def console(*, stderr: bool = False) -> rich.console.Console:
  """A console on stdout (or our stderr stream).

  On a terminal it is rich's own. Piped or captured, it is COLUMNS wide if
  set, else 80 (never a guess), and its lines carry no trailing spaces.
  """
  import rich.console

  from flax_dtensor import _output

  file = _output.stream() if stderr else sys.stdout
  out = rich.console.Console(file=file)
  if not out.is_terminal:
    out = rich.console.Console(
      file=_TrimmedLines(file), width=shutil.get_terminal_size((80, 24)).columns
    )
  return out


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
  from flax_dtensor import _output

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


_INSTALL_EXTRA = 'pip install "flax-dtensor['


def _message(e: BaseException) -> tuple[str, int]:
  """The ``error:`` line's text and the exit status for `e`."""
  from flax_dtensor import _errors

  if isinstance(e, BadInputError):
    return str(e), EXIT_BAD_INPUT
  if isinstance(e, _errors.UnknownLogicalAxisError):
    # The command line's fix, not the Python one.
    rules = ', '.join(f'[{n!r}, null]' for n in e.names)
    return (
      f'{e.problem} Add a rule for each to the rules file (--rules), e.g. '
      f'{rules} to replicate, or a mesh axis to shard over; if the names '
      'are mesh axes already (as some libraries annotate), pass '
      '--mesh-axis-names.',
      EXIT_BAD_INPUT,
    )
  if isinstance(e, _errors.FlaxDTensorError):
    return str(e), EXIT_BAD_INPUT
  if isinstance(e, ImportError) and _INSTALL_EXTRA in str(e):
    # An optional extra the user has not installed (`_tf.INSTALL_HINT`):
    # theirs to install. Nothing more is imported on this path, which may
    # run where the interpreter can import nothing new.
    return str(e), EXIT_BAD_INPUT
  text = str(e).strip() or 'no message'
  return f'unexpected failure: {text}', EXIT_FAILURE


@contextlib.contextmanager
def handle_errors(debug: bool) -> Iterator[None]:
  """Turns exceptions into one-line messages and exit statuses.

  Also keeps other libraries' output off stderr (see `_own_messages_only`).
  The class of an exception shows only in the traceback of ``--debug``.
  """
  from flax_dtensor import _interrupts, _output

  with _own_messages_only(debug) as log:
    keep_log = False
    try:
      yield
    except (typer.Exit, typer.Abort):
      raise
    except KeyboardInterrupt:
      _interrupts.acknowledge()
      _interrupts.say_interrupted()
      raise typer.Exit(_interrupts.status()) from None
    except Exception as e:
      if _interrupts.received() is not None:
        # A failure the signal caused (a child process it stopped first).
        _interrupts.acknowledge()
        _interrupts.say_interrupted()
        raise typer.Exit(_interrupts.status()) from None
      message, status = _message(e)
      if status == EXIT_FAILURE:
        message = f'{message.rstrip(".")}. {REPORT_MSG}'
        if log is not None:
          keep_log = True
          message += f" Other libraries' output is in {log}."
      if debug:
        traceback.print_exc()
      _output.say(f'error: {one_line(message)}')
      raise typer.Exit(status) from None
    finally:
      if log is not None and not keep_log:
        atexit.register(_remove, log)
        _interrupts.on_exit_now(lambda: _remove(log))


@contextlib.contextmanager
def user_prints_to_stderr(when: bool) -> Iterator[None]:
  """Within the block, `when` true, what Python code prints goes to stderr.

  For the user's code (importing TARGET, calling its factory) while stdout
  carries data a program parses (``--json``): a module that prints when
  imported leaves that output whole. Our stderr stream (`_output.stream`)
  receives it, so it is seen, not sent to the log. Writes to file
  descriptor 1 from C are not caught.
  """
  if not when:
    yield
    return
  from flax_dtensor import _output

  sys.stdout.flush()
  with contextlib.redirect_stdout(_output.stream()):
    yield


def _remove(path: str) -> None:
  with contextlib.suppress(OSError):
    os.remove(path)


def disk_usage(path: pathlib.Path) -> int:
  if path.is_file():
    return path.stat().st_size
  return sum(p.stat().st_size for p in path.rglob('*') if p.is_file())


def exit_findings(found: Any) -> None:
  """Exits with `EXIT_FINDINGS` when `found` (a report or diff) is true."""
  if found:
    raise typer.Exit(EXIT_FINDINGS)
