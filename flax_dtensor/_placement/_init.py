"""`init`: build a module under ``jit`` so no parameter ever exists unsharded.

The factory runs once, traced under ``nnx.jit`` on an all-Auto copy of the
caller's mesh (same devices): each variable is constrained to the spec
`_spec.spec_of_variable` gives it, so XLA computes only its shards.
Inputs and outputs cross to and from the Auto copy by zero-copy retyping,
so the result and the caller's `nnx.Rngs` keep the caller's mesh and axis
types.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import flax
import jax
from flax import nnx
from flax.nnx.training import optimizer
from jax.sharding import Mesh, NamedSharding

from flax_dtensor import _errors
from flax_dtensor._placement import (
  _creation,
  _creation_order,
  _init_cache,
  _placing,
  _replay,
  _switches,
  _variables,
)
from flax_dtensor._rules import _context, _logical, _meshes, _spec

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


@contextlib.contextmanager
def scope(
  mesh: Mesh | None, rules: _logical.RulesLike | None
) -> Iterator[None]:
  """Enters ``jax.set_mesh(mesh)`` and `logical_axis_rules(rules)` if given."""
  with contextlib.ExitStack() as stack:
    if mesh is not None:
      stack.enter_context(jax.set_mesh(mesh))
    if rules is not None:
      stack.enter_context(_context.logical_axis_rules(rules))
    yield


def _is_node(x: Any) -> bool:
  return nnx.graph.is_graph_node(x) or isinstance(x, nnx.Variable)


def factory_name(factory: Any) -> str:
  """'make_model' (a function), 'nnx.Linear' (a class), for messages."""
  name = getattr(factory, '__qualname__', None) or type(factory).__name__
  return name.replace('.<locals>', '')


def expect_module(built: Any, factory: Any) -> Any:
  """Returns `built`, what `factory` returned, if it is an NNX graph node
  (or a tuple, list or dict of them).

  Called on the value itself, before JAX traces, stages or places it, so a
  factory returning a number, a string or a tuple holding one hears so in
  our words.

  Raises:
    NotAModelError: Naming the type returned.
  """
  leaves = jax.tree.leaves(built, is_leaf=_is_node)
  if _is_node(built) or (
    isinstance(built, tuple | list | dict)
    and leaves
    and all(_is_node(x) for x in leaves)
  ):
    return built
  raise _errors.NotAModelError(
    f'Expected the factory {factory_name(factory)!r} to return an NNX '
    f'module (or another NNX graph node), got {type(built).__name__}: '
    f'{built!r:.100}. Pass a callable that builds the model and returns it, '
    'e.g. lambda: Model(rngs=nnx.Rngs(0)).'
  )


def checked(factory: Callable[..., Any]) -> Callable[..., Any]:
  """`factory`, its result checked by `expect_module` as it returns."""

  def build(*args: Any, **kwargs: Any) -> Any:
    return expect_module(factory(*args, **kwargs), factory)

  return build


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
  with scope(mesh, rules):
    mesh_ = _meshes.mesh_for()
    if not isinstance(mesh_, Mesh):
      lacking = (
        None if mesh_ is not None else _without_own_mesh(factory, args, kwargs)
      )
      if lacking == []:  # Every variable placed names its own mesh.
        return _build_on_own_meshes(factory, args, kwargs, None)
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
    leaves, treedef = jax.tree_util.tree_flatten(
      (args, kwargs), is_leaf=_is_node
    )
    dynamic = [
      i for i, x in enumerate(leaves) if _is_node(x) or isinstance(x, jax.Array)
    ]
    nodes = [leaves[i] for i in dynamic if _is_node(leaves[i])]
    # The same configuration as an earlier call: its verdict, or its
    # compiled build, is reused.
    key = _init_cache.key(
      factory, leaves, treedef, dynamic, _is_node, rules_, mesh_
    )
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
      in_shards, order = _builds_in_shards(
        factory, leaves, treedef, dynamic, mesh_
      )
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
        and len(nodes) == len(dynamic)
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
          built = expect_module(factory(*args, **kwargs), factory)
      except _creation.NotInShards:  # Not foreseen by the abstract pass.
        nnx.update(nodes, nnx.state(saved))
      else:
        _place_result(built, rules_, mesh_)
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
              _rerun(factory, leaves, treedef, dynamic),
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
      return _traced_build(
        factory, rules_, mesh_, leaves, treedef, dynamic, compiled, key
      )
    except _OnAnotherMesh:  # Found while tracing: nothing was kept.
      return _build_on_own_meshes(factory, args, kwargs, mesh_)
    except flax.errors.TraceContextError as e:
      raise _errors.FactoryError(
        f'fdt.init could not trace {factory_name(factory)!r}: it changes a Flax '
        'graph node (an nnx.Rngs, say) that it was not passed, one captured '
        'from the enclosing scope, and Flax refuses that inside a trace '
        f'({e}). Pass it as an argument, e.g. `fdt.init(Model, ..., '
        'rngs=rngs)` or `fdt.init(make, rngs)` with `def make(rngs): ...`.'
      ) from e


def _calling(
  factory: Callable[..., Any],
  leaves: list[Any],
  treedef: Any,
  dynamic: list[int],
) -> Callable[[list[Any]], Any]:
  """The factory called on other values in place of those passed (graph
  nodes, arrays: traced, or abstract), the arguments compiled in (sizes,
  dtypes, wherever they are, positional or keyword) as they are; it keeps
  only those, never the values passed."""
  passed = set(dynamic)
  statics = [None if i in passed else x for i, x in enumerate(leaves)]

  def call(values: list[Any]) -> Any:
    full = list(statics)
    for i, value in zip(dynamic, values, strict=True):
      full[i] = value
    a, k = jax.tree_util.tree_unflatten(treedef, full)
    return factory(*a, **k)

  return call


def _rerun(
  factory: Callable[..., Any],
  leaves: list[Any],
  treedef: Any,
  dynamic: list[int],
) -> Callable[[list[Any]], Any]:
  """The factory called on other graph nodes in place of those passed
  (traced, in a replay's program)."""
  call = _calling(factory, leaves, treedef, dynamic)

  def rerun(nodes: list[Any]) -> Any:
    with _switches.building():
      return call(nodes)

  return rerun


def _builds_in_shards(
  factory: Callable[..., Any],
  leaves: list[Any],
  treedef: Any,
  dynamic: list[int],
  mesh: Mesh,
) -> tuple[bool, _creation_order.Order | None]:
  """Whether an eager build computes every variable in its shards, and the
  creation order it follows.

  True when, in an abstract pass (nothing allocated, the caller's
  `nnx.Rngs` untouched), every variable that a path rule covers lies in a
  leaf module whose arguments determine it (built under a cached jit by
  `_creation_order`), and every other variable with logical axes holds
  exactly what an annotated JAX or Flax initializer returned (which
  `_creation.create` computes in its shards) or lies in such a leaf too,
  or is an ``nnx.Optimizer``'s state (``OptVariable``: optax's
  ``zeros_like`` of a parameter, made where the parameter lies).
  Only the values passed are abstract in that pass; the arguments compiled
  in (a ``width=64``) stay what they are. Anything else (a user's
  initializer or function, an array computed before it is annotated) is
  built by `_traced_build`, whose compile time grows with the model.
  """
  found: list[Any] = []
  verdict: list[bool] = []
  rules = _context.rules_in_effect()
  path_rules = isinstance(rules, _logical.LogicalRules) and bool(
    rules.path_rules
  )
  recording = _creation_order.Recording() if path_rules else None

  call = _calling(factory, leaves, treedef, dynamic)

  def probe(values: list[Any]) -> None:
    with _switches.building(in_shards=found, mesh=mesh, recording=recording):
      built = expect_module(call(values), factory)
    if recording is not None:
      _creation_order.finish(recording, built)
    leaf_paths = (
      [
        r.path
        for r in recording.records
        if r.leaf and r.keyable and r.path is not None
      ]
      if recording is not None
      else []
    )

    def in_a_leaf(path: str) -> bool:
      return any(path == p or path.startswith(p + '/') for p in leaf_paths)

    ids = {id(x) for x in found}
    for where, v, resolution in _variables.resolved(
      built, rules=rules, mesh=mesh
    ):
      if resolution is None:
        continue
      if resolution.by_path_rule:
        verdict.append(in_a_leaf(where))
      elif _spec.logical_axes_of(v) is not None:
        verdict.append(
          id(_spec.value_of(v)) in ids
          or in_a_leaf(where)
          or isinstance(v, optimizer.OptVariable)
        )
    verdict.append(True)

  try:
    # Only the values passed are abstract: a size, positional or keyword,
    # stays the int it is.
    nnx.eval_shape(
      probe, [leaves[i] for i in dynamic], graph=True, graph_updates=False
    )
  except _errors.NotAModelError:
    raise
  except Exception:  # The traced build reports it, or builds it anyway.
    return False, None
  ok = bool(verdict) and all(verdict)
  order = (
    _creation_order.Order(
      recording.records, rules, mesh, quiet=_switches.building, strict=True
    )
    if ok and recording is not None
    else None
  )
  return ok, order


def _traced_build(
  factory: Callable[..., Any],
  rules_: _logical.LogicalRules | _context.FlaxRules,
  mesh_: Mesh,
  leaves: list[Any],
  treedef: Any,
  dynamic: list[int],
  compiled: Any = None,
  key: Any = None,
) -> Any:
  """Builds under one ``nnx.jit``, each variable constrained to its spec.

  `compiled` is an earlier call's compiled build of the same configuration
  (`key`), run as it is; else the build is compiled and, unless its trace
  captured arrays, kept under `key`.
  """
  auto = _meshes.auto_copy(mesh_)
  nodes = [leaves[i] for i in dynamic if _is_node(leaves[i])]
  with _nodes_on(nodes, auto):
    values = [
      leaves[i] if _is_node(leaves[i]) else _meshes.retype(leaves[i], auto)
      for i in dynamic
    ]
    with jax.set_mesh(auto):
      if compiled is None:
        compiled = _compile(
          _creator(factory, rules_, mesh_, leaves, treedef, dynamic),
          values,
          key,
        )
      built = compiled(values)
    _place_result(built, rules_, mesh_)
  return built


@contextlib.contextmanager
def _nodes_on(nodes: list[Any], mesh: Mesh) -> Iterator[None]:
  """The caller's graph nodes (nnx.Rngs) on `mesh` for a build, and back
  after it: zero-copy where they can, keeping their own Variable objects
  and shardings."""
  originals = nnx.state(nodes, graph=True)
  original_shardings = jax.tree.map(
    lambda x: getattr(x, 'sharding', None), originals
  )
  try:
    nnx.update(
      nodes, jax.tree.map(lambda x: _meshes.retype(x, mesh), originals)
    )
    yield
  finally:
    nnx.update(
      nodes,
      jax.tree.map(
        _creation_order.put_back,
        nnx.state(nodes, graph=True),
        original_shardings,
      ),
    )


def _compile(create: Any, values: list[Any], key: Any) -> Any:
  """`create` traced on `values`, compiled, and kept under `key` unless its
  trace captured arrays (`_init_cache.holds_constants`)."""
  traced = create.trace(values)
  # Compiled as `_creation` compiles initializers, so that the values
  # equal an eager build's (within 8 ulps).
  compiled = traced.lower().compile(_creation.COMPILER_OPTIONS)
  builds['compiled'] += 1
  if not _init_cache.holds_constants(traced):
    _init_cache.put(key, _init_cache.Build(in_shards=False, compiled=compiled))
  return compiled


def _creator(
  factory: Callable[..., Any],
  rules_: _logical.LogicalRules | _context.FlaxRules,
  mesh_: Mesh,
  leaves: list[Any],
  treedef: Any,
  dynamic: list[int],
) -> Any:
  """The ``nnx.jit`` function of `_traced_build`, taking the dynamic args.

  It keeps the arguments that are compiled in, never those passed (the
  caller's arrays and graph nodes): a kept build holds none of them.
  """
  auto = _meshes.auto_copy(mesh_)
  passed = set(dynamic)
  statics = [None if i in passed else x for i, x in enumerate(leaves)]

  def rebuild(values: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    full = list(statics)
    for i, v in zip(dynamic, values, strict=True):
      full[i] = v
    return jax.tree_util.tree_unflatten(treedef, full)

  @nnx.jit(graph=True, graph_updates=True)
  def create(values: list[Any]) -> Any:
    a, k = rebuild(values)
    with _switches.building():
      built = expect_module(factory(*a, **k), factory)
    _constrain(built, rules_, mesh_, auto)
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
  with scope(mesh, rules):
    leaves, treedef = jax.tree_util.tree_flatten(
      (args, kwargs), is_leaf=_is_node
    )
    dynamic = [
      i for i, x in enumerate(leaves) if _is_node(x) or isinstance(x, jax.Array)
    ]
    create = _creator(
      factory, _context.rules_in_effect(), mesh, leaves, treedef, dynamic
    )
    with jax.set_mesh(_meshes.auto_copy(mesh)):
      return create.lower([leaves[i] for i in dynamic]).compile(
        _creation.COMPILER_OPTIONS
      )


def build_abstract(
  factory: Callable[[], M],
  *,
  mesh: _meshes.MeshLike | None = None,
  rules: _logical.RulesLike | _context.FlaxRules | None = None,
) -> M:
  """``factory()`` built abstractly (nothing allocated), in linear time.

  Under the mesh (concrete or abstract) and rules given, or the context's;
  the variables hold ``jax.ShapeDtypeStruct``s carrying their shardings.
  `FlaxRules` are the context's own (Flax's, or none): nothing is entered.

  Raises:
    NotAModelError: If the factory returns no NNX module or graph node
      (said before JAX traces what it returned).
  """
  with contextlib.ExitStack() as stack:
    if isinstance(mesh, Mesh):
      stack.enter_context(jax.set_mesh(mesh))
    elif mesh is not None:
      stack.enter_context(jax.sharding.use_abstract_mesh(mesh))
    if rules is not None and not isinstance(rules, _context.FlaxRules):
      stack.enter_context(_context.logical_axis_rules(rules))
    stack.enter_context(_switches.building())
    return nnx.eval_shape(checked(factory))


def _constrain(
  built: Any,
  rules: _logical.LogicalRules | _context.FlaxRules,
  mesh: Mesh,
  auto: Mesh,
) -> None:
  """Constrains each annotated variable to its spec (traced, on `auto`)."""
  for where, variable, resolution in _variables.resolved(
    built, rules=rules, mesh=mesh
  ):
    if resolution is None:
      continue
    own = _meshes.mesh_for(variable, mesh=mesh)
    if not _meshes.same_devices(own, mesh):
      # One traced build constrains to one mesh: `init` builds eagerly.
      raise _OnAnotherMesh(where)
    value = _spec.value_of(variable)
    variable.set_value(
      jax.lax.with_sharding_constraint(
        value, NamedSharding(auto, resolution.spec)
      )
    )


def _place_result(
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


class _OnAnotherMesh(Exception):
  """`_constrain` met a variable naming a mesh of other devices."""


def _without_own_mesh(
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
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_is_node)
  dynamic = [
    i for i, x in enumerate(leaves) if _is_node(x) or isinstance(x, jax.Array)
  ]

  def probe(values: list[Any]) -> None:
    full = list(leaves)
    for i, v in zip(dynamic, values, strict=True):
      full[i] = v
    a, k = jax.tree_util.tree_unflatten(treedef, full)
    with _switches.building():
      built = expect_module(factory(*a, **k), factory)
    lacking, named = [], 0
    for where, v, resolution in _variables.resolved(
      built, rules=rules, mesh=None
    ):
      if resolution is None:
        continue
      if isinstance(_spec.named_mesh_of(v), Mesh):
        named += 1
      else:
        lacking.append(where)
    found.append((lacking, named))

  try:
    nnx.eval_shape(
      probe,
      [leaves[i] for i in dynamic],
      graph=True,
      graph_updates=False,
    )
  except _errors.NotAModelError:
    raise
  except Exception:  # The error of the missing mesh stands.
    return None
  if not found or not found[0][1]:
    return None
  return found[0][0]


def _build_on_own_meshes(
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
  builds['own_meshes'] += 1
  if mesh is None:
    with nnx.use_eager_sharding(True):
      built = expect_module(factory(*args, **kwargs), factory)
    _place_result(built, _context.rules_in_effect(), None)
    return built
  # The caller's graph nodes (nnx.Rngs) and arrays cross onto `mesh`, the
  # context of the build, zero-copy where they can, and the nodes back.
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_is_node)
  nodes = [x for x in leaves if _is_node(x)]
  with _nodes_on(nodes, mesh):
    a, k = jax.tree_util.tree_unflatten(
      treedef,
      [x if _is_node(x) else _meshes.retype(x, mesh) for x in leaves],
    )
    with nnx.use_eager_sharding(True):
      built = expect_module(factory(*a, **k), factory)
    _place_result(built, _context.rules_in_effect(), mesh)
  return built
