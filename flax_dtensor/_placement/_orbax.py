"""Orbax checkpoints of ``nnx.state(model)``, restored straight onto a mesh.

What ``flax-dtensor export`` starts from: `find_checkpoint` accepts a
``StandardCheckpointer`` directory or a ``CheckpointManager`` one (its
latest step); `restore` reads every array directly into the sharding the
rules give its variable (`_variables.spec_of_variable`). Orbax is imported
when these run (``pip install "flax-dtensor[cli]"``).
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from flax_dtensor import _errors
from flax_dtensor._placement import _variables
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
    ExportError: If the checkpoint cannot be read or does not match.
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
