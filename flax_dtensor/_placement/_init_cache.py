"""What identifies a build of `fdt.init`, and the builds kept for reuse.

A second `init` of the same configuration reuses the first's work: the
compiled traced build (or the verdict that the eager build computes every
variable in its shards). `key` says what a configuration is; where it
cannot be sure that two calls build the same thing, it returns None and
nothing is reused. A key holds:

- the factory: a function by its code, its defaults, the values of its
  closure's cells and of the globals its code names (each value as below;
  a library's function by its code, defaults and closure only);
  a class or another global function by identity (a weak reference: the
  key keeps nothing alive); a ``functools.partial`` by its parts;
- the arguments that are compiled in (sizes, dtypes, initializers,
  frozen dataclasses of such values), by value; the arrays and NNX graph
  nodes that are passed (``nnx.Rngs``), by their shapes, dtypes and
  shardings only, never their values;
- the rules (by value), the mesh (its devices, names and axis types),
  and the JAX and Flax settings a trace reads (x64, the PRNG, eager
  sharding).

Containers (tuples, lists, dicts, sets) are keyed by their content at the
call, so a changed entry is another configuration. Anything else (an
object, an array where a value is compiled in) makes the call
uncacheable. What the factory reads
beyond its own code (a global that a class's ``__init__`` reads) is fixed
at the first call, as ``jax.jit`` fixes it; a trace that captured an array
(`holds_constants`) is never kept. `clear` forgets every build.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import sys
import types
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

from flax_dtensor import _output
from flax_dtensor._placement import _calls, _creation

CACHE_SIZE = 32
"""Builds kept (the least recently used go first)."""

MAX_DEPTH = 24
"""How deep keys follow values into functions, closures and containers (a
function closing over itself is uncacheable, not endless)."""


class Uncacheable(Exception):
  """A call whose configuration a key cannot pin down."""


@dataclasses.dataclass(frozen=True)
class Build:
  """What a configuration's first `init` learned.

  Attributes:
    in_shards: Whether the eager build computes every variable in its
      shards (else the traced build).
    compiled: The compiled traced build (None for an eager one).
    replay: The eager build as one compiled call (`_replay`), where it
      can be.
  """

  in_shards: bool
  compiled: Any = None
  replay: Any = None


_builds = _creation.LRU(CACHE_SIZE)


def get(key: Hashable | None) -> Build | None:
  """The build of the configuration `key`, if one is kept."""
  if key is None:
    return None
  return _builds.find(key)


def put(key: Hashable | None, build: Build) -> None:
  if key is not None:
    _builds.get(key, lambda: build)


def clear() -> None:
  """Forgets every kept build (and the compiled initializers)."""
  _builds.clear()
  _creation.clear_caches()


# Keys
# ------------------------------------------------------------------------------


def _identity(x: Any) -> Hashable:
  """`x` by identity, without keeping it alive."""
  try:
    return ('ref', weakref.ref(x))
  except TypeError:
    module, name = (
      getattr(x, '__module__', None),
      getattr(x, '__qualname__', None),
    )
    if module and name and _lookup(module, name) is x:
      return ('named', module, name)
    raise Uncacheable(type(x).__name__) from None


def _lookup(module: str, qualname: str) -> Any:
  obj: Any = sys.modules.get(module)
  for part in qualname.split('.'):
    obj = getattr(obj, part, None)
  return obj


def _plain(x: Any) -> Hashable | None:
  """The key of a scalar, dtype or sharding spec; None for anything else."""
  if x is None or isinstance(x, bool | int | str | bytes | float | complex):
    return _creation.static_key(x)
  if x is Ellipsis:
    return ('...',)
  if isinstance(x, np.generic) and not isinstance(x, np.void):
    return ('scalar', x.dtype.str, _creation.static_key(x.item()))
  if isinstance(x, np.dtype) or (
    isinstance(x, type) and issubclass(x, np.generic)
  ):
    return _creation.static_key(x)
  if isinstance(x, jax.sharding.PartitionSpec | jax.sharding.Mesh):
    return (type(x), x)
  if isinstance(x, jax.sharding.AbstractMesh | jax.sharding.NamedSharding):
    return (type(x), x)
  if isinstance(x, enum.Enum):
    return ('enum', _identity(type(x)), x.name)
  return None


def value_key(x: Any, depth: int = 0) -> Hashable:
  """A hashable key equal for values a trace treats alike.

  Raises:
    Uncacheable: For an array, a module, a mutable container or object.
  """
  plain = _plain(x)
  if plain is not None:
    return plain
  if depth > MAX_DEPTH:
    raise Uncacheable('too deep')
  if isinstance(x, tuple | list):
    return (type(x), tuple(value_key(v, depth + 1) for v in x))
  if isinstance(x, set | frozenset):
    keys = [value_key(v, depth + 1) for v in x]
    return (type(x), tuple(sorted(keys, key=repr)))
  if isinstance(x, dict):
    # By its content now (a key is made at each call): a changed entry is
    # another configuration.
    items = [
      (value_key(k, depth + 1), value_key(v, depth + 1)) for k, v in x.items()
    ]
    return (dict, tuple(sorted(items, key=repr)))
  if isinstance(x, types.ModuleType):
    return ('module', x.__name__)
  if isinstance(x, type):
    return _identity(x)
  if (
    dataclasses.is_dataclass(x) and x.__dataclass_params__.frozen  # type: ignore[attr-defined]
  ):
    return (
      'dataclass',
      _identity(type(x)),
      tuple(
        (f.name, value_key(getattr(x, f.name), depth + 1))
        for f in dataclasses.fields(x)
      ),
    )
  if callable(x):
    return callable_key(x, depth + 1)
  raise Uncacheable(type(x).__name__)


def _code_names(code: types.CodeType) -> set[str]:
  """The global names `code` and the code nested in it may read."""
  names = set(code.co_names)
  for const in code.co_consts:
    if isinstance(const, types.CodeType):
      names |= _code_names(const)
  return names


def _global_key(value: Any, depth: int) -> Hashable:
  """A global a function's code names: modules, classes and functions by
  identity, plain values and frozen dataclasses by value."""
  if isinstance(value, types.FunctionType | type | types.BuiltinFunctionType):
    return _identity(value)
  return value_key(value, depth)


def callable_key(fn: Any, depth: int = 0) -> Hashable:
  """What determines what calling `fn` traces (see the module docstring).

  Raises:
    Uncacheable: For a callable object, or a function whose closure or
      globals hold what `value_key` refuses.
  """
  if depth > MAX_DEPTH:
    raise Uncacheable('too deep')
  if isinstance(fn, functools.partial):
    return (
      functools.partial,
      callable_key(fn.func, depth + 1),
      value_key(fn.args, depth + 1),
      value_key(tuple(sorted(fn.keywords.items())), depth + 1),
    )
  if isinstance(fn, type) or isinstance(fn, types.BuiltinFunctionType):
    return _identity(fn)
  if isinstance(fn, types.MethodType):
    # A classmethod's class, or a frozen dataclass's method.
    owner = value_key(fn.__self__, depth + 1)
    return ('method', callable_key(fn.__func__, depth + 1), owner)
  if not isinstance(fn, types.FunctionType):
    raise Uncacheable(type(fn).__name__)
  code = fn.__code__
  scope = fn.__globals__
  # A library's function reads the library's own state: as for jax.jit, its
  # globals are not the configuration (only the user's code's are).
  library = code.co_filename.startswith(_output.library_prefixes())
  names = [] if library else sorted(n for n in _code_names(code) if n in scope)
  return (
    'function',
    code,
    fn.__module__,
    tuple(value_key(c.cell_contents, depth + 1) for c in fn.__closure__ or ()),
    value_key(fn.__defaults__, depth + 1),
    value_key(tuple(sorted((fn.__kwdefaults__ or {}).items())), depth + 1),
    tuple((n, _global_key(scope[n], depth + 1)) for n in names),
  )


def _aval(x: Any) -> Hashable:
  """An array passed to the build, by what its compiled program depends
  on: shape, dtype, weak type and sharding (never its values)."""
  return (
    tuple(x.shape),
    str(x.dtype),
    bool(getattr(x, 'weak_type', False)),
    getattr(x, 'sharding', None),
  )


def _node_key(node: Any) -> Hashable:
  """A graph node passed to the build (``nnx.Rngs``): its structure and
  the avals of its state."""
  from flax import nnx

  graphdef, state = nnx.split(node)
  leaves, treedef = jax.tree_util.tree_flatten(state)
  return (graphdef, treedef, tuple(_aval(x) for x in leaves))


def _settings() -> Hashable:
  """The JAX and Flax settings a traced build reads."""
  import flax
  from flax import nnx

  config = jax.config
  return (
    bool(config.jax_enable_x64),
    str(config.jax_default_prng_impl),
    bool(config.jax_threefry_partitionable),
    str(config.jax_default_matmul_precision),
    bool(flax.config.flax_always_shard_variable),
    bool(nnx.using_eager_sharding()),
  )


def key(
  factory: Callable[..., Any], call: _calls.Split, rules: Any, mesh: Any
) -> Hashable | None:
  """The configuration of an `init` call (`call`: its arguments, split),
  or None if it cannot be pinned down (then nothing is reused or kept)."""
  passed = set(call.dynamic)
  try:
    args = tuple(
      ('node', _node_key(x))
      if i in passed and _calls.is_node(x)
      else ('array', _aval(x))
      if i in passed
      else ('value', value_key(x))
      for i, x in enumerate(call.leaves)
    )
    found = (
      callable_key(factory),
      call.treedef,
      args,
      rules,
      mesh,
      _settings(),
    )
    hash(found)  # Everything in it must be hashable.
    return found
  except (Uncacheable, TypeError, ValueError):
    # TypeError: something unhashable inside; ValueError: an array's truth.
    return None


def holds_constants(traced: Any) -> bool:
  """Whether a traced build captured arrays (a global or closure's array,
  a table made from literals): its compiled program then holds them, and
  it is not kept. True when that cannot be told."""
  jaxpr = getattr(getattr(traced, 'traced', None), 'jaxpr', None)
  consts = getattr(jaxpr, 'consts', None)
  return consts is None or len(consts) > 0
