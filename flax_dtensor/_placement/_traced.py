"""`init`'s traced build: the factory under one ``nnx.jit``, in shards.

The factory is traced on an all-Auto copy of the caller's mesh (same
devices), each variable constrained to its spec (`constrain`), so XLA
computes only its shards; inputs cross to and from the Auto copy by
zero-copy retyping. `build` runs it (compiled once per configuration, and
kept by `_init_cache`); `compiled_build` shows XLA's program per device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from flax_dtensor._placement import (
  _calls,
  _creation,
  _init_cache,
  _own_meshes,
  _switches,
  _variables,
)
from flax_dtensor._rules import _context, _logical, _meshes, _spec


class OnAnotherMesh(Exception):
  """`constrain` met a variable naming a mesh of other devices."""


def build(
  factory: Callable[..., Any],
  rules: _logical.LogicalRules | _context.FlaxRules,
  mesh: Mesh,
  call: _calls.Split,
  compiled: Any = None,
  key: Any = None,
) -> Any:
  """Builds under one ``nnx.jit``, each variable constrained to its spec.

  `compiled` is an earlier call's compiled build of the same configuration
  (`key`), run as it is; else the build is compiled and, unless its trace
  captured arrays (`_init_cache.holds_constants`), kept under `key`.

  Raises:
    OnAnotherMesh: If a variable names a mesh of other devices (found while
      tracing: nothing was kept).
  """
  auto = _meshes.auto_copy(mesh)
  with _calls.nodes_on(call.nodes, auto):
    values = [
      x if _calls.is_node(x) else _meshes.retype(x, auto) for x in call.passed
    ]
    with jax.set_mesh(auto):
      if compiled is None:
        traced = _creator(factory, rules, mesh, call).trace(values)
        # Compiled as `_creation` compiles initializers, so that the values
        # equal an eager build's (within 8 ulps).
        compiled = traced.lower().compile(_creation.COMPILER_OPTIONS)
        if not _init_cache.holds_constants(traced):
          _init_cache.put(
            key, _init_cache.Build(in_shards=False, compiled=compiled)
          )
      built = compiled(values)
    _own_meshes.place(built, rules, mesh)
  return built


def _creator(
  factory: Callable[..., Any],
  rules: _logical.LogicalRules | _context.FlaxRules,
  mesh: Mesh,
  call: _calls.Split,
) -> Any:
  """The ``nnx.jit`` function of `build`, taking the values passed.

  It keeps the arguments that are compiled in, never those passed (the
  caller's arrays and graph nodes): a kept build holds none of them.
  """
  auto = _meshes.auto_copy(mesh)
  calling = call.calling(factory)

  @nnx.jit(graph=True, graph_updates=True)
  def create(values: list[Any]) -> Any:
    with _switches.building():
      built = _calls.expect_module(calling(values), factory)
    constrain(built, rules, mesh, auto)
    return built

  return create


def compiled_build(
  factory: Callable[..., Any],
  *args: Any,
  mesh: Mesh,
  rules: _logical.RulesLike | None = None,
  **kwargs: Any,
) -> Any:
  """The traced build of `init`, compiled, not run: XLA's program per device.

  Its ``as_text()`` and ``memory_analysis()`` show what one device holds
  while the model is built (tests and benchmarks read them).
  """
  with _calls.scope(mesh, rules):
    call = _calls.split(args, kwargs)
    create = _creator(factory, _context.rules_in_effect(), mesh, call)
    with jax.set_mesh(_meshes.auto_copy(mesh)):
      return create.lower(call.passed).compile(_creation.COMPILER_OPTIONS)


def constrain(
  built: Any,
  rules: _logical.LogicalRules | _context.FlaxRules,
  mesh: Mesh,
  auto: Mesh,
) -> None:
  """Constrains each annotated variable to its spec (traced, on `auto`).

  Raises:
    OnAnotherMesh: If a variable names a mesh of other devices.
  """
  for where, variable, resolution in _variables.resolved(
    built, rules=rules, mesh=mesh
  ):
    if resolution is None:
      continue
    own = _meshes.mesh_for(variable, mesh=mesh)
    if not _meshes.same_devices(own, mesh):
      # One traced build constrains to one mesh: `init` builds eagerly.
      raise OnAnotherMesh(where)
    value = _spec.value_of(variable)
    variable.set_value(
      jax.lax.with_sharding_constraint(
        value, NamedSharding(auto, resolution.spec)
      )
    )
