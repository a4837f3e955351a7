"""The ``cli-help`` directive: a command's ``--help``, rendered at build time.

Usage in a MyST page::

  ```{cli-help} plan
  ```

runs ``flax-dtensor plan --help`` (in process, through typer's test runner,
at a fixed width and without colours) and inserts the text as a literal
block, so the CLI reference never goes stale.
"""

from __future__ import annotations

from typing import Any

from docutils import nodes
from docutils.parsers.rst import Directive
from sphinx.application import Sphinx
from sphinx.errors import ExtensionError

WIDTH = 80
"""Columns of the help text: what fits the theme's text column unclipped."""


def command_help(args: list[str]) -> str:
  """Returns the help text of ``flax-dtensor ARGS --help``."""
  import typer.testing

  from flax_dtensor.cli import _app

  runner = typer.testing.CliRunner()
  result = runner.invoke(
    _app.app,
    [*args, '--help'],
    prog_name='flax-dtensor',
    terminal_width=WIDTH,
    env={'NO_COLOR': '1', 'TERM': 'dumb', 'COLUMNS': str(WIDTH)},
    color=False,
  )
  if result.exit_code != 0:
    raise ExtensionError(
      f'flax-dtensor {" ".join(args)} --help failed (exit '
      f'{result.exit_code}): {result.output}'
    )
  return '\n'.join(line.rstrip() for line in result.output.splitlines())


class CliHelp(Directive):
  """Inserts the ``--help`` text of a ``flax-dtensor`` command."""

  optional_arguments = 1
  has_content = False

  def run(self) -> list[nodes.Node]:
    args = self.arguments[0].split() if self.arguments else []
    text = command_help(args).strip('\n')
    block = nodes.literal_block(text, text)
    block['language'] = 'text'
    return [block]


def setup(app: Sphinx) -> dict[str, Any]:
  app.add_directive('cli-help', CliHelp)
  return {'parallel_read_safe': True, 'parallel_write_safe': True}
