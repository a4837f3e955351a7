"""Placing arrays by logical axes, by mesh axis type; the NNX creation hook.

Arrays are placed by the types of the mesh axes their PartitionSpec uses:
``jax.sharding.reshard`` for Explicit axes, ``jax.lax.with_sharding_constraint``
for Auto axes, and both on a mixed mesh (``reshard`` to the Explicit part,
then a constraint for the Auto part). Outside ``jit`` a mixed placement is a
single ``jax.device_put`` to the full sharding, since an eager
``with_sharding_constraint`` would drop the Explicit part.

The hook into Flax (one mechanism, installed when flax_dtensor is imported): Flax calls ``flax.core.spmd.shard_value`` from
``Variable.__init__`` to place annotated variables, and
``flax.nnx.spmd.get_var_pspec`` to answer ``nnx.get_partition_spec``,
``nnx.get_named_sharding`` and ``nnx.eval_shape``. flax_dtensor wraps both.
While a flax_dtensor rules context is active in the current thread, they
resolve a variable's logical axes with flax_dtensor's semantics (priority,
fallbacks, mesh and shape checks); otherwise they are Flax's own, unchanged.
Both see the same shape, mesh and rules, so the reported PartitionSpec and the
actual placement agree.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from flax import nnx
from flax.core import spmd as core_spmd
from flax.nnx import spmd as nnx_spmd
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from flax_dtensor import _errors, _rules

M = TypeVar('M')

NO_MESH_MSG = (
  'Set one with `jax.set_mesh(mesh)` (a context manager), or pass `mesh=`. '
  'To build a model without a mesh and shard it later, build it under '
  '`nnx.use_eager_sharding(False)` and call `fdt.shard_module`.'
)


def _is_traced(x: Any) -> bool:
  return isinstance(x, jax.core.Tracer)


def _require_mesh(
  mesh: _rules.MeshLike | None, what: str, path: str | None
) -> _rules.MeshLike:
  if mesh is None:
    mesh = _rules.current_mesh()
  if mesh is None:
    raise _errors.MeshError(
      f'Expected a mesh to place {what}{_rules._where(path)}, but no mesh '
      f'is set. {NO_MESH_MSG}'
    )
  return mesh


def apply_spec(
  x: jax.Array,
  spec: PartitionSpec,
  mesh: _rules.MeshLike,
  *,
  path: str | None = None,
) -> jax.Array:
  """Places `x` as `spec` on `mesh`, by the types of the mesh axes used.

  Args:
    x: An array or tracer.
    spec: A PartitionSpec of mesh axes.
    mesh: A concrete mesh (outside jit) or an abstract one (inside jit).
    path: The variable path, for error messages.

  Returns:
    `x` placed as `spec`.

  Raises:
    MeshAxisTypeError: If `spec` uses a Manual axis, or, inside jit, shards
      one dimension over a product of Explicit and Auto axes.
    MeshError: If `x` is concrete but `mesh` is abstract.
  """
  types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
  used = [
    m
    for entry in spec
    if entry is not PartitionSpec.UNCONSTRAINED
    for m in _rules.target_axes(entry)
  ]
  manual = [m for m in used if types[m] == AxisType.Manual]
  if manual:
    raise _errors.MeshAxisTypeError(
      f'Cannot place an array{_rules._where(path)} as {spec}: mesh axes '
      f'{manual} are Manual (inside `shard_map`), where each device holds '
      f'its own block. Expected Explicit or Auto axes '
      f'({_rules.describe_mesh(mesh)}). Create sharded variables outside '
      '`shard_map`, or constrain them with the Manual axes removed.'
    )
  if not _is_traced(x) and not isinstance(mesh, jax.sharding.Mesh):
    raise _errors.MeshError(
      f'Expected a concrete mesh to place a concrete array'
      f'{_rules._where(path)}; got the abstract {mesh} (from '
      '`jax.sharding.use_abstract_mesh` or `jax.eval_shape`). Outside jit, '
      'place arrays under `jax.set_mesh(mesh)` or pass `mesh=` a '
      '`jax.sharding.Mesh`.'
    )
  explicit = {m for m in used if types[m] == AxisType.Explicit}
  auto = {m for m in used if types[m] == AxisType.Auto}
  if not explicit and not auto:  # Replicated.
    if not _is_traced(x):
      return jax.device_put(x, NamedSharding(mesh, spec))
    if AxisType.Explicit in types.values():
      return jax.sharding.reshard(x, _sharding_for(mesh, spec))
    return jax.lax.with_sharding_constraint(x, _sharding_for(mesh, spec))
  if not auto:
    return jax.sharding.reshard(x, _sharding_for(mesh, spec))
  if not explicit:
    return jax.lax.with_sharding_constraint(x, _sharding_for(mesh, spec))
  # Mixed.
  if not _is_traced(x):
    return jax.device_put(x, NamedSharding(mesh, spec))
  explicit_part, auto_part = [], []
  for entry in spec:
    axes = _rules.target_axes(entry)
    kinds = {types[m] for m in axes}
    if len(kinds) > 1:
      raise _errors.MeshAxisTypeError(
        f'Cannot shard one dimension{_rules._where(path)} over {entry!r} '
        f'inside jit: it mixes Explicit and Auto mesh axes '
        f'({_rules.describe_mesh(mesh)}), which JAX cannot express in a '
        'traced computation. Use mesh axes of one type for that dimension '
        '(change the rule or the mesh axis types).'
      )
    is_explicit = kinds == {AxisType.Explicit}
    explicit_part.append(entry if is_explicit else None)
    auto_part.append(None if is_explicit else entry)
  x = jax.sharding.reshard(
    x, _sharding_for(mesh, PartitionSpec(*explicit_part))
  )
  return jax.lax.with_sharding_constraint(
    x, _sharding_for(mesh, PartitionSpec(*auto_part))
  )


def _sharding_for(
  mesh: _rules.MeshLike, spec: PartitionSpec
) -> NamedSharding | PartitionSpec:
  if isinstance(mesh, jax.sharding.Mesh):
    return NamedSharding(mesh, spec)
  # Inside jit only the abstract mesh of `jax.set_mesh` is known; a bare
  # spec refers to it.
  return spec


def _concrete_or_current(mesh: _rules.MeshLike | None) -> Any:
  return mesh if mesh is not None else _rules.current_mesh()


def shard_value(
  value: jax.typing.ArrayLike,
  logical_axes: _rules.LogicalAxes | PartitionSpec,
  *,
  mesh: jax.sharding.Mesh | None = None,
  rules: _rules.RulesLike | None = None,
  path: str | None = None,
) -> jax.Array:
  """Places a value by its logical axes, by the mesh's axis types.

  Works eagerly and inside ``jax.jit`` / ``nnx.jit``. Explicit mesh axes are
  placed with ``jax.sharding.reshard``, Auto axes with
  ``jax.lax.with_sharding_constraint``, and a mixed mesh with both.

  Args:
    value: The array to place.
    logical_axes: One logical name (or None) per dimension.
    mesh: The mesh. Defaults to the one set by ``jax.set_mesh``.
    rules: The rules. Defaults to the current `logical_axis_rules`.
    path: A variable path to name in error messages.

  Returns:
    The placed array.

  Raises:
    MeshError: If there is no mesh.
    MeshAxisTypeError: If the mesh axis types forbid the placement.
    UnknownLogicalAxisError: If a name is in no rule.
    ShardingResolutionError: If the names cannot be resolved.

  Example:
    >>> import jax, jax.numpy as jnp, flax_dtensor as fdt
    >>> mesh = jax.make_mesh((2, 4), ('data', 'model'))
    >>> x = fdt.shard_value(jnp.zeros((8, 16)), ('batch', 'mlp'), mesh=mesh,
    ...                     rules=[('batch', 'data'), ('mlp', 'model')])
    >>> x.sharding.spec
    P('data', 'model')
  """
  mesh = _require_mesh(mesh, 'a value', path)
  rules_ = _rules.resolve_rules(rules) or _rules.LogicalRules(())
  if not isinstance(value, jax.Array | jax.core.Tracer):
    value = jax.numpy.asarray(value)
  resolution = _rules.resolve(
    logical_axes, value.shape, mesh=mesh, rules=rules_, path=path
  )
  return apply_spec(value, resolution.spec, mesh, path=path)


def with_logical_constraint(
  x: jax.Array,
  logical_axes: _rules.LogicalAxes | PartitionSpec,
  *,
  mesh: jax.sharding.Mesh | None = None,
  rules: _rules.RulesLike | None = None,
) -> jax.Array:
  """Constrains an activation's sharding by logical axes (inside jit).

  Like Flax Linen's ``nn.with_logical_constraint``, this is a no-op when no
  rules are set or no mesh is available, so model code runs unchanged on one
  device. Otherwise it resolves the names against the mesh and ``x``'s shape
  and places ``x`` by the mesh axis types (see `shard_value`).

  Args:
    x: The array (usually a tracer).
    logical_axes: One logical name (or None) per dimension.
    mesh: The mesh. Defaults to the one set by ``jax.set_mesh``.
    rules: The rules. Defaults to the current `logical_axis_rules`.

  Returns:
    `x`, constrained.

  Raises:
    MeshAxisTypeError: If the mesh axis types forbid the placement.
    UnknownLogicalAxisError: If a name is in no rule.
    ShardingResolutionError: If the names cannot be resolved.
  """
  rules_ = _rules.resolve_rules(rules)
  mesh = _concrete_or_current(mesh)
  if rules_ is None or mesh is None:
    return x
  resolution = _rules.resolve(logical_axes, x.shape, mesh=mesh, rules=rules_)
  return apply_spec(x, resolution.spec, mesh)


# Variables
# ------------------------------------------------------------------------------


def variable_logical_axes(variable: nnx.Variable) -> tuple[Any, ...] | None:
  """The logical axes a variable is annotated with, or None."""
  out_sharding = variable.get_metadata('out_sharding', None)
  if not out_sharding or isinstance(out_sharding, NamedSharding):
    return None
  return tuple(out_sharding)


def variable_rules(
  variable: nnx.Variable, rules: _rules.LogicalRules
) -> _rules.LogicalRules:
  """Composes a variable's own ``sharding_rules`` (first) with `rules`."""
  local = variable.get_metadata('sharding_rules', None)
  return rules.prepend(tuple(local)) if local else rules


