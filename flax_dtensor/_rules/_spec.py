"""Each variable's spec: where it goes, and why.

`spec_of_variable` answers "where does this variable go" for the plan, the
Flax hook, placement, `init` and restore alike (`spec_of_array` for a plain
array in a pytree): its annotation, or the path rule its path matches; and
what a variable names for itself (`logical_axes_of`, `named_mesh_of`,
`layout_of`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding, PartitionSpec

from flax_dtensor._rules import (
  _context,
  _logical,
  _meshes,
  _missing_axes,
  _path_rules,
  _resolution,
)


def value_of(variable: nnx.Variable) -> Any:
  """The variable's array (or ShapeDtypeStruct), without hooks."""
  value = variable.get_raw_value()
  if nnx.variablelib.is_array_ref(value):
    value = value[...]
  return value


def logical_axes_of(variable: nnx.Variable) -> tuple[Any, ...] | None:
  """The logical axes a variable is annotated with, or None.

  None for a variable without ``out_sharding`` metadata, and for one whose
  ``out_sharding`` is a concrete sharding (a ``NamedSharding`` or a
  ``Format``) rather than names.
  """
  out_sharding = variable.get_metadata('out_sharding', None)
  if not out_sharding or not isinstance(
    out_sharding, tuple | list | PartitionSpec
  ):
    return None
  return tuple(out_sharding)


def concrete_sharding_of(variable: nnx.Variable) -> NamedSharding | None:
  """The ``NamedSharding`` a variable's ``out_sharding`` names, if any."""
  out_sharding = variable.get_metadata('out_sharding', None)
  if isinstance(out_sharding, NamedSharding):
    return out_sharding
  inner = getattr(out_sharding, 'sharding', None)  # A jax Format.
  return inner if isinstance(inner, NamedSharding) else None


def named_mesh_of(variable: nnx.Variable) -> Any:
  """The mesh a variable names for itself, or None.

  Its ``mesh`` metadata (``nnx.Param(..., mesh=m)``), else the mesh of its
  concrete ``out_sharding``: where Flax's ``shard_value`` puts it, whatever
  mesh is in effect (see `_meshes.mesh_for`).
  """
  concrete = concrete_sharding_of(variable)
  if concrete is not None:
    return concrete.mesh
  return variable.get_metadata('mesh', None)


def layout_of(variable: nnx.Variable) -> Layout | None:
  """The device-local layout a variable's ``out_sharding`` asks for.

  A ``jax.experimental.layout.Format`` carries one beside its sharding;
  every placement of the variable keeps it (`sharding_for`).
  """
  out_sharding = variable.get_metadata('out_sharding', None)
  if isinstance(out_sharding, Format):
    return out_sharding.layout
  return None


def sharding_for(
  variable: nnx.Variable, mesh: Any, spec: PartitionSpec
) -> NamedSharding | Format:
  """Where a variable's array goes: `spec` on `mesh`, in its own layout."""
  sharding = NamedSharding(mesh, spec)
  layout = layout_of(variable)
  return sharding if layout is None else Format(layout, sharding)


def spec_of_variable(
  variable: nnx.Variable,
  *,
  rules: _logical.LogicalRules | _context.FlaxRules | None = None,
  mesh: _meshes.MeshLike | None = None,
  path: str | None = None,
) -> _resolution.Resolution | None:
  """Where a variable goes under the rules in effect; None if unannotated.

  The same answer for every API: the plan, ``nnx.get_partition_spec`` (via
  the Flax hook), creation, `shard_module`, `init` and restore.

  A variable annotated with logical axes (or a concrete sharding) is placed
  by its annotation, unless the first path rule matching its path says
  ``override=True``; any other variable by the first path rule matching its
  path (if the variable is large enough for path rules); else it is not
  governed by the rules (None).

  Args:
    variable: The variable.
    rules: The rules in effect; default `_context.rules_in_effect()`.
    mesh: A mesh the caller named; see `_meshes.mesh_for` for the order.
    path: The variable's '/'-joined path: path rules match it, and errors
      name it. Without it, path rules do not apply.
  """
  if rules is None:
    rules = _context.rules_in_effect()
  value = value_of(variable)
  shape = _shape_of(value)
  concrete = concrete_sharding_of(variable)
  axes = logical_axes_of(variable)
  if path is not None and isinstance(rules, _logical.LogicalRules):
    found = path_rule_of(path, type(variable), shape, value, rules)
    if found is not None and (
      found[1].override or (concrete is None and axes is None)
    ):
      return _by_path_rule(
        found,
        shape,
        rules=rules,
        mesh=_meshes.mesh_for(variable, mesh=mesh, value=value),
        local_rules=variable.get_metadata('sharding_rules', None),
        path=path,
      )
  if concrete is not None:
    spec = concrete.spec
    if isinstance(rules, _context.FlaxRules):
      spec = _flax_renamed(variable, spec)
    return _resolution.Resolution(
      logical_axes=tuple(spec),
      shape=shape,
      dims=tuple(
        _resolution.DimResolution(None, t)
        for t in (*spec, *([None] * (len(shape or ()) - len(spec))))
      ),
      semantics=_resolution.FLAX_SEMANTICS,
    )
  if axes is None:
    return None
  return _resolution.resolve(
    axes,
    shape,
    mesh=_meshes.mesh_for(variable, mesh=mesh, value=value),
    rules=rules,
    local_rules=variable.get_metadata('sharding_rules', None),
    path=path,
  )


