"""``python -m flax_dtensor``: the ``flax-dtensor`` command line."""

from flax_dtensor import cli

if __name__ == '__main__':
  cli.main()
