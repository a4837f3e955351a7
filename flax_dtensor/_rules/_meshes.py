"""Which mesh applies: to a value, to a variable, here and now.

`mesh_for` is the one answer to "which mesh applies", used by resolution,
placement, the Flax hook, `init`, `plan` and the DTensor export alike.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
from jax.sharding import (
  AbstractMesh,
  AxisType,
  Mesh,
  NamedSharding,
  PartitionSpec,
)

MeshLike = Mesh | AbstractMesh


def context_meshes() -> tuple[AbstractMesh | None, Mesh | None]:
  """The (abstract, concrete) meshes of this thread's context, or None."""
  abstract = jax.sharding.get_abstract_mesh()
  try:
    concrete = jax.sharding.get_mesh()
  except ValueError:  # Inside jit only the abstract mesh is known.
    concrete = None
  return (
    None if abstract.empty else abstract,
    None if concrete is None or concrete.empty else concrete,
  )


def current_mesh() -> MeshLike | None:
  """The mesh set by ``jax.set_mesh`` (abstract inside jit), or None.

  The concrete mesh when it is the one in effect, else the abstract mesh
  (inside ``jit``, or under ``jax.sharding.use_abstract_mesh``).
  """
  abstract, concrete = context_meshes()
  if abstract is None:
    return None
  if concrete is not None and concrete.abstract_mesh == abstract:
    return concrete
  return abstract


def own_mesh(value: Any) -> MeshLike | None:
  """The mesh an array (or ShapeDtypeStruct) is laid out on, if named."""
  sharding = getattr(value, 'sharding', None)
  if isinstance(sharding, NamedSharding):
    return sharding.mesh
  return None


def mesh_for(
  variable: Any = None,
  *,
  mesh: MeshLike | None = None,
  value: Any = None,
) -> MeshLike | None:
  """Returns the mesh that applies to a variable or value here, or None.

  In order: the variable's own ``mesh`` metadata (as Flax uses it when it
  creates the variable); `mesh`, when the caller names one; the mesh of the
  context (``jax.set_mesh``, abstract inside ``jit``); the mesh the value is
  already laid out on.

  Args:
    variable: An ``nnx.Variable``, or None.
    mesh: A mesh the caller passed explicitly, or None.
    value: The array; defaults to the variable's value.
  """
  if variable is not None:
    own = variable.get_metadata('mesh', None)
    if own is not None:
      return own
  if mesh is not None:
    return mesh
  context = current_mesh()
  if context is not None:
    return context
  if value is None and variable is not None:
    value = variable.get_raw_value()
  return own_mesh(value)


def axis_sizes(mesh: MeshLike) -> dict[str, int]:
  """``{axis name: size}`` of a mesh."""
  return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))


DEVICES_MSG = (
  'The mesh needs {needed} devices, and JAX has {have} ({backend}). On CPU, '
  'make {needed} virtual devices before any other JAX call: '
  "jax.config.update('jax_num_cpu_devices', {needed}) (or start Python "
  'with XLA_FLAGS=--xla_force_host_platform_device_count={needed}), then '
  'build the mesh with jax.make_mesh.'
)


def devices_hint(mesh: MeshLike | None) -> str:
  """How to get the devices `mesh` needs, or '' if JAX has enough.

  For the error of a function given an abstract mesh where it needs a
  concrete one: often the concrete mesh could not be built, because
  `jax.make_mesh` needs as many devices as the mesh has positions and a
  laptop has one CPU device.
  """
  if mesh is None:
    return ''
  needed = math.prod(mesh.axis_sizes)
  have = jax.device_count()
  if needed <= have:
    return ''
  return DEVICES_MSG.format(
    needed=needed, have=have, backend=jax.default_backend()
  )


def describe(mesh: MeshLike | None) -> str:
  """'mesh(data=2, model=4; Explicit, Auto)' for error messages."""
  if mesh is None:
    return 'no mesh'
  sizes = ', '.join(f'{n}={s}' for n, s in axis_sizes(mesh).items())
  types = ', '.join(str(t).rsplit('.', 1)[-1] for t in mesh.axis_types)
  return f'mesh({sizes}; {types})'


@functools.lru_cache(maxsize=64)
def auto_copy(mesh: Mesh) -> Mesh:
  """`mesh` with every axis Auto: same devices, names and sizes."""
  return Mesh(
    mesh.devices,
    mesh.axis_names,
    axis_types=(AxisType.Auto,) * len(mesh.axis_names),
  )


def same_devices(a: MeshLike | None, b: Mesh) -> bool:
  """Whether `a` is a concrete mesh of `b`'s devices, names and shape."""
  return (
    isinstance(a, Mesh)
    and a.axis_names == b.axis_names
    and a.devices.shape == b.devices.shape
    and (a.devices == b.devices).all()
  )


def put(x: Any, sharding: jax.sharding.Sharding) -> Any:
  """``jax.device_put(x, sharding)``, typed keys over several processes too.

  JAX moves a typed key array laid out over several processes' devices
  only as its key data: `jax.device_put` refuses the key itself there
  (it is not a plain array), where it moves the key data. An array already
  laid out so is returned as it is, without a dispatch.
  """
  if isinstance(x, jax.Array) and x.sharding == sharding:
    return x
  if (
    isinstance(x, jax.Array)
    and not x.is_fully_addressable
    and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
  ):
    data = jax.device_put(jax.random.key_data(x), sharding)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
  return jax.device_put(x, sharding)


def retype(x: Any, mesh: Mesh) -> Any:
  """`x` on `mesh`, zero-copy when it is laid out on the same devices."""
  if not isinstance(x, jax.Array):
    return x
  sharding = x.sharding
  if isinstance(sharding, NamedSharding) and same_devices(sharding.mesh, mesh):
    return put(x, NamedSharding(mesh, _spec_of_rank(sharding.spec, x.ndim)))
  return put(x, NamedSharding(mesh, PartitionSpec()))


def _spec_of_rank(spec: PartitionSpec, ndim: int) -> PartitionSpec:
  """`spec` for an array of `ndim` dimensions.

  JAX 0.10 gives a typed key on a mesh of one device its key data's spec
  (`P(None,)` for a scalar key); the entries past the key's own rank name
  nothing, and are dropped.
  """
  if len(spec) <= ndim:
    return spec
  if any(entry is not None for entry in spec[ndim:]):
    return PartitionSpec()
  return PartitionSpec(*spec[:ndim])
