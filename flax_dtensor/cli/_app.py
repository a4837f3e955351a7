"""The ``flax-dtensor`` application: its commands, and `main`."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import typer

from flax_dtensor.cli import _command, demo, export, inspect, plan

app = typer.Typer(
  name='flax-dtensor',
  help=(
    'Logical-axis sharding for Flax NNX, and export of sharded NNX models '
    'to TensorFlow DTensor.'
  ),
  add_completion=False,
  pretty_exceptions_enable=False,
  context_settings={'help_option_names': ['-h', '--help']},
)
app.command()(demo.demo)
app.command()(plan.plan)
app.command()(export.export)
app.command()(inspect.inspect)


def main(argv: Sequence[str] | None = None) -> None:
  """Runs the command line in this process, until it exits.

  Usage errors (a missing argument, an unknown option) come in the same
  one-line ``error:`` style, and exit status 2, as every other bad input.
  """
  _command.capture_until_exit = True
  args = list(sys.argv[1:] if argv is None else argv) or ['--help']
  try:
    status = app(args=args, prog_name='flax-dtensor', standalone_mode=False)
  except typer.Abort:
    print('interrupted', file=sys.stderr)
    sys.exit(130)
  except Exception as e:  # pylint: disable=broad-except
    # Click's usage errors (exit status 2; Typer vendors Click, so they are
    # matched by what they carry rather than by class).
    if getattr(e, 'exit_code', None) != 2 or not hasattr(e, 'format_message'):
      raise
    ctx = getattr(e, 'ctx', None)
    where = ctx.command_path if ctx is not None else 'flax-dtensor'
    message = e.format_message().rstrip('.')
    print(
      f"error: {message}. Run '{where} --help' for the usage.",
      file=sys.stderr,
    )
    sys.exit(_command.EXIT_BAD_INPUT)
  sys.exit(status if isinstance(status, int) else 0)
