"""Where flax_dtensor's own messages and progress bars go.

`stream()` is ``sys.stderr`` unless a caller routes our output elsewhere
with `routed_to` (the command line does, so that its stderr holds only our
own messages while other libraries' output goes to a log). `progress` is
the one progress bar of the package, `step` the one spinner (a phase of
work with no count, such as a write). `warn` issues our warnings at the
user's line, past every frame of this package and the libraries it calls.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
  import rich.console

_lock = threading.Lock()
_stream: TextIO | None = None


def stream() -> TextIO:
  """The stream our messages and progress bars are written to."""
  return _stream if _stream is not None else sys.stderr


def say(line: str) -> None:
  """Writes one line of ours to `stream()` in one write, then flushes.

  One write, not `print`'s two (the text, then its newline): another
  thread's output (a library printing a traceback as it fails) cannot
  land inside the line, nor glue itself to its end.
  """
  out = stream()
  out.write(f'{line}\n')
  out.flush()


def route(target: TextIO | None) -> TextIO | None:
  """Sends our messages to `target` (None: sys.stderr); returns the old."""
  global _stream
  with _lock:
    old, _stream = _stream, target
  return old


@contextlib.contextmanager
def routed_to(target: TextIO) -> Iterator[None]:
  """Sends our messages and progress bars to `target` within the block."""
  old = route(target)
  try:
    yield
  finally:
    route(old)


@contextlib.contextmanager
def progress(
  *, show: bool, total: int, description: str, unit: str = ''
) -> Iterator[Callable[..., None]]:
  """Yields ``advance(n=1)`` for a progress bar (a no-op when not shown).

  Drawn with rich on `stream()`: live and removed when done on a
  terminal, otherwise printed once, finished (e.g. into a log).
  """
  if not show:
    yield lambda n=1: None
    return
  import rich.console
  import rich.progress

  console = rich.console.Console(file=stream())
  columns = [
    rich.progress.TextColumn('{task.description}'),
    rich.progress.BarColumn(),
    rich.progress.MofNCompleteColumn(),
  ]
  if unit:
    columns.append(rich.progress.TextColumn(unit))
  columns.append(rich.progress.TimeElapsedColumn())
  with rich.progress.Progress(
    *columns, console=console, transient=console.is_terminal
  ) as bar:
    task = bar.add_task(description, total=total)
    yield lambda n=1: bar.advance(task, n)


def announce(show: bool, message: str) -> None:
  """Prints 'flax_dtensor: MESSAGE' on `stream()` when `show`."""
  if show:
    print(f'flax_dtensor: {message}', file=stream(), flush=True)


# Packages whose frames are never the user's line: this one, and the
# libraries whose code runs between the user's call and our warning.
_LIBRARIES = ('flax_dtensor', 'flax', 'jax', 'jaxlib', 'optax')


def library_prefixes() -> tuple[str, ...]:
  """The directories of `_LIBRARIES` imported so far, each ending in a
  separator (``.../site-packages/flax/``)."""
  out = []
  for name in _LIBRARIES:
    module = sys.modules.get(name)
    path = getattr(module, '__file__', None)
    if path:
      out.append(os.path.dirname(os.path.abspath(path)) + os.sep)
  return tuple(out)


def warn(message: str, category: type[Warning]) -> None:
  """Warns `message` at the first frame outside this package and the
  libraries it runs under (Flax's module construction, JAX's tracing): the
  user's line that caused it, whatever depth it was found at.

  Python 3.12 skips those frames itself (``skip_file_prefixes``); before,
  the stack level is counted here.
  """
  prefixes = library_prefixes()
  if sys.version_info >= (3, 12):
    warnings.warn(message, category, skip_file_prefixes=prefixes)
    return
  frame = sys._getframe(1)
  level = 2  # The frame that called `warn`.
  while frame.f_back is not None and frame.f_code.co_filename.startswith(
    prefixes
  ):
    frame = frame.f_back
    level += 1
  warnings.warn(message, category, stacklevel=level)


@contextlib.contextmanager
def step(
  description: str, *, show: bool, console: rich.console.Console | None = None
) -> Iterator[None]:
  """Shows that `description` (a phase of work, e.g. a write) is under way.

  On a terminal, a spinner with the seconds elapsed, removed when the block
  ends; piped (a log, CI), one line ``DESCRIPTION…`` as it starts, nothing
  animated; with `show` false, nothing. Written on `console` (default:
  `stream()`).
  """
  if not show:
    yield
    return
  import rich.console
  import rich.progress

  console = console or rich.console.Console(file=stream())
  if not console.is_terminal:
    console.print(f'{description}…', highlight=False, markup=False)
    yield
    return
  with rich.progress.Progress(
    rich.progress.SpinnerColumn(),
    rich.progress.TextColumn('{task.description}'),
    rich.progress.TimeElapsedColumn(),
    console=console,
    transient=True,
  ) as bar:
    bar.add_task(description, total=None)
    yield