def variable_mesh(
  variable: nnx.Variable, mesh: _rules.MeshLike | None
) -> _rules.MeshLike | None:
  own = variable.get_metadata('mesh', None)
  return own if own is not None else _concrete_or_current(mesh)


def resolve_variable(
  variable: nnx.Variable,
  *,
  mesh: _rules.MeshLike | None,
  rules: _rules.LogicalRules,
  path: str | None = None,
) -> _rules.Resolution | None:
  """Resolves an annotated variable; None when it has no logical axes."""
  axes = variable_logical_axes(variable)
  if axes is None:
    return None
  return _rules.resolve(
    axes,
    np.shape(variable.get_value()),
    mesh=variable_mesh(variable, mesh),
    rules=variable_rules(variable, rules),
    path=path,
  )


class _Deferred(threading.local):
  """Placement left to the enclosing jit's output shardings (`init`)."""

  active: bool = False


_deferred = _Deferred()


@contextlib.contextmanager
def _defer_placement() -> Iterator[None]:
  old = _deferred.active
  _deferred.active = True
  try:
    yield
  finally:
    _deferred.active = old


def _shard_value_hook(
  flax_shard_value: Callable[..., Any],
  value: Any,
  out_sharding: Any,
  sharding_rules: Any,
  mesh: Any,
) -> Any:
  rules = _rules.active_rules()
  if rules is not None and _deferred.active:
    # Inside `init`'s jitted build: its output shardings place every
    # variable, and XLA computes each one directly in its shards.
    return value
  if (
    rules is None
    or not out_sharding
    or not isinstance(out_sharding, (tuple, list, PartitionSpec))
  ):
    return flax_shard_value(value, out_sharding, sharding_rules, mesh)
  if sharding_rules:
    rules = rules.prepend(tuple(sharding_rules))
  return shard_value(value, tuple(out_sharding), mesh=mesh, rules=rules)