def path_rule_of(
  path: str,
  variable_type: type | None,
  shape: tuple[int, ...] | None,
  value: Any,
  rules: _logical.LogicalRules,
) -> tuple[int, _path_rules.PathRule] | None:
  """(index, rule) of the path rule for a variable, or None.

  None when no rule matches, and for scalars and variables below the
  rules' `min_size` / `min_bytes`, which path rules leave alone.
  """
  if not rules.path_rules:
    return None
  if (
    _path_rules.exemption(
      shape,
      dtype_of(value) if shape else None,
      min_size=rules.min_size,
      min_bytes=rules.min_bytes,
    )
    is not None
  ):
    return None
  return _path_rules.first_match(rules.path_rules, path, variable_type)


def _by_path_rule(
  found: tuple[int, _path_rules.PathRule],
  shape: tuple[int, ...] | None,
  *,
  rules: _logical.LogicalRules,
  mesh: _meshes.MeshLike | None,
  local_rules: Any,
  path: str,
) -> _resolution.Resolution:
  """The placement a path rule gives an array of `shape`."""
  index, rule = found
  source = rule.describe(index)
  entries = _path_rules.entries_for(rule, index, shape, path)
  if rule.kind == _path_rules.LOGICAL:
    resolution = _resolution.resolve(
      entries,
      shape,
      mesh=mesh,
      rules=rules,
      local_rules=local_rules,
      path=path,
    )
    return dataclasses.replace(resolution, source=source)
  if mesh is not None:
    _missing_axes.check_on_mesh(rules, _meshes.axis_sizes(mesh))
  return _resolution.fit_spec(
    entries,
    shape,
    mesh=mesh,
    strict=rules.strict and rule.kind == _path_rules.MESH,
    source=source,
    path=path,
  )


def spec_of_array(
  value: Any,
  *,
  path: str,
  logical_axes: Any = None,
  rules: _logical.LogicalRules | _context.FlaxRules,
  mesh: _meshes.MeshLike | None,
) -> _resolution.Resolution | None:
  """Where a plain array in a pytree goes; None if nothing governs it.

  As `spec_of_variable`, with `logical_axes` (from a parallel tree) as the
  annotation; a path rule with a `type` never matches a plain array.
  """
  shape = _shape_of(value)
  if isinstance(rules, _logical.LogicalRules):
    found = path_rule_of(path, None, shape, value, rules)
    if found is not None and (found[1].override or logical_axes is None):
      return _by_path_rule(
        found, shape, rules=rules, mesh=mesh, local_rules=None, path=path
      )
  if logical_axes is None:
    return None
  return _resolution.resolve(
    tuple(logical_axes), shape, mesh=mesh, rules=rules, path=path
  )


def source_of(
  resolution: _resolution.Resolution | None,
  path: str,
  variable_type: type | None,
  shape: tuple[int, ...] | None,
  value: Any,
  rules: _logical.LogicalRules | _context.FlaxRules,
) -> str:
  """What decided a variable's placement, in words (the plan's `source`).

  ``'annotation'`` (with the path rule it shadows, if one matches),
  ``"path rule #k 'pattern'"``, or, for a variable no annotation or path
  rule covers, ``'none'`` with the reason: replicated, left where it is, or
  too small for path rules.
  """
  if resolution is not None:
    if (
      resolution.source == _resolution.ANNOTATION
      and isinstance(rules, _logical.LogicalRules)
      and rules.path_rules
    ):
      found = path_rule_of(path, variable_type, shape, value, rules)
      if found is not None:  # Shadowed by the annotation: say so.
        return (
          f'annotation (over {found[1].describe(found[0])}, which has no '
          'override=True)'
        )
    return resolution.source
  if isinstance(rules, _logical.LogicalRules) and rules.path_rules:
    why = _path_rules.exemption(
      shape,
      dtype_of(value) if shape else None,
      min_size=rules.min_size,
      min_bytes=rules.min_bytes,
    )
    if why is not None and _path_rules.first_match(
      rules.path_rules, path, variable_type
    ):
      return f'none ({why})'
  placed = placed_spec(value)
  if placed is not None and any(placed):
    return 'none (stays where it is)'
  return NO_SOURCE


NO_SOURCE = 'none (replicated)'
"""The plan's `source` of a variable nothing covers, placed nowhere yet."""


def _flax_renamed(variable: nnx.Variable, spec: PartitionSpec) -> PartitionSpec:
  from flax.core import spmd as core_spmd

  renamed = core_spmd.apply_rules(
    spec, variable.get_metadata('sharding_rules', None)
  )
  return renamed if isinstance(renamed, PartitionSpec) else spec


def _shape_of(value: Any) -> tuple[int, ...] | None:
  shape = getattr(value, 'shape', None)
  if shape is None:
    try:
      shape = np.shape(value)
    except Exception:
      return None
  return tuple(int(d) for d in shape)


def dtype_of(value: Any) -> Any:
  """The dtype of an array, ShapeDtypeStruct or Python scalar."""
  dtype = getattr(value, 'dtype', None)
  return dtype if dtype is not None else np.asarray(value).dtype


def placed_spec(value: Any) -> PartitionSpec | None:
  """Where a concrete array actually is, or None for abstract values."""
  if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer):
    sharding = value.sharding
    if isinstance(sharding, NamedSharding):
      return sharding.spec
  return None
