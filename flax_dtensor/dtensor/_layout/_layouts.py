"""JAX meshes and shardings -> TF DTensor meshes and layouts.

The one rule: a DTensor mesh's device *ids* are JAX mesh *positions*. For a
DTensor mesh built from JAX devices laid out in an array `devices` (the JAX
mesh's devices, transposed and reshaped when mesh axes are fused),
`global_device_ids = arange(devices.size).reshape(devices.shape)`,
`local_device_ids` are the flat positions of this process's devices, and
`local_devices[i]` is the TF logical CPU device of the JAX device at
`local_device_ids[i]`. JAX device ids never become DTensor ids. Nothing here
runs a computation or a collective.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from flax_dtensor import _errors
from flax_dtensor._rules import _partition_specs
from flax_dtensor.dtensor import _tf
from flax_dtensor.dtensor._layout import _topology

if TYPE_CHECKING:
  from tensorflow.experimental import dtensor as tf_dtensor

# A DTensor mesh axis that fuses several JAX mesh axes is named after them,
# joined by this separator, e.g. 'data+model'.
FUSED_AXIS_SEPARATOR = '+'
# The one DTensor mesh axis (of size 1) of an array on a single device.
SINGLE_DEVICE_AXIS = 'single_device'
# DTensor parses mesh and layout strings split on ',', '|', '=' and ' ' (some
# of these crash TF); keep to a safe alphabet.
_AXIS_NAME_RE = re.compile(r'[A-Za-z0-9_.\-]+')
_RESERVED_AXIS_NAMES = frozenset({'unsharded', 'match'})
_UNSHARDED = 'unsharded'  # == tf.experimental.dtensor.UNSHARDED

_lock = _topology._lock
# (JAX mesh, fused axis groups) -> DTensor mesh.
_mesh_cache: dict[
  tuple[jax.sharding.Mesh, tuple[tuple[str, ...], ...]], tuple[Any, _MeshRecord]
] = {}
# DTensor mesh string -> the ways flax_dtensor built that DTensor mesh, the
# most recently used last.
_registry: dict[str, list[_MeshRecord]] = {}
# JAX device -> its one-device DTensor mesh.
_single_device_cache: dict[jax.Device, tuple[Any, _MeshRecord]] = {}
_local_index_cache: dict[jax.Device, int] | None = None


@dataclasses.dataclass(frozen=True)
class _MeshRecord:
  """How a DTensor mesh built here maps back to JAX.

  Attributes:
    devices: The JAX devices in the DTensor mesh's shape: DTensor device id
      `p` (a flat position) is `devices.flat[p]`.
    axis_groups: For each DTensor mesh axis, the JAX mesh axes it fuses.
    jax_mesh: The JAX mesh, or None for a single-device array.
    device: The device of a single-device array, else None.
    key: The DTensor mesh's string (its key in the registry).
  """

  devices: np.ndarray = dataclasses.field(compare=False)
  axis_groups: tuple[tuple[str, ...], ...]
  jax_mesh: jax.sharding.Mesh | None
  device: jax.Device | None
  key: str

  def sharding(self, specs: Sequence[str]) -> jax.sharding.Sharding:
    """Returns the JAX sharding of a DTensor layout on this mesh."""
    if self.device is not None:
      return jax.sharding.SingleDeviceSharding(self.device)
    assert self.jax_mesh is not None
    return jax.sharding.NamedSharding(
      self.jax_mesh, partition_spec(specs, self.jax_mesh)
    )


def clear_caches() -> None:
  """Forgets every DTensor mesh built here (after a DTensor shutdown)."""
  with _lock:
    _mesh_cache.clear()
    _single_device_cache.clear()
    _registry.clear()


_topology._on_shutdown.append(clear_caches)


def mesh_to_dtensor(mesh: jax.sharding.Mesh) -> tf_dtensor.Mesh:
  """Returns the TF DTensor mesh with the same axes and devices as `mesh`.

  DTensor device ids are positions in `mesh.devices` (row-major), so any
  device order (reversed, transposed, `jax.make_mesh`'s) and meshes across
  several processes map correctly. Runs no computation; the result is cached
  per mesh.

  Args:
    mesh: A JAX mesh. Its devices must be this process's local devices or
      devices of other JAX processes.

  Returns:
    A `tf.experimental.dtensor.Mesh` with the axis names and shape of `mesh`.

  Raises:
    DTensorInitializationError: If `initialize()` was not called.
    DTensorError: If `mesh` is not a `jax.sharding.Mesh`, has an axis name
      DTensor cannot use, or has no device of this process.
  """
  _topology.require_initialized()
  if not isinstance(mesh, jax.sharding.Mesh):
    raise _errors.DTensorError(
      'Expected a concrete `jax.sharding.Mesh` (with devices), got '
      f'{mesh!r}. Build one with jax.make_mesh(...) or '
      'jax.sharding.Mesh(devices, axis_names).'
    )
  groups = tuple((name,) for name in mesh.axis_names)
  return _dtensor_mesh(mesh, groups)[0]


def layout_for(sharding: jax.sharding.Sharding, ndim: int) -> tf_dtensor.Layout:
  """Returns the TF DTensor layout equivalent to a JAX sharding.

  A `NamedSharding` maps each array dimension to its mesh axis; mesh axes the
  spec does not use are replicated over. A dimension sharded over several
  mesh axes (`P(('data', 'model'))`) maps to one DTensor mesh axis fusing them
  (named 'data+model', devices in the product's row-major order), so the
  layout is lossless and the DTensor components are exactly the JAX shards.
  A `SingleDeviceSharding` maps to a one-device mesh (axis 'single_device').

  Args:
    sharding: A `jax.sharding.NamedSharding` or `SingleDeviceSharding`.
    ndim: The rank of the arrays to lay out.

  Returns:
    A `tf.experimental.dtensor.Layout` of rank `ndim`.

  Raises:
    DTensorInitializationError: If `initialize()` was not called.
    DTensorError: If the sharding has another type, does not fit `ndim`, has
      unreduced axes, or uses mesh axis names DTensor cannot use.
  """
  dt = _topology.require_initialized()
  if not isinstance(ndim, int) or isinstance(ndim, bool) or ndim < 0:
    raise _errors.DTensorError(
      f'Expected `ndim` to be a non-negative int, got {ndim!r}.'
    )
  dmesh, specs, _ = layout_parts(sharding, ndim)
  return dt.Layout(specs, dmesh)


def layout_parts(
  sharding: jax.sharding.Sharding, ndim: int
) -> tuple[Any, list[str], _MeshRecord]:
  """Returns (DTensor mesh, DTensor sharding specs, record) for a sharding."""
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    (device,) = sharding.device_set
    dmesh, record = _single_device_mesh(device)
    return dmesh, [_UNSHARDED] * ndim, record
  if not isinstance(sharding, jax.sharding.NamedSharding):
    raise _errors.DTensorError(
      'Expected a jax.sharding.NamedSharding or SingleDeviceSharding, got '
      f'{sharding!r}. TF DTensor layouts are named: put the array on a mesh '
      'first, e.g. jax.device_put(x, jax.sharding.NamedSharding(mesh, spec)).'
    )
  mesh = sharding.mesh
  if not isinstance(mesh, jax.sharding.Mesh):
    raise _errors.DTensorError(
      f'Expected a NamedSharding on a concrete jax.sharding.Mesh, got one on '
      f'{mesh!r}. Use a mesh with devices.'
    )
  dim_axes = _dim_axes(sharding, ndim)
  groups: list[tuple[str, ...]] = []
  emitted: set[str] = set()
  for name in mesh.axis_names:
    if name in emitted:
      continue
    group = next((axes for axes in dim_axes if name in axes), (name,))
    groups.append(group)
    emitted.update(group)
  dmesh, record = _dtensor_mesh(mesh, tuple(groups))
  specs = [
    FUSED_AXIS_SEPARATOR.join(axes) if axes else _UNSHARDED for axes in dim_axes
  ]
  return dmesh, specs, record


def _dim_axes(
  sharding: jax.sharding.NamedSharding, ndim: int
) -> list[tuple[str, ...]]:
  """Returns, per array dimension, the mesh axes it is sharded over."""
  spec = sharding.spec
  mesh = sharding.mesh
  unreduced = getattr(spec, 'unreduced', frozenset())
  if unreduced:
    raise _errors.DTensorError(
      'Expected an array holding its values, got a sharding with unreduced '
      f'(partial-sum) mesh axes {sorted(unreduced)!r}: {sharding!r}. Reduce '
      'it first (e.g. jax.sharding.reshard to a spec without `unreduced`).'
    )
  if len(spec) > ndim:
    raise _errors.DTensorError(
      f'Expected a PartitionSpec of at most {ndim} entries for a rank-{ndim} '
      f'array, got {spec!r}.'
    )
  dim_axes: list[tuple[str, ...]] = []
  for entry in (*spec, *([None] * (ndim - len(spec)))):
    if entry is jax.sharding.PartitionSpec.UNCONSTRAINED:
      raise _errors.DTensorError(
        f'Expected a concrete PartitionSpec, got {spec!r} with '
        'P.UNCONSTRAINED, which only has a meaning inside jax.jit. Convert '
        'the array returned by the jitted function instead.'
      )
    dim_axes.append(_partition_specs.axes_of(entry))
  # NamedSharding itself rejects unknown and repeated mesh axes.
  used = [name for axes in dim_axes for name in axes]
  assert set(used) <= set(mesh.axis_names), (spec, mesh)
  assert len(used) == len(set(used)), spec
  return dim_axes


def _check_axis_name(name: Any, mesh: jax.sharding.Mesh) -> None:
  if (
    not isinstance(name, str)
    or not _AXIS_NAME_RE.fullmatch(name)
    or name.lower() in _RESERVED_AXIS_NAMES
  ):
    raise _errors.DTensorError(
      'Expected mesh axis names DTensor can use: non-empty strings of '
      "letters, digits, '_', '-' and '.', other than 'unsharded' and "
      f"'match'; got {name!r} in mesh axis names {mesh.axis_names!r}. "
      "Rename the mesh axis (DTensor parses ',', '|', '=' and spaces as "
      f'separators, and flax_dtensor uses {FUSED_AXIS_SEPARATOR!r} to fuse '
      'axes).'
    )


def _dtensor_mesh(
  mesh: jax.sharding.Mesh, groups: tuple[tuple[str, ...], ...]
) -> tuple[Any, _MeshRecord]:
  """Returns the (cached) DTensor mesh fusing `mesh`'s axes into `groups`."""
  key = (mesh, groups)
  with _lock:
    cached = _mesh_cache.get(key)
    if cached is not None:
      _use(cached[1])
      return cached
    if not mesh.axis_names:
      raise _errors.DTensorError(
        f'Expected a mesh with at least one axis, got {mesh!r}.'
      )
    for name in mesh.axis_names:
      _check_axis_name(name, mesh)
    order = [mesh.axis_names.index(name) for group in groups for name in group]
    assert sorted(order) == list(range(len(mesh.axis_names))), (groups, mesh)
    shape = [math.prod(mesh.shape[name] for name in group) for group in groups]
    devices = np.transpose(mesh.devices, order).reshape(shape)
    names = [FUSED_AXIS_SEPARATOR.join(group) for group in groups]
    dmesh = _build_dtensor_mesh(names, devices)
    record = _MeshRecord(devices, groups, mesh, None, dmesh.to_string())
    _use(record)
    _mesh_cache[key] = (dmesh, record)
    return dmesh, record


def _single_device_mesh(device: jax.Device) -> tuple[Any, _MeshRecord]:
  """Returns the (cached) one-device DTensor mesh of `device`."""
  with _lock:
    cached = _single_device_cache.get(device)
    if cached is not None:
      _use(cached[1])
      return cached
    devices = np.array([device], dtype=object)
    dmesh = _build_dtensor_mesh([SINGLE_DEVICE_AXIS], devices)
    record = _MeshRecord(devices, (), None, device, dmesh.to_string())
    _use(record)
    _single_device_cache[device] = (dmesh, record)
    return dmesh, record


def _local_index() -> dict[jax.Device, int]:
  """Maps each local JAX device to its TF logical CPU device index."""
  global _local_index_cache
  if _local_index_cache is None:
    local = sorted(jax.local_devices(), key=lambda d: d.id)
    _local_index_cache = {d: k for k, d in enumerate(local)}
  return _local_index_cache


def local_jax_device(tf_device: str) -> jax.Device:
  """The local JAX device a TF logical CPU device (`initialize`) stands for."""
  index = _tf.tf().DeviceSpec.from_string(tf_device).device_index
  by_index = {k: d for d, k in _local_index().items()}
  return by_index[index]


def _build_dtensor_mesh(names: list[str], devices: np.ndarray) -> Any:
  """Builds a DTensor mesh: device id `p` is JAX device `devices.flat[p]`."""
  dt = _tf.dtensor()
  local_index = _local_index()
  flat = list(devices.flat)
  this_process = jax.process_index()
  local_ids = [p for p, device in enumerate(flat) if device in local_index]
  # A device of this process that is not a local device of the default
  # backend (e.g. a CPU device when JAX runs on GPU) has no TF device.
  foreign = [
    d for d in flat if d not in local_index and d.process_index == this_process
  ]
  if foreign or not local_ids:
    raise _errors.DTensorError(
      'Expected mesh devices that are local devices of this process '
      f'(process {this_process}: jax.local_devices()={jax.local_devices()!r}) '
      'or devices of other JAX processes, with at least one of this process '
      f'(DTensor needs every process to hold part of a mesh); got {flat!r}.'
    )
  tf_devices = dt.local_devices('CPU')
  # _check_topology() guarantees one TF logical CPU per local JAX device.
  assert len(tf_devices) == len(local_index), (tf_devices, local_index)
  local_devices = [tf_devices[local_index[flat[p]]] for p in local_ids]
  return dt.Mesh(
    list(names),
    np.arange(len(flat), dtype=np.int64).reshape(devices.shape),
    local_ids,
    local_devices,
  )


def _use(record: _MeshRecord) -> None:
  """Registers `record` as the most recent JAX origin of its DTensor mesh.

  Several JAX meshes can give one DTensor mesh: the same devices and axis
  names with other `axis_types` (e.g. Explicit and Auto), or, in another
  process, another placement of that process's devices. The JAX mesh used
  most recently wins when a DTensor comes back without `mesh` or `sharding`.
  """
  with _lock:
    records = _registry.setdefault(record.key, [])
    if not records or records[-1] is not record:
      if record in records:
        records.remove(record)
      records.append(record)


def lookup(dmesh: Any) -> _MeshRecord | None:
  """Returns the most recent JAX origin of a DTensor mesh, if any."""
  with _lock:
    records = _registry.get(dmesh.to_string())
    return records[-1] if records else None


def partition_spec(
  specs: Sequence[str], mesh: jax.sharding.Mesh
) -> jax.sharding.PartitionSpec:
  """Returns the PartitionSpec of DTensor sharding specs, against `mesh`."""
  entries: list[Any] = []
  for spec in specs:
    if spec == _UNSHARDED:
      entries.append(None)
      continue
    axes = tuple(spec.split(FUSED_AXIS_SEPARATOR))
    for name in axes:
      if name not in mesh.axis_names:
        raise _errors.DTensorError(
          f'The DTensor layout shards over mesh axis {spec!r}, expected its '
          f'axis name(s) {axes!r} in the JAX mesh axes {mesh.axis_names!r}. '
          'Pass a `mesh` with these axes, or an explicit `sharding`.'
        )
    entries.append(axes[0] if len(axes) == 1 else axes)
  while entries and entries[-1] is None:
    # JAX's canonical form: P('data') rather than P('data', None).
    entries.pop()
  return jax.sharding.PartitionSpec(*entries)


def component_indices(
  dmesh: Any, specs: Sequence[str], shape: tuple[int, ...]
) -> list[tuple[tuple[int, int], ...]]:
  """Returns, per local DTensor component, the global (start, stop) per dim."""
  mesh_shape = tuple(dmesh.shape())
  names = list(dmesh.dim_names)
  positions = {
    int(gid): p for p, gid in enumerate(dmesh.global_device_ids().flat)
  }
  for dim, spec in enumerate(specs):
    # Neither JAX arrays nor DTensors are ever unevenly sharded.
    assert spec == _UNSHARDED or not shape[dim] % mesh_shape[names.index(spec)]
  out = []
  for gid in dmesh.local_device_ids():
    coords = np.unravel_index(positions[int(gid)], mesh_shape)
    index = []
    for dim, spec in enumerate(specs):
      if spec == _UNSHARDED:
        index.append((0, shape[dim]))
      else:
        axis = names.index(spec)
        chunk = shape[dim] // mesh_shape[axis]
        index.append(
          (int(coords[axis]) * chunk, (int(coords[axis]) + 1) * chunk)
        )
    out.append(tuple(index))
  return out


def normalize_index(
  index: tuple[slice, ...], shape: tuple[int, ...]
) -> tuple[tuple[int, int], ...]:
  out = []
  for s, size in zip(index, shape, strict=True):
    start, stop, step = s.indices(size)
    assert step == 1, index
    out.append((start, stop))
  return tuple(out)
