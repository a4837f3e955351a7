"""Restore targets: where each array goes, and what a source must hold.

Shared by `restore_checkpoint` (from disk) and `from_tf_module` (from TF
variables in memory), which take the same keywords (`RestoreOptions`,
given to each by `takes_restore_options`). `target_shardings` gives each
selected variable the sharding the rules in effect say
(`_spec.spec_of_variable`), or its value's own; `fill` puts the placed
arrays into the target, an abstract one entirely. What a source must hold is checked by `_sources`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import filterlib
from jax.experimental.layout import Format, Layout

from flax_dtensor import _errors
from flax_dtensor._placement import _variables
from flax_dtensor._rules import _context, _logical, _meshes, _spec
from flax_dtensor.dtensor._conversion import _names, _selection
from flax_dtensor.dtensor._layout import _dtypes

# Where each array goes
# ------------------------------------------------------------------------------


def _own_sharding(
  entry: _selection.Entry, mesh: jax.sharding.Mesh | None
) -> jax.sharding.Sharding:
  """The target value's own sharding, made concrete."""
  value = _spec.value_of(entry.variable)
  sharding = getattr(value, 'sharding', None)
  own = entry.variable.get_metadata('mesh', None)
  if (
    isinstance(own, jax.sharding.Mesh)
    and isinstance(sharding, jax.sharding.NamedSharding)
    and own.abstract_mesh == sharding.mesh
  ):
    # Abstract on the mesh its `mesh=` metadata names (a model on several
    # meshes): that one, whatever mesh is given or set.
    mesh = own
  elif mesh is None:
    current = _meshes.mesh_for()
    mesh = current if isinstance(current, jax.sharding.Mesh) else None
  if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(
    sharding.mesh, jax.sharding.AbstractMesh
  ):
    if mesh is None:
      raise _errors.ExportError(
        f'The target variable {entry.name!r} has a sharding on an abstract '
        f'mesh ({sharding.spec} on {sharding.mesh}): expected a concrete '
        'mesh to place it on. '
        + (
          _meshes.devices_hint(sharding.mesh)
          or 'Restore under jax.set_mesh(mesh), or pass `mesh=`.'
        )
      )
    if mesh.abstract_mesh != sharding.mesh:
      raise _errors.ExportError(
        f'The target variable {entry.name!r} is sharded over the abstract '
        f'mesh {sharding.mesh}, but the mesh given is {mesh.abstract_mesh}: '
        'expected the same axis names and sizes.'
      )
    sharding = jax.sharding.NamedSharding(mesh, sharding.spec)
  if sharding is None:
    if mesh is not None:
      sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    elif jax.process_count() == 1:
      sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    else:
      raise _errors.ExportError(
        f'The target variable {entry.name!r} has no sharding: expected one '
        'in a multi-process run. Build the target under jax.set_mesh(mesh), '
        'or pass `mesh=`.'
      )
  return sharding


def _names_mesh_axes(variable: Any, mesh: jax.sharding.Mesh) -> bool:
  """Whether `variable` is annotated with axes of `mesh` only (or None).

  Without rules, such an annotation places the variable as Flax's eager
  creation and `plan` do; logical names no rule resolves leave it alone.
  """
  names = variable.get_metadata('out_sharding', None)
  if not names or not isinstance(
    names, tuple | list | jax.sharding.PartitionSpec
  ):
    return False  # None, or a sharding or Format: the value's own applies.
  for name in names:
    axes = name if isinstance(name, tuple | list) else (name,)
    if any(a is not None and a not in mesh.axis_names for a in axes):
      return False
  return True


