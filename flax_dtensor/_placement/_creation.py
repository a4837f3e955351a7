"""Eager creation that computes only the shards: initializers under ``jit``.

Under ``jax.set_mesh`` an initializer called eagerly computes the whole
array on every device (replicated), and only then does Flax hand the value
to `flax.core.spmd.shard_value` to be placed: 4.5x the time of an unsharded
build for a stack of MLPs. When our rules are in effect, the hook (`flax_dtensor._hook`) routes an
annotated initializer (``nnx.with_partitioning(init, axes)``) through
`create` instead: the spec is resolved from the output's shape first, and
the initializer runs under a cached ``jax.jit`` whose ``out_shardings`` is
that spec, so each device computes its own shard. The value arrives at
Flax's ``shard_value`` already placed, and `_placing.apply_spec` returns it
as it is.

Only initializers from JAX and Flax (``jax.nn.initializers``,
``nnx.initializers``; pure functions of ``(key, shape, dtype)`` by contract)
take this path: a user's initializer may read global or random NumPy state
that a cached trace would freeze, so it runs as written and is placed after,
with the same result. The compiled initializers are cached by what
determines them (code, closure and default values, static arguments, spec,
mesh), so ``lecun_normal()`` called once per layer compiles once.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import types
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_dtensor._placement import _replay
from flax_dtensor._rules import _context, _logical, _meshes, _resolution

# Modules whose initializers are pure functions of their arguments.
_PURE_MODULES = ('jax.', 'flax.')
CACHE_SIZE = 256
# XLA's algebraic simplifier reassociates constant factors across the ops an
# eager call runs one by one (``normal(key, shape) * stddev``), which moves
# values by an ulp. Without it the compiled initializer is the eager call's
# arithmetic; its values lie within 8 ulps of the eager call's (XLA's vector
# code for the shard's shape may round otherwise: docs/concepts.md, "Values
# of a sharded build").
COMPILER_OPTIONS = {'xla_disable_hlo_passes': 'algsimp'}


class Unkeyable(Exception):
  """A value that does not determine a compiled initializer by itself."""


def static_key(x: Any) -> Hashable:
  """A hashable key equal for values that trace to the same computation."""
  if x is None or isinstance(x, bool | int | str | bytes):
    return (type(x), x)
  if isinstance(x, float):
    return (float, x.hex())
  if isinstance(x, complex):
    return (complex, x.real.hex(), x.imag.hex())
  if isinstance(x, tuple | list):
    return (type(x), tuple(static_key(v) for v in x))
  if isinstance(x, np.dtype) or (
    # Scalar types: np.float32, jnp.float32, jnp.bfloat16 ...
    isinstance(getattr(x, 'dtype', None), np.dtype) and not hasattr(x, 'shape')
  ):
    dtype = np.dtype(x)
    return (np.dtype, dtype.str, str(dtype))
  if isinstance(x, type) and issubclass(x, np.generic):
    return (np.dtype, np.dtype(x).str, str(np.dtype(x)))
  if callable(x):
    return function_key(x)
  raise Unkeyable(type(x).__name__)


def function_key(fn: Callable[..., Any]) -> Hashable:
  """What determines a pure library function's computation.

  Raises:
    Unkeyable: For anything but a function from JAX or Flax (or a
      ``functools.partial`` of one) closing over plain values.
  """
  if isinstance(fn, functools.partial):
    return (
      functools.partial,
      function_key(fn.func),
      static_key(fn.args),
      static_key(sorted(fn.keywords.items())),
    )
  if not isinstance(fn, types.FunctionType) or not (
    fn.__module__ or ''
  ).startswith(_PURE_MODULES):
    raise Unkeyable(getattr(fn, '__qualname__', type(fn).__name__))
  cells = tuple(static_key(c.cell_contents) for c in fn.__closure__ or ())
  return (
    fn.__code__,
    id(fn.__globals__),
    cells,
    static_key(fn.__defaults__),
    static_key(sorted((fn.__kwdefaults__ or {}).items())),
  )


class LRU:
  """A small thread-safe LRU map of compiled initializers and shapes."""

  def __init__(self, size: int):
    self._size = size
    self._data: collections.OrderedDict[Hashable, Any] = (
      collections.OrderedDict()
    )
    self._lock = threading.Lock()

  def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
    with self._lock:
      if key in self._data:
        self._data.move_to_end(key)
        return self._data[key]
    value = make()
    with self._lock:
      self._data[key] = value
      while len(self._data) > self._size:
        self._data.popitem(last=False)
    return value

  def find(self, key: Hashable) -> Any:
    """The value kept for `key` (now the most recent), or None."""
    with self._lock:
      if key not in self._data:
        return None
      self._data.move_to_end(key)
      return self._data[key]

  def clear(self) -> None:
    with self._lock:
      self._data.clear()


_shapes = LRU(CACHE_SIZE)
_compiled = LRU(CACHE_SIZE)
leaves = LRU(CACHE_SIZE)
"""Compiled leaf-module constructors (`_creation_order`), by what
determines them."""


def clear_caches() -> None:
  """Drops the cached initializers (e.g. after the devices change)."""
  _shapes.clear()
  _compiled.clear()
  leaves.clear()


def _is_dynamic(x: Any) -> bool:
  return isinstance(x, jax.Array | np.ndarray)  # Tracers are jax.Arrays.


_DYNAMIC = object()  # Marks the arguments passed to the compiled function.


@dataclasses.dataclass(frozen=True)
class _Call:
  """An initializer call split into what is compiled in and what is passed."""

  key: Hashable
  statics: tuple[Any, ...]  # `_DYNAMIC` where an array is passed.
  dynamic: tuple[Any, ...]

  def merge(self, values: tuple[Any, ...]) -> list[Any]:
    it = iter(values)
    return [next(it) if s is _DYNAMIC else s for s in self.statics]


def _call_of(initializer: Callable[..., Any], args: tuple[Any, ...]) -> _Call:
  """Raises `Unkeyable` unless the call can be compiled once and reused."""
  key = (
    function_key(initializer),
    tuple(('dynamic',) if _is_dynamic(a) else static_key(a) for a in args),
  )
  return _Call(
    key,
    tuple(_DYNAMIC if _is_dynamic(a) else a for a in args),
    tuple(a for a in args if _is_dynamic(a)),
  )


class NotInShards(Exception):
  """`create(strict=True)` could not compute a value in its shards."""


def create(
  initializer: Callable[..., Any],
  metadata: dict[str, Any],
  args: tuple[Any, ...],
  *,
  strict: bool = False,
) -> Any:
  """``initializer(*args)``, computed in its shards where that is possible.

  The shards are those our rules give the variable the value is for (its
  ``out_sharding`` metadata), on its mesh. Wherever that is not known here
  (Flax's rules, eager sharding off, no or an abstract mesh, traced
  arguments, a user's initializer, a resolution error that Flax's
  ``shard_value`` then reports as usual), the initializer runs as written;
  with `strict`, `NotInShards` is raised instead, before it runs.
  """
  mesh = _meshes.mesh_for(mesh=metadata.get('mesh'))
  if any(isinstance(a, jax.core.Tracer) for a in args) or not isinstance(
    mesh, Mesh
  ):
    call = None
  else:
    try:
      call = _call_of(initializer, args)
    except Unkeyable:
      call = None
  spec = None if call is None else _spec_for(initializer, call, metadata, mesh)
  if spec is None:
    if strict:
      raise NotInShards(getattr(initializer, '__qualname__', initializer))
    return initializer(*args)
  auto = _meshes.auto_copy(mesh)

  def make() -> Callable[..., Any]:
    def run(*values: Any) -> Any:
      return initializer(*call.merge(values))

    return jax.jit(
      run,
      out_shardings=NamedSharding(auto, spec),
      compiler_options=COMPILER_OPTIONS,
    )

  jitted = _compiled.get((call.key, spec, auto), make)
  with jax.set_mesh(auto):
    out = jitted(*[_meshes.retype(v, auto) for v in call.dynamic])
  out = jax.device_put(out, NamedSharding(mesh, spec))
  # A call of one key, which `init`'s replay may redo.
  if len(call.dynamic) == 1 and _replay.is_recording():
    _replay.note(
      _replay.Created(
        (call.key, spec, auto),
        lambda key: initializer(*call.merge((key,))),
        spec,
        call.dynamic[0],
        out,
      )
    )
  return out


def would_create(
  initializer: Callable[..., Any],
  metadata: dict[str, Any],
  args: tuple[Any, ...],
  out: Any,
  mesh: Mesh,
) -> bool:
  """Whether `create` computes this call in its shards, eagerly on `mesh`.

  For `init`'s abstract pass, where `args` and `out` are traced.
  """
  own = metadata.get('mesh')
  if own is not None and not _meshes.same_devices(own, mesh):
    return False
  try:
    call = _call_of(initializer, args)
  except Unkeyable:
    return False
  shape = jax.ShapeDtypeStruct(np.shape(out), getattr(out, 'dtype', None))
  return _spec_for(initializer, call, metadata, mesh, shape=shape) is not None


def _spec_for(
  initializer: Callable[..., Any],
  call: _Call,
  metadata: dict[str, Any],
  mesh: Mesh,
  *,
  shape: jax.ShapeDtypeStruct | None = None,
) -> PartitionSpec | None:
  """The spec our rules give the output, or None where they do not apply."""
  out_sharding = metadata.get('out_sharding')
  if not isinstance(out_sharding, tuple | list | PartitionSpec):
    return None
  if not metadata.get('eager_sharding', _using_eager_sharding()):
    return None
  rules = _context.rules_in_effect()
  local = metadata.get('sharding_rules')
  if not (
    isinstance(rules, _logical.LogicalRules)
    or (not rules.pairs and isinstance(local, _logical.LogicalRules))
  ):
    return None
  try:
    if shape is None:
      avals = tuple((np.shape(a), str(a.dtype)) for a in call.dynamic)
      shape = _shapes.get(
        (call.key, avals),
        lambda: jax.eval_shape(
          lambda *v: initializer(*call.merge(v)), *call.dynamic
        ),
      )
    if not isinstance(shape, jax.ShapeDtypeStruct):
      return None
    resolution = _resolution.resolve(
      tuple(out_sharding),
      shape.shape,
      mesh=mesh,
      rules=rules,
      local_rules=local,
    )
  except (ValueError, TypeError):  # Flax's shard_value reports it, eagerly.
    return None
  return resolution.spec


def _using_eager_sharding() -> bool:
  return nnx.using_eager_sharding()
