"""The hook's install: the table of what it wraps in Flax, once each, and the
proof (`check_routing`) that Flax still calls the wrappers (`_wrappers`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
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

from flax_dtensor import _compat, _errors
from flax_dtensor._hook import _wrappers
from flax_dtensor._placement import _switches
from flax_dtensor._rules import _first_made, _logical

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
  of `_wrappers` named `implementation` (which gets Flax's own function
  first, then the call's arguments). The name is looked up at each call, as a global is, so
  that the function can be replaced (a test's stand-in) after install."""
  functions = vars(_wrappers)

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
    if not _switches.state.building:
      return flax_set_value(variable, *args, **kwargs)
    return _wrappers._set_value(flax_set_value, variable, *args, **kwargs)

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
  if getattr(core_spmd.shard_value, _wrappers.MARK, False):
    return
  for owners, attribute, make in HOOKED:
    hook = make(getattr(owners[0], attribute))
    setattr(hook, _wrappers.MARK, True)
    for owner in owners:
      setattr(owner, attribute, hook)
  _first_made.when_first_made(_route_modules)


def _module_call(flax_call: Callable[..., Any]) -> Callable[..., Any]:
  """The wrapper of the module metaclass's call `flax_call` (`_construct`)."""

  @functools.wraps(flax_call)
  def module_call(cls: Any, /, *args: Any, **kwargs: Any) -> Any:
    # The common case inline (no path rules, not inside a constructor):
    # two thread-local reads, one frame.
    state = _switches.state
    if not state.depth and state.probe is None:
      rules = core_spmd.get_logical_axis_rules()
      if not isinstance(rules, _logical.LogicalRules) or (
        not rules.path_rules and variablelib.using_eager_sharding()
      ):
        return flax_call(cls, *args, **kwargs)
    return _wrappers._construct(flax_call, cls, *args, **kwargs)

  setattr(module_call, _wrappers.MARK, True)
  return module_call


# Serializes routing module construction with `check_routing`'s probe of it.
_routing_lock = threading.Lock()


def _route_modules() -> None:
  """Routes module construction through `_construct`, once.

  Only rules of ours need it (path rules, and saying that eager sharding is
  off), so it goes in when the first `LogicalRules` is made
  (`_first_made.when_first_made`), and a process that never makes rules
  builds its modules at Flax's cost.
  """
  with _routing_lock:
    flax_call = module_lib.ModuleMeta.__call__
    if not getattr(flax_call, _wrappers.MARK, False):
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
  old = _switches.state.probe
  _switches.state.probe = calls
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
    _switches.state.probe = old
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
    routed = getattr(call, _wrappers.MARK, False)
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
