"""The hook's wrappers: what Flax's creation and pspec queries do under our
rules.

Each takes Flax's own function first, then the call's arguments, and defers
to it unless our rules are in effect or our build runs
(`_placement._switches`). `_install` sets them into Flax.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.core import spmd as core_spmd
from flax.nnx import variablelib
from jax.experimental.layout import Format
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_dtensor import _errors
from flax_dtensor._placement import (
  _creation,
  _creation_order,
  _placing,
  _switches,
  _variables,
)
from flax_dtensor._rules import _context, _logical, _meshes, _resolution, _spec

# Set on each wrapper `_install` puts into Flax.
MARK = '__flax_dtensor_hook__'


def _set_value(flax_fn: Callable[..., Any], variable: Any, *args, **kwargs):
  """``Variable.set_value``, without Flax's quadratic cost while tracing.

  On ``var[...] = x`` (what every ``nnx.Rngs`` call does to its count),
  Flax compares ``getattr(x, 'sharding', None)`` with the old value's. For
  a traced value that attribute raises, and JAX first builds the error's
  message by walking every equation traced so far: each RNG call costs
  O(variables), a model's build O(variables²) (29 s for 1,000 variables,
  170 s for 2,000). Between two traced values both sides are None, so Flax
  assigns; this does the same without asking. Only inside `building`;
  anything else is Flax's own.
  """
  if (
    _switches.state.building
    and len(args) == 1
    and kwargs.keys() == {'index'}
    and kwargs['index'] is Ellipsis
  ):
    (value,) = args
    raw = getattr(variable, '_raw_value', None)
    if (
      isinstance(raw, jax.core.Tracer)
      and isinstance(value, jax.core.Tracer)
      and not variablelib.is_array_ref(raw)
      and 'on_set_value' not in variable.get_metadata()
      and value.shape == raw.shape
      and value.dtype == raw.dtype
    ):
      variable._raw_value = value  # What Flax does, as both shardings are None.
      return None
  return flax_fn(variable, *args, **kwargs)


def _bind(fn: Callable[..., Any], args: Any, kwargs: Any) -> dict[str, Any]:
  """Flax's arguments by name, or {} if Flax's signature changed."""
  try:
    bound = inspect.signature(fn).bind(*args, **kwargs)
  except TypeError:
    return {}
  return dict(bound.arguments)


def _shard_value(flax_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
  named = _bind(flax_fn, args, kwargs)
  if not {'value', 'out_sharding'} <= named.keys():
    return flax_fn(*args, **kwargs)
  value, out_sharding = named['value'], named['out_sharding']
  if _switches.state.probe is not None:
    _switches.state.probe.append('shard_value')
    return value
  if not out_sharding:
    return flax_fn(*args, **kwargs)
  if _switches.state.building:
    return value
  rules = _context.rules_in_effect()
  local = named.get('sharding_rules')
  if isinstance(out_sharding, NamedSharding | Format):
    # Flax fails on these under a context mesh (its assertion compares the
    # abstract mesh with a concrete one; a Format has no `.mesh`).
    return _placing.place_concrete(
      value, out_sharding, rules=rules, local_rules=local
    )
  uses_ours = isinstance(rules, _logical.LogicalRules) or (
    not rules.pairs and isinstance(local, _logical.LogicalRules)
  )
  if not uses_ours or not isinstance(
    out_sharding, tuple | list | PartitionSpec
  ):
    try:
      return flax_fn(*args, **kwargs)
    except ValueError as e:
      # Flax's own refusal when it has no mesh: ours instead (a ValueError
      # too), saying how to get one. Checked only once Flax has refused.
      if _meshes.mesh_for(mesh=named.get('mesh')) is not None:
        raise
      raise _errors.MeshError(
        'Expected a mesh to place a new variable annotated '
        f'out_sharding={tuple(out_sharding)!r}, but no mesh is set (nor '
        f"given in the variable's metadata). {_placing.NO_MESH_MSG}"
      ) from e
  mesh = _placing.require_mesh(named.get('mesh'), 'a new variable')
  resolution = _resolution.resolve(
    tuple(out_sharding),
    np.shape(value),
    mesh=mesh,
    rules=rules,
    local_rules=local,
  )
  return _placing.apply_spec(value, resolution.spec, mesh)


def _with_metadata(flax_fn: Callable[..., Any], *args: Any, **kwargs: Any):
  """Flax's ``with_metadata``, its initializer routed through `_creation`."""
  named = _bind(flax_fn, args, kwargs)
  initializer = named.get('initializer')
  if not callable(initializer):
    return flax_fn(*args, **kwargs)
  metadata = _remapped(dict(named.get('metadata', {})))

  @functools.wraps(initializer)
  def routed(*init_args: Any) -> Any:
    if _switches.state.probe is not None:
      _switches.state.probe.append('with_metadata')
      return initializer(*init_args)
    if _switches.state.building:
      out = initializer(*init_args)
      if _switches.state.in_shards is not None and _creation.would_create(
        initializer, metadata, init_args, out, _switches.state.mesh
      ):
        _switches.state.in_shards.append(out)
      return out
    return _creation.create(
      initializer, metadata, init_args, strict=_switches.state.strict
    )

  setattr(routed, MARK, True)
  named['initializer'] = routed
  return flax_fn(**named, **named.pop('metadata', {}))


