"""`fdt.plan`: a `ShardingPlan` built from a model, a state, a factory
(built abstractly) or a pytree of arrays, each variable resolved by the
rules as creation and `init` resolve it, its bytes per device counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from flax_dtensor import _errors
from flax_dtensor._placement import (
  _abstract_build,
  _creation_order,
  _placing,
  _trees,
  _variables,
)
from flax_dtensor._planning import _plan
from flax_dtensor._rules import (
  _context,
  _logical,
  _meshes,
  _missing_axes,
  _partition_specs,
  _path_rules,
  _spec,
)


def optimizer_of(model: Any, optimizer: Any, mesh: Any, rules: Any) -> Any:
  """`optimizer` if an nnx.Optimizer; else one built abstractly over `model`."""
  if isinstance(optimizer, nnx.Optimizer):
    return optimizer
  if not (hasattr(optimizer, 'init') and hasattr(optimizer, 'update')):
    raise _errors.NotAModelError(
      f'optimizer= expected an nnx.Optimizer or an optax transformation; '
      f'got {type(optimizer).__name__}. Pass e.g. optax.adamw(1e-3).'
    )
  if not isinstance(model, nnx.Module):
    raise _errors.NotAModelError(
      'optimizer= as an optax transformation needs a module (or factory) to '
      f'optimize; got {type(model).__name__}. Pass the model.'
    )
  with contextlib.ExitStack() as stack:
    if mesh is not None:
      abstract = getattr(mesh, 'abstract_mesh', mesh)
      stack.enter_context(jax.sharding.use_abstract_mesh(abstract))
    if isinstance(rules, _logical.LogicalRules):
      stack.enter_context(_context.logical_axis_rules(rules))
    return nnx.eval_shape(
      lambda m: nnx.Optimizer(m, optimizer, wrt=nnx.Param), model
    )


def _category(variable: Any) -> str:
  if isinstance(variable, nnx.Param):
    return 'params'
  if isinstance(variable, nnx.OptState):
    return 'optimizer'
  return 'other'


def is_factory(x: Any) -> bool:
  return (
    callable(x)
    and not nnx.graph.is_node(x)
    and not isinstance(x, nnx.State | nnx.Variable)
  )


def _dim_label(resolution: Any, i: int) -> str:
  """ "'embed'" for a logical name; "P entry 'data'" for a path rule's spec."""
  if resolution.mesh_axes:
    return (
      f'P entry {_partition_specs.format_entry(resolution.logical_axes[i])}'
    )
  return repr(resolution.logical_axes[i])


def _variable_rows(
  module_or_state: Any,
  rules: _logical.LogicalRules | _context.FlaxRules,
  mesh: Any,
  optimizer: Any,
) -> list[tuple[str, str, str, Any, Any, type, bool, str | None, Any]]:
  """(path, kind, category, value, resolution, type, created eagerly
  sharded, how flax_dtensor created it, the mesh it names if not `mesh`)
  of every variable."""
  if is_factory(module_or_state):
    module_or_state = _abstract_build.build_abstract(
      module_or_state, mesh=mesh, rules=rules
    )
  variables = list(_variables.iter_variables(module_or_state))
  if optimizer is not None:
    variables += [
      (('optimizer', *path), v)
      for path, v in _variables.iter_variables(
        optimizer_of(module_or_state, optimizer, mesh, rules)
      )
    ]
  rows = []
  for path, variable in variables:
    where = _variables.path_str(path)
    rows.append(
      (
        where,
        type(variable).__name__,
        _category(variable),
        _spec.value_of(variable),
        _spec.spec_of_variable(variable, rules=rules, mesh=mesh, path=where),
        type(variable),
        bool(variable.get_metadata('eager_sharding', True)),
        _creation_order.note_of(variable),
        _own_mesh(variable, mesh),
      )
    )
  return rows


