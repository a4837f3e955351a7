"""Text every printed view of the package shares, at the bottom of it.

Sizes in IEC units (`human_bytes`), counts with their noun (`count`), paths
broken only after a ``/`` (`wrap_path`), the terminal's width, and a table
that turns into short stacked lines when it does not fit
(`table_or_stacked`). The plan's views, the bridge's messages and the
command line all import these; none of them imports another's.
"""

from __future__ import annotations

import io
import re
import shutil
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import rich.console
import rich.padding
import rich.table
import rich.text


def human_bytes(n: float) -> str:
  """'1.5 MiB' for 1572864 (IEC units, everywhere in this package)."""
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
    if abs(n) < 1024 or unit == 'TiB':
      return f'{n:.0f} {unit}' if unit == 'B' else f'{n:.1f} {unit}'
    n /= 1024
  raise AssertionError('unreachable')


def exact_bytes(n: int) -> str:
  """'1.5 GiB (1610612736 bytes)', or '80 bytes': a size and its count."""
  return f'{n} bytes' if n < 1024 else f'{human_bytes(n)} ({n} bytes)'


def count(n: int, noun: str) -> str:
  """'1 device', '8 devices' (`noun` is singular and takes an 's')."""
  return f'{n} {noun}' + ('' if n == 1 else 's')


def wrap_path(path: str, width: int) -> list[str]:
  """`path` in lines of at most `width` columns, broken only after a '/'.

  A component longer than `width` keeps its own line, whole: a path is
  never cut inside a name.
  """
  lines = ['']
  for part in re.findall(r'[^/]*/|[^/]+$', path):
    if lines[-1] and len(lines[-1]) + len(part) > width:
      lines.append('')
    lines[-1] += part
  return lines


def terminal_width(default: int = 80) -> int:
  """The terminal's width, or ``COLUMNS``, or `default` when piped."""
  return shutil.get_terminal_size((default, 24)).columns


def table_or_stacked(
  columns: Sequence[str],
  rows: Iterable[Sequence[str]],
  width: int,
  *,
  paths: Sequence[str] = (),
  right: Sequence[str] = (),
  details: Callable[[Sequence[str]], list[str]] | None = None,
) -> Any:
  """A table of `rows` when it fits `width` unwrapped; else short lines.

  Nothing is cut, or folded inside a word: in the stacked form each row's
  first cell heads it on a line of its own, and each other cell follows on
  its own line, labelled with its column (or the lines `details` makes of
  the row). Cells of the `paths` columns are broken only after a '/'
  (`wrap_path`); a cell holding several lines keeps them. `right` columns
  are right-justified in the table.
  """
  rows = [list(row) for row in rows]
  table = rich.table.Table()
  for column in columns:
    table.add_column(
      column, no_wrap=True, justify='right' if column in right else 'left'
    )
  for row in rows:
    table.add_row(*(rich.text.Text(c) for c in row))
  if measure(table) <= width:
    return table
  label = max((len(c) for c in columns[1:]), default=0) + 2
  items: list[Any] = []
  for row in rows:
    head = row[0]
    for line in wrap_path(head, width) if columns[0] in paths else [head]:
      items.append(rich.text.Text(line, style='bold'))
    if details is not None:
      items.extend(
        rich.padding.Padding(rich.text.Text(line), (0, 0, 0, 2), expand=False)
        for line in details(row)
      )
      continue
    for column, cell in zip(columns[1:], row[1:], strict=True):
      if not cell:
        continue
      if column in paths:
        lines = wrap_path(cell, max(width - 2 - label, 1))
      else:
        lines = cell.split('\n')
      for i, line in enumerate(lines):
        text = (column if i == 0 else '').ljust(label) + line
        items.append(
          rich.padding.Padding(rich.text.Text(text), (0, 0, 0, 2), expand=False)
        )
  return rich.console.Group(*items)


def console(file: io.StringIO, width: int) -> rich.console.Console:
  """A console writing plain text to `file` (never to Jupyter's display)."""
  return rich.console.Console(
    file=file,
    width=width,
    color_system=None,
    force_terminal=False,
    force_jupyter=False,
    legacy_windows=False,
  )


def measure(renderable: Any) -> int:
  """The columns `renderable` needs to print without wrapping."""
  return console(io.StringIO(), 100_000).measure(renderable).maximum
