"""flax_dtensor: logical-axis sharding and DTensor export for Flax NNX.

The namespace is lazy (PEP 562): ``import flax_dtensor`` imports neither
JAX nor Flax, so that the ``flax-dtensor`` command answers ``--help`` at
once. The first public name used imports its module and, before that,
installs the hook into Flax (`_hook.ensure_installed`), so the hook is in
place before any rules object or function of flax_dtensor exists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flax_dtensor import _lazy

if TYPE_CHECKING:
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
  from flax_dtensor._errors import (
    MissingMeshAxisError as MissingMeshAxisError,
  )
  from flax_dtensor._errors import NotAModelError as NotAModelError
  from flax_dtensor._errors import RuleTargetTypeError as RuleTargetTypeError
  from flax_dtensor._errors import (
    ShardingResolutionError as ShardingResolutionError,
  )
  from flax_dtensor._errors import (
    UnknownLogicalAxisError as UnknownLogicalAxisError,
  )
  from flax_dtensor._placement._init import (
    clear_init_cache as clear_init_cache,
  )
  from flax_dtensor._placement._init import init as init
  from flax_dtensor._placement._placing import shard_module as shard_module
  from flax_dtensor._placement._placing import shard_value as shard_value
  from flax_dtensor._placement._placing import (
    with_logical_constraint as with_logical_constraint,
  )
  from flax_dtensor._placement._trees import gather_tree as gather_tree
  from flax_dtensor._placement._trees import shard_tree as shard_tree
  from flax_dtensor._planning._check import CheckReport as CheckReport
  from flax_dtensor._planning._check import Finding as Finding
  from flax_dtensor._planning._check import check as check
  from flax_dtensor._planning._memory import MemoryReport as MemoryReport
  from flax_dtensor._planning._memory import memory_report as memory_report
  from flax_dtensor._planning._plan import PlanEntry as PlanEntry
  from flax_dtensor._planning._plan import ShardingPlan as ShardingPlan
  from flax_dtensor._planning._plan import plan as plan
  from flax_dtensor._planning._plan_diff import PlanDiff as PlanDiff
  from flax_dtensor._planning._suggest import RulesSuggestion as RulesSuggestion
  from flax_dtensor._planning._suggest import suggest_rules as suggest_rules
  from flax_dtensor._rules._logical import LogicalRules as LogicalRules
  from flax_dtensor._rules._logical import (
    get_logical_axis_rules as get_logical_axis_rules,
  )
  from flax_dtensor._rules._logical import (
    logical_axis_rules as logical_axis_rules,
  )
  from flax_dtensor._rules._logical import propagate as propagate
  from flax_dtensor._rules._logical import (
    set_logical_axis_rules as set_logical_axis_rules,
  )
  from flax_dtensor._rules._path_rules import PathRule as PathRule
  from flax_dtensor._rules._resolution import (
    logical_to_mesh_axes as logical_to_mesh_axes,
  )

__version__ = '0.1.0'

__all__ = (
  'CheckReport',
  'DTensorError',
  'DTensorInitializationError',
  'EagerShardingOffWarning',
  'ExportError',
  'FactoryError',
  'Finding',
  'FlaxCompatibilityError',
  'FlaxDTensorError',
  'LayoutFileError',
  'LikelyTypoWarning',
  'LogicalRules',
  'LogicalRulesError',
  'MemoryReport',
  'MeshAxisTypeError',
  'MeshError',
  'MissingMeshAxisError',
  'NotAModelError',
  'PathRule',
  'PlanDiff',
  'PlanEntry',
  'RuleTargetTypeError',
  'RulesSuggestion',
  'ShardingPlan',
  'ShardingResolutionError',
  'UnknownLogicalAxisError',
  'check',
  'clear_init_cache',
  'gather_tree',
  'get_logical_axis_rules',
  'init',
  'logical_axis_rules',
  'logical_to_mesh_axes',
  'memory_report',
  'plan',
  'propagate',
  'set_logical_axis_rules',
  'shard_module',
  'shard_tree',
  'shard_value',
  'suggest_rules',
  'with_logical_constraint',
)

# {public name: the private module that defines it}.
_MODULES = {
  'CheckReport': '_planning._check',
  'Finding': '_planning._check',
  'check': '_planning._check',
  'DTensorError': '_errors',
  'DTensorInitializationError': '_errors',
  'EagerShardingOffWarning': '_errors',
  'ExportError': '_errors',
  'FactoryError': '_errors',
  'FlaxCompatibilityError': '_errors',
  'FlaxDTensorError': '_errors',
  'LayoutFileError': '_errors',
  'LikelyTypoWarning': '_errors',
  'LogicalRulesError': '_errors',
  'MeshAxisTypeError': '_errors',
  'MeshError': '_errors',
  'MissingMeshAxisError': '_errors',
  'NotAModelError': '_errors',
  'RuleTargetTypeError': '_errors',
  'ShardingResolutionError': '_errors',
  'UnknownLogicalAxisError': '_errors',
  'init': '_placement._init',
  'clear_init_cache': '_placement._init',
  'MemoryReport': '_planning._memory',
  'memory_report': '_planning._memory',
  'PathRule': '_rules._path_rules',
  'shard_module': '_placement._placing',
  'shard_value': '_placement._placing',
  'with_logical_constraint': '_placement._placing',
  'PlanDiff': '_planning._plan_diff',
  'PlanEntry': '_planning._plan',
  'ShardingPlan': '_planning._plan',
  'plan': '_planning._plan',
  'logical_to_mesh_axes': '_rules._resolution',
  'LogicalRules': '_rules._logical',
  'get_logical_axis_rules': '_rules._logical',
  'logical_axis_rules': '_rules._logical',
  'propagate': '_rules._logical',
  'set_logical_axis_rules': '_rules._logical',
  'RulesSuggestion': '_planning._suggest',
  'suggest_rules': '_planning._suggest',
  'gather_tree': '_placement._trees',
  'shard_tree': '_placement._trees',
}


__getattr__ = _lazy.module_getattr(__name__, _MODULES, globals())


def __dir__() -> list[str]:
  return sorted((*__all__, '__version__'))