def _own_mesh(variable: nnx.Variable, mesh: Any) -> Any:
  """The mesh a variable names for itself (its ``mesh`` metadata, or its
  concrete ``out_sharding``'s), if it is not `mesh`; else None."""
  own = _spec.named_mesh_of(variable)
  if not isinstance(own, jax.sharding.Mesh | jax.sharding.AbstractMesh):
    return None
  if mesh is not None and (
    own == mesh or getattr(own, 'abstract_mesh', own) == mesh
  ):
    return None
  return own


def mesh_label(mesh: Any) -> str:
  """'a=2, b=2 (devices 0-3)' (concrete) or 'a=2, b=2' (abstract)."""
  axes = ', '.join(f'{k}={v}' for k, v in _meshes.axis_sizes(mesh).items())
  if not isinstance(mesh, jax.sharding.Mesh):
    return axes
  ids = [d.id for d in mesh.devices.flat]
  if ids == list(range(ids[0], ids[0] + len(ids))):
    devices = f'{ids[0]}-{ids[-1]}' if len(ids) > 1 else str(ids[0])
  else:
    devices = ', '.join(map(str, ids))
  return f'{axes} (devices {devices})'


def _devices_of(meshes: Sequence[Any]) -> int:
  """How many devices `meshes` span together (abstract ones by size)."""
  ids: set[Any] = set()
  for m in meshes:
    if isinstance(m, jax.sharding.Mesh):
      ids.update(d.id for d in m.devices.flat)
    else:
      ids.update(('abstract', i) for i in range(math.prod(m.axis_sizes)))
  return max(len(ids), 1)


def _misplaced_reason(eager: bool) -> str:
  if not eager:
    return f'{_placing.EAGER_OFF_REASON}. {_placing.EAGER_OFF_FIX}'
  return (
    'placed by other rules, on another mesh or by hand; '
    '`fdt.shard_module(model)` places it as the rules say'
  )


