"""The ``flax-dtensor`` command line: ``demo``, ``plan``, ``export``, ``inspect``.

Run ``flax-dtensor --help`` (or ``python -m flax_dtensor --help``). Each
command is a module here that parses its flags and calls the library;
`_command` holds what they share (console, errors, exit statuses),
`_options` the options they declare alike, `_parsing` the parsers of
meshes, axis types, sizes and ``--out``, `_served` the served inputs
(``--input-shape``), and `_loading` what they load (rules files,
optimizers, TARGET factories, devices, the abstract model).
The command line needs the ``cli`` extra (typer, rich, orbax-checkpoint).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

INSTALL_HINT = (
  'error: the flax-dtensor command needs its extra: '
  'pip install "flax-dtensor[cli]"'
)


def main(argv: Sequence[str] | None = None) -> None:
  """Runs the command line (the ``flax-dtensor`` entry point)."""
  from flax_dtensor import _interrupts

  try:
    # First: Ctrl-C stops any command (docs/cli.md). Inside the `try`: a
    # signal that arrives while the handlers are being put in place is
    # told as any other.
    _interrupts.install()
    try:
      from flax_dtensor.cli import _app
    except ImportError as e:
      sys.exit(f'{INSTALL_HINT} ({e})')
    _app.main(argv)
  except KeyboardInterrupt:  # Before a command could catch it.
    _interrupts.acknowledge()
    print('interrupted', file=sys.stderr, flush=True)
    _interrupts.exit_now(_interrupts.status())
