"""`flax-dtensor ARGS` in a fork of the warm pool: the entry point's call."""

import sys

from flax_dtensor import cli

cli.main(sys.argv[1:])