def target_sharding(
  entry: _selection.Entry,
  mesh: jax.sharding.Mesh | None,
  rules: _logical.LogicalRules | _context.FlaxRules,
) -> jax.sharding.Sharding:
  """The concrete sharding the restored array of `entry` must have.

  An annotated variable is resolved by the rules in effect on the mesh
  that applies (`_meshes.mesh_for`); when no rules are in effect at all,
  only one annotated with that mesh's axes is (as Flax places it). Any
  other variable keeps its value's own sharding.
  """
  sharding = None
  no_rules = isinstance(rules, _context.FlaxRules) and not rules.pairs
  placement = _meshes.mesh_for(entry.variable, mesh=mesh)
  if not isinstance(placement, jax.sharding.Mesh) or (
    no_rules
    and not entry.variable.get_metadata('sharding_rules', None)
    and not _names_mesh_axes(entry.variable, placement)
  ):
    placement = None
  if placement is not None:
    resolution = _spec.spec_of_variable(
      entry.variable, rules=rules, mesh=placement, path=entry.name
    )
    if resolution is not None:
      sharding = jax.sharding.NamedSharding(placement, resolution.spec)
  if sharding is None:
    sharding = _own_sharding(entry, mesh)
  if entry.key_impl is not None and isinstance(
    sharding, jax.sharding.NamedSharding
  ):
    # The key-data dimension is not sharded.
    spec = tuple(sharding.spec) + (None,) * (
      len(entry.shape) - len(sharding.spec)
    )
    sharding = jax.sharding.NamedSharding(
      sharding.mesh, jax.sharding.PartitionSpec(*spec)
    )
  return sharding


def target_shardings(
  entries: Sequence[_selection.Entry],
  mesh: jax.sharding.Mesh | None,
  rules: _logical.LogicalRules | _context.FlaxRules,
) -> list[jax.sharding.Sharding]:
  """`target_sharding` of each entry; each over every process if several."""
  out = []
  for e in entries:
    sharding = target_sharding(e, mesh, rules)
    if jax.process_count() > 1:
      _selection.check_spans_processes(e.name, sharding)
    out.append(sharding)
  return out


# Filling the target
# ------------------------------------------------------------------------------


def as_target(
  array: jax.Array, entry: _selection.Entry, saved: np.dtype
) -> jax.Array:
  """A placed array in the target's form: its dtype, a typed key if one,
  and the device-local layout the target asks for (`target_layout`)."""
  if saved != entry.dtype:  # convert_dtypes: as asked.
    array = astype(array, entry.dtype)
  layout = target_layout(entry)
  if layout is not None:
    array = jax.device_put(array, Format(layout, array.sharding))
  if entry.key_impl is not None:
    array = jax.random.wrap_key_data(array, impl=entry.key_impl)
  return array


def target_layout(entry: _selection.Entry) -> Layout | None:
  """The layout a target variable asks for, or None for the default.

  Its ``out_sharding`` metadata's, if a ``Format``; else that of its
  abstract value, as ``nnx.get_abstract_model`` and ``nnx.as_abstract``
  type it (a ``jax.ShapeDtypeStruct`` made with a ``Format``).
  """
  layout = _spec.layout_of(entry.variable)
  if layout is None:
    value = _spec.value_of(entry.variable)
    if isinstance(value, jax.ShapeDtypeStruct):
      layout = getattr(getattr(value, 'format', None), 'layout', None)
  return layout


def astype(array: jax.Array, dtype: np.dtype) -> jax.Array:
  """`array.astype(dtype)`, keeping exactly `array.sharding`."""
  out = array.astype(dtype)
  if out.sharding == array.sharding:
    return out
  return jax.make_array_from_single_device_arrays(
    out.shape, array.sharding, [s.data for s in out.addressable_shards]
  )


def fill(
  target: Any,
  entries: Sequence[_selection.Entry],
  arrays: Sequence[jax.Array],
  rng_seed: int | None,
) -> Any:
  """Puts `arrays` into the target: a module in place, or a new state.

  Raises:
    ExportError: If an abstract target would keep abstract variables.
  """
  flat = [
    (e.path, e.variable.copy(a)) for e, a in zip(entries, arrays, strict=True)
  ]
  if isinstance(target, nnx.State):
    return nnx.from_flat_state(flat)
  flat += _fill_abstract(target, {e.path for e in entries}, rng_seed)
  nnx.update(target, nnx.from_flat_state(flat))
  return target


