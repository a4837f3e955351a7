"""JAX meshes, shardings and arrays <-> TF DTensor meshes, layouts and tensors.

The one rule everything here follows: a DTensor mesh's device *ids* are JAX
mesh *positions*. For a DTensor mesh built from JAX devices laid out in an
array `devices` (the JAX mesh's devices, transposed and reshaped when mesh axes
are fused), `global_device_ids = arange(devices.size).reshape(devices.shape)`,
`local_device_ids` are the flat positions of this process's devices (in
increasing order), and `local_devices[i]` is the TF logical CPU device
`CPU:k` where `k` is the index of the JAX device at `local_device_ids[i]` in
this process's local devices sorted by id. DTensor component `i` is then the
JAX shard on that device. JAX device ids themselves never become DTensor ids:
they are not positions, and across processes they are not even contiguous.

Nothing here runs a computation, a `jit` or a collective: a conversion only
builds metadata and hands buffers over, so processes need not call it in
lockstep.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import re
import threading
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from flax_dtensor import _errors, _rules
from flax_dtensor.dtensor import _tf

if TYPE_CHECKING:
  import tensorflow as tf
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

NOT_INITIALIZED_MSG = (
  'TF DTensor is not initialized: expected flax_dtensor.dtensor.initialize() '
  'to have been called. Call it once per process, before any other '
  'TensorFlow operation (it sets up one TF logical CPU device per local JAX '
  'device).'
)
_ENV_HELP = (
  'In a multi-process job, call jax.distributed.initialize() before '
  'flax_dtensor.dtensor.initialize(). Set, in every process and before '
  'initialize(): DTENSOR_JOBS to a '
  'comma-separated list of one free host:port per JAX process, in '
  'jax.process_index() order (the same list everywhere); DTENSOR_CLIENT_ID to '
  'jax.process_index(); and DTENSOR_JOB_NAME to one job name shared by all '
  'processes (e.g. "worker"). For a single process leave DTENSOR_JOBS unset.'
)

_lock = threading.RLock()
_topology_checked = False
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
      self.jax_mesh, _partition_spec(specs, self.jax_mesh)
    )


# ---------------------------------------------------------------------------
# Initialization.
# ---------------------------------------------------------------------------


def initialize(*, reset_context: bool = False) -> None:
  """Sets up TF DTensor to mirror the JAX topology of this process.

  Configures one TF logical CPU device per local JAX device
  (`jax.local_device_count()`), and one DTensor client per JAX process: in a
  multi-process job, the environment variables `DTENSOR_JOBS`,
  `DTENSOR_CLIENT_ID` and `DTENSOR_JOB_NAME` must describe the same processes
  as `jax.distributed.initialize` (client id == `jax.process_index()`).

  Call it once per process, before any other TensorFlow operation (TF fixes
  its devices the first time it runs anything). Calling it again is a no-op.

  Args:
    reset_context: Escape hatch when TensorFlow already ran something: reset
      TF's context first. Every TF object created before (tensors, variables)
      becomes invalid. Prefer calling `initialize()` earlier.

  Raises:
    DTensorInitializationError: If TF was already initialized (and
      `reset_context` is False), if the DTensor client environment does not
      match the JAX processes, or if DTensor was set up elsewhere with a
      different number of devices.
    ImportError: If TensorFlow is not installed.
  """
  global _topology_checked
  dt = _tf.dtensor()
  with _lock:
    if _tf.accelerator_util().is_initialized():
      _check_topology()
      return
    _check_client_env()
    try:
      with warnings.catch_warnings():
        # TF's reset path calls the deprecated `logging.warn`.
        warnings.simplefilter('ignore', DeprecationWarning)
        dt.initialize_accelerator_system(
          device_type='CPU',
          num_logical_cpu_devices=jax.local_device_count(),
          experimental_reset_context=reset_context,
        )
    except ValueError as e:
      if 'already been initialized' not in str(e):
        raise
      raise _errors.DTensorInitializationError(
        'TensorFlow was already initialized: expected '
        'flax_dtensor.dtensor.initialize() to run before any other '
        'TensorFlow operation, but TF already ran something (got '
        f'{str(e).splitlines()[0]!r}). Call '
        'flax_dtensor.dtensor.initialize() first thing in the program, or '
        'pass `reset_context=True` (invalidates every existing TF tensor '
        'and variable).'
      ) from e
    _topology_checked = False
    _check_topology()


def shutdown() -> None:
  """Shuts TF DTensor down and forgets every DTensor mesh built here.

  Every TF object created under DTensor (tensors, variables) becomes invalid.
  `initialize()` may be called again afterwards.

  TensorFlow cannot shut DTensor down in multi-client mode (several
  processes): there, keep it initialized until the processes exit.

  Raises:
    DTensorInitializationError: If DTensor is not initialized, or runs in
      multi-client mode.
  """
  global _topology_checked
  with _lock:
    if not is_initialized():
      raise _errors.DTensorInitializationError(
        'flax_dtensor.dtensor.shutdown() was called but TF DTensor is not '
        'initialized: expected a prior flax_dtensor.dtensor.initialize(). '
        'Nothing to shut down.'
      )
    dt = _tf.dtensor()
    if dt.num_clients() > 1:
      raise _errors.DTensorInitializationError(
        'TF DTensor cannot be shut down in multi-client mode: expected a '
        f'single client, got {dt.num_clients()} clients '
        f'(DTENSOR_JOBS={os.environ.get("DTENSOR_JOBS")!r}). TensorFlow does '
        'not support it; keep DTensor initialized until the processes exit.'
      )
    dt.shutdown_accelerator_system()
    # TF keeps its DTensor device, bound to the context just reset; a later
    # initialize() would then fail every pack ('device:CUSTOM:0 unknown
    # device'). Drop it so that the next use creates a new one.
    api = importlib.import_module('tensorflow.dtensor.python.api')
    reset = getattr(api, '_reset', None)
    if reset is not None:
      reset()
    _topology_checked = False
    _mesh_cache.clear()
    _single_device_cache.clear()
    _registry.clear()


def is_initialized() -> bool:
  """Returns whether TF DTensor is initialized (never imports TensorFlow)."""
  if not _tf.is_imported():
    return False
  return bool(_tf.accelerator_util().is_initialized())


def _expected_clients() -> tuple[int, int, str | None, str | None]:
  jobs = os.environ.get('DTENSOR_JOBS')
  raw_id = os.environ.get('DTENSOR_CLIENT_ID')
  num_clients = len(jobs.split(',')) if jobs else 1
  try:
    client_id = int(raw_id) if raw_id is not None else 0
  except ValueError:
    client_id = -1
  return num_clients, client_id, jobs, raw_id


def _check_client_env() -> None:
  """Checks the DTENSOR_* environment against the JAX processes."""
  num_clients, client_id, jobs, raw_id = _expected_clients()
  if jobs is not None and not jobs.strip():
    raise _errors.DTensorInitializationError(
      'DTENSOR_JOBS is set but empty: expected it unset (one process) or a '
      f'list of {jax.process_count()} host:port entries, got {jobs!r}. '
      + _ENV_HELP
    )
  if num_clients != jax.process_count() or client_id != jax.process_index():
    raise _errors.DTensorInitializationError(
      'TF DTensor must have one client per JAX process: expected '
      f'{jax.process_count()} DTensor client(s) and client id '
      f'{jax.process_index()} (jax.process_count() and '
      f'jax.process_index()), got {num_clients} client(s) from '
      f'DTENSOR_JOBS={jobs!r} and client id {raw_id!r} from '
      f'DTENSOR_CLIENT_ID (DTENSOR_JOB_NAME='
      f'{os.environ.get("DTENSOR_JOB_NAME")!r}). ' + _ENV_HELP
    )


def _check_topology() -> None:
  """Checks that initialized DTensor mirrors the JAX topology (cached)."""
  global _topology_checked
  if _topology_checked:
    return
  dt = _tf.dtensor()
  num_tf = dt.num_local_devices('CPU')
  if num_tf != jax.local_device_count():
    raise _errors.DTensorInitializationError(
      'TF DTensor must have one logical CPU device per local JAX device: '
      f'expected {jax.local_device_count()} (jax.local_device_count()), got '
      f'{num_tf}. DTensor was probably initialized by other code; call '
      'flax_dtensor.dtensor.initialize() instead, before any other '
      'TensorFlow operation.'
    )
  if dt.num_clients() != jax.process_count() or (
    dt.client_id() != jax.process_index()
  ):
    raise _errors.DTensorInitializationError(
      'TF DTensor must have one client per JAX process: expected '
      f'{jax.process_count()} client(s) and client id '
      f'{jax.process_index()}, got {dt.num_clients()} client(s) and client '
      f'id {dt.client_id()}. ' + _ENV_HELP
    )
  _topology_checked = True


def _require_initialized() -> Any:
  """Returns the dtensor module, or raises if DTensor is not set up."""
  if not is_initialized():
    raise _errors.DTensorInitializationError(NOT_INITIALIZED_MSG)
  with _lock:
    _check_topology()
  return _tf.dtensor()


# ---------------------------------------------------------------------------
# Meshes and layouts.
# ---------------------------------------------------------------------------


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
  _require_initialized()
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
  dt = _require_initialized()
  if not isinstance(ndim, int) or isinstance(ndim, bool) or ndim < 0:
    raise _errors.DTensorError(
      f'Expected `ndim` to be a non-negative int, got {ndim!r}.'
    )
  dmesh, specs, _ = _plan(sharding, ndim)
  return dt.Layout(specs, dmesh)


def _plan(
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
    dim_axes.append(tuple(_rules.target_axes(entry)))
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


def _lookup(dmesh: Any) -> _MeshRecord | None:
  """Returns the most recent JAX origin of a DTensor mesh, if any."""
  with _lock:
    records = _registry.get(dmesh.to_string())
    return records[-1] if records else None


def _partition_spec(
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


def _component_indices(
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


def _normalize_index(
  index: tuple[slice, ...], shape: tuple[int, ...]
) -> tuple[tuple[int, int], ...]:
  out = []
  for s, size in zip(index, shape, strict=True):
    start, stop, step = s.indices(size)
    assert step == 1, index
    out.append((start, stop))
  return tuple(out)


# ---------------------------------------------------------------------------
# Arrays.
# ---------------------------------------------------------------------------


def array_to_dtensor(arr: jax.Array) -> tf.Tensor:
  """Returns a TF DTensor whose components are `arr`'s shards, without copy.

  The layout is `layout_for(arr.sharding, arr.ndim)`. Only this process's
  (addressable) shards are used; no data moves between devices or processes
  and no collective runs. On CPU the components alias the JAX buffers
  (zero-copy): TF writes to a `DVariable` made from the result copy first, so
  `arr` never changes. While TF holds the DTensor, JAX skips donating `arr`'s
  buffers.

  Args:
    arr: A `jax.Array` with a `NamedSharding` or `SingleDeviceSharding`.

  Returns:
    A DTensor (`tf.Tensor`) of `arr`'s shape and dtype.

  Raises:
    DTensorInitializationError: If `initialize()` was not called.
    DTensorError: If `arr` is not a live `jax.Array`, or its sharding cannot
      be expressed as a DTensor layout (see `layout_for`).
  """
  dt = _require_initialized()
  if not isinstance(arr, jax.Array):
    raise _errors.DTensorError(
      f'Expected a jax.Array, got {type(arr).__name__}: {arr!r}. Convert it '
      'with jax.device_put(x, sharding) first.'
    )
  if arr.is_deleted():
    raise _errors.DTensorError(
      f'Expected a live jax.Array, got a deleted one (shape {arr.shape}, dtype '
      f'{arr.dtype}), e.g. donated to a jitted function. Convert the array '
      'before donating it.'
    )
  shape = tuple(arr.shape)
  dmesh, specs, record = _plan(arr.sharding, arr.ndim)
  by_device = {shard.device: shard for shard in arr.addressable_shards}
  components = []
  expected = _component_indices(dmesh, specs, shape)
  for gid, index in zip(dmesh.local_device_ids(), expected, strict=True):
    device = record.devices.flat[int(gid)]
    shard = by_device.get(device)
    if shard is None or _normalize_index(shard.index, shape) != index:
      # An internal invariant, checked even under `python -O`: the layout
      # must describe exactly the shards packed.
      raise AssertionError(
        'flax_dtensor internal error: the DTensor component at mesh '
        f'position {gid} (JAX device {device!r}) should hold the slice '
        f'{index!r} of the array, but the JAX shard there is '
        f'{None if shard is None else shard.index!r}. Please report this '
        f'with the sharding {arr.sharding!r}.'
      )
    components.append(np.asarray(shard.data))
  return dt.pack(components, dt.Layout(specs, dmesh))


def dtensor_to_array(
  t: tf.Tensor | tf.Variable,
  *,
  mesh: jax.sharding.Mesh | None = None,
  sharding: jax.sharding.Sharding | None = None,
) -> jax.Array:
  """Returns the `jax.Array` with the values and layout of a TF DTensor.

  Each local DTensor component becomes the JAX shard holding the same slice
  of the global array: no host gather, no collective, no data exchanged
  between processes. On CPU the shards alias the TF buffers when they are
  suitably aligned (TF's are); JAX arrays are immutable, and TF copies a
  `DVariable`'s buffer before writing to it while a JAX array still holds it.

  The JAX sharding is, in order of preference: `sharding`; else the DTensor
  layout's axes looked up in `mesh` (a fused DTensor axis 'a+b' becomes
  `('a', 'b')`); else the JAX mesh the DTensor mesh was built from by this
  module (`mesh_to_dtensor`, `layout_for`, `array_to_dtensor`). Several JAX
  meshes can give the same DTensor mesh (same devices and axis names, other
  `axis_types`): then the one converted most recently wins, so pass `mesh` or
  `sharding` when it matters. Whichever is used, values are right: shards are
  matched to components by slice.

  Args:
    t: A DTensor, or a DTensor variable (`dtensor.DVariable`).
    mesh: A JAX mesh whose axis names include the layout's mesh axes.
    sharding: The JAX sharding of the result. Each of its local shards must be
      exactly the slice held by some local DTensor component (the device
      assignment may differ: shards are matched by slice).

  Returns:
    A `jax.Array` with the shape, dtype and values of `t`.

  Raises:
    DTensorInitializationError: If `initialize()` was not called.
    DTensorError: If `t` is not a DTensor; if both `mesh` and `sharding` are
      given; if `sharding` partitions the array differently from the DTensor
      layout; if neither is given and the DTensor mesh was not built here.
  """
  dt = _require_initialized()
  tf_module = _tf.tf()
  if mesh is not None and sharding is not None:
    raise _errors.DTensorError(
      'Expected at most one of `mesh` and `sharding`, got both: '
      f'mesh={mesh!r}, sharding={sharding!r}.'
    )
  if isinstance(t, tf_module.Variable):
    t = t.read_value()
  if not isinstance(t, tf_module.Tensor) or not dt.is_dtensor(t):
    raise _errors.DTensorError(
      f'Expected a TF DTensor (e.g. from array_to_dtensor or dtensor.pack), '
      f'got {type(t).__name__}: {t!r:.200}.'
    )
  layout = dt.fetch_layout(t)
  dmesh = layout.mesh
  specs = list(layout.sharding_specs)
  shape = tuple(int(d) for d in t.shape)
  record = _lookup(dmesh)
  if sharding is None:
    if mesh is not None:
      if not isinstance(mesh, jax.sharding.Mesh):
        raise _errors.DTensorError(
          f'Expected `mesh` to be a jax.sharding.Mesh, got {mesh!r}.'
        )
      sharding = jax.sharding.NamedSharding(mesh, _partition_spec(specs, mesh))
    elif record is None:
      raise _errors.DTensorError(
        'Expected a DTensor on a mesh built by flax_dtensor in this process, '
        f'got one on the DTensor mesh {dmesh.to_string()!r}, whose JAX '
        'devices are unknown. Pass `mesh=` or `sharding=`.'
      )
    else:
      sharding = record.sharding(specs)
  elif not isinstance(
    sharding,
    jax.sharding.NamedSharding | jax.sharding.SingleDeviceSharding,
  ):
    raise _errors.DTensorError(
      'Expected `sharding` to be a jax.sharding.NamedSharding or '
      f'SingleDeviceSharding, got {sharding!r}.'
    )
  elif isinstance(sharding, jax.sharding.NamedSharding) and (
    len(sharding.spec) > len(shape)
  ):
    raise _errors.DTensorError(
      f'Expected a `sharding` whose PartitionSpec has at most {len(shape)} '
      f'entries for the rank-{len(shape)} DTensor, got {sharding!r}.'
    )
  components = dt.unpack(t)
  indices = _component_indices(dmesh, specs, shape)
  # The device each component came from, when this module built the mesh.
  home = (
    [record.devices.flat[int(g)] for g in dmesh.local_device_ids()]
    if record is not None
    else [None] * len(components)
  )
  by_index: dict[tuple[tuple[int, int], ...], list[int]] = {}
  for i, index in enumerate(indices):
    by_index.setdefault(index, []).append(i)
  try:
    targets = sharding.addressable_devices_indices_map(shape)
  except (ValueError, IndexError) as e:
    raise _errors.DTensorError(
      f'Expected a `sharding` that fits the DTensor shape {shape}, got '
      f'{sharding!r}: {e}'
    ) from e
  devices, views = [], []
  for device, index in targets.items():
    key = _normalize_index(index, shape)
    candidates = by_index.get(key)
    if not candidates:
      raise _errors.DTensorError(
        f'The JAX sharding disagrees with the DTensor layout: expected each '
        f'local JAX shard to be the slice of a local DTensor component, got '
        f'device {device!r} needing slice {key!r} while the local components '
        f'hold {sorted(by_index)!r} (DTensor layout {specs!r} on mesh axes '
        f'{dict(zip(dmesh.dim_names, dmesh.shape(), strict=True))!r}; '
        f'sharding {sharding!r}). Pass a sharding that partitions the array '
        'like the layout does, or relayout the DTensor first.'
      )
    i = next((c for c in candidates if home[c] == device), candidates[0])
    devices.append(device)
    views.append(_component_numpy(components[i]))
  arrays = jax.device_put(views, devices)  # One batched call.
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _component_numpy(component: Any) -> np.ndarray:
  """Returns a NumPy view of a TF eager tensor (a copy if TF cannot share)."""
  view = getattr(component, '_numpy', None)
  return view() if view is not None else component.numpy()
