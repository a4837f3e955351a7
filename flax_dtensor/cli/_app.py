"""The ``flax-dtensor`` application: its commands, and `main`."""

from __future__ import annotations

from collections.abc import Sequence

import typer

from flax_dtensor.cli import _command, demo, export, inspect, plan

app = typer.Typer(
  name='flax-dtensor',
  help=(
    'Logical-axis sharding for Flax NNX, and export of sharded NNX models '
    'to TensorFlow DTensor.'
  ),
  no_args_is_help=True,
  add_completion=False,
  pretty_exceptions_enable=False,
  context_settings={'help_option_names': ['-h', '--help']},
)
app.command()(demo.demo)
app.command()(plan.plan)
app.command()(export.export)
app.command()(inspect.inspect)


def main(argv: Sequence[str] | None = None) -> None:
  """Runs the command line in this process, until it exits."""
  _command.capture_until_exit = True
  app(args=list(argv) if argv is not None else None, prog_name='flax-dtensor')