def _fill_abstract(
  target: Any, restored: set[tuple[Any, ...]], rng_seed: int | None
) -> list[tuple[tuple[Any, ...], nnx.Variable]]:
  """Values for target variables that stay abstract; or an error naming them."""
  filled, missing = [], []
  for path, variable in _variables.iter_variables(target):
    value = _spec.value_of(variable)
    if tuple(path) in restored or not isinstance(value, jax.ShapeDtypeStruct):
      continue
    if rng_seed is not None and isinstance(variable, nnx.RngState):
      filled.append(
        (tuple(path), variable.copy(_rng_value(path, value, rng_seed)))
      )
    else:
      missing.append(_names.path_text(path))
  if missing:
    raise _errors.ExportError(
      f'The target is abstract, and {len(missing)} of its variables are not '
      f'restored: {_variables.listing(missing)}. Expected every variable '
      'of an abstract target to get a value: restore them too (`include=`, '
      '`exclude=`), pass `rng_seed=` to seed RNG state, or restore into a '
      'concrete model, whose other variables keep their values.'
    )
  return filled


def _rng_value(path: Any, abstract: jax.ShapeDtypeStruct, seed: int) -> Any:
  sharding = getattr(abstract, 'sharding', None)
  if not isinstance(getattr(sharding, 'mesh', None), jax.sharding.Mesh):
    sharding = None
  if _dtypes.is_key(abstract.dtype):
    key = jax.random.fold_in(
      jax.random.key(seed, impl=_dtypes.key_impl(abstract)),
      zlib.crc32(_names.path_text(path).encode()) & 0x7FFFFFFF,
    )
    value = jax.random.split(key, abstract.shape) if abstract.shape else key
  else:
    value = jnp.zeros(abstract.shape, abstract.dtype)  # An nnx.Rngs count.
  return jax.device_put(value, sharding) if sharding is not None else value


# The keywords of a restore
# ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class RestoreOptions:
  """The keywords of every restore, with their defaults, written once.

  `restore_checkpoint` and `from_tf_module` take them (`takes_restore_options`
  gives each its public signature); see either for what each means.
  """

  include: filterlib.Filter = ...
  exclude: filterlib.Filter = nnx.RngState
  mesh: jax.sharding.Mesh | None = None
  rules: _logical.RulesLike | None = None
  allow_extra: bool = False
  convert_dtypes: bool = False
  rng_seed: int | None = None
  progress: bool | None = None

  def entries(self, target: Any) -> list[_selection.Entry]:
    """The target's variables these options select."""
    return _selection.select(target, self.include, self.exclude, what='target')

  def rules_in_effect(self) -> _logical.LogicalRules | _context.FlaxRules:
    """The rules these options place annotated variables by."""
    return _context.rules_in_effect(self.rules)


_S = TypeVar('_S')
_T = TypeVar('_T')
_P = ParamSpec('_P')


def _keywords_of(
  options: Callable[_P, RestoreOptions],
) -> Callable[
  [Callable[[_S, _T, RestoreOptions], _T]],
  Callable[Concatenate[_S, _T, _P], _T],
]:
  """A decorator giving `fn(source, target, options)` the public signature.

  The decorated function is called as `fn(source, target, *, <each field
  of RestoreOptions>=default)`, and `inspect.signature` shows that: its
  own two parameters, then every option as a keyword-only parameter with
  its type and default.
  """
  keywords = list(inspect.signature(options).parameters.values())

  def decorate(
    fn: Callable[[_S, _T, RestoreOptions], _T],
  ) -> Callable[Concatenate[_S, _T, _P], _T]:
    own = inspect.signature(fn)
    source, target = list(own.parameters.values())[:2]
    signature = own.replace(parameters=[source, target, *keywords])

    @functools.wraps(fn)
    def restore(*args: Any, **kwargs: Any) -> _T:
      bound = signature.bind(*args, **kwargs)
      given = dict(bound.arguments)
      return fn(
        given.pop(source.name), given.pop(target.name), options(**given)
      )

    restore.__signature__ = signature  # type: ignore[attr-defined]
    return restore

  return decorate


takes_restore_options = _keywords_of(RestoreOptions)
