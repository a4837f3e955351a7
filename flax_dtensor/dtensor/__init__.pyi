# The public names of `flax_dtensor.dtensor`, one import each: what type
# checkers see, and what the lazy namespace hands out (`flax_dtensor._lazy`
# parses this stub once). Add a public name here and nowhere else.

from flax_dtensor.dtensor._checkpoints._checkpoint import (
  save_checkpoint as save_checkpoint,
)
from flax_dtensor.dtensor._checkpoints._from_tf_files import (
  restore_from_tf as restore_from_tf,
)
from flax_dtensor.dtensor._checkpoints._manager import (
  CheckpointManager as CheckpointManager,
)
from flax_dtensor.dtensor._checkpoints._restore import (
  read_checkpoint as read_checkpoint,
)
from flax_dtensor.dtensor._checkpoints._restore import (
  restore_checkpoint as restore_checkpoint,
)
from flax_dtensor.dtensor._conversion._convert import (
  flat_variables as flat_variables,
)
from flax_dtensor.dtensor._conversion._convert import (
  to_tf_module as to_tf_module,
)
from flax_dtensor.dtensor._conversion._from_tf import (
  from_tf_module as from_tf_module,
)
from flax_dtensor.dtensor._conversion._names import (
  checkpoint_key as checkpoint_key,
)
from flax_dtensor.dtensor._conversion._names import nnx_path as nnx_path
from flax_dtensor.dtensor._conversion._single_mesh import (
  RelaidVariable as RelaidVariable,
)
from flax_dtensor.dtensor._conversion._single_mesh import (
  SingleMeshReport as SingleMeshReport,
)
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
from flax_dtensor.dtensor._layout._arrays import (
  array_to_dtensor as array_to_dtensor,
)
from flax_dtensor.dtensor._layout._arrays import (
  dtensor_to_array as dtensor_to_array,
)
from flax_dtensor.dtensor._layout._layouts import layout_for as layout_for
from flax_dtensor.dtensor._layout._layouts import (
  mesh_to_dtensor as mesh_to_dtensor,
)
from flax_dtensor.dtensor._layout._topology import initialize as initialize
from flax_dtensor.dtensor._layout._topology import (
  is_initialized as is_initialized,
)
from flax_dtensor.dtensor._layout._topology import shutdown as shutdown
from flax_dtensor.dtensor._serving._saved_model import (
  save_saved_model as save_saved_model,
)
from flax_dtensor.dtensor._serving._signatures import (
  ServingSignature as ServingSignature,
)
from flax_dtensor.dtensor._serving._verify import (
  VerificationReport as VerificationReport,
)
from flax_dtensor.dtensor._serving._verify import (
  verify_saved_model as verify_saved_model,
)
from flax_dtensor.dtensor._storage._background import SaveHandle as SaveHandle
