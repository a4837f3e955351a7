"""Placing arrays by the types of the mesh axes their spec uses.

Explicit axes: ``jax.sharding.reshard``. Auto axes:
``jax.lax.with_sharding_constraint``. A mixed mesh: both inside ``jit``
(``reshard`` to the Explicit part, then a constraint for the Auto part), and
one ``jax.device_put`` outside it. `shard_value`, `with_logical_constraint`
and `shard_module` resolve logical axes first (`_variables`,
`_resolution`), then place; `place_by_path_rules` places what path rules
cover when a module's construction ends.

It stays one module past 600 lines: its entry points share one rule by
axis type (`apply_spec`, what is already placed, `_is_placed`, and what is
traced, `_is_traced`), which a split would leave half on each side.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental.layout import Format
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from flax_dtensor import _errors, _output
from flax_dtensor._placement import _creation, _creation_order, _variables
from flax_dtensor._rules import (
  _context,
  _logical,
  _meshes,
  _partition_specs,
  _resolution,
  _spec,
)

NO_MESH_MSG = (
  'Set one with `jax.set_mesh(mesh)` (a context manager), or pass `mesh=`. '
  'To build a model without a mesh and shard it later, build it under '
  '`nnx.use_eager_sharding(False)` and call `fdt.shard_module`.'
)


def _is_traced(x: Any) -> bool:
  return isinstance(x, jax.core.Tracer)


def require_mesh(
  mesh: _meshes.MeshLike | None, what: str, path: str | None = None
) -> _meshes.MeshLike:
  """`mesh`, or the context's; raises `MeshError` if there is none."""
  mesh = _meshes.mesh_for(mesh=mesh)
  if mesh is None:
    raise _errors.MeshError(
      f'Expected a mesh to place {what}{_resolution.where(path)}, but no '
      f'mesh is set. {NO_MESH_MSG}'
    )
  return mesh


