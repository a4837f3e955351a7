# The public names of `flax_dtensor`, one import each: what type
# checkers see, and what the lazy namespace hands out (`flax_dtensor._lazy`
# parses this stub once). Add a public name here and nowhere else.

from flax_dtensor._errors import DTensorError as DTensorError
from flax_dtensor._errors import (
  DTensorInitializationError as DTensorInitializationError,
)
from flax_dtensor._errors import (
  EagerShardingOffWarning as EagerShardingOffWarning,
)
from flax_dtensor._errors import ExportError as ExportError
from flax_dtensor._errors import FactoryError as FactoryError
from flax_dtensor._errors import (
  FlaxCompatibilityError as FlaxCompatibilityError,
)
from flax_dtensor._errors import FlaxDTensorError as FlaxDTensorError
from flax_dtensor._errors import LayoutFileError as LayoutFileError
from flax_dtensor._errors import LikelyTypoWarning as LikelyTypoWarning
from flax_dtensor._errors import LogicalRulesError as LogicalRulesError
from flax_dtensor._errors import MeshAxisTypeError as MeshAxisTypeError
from flax_dtensor._errors import MeshError as MeshError
from flax_dtensor._errors import MissingMeshAxisError as MissingMeshAxisError
from flax_dtensor._errors import NotAModelError as NotAModelError
from flax_dtensor._errors import RuleTargetTypeError as RuleTargetTypeError
from flax_dtensor._errors import (
  ShardingResolutionError as ShardingResolutionError,
)
from flax_dtensor._errors import (
  UnknownLogicalAxisError as UnknownLogicalAxisError,
)
from flax_dtensor._placement._init import clear_init_cache as clear_init_cache
from flax_dtensor._placement._init import init as init
from flax_dtensor._placement._placing import shard_module as shard_module
from flax_dtensor._placement._placing import shard_value as shard_value
from flax_dtensor._placement._placing import (
  with_logical_constraint as with_logical_constraint,
)
from flax_dtensor._placement._trees import gather_tree as gather_tree
from flax_dtensor._placement._trees import shard_tree as shard_tree
from flax_dtensor._planning._check import check as check
from flax_dtensor._planning._check_report import CheckReport as CheckReport
from flax_dtensor._planning._check_report import Finding as Finding
from flax_dtensor._planning._memory import MemoryReport as MemoryReport
from flax_dtensor._planning._memory import memory_report as memory_report
from flax_dtensor._planning._plan import PlanEntry as PlanEntry
from flax_dtensor._planning._plan import ShardingPlan as ShardingPlan
from flax_dtensor._planning._plan_build import plan as plan
from flax_dtensor._planning._plan_diff import PlanDiff as PlanDiff
from flax_dtensor._planning._suggest import RulesSuggestion as RulesSuggestion
from flax_dtensor._planning._suggest import suggest_rules as suggest_rules
from flax_dtensor._rules._context import (
  get_logical_axis_rules as get_logical_axis_rules,
)
from flax_dtensor._rules._context import (
  logical_axis_rules as logical_axis_rules,
)
from flax_dtensor._rules._context import propagate as propagate
from flax_dtensor._rules._context import (
  set_logical_axis_rules as set_logical_axis_rules,
)
from flax_dtensor._rules._logical import LogicalRules as LogicalRules
from flax_dtensor._rules._path_rules import PathRule as PathRule
from flax_dtensor._rules._resolution import (
  logical_to_mesh_axes as logical_to_mesh_axes,
)

__version__: str