def plan(
  module_or_state: Any,
  *,
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
  rules: _logical.RulesLike | None = None,
  optimizer: Any = None,
  logical_axes: Any = None,
) -> _plan.ShardingPlan:
  """Plans the sharding of every variable of a module, state or factory.

  Works on an abstract model (``nnx.eval_shape``) without allocating it, and
  on a factory (``lambda: Model(...)``), which it builds abstractly, in time
  linear in the number of variables (10,000 take seconds). For
  every variable: shape, dtype, logical axes, the resolved PartitionSpec,
  bytes per device, and each fallback taken with its reason. For arrays
  that are already placed, bytes per device count the actual placement, and
  an entry whose placement differs from the rules shows both (see
  `_plan.PlanEntry.misplaced`). Each entry says what decided it
  (`_plan.PlanEntry.source`): the variable's annotation, a path rule, or nothing.
  A plain pytree of arrays (a weights dict) is planned as `shard_tree`
  places it: by path rules, and by `logical_axes`.

  Args:
    module_or_state: An NNX module, an ``nnx.Optimizer``, or an
      ``nnx.State`` (concrete or abstract); or a factory taking no arguments
      that builds one; or a pytree of arrays (NumPy, JAX, or
      ``jax.ShapeDtypeStruct``).
    mesh: The mesh. Defaults to the one set by ``jax.set_mesh``, else each
      array's own mesh.
    rules: The rules. Defaults to the rules in effect (see
      `get_logical_axis_rules`): the plan says what creation, `init`,
      `shard_module` and ``nnx.get_partition_spec`` do under them.
    optimizer: Also plan an optimizer's state, under ``optimizer/``: an
      ``nnx.Optimizer`` of the model, or an optax transformation, for which
      ``nnx.Optimizer(model, optimizer, wrt=nnx.Param)`` is built
      abstractly (its mu and nu placed like their params). See
      `_plan.ShardingPlan.bytes_per_device_by_category`.
    logical_axes: For a pytree of arrays: a tree of the same structure
      holding each array's logical axes, or None (see `shard_tree`).

  Returns:
    The plan, its variables in natural path order ('layers/2' before
    'layers/10').

  Raises:
    NotAModelError: If `module_or_state` is none of these, or the factory
      builds no NNX module.
    UnknownLogicalAxisError: If a variable names an axis in no rule; the
      message names the variable path.
    ShardingResolutionError: If a variable's axes cannot be resolved.
    MissingMeshAxisError: If the rules say ``missing_mesh_axes='error'``
      and one names a mesh axis the mesh lacks.

  A rule naming a mesh axis the mesh lacks but spelled like one it has (a
  likely typo, see `LikelyTypoWarning`) is the plan's headline
  (`_plan.ShardingPlan.likely_typos`) rather than a warning.

  Example:
    Plan a model for a mesh of 256 devices, without any device or memory:

    >>> import jax, flax_dtensor as fdt
    >>> from flax import nnx
    >>> init = nnx.with_partitioning(nnx.initializers.ones, ('embed', 'mlp'))
    >>> mesh = jax.sharding.AbstractMesh((16, 16), ('data', 'model'))
    >>> rules = [('embed', 'data'), ('mlp', 'model'), ('mlp', None)]
    >>> with jax.sharding.use_abstract_mesh(mesh), fdt.logical_axis_rules(rules):
    ...   model = nnx.eval_shape(
    ...       lambda: nnx.Linear(64, 24, kernel_init=init, rngs=nnx.Rngs(0)))
    ...   p = fdt.plan(model)
    >>> p['kernel'].spec
    P('data', None)
    >>> print(*p['kernel'].fallbacks)
    dim 1 ('mlp'): 'model': dim size 24 is not divisible by 16
    (mesh axes ['model'])

    Or from the factory, with the mesh and rules as arguments:

    >>> fdt.plan(lambda: nnx.Linear(64, 24, kernel_init=init,
    ...                             rngs=nnx.Rngs(0)),
    ...          mesh=mesh, rules=rules)['kernel'].spec
    P('data', None)
  """
  rules_ = _context.rules_in_effect(rules)
  mesh_ = _meshes.mesh_for(mesh=mesh)
  sizes = _meshes.axis_sizes(mesh_) if mesh_ is not None else None
  with _missing_axes.reported_elsewhere():  # By the headline.
    if sizes is not None and isinstance(rules_, _logical.LogicalRules):
      _missing_axes.check_on_mesh(rules_, sizes)  # Raises if they say so.
    own_meshes: list[Any] = []
    entries = _entries(
      module_or_state,
      rules_,
      mesh_,
      sizes,
      optimizer,
      logical_axes,
      own_meshes,
    )
  num_devices = math.prod(sizes.values()) if sizes else 1
  if own_meshes:  # Variables on meshes of their own: every device counts.
    num_devices = _devices_of([*own_meshes, *([mesh_] if mesh_ else [])])
  typos = _missing_axes.likely_typos(
    rules_, None if sizes is None else list(sizes)
  )
  return _plan.ShardingPlan(
    entries=tuple(entries),
    mesh_axes=sizes,
    num_devices=num_devices,
    likely_typos=(*map(str, typos), *_unknown_name_typos(entries, rules_)),
  )


def unknown_names(
  entries: Sequence[_plan.PlanEntry], rules: Any
) -> dict[str, list[str]]:
  """{name: the paths naming it} for each logical name of the entries that
  no rule of `rules` mentions (ours: Flax's rules have no such names)."""
  if not isinstance(rules, _logical.LogicalRules):
    return {}
  where: dict[str, list[str]] = {}
  for e in entries:
    for name in e.logical_axes or ():
      if isinstance(name, str) and name not in rules.names:
        where.setdefault(name, []).append(e.path)
  return where


def _unknown_name_typos(
  entries: Sequence[_plan.PlanEntry], rules: Any
) -> list[str]:
  """A line for each logical name that no rule mentions (replicated) but
  spelled like one they do: "'embedd' (at kernel) is in no rule, so it is
  replicated: did you mean 'embed'?"."""
  out = []
  for name, paths in unknown_names(entries, rules).items():
    hint = _missing_axes.meant_hint(name, rules.names)
    if hint:
      more = f' and {len(paths) - 1} more' if len(paths) > 1 else ''
      out.append(
        f'{name!r} (at {paths[0]}{more}) is in no rule, so it is '
        f'replicated{hint}'
      )
  return out


