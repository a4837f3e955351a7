"""Zero-copy bridge from sharded JAX arrays to TensorFlow DTensor.

TensorFlow is an optional dependency (`pip install "flax-dtensor[tf]"`) and is
imported only when one of these functions runs, never by
`import flax_dtensor.dtensor`. Call `initialize()` once per process, before
any other TensorFlow operation.
"""

# Low-level bridge: topology, meshes, layouts, arrays (flax_dtensor/dtensor/_mesh.py).
from flax_dtensor.dtensor._mesh import array_to_dtensor as array_to_dtensor
from flax_dtensor.dtensor._mesh import dtensor_to_array as dtensor_to_array
from flax_dtensor.dtensor._mesh import initialize as initialize
from flax_dtensor.dtensor._mesh import is_initialized as is_initialized
from flax_dtensor.dtensor._mesh import layout_for as layout_for
from flax_dtensor.dtensor._mesh import mesh_to_dtensor as mesh_to_dtensor
from flax_dtensor.dtensor._mesh import shutdown as shutdown

# --- NNX state export (flax_dtensor/dtensor/_export.py) ---------------------
# The export module adds its imports here (to_tf_module, save_checkpoint,
# restore_checkpoint, save_saved_model) and its names to __all__ below.
# --- end of NNX state export -------------------------------------------------

__all__ = (
  # Low-level bridge.
  'array_to_dtensor',
  'dtensor_to_array',
  'initialize',
  'is_initialized',
  'layout_for',
  'mesh_to_dtensor',
  'shutdown',
  # NNX state export: add names here.
)
