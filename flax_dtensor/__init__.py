"""flax_dtensor: logical-axis sharding and DTensor export for Flax NNX."""

from flax_dtensor._errors import DTensorError as DTensorError
from flax_dtensor._errors import (
  DTensorInitializationError as DTensorInitializationError,
)
from flax_dtensor._errors import ExportError as ExportError
from flax_dtensor._errors import FlaxDTensorError as FlaxDTensorError
from flax_dtensor._errors import LogicalRulesError as LogicalRulesError
from flax_dtensor._errors import MeshAxisTypeError as MeshAxisTypeError
from flax_dtensor._errors import MeshError as MeshError
from flax_dtensor._errors import RuleTargetTypeError as RuleTargetTypeError
from flax_dtensor._errors import (
  ShardingResolutionError as ShardingResolutionError,
)
from flax_dtensor._errors import (
  UnknownLogicalAxisError as UnknownLogicalAxisError,
)

__version__ = '0.1.0'

__all__ = (
  'DTensorError',
  'DTensorInitializationError',
  'ExportError',
  'FlaxDTensorError',
  'LogicalRulesError',
  'MeshAxisTypeError',
  'MeshError',
  'RuleTargetTypeError',
  'ShardingResolutionError',
  'UnknownLogicalAxisError',
)
