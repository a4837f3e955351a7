"""Zero-copy bridge from sharded JAX arrays to TensorFlow DTensor.

TensorFlow is an optional dependency (`pip install "flax-dtensor[tf]"`) and is
imported only when one of these functions runs, never by
`import flax_dtensor.dtensor`. Call `initialize()` once per process, before
any other TensorFlow operation.

The namespace is lazy, as the package's: importing a module of it (the
command line's ``inspect`` reads the manifest) imports no JAX. The first
public name used installs the Flax hook first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flax_dtensor import _lazy

if TYPE_CHECKING:
  from flax_dtensor.dtensor._errors import (
    CheckpointManagerError as CheckpointManagerError,
  )
  from flax_dtensor.dtensor._errors import (
    CheckpointStepWarning as CheckpointStepWarning,
  )
  from flax_dtensor.dtensor._errors import (
    DamagedExportError as DamagedExportError,
  )
  from flax_dtensor.dtensor._errors import DiskFullError as DiskFullError
  from flax_dtensor.dtensor._errors import (
    ExportNotFoundError as ExportNotFoundError,
  )
  from flax_dtensor.dtensor._errors import (
    MalformedExportError as MalformedExportError,
  )
  from flax_dtensor.dtensor._errors import PeerError as PeerError
  from flax_dtensor.dtensor._errors import (
    SaveInProgressError as SaveInProgressError,
  )
  from flax_dtensor.dtensor._errors import (
    ServedShapeWarning as ServedShapeWarning,
  )
  from flax_dtensor.dtensor._files._background import SaveHandle as SaveHandle
  from flax_dtensor.dtensor._files._checkpoint import (
    save_checkpoint as save_checkpoint,
  )
  from flax_dtensor.dtensor._files._manager import (
    CheckpointManager as CheckpointManager,
  )
  from flax_dtensor.dtensor._files._restore import (
    read_checkpoint as read_checkpoint,
  )
  from flax_dtensor.dtensor._files._restore import (
    restore_checkpoint as restore_checkpoint,
  )
  from flax_dtensor.dtensor._layout._arrays import (
    array_to_dtensor as array_to_dtensor,
  )
  from flax_dtensor.dtensor._layout._arrays import (
    dtensor_to_array as dtensor_to_array,
  )
  from flax_dtensor.dtensor._layout._convert import (
    flat_variables as flat_variables,
  )
  from flax_dtensor.dtensor._layout._convert import to_tf_module as to_tf_module
  from flax_dtensor.dtensor._layout._from_tf import (
    from_tf_module as from_tf_module,
  )
  from flax_dtensor.dtensor._layout._layouts import layout_for as layout_for
  from flax_dtensor.dtensor._layout._layouts import (
    mesh_to_dtensor as mesh_to_dtensor,
  )
  from flax_dtensor.dtensor._layout._names import (
    checkpoint_key as checkpoint_key,
  )
  from flax_dtensor.dtensor._layout._names import nnx_path as nnx_path
  from flax_dtensor.dtensor._layout._single_mesh import (
    RelaidVariable as RelaidVariable,
  )
  from flax_dtensor.dtensor._layout._single_mesh import (
    SingleMeshReport as SingleMeshReport,
  )
  from flax_dtensor.dtensor._layout._topology import initialize as initialize
  from flax_dtensor.dtensor._layout._topology import (
    is_initialized as is_initialized,
  )
  from flax_dtensor.dtensor._layout._topology import shutdown as shutdown
  from flax_dtensor.dtensor._serving._saved_model import (
    save_saved_model as save_saved_model,
  )

__all__ = (
  'CheckpointManager',
  'CheckpointManagerError',
  'CheckpointStepWarning',
  'DamagedExportError',
  'DiskFullError',
  'ExportNotFoundError',
  'MalformedExportError',
  'PeerError',
  'RelaidVariable',
  'SaveHandle',
  'SaveInProgressError',
  'ServedShapeWarning',
  'SingleMeshReport',
  'array_to_dtensor',
  'checkpoint_key',
  'dtensor_to_array',
  'flat_variables',
  'from_tf_module',
  'initialize',
  'is_initialized',
  'layout_for',
  'mesh_to_dtensor',
  'nnx_path',
  'read_checkpoint',
  'restore_checkpoint',
  'save_checkpoint',
  'save_saved_model',
  'shutdown',
  'to_tf_module',
)

# {public name: the private module that defines it}.
_MODULES = {
  'array_to_dtensor': '_layout._arrays',
  'dtensor_to_array': '_layout._arrays',
  'SaveHandle': '_files._background',
  'CheckpointManager': '_files._manager',
  'CheckpointManagerError': '_errors',
  'CheckpointStepWarning': '_errors',
  'save_checkpoint': '_files._checkpoint',
  'flat_variables': '_layout._convert',
  'to_tf_module': '_layout._convert',
  'DamagedExportError': '_errors',
  'DiskFullError': '_errors',
  'ExportNotFoundError': '_errors',
  'MalformedExportError': '_errors',
  'PeerError': '_errors',
  'SaveInProgressError': '_errors',
  'ServedShapeWarning': '_errors',
  'from_tf_module': '_layout._from_tf',
  'layout_for': '_layout._layouts',
  'mesh_to_dtensor': '_layout._layouts',
  'checkpoint_key': '_layout._names',
  'nnx_path': '_layout._names',
  'read_checkpoint': '_files._restore',
  'restore_checkpoint': '_files._restore',
  'save_saved_model': '_serving._saved_model',
  'RelaidVariable': '_layout._single_mesh',
  'SingleMeshReport': '_layout._single_mesh',
  'initialize': '_layout._topology',
  'is_initialized': '_layout._topology',
  'shutdown': '_layout._topology',
}


__getattr__ = _lazy.module_getattr(__name__, _MODULES, globals())


def __dir__() -> list[str]:
  return sorted(__all__)