def _get_var_pspec_hook(
  flax_get_var_pspec: Callable[[nnx.Variable], Any], variable: nnx.Variable
) -> PartitionSpec | None:
  rules = _rules.active_rules()
  if rules is None or variable_logical_axes(variable) is None:
    return flax_get_var_pspec(variable)
  resolution = resolve_variable(variable, mesh=None, rules=rules)
  assert resolution is not None
  return resolution.spec


def install_flax_hooks() -> None:
  """Routes Flax's variable placement and pspec queries through ours.

  Called once, when flax_dtensor is imported; idempotent. The wrappers
  defer to Flax's own functions unless the current rules are `LogicalRules`
  (which only flax_dtensor puts there), so importing flax_dtensor changes
  nothing for code that does not use it.
  """
  if getattr(core_spmd.shard_value, '__flax_dtensor_hook__', False):
    return
  shard_hook = functools.partial(_shard_value_hook, core_spmd.shard_value)
  pspec_hook = functools.partial(_get_var_pspec_hook, nnx_spmd.get_var_pspec)
  for hook in (shard_hook, pspec_hook):
    hook.__flax_dtensor_hook__ = True  # type: ignore[attr-defined]
  core_spmd.shard_value = shard_hook
  nnx_spmd.get_var_pspec = pspec_hook


