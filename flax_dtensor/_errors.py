"""Exception and warning classes of flax_dtensor.

Every error the package raises on bad input is one of these. Each subclasses
the builtin callers already catch (`ValueError` or `TypeError`) and
`FlaxDTensorError`, so ``except fdt.FlaxDTensorError`` catches them all.
Messages say what was expected, what arrived, where (the variable path when
there is one), and how to fix it. `causes` walks an error's chain (what it
was raised from), and `errno_in` finds the OS's error number in it, for
every layer that puts a library's failure in our words.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterable, Iterator


def causes(error: BaseException | None) -> Iterator[BaseException]:
  """`error`, then what it was raised from (its ``__cause__``, else its
  ``__context__``), and so on: each exception once, so a cycle ends."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    yield error
    error = error.__cause__ or error.__context__


def errno_in(
  error: BaseException | None,
  codes: Collection[int],
  found_in_text: Callable[[str], Iterable[int]] = lambda text: (),
) -> int | None:
  """The first of `codes` that `error` or one of its `causes` reports.

  An ``OSError`` carries its errno; another library's error only the OS's
  words (TensorFlow's ``...; File too large``), so each one's text is
  searched for them, after the numbers `found_in_text` reads in it (e.g.
  TensorStore's ``os_error_code='13'``).
  """
  for cause in causes(error):
    if isinstance(cause, OSError) and cause.errno in codes:
      return cause.errno
    text = str(getattr(cause, 'message', None) or cause)
    for code in found_in_text(text):
      if code in codes:
        return code
    for code in codes:
      if os.strerror(code) in text:
        return code
  return None


class FlaxDTensorError(Exception):
  """Base class of every error raised by flax_dtensor."""


class LogicalRulesError(FlaxDTensorError, ValueError):
  """A rule set is malformed: a bad pair, a bad YAML document, a bad option."""


class MissingMeshAxisError(LogicalRulesError):
  """A rule names a mesh axis the mesh lacks, and the rules forbid that.

  Raised only for rules made with ``missing_mesh_axes='error'`` (YAML
  ``missing_mesh_axes: error``, ``--missing-mesh-axes error`` on the
  command line), when they meet a mesh: every rule naming an axis the mesh
  lacks is listed, with the mesh axis it was likely meant to name. By
  default such a rule falls back instead (see `LikelyTypoWarning`).
  """


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

  Raised for a logical name repeated within one array, more logical axes
  than the array has dimensions (fewer are fine: the missing trailing ones
  are None), and, in strict mode, a dimension that no rule could shard.
  """


class NotAModelError(FlaxDTensorError, TypeError):
  """Expected an NNX module, graph node or state; got something else.

  For example a factory (``lambda: Model(...)``) where a built model is
  expected, or a plain dict of arrays.
  """


class FactoryError(FlaxDTensorError, ValueError):
  """A factory given to `flax_dtensor.init` cannot be built as it is written.

  For example one that draws from an ``nnx.Rngs`` it was not passed (one
  captured from the enclosing scope): `init` traces the factory, and Flax
  refuses a graph node of the caller's mutated inside that trace. Pass
  the ``nnx.Rngs`` as an argument (``fdt.init(Model, rngs=rngs)``).
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


# The kinds of ExportError a caller may handle apart (a training loop: retry
# elsewhere on a full disk, restart the job when a peer died, fall back to
# an older checkpoint when this one is damaged). Each keeps ExportError's
# bases, so ``except ExportError`` still catches them all.


class DiskFullError(ExportError):
  """A write found no room: the disk is full, or a limit was reached.

  The filesystem has no space left (ENOSPC), this user's disk quota is used
  up (EDQUOT), or a file grew past the largest size allowed (EFBIG, e.g.
  ``ulimit -f``). The message gives the bytes needed and free. The previous
  export at the path, if any, is unchanged, and the partial one removed.
  """


class PeerError(ExportError):
  """Another process of a multi-process save or restore stopped or failed.

  A process that died or hangs is named after ``FLAX_DTENSOR_PEER_TIMEOUT``
  seconds without its heartbeat (60 by default); a process that failed
  tells the others at once, and its error is quoted. Every process of the
  job should be restarted.
  """


class DamagedExportError(ExportError):
  """An export's files are not what its manifest records.

  A file is missing, truncated or resized, its bytes fail their CRC-32, or
  TensorFlow cannot read its data. Nothing was restored: restore from an
  intact copy, or re-export.
  """