def apply_spec(
  x: jax.Array,
  spec: PartitionSpec,
  mesh: _meshes.MeshLike,
  *,
  path: str | None = None,
) -> jax.Array:
  """Places `x` as `spec` on `mesh`, by the types of the mesh axes used.

  Args:
    x: An array or tracer (or a concrete array inside jit, closed over).
    spec: A PartitionSpec of mesh axes.
    mesh: A concrete mesh (outside jit) or an abstract one (inside jit).
    path: The variable path, for error messages.

  Returns:
    `x` placed as `spec`.

  Raises:
    MeshAxisTypeError: If `spec` uses a Manual axis, or, inside jit, shards
      one dimension over a product of Explicit and Auto axes.
    MeshError: If `x` is concrete, outside jit, but `mesh` is abstract.
  """
  types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
  used = [
    m
    for entry in spec
    if entry is not PartitionSpec.UNCONSTRAINED
    for m in _partition_specs.axes_of(entry)
  ]
  manual = [m for m in used if types[m] == AxisType.Manual]
  if manual:
    raise _errors.MeshAxisTypeError(
      f'Cannot place an array{_resolution.where(path)} as {spec}: mesh axes '
      f'{manual} are Manual (inside `shard_map`), where each device holds '
      f'its own block. Expected Explicit or Auto axes '
      f'({_meshes.describe(mesh)}). Create sharded variables outside '
      '`shard_map`, or constrain them with the Manual axes removed.'
    )
  # A concrete array inside a trace (one a jitted function closes over) is
  # placed as a tracer is: `reshard` and `with_sharding_constraint` take it
  # there, on the abstract mesh of `jax.set_mesh`.
  traced = _is_traced(x) or (
    not isinstance(mesh, jax.sharding.Mesh) and _creation_order.traced((), {})
  )
  if not traced and not isinstance(mesh, jax.sharding.Mesh):
    given = (
      'in effect by `jax.sharding.use_abstract_mesh`'
      if _meshes.context_meshes()[0] == mesh
      else 'passed as `mesh=`'
    )
    raise _errors.MeshError(
      f'Expected a concrete mesh to place a concrete array'
      f'{_resolution.where(path)} outside jit, where JAX needs the devices; '
      f'got the abstract {_meshes.describe(mesh)} ({given}), which has '
      'none. '
      + (
        _meshes.devices_hint(mesh)
        or 'Pass `mesh=` a `jax.sharding.Mesh`, or place the array under '
        '`jax.set_mesh(mesh)` (inside `jax.jit` the abstract mesh is '
        'enough, for traced and closed-over arrays alike).'
      )
    )
  if not traced and _is_placed(x, spec, mesh):
    return x  # Already there (created in its shards, see `_creation`).
  if not traced and not _on_devices_of(x, mesh):
    # A variable naming its own mesh, created under a context mesh of other
    # devices: `reshard` refuses to cross devices, a copy does not.
    return jax.device_put(x, NamedSharding(mesh, spec))
  explicit = {m for m in used if types[m] == AxisType.Explicit}
  auto = {m for m in used if types[m] == AxisType.Auto}
  if not explicit and not auto:  # Replicated.
    if not traced:
      return jax.device_put(x, NamedSharding(mesh, spec))
    if AxisType.Explicit in types.values():
      return jax.sharding.reshard(x, _sharding_for(mesh, spec))
    return jax.lax.with_sharding_constraint(x, _sharding_for(mesh, spec))
  if not auto:
    return jax.sharding.reshard(x, _sharding_for(mesh, spec))
  if not explicit:
    return jax.lax.with_sharding_constraint(x, _sharding_for(mesh, spec))
  # Mixed.
  if not traced:
    return jax.device_put(x, NamedSharding(mesh, spec))
  explicit_part, auto_part = [], []
  for entry in spec:
    axes = _partition_specs.axes_of(entry)
    kinds = {types[m] for m in axes}
    if len(kinds) > 1:
      raise _errors.MeshAxisTypeError(
        f'Cannot shard one dimension{_resolution.where(path)} over {entry!r} '
        f'inside jit: it mixes Explicit and Auto mesh axes '
        f'({_meshes.describe(mesh)}), which JAX cannot express in a '
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


def _is_placed(x: Any, spec: PartitionSpec, mesh: jax.sharding.Mesh) -> bool:
  """Whether `x` is where `spec` says, with the type `spec` gives it.

  On Explicit axes the spec is part of the array's type, axes of size 1
  included (``f32[32@data,16]`` on a mesh of one device): an array placed
  alike but typed otherwise is not there, or eager and jitted code would
  see different types (jit types the result of `reshard`).
  """
  sharding = getattr(x, 'sharding', None)
  ndim = np.ndim(x)
  if not (
    isinstance(sharding, NamedSharding)
    and sharding.mesh == mesh
    and sharding.is_equivalent_to(NamedSharding(mesh, spec), ndim)
  ):
    return False
  explicit = {
    n
    for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
    if t == AxisType.Explicit
  }
  if not explicit:
    return True

  def typed(s: PartitionSpec) -> tuple[tuple[str, ...], ...]:
    return tuple(
      tuple(a for a in axes if a in explicit)
      for axes in _partition_specs.canonical(s, ndim)
    )

  return typed(sharding.spec) == typed(spec)


def _on_devices_of(x: Any, mesh: jax.sharding.Mesh) -> bool:
  """Whether concrete `x` lies on exactly the devices of `mesh`."""
  devices = getattr(x, 'devices', None)
  return devices is None or devices() == set(mesh.devices.flat)


def _sharding_for(
  mesh: _meshes.MeshLike, spec: PartitionSpec
) -> NamedSharding | PartitionSpec:
  if isinstance(mesh, jax.sharding.Mesh):
    return NamedSharding(mesh, spec)
  # Inside jit only the abstract mesh of `jax.set_mesh` is known; a bare
  # spec refers to it.
  return spec


def shard_value(
  value: jax.typing.ArrayLike,
  logical_axes: _logical.LogicalAxes | PartitionSpec,
  *,
  mesh: jax.sharding.Mesh | None = None,
  rules: _logical.RulesLike | None = None,
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
    rules: The rules. Defaults to the rules in effect (see
      `get_logical_axis_rules`).
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
  mesh = require_mesh(mesh, 'a value', path)
  if not isinstance(value, jax.Array | jax.core.Tracer):
    value = jax.numpy.asarray(value)
  resolution = _resolution.resolve(
    logical_axes,
    value.shape,
    mesh=mesh,
    rules=_context.rules_in_effect(rules),
    path=path,
  )
  return apply_spec(value, resolution.spec, mesh, path=path)


def with_logical_constraint(
  x: jax.Array,
  logical_axes: _logical.LogicalAxes | PartitionSpec,
  *,
  mesh: jax.sharding.Mesh | None = None,
  rules: _logical.RulesLike | None = None,
) -> jax.Array:
  """Constrains an activation's sharding by logical axes (inside jit).

  Like Flax Linen's ``nn.with_logical_constraint``, this is a no-op when no
  rules are set or no mesh is available, so model code runs unchanged on one
  device. Otherwise it resolves the names against the mesh and ``x``'s shape
  (with the semantics of the rules in effect, see `get_logical_axis_rules`)
  and places ``x`` by the mesh axis types (see `shard_value`).

  Wherever ``jax.sharding.reshard`` and ``with_sharding_constraint`` work,
  this does: on a tracer, on a concrete array a jitted function closes over
  (a train step's batch), and eagerly under ``jax.set_mesh``.

  Args:
    x: The array (usually a tracer).
    logical_axes: One logical name (or None) per dimension.
    mesh: The mesh. Defaults to the one set by ``jax.set_mesh``.
    rules: The rules. Defaults to the rules in effect.

  Returns:
    `x`, constrained.

  Raises:
    MeshAxisTypeError: If the mesh axis types forbid the placement.
    MeshError: If `x` is concrete, outside jit, and the mesh is abstract.
    UnknownLogicalAxisError: If a name is in no rule.
    ShardingResolutionError: If the names cannot be resolved.
  """
  rules_ = _context.rules_in_effect(rules)
  mesh = _meshes.mesh_for(mesh=mesh)
  if mesh is None or (
    isinstance(rules_, _context.FlaxRules) and not rules_.pairs
  ):
    return x
  resolution = _resolution.resolve(
    logical_axes, x.shape, mesh=mesh, rules=rules_
  )
  return apply_spec(x, resolution.spec, mesh)


EAGER_OFF_REASON = (
  'created while eager sharding was off (its `eager_sharding` metadata is '
  'False: flax.config.flax_always_shard_variable was False, which some '
  'libraries set when they are imported, or nnx.use_eager_sharding(False) '
  'was in effect), so Flax left it where it was created'
)
"""Why a variable the rules cover is not where they say (the plan's reason)."""

EAGER_OFF_FIX = (
  'Build the model inside `with nnx.use_eager_sharding(True):`, or with '
  '`fdt.init(...)` (which places every variable whatever the flag), or '
  'place it afterwards with `fdt.shard_module(model)`.'
)


def warn_unplaced(module: Any, rules: _logical.LogicalRules) -> None:
  """Warns that a module built under our rules was not placed.

  Called when the outermost ``nnx.Module`` constructor returns under our
  rules while eager sharding is off. Said once per rules context
  (`_context.first_time_in_context`), with `EagerShardingOffWarning`, when
  the global flag ``flax_always_shard_variable`` is off (another library
  may have turned it off at import) and a concrete mesh is set: the user
  asked for placement with the rules and the mesh, and got none. A
  ``nnx.use_eager_sharding(False)`` block of the user's own, with the flag
  on, is a deliberate choice: nothing is said (the plan still gives the
  reason).
  """
  import flax

  if flax.config.flax_always_shard_variable:
    return
  mesh = _meshes.mesh_for()
  if not isinstance(mesh, jax.sharding.Mesh):
    return
  if not _context.first_time_in_context('eager-sharding-off'):
    return
  unplaced = []
  for where, variable in _variables.iter_variables(module):
    value = _spec.value_of(variable)
    if _is_traced(value) or variable.get_metadata('eager_sharding', True):
      continue
    try:
      resolution = _spec.spec_of_variable(
        variable, rules=rules, mesh=mesh, path=_variables.path_str(where)
      )
    except (ValueError, TypeError):  # Resolution errors: unplaced as well.
      resolution = None
      unplaced.append(_variables.path_str(where))
      continue
    if resolution is not None and not _is_placed(value, resolution.spec, mesh):
      unplaced.append(_variables.path_str(where))
  if not unplaced:
    # Nothing to say here: ask again in this context for the next module.
    _context.forget_in_context('eager-sharding-off')
    return
  _output.warn(
    f'flax_dtensor did not place {len(unplaced)} variables of '
    f'{type(module).__name__} that the rules in effect cover (e.g. '
    f'{_variables.listing(unplaced, 3)}) on {_meshes.describe(mesh)}: '
    'eager sharding is off (flax.config.flax_always_shard_variable is '
    'False; some libraries turn it off when they are imported), so Flax '
    f'created them unsharded. {EAGER_OFF_FIX} Said once per '
    '`fdt.logical_axis_rules` block.',
    _errors.EagerShardingOffWarning,
  )


def place_by_path_rules(
  module: Any,
  rules: _logical.LogicalRules,
  order: _creation_order.Order | None = None,
) -> None:
  """Moves the variables path rules cover to their placement, once.

  Called when the outermost ``nnx.Module`` constructor returns under path
  rules (`flax_dtensor._hook`): by then every variable has its path in the new module.
  Variables placed already (built in their shards by the creation `order`,
  or by an earlier module's construction) are not moved again; those moved
  here are noted with the reason (`_creation_order.note_of`). Nothing moves
  when eager sharding is off (``nnx.use_eager_sharding(False)``, or a
  variable's own ``eager_sharding=False``), as for annotated variables.

  Raises:
    MeshError: If a path rule covers a variable but no mesh is set.
    ShardingResolutionError: If a rule's target does not fit a variable.
  """
  if not nnx.using_eager_sharding():
    return
  for where, variable, resolution in _variables.resolved(
    module, rules=rules, mesh=None
  ):
    if resolution is None or not resolution.by_path_rule:
      continue
    if not variable.get_metadata('eager_sharding', True):
      continue
    value = _spec.value_of(variable)
    mesh = _meshes.mesh_for(variable, value=value)
    if mesh is None or (
      not _is_traced(value) and not isinstance(mesh, jax.sharding.Mesh)
    ):
      raise _errors.MeshError(
        f'Expected a mesh to place the variable at {where}, which '
        f'{resolution.source} covers, but no mesh is set. {NO_MESH_MSG}'
      )
    if _is_traced(value) or not _is_placed(value, resolution.spec, mesh):
      if order is not None and order.strict:
        raise _creation.NotInShards(where)
      placed = apply_spec(value, resolution.spec, mesh, path=where)
      variable.set_value(in_layout(placed, variable, mesh, resolution.spec))
      if not _is_traced(value):
        _creation_order.note(variable, _moved_at_return(order))


def _moved_at_return(order: _creation_order.Order | None) -> str:
  why = (
    'there was no creation order to follow (no concrete mesh when it was '
    'created, or an abstract build of the model failed)'
    if order is None
    else order.stopped
    or 'the abstract build did not predict where it ends (it was built '
    'inside a transform such as nnx.vmap, or its path differed)'
  )
  return f'{_creation_order.MOVED}the outermost constructor returned: {why}'


def in_layout(
  x: jax.Array, variable: nnx.Variable, mesh: Any, spec: PartitionSpec
) -> jax.Array:
  """`x`, placed as `spec`, in the layout the variable's Format names."""
  layout = _spec.layout_of(variable)
  if layout is None:
    return x
  target = Format(layout, _sharding_for_format(mesh, spec))
  if _is_traced(x):
    return jax.lax.with_sharding_constraint(x, target)
  return jax.device_put(x, target)


def _sharding_for_format(mesh: Any, spec: PartitionSpec) -> NamedSharding:
  if not isinstance(mesh, jax.sharding.Mesh | jax.sharding.AbstractMesh):
    mesh = jax.sharding.get_abstract_mesh()
  return NamedSharding(mesh, spec)


def place_concrete(
  value: Any,
  out_sharding: NamedSharding | Format,
  *,
  rules: _logical.LogicalRules | _context.FlaxRules,
  local_rules: Any = None,
) -> Any:
  """A new variable's value placed by its concrete ``out_sharding``.

  What Flax's ``shard_value`` means for a ``NamedSharding`` or a ``Format``
  (where it fails: an assertion that compares the context's abstract mesh
  with a concrete one, or ``Format`` has no ``.mesh``): the sharding's own
  mesh and spec, by the mesh axis types (`apply_spec`), in the Format's
  layout. Under Flax's rules, the spec's names are renamed by them first,
  as Flax does; our rules leave a concrete sharding's mesh axes alone.
  """
  named = (
    out_sharding.sharding
    if isinstance(out_sharding, Format)
    else (out_sharding)
  )
  spec = named.spec
  if not isinstance(rules, _logical.LogicalRules):
    from flax.core import spmd as core_spmd

    spec = core_spmd.apply_rules(spec, local_rules)
  placed = apply_spec(value, spec, named.mesh)
  if isinstance(out_sharding, Format):
    target = Format(out_sharding.layout, NamedSharding(named.mesh, spec))
    if _is_traced(placed):
      return jax.lax.with_sharding_constraint(placed, target)
    return jax.device_put(placed, target)
  return placed


def type_concrete(out: Any) -> None:
  """Gives abstract variables their concrete ``out_sharding``, layout kept.

  For ``nnx.as_abstract`` and ``nnx.get_abstract_model``: Flax types an
  abstract variable with ``NamedSharding(mesh, spec)`` on the context's
  mesh, which drops a ``Format``'s layout. A variable whose
  ``out_sharding`` is a ``NamedSharding`` or ``Format`` gets that sharding
  (its spec as `_spec.spec_of_variable` resolves it), in its layout.
  """
  rules = _context.rules_in_effect()
  for where, variable in _variables.iter_variables(out):
    concrete = _spec.concrete_sharding_of(variable)
    value = _spec.value_of(variable)
    if concrete is None or not isinstance(value, jax.ShapeDtypeStruct):
      continue
    resolution = _spec.spec_of_variable(
      variable, rules=rules, path=_variables.path_str(where)
    )
    spec = concrete.spec if resolution is None else resolution.spec
    variable.set_value(
      jax.ShapeDtypeStruct(
        value.shape,
        value.dtype,
        sharding=_spec.sharding_for(variable, concrete.mesh, spec),
        weak_type=value.weak_type,
      )
    )


def type_abstract(out: Any, rules: _logical.LogicalRules) -> None:
  """Gives abstract variables the sharding path rules give them.

  For ``nnx.eval_shape``'s result: in each graph node of `out`, a variable
  a path rule covers (by its path in that node) whose value is a
  ``jax.ShapeDtypeStruct`` with a ``NamedSharding`` gets the rule's spec on
  the same mesh. Explicit axes are in the type already; Auto axes are not,
  and Flax would name the variable replicated.
  """
  nodes = jax.tree_util.tree_leaves(
    out, is_leaf=lambda x: nnx.graph.is_graph_node(x)
  )
  for node in nodes:
    if not nnx.graph.is_graph_node(node):
      continue
    for _, variable, resolution in _variables.resolved(
      node, rules=rules, mesh=None
    ):
      value = _spec.value_of(variable)
      sharding = getattr(value, 'sharding', None)
      if (
        resolution is None
        or not resolution.by_path_rule
        or not isinstance(value, jax.ShapeDtypeStruct)
        or not isinstance(sharding, NamedSharding)
      ):
        continue
      variable.set_value(
        jax.ShapeDtypeStruct(
          value.shape,
          value.dtype,
          sharding=NamedSharding(sharding.mesh, resolution.spec),
          weak_type=value.weak_type,
        )
      )


def shard_module(
  module: nnx.Module,
  *,
  mesh: jax.sharding.Mesh | None = None,
  rules: _logical.RulesLike | None = None,
) -> nnx.Module:
  """Shards, in place, the variables of an existing module by the rules.

  For a module built without a mesh (or under other rules): every variable
  with logical axes (``nnx.with_partitioning``) is placed by the rules, and
  every variable a path rule covers by that rule (the path is the
  variable's path in `module`). Every other variable ends on the mesh too:
  one on a single device (or a NumPy value) is replicated over it, one
  already sharded stays as it is, as `plan` reports.

  Args:
    module: The module. Its variables are updated in place.
    mesh: The mesh. Defaults to the one set by ``jax.set_mesh``.
    rules: The rules. Defaults to the rules in effect (see
      `get_logical_axis_rules`).

  Returns:
    `module`, for chaining.

  Raises:
    MeshError: If there is no mesh.
    NotAModelError: If `module` is not an NNX module, graph node or state.
    UnknownLogicalAxisError: If a variable names an axis in no rule; the
      message names the variable path.
    ShardingResolutionError: If a variable's axes cannot be resolved, or a
      path rule's target does not fit a variable it matches.
  """
  rules_ = _context.rules_in_effect(rules)
  mesh_ = require_mesh(mesh, 'the variables of a module')
  for where, variable, resolution in _variables.resolved(
    module, rules=rules_, mesh=mesh_
  ):
    if resolution is None:
      value = _spec.value_of(variable)
      if (
        _spec.placed_spec(value) is None
        and isinstance(value, jax.Array | np.ndarray | np.generic)
        and not _is_traced(value)
      ):
        # On no mesh yet: replicated on this one, as the plan says.
        variable.set_value(
          jax.device_put(value, NamedSharding(mesh_, PartitionSpec()))
        )
      continue
    target_mesh = _meshes.mesh_for(variable, mesh=mesh_)
    placed = apply_spec(
      _spec.value_of(variable), resolution.spec, target_mesh, path=where
    )
    variable.set_value(
      in_layout(placed, variable, target_mesh, resolution.spec)
    )
  return module
