"""`init`: build a module so that no parameter ever exists unsharded.

`init` chooses the path of each build: a replay of an earlier call's
recorded eager build (`_replay`), the eager build in shards that the
abstract pass allows (`_abstract_build.builds_in_shards`), the traced build
under one ``nnx.jit`` (`_traced`), or, for a model on several meshes, the
eager build of `_own_meshes`. `builds` counts the paths taken;
`_init_cache` keeps what a configuration's first call learned.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

import flax
from flax import nnx
from jax.sharding import Mesh

from flax_dtensor import _errors
from flax_dtensor._placement import (
  _abstract_build,
  _calls,
  _creation,
  _init_cache,
  _own_meshes,
  _placing,
  _replay,
  _switches,
  _traced,
  _variables,
)
from flax_dtensor._rules import _context, _logical, _meshes

M = TypeVar('M')

# How many builds took each path, how many were compiled, and how many
# reused an earlier call's work (for tests and benchmarks).
builds: collections.Counter[str] = collections.Counter()


def clear_init_cache() -> None:
  """Forgets what earlier calls of `init` compiled.

  `init` keeps the compiled build of each model configuration (the
  factory and the values it closes over, the arguments compiled in, the
  shapes of those passed, the rules, the mesh), so that building the same
  model again does not trace and compile it again; it keeps no array or
  module of the caller's. Clear it to free the compiled programs, or after
  changing something a factory reads that the configuration does not
  name (a global that a class's ``__init__`` reads, which, as under
  ``jax.jit``, is fixed at the first call).

  Example:
    >>> import flax_dtensor as fdt
    >>> fdt.clear_init_cache()
  """
  _init_cache.clear()


def init(
  factory: Callable[..., M],
  *args: Any,
  mesh: Mesh | None = None,
  rules: _logical.RulesLike | None = None,
  **kwargs: Any,
) -> M:
  """Builds a module so that no parameter ever exists unsharded.

  ``factory(*args, **kwargs)`` runs once, and every variable with logical
  axes is computed directly in the shards the rules give it (the spec
  `plan` reports). Where every such variable comes straight from a JAX or
  Flax initializer (``nnx.with_partitioning(nnx.initializers.lecun_normal(),
  ...)``, as in ``nnx.Linear``, ``nnx.Embed``, ``nnx.Conv``), the factory
  runs eagerly and each initializer runs under a ``jit`` with its output
  sharding, compiled once per distinct initializer; an abstract pass checks
  this first. Otherwise (a user's initializer, a value reshaped after
  its initializer, as in ``nnx.LinearGeneral``, or a variable a path rule
  covers, which has no path until the model is built) the whole factory is
  traced under one ``nnx.jit`` and each variable is constrained to its spec;
  its compile time grows with the model.

  Arrays and NNX graph nodes (``nnx.Rngs``) anywhere in the arguments are
  passed as they are, and the ``nnx.Rngs`` advance as in an eager call;
  other arguments (sizes, dtypes, initializers) are static for the traced
  build. The values equal an unsharded eager build's within 8 ulps (XLA
  may round a shard's arithmetic otherwise than the whole's), and the
  result lives on the caller's mesh with its axis types (Explicit, Auto or
  mixed), in graph and tree mode alike.

  A second call of the same configuration compiles nothing: the factory
  (its code, defaults, closure values and the globals its code names), the
  arguments compiled in, the shapes, dtypes and shardings of those passed,
  the mesh and the rules name it, and the compiled build (or the abstract
  pass's verdict) is reused; a changed seed passed in ``nnx.Rngs`` is a
  changed value, not a new build. An eager build of at least 64 arrays is
  then one compiled call, the factory not run again (its initializers'
  calls and draws, recorded by the first call), as for a cached
  ``nnx.jit`` factory, however the factory is spelled: the ``nnx.Rngs``
  passed (positionally or as ``rngs=``) or made in the factory from its
  own constants (``lambda: Model(nnx.Rngs(0))``: the seed is then part of
  the configuration, and a changed seed a new build), sizes positional or
  keyword, a ``functools.partial``, or a factory that builds the
  ``nnx.Optimizer`` too (its state, zeros like the parameters, is made in
  the parameters' shards). A call whose configuration cannot be
  pinned down (a closure or argument holding an array where a value is
  compiled in, or another object), or whose trace captured an array, is
  built anew each time. What the factory reads beyond its own code (a
  module global a class's ``__init__`` reads) is fixed at the first call,
  as ``jax.jit`` fixes it. Nothing of the caller's (arrays, modules) is
  kept; `clear_init_cache` forgets the builds.

  A variable whose ``mesh`` metadata names a mesh (``nnx.Param(...,
  mesh=m)``, ``nnx.with_partitioning(init, axes, mesh=m)``) goes on that
  mesh, with the spec its axes resolve to there, whatever mesh is given or
  set: its own wins, as in Flax's ``shard_value``. Where every variable the
  rules place names its mesh, none need be given. A model on several
  meshes is built eagerly, each variable created on its own mesh (an
  annotated JAX or Flax initializer computing only its shards there), and
  anew at each call.

  Args:
    factory: A callable returning an NNX module (or another graph node),
      e.g. the module class.
    *args: Positional arguments for `factory`.
    mesh: The mesh. Defaults to the one set by ``jax.set_mesh``; a
      variable naming its own mesh goes there instead.
    rules: The rules. Defaults to the rules in effect (see
      `get_logical_axis_rules`).
    **kwargs: Keyword arguments for `factory`.

  Returns:
    The module, every variable placed on the mesh.

  Raises:
    MeshError: If there is no concrete mesh (the message says how to get
      the devices a bigger mesh needs) and some variable the rules place
      names none in its ``mesh`` metadata (the message names them).
    FactoryError: If the factory draws from an ``nnx.Rngs`` (or changes
      another graph node) it was not passed, one from its enclosing scope.
    UnknownLogicalAxisError: If a variable names an axis in no rule.
    ShardingResolutionError: If a variable's axes cannot be resolved.
    NotAModelError: If `factory` is not callable, or returns no NNX module
      or graph node.

  Example:
    >>> import jax, flax_dtensor as fdt
    >>> from flax import nnx
    >>> mesh = jax.make_mesh((2, 4), ('data', 'model'))
    >>> init = nnx.with_partitioning(nnx.initializers.ones, ('embed', 'mlp'))
    >>> model = fdt.init(nnx.Linear, 8, 16, kernel_init=init,
    ...                  rngs=nnx.Rngs(0), mesh=mesh,
    ...                  rules=[('embed', 'data'), ('mlp', 'model')])
    >>> model.kernel.sharding.spec
    P('data', 'model')
  """
  if not callable(factory):
    raise _errors.NotAModelError(
      f'Expected `fdt.init` to be given a factory (a callable that builds '
      f'the model), got {type(factory).__name__}: {factory!r:.100}. Pass '
      'e.g. lambda: Model(rngs=nnx.Rngs(0)); to shard a model already '
      'built, use `fdt.shard_module`.'
    )
  if mesh is not None and not isinstance(mesh, Mesh):
    raise _errors.MeshError(
      f'Expected a concrete mesh for `fdt.init`, got the abstract {mesh}. '
      + (
        _meshes.devices_hint(mesh)
        or 'Pass `mesh=` a `jax.sharding.Mesh` (from jax.make_mesh).'
      )
    )
  with _calls.scope(mesh, rules):
    mesh_ = _meshes.mesh_for()
    if not isinstance(mesh_, Mesh):
      lacking = (
        None
        if mesh_ is not None
        else _own_meshes.lacking(factory, args, kwargs)
      )
      if lacking == []:  # Every variable placed names its own mesh.
        builds['own_meshes'] += 1
        return _own_meshes.build(factory, args, kwargs, None)
      hint = _meshes.devices_hint(mesh_)
      raise _errors.MeshError(
        'Expected a concrete mesh for `fdt.init`, but no mesh is set'
        + (f' (got the abstract {mesh_})' if mesh_ is not None else '')
        + (
          ', and the variables at '
          f'{_variables.listing(lacking)} name none in their `mesh` '
          'metadata (the others do)'
          if lacking
          else ''
        )
        + f'. {hint or _placing.NO_MESH_MSG}'
      )
    rules_ = _context.rules_in_effect()
    call = _calls.split(args, kwargs)
    nodes = call.nodes
    # The same configuration as an earlier call: its verdict, or its
    # compiled build, is reused.
    key = _init_cache.key(factory, call, rules_, mesh_)
    known = _init_cache.get(key)
    if known is not None and known.replay is not None:
      built = known.replay(nodes, mesh_)
      if built is not None:
        builds['replayed'] += 1
        return built
    if known is not None:
      builds['reused'] += 1
      in_shards, order = known.in_shards, None
    elif isinstance(rules_, _logical.LogicalRules):
      in_shards, order = _abstract_build.builds_in_shards(factory, call, mesh_)
    else:
      in_shards, order = False, None
    if in_shards:
      saved = nnx.clone(nodes)
      # A first build that only nodes are passed to (no array whose values
      # the factory might read) is recorded, for a replay of later calls.
      replayable = (
        key is not None
        and known is None
        and order is None
        and len(nodes) == len(call.dynamic)
      )
      try:
        recorder = (
          _replay.recording() if replayable else contextlib.nullcontext([])
        )
        with (
          _switches.strictly_in_shards(),
          _switches.following(order),
          recorder as records,
        ):
          built = _calls.expect_module(factory(*args, **kwargs), factory)
      except _creation.NotInShards:  # Not foreseen by the abstract pass.
        nnx.update(nodes, nnx.state(saved))
      else:
        _own_meshes.place(built, rules_, mesh_)
        builds['in_shards'] += 1
        if order is None and known is None:
          # With path rules, the creation order is found anew each time.
          replay = (
            _replay.record(
              built,
              records,
              saved,
              nodes,
              mesh_,
              _rerun(factory, call),
              _creation.COMPILER_OPTIONS,
            )
            if replayable
            else None
          )
          _init_cache.put(key, _init_cache.Build(in_shards=True, replay=replay))
        return built
    builds['traced'] += 1
    compiled = None if known is None else known.compiled
    try:
      built = _traced.build(factory, rules_, mesh_, call, compiled, key)
    except _traced.OnAnotherMesh:  # Found while tracing: nothing was kept.
      builds['own_meshes'] += 1
      return _own_meshes.build(factory, args, kwargs, mesh_)
    except flax.errors.TraceContextError as e:
      raise _errors.FactoryError(
        'fdt.init could not trace '
        f'{_calls.factory_name(factory)!r}: it changes a Flax graph node (an '
        'nnx.Rngs, say) that it was not passed, one captured '
        'from the enclosing scope, and Flax refuses that inside a trace '
        f'({e}). Pass it as an argument, e.g. `fdt.init(Model, ..., '
        'rngs=rngs)` or `fdt.init(make, rngs)` with `def make(rngs): ...`.'
      ) from e
    if compiled is None:  # Compiled now (and kept, unless it holds arrays).
      builds['compiled'] += 1
    return built


def _rerun(
  factory: Callable[..., Any], call: _calls.Split
) -> Callable[[list[Any]], Any]:
  """The factory called on other graph nodes in place of those passed
  (traced, in a replay's program)."""
  calling = call.calling(factory)

  def rerun(nodes: list[Any]) -> Any:
    with _switches.building():
      return calling(nodes)

  return rerun