def _entries(
  module_or_state: Any,
  rules_: _logical.LogicalRules | _context.FlaxRules,
  mesh_: Any,
  sizes: dict[str, int] | None,
  optimizer: Any,
  logical_axes: Any,
  own_meshes: list[Any] | None = None,
) -> list[_plan.PlanEntry]:
  """The plan's entries, in natural path order; the meshes variables name
  for themselves (other than `mesh_`) are appended to `own_meshes`."""
  if _trees.is_array_tree(module_or_state):
    if optimizer is not None:
      raise _errors.NotAModelError(
        'optimizer= needs an NNX module to optimize; got a pytree of '
        'arrays. Plan the optimizer state as a tree of its own.'
      )
    items, _ = _trees.resolved(
      module_or_state, rules=rules_, mesh=mesh_, logical_axes=logical_axes
    )
    rows = [
      (path, 'array', 'other', leaf, resolution, None, True, None, None)
      for path, leaf, resolution in items
    ]
  else:
    if logical_axes is not None:
      raise _errors.NotAModelError(
        '`logical_axes=` is for a pytree of arrays; the variables of an '
        f'NNX {type(module_or_state).__name__} carry their own (annotate '
        'them, or use path rules).'
      )
    rows = _variable_rows(module_or_state, rules_, mesh_, optimizer)
  entries = []
  for (
    where,
    kind,
    category,
    value,
    resolution,
    variable_type,
    eager,
    creation,
    own_mesh,
  ) in rows:
    # A variable naming its own mesh goes there (as creation and `init`
    # place it): its sizes, not the plan's, split it.
    entry_sizes = sizes if own_mesh is None else _meshes.axis_sizes(own_mesh)
    if own_mesh is not None and own_meshes is not None:
      own_meshes.append(own_mesh)
    shape = tuple(getattr(value, 'shape', np.shape(value)))
    dtype = _spec.dtype_of(value)
    placed = _spec.placed_spec(value)
    if resolution is None:
      # Not governed by rules: it stays where it is (replicated if new),
      # one entry per dimension whether placed or abstract.
      spec = _partition_specs.full_length(
        placed if placed is not None else PartitionSpec(), len(shape)
      )
      axes = None
      fallbacks: tuple[str, ...] = ()
    else:
      spec = resolution.spec
      axes = None if resolution.mesh_axes else resolution.logical_axes
      fallbacks = tuple(
        f'dim {i} ({_dim_label(resolution, i)}): {skip}'
        for i, skip in resolution.skipped
      )
    itemsize = _path_rules.itemsize(dtype)
    if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer):
      # A concrete array: count the bytes where it really is.
      per_device = math.prod(value.sharding.shard_shape(shape)) * itemsize
    else:
      per_device = (
        math.prod(_plan.shard_shape(shape, spec, entry_sizes)) * itemsize
      )
    entries.append(
      _plan.PlanEntry(
        path=where,
        kind=kind,
        shape=shape,
        dtype=str(dtype),
        logical_axes=axes,
        spec=spec,
        bytes=math.prod(shape) * itemsize,
        bytes_per_device=per_device,
        fallbacks=fallbacks,
        placed=placed,
        category=category,
        source=_spec.source_of(
          resolution, where, variable_type, shape, value, rules_
        ),
        creation=creation,
        mesh=None if own_mesh is None else mesh_label(own_mesh),
        mesh_axes=entry_sizes,
      )
    )
    if entries[-1].misplaced:
      entries[-1] = dataclasses.replace(
        entries[-1], misplaced_reason=_misplaced_reason(eager)
      )
  entries.sort(key=lambda e: _variables.natural_key(e.path))
  return entries
