"""The kinds of `ExportError` the bridge raises, and its warnings.

Defined with the package's other errors (`flax_dtensor._errors`), handed
out here, by `flax_dtensor.dtensor`.
"""

from flax_dtensor._errors import (
  CheckpointManagerError as CheckpointManagerError,
)
from flax_dtensor._errors import (
  CheckpointStepWarning as CheckpointStepWarning,
)
from flax_dtensor._errors import DamagedExportError as DamagedExportError
from flax_dtensor._errors import DiskFullError as DiskFullError
from flax_dtensor._errors import ExportNotFoundError as ExportNotFoundError
from flax_dtensor._errors import MalformedExportError as MalformedExportError
from flax_dtensor._errors import PeerError as PeerError
from flax_dtensor._errors import SaveInProgressError as SaveInProgressError
from flax_dtensor._errors import ServedShapeWarning as ServedShapeWarning

__all__ = (
  'CheckpointManagerError',
  'CheckpointStepWarning',
  'DamagedExportError',
  'DiskFullError',
  'ExportNotFoundError',
  'MalformedExportError',
  'PeerError',
  'SaveInProgressError',
  'ServedShapeWarning',
)
