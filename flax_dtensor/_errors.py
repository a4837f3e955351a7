"""Exception and warning classes of flax_dtensor.

Every error the package raises on bad input is one of these. Each subclasses
the builtin callers already catch (`ValueError` or `TypeError`) and
`FlaxDTensorError`, so ``except fdt.FlaxDTensorError`` catches them all.
Messages say what was expected, what arrived, where (the variable path when
there is one), and how to fix it.
"""


class FlaxDTensorError(Exception):
  """Base class of every error raised by flax_dtensor."""


class LogicalRulesError(FlaxDTensorError, ValueError):
  """A rule set is malformed: a bad pair, a bad YAML document, a bad option."""


class RuleTargetTypeError(FlaxDTensorError, TypeError):
  """A rule's target is not a mesh axis name, a sequence of names, or None."""


class UnknownLogicalAxisError(FlaxDTensorError, ValueError):
  """A logical axis name is not mentioned by any rule.

  Attributes:
    names: The unmentioned logical names.
    problem: The message without its fix (for front ends, such as the
      command line, that suggest their own).
  """

  def __init__(self, message: str, *, names=(), problem: str = '') -> None:
    super().__init__(message)
    self.names = tuple(names)
    self.problem = problem or message


class LayoutFileError(FlaxDTensorError, ValueError):
  """A golden layout (a plan's JSON) cannot be read."""


class ShardingResolutionError(FlaxDTensorError, ValueError):
  """Logical axes cannot be resolved to a PartitionSpec.

  Raised for a logical name repeated within one array, logical axes whose
  length does not match the array's rank, and, in strict mode, a dimension
  that no rule could shard.
  """


class NotAModelError(FlaxDTensorError, TypeError):
  """Expected an NNX module, graph node or state; got something else.

  For example a factory (``lambda: Model(...)``) where a built model is
  expected, or a plain dict of arrays.
  """


class FlaxCompatibilityError(FlaxDTensorError, TypeError):
  """The installed JAX or Flax is not one flax_dtensor works with.

  Raised when flax_dtensor is first used (its first public name) with a JAX
  or Flax release outside the supported range (see the compatibility page),
  or when Flax creates variables or answers ``nnx.get_partition_spec``
  without calling the functions flax_dtensor wraps, so the rules would
  silently stop applying.
  """


class MeshError(FlaxDTensorError, ValueError):
  """No usable mesh: none given and none set, or one of the wrong kind."""


class MeshAxisTypeError(FlaxDTensorError, ValueError):
  """The mesh axis types do not allow the requested sharding.

  For example a `Manual` axis (inside `shard_map`), or, inside `jax.jit`, one
  array dimension sharded over a product of Explicit and Auto axes.
  """


class DTensorError(FlaxDTensorError, ValueError):
  """A JAX array, mesh or sharding cannot be expressed in TF DTensor."""


class DTensorInitializationError(FlaxDTensorError, ValueError):
  """TF DTensor is not, or cannot be, set up to mirror the JAX topology."""


class ExportError(FlaxDTensorError, ValueError):
  """An export or restore of NNX state to or from TensorFlow failed.

  For example an existing target directory without `overwrite=True`, a
  checkpoint that lacks a variable the target needs, or a shape mismatch.
  """


class EagerShardingOffWarning(UserWarning):
  """Variables were created unplaced: Flax's eager sharding was off.

  Warned once per rules context, when a module is built under our rules and
  a concrete mesh while ``flax.config.flax_always_shard_variable`` is False
  (some libraries set it when imported), so Flax created its annotated
  variables unsharded. ``fdt.plan`` gives each such variable's
  reason and ``fdt.check`` reports ``eager-sharding-off``.
  """
