"""A built model's variables onto their meshes, and models on several.

`place` is every build's last step: each variable goes, zero-copy, onto
the mesh its ``mesh`` metadata names, else the caller's, with its spec.
A model whose variables name meshes of their own is built eagerly
(`build`); `lacking` tells, from an abstract build, which variables name
none, for `init` called without a mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from flax_dtensor import _errors
from flax_dtensor._placement import _calls, _switches, _variables
from flax_dtensor._rules import _context, _logical, _meshes, _spec


def place(
  built: Any,
  rules: _logical.LogicalRules | _context.FlaxRules,
  mesh: Mesh | None,
) -> None:
  """Moves the built variables onto `mesh` (zero-copy), where planned.

  A variable whose ``mesh`` metadata names a concrete mesh goes onto that
  one (`_meshes.mesh_for`); with `mesh` None, the others stay where they
  are.
  """
  for _, variable, resolution in _variables.resolved(
    built, rules=rules, mesh=mesh
  ):
    value = _spec.value_of(variable)
    if not isinstance(value, jax.Array):
      continue
    if resolution is None:
      if mesh is not None:
        variable.set_value(_meshes.retype(value, mesh))
      continue
    own = _meshes.mesh_for(variable, mesh=mesh)  # Its own `mesh=` first.
    if not isinstance(own, Mesh):
      own = mesh
    if own is None:
      continue
    target = _spec.sharding_for(variable, own, resolution.spec)
    variable.set_value(_meshes.put(value, target))  # No dispatch if there.


def lacking(
  factory: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[str] | None:
  """The paths of the variables the rules place that name no concrete mesh
  of their own, from an abstract build (the caller's `nnx.Rngs` untouched).

  For `init` without a mesh: [] when every such variable names its mesh
  (its ``mesh`` metadata, or the mesh of a concrete ``out_sharding``), so
  that none is needed; None when the abstract build fails or no variable
  names a mesh (the caller's error stands as it is).
  """
  rules = _context.rules_in_effect()
  found: list[tuple[list[str], int]] = []
  # Graph nodes and arrays are passed (abstract), the rest closed over.
  call = _calls.split(args, kwargs)
  calling = call.calling(factory)

  def probe(values: list[Any]) -> None:
    with _switches.building():
      built = _calls.expect_module(calling(values), factory)
    without, named = [], 0
    for where, v, resolution in _variables.resolved(
      built, rules=rules, mesh=None
    ):
      if resolution is None:
        continue
      if isinstance(_spec.named_mesh_of(v), Mesh):
        named += 1
      else:
        without.append(where)
    found.append((without, named))

  try:
    nnx.eval_shape(probe, call.passed, graph=True, graph_updates=False)
  except _errors.NotAModelError:
    raise
  except Exception:  # The error of the missing mesh stands.
    return None
  if not found or not found[0][1]:
    return None
  return found[0][0]


def build(
  factory: Callable[..., Any],
  args: tuple[Any, ...],
  kwargs: dict[str, Any],
  mesh: Mesh | None,
) -> Any:
  """`init`'s build of a model whose variables name meshes of their own.

  One traced build constrains to one mesh, so the factory runs eagerly, as
  under ``jax.set_mesh`` and the rules: each variable is created on the
  mesh its ``mesh`` metadata names (an annotated JAX or Flax initializer
  computing only its shards there), the others on `mesh`; then every
  variable is placed by its spec on its own mesh, whatever the eager
  sharding flag. Built anew at each call (no compiled build is kept).
  """
  if mesh is None:
    with nnx.use_eager_sharding(True):
      built = _calls.expect_module(factory(*args, **kwargs), factory)
    place(built, _context.rules_in_effect(), None)
    return built
  # The caller's graph nodes (nnx.Rngs) and arrays cross onto `mesh`, the
  # context of the build, zero-copy where they can, and the nodes back.
  leaves, treedef = jax.tree_util.tree_flatten(
    (args, kwargs), is_leaf=_calls.is_node
  )
  nodes = [x for x in leaves if _calls.is_node(x)]
  with _calls.nodes_on(nodes, mesh):
    a, k = jax.tree_util.tree_unflatten(
      treedef,
      [x if _calls.is_node(x) else _meshes.retype(x, mesh) for x in leaves],
    )
    with nnx.use_eager_sharding(True):
      built = _calls.expect_module(factory(*a, **k), factory)
    place(built, _context.rules_in_effect(), mesh)
  return built