def _variables(
  node: Any,
) -> list[tuple[tuple[Any, ...], nnx.Variable]]:
  """(path, Variable) for every Variable in a module or state."""
  if isinstance(node, nnx.State):
    leaves = jax.tree_util.tree_flatten_with_path(
      node, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )[0]
    return [
      (tuple(_key_name(k) for k in path), v)
      for path, v in leaves
      if isinstance(v, nnx.Variable)
    ]
  return [
    (tuple(path), v)
    for path, v in nnx.iter_graph(node)
    if isinstance(v, nnx.Variable)
  ]


def _key_name(key: Any) -> Any:
  for attr in ('key', 'name', 'idx'):
    if hasattr(key, attr):
      return getattr(key, attr)
  return key


def path_str(path: Sequence[Any]) -> str:
  """'layers/0/kernel' for a path of keys."""
  return '/'.join(str(k) for k in path)


def shard_module(
  module: nnx.Module,
  *,
  mesh: jax.sharding.Mesh | None = None,
  rules: _rules.RulesLike | None = None,
) -> nnx.Module:
  """Shards, in place, the annotated variables of an existing module.

  For a module built without a mesh (or under other rules): every variable
  with logical axes (``nnx.with_partitioning``) is placed by the rules;
  variables without them are left where they are.

  Args:
    module: The module. Its variables are updated in place.
    mesh: The mesh. Defaults to the one set by ``jax.set_mesh``.
    rules: The rules. Defaults to the current `logical_axis_rules`.

  Returns:
    `module`, for chaining.

  Raises:
    MeshError: If there is no mesh.
    UnknownLogicalAxisError: If a variable names an axis in no rule; the
      message names the variable path.
    ShardingResolutionError: If a variable's axes cannot be resolved.
  """
  rules_ = _rules.resolve_rules(rules) or _rules.LogicalRules(())
  mesh_ = _require_mesh(mesh, 'the variables of a module', None)
  for path, variable in _variables(module):
    resolution = resolve_variable(
      variable, mesh=mesh_, rules=rules_, path=path_str(path)
    )
    if resolution is None:
      continue
    placed = apply_spec(
      variable.get_value(),
      resolution.spec,
      variable_mesh(variable, mesh_),
      path=path_str(path),
    )
    variable.set_value(placed)
  return module


# Scopes and sharded init
# ------------------------------------------------------------------------------


@contextlib.contextmanager
def scope(
  mesh: jax.sharding.Mesh | None, rules: _rules.RulesLike | None
) -> Iterator[None]:
  """Enters ``jax.set_mesh(mesh)`` and `logical_axis_rules(rules)` if given."""
  with contextlib.ExitStack() as stack:
    if mesh is not None:
      stack.enter_context(jax.set_mesh(mesh))
    if rules is not None:
      stack.enter_context(_rules.logical_axis_rules(rules))
    elif _rules.active_rules() is None:
      # Rules set with Flax's own context, or none: read them with
      # flax_dtensor's semantics inside this scope.
      stack.enter_context(
        _rules.logical_axis_rules(_rules.current_rules() or ())
      )
    yield


