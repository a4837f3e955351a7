"""Small, general fixes applied to docstrings before Sphinx parses them.

The package's Google-style docstrings are read as plain text too (``help()``,
IDEs), so they use Markdown habits that reStructuredText rejects. Rather than
bend every docstring to reST, this rewrites them on the way in:

* a plural after inline code, `` `DVariable`s ``, becomes
  `` `DVariable`\\ s `` (reST needs a non-word character after the closing
  backtick).
"""

from __future__ import annotations

import re
from typing import Any

from sphinx.application import Sphinx

# Inline code or interpreted text: `x` or ``x``, scanned left to right.
_CODE = re.compile(r'(`+)([^`]+?)\1')


def fix_line(line: str) -> str:
  """Escapes the boundary after inline code followed by a word character."""

  def replace(m: re.Match[str]) -> str:
    end = m.end()
    if end < len(line) and (line[end].isalnum() or line[end] == '_'):
      return m.group(0) + '\\ '
    return m.group(0)

  return _CODE.sub(replace, line)


def _process(
  app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
  del app, what, name, obj, options
  lines[:] = [fix_line(line) for line in lines]


def setup(app: Sphinx) -> dict[str, Any]:
  app.connect('autodoc-process-docstring', _process)
  return {'parallel_read_safe': True, 'parallel_write_safe': True}
