"""Selection: which NNX variables an export takes, and their arrays.

`select` walks a module or state (`flax_dtensor._placement._variables`), keeps the
variables matching `include` and not `exclude`, and describes each as an
`Entry`: path, shape and dtype as exported (a typed PRNG key as its key
data), and the dtype it is stored as.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import filterlib

from flax_dtensor import _errors
from flax_dtensor._placement import _variables
from flax_dtensor._rules import _spec
from flax_dtensor.dtensor._conversion import _names
from flax_dtensor.dtensor._layout import _dtypes

NO_VARIABLES_MSG = (
  'No NNX variable of {what} matched `include={include!r}` minus '
  '`exclude={exclude!r}`: expected at least one. Check the filters, e.g. '
  '`include=nnx.Param` for a model, `include=nnx.OptState` for an '
  'nnx.Optimizer, `include=...` for everything.'
)


@dataclasses.dataclass
class Entry:
  """One selected NNX variable.

  Attributes:
    path: The NNX path (tuple of keys).
    variable: The NNX variable.
    shape: The exported shape (with the key-data dimension for RNG keys).
    dtype: The exported dtype (uint32 for RNG keys).
    key_impl: The PRNG implementation name for a typed key array, else None.
  """

  path: _names.Path
  variable: nnx.Variable
  shape: tuple[int, ...]
  dtype: np.dtype
  key_impl: str | None

  @property
  def name(self) -> str:
    """The path as messages show it ('layers/0/kernel')."""
    return _names.path_text(self.path)

  @property
  def key(self) -> str:
    """The checkpoint key."""
    return _names.checkpoint_key(self.path)

  @property
  def stored_dtype(self) -> np.dtype:
    return _dtypes.stored(self.dtype)

  @property
  def widened_in_jax(self) -> bool:
    return _dtypes.widened_in_jax(self.dtype)

  @property
  def nbytes(self) -> int:
    """Bytes as stored."""
    return int(np.prod(self.shape)) * self.stored_dtype.itemsize


def select(
  node: Any, include: Any, exclude: Any, *, what: str, widen: bool = True
) -> list[Entry]:
  """The variables of `node` matching `include` and not `exclude`.

  `widen=False` (to_tf_module) also refuses dtypes TF has no tensor for.

  Raises:
    NotAModelError: If `node` is not an NNX module, graph node or state.
    ExportError: If nothing is selected, a selected variable holds no
      array, or its dtype cannot be stored.
  """
  predicate = filterlib.to_predicate(nnx.All(include, nnx.Not(exclude)))
  entries = []
  for path, variable in _variables.iter_variables(node):
    if not predicate(path, variable):
      continue
    name = _names.path_text(path)
    for key in path:
      _names.component(key)  # Raises on keys that are neither str nor int.
    value = _spec.value_of(variable)
    shape, dtype = getattr(value, 'shape', None), getattr(value, 'dtype', None)
    if shape is None or dtype is None:
      raise _errors.ExportError(
        f'Expected the NNX variable {name!r} ({type(variable).__name__}) to '
        f'hold an array, got {type(value).__name__}: {value!r:.100}. Leave '
        'it out with `exclude=`.'
      )
    key_impl = None
    if _dtypes.is_key(dtype):
      key_impl = _dtypes.key_impl(value)
      data = jax.eval_shape(jax.random.key_data, value)
      shape, dtype = data.shape, data.dtype
    dtype = np.dtype(dtype)
    if not _dtypes.is_storable(dtype):
      raise _errors.ExportError(
        f'The NNX variable {name!r} has dtype {dtype}, which TF cannot '
        'store in a sharded checkpoint: expected one of '
        f'{_dtypes.storable_names()}. Cast it (e.g. uint64 to int64), or '
        'leave it out with `exclude=`.'
      )
    if not widen and dtype in _dtypes.NOT_IN_TF:
      raise _errors.ExportError(
        f'The NNX variable {name!r} has dtype {dtype}, for which TensorFlow '
        'has no usable tensor dtype: expected a dtype TF holds. Cast it, '
        'leave it out with `exclude=`, or use save_checkpoint / '
        f'save_saved_model, which store it widened to '
        f'{_dtypes.stored(dtype)}.'
      )
    entries.append(Entry(tuple(path), variable, tuple(shape), dtype, key_impl))
  if not entries:
    raise _errors.ExportError(
      NO_VARIABLES_MSG.format(what=what, include=include, exclude=exclude)
    )
  return entries


def names(entries: Any, limit: int = 4) -> str:
  """ "'a', 'b' and 3 more": entries' paths for messages."""
  shown = [repr(e.name) for e in entries]
  return ', '.join(shown[:limit]) + (
    f' and {len(shown) - limit} more' if len(shown) > limit else ''
  )


def to_jax_array(entry: Entry, *, across_processes: bool = True) -> jax.Array:
  """The entry's concrete array, as exported (RNG keys as key data).

  In a multi-process run the array must span every process, unless
  `across_processes` is False (a copy one process writes alone).
  """
  value = _spec.value_of(entry.variable)
  if isinstance(value, jax.ShapeDtypeStruct):
    raise _errors.ExportError(
      f'Expected a concrete array in the NNX variable {entry.name!r}, got an '
      f'abstract {value!r} (e.g. from nnx.eval_shape). Export a module with '
      'real values, or fill it first with restore_checkpoint.'
    )
  if entry.key_impl is not None:
    value = jax.random.key_data(value)
  several = across_processes and jax.process_count() > 1
  if not isinstance(value, jax.Array):
    if several:
      raise _errors.ExportError(
        f'Expected a jax.Array in the NNX variable {entry.name!r}, got '
        f'{type(value).__name__}. In a multi-process run place it first, '
        'e.g. jax.device_put(x, NamedSharding(mesh, P())).'
      )
    value = jnp.asarray(value)
  if several:
    check_spans_processes(entry.name, value.sharding)
  return value


def check_spans_processes(name: str, sharding: jax.sharding.Sharding) -> None:
  """Multi-process: every process must hold part of each array.

  DTensor's multi-client save and restore are collective over a mesh's
  processes; an array on some processes only (e.g. created outside any mesh
  context, on one local device) would leave the others waiting.
  """
  processes = {d.process_index for d in sharding.device_set}
  if len(processes) != jax.process_count():
    raise _errors.ExportError(
      f'The NNX variable {name!r} lives on the devices of processes '
      f'{sorted(processes)} only ({sharding}): expected, in a multi-process '
      'run, an array on a mesh over all processes. Create it under '
      'jax.set_mesh(mesh), or place it with jax.device_put(x, '
      'NamedSharding(mesh, P())).'
    )
