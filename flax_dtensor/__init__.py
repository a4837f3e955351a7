"""flax_dtensor: logical-axis sharding and DTensor export for Flax NNX.

The namespace is lazy (PEP 562): ``import flax_dtensor`` imports neither
JAX nor Flax, so that the ``flax-dtensor`` command answers ``--help`` at
once. The first public name used imports its module and, before that,
installs the hook into Flax (`_hook._install.ensure_installed`), so the hook is in
place before any rules object or function of flax_dtensor exists. The
public names are listed once, in ``__init__.pyi`` (see `_lazy`).
"""

from flax_dtensor import _lazy

__version__ = '0.1.0'

__all__, __getattr__, __dir__ = _lazy.namespace(__name__, __file__, globals())
