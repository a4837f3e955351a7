"""Writes the docs' generated parts as Markdown, where readers read them.

Some parts of the docs come from the code: the troubleshooting tables from
the test suite's bad-input matrix (`tests/support/bad_input_cases.py`, each
row a test that provokes the error and checks its message), and the command
line reference from each command's ``--help``. They are written into the
pages themselves, between two markers::

  <!-- generated: troubleshooting -->
  ...
  <!-- end generated -->

so that a page reads whole on GitHub, in a clone and in the Sphinx build
alike. Rerun after changing a command's options or the matrix:

    python tools/generate_docs.py           # rewrites the pages
    python tools/generate_docs.py --check   # exit 1 if a page is stale

`tests/docs/generated_docs_test.py` runs the check.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pathlib
import re
import sys
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / 'docs'
SUPPORT = ROOT / 'tests' / 'support'
WIDTH = 80
"""Columns of the help text: what fits the theme's text column unclipped."""

_REGION = re.compile(
  r'(<!-- generated: (?P<name>[\w-]+)(?P<args>[^>]*?) -->\n)'
  r'(?P<body>.*?)'
  r'(<!-- end generated -->)',
  re.DOTALL,
)


def command_help(args: list[str]) -> str:
  """The help text of ``flax-dtensor ARGS --help`` at `WIDTH` columns."""
  import typer.testing

  from flax_dtensor.cli import _app

  result = typer.testing.CliRunner().invoke(
    _app.app,
    [*args, '--help'],
    prog_name='flax-dtensor',
    terminal_width=WIDTH,
    env={'NO_COLOR': '1', 'TERM': 'dumb', 'COLUMNS': str(WIDTH)},
    color=False,
  )
  if result.exit_code != 0:
    raise RuntimeError(
      f'flax-dtensor {" ".join(args)} --help failed (exit '
      f'{result.exit_code}): {result.output}'
    )
  return '\n'.join(line.rstrip() for line in result.output.splitlines())


def cli_help(args: str) -> str:
  text = command_help(args.split()).strip('\n')
  return f'```text\n{text}\n```\n'


# The classes a message pattern uses for what varies, as a reader reads
# them: a number as N, any other word (a path's part, a file's suffix) as '…'.
_READABLE_CLASSES = ((r'\d+', 'N'), (r'\S+', '…'), (r'\w+', '…'))


def _pattern(regex: str) -> str:
  """A message pattern, made readable.

  `.*` is ' … ', ``\\d+`` is N, ``\\S+`` is '…', and the other escapes
  are the characters they escape: ``uid \\d+\\)`` reads ``uid N)``.
  """
  text = regex.replace('.*', ' … ')
  for pattern, readable in _READABLE_CLASSES:
    text = text.replace(pattern, readable)
  text = re.sub(r'\\(.)', r'\1', text)
  return ' '.join(text.split())


def _cell(text: str, *, code: bool = False) -> str:
  text = ' '.join(text.split()).replace('|', '\\|')
  if not code:
    return text
  ticks = '``' if '`' in text else '`'
  pad = ' ' if text.startswith('`') or text.endswith('`') else ''
  return f'{ticks}{pad}{text}{pad}{ticks}'


def _qualified(error: type) -> str:
  """How a user spells `error`: fdt.NAME, flax_dtensor.dtensor.NAME, or
  a builtin's name."""
  import flax_dtensor.dtensor

  name = error.__name__
  if not error.__module__.startswith('flax_dtensor'):
    return name
  if name in flax_dtensor.dtensor.__all__:
    return f'flax_dtensor.dtensor.{name}'
  return f'fdt.{name}'


def troubleshooting(args: str) -> str:
  """A section per error class: its description, then a row per case."""
  del args
  # The tests' package `support` (tests/ is on the path in pytest, by
  # pyproject.toml's `pythonpath`; here, by this tool).
  if str(SUPPORT.parent) not in sys.path:
    sys.path.insert(0, str(SUPPORT.parent))
  cases = importlib.import_module('support.bad_input_cases').CASES
  by_error: dict[type, list] = {}
  for case in cases:
    by_error.setdefault(case.error, []).append(case)
  out = []
  for error in sorted(by_error, key=lambda e: e.__name__):
    doc = (inspect.getdoc(error) or '').split('\n\n')[0]
    out += [
      f'## {_qualified(error)}',
      '',
      ' '.join(doc.split()),
      '',
      '| Entry point | What went wrong | The message says | Fix |',
      '| --- | --- | --- | --- |',
    ]
    for case in by_error[error]:
      out.append(
        f'| {_cell(case.entry, code=True)} | {_cell(case.bad)} | '
        f'{_cell(_pattern(case.match), code=True)} | {_cell(case.fix)} |'
      )
    out.append('')
  return '\n'.join(out)


GENERATORS: dict[str, Callable[[str], str]] = {
  'cli-help': cli_help,
  'troubleshooting': troubleshooting,
}


def render(text: str) -> str:
  """`text` with every generated region written anew."""

  def fill(match: re.Match[str]) -> str:
    name, args = match['name'], match['args'].strip()
    if name not in GENERATORS:
      raise ValueError(f'unknown generated region {name!r}')
    return f'{match[1]}\n{GENERATORS[name](args).strip()}\n\n{match[5]}'

  return _REGION.sub(fill, text)


def pages() -> list[pathlib.Path]:
  return sorted(p for p in DOCS.glob('*.md') if _REGION.search(p.read_text()))


def stale() -> list[pathlib.Path]:
  """The pages whose generated regions differ from what the code gives."""
  return [p for p in pages() if render(p.read_text()) != p.read_text()]


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument(
    '--check',
    action='store_true',
    help='write nothing; exit 1 naming each stale page',
  )
  args = parser.parse_args(argv)
  if args.check:
    old = stale()
    for page in old:
      print(f'{page.relative_to(ROOT)} is stale: run tools/generate_docs.py')
    return 1 if old else 0
  for page in pages():
    text = page.read_text()
    new = render(text)
    if new != text:
      page.write_text(new)
      print(f'wrote {page.relative_to(ROOT)}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
