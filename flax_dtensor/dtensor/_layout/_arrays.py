"""JAX arrays <-> TF DTensors, shard for component, without copies.

A conversion builds a layout (`_layouts`) and hands buffers over: on CPU the
DTensor components alias the JAX shards and back. No data moves between
devices or processes, so processes need not call it in lockstep.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from flax_dtensor import _errors
from flax_dtensor.dtensor import _tf
from flax_dtensor.dtensor._layout import _layouts, _topology

if TYPE_CHECKING:
  import tensorflow as tf


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
  dt = _topology.require_initialized()
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
  dmesh, specs, record = _layouts.layout_parts(arr.sharding, arr.ndim)
  by_device = {shard.device: shard for shard in arr.addressable_shards}
  components = []
  expected = _layouts.component_indices(dmesh, specs, shape)
  for gid, index in zip(dmesh.local_device_ids(), expected, strict=True):
    device = record.devices.flat[int(gid)]
    shard = by_device.get(device)
    if shard is None or _layouts.normalize_index(shard.index, shape) != index:
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
  dt = _topology.require_initialized()
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
  record = _layouts.lookup(dmesh)
  if sharding is None:
    if mesh is not None:
      if not isinstance(mesh, jax.sharding.Mesh):
        raise _errors.DTensorError(
          f'Expected `mesh` to be a jax.sharding.Mesh, got {mesh!r}.'
        )
      sharding = jax.sharding.NamedSharding(
        mesh, _layouts.partition_spec(specs, mesh)
      )
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
  indices = _layouts.component_indices(dmesh, specs, shape)
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
    key = _layouts.normalize_index(index, shape)
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
    views.append(tensor_numpy(components[i]))
  arrays = jax.device_put(views, devices)  # One batched call.
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def tensor_numpy(component: Any) -> np.ndarray:
  """Returns a NumPy view of a TF eager tensor (a copy if TF cannot share)."""
  view = getattr(component, '_numpy', None)
  return view() if view is not None else component.numpy()
