"""The ``troubleshooting`` directive: every error a user can meet, with fixes.

It renders ``tests/support/bad_input_cases.py``'s ``CASES`` (the bad-input
matrix the test suite runs), grouped by exception class: the class's description, then
per case the entry point, what went wrong, what the message says and the
fix. So the page lists exactly what is tested, and cannot go stale.

Usage in a MyST page::

  ```{troubleshooting}
  ```
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import sys

from docutils import nodes
from docutils.parsers.rst import Directive
from sphinx.application import Sphinx

TESTS = pathlib.Path(__file__).resolve().parents[2] / 'tests' / 'support'


def _cases():
  if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
  return importlib.import_module('bad_input_cases').CASES


def _pattern(regex: str) -> str:
  """A message pattern, made readable: escapes dropped, `.*` as '…'."""
  text = regex.replace('.*', ' … ').replace('\\', '')
  return ' '.join(text.split())


def _entry(*children: nodes.Node) -> nodes.entry:
  entry = nodes.entry()
  entry += nodes.paragraph('', '', *children)
  return entry


def _table(cases) -> nodes.table:
  widths = (22, 22, 30, 26)
  table = nodes.table(classes=['troubleshooting'])
  group = nodes.tgroup(cols=len(widths))
  table += group
  for width in widths:
    group += nodes.colspec(colwidth=width)
  head = nodes.thead()
  row = nodes.row()
  for title in ('Entry point', 'What went wrong', 'The message says', 'Fix'):
    row += _entry(nodes.Text(title))
  head += row
  group += head
  body = nodes.tbody()
  for case in cases:
    row = nodes.row()
    row += _entry(nodes.literal(text=case.entry))
    row += _entry(nodes.Text(case.bad))
    row += _entry(nodes.literal(text=_pattern(case.match)))
    row += _entry(nodes.Text(' '.join(case.fix.split())))
    body += row
  group += body
  return table


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


class Troubleshooting(Directive):
  has_content = False

  def run(self) -> list[nodes.Node]:
    by_error: dict[type, list] = {}
    for case in _cases():
      by_error.setdefault(case.error, []).append(case)
    out = []
    for error in sorted(by_error, key=lambda e: e.__name__):
      name = error.__name__
      qualified = _qualified(error)
      section = nodes.section(ids=[nodes.make_id(f'error-{name}')])
      section += nodes.title(text=qualified)
      doc = (inspect.getdoc(error) or '').split('\n\n')[0]
      section += nodes.paragraph(text=' '.join(doc.split()))
      section += _table(by_error[error])
      out.append(section)
    return out


def setup(app: Sphinx) -> dict[str, bool]:
  app.add_directive('troubleshooting', Troubleshooting)
  return {'parallel_read_safe': True, 'parallel_write_safe': True}
