"""The ``flax-dtensor`` application: its commands, ``--version``, and `main`.

Importing it imports typer and the commands' modules only: JAX, Flax and
TensorFlow are imported by a command when it runs. The help is click's
plain text (no boxes, no padding), so it reads the same piped or in the
docs, and costs no rich import.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from collections.abc import Sequence
from typing import Annotated, Any

import typer
import typer.core

from flax_dtensor.cli import _command, demo, export, inspect, plan

# What `--version` names, for bug reports: installed versions, read from
# the packages' metadata (nothing is imported).
_VERSIONS = (
  'jax',
  'jaxlib',
  'flax',
  'tensorflow-cpu',
  'tensorflow',
  'orbax-checkpoint',
)


def _versions() -> str:
  """'flax-dtensor 0.1.0', then Python's and each library's, one a line."""
  import flax_dtensor

  lines = [
    f'flax-dtensor {flax_dtensor.__version__}',
    f'Python {platform.python_version()}',
  ]
  for name in _VERSIONS:
    try:
      lines.append(f'{name} {importlib.metadata.version(name)}')
    except importlib.metadata.PackageNotFoundError:
      pass
  return '\n'.join(lines)


def _print_version(value: bool) -> None:
  if value:
    print(_versions())
    raise typer.Exit(_command.EXIT_OK)


class _Command(typer.core.TyperCommand):
  """A command whose help names its arguments as plain metavars.

  Typer writes a required argument as ``{TARGET}`` in the usage line and
  as ``TARGET <str>`` in the help; this writes ``TARGET`` (``[TARGET]``
  when optional), as click and man pages do.
  """

  def collect_usage_pieces(self, ctx: Any) -> list[str]:
    pieces = [self.options_metavar] if self.options_metavar else []
    for param in self.get_params(ctx):
      if param.param_type_name == 'argument':
        name = _argument_name(param)
        pieces.append(name if param.required else f'[{name}]')
      else:
        pieces.extend(param.get_usage_pieces(ctx))
    return pieces

  def format_options(self, ctx: Any, formatter: Any) -> None:
    args, opts = [], []
    for param in self.get_params(ctx):
      record = param.get_help_record(ctx)
      if record is None:
        continue
      if param.param_type_name == 'argument':
        args.append((_argument_name(param), record[1]))
      else:
        opts.append(record)
    for title, records in (('Arguments', args), ('Options', opts)):
      if records:
        with formatter.section(title):
          formatter.write_dl(records)


def _argument_name(param: Any) -> str:
  return param.metavar or param.name.upper()


app = typer.Typer(
  name='flax-dtensor',
  help=(
    'Logical-axis sharding for Flax NNX, and export of sharded NNX models '
    'to TensorFlow DTensor.'
  ),
  add_completion=False,
  pretty_exceptions_enable=False,
  rich_markup_mode=None,
  context_settings={'help_option_names': ['-h', '--help']},
)


@app.callback()
def _options(
  version: Annotated[
    bool,
    typer.Option(
      '--version',
      help='Print the versions of flax-dtensor and its libraries, and exit.',
      callback=_print_version,
      is_eager=True,
    ),
  ] = False,
) -> None:
  del version


# Each command's line in the top-level help, whole at 80 columns (click
# would cut the docstring's first sentence with '...').
_SHORT_HELP = {
  demo.demo: 'Train a small Transformer on a mesh; export it to TF.',
  plan.plan: 'Show where every variable of a model would go.',
  export.export: 'Restore an Orbax checkpoint onto a mesh; export it to TF.',
  inspect.inspect: "List an export's variables, shapes and layouts.",
}
for _function, _short in _SHORT_HELP.items():
  app.command(cls=_Command, short_help=_short)(_function)


def main(argv: Sequence[str] | None = None) -> None:
  """Runs the command line in this process, until it exits.

  Usage errors (a missing argument, an unknown option) come in the same
  one-line ``error:`` style, and exit status 2, as every other bad input.
  """
  from flax_dtensor import _interrupts

  _command.capture_until_exit = True
  args = list(sys.argv[1:] if argv is None else argv) or ['--help']
  try:
    status = app(args=args, prog_name='flax-dtensor', standalone_mode=False)
  except typer.Abort:
    _interrupts.acknowledge()
    print('interrupted', file=sys.stderr, flush=True)
    _interrupts.exit_now(_interrupts.status())
  except Exception as e:
    # Click's usage errors (exit status 2; Typer vendors Click, so they are
    # matched by what they carry rather than by class).
    if getattr(e, 'exit_code', None) != 2 or not hasattr(e, 'format_message'):
      raise
    ctx = getattr(e, 'ctx', None)
    where = ctx.command_path if ctx is not None else 'flax-dtensor'
    message = e.format_message().rstrip('.')
    if not message.endswith(('?', '!')):  # Click's 'Did you mean ...?'.
      message += '.'
    print(
      f"error: {message} Run '{where} --help' for the usage.",
      file=sys.stderr,
    )
    sys.exit(_command.EXIT_BAD_INPUT)
  status = status if isinstance(status, int) else 0
  if _interrupts.received() is not None:
    # Interrupted: what it wrote is cleaned up; exit now, not after other
    # libraries' exit handlers and threads (docs/cli.md, Ctrl-C).
    _interrupts.exit_now(_interrupts.status())
  _interrupts.finishing()
  sys.exit(status)
