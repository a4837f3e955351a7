"""The hook into Flax: variable creation and pspec queries follow our rules.

Flax places an annotated variable at creation with
``flax.core.spmd.shard_value``, and answers ``nnx.get_partition_spec`` (and
``get_named_sharding``, ``as_abstract``, ``eval_shape``) with
``flax.nnx.spmd.get_var_pspec``. `install` wraps both, once, and
two more: ``with_metadata`` (behind ``nnx.with_partitioning``), so that an
annotated initializer computes only its shards (`_creation`), and
``Variable.set_value``. The wrappers take any arguments and defer to Flax
unless our rules are in effect or our build (`building`) runs; `HOOKED`
lists each wrapped function and every place Flax holds it.
`ensure_installed` installs them and proves (`check_routing`) that Flax
still calls them, once per process, before the first public name of
flax_dtensor is handed out (see the package's ``__getattr__``). Two more
wrappers serve path rules: ``get_partition_spec`` lends ``get_var_pspec``
each variable's path, and the module metaclass's call places, when the
outermost ``nnx.Module`` constructor returns, the variables path rules
cover; that one goes in when the first `LogicalRules` is made
(`_route_modules`), so a process that makes no rules of ours builds its
modules at Flax's cost.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import flax
import jax
import numpy as np
from flax import nnx
from flax.core import spmd as core_spmd
from flax.nnx import module as module_lib
from flax.nnx import spmd as nnx_spmd
from flax.nnx import variablelib
from flax.nnx.transforms import transforms as nnx_transforms
from jax.experimental.layout import Format
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_dtensor import _compat, _errors
from flax_dtensor._placement import (
  _creation,
  _creation_order,
  _placing,
  _variables,
)
from flax_dtensor._rules import _logical, _meshes, _resolution

_MARK = '__flax_dtensor_hook__'


class _State(threading.local):
  """Per-thread switches of the hook."""

  building: bool = False  # Inside `init`'s and `plan`'s builds.
  # Inside `init`'s abstract pass: the traced outputs of the initializers
  # `_creation.create` would compute in their shards on `mesh`.
  in_shards: list[Any] | None = None
  mesh: Mesh | None = None
  strict: bool = False  # Inside `init`'s eager build (see `in_shards`).
  probe: list[str] | None = None  # `check_routing` records calls here.
  # Inside an `nnx.Module` constructor called under path rules: how deep.
  depth: int = 0
  # Inside `nnx.get_partition_spec` under path rules: {id(variable): path}.
  paths: dict[int, str] | None = None
  # Inside an abstract build under path rules: module constructions, in
  # order (`_creation_order`).
  recording: _creation_order.Recording | None = None
  # Inside a concrete build under path rules: the abstract build's records
  # it follows.
  order: _creation_order.Order | None = None


_state = _State()


@contextlib.contextmanager
def building(
  in_shards: list[Any] | None = None,
  mesh: Mesh | None = None,
  recording: _creation_order.Recording | None = None,
) -> Iterator[None]:
  """Within the block, a model is built by flax_dtensor (`init`, `plan`).

  Created variables stay where their value is (the build places or plans
  every variable itself, by `_variables.spec_of_variable`), and tracing
  stays linear in the number of variables (see `_set_value`). With
  `in_shards`, the build is `init`'s abstract pass: the outputs of annotated
  initializers that an eager build on `mesh` computes in their shards are
  appended to it. With `recording`, every module construction is recorded
  in order (see `_creation_order`).
  """
  old = (_state.building, _state.in_shards, _state.mesh, _state.recording)
  _state.building, _state.in_shards, _state.mesh = True, in_shards, mesh
  _state.recording = recording
  try:
    yield
  finally:
    (_state.building, _state.in_shards, _state.mesh, _state.recording) = old


@contextlib.contextmanager
def following(order: _creation_order.Order | None) -> Iterator[None]:
  """Within the block, module constructions follow `order`."""
  old = _state.order
  _state.order = order
  try:
    yield
  finally:
    _state.order = old


@contextlib.contextmanager
def strictly_in_shards() -> Iterator[None]:
  """Within the block, an annotated initializer that would compute its
  whole value raises `_creation.NotInShards` before it runs (`init`'s eager
  build, which its abstract pass predicted to need none)."""
  old = _state.strict
  _state.strict = True
  try:
    yield
  finally:
    _state.strict = old


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
    _state.building
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
  if _state.probe is not None:
    _state.probe.append('shard_value')
    return value
  if not out_sharding:
    return flax_fn(*args, **kwargs)
  if _state.building:
    return value
  rules = _logical.rules_in_effect()
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
    if _state.probe is not None:
      _state.probe.append('with_metadata')
      return initializer(*init_args)
    if _state.building:
      out = initializer(*init_args)
      if _state.in_shards is not None and _creation.would_create(
        initializer, metadata, init_args, out, _state.mesh
      ):
        _state.in_shards.append(out)
      return out
    return _creation.create(
      initializer, metadata, init_args, strict=_state.strict
    )

  setattr(routed, _MARK, True)
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
  if _state.probe is not None:
    _state.probe.append('get_var_pspec')
  rules = _logical.rules_in_effect()
  local = variable.get_metadata('sharding_rules', None)
  uses_ours = isinstance(rules, _logical.LogicalRules) or (
    not rules.pairs and isinstance(local, _logical.LogicalRules)
  )
  path = _state.paths.get(id(variable)) if _state.paths else None
  concrete = _variables.concrete_sharding_of(variable) is not None
  annotated = _variables.logical_axes_of(variable) is not None
  if _state.building and annotated and not uses_ours:
    # Our own builds (plan, check, init) under Flax's semantics: a name
    # that is no mesh axis is our error, not JAX's inside Flax.
    _variables.spec_of_variable(variable, rules=rules)
  if not concrete and (not uses_ours or (path is None and not annotated)):
    # Flax's answer; a concrete sharding is ours everywhere (Flax's would
    # iterate a NamedSharding or Format as if it were names).
    return flax_fn(*args, **kwargs)
  resolution = _variables.spec_of_variable(variable, rules=rules, path=path)
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
  if _state.probe is not None:
    _state.probe.append('get_partition_spec')
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
  old = _state.paths
  _state.paths = paths
  try:
    return flax_fn(*args, **kwargs)
  finally:
    _state.paths = old


def _get_named_sharding(flax_fn: Callable[..., Any], *args: Any, **kwargs):
  """``nnx.get_named_sharding`` (behind ``nnx.get_abstract_model``), with
  the layout of a variable whose ``out_sharding`` is a ``Format``: Flax
  builds ``NamedSharding(mesh, spec)``, which has none."""
  out = flax_fn(*args, **kwargs)
  for _, variable in _variables.iter_variables_in(out):
    layout = _variables.layout_of(variable)
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
    and not _state.building
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
  state = _state
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
    with building(recording=recording):
      nnx.eval_shape(build, *args, graph=True, graph_updates=False, **kwargs)
  except Exception:  # The concrete build meets it again, and reports it.
    return None
  return _creation_order.Order(
    recording.records,
    rules,
    mesh,
    quiet=building,
    strict=strict,
  )


_install_lock = threading.Lock()
_installed = False


def ensure_installed() -> None:
  """Installs the hook and checks Flax's routing, once per process.

  Thread-safe and cheap after the first call. Called before any public name
  of flax_dtensor is handed out, and by the modules that run flax_dtensor
  code without going through that namespace (``flax_dtensor.dtensor``).

  Raises:
    FlaxCompatibilityError: If the installed JAX or Flax is a release
      flax_dtensor does not support (`_compat.SUPPORTED`), or Flax does not
      route creation and pspec queries through the hook (see
      `check_routing`).
  """
  global _installed
  if _installed:
    return
  with _install_lock:
    if not _installed:
      _compat.check_versions({'jax': jax.__version__, 'flax': flax.__version__})
      install()
      check_routing()
      _installed = True


def _deferring(
  implementation: str,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """A wrapper maker: Flax's function, called through this module's function
  named `implementation` (which gets Flax's own function first, then the
  call's arguments). The name is looked up at each call, as a global is, so
  that the function can be replaced (a test's stand-in) after install."""
  functions = globals()

  def wrap(flax_fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(flax_fn)
    def hook(*args: Any, **kwargs: Any) -> Any:
      return functions[implementation](flax_fn, *args, **kwargs)

    return hook

  return wrap


def _wrap_set_value(flax_set_value: Callable[..., Any]) -> Callable[..., Any]:
  """``Variable.set_value``'s wrapper: outside a traced build (every eager
  one), Flax's own, one frame."""

  @functools.wraps(flax_set_value)
  def set_value(variable: Any, *args: Any, **kwargs: Any) -> Any:
    if not _state.building:
      return flax_set_value(variable, *args, **kwargs)
    return _set_value(flax_set_value, variable, *args, **kwargs)

  return set_value


HOOKED: tuple[tuple[tuple[Any, ...], str, Callable[..., Any]], ...] = (
  # (owners: where Flax defines it, then where Flax re-exports it; the
  # attribute; what makes its wrapper from Flax's function)
  ((core_spmd,), 'shard_value', _deferring('_shard_value')),
  ((nnx_spmd,), 'get_var_pspec', _deferring('_get_var_pspec')),
  ((variablelib, nnx), 'with_metadata', _deferring('_with_metadata')),
  ((variablelib.Variable,), 'set_value', _wrap_set_value),
  ((nnx_spmd, nnx), 'get_partition_spec', _deferring('_get_partition_spec')),
  ((nnx_transforms, nnx_spmd, nnx), 'eval_shape', _deferring('_eval_shape')),
  ((nnx_spmd, nnx), 'get_named_sharding', _deferring('_get_named_sharding')),
  ((nnx_spmd, nnx), 'as_abstract', _deferring('_as_abstract')),
)
"""What `install` wraps in Flax, once each, in every place that holds it.

The wrapper is made once, at install, from the function its first owner
holds, and set on every owner, so that ``nnx.eval_shape`` and
``flax.nnx.spmd.eval_shape`` stay one function. (The module metaclass's call
goes in later and on its own: see `_route_modules`.)
"""


def install() -> None:
  """Wraps Flax's functions (`HOOKED`); idempotent (see `ensure_installed`)."""
  if getattr(core_spmd.shard_value, _MARK, False):
    return
  for owners, attribute, make in HOOKED:
    hook = make(getattr(owners[0], attribute))
    setattr(hook, _MARK, True)
    for owner in owners:
      setattr(owner, attribute, hook)
  _logical.when_first_made(_route_modules)


def _module_call(flax_call: Callable[..., Any]) -> Callable[..., Any]:
  """The wrapper of the module metaclass's call `flax_call` (`_construct`)."""

  @functools.wraps(flax_call)
  def module_call(cls: Any, /, *args: Any, **kwargs: Any) -> Any:
    # The common case inline (no path rules, not inside a constructor):
    # two thread-local reads, one frame.
    state = _state
    if not state.depth and state.probe is None:
      rules = core_spmd.get_logical_axis_rules()
      if not isinstance(rules, _logical.LogicalRules) or (
        not rules.path_rules and variablelib.using_eager_sharding()
      ):
        return flax_call(cls, *args, **kwargs)
    return _construct(flax_call, cls, *args, **kwargs)

  setattr(module_call, _MARK, True)
  return module_call


# Serializes routing module construction with `check_routing`'s probe of it.
_routing_lock = threading.Lock()


def _route_modules() -> None:
  """Routes module construction through `_construct`, once.

  Only rules of ours need it (path rules, and saying that eager sharding is
  off), so it goes in when the first `LogicalRules` is made
  (`_logical.when_first_made`), and a process that never makes rules
  builds its modules at Flax's cost.
  """
  with _routing_lock:
    flax_call = module_lib.ModuleMeta.__call__
    if not getattr(flax_call, _MARK, False):
      module_lib.ModuleMeta.__call__ = _module_call(flax_call)


def check_routing() -> None:
  """Proves that Flax routes creation and pspec queries through the hook.

  Creates one annotated variable from a NumPy value (no JAX backend starts)
  and asks for its PartitionSpec, and constructs an empty ``nnx.Module``,
  with the hook in probe mode.

  Raises:
    FlaxCompatibilityError: If Flax did not call one of the wrapped
      functions: the installed Flax has moved on, and the rules would
      silently stop applying.
  """
  calls: list[str] = []
  problems: list[str] = []
  old = _state.probe
  _state.probe = calls
  try:
    for name, probe in (
      ('shard_value', _probe_creation),
      ('get_var_pspec', _probe_query),
      ('with_metadata', _probe_initializer),
      ('module_call', _probe_module),
    ):
      try:
        probe()
      except Exception as e:  # Reported below, with what was not called.
        problems.append(f'{name}: {type(e).__name__}: {e}')
  finally:
    _state.probe = old
  missing = [
    n
    for n in (
      'shard_value',
      'get_var_pspec',
      'with_metadata',
      'get_partition_spec',
      'module_call',
    )
    if n not in calls
  ]
  if missing:
    details = f' (Probing raised {"; ".join(problems)})' if problems else ''
    raise _errors.FlaxCompatibilityError(
      _ROUTING_MSG.format(version=flax.__version__, missing=missing) + details
    )


def _probe_creation() -> None:
  with nnx.use_eager_sharding(True):
    nnx.Param(np.zeros((2,), np.float32), out_sharding=('x',))


def _probe_initializer() -> None:
  nnx.with_partitioning(lambda: np.zeros((2,), np.float32), ('x',))()


class _Probe(nnx.Module):
  """An empty module: constructing it must go through `_construct`."""


def _probe_module() -> None:
  """Builds `_Probe`, through the module routing (in for the probe if not
  yet: see `_route_modules`)."""
  with _routing_lock:
    call = module_lib.ModuleMeta.__call__
    routed = getattr(call, _MARK, False)
    if not routed:
      module_lib.ModuleMeta.__call__ = _module_call(call)
    try:
      _Probe()
    finally:
      module_lib.ModuleMeta.__call__ = call


def _probe_query() -> None:
  variable = nnx.Param(
    np.zeros((2,), np.float32), out_sharding=('x',), eager_sharding=False
  )
  nnx.get_partition_spec(nnx.State({'v': variable}))


_ROUTING_MSG = (
  'flax_dtensor needs Flax to create annotated variables through '
  '`flax.core.spmd.shard_value`, to answer `nnx.get_partition_spec` '
  'through `flax.nnx.spmd.get_partition_spec` and `get_var_pspec`, to wrap '
  'initializers with `flax.nnx.variablelib.with_metadata`, and to build '
  'modules through `flax.nnx.module.ModuleMeta.__call__` (path rules place '
  'variables when the outermost module constructor returns); the installed '
  'Flax {version} did not call {missing}. Expected a Flax version '
  'flax_dtensor supports (see '
  'its pyproject.toml and docs/compatibility.md); a newer Flax needs a newer '
  'flax_dtensor.'
)