def _split_graph_args(
  args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[dict[Any, Any], Callable[[dict[Any, Any]], tuple[tuple, dict]]]:
  """Separates graph-node arguments (e.g. `nnx.Rngs`) from static ones."""
  dynamic: dict[Any, Any] = {}
  for i, a in enumerate(args):
    if nnx.graph.is_graph_node(a) or isinstance(a, jax.Array):
      dynamic[i] = a
  for k, a in kwargs.items():
    if nnx.graph.is_graph_node(a) or isinstance(a, jax.Array):
      dynamic[k] = a

  def rebuild(d: dict[Any, Any]) -> tuple[tuple, dict]:
    new_args = tuple(d.get(i, a) for i, a in enumerate(args))
    new_kwargs = {k: d.get(k, a) for k, a in kwargs.items()}
    return new_args, new_kwargs

  return dynamic, rebuild


def init(
  factory: Callable[..., M],
  *args: Any,
  mesh: jax.sharding.Mesh | None = None,
  rules: _rules.RulesLike | None = None,
  **kwargs: Any,
) -> M:
  """Builds a module under ``jax.jit`` so no parameter ever exists unsharded.

  The module is first built abstractly (``nnx.eval_shape``, nothing
  allocated) to learn every variable's sharding under the rules and mesh;
  then ``factory(*args, **kwargs)`` runs under ``nnx.jit`` with those
  shardings as output shardings, so XLA computes each parameter directly in
  its shards. Graph-node arguments (``nnx.Rngs``) are traced and advanced as
  an eager call would; other arguments (sizes, dtypes) are static. The
  result equals an eager build bit for bit.

  Args:
    factory: A callable returning an NNX module, e.g. the module class.
    *args: Positional arguments for `factory`.
    mesh: The mesh. Defaults to the one set by ``jax.set_mesh``.
    rules: The rules. Defaults to the current `logical_axis_rules`.
    **kwargs: Keyword arguments for `factory`.

  Returns:
    The module, every variable placed on the mesh.

  Raises:
    MeshError: If there is no concrete mesh.
    UnknownLogicalAxisError: If a variable names an axis in no rule.
    ShardingResolutionError: If a variable's axes cannot be resolved.

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
  with scope(mesh, rules):
    mesh_ = _rules.current_mesh()
    if not isinstance(mesh_, jax.sharding.Mesh):
      raise _errors.MeshError(
        'Expected a concrete mesh for `fdt.init`, but no mesh is set'
        + (f' (got the abstract {mesh_})' if mesh_ is not None else '')
        + f'. {NO_MESH_MSG}'
      )
    dynamic, rebuild = _split_graph_args(args, kwargs)

    def build(d: dict[Any, Any]) -> M:
      a, k = rebuild(d)
      return factory(*a, **k)

    abstract = nnx.eval_shape(build, dynamic)
    graphdef, abstract_state = nnx.split(abstract)
    # The jitted build runs on an all-Auto copy of the mesh: on Explicit
    # axes an initializer's output is typed replicated, so every device
    # would compute the whole parameter (measured: 7x the model's size in
    # peak memory). With Auto axes the output shardings propagate back into
    # the initializers and XLA computes each shard only. The result is then
    # retyped onto the caller's mesh (same devices, same specs: no copy).
    auto_mesh = jax.sharding.Mesh(
      mesh_.devices,
      mesh_.axis_names,
      axis_types=(AxisType.Auto,) * len(mesh_.axis_names),
    )

    def shardings_on(m: jax.sharding.Mesh) -> nnx.State:
      return jax.tree.map(
        lambda v: NamedSharding(m, _abstract_spec(v)),
        abstract_state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
      )

    @nnx.jit(out_shardings=shardings_on(auto_mesh))
    def create(d: dict[Any, Any]) -> nnx.State:
      with _defer_placement():
        return nnx.state(build(d))

    with jax.set_mesh(auto_mesh):
      state = create(dynamic)
    state = jax.device_put(state, shardings_on(mesh_))
    return nnx.merge(graphdef, state)


def _abstract_spec(variable: nnx.Variable) -> PartitionSpec:
  sharding = getattr(variable.get_value(), 'sharding', None)
  if isinstance(sharding, NamedSharding):
    return sharding.spec
  return PartitionSpec()


install_flax_hooks()
