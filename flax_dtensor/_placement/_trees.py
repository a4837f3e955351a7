"""Plain pytrees of arrays: placed by path rules or logical axes, and back.

Weights converted from another framework or read from a file arrive as a
nested dict of host arrays. `resolved` gives each leaf its path (the plan's
format) and placement (`_spec.spec_of_array`); `shard_tree` builds
each array from its blocks (``jax.make_array_from_callback``), so no
device receives more than its block; `gather_tree` brings them back to
host NumPy.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_dtensor import _errors
from flax_dtensor._placement import _placing, _variables
from flax_dtensor._rules import _context, _logical, _meshes, _resolution, _spec

T = TypeVar('T')


def _is_array_like(x: Any) -> bool:
  """An array, something that reads like one (``np.memmap``, an h5py or
  safetensors slice), an abstract array, or a number."""
  return (hasattr(x, 'shape') and hasattr(x, 'dtype')) or isinstance(
    x, numbers.Number | np.generic
  )


def _is_nnx(x: Any) -> bool:
  return isinstance(x, nnx.State | nnx.Variable) or nnx.graph.is_graph_node(x)


def is_array_tree(tree: Any) -> bool:
  """Whether `tree` is a pytree of arrays and nothing NNX (a weights dict)."""
  if _is_nnx(tree) or isinstance(tree, numbers.Number) or callable(tree):
    return False
  leaves = jax.tree_util.tree_leaves(tree, is_leaf=_is_nnx)
  return any(hasattr(x, 'shape') for x in leaves) and all(
    _is_array_like(x) and not _is_nnx(x) for x in leaves
  )


def _axes_leaves(tree: Any, treedef: Any, logical_axes: Any) -> list[Any]:
  if logical_axes is None:
    return [None] * treedef.num_leaves
  try:
    found = treedef.flatten_up_to(logical_axes)
  except (ValueError, TypeError) as e:
    raise _errors.ShardingResolutionError(
      f'Expected `logical_axes` to have the structure of the tree, with '
      f'logical axes (a tuple, one name or None per dimension) or None in '
      f'place of each array; it does not: {e}. Mirror the tree, e.g. '
      "{'w': ('embed', 'mlp'), 'b': None} for {'w': ..., 'b': ...}."
    ) from e
  for i, axes in enumerate(found):
    if axes is not None and not isinstance(axes, tuple | list | PartitionSpec):
      raise _errors.ShardingResolutionError(
        f'Expected logical axes (a tuple) or None for each array in '
        f'`logical_axes`; got {type(axes).__name__} {axes!r} for leaf {i}. '
        "Write ('embed',) for a 1-D array."
      )
  return found


def resolved(
  tree: Any,
  *,
  rules: _logical.LogicalRules | _context.FlaxRules,
  mesh: _meshes.MeshLike | None,
  logical_axes: Any = None,
) -> tuple[list[tuple[str, Any, _resolution.Resolution | None]], Any]:
  """([(path, leaf, resolution or None)], treedef) for every leaf.

  Raises:
    ShardingResolutionError: If `logical_axes` does not mirror the tree,
      or a leaf's axes or path rule cannot be resolved.
    UnknownLogicalAxisError: If a name is in no rule.
  """
  keyed, treedef = jax.tree_util.tree_flatten_with_path(tree)
  axes = _axes_leaves(tree, treedef, logical_axes)
  out = []
  for (keypath, leaf), leaf_axes in zip(keyed, axes, strict=True):
    path = _variables.keypath_str(keypath)
    out.append(
      (
        path,
        leaf,
        _spec.spec_of_array(
          leaf, path=path, logical_axes=leaf_axes, rules=rules, mesh=mesh
        ),
      )
    )
  return out, treedef


def shard_tree(
  tree: T,
  rules: _logical.RulesLike | None = None,
  *,
  mesh: Mesh | None = None,
  logical_axes: Any = None,
) -> T:
  """Places a pytree of host arrays on the mesh, each device its block only.

  Each array goes where the rules say: the first path rule matching its
  path (the keys joined with '/', as the plan shows them), or its logical
  axes in `logical_axes`; else it is replicated. Each device receives only
  its block (``jax.make_array_from_callback``, reading ``leaf[block]``):
  no whole copy of a sharded array is ever made on a device, and a leaf
  that reads lazily (``np.memmap``, an h5py dataset) is read block by
  block. `fdt.plan(tree, ...)` reports the same placement without
  allocating anything; `gather_tree` is the way back.

  Args:
    tree: Nested dicts, lists and tuples of NumPy arrays (or anything with
      ``shape``, ``dtype`` and slicing), JAX arrays or numbers.
    rules: The rules, with their path rules; defaults to the rules in
      effect.
    mesh: The mesh; defaults to the one set by ``jax.set_mesh``.
    logical_axes: A tree of the same structure holding, in place of each
      array, its logical axes (a tuple) or None. Path rules with
      ``override=True`` win over them.

  Returns:
    The same structure, of ``jax.Array``s placed on the mesh.

  Raises:
    MeshError: If there is no concrete mesh.
    NotAModelError: If a leaf is not an array (e.g. an abstract one).
    ShardingResolutionError: If `logical_axes` does not mirror `tree`, or
      a rule or an array's axes cannot be resolved against its shape.
    UnknownLogicalAxisError: If a name is in no rule.

  Example:
    >>> import jax, numpy as np, flax_dtensor as fdt
    >>> mesh = jax.make_mesh((2, 4), ('data', 'model'))
    >>> weights = {'dense': {'kernel': np.ones((8, 16), np.float32),
    ...                      'bias': np.zeros(16, np.float32)}}
    >>> rules = fdt.LogicalRules(
    ...     [], path_rules=[('kernel$', jax.P('data', 'model'))])
    >>> placed = fdt.shard_tree(weights, rules, mesh=mesh)
    >>> placed['dense']['kernel'].sharding.spec
    P('data', 'model')
    >>> fdt.gather_tree(placed)['dense']['kernel'].shape
    (8, 16)
  """
  rules_ = _context.rules_in_effect(rules)
  mesh_ = _placing.require_mesh(mesh, 'a tree of arrays')
  if not isinstance(mesh_, Mesh):
    raise _errors.MeshError(
      f'Expected a concrete mesh to place arrays, got the abstract '
      f'{mesh_}. Pass `mesh=` a jax.sharding.Mesh, or call under '
      'jax.set_mesh(mesh).'
    )
  items, treedef = resolved(
    tree, rules=rules_, mesh=mesh_, logical_axes=logical_axes
  )
  placed = []
  for path, leaf, resolution in items:
    spec = resolution.spec if resolution is not None else PartitionSpec()
    placed.append(place_leaf(leaf, NamedSharding(mesh_, spec), path))
  return jax.tree_util.tree_unflatten(treedef, placed)


def place_leaf(leaf: Any, sharding: NamedSharding, path: str) -> jax.Array:
  """One array on `sharding`, each device given its block only."""
  if isinstance(leaf, jax.ShapeDtypeStruct) or isinstance(
    leaf, jax.core.Tracer
  ):
    raise _errors.NotAModelError(
      f'Expected a concrete array at {path!r} to place; got '
      f'{type(leaf).__name__} {leaf!r:.100}. Pass arrays with values (for '
      'a layout without values, use fdt.plan).'
    )
  if isinstance(leaf, jax.Array):
    return jax.device_put(leaf, sharding)  # Device to device, by block.
  if not hasattr(leaf, 'shape') or not hasattr(leaf, 'dtype'):
    leaf = np.asarray(leaf)
  # 64-bit host values become 32-bit unless x64 is on, as in device_put.
  dtype = jax.dtypes.canonicalize_dtype(leaf.dtype)
  return jax.make_array_from_callback(
    tuple(leaf.shape), sharding, _blocks_of(leaf, dtype), dtype=dtype
  )


def _blocks_of(leaf: Any, dtype: Any) -> Callable[[Any], np.ndarray]:
  """The callback handing each device its block, each block read once."""
  read: dict[Any, np.ndarray] = {}

  def block(index: Any) -> np.ndarray:
    key = tuple((s.start, s.stop, s.step) for s in index)
    if key not in read:
      read[key] = np.asarray(leaf[index]).astype(dtype, copy=False)
    return read[key]

  return block


def gather_tree(tree: T) -> T:
  """Brings a pytree of (sharded) arrays back to host NumPy, whole.

  The way back from `shard_tree`: each array is assembled from its
  blocks on the host. In a multi-process run, every process receives the
  whole arrays (``process_allgather``); call it in every process.

  Args:
    tree: A pytree of ``jax.Array``s (or host arrays, returned as NumPy).

  Returns:
    The same structure, of NumPy arrays.

  Raises:
    NotAModelError: If a leaf is abstract (no values).
  """

  def gather(path: Any, x: Any) -> np.ndarray:
    if isinstance(x, jax.ShapeDtypeStruct | jax.core.Tracer):
      raise _errors.NotAModelError(
        f'Expected concrete arrays to gather; got {type(x).__name__} at '
        f'{_variables.keypath_str(path)!r}. Gather arrays with values.'
      )
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      from jax.experimental import multihost_utils

      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)

  return jax.tree_util.tree_map_with_path(gather, tree)
