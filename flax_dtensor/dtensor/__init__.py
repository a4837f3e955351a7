"""Zero-copy bridge from sharded JAX arrays to TensorFlow DTensor.

TensorFlow is an optional dependency (`pip install "flax-dtensor[tf]"`) and is
imported only when one of these functions runs, never by
`import flax_dtensor.dtensor`. Call `initialize()` once per process, before
any other TensorFlow operation.

The namespace is lazy, as the package's: importing a module of it (the
command line's ``inspect`` reads the manifest) imports no JAX. The first
public name used installs the Flax hook first. The public names are listed
once, in ``__init__.pyi`` (see `flax_dtensor._lazy`).
"""

from flax_dtensor import _lazy

__all__, __getattr__, __dir__ = _lazy.namespace(__name__, __file__, globals())
