"""Host pieces of a global array, and the array they make once placed.

A piece is a block of a global array held on the host, keyed by its global
`Index` (`_index`). `assemble` cuts or joins the slices a sharding's
devices need from disjoint pieces and `place`s them with JAX, zero-copy on
CPU where a slice is aligned. TF's DTensor components (`_from_tf`), another
mesh's shards (`_single_mesh`) and a checkpoint's slices read on the host
(`_storage`) are all placed here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from flax_dtensor.dtensor._layout import _index, _layouts

Index = _index.Index


def place(
  pieces: Mapping[Index, np.ndarray],
  shape: tuple[int, ...],
  sharding: jax.sharding.Sharding,
  *,
  own: Mapping[jax.Device, tuple[Index, np.ndarray]] | None = None,
) -> jax.Array:
  """The array made of host slices, placed as `sharding` says.

  On CPU, JAX uses a suitably aligned host slice as the device buffer
  itself; elsewhere it copies. `own` maps a device to a slice held for it
  (its global index and data), used where the device needs exactly that
  slice: replicas then keep a buffer each rather than sharing one piece.
  """
  targets = sharding.addressable_devices_indices_map(shape)
  devices = list(targets)
  views = []
  for d in devices:
    index = _layouts.normalize_index(targets[d], shape)
    mine = own.get(d) if own is not None else None
    views.append(
      mine[1] if mine is not None and mine[0] == index else pieces[index]
    )
  arrays = jax.device_put(views, devices)  # One batched call.
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


# JAX on CPU uses a host buffer as a device buffer, without a copy, when it
# is aligned to this many bytes (NumPy's own allocations often are not).
_ALIGNMENT = 64


def aligned_empty(shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
  """An uninitialized array whose data starts on a `_ALIGNMENT` boundary."""
  nbytes = math.prod(shape) * np.dtype(dtype).itemsize
  raw = np.empty(nbytes + _ALIGNMENT, np.uint8)
  start = (-raw.ctypes.data) % _ALIGNMENT
  return raw[start : start + nbytes].view(dtype).reshape(shape)


def slice_of(pieces: Mapping[Index, np.ndarray], index: Index) -> np.ndarray:
  """The global slice `index` of pieces that are disjoint blocks covering it.

  A view when one piece holds it, else a copy assembled from several (its
  buffer aligned so that JAX on CPU places it without copying it again).
  """
  if index in pieces:
    return pieces[index]
  for held, data in pieces.items():
    if _index.contains(held, index):
      return data[_index.local(index, held)]
  first = next(iter(pieces.values()))
  out = aligned_empty([b - a for a, b in index], first.dtype)
  covered = 0
  for held, data in pieces.items():
    overlap = tuple(
      (max(a, h0), min(b, h1))
      for (a, b), (h0, h1) in zip(index, held, strict=True)
    )
    if any(lo >= hi for lo, hi in overlap):
      continue
    out[_index.local(overlap, index)] = data[_index.local(overlap, held)]
    covered += math.prod(hi - lo for lo, hi in overlap)
  if covered != out.size:
    # The callers' pieces are a DTensor's components or an array's shards,
    # which cover it: an internal invariant, checked even under
    # `python -O` (a region left out would hold uninitialized memory).
    raise AssertionError(
      f'flax_dtensor internal error: the pieces {sorted(pieces)} cover '
      f'{covered} of the {out.size} elements of the slice {index}. Please '
      'report this.'
    )
  return out


def assemble(
  pieces: Mapping[Index, np.ndarray],
  shape: tuple[int, ...],
  sharding: jax.sharding.Sharding,
  *,
  own: Mapping[jax.Device, tuple[Index, np.ndarray]] | None = None,
) -> jax.Array:
  """The array of host pieces covering it, placed as `sharding` says.

  Each distinct slice the devices need is made once (`slice_of`), and
  `place`d (see there for `own`).
  """
  wanted = {
    _layouts.normalize_index(index, shape)
    for index in sharding.addressable_devices_indices_map(shape).values()
  }
  slices = {index: slice_of(pieces, index) for index in wanted}
  return place(slices, shape, sharding, own=own)