class MalformedExportError(ExportError):
  """An export is untrusted or malformed: it is refused before it is read.

  Its manifest is not valid JSON or holds values of the wrong type or
  range; a path it names escapes the export directory (or a checkpoint
  state file's does); a file on disk is not in the manifest; or the
  manifest disagrees with TensorFlow's index (a variable, shape or dtype).
  """


class ExportNotFoundError(ExportError):
  """No export is at the path: nothing to restore, read or inspect."""


class SaveInProgressError(ExportError):
  """Another save to the path is in progress, or replaced it during a read.

  Another live process writes the path (its temporary directory is held),
  or the export changed while it was located or read. Wait for that save
  to finish, then try again.
  """


_EXPORT_ERRORS = {
  cls.__name__: cls
  for cls in (
    ExportError,
    DiskFullError,
    PeerError,
    DamagedExportError,
    MalformedExportError,
    ExportNotFoundError,
    SaveInProgressError,
  )
}


def export_error_named(name: str) -> type[ExportError]:
  """The `ExportError` class called `name`, else `ExportError` itself.

  For an error one process found and shares with the others as text (its
  class name and message), so each raises the same kind.
  """
  return _EXPORT_ERRORS.get(name, ExportError)


class CheckpointManagerError(ExportError):
  """A `CheckpointManager` was given what it cannot use: a setting out of
  range, a step that is not a non-negative int or not above the latest
  saved one, metrics that are not finite numbers."""


class CheckpointStepWarning(UserWarning):
  """A step the caller asked about was not saved, or not the one restored.

  Warned by `CheckpointManager` when a save is skipped because the one
  before is still being written (``when_busy='skip'``), and when
  ``restore()`` with no step passes over a damaged latest step to restore
  the newest good one.
  """


class EagerShardingOffWarning(UserWarning):
  """Variables were created unplaced: Flax's eager sharding was off.

  Warned once per rules context, when a module is built under our rules and
  a concrete mesh while ``flax.config.flax_always_shard_variable`` is False
  (some libraries set it when imported), so Flax created its annotated
  variables unsharded. ``fdt.plan`` gives each such variable's
  reason and ``fdt.check`` reports ``eager-sharding-off``.
  """


class LikelyTypoWarning(UserWarning):
  """A rule names a mesh axis the mesh lacks, spelled like one it has; or
  a logical name no rule mentions is spelled like one they do.

  A rule such as ``('embed', 'dta')`` on a mesh with a ``data`` axis is
  skipped (its name falls back to its next rule, often replication), which
  silently costs memory. Warned once per rules and mesh, with "did you mean
  'data'?", when variables are placed or resolved under them; ``fdt.plan``
  shows it as a headline instead, and ``fdt.check`` reports it as
  ``mesh-axis-typo``. A missing axis is a likely typo of a mesh axis when,
  compared without regard to case, both names are the same, or both have
  at least 3 characters and are one edit apart (a character inserted,
  deleted or changed, or two adjacent characters swapped); so ``'fsdp'``
  on a mesh of ``data`` and ``model`` is an intended fallback, not a typo.
  ``missing_mesh_axes='error'`` makes every rule naming a missing axis an
  error (`MissingMeshAxisError`).

  The same rule finds a likely typo in a logical name: one that no rule
  mentions (``'embedd'``) spelled like one they do (``'embed'``), replicated
  under ``unknown='replicate'``, is warned once per rules and name ("did you
  mean 'embed'?"), and is ``fdt.check``'s ``unknown-logical-name``. Each
  warning points at the user's line that caused it.
  """


class ServedShapeWarning(UserWarning):
  """A SavedModel serves fewer input shapes than its signature's None allows.

  Warned by `save_saved_model` when the forward splits a polymorphic
  dimension (the batch, say) over an Explicit mesh axis of `n` devices,
  which JAX does only for sizes it knows to be multiples of `n`: the
  dimension is exported as ``n*b``, so the SavedModel serves the sizes JAX
  runs, multiples of `n`, and any other size fails in TensorFlow with
  JAX's message ('Division had remainder'). Passing those shapes as
  `polymorphic_shapes=` says so and silences it; constraining the dimension
  on Auto axes (``with_sharding_constraint``) serves every size.
  """