def _remapped(metadata: dict[str, Any]) -> dict[str, Any]:
  """Flax's deprecated names for ``out_sharding``, as Flax maps them."""
  for old in ('sharding', 'sharding_names'):
    if old in metadata and 'out_sharding' not in metadata:
      metadata = {**metadata, 'out_sharding': metadata[old]}
  return metadata


def _get_var_pspec(
  flax_fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> PartitionSpec | None:
  named = _bind(flax_fn, args, kwargs)
  variable = named.get('v', args[0] if args else None)
  if not isinstance(variable, nnx.Variable):
    return flax_fn(*args, **kwargs)
  if _switches.state.probe is not None:
    _switches.state.probe.append('get_var_pspec')
  rules = _context.rules_in_effect()
  local = variable.get_metadata('sharding_rules', None)
  uses_ours = isinstance(rules, _logical.LogicalRules) or (
    not rules.pairs and isinstance(local, _logical.LogicalRules)
  )
  path = (
    _switches.state.paths.get(id(variable)) if _switches.state.paths else None
  )
  concrete = _spec.concrete_sharding_of(variable) is not None
  annotated = _spec.logical_axes_of(variable) is not None
  if _switches.state.building and annotated and not uses_ours:
    # Our own builds (plan, check, init) under Flax's semantics: a name
    # that is no mesh axis is our error, not JAX's inside Flax.
    _spec.spec_of_variable(variable, rules=rules)
  if not concrete and (not uses_ours or (path is None and not annotated)):
    # Flax's answer; a concrete sharding is ours everywhere (Flax's would
    # iterate a NamedSharding or Format as if it were names).
    return flax_fn(*args, **kwargs)
  resolution = _spec.spec_of_variable(variable, rules=rules, path=path)
  if resolution is None:
    return flax_fn(*args, **kwargs)
  return resolution.spec


def _get_partition_spec(flax_fn: Callable[..., Any], *args: Any, **kwargs):
  """``nnx.get_partition_spec``, each variable's path lent to the query.

  Flax maps ``get_var_pspec`` over the tree without paths. Under path
  rules, the paths of the tree's variables (relative to the tree, as
  `_variables.keypath_str` joins them: ``nnx.state(model)`` gives the
  plan's paths) are kept for the duration of the call.
  """
  if _switches.state.probe is not None:
    _switches.state.probe.append('get_partition_spec')
  rules = core_spmd.get_logical_axis_rules()
  if not isinstance(rules, _logical.LogicalRules) or not rules.path_rules:
    return flax_fn(*args, **kwargs)
  named = _bind(flax_fn, args, kwargs)
  if 'tree' not in named:
    return flax_fn(*args, **kwargs)
  paths: dict[int, str] = {}
  leaves = jax.tree_util.tree_flatten_with_path(
    named['tree'], is_leaf=lambda x: isinstance(x, nnx.Variable)
  )[0]
  for keypath, leaf in leaves:
    if isinstance(leaf, nnx.Variable):
      paths.setdefault(id(leaf), _variables.keypath_str(keypath))
  old = _switches.state.paths
  _switches.state.paths = paths
  try:
    return flax_fn(*args, **kwargs)
  finally:
    _switches.state.paths = old


def _get_named_sharding(flax_fn: Callable[..., Any], *args: Any, **kwargs):
  """``nnx.get_named_sharding`` (behind ``nnx.get_abstract_model``), with
  the layout of a variable whose ``out_sharding`` is a ``Format``: Flax
  builds ``NamedSharding(mesh, spec)``, which has none."""
  out = flax_fn(*args, **kwargs)
  for _, variable in _variables.iter_variables_in(out):
    layout = _spec.layout_of(variable)
    sharding = variable.get_raw_value()
    if layout is not None and isinstance(sharding, NamedSharding):
      variable.set_raw_value(Format(layout, sharding))
  return out


def _as_abstract(flax_fn: Callable[..., Any], *args: Any, **kwargs: Any):
  """``nnx.as_abstract``, concrete ``out_sharding`` kept with its layout."""
  out = flax_fn(*args, **kwargs)
  _placing.type_concrete(out)
  return out


def _eval_shape(flax_fn: Callable[..., Any], *args: Any, **kwargs: Any):
  """``nnx.eval_shape``, the abstract values typed by path rules too.

  Flax gives each abstract variable the sharding ``get_var_pspec`` names,
  without a path; under path rules, those a path rule covers (by their
  path in each graph node returned) get its placement, as `plan` reports.
  """
  out = flax_fn(*args, **kwargs)
  rules = core_spmd.get_logical_axis_rules()
  if (
    isinstance(rules, _logical.LogicalRules)
    and rules.path_rules
    and not _switches.state.building
  ):
    _placing.type_abstract(out, rules)
  return out


def _construct(flax_call: Callable[..., Any], cls: Any, /, *args, **kwargs):
  """The module metaclass's call: construction, then path-ruled placement.

  With no rules of ours in effect this costs two thread-local reads. Under
  path rules, the outermost ``nnx.Module`` constructor (a per-thread depth
  count) first builds the module abstractly to learn where each variable
  ends (`_creation_order.record`), then builds it following that record:
  leaf modules in their shards, other variables placed as soon as their
  module returns; when it returns, every variable a path rule covers is
  checked against its actual path and moved if it is not there. When eager
  sharding is off, nothing is placed, and that is said
  (`_placing.warn_unplaced`).
  """
  state = _switches.state
  if state.recording is not None:  # An abstract build: record, in order.
    record = state.recording.enter(cls, args, kwargs)
    record.module = flax_call(cls, *args, **kwargs)
    return record.module
  if state.depth:
    state.depth += 1
    try:
      if state.order is not None:
        return state.order.construct(
          flax_call, cls, args, kwargs, lambda: flax_call(cls, *args, **kwargs)
        )
      return flax_call(cls, *args, **kwargs)
    finally:
      state.depth -= 1
  if state.probe is not None:
    state.probe.append('module_call')
    return flax_call(cls, *args, **kwargs)
  rules = core_spmd.get_logical_axis_rules()
  if not isinstance(rules, _logical.LogicalRules) or state.building:
    return flax_call(cls, *args, **kwargs)
  eager = variablelib.using_eager_sharding()
  if eager and not rules.path_rules:
    return flax_call(cls, *args, **kwargs)
  order = state.order
  if order is None and eager:
    order = _planned_order(flax_call, cls, args, kwargs, rules)
  state.depth = 1
  old_order, state.order = state.order, order
  try:
    if order is not None:
      module = order.construct(
        flax_call, cls, args, kwargs, lambda: flax_call(cls, *args, **kwargs)
      )
    else:
      module = flax_call(cls, *args, **kwargs)
  finally:
    state.depth = 0
    state.order = old_order
  if eager:
    _placing.place_by_path_rules(module, rules, order)
  else:
    _placing.warn_unplaced(module, rules)
  return module


def _planned_order(
  flax_call: Callable[..., Any],
  cls: Any,
  args: tuple[Any, ...],
  kwargs: dict[str, Any],
  rules: _logical.LogicalRules,
  *,
  strict: bool = False,
) -> _creation_order.Order | None:
  """The creation order of `cls(*args, **kwargs)`, from an abstract build.

  None where there is no concrete mesh, the arguments are traced (the
  constructor runs inside a transform), or the abstract build fails (the
  concrete build then reports the error as it would anyway).
  """
  mesh = _meshes.mesh_for()
  if not isinstance(mesh, Mesh) or _creation_order.traced(args, kwargs):
    return None
  recording = _creation_order.Recording()

  def build(*a: Any, **k: Any) -> Any:
    outermost = recording.enter(cls, a, k)
    outermost.module = flax_call(cls, *a, **k)
    _creation_order.finish(recording, outermost.module)
    return outermost.module

  try:
    with _switches.building(recording=recording):
      nnx.eval_shape(build, *args, graph=True, graph_updates=False, **kwargs)
  except Exception:  # The concrete build meets it again, and reports it.
    return None
  return _creation_order.Order(
    recording.records,
    rules,
    mesh,
    quiet=_switches.building,
    strict=strict,
  )
