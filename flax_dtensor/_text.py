"""Text every printed view of the package shares, at the bottom of it.

Sizes in IEC units (`human_bytes`), counts with their noun (`count`), paths
broken only after a ``/`` (`wrap_path`, and in running text `wrap_words`),
lines broken only between their parts (`fill`, `hanging_lines`), paths
alike but for an integer as one pattern (`collapse_paths`), the terminal's
width, and a table that turns into short stacked lines when it does not
fit (`table_or_stacked`). The plan's views, the bridge's messages and the
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


def wrap_words(text: str, width: int, *, hanging: int = 0) -> list[str]:
  """`text` in lines of at most `width` columns, broken between words.

  A word too long for a line (a long path) is broken only after a '/'
  (`wrap_path`), or kept whole on a line of its own: never cut inside a
  name. The lines after the first are indented by `hanging`.
  """
  lines = ['']
  indent = ' ' * hanging
  for word in text.split():
    if lines[-1].strip():
      if len(lines[-1]) + 1 + len(word) <= width:
        lines[-1] += ' ' + word
        continue
      lines.append(indent)
    if len(word) <= width - len(lines[-1]):
      lines[-1] += word
      continue
    # Its parts must fit this line and the indented ones after it.
    parts = wrap_path(word, max(width - max(len(lines[-1]), hanging), 1))
    lines[-1] += parts[0]
    lines += [indent + part for part in parts[1:]]
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
  box: Any = None,
) -> Any:
  """A table of `rows` when it fits `width` unwrapped; else short lines.

  Nothing is cut, or folded inside a word: in the stacked form each row's
  first cell heads it on a line of its own, and each other cell follows on
  its own line, labelled with its column (or the lines `details` makes of
  the row). Cells of the `paths` columns are broken only after a '/'
  (`wrap_path`); a cell holding several lines keeps them. `right` columns
  are right-justified in the table; `box` is its rich box (rich's default:
  lines around every cell).
  """
  rows = [list(row) for row in rows]
  table = (
    rich.table.Table()
    if box is None
    else rich.table.Table(
      box=box, pad_edge=False, show_edge=False, padding=(0, 1, 0, 0)
    )
  )
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


def fill(
  segments: Sequence[str | tuple[str, str]],
  width: int,
  *,
  hanging: int = 2,
  sep: str = '  ',
) -> list[str]:
  """`segments` joined by `sep` in lines of at most `width` columns.

  A segment may be (separator, text) to be joined by another separator.
  Lines break only between segments; the lines after the first are
  indented by `hanging`. Empty segments are left out. A segment too long for a line of its own is
  broken after its commas (a spec ``P('data', 'model', None)`` after
  ``'data', ``), and cut only where a part between commas is longer still.
  """
  lines = ['']
  for item in segments:
    before, segment = item if isinstance(item, tuple) else (sep, item)
    if not segment:
      continue
    joined = (
      f'{lines[-1]}{before}{segment}'
      if lines[-1].strip()
      else lines[-1] + segment
    )
    if len(joined) <= width:
      lines[-1] = joined
      continue
    indent = ' ' * hanging
    if lines[-1].strip():
      lines.append(indent)
    for part in re.findall(r'[^,]*(?:, ?|$)', segment):
      if not part:
        continue
      if len(lines[-1]) + len(part.rstrip()) > width and lines[-1].strip():
        lines.append(indent)
      lines[-1] += part
      while len(lines[-1].rstrip()) > width:  # One part wider than a line.
        head, rest = lines[-1][:width], lines[-1][width:]
        lines[-1] = head
        lines.append(indent + rest)
  return [line.rstrip() for line in lines]


def int_ranges(values: Iterable[int]) -> str:
  """'0..23' for 0 to 23, '0,1' for two, '0..3,5,7..9' with gaps."""
  runs: list[list[int]] = []
  for v in sorted(set(values)):
    if runs and v == runs[-1][1] + 1:
      runs[-1][1] = v
    else:
      runs.append([v, v])
  parts = []
  for a, b in runs:
    if a == b:
      parts.append(str(a))
    elif b == a + 1:
      parts.append(f'{a},{b}')
    else:
      parts.append(f'{a}..{b}')
  return ','.join(parts)


_INDEX = re.compile(r'\d+')


def collapse_paths(
  items: Sequence[tuple[str, Any]],
) -> list[tuple[str, list[int]]]:
  """Paths that differ only in integer components, as one pattern each.

  `items` are (path, key) pairs; paths whose keys are equal and whose
  components are equal but for integers collapse into one pattern,
  ``layers/{0..23}/attn/kernel``, placed where its first path was.
  Returns (pattern, the indices of `items` it stands for). A group whose
  integers do not form a full grid (``a/0/b/0``, ``a/1/b/1``) is split
  until each part does.
  """
  groups: dict[Any, list[int]] = {}
  for i, (path, key) in enumerate(items):
    parts = path.split('/')
    template = tuple(None if _INDEX.fullmatch(p) else p for p in parts)
    groups.setdefault((template, key), []).append(i)
  out: list[tuple[int, str, list[int]]] = []
  for members in groups.values():
    numbers = [
      tuple(int(p) for p in items[i][0].split('/') if _INDEX.fullmatch(p))
      for i in members
    ]
    for part in _grids(members, numbers):
      out.append((part[0], _pattern(items[part[0]][0], part, items), part))
  out.sort(key=lambda t: t[0])
  return [(pattern, part) for _, pattern, part in out]


def _grids(members: list[int], numbers: list[tuple[int, ...]]) -> list[Any]:
  """`members` split so that each part's integers form a full grid."""
  if len(members) == 1:
    return [members]
  sets = [set(column) for column in zip(*numbers, strict=True)]
  if len(set(numbers)) == len(numbers) and len(numbers) == _product(sets):
    return [members]
  varying = [k for k, s in enumerate(sets) if len(s) > 1]
  last = varying[-1]
  parts: dict[tuple[int, ...], list[int]] = {}
  for i, n in zip(members, numbers, strict=True):
    parts.setdefault(n[:last] + n[last + 1 :], []).append(i)
  return list(parts.values())


def _product(sets: Sequence[set[int]]) -> int:
  n = 1
  for s in sets:
    n *= len(s)
  return n


def _pattern(
  first: str, part: Sequence[int], items: Sequence[tuple[str, Any]]
) -> str:
  parts = first.split('/')
  if len(part) == 1:
    return first
  columns = [items[i][0].split('/') for i in part]
  out = []
  for k, p in enumerate(parts):
    values = {c[k] for c in columns}
    if len(values) == 1:
      out.append(p)
    else:
      out.append('{' + int_ranges(int(v) for v in values) + '}')
  return '/'.join(out)


def hanging_lines(
  text: str, width: int, *, indent: int = 2, hanging: int = 4
) -> list[str]:
  """`text` wrapped at its spaces to `width` columns: the first line
  indented by `indent`, the others by `hanging` (never cut in a word)."""
  words = [w for w in text.split(' ') if w]
  lines = fill(
    [(' ', w) for w in words], max(width - indent, 1), hanging=hanging - indent
  )
  return [' ' * indent + line for line in lines]
