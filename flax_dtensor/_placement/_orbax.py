"""Orbax checkpoints of ``nnx.state(model)``, restored straight onto a mesh.

What ``flax-dtensor export`` starts from: `find_checkpoint` accepts a
``StandardCheckpointer`` directory or a ``CheckpointManager`` one (its
latest step); `restore` checks the checkpoint's variables and shapes
against the model (`_sources`, as every restore does), then reads every
array directly into the sharding the rules give its variable
(`_variables.spec_of_variable`). Orbax is imported when these run (``pip
install "flax-dtensor[cli]"``).
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from flax_dtensor import _errors
from flax_dtensor._placement import _sources, _variables
from flax_dtensor._rules import _logical

_FIX = (
  'Expected the directory written by orbax.checkpoint.StandardCheckpointer()'
  '.save(path, nnx.state(model)) (and waited for with wait_until_finished()),'
  ' or a CheckpointManager directory.'
)


def _is_checkpoint(path: pathlib.Path) -> bool:
  return (path / '_CHECKPOINT_METADATA').exists() or (
    path / '_METADATA'
  ).exists()


def find_checkpoint(path: pathlib.Path) -> pathlib.Path:
  """The Orbax checkpoint directory at or below `path`.

  Raises:
    ExportNotFoundError: If there is no Orbax checkpoint there.
    ExportError: If `path` is a file.
  """
  if not path.exists():
    raise _errors.ExportNotFoundError(
      f'Orbax checkpoint {str(path)!r} does not exist. {_FIX}'
    )
  if not path.is_dir():
    raise _errors.ExportError(
      f'Orbax checkpoint {str(path)!r} is a file, not a directory. {_FIX}'
    )
  if _is_checkpoint(path):
    return path
  steps = sorted(
    (p for p in path.iterdir() if p.is_dir() and p.name.isdigit()),
    key=lambda p: int(p.name),
  )
  if steps:
    latest = steps[-1]
    if (latest / '_METADATA').exists():
      return latest
    items = [p for p in latest.iterdir() if p.is_dir() and _is_checkpoint(p)]
    if len(items) == 1:
      return items[0]
  raise _errors.ExportNotFoundError(
    f'{str(path)!r} holds no Orbax checkpoint (no _CHECKPOINT_METADATA or '
    f'_METADATA file). {_FIX}'
  )


@dataclasses.dataclass(frozen=True)
class _Wanted:
  """A variable of the model, as `_sources` checks it."""

  path: tuple[str, ...]
  shape: tuple[int, ...]
  dtype: Any

  @property
  def name(self) -> str:
    return '/'.join(self.path)

  @property
  def key(self) -> str:
    return self.name


def _parts(keypath: Any) -> tuple[str, ...]:
  return tuple(_variables.keypath_str(keypath).split('/'))


def check_matches(path: pathlib.Path, abstract_model: Any) -> None:
  """Refuses a checkpoint whose variables or shapes are not the model's.

  Read from the checkpoint's metadata, before any array is.

  Raises:
    ExportError: If the checkpoint lacks a variable of the model, holds one
      the model lacks, or holds one with another shape; the message names
      the variable, what the model expects and what the checkpoint holds.
  """
  import orbax.checkpoint as ocp

  with ocp.StandardCheckpointer() as checkpointer:
    _check_matches(checkpointer, path, nnx.state(abstract_model))


def _check_matches(
  checkpointer: Any, path: pathlib.Path, abstract_state: Any
) -> None:
  try:
    metadata = checkpointer.metadata(path.absolute())
  except Exception:  # No metadata to compare: Orbax's restore says why.
    return
  tree = getattr(metadata, 'item_metadata', metadata)
  held = {}
  for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    shape = getattr(leaf, 'shape', None)
    if shape is None:
      continue
    parts = _parts(keypath)
    if parts[-1:] == ('value',):  # An nnx.Variable's array.
      parts = parts[:-1]
    dtype = np.dtype(getattr(leaf, 'dtype', None) or np.float32)
    held[parts] = _sources.Held(tuple(shape), dtype, dtype)
  if not held:  # Unreadable metadata (a damaged checkpoint): Orbax says.
    return
  wanted = []
  for keypath, variable in jax.tree_util.tree_flatten_with_path(
    abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable)
  )[0]:
    value = _variables.value_of(variable)
    if not hasattr(value, 'shape') or jax.dtypes.issubdtype(
      value.dtype, jax.dtypes.prng_key
    ):
      continue  # Keys are stored as their data: Orbax checks them.
    wanted.append(_Wanted(_parts(keypath), tuple(value.shape), value.dtype))
  source = _sources.Source(
    f'The Orbax checkpoint {str(path)!r}',
    'an Orbax checkpoint',
    'saved',
    selects=False,
    rebuild='Pass a TARGET that builds the model that was saved (the same '
    'configuration)',
  )
  _sources.check_extra(abstract_state, held, source, allow_extra=False)
  # Orbax converts dtypes on restore, as it always did here.
  _sources.check_held(wanted, held, source, convert_dtypes=True)


def restore(
  path: pathlib.Path,
  abstract_model: Any,
  mesh: jax.sharding.Mesh,
  rules: _logical.RulesLike | None = None,
) -> Any:
  """Restores an Orbax checkpoint of ``nnx.state(model)`` onto `mesh`.

  Args:
    path: The checkpoint directory (see `find_checkpoint`).
    abstract_model: The model from ``nnx.eval_shape``.
    mesh: Where to place it.
    rules: The rules; default the rules in effect.

  Returns:
    The restored module, every array read into its planned sharding.

  Raises:
    ExportError: If the checkpoint cannot be read, lacks a variable of the
      model, holds one the model lacks, or holds one with another shape;
      the message names the variable.
  """
  import orbax.checkpoint as ocp

  rules_ = _logical.rules_in_effect(rules)
  graphdef, abstract_state = nnx.split(abstract_model)

  def target(keypath: Any, variable: nnx.Variable) -> nnx.Variable:
    resolution = _variables.spec_of_variable(
      variable,
      rules=rules_,
      mesh=mesh,
      path=_variables.keypath_str(keypath),
    )
    spec = resolution.spec if resolution is not None else PartitionSpec()
    value = _variables.value_of(variable)
    return variable.replace(
      jax.ShapeDtypeStruct(
        value.shape, value.dtype, sharding=NamedSharding(mesh, spec)
      )
    )

  wanted = jax.tree_util.tree_map_with_path(
    target, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable)
  )
  with ocp.StandardCheckpointer() as checkpointer:
    _check_matches(checkpointer, path, abstract_state)
    try:
      state = checkpointer.restore(path.absolute(), wanted)
    except Exception as e:
      message = ' '.join(str(e).split())[:300]
      raise _errors.ExportError(
        f'Cannot restore the Orbax checkpoint {str(path)!r} into the model: '
        f'{type(e).__name__}: {message}. Expected a checkpoint of '
        f'nnx.state(model) for this model. {_FIX}'
      ) from e
  return nnx.merge(graphdef, state)
