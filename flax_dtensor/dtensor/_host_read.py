"""Reading checkpoint slices on the host and placing them onto devices.

Each process asks TF's checkpoint reader (RestoreV2 on the host CPU) for the
slices its own devices hold, and JAX places them. TF reads ahead in worker
threads while JAX places in the calling thread, and the workers check each
placed shard's CRC against the manifest.
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from flax_dtensor import _errors
from flax_dtensor.dtensor import (
  _arrays,
  _layouts,
  _manifest,
  _selection,
  _target,
  _tf,
  _tf_errors,
)

AHEAD = 2
"""Variables TF reads ahead of the one JAX is placing (host copies alive)."""


def _slice_spec(shape: Sequence[int], index: _manifest.Index) -> str:
  """TF's ``shape_and_slices`` for one slice: '8 16 0,4:-'."""
  dims = [
    '-' if (a, b) == (0, n) else f'{a},{b - a}'
    for (a, b), n in zip(index, shape, strict=True)
  ]
  return ' '.join(map(str, shape)) + ' ' + ':'.join(dims)


def _pieces(
  prefix: str,
  entry: _selection.Entry,
  sharding: jax.sharding.Sharding,
  stored: np.dtype,
) -> dict[_manifest.Index, np.ndarray]:
  """The slices this process's devices hold, read by TF into host memory.

  Reads the whole variable when this process holds all of it (a single
  process, or a replicated variable): TF reads an entry whole in one pass
  and checks its own CRC-32C. Otherwise only this process's slices, so no
  host reads the full model. Thread-safe: each call is one TF op.
  """
  shape = tuple(entry.shape)
  indices = {
    _layouts.normalize_index(index, shape)
    for index in sharding.addressable_devices_indices_map(shape).values()
  }
  whole = sharding.is_fully_addressable or indices == {
    tuple((0, n) for n in shape)
  }
  ordered = [()] if whole else sorted(indices)
  tf = _tf.tf()
  try:
    with tf.device('/CPU:0'):
      read = tf.raw_ops.RestoreV2(
        prefix=prefix,
        tensor_names=[entry.key] * len(ordered),
        shape_and_slices=[
          '' if whole else _slice_spec(shape, i) for i in ordered
        ],
        dtypes=[tf.as_dtype(stored)] * len(ordered),
      )
  except tf.errors.OpError as e:
    raise _errors.ExportError(
      f'TensorFlow failed to read the NNX variable {entry.name!r} from the '
      f'checkpoint {prefix!r}: {_tf_errors.describe(e)}. Check that every '
      'data file of the checkpoint is complete and readable, or re-export it.'
    ) from e
  if whole:
    value = _arrays.tensor_numpy(read[0])
    return {
      index: value[tuple(slice(a, b) for a, b in index)] for index in indices
    }
  return {
    index: _arrays.tensor_numpy(t)
    for index, t in zip(ordered, read, strict=True)
  }


def _read(
  prefix: str,
  entry: _selection.Entry,
  kind: tuple[np.dtype, np.dtype],
  sharding: jax.sharding.Sharding,
) -> dict[_manifest.Index, np.ndarray]:
  """`_pieces` in the saved dtype (widened on save; exact both ways)."""
  stored, saved = kind
  pieces = _pieces(prefix, entry, sharding, stored)
  if stored != saved:
    pieces = {i: p.astype(saved) for i, p in pieces.items()}
  return pieces


def place(
  pieces: Mapping[_manifest.Index, np.ndarray],
  shape: tuple[int, ...],
  sharding: jax.sharding.Sharding,
  *,
  own: Mapping[jax.Device, tuple[_manifest.Index, np.ndarray]] | None = None,
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


def _local(index: _manifest.Index, held: _manifest.Index) -> tuple[slice, ...]:
  """`index` relative to the slice `held`."""
  return tuple(
    slice(a - h, b - h) for (a, b), (h, _) in zip(index, held, strict=True)
  )


# JAX on CPU uses a host buffer as a device buffer, without a copy, when it
# is aligned to this many bytes (NumPy's own allocations often are not).
_ALIGNMENT = 64


def _aligned_empty(shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
  """An uninitialized array whose data starts on a `_ALIGNMENT` boundary."""
  nbytes = math.prod(shape) * np.dtype(dtype).itemsize
  raw = np.empty(nbytes + _ALIGNMENT, np.uint8)
  start = (-raw.ctypes.data) % _ALIGNMENT
  return raw[start : start + nbytes].view(dtype).reshape(shape)


def slice_of(
  pieces: Mapping[_manifest.Index, np.ndarray], index: _manifest.Index
) -> np.ndarray:
  """The global slice `index` of pieces that are disjoint blocks covering it.

  A view when one piece holds it, else a copy assembled from several (its
  buffer aligned so that JAX on CPU places it without copying it again).
  """
  if index in pieces:
    return pieces[index]
  for held, data in pieces.items():
    if _manifest.contains(held, index):
      return data[_local(index, held)]
  first = next(iter(pieces.values()))
  out = _aligned_empty([b - a for a, b in index], first.dtype)
  covered = 0
  for held, data in pieces.items():
    overlap = tuple(
      (max(a, h0), min(b, h1))
      for (a, b), (h0, h1) in zip(index, held, strict=True)
    )
    if any(lo >= hi for lo, hi in overlap):
      continue
    out[_local(overlap, index)] = data[_local(overlap, held)]
    covered += math.prod(hi - lo for lo, hi in overlap)
  assert covered == out.size, (index, sorted(pieces))
  return out


def assemble(
  pieces: Mapping[_manifest.Index, np.ndarray],
  shape: tuple[int, ...],
  sharding: jax.sharding.Sharding,
  *,
  own: Mapping[jax.Device, tuple[_manifest.Index, np.ndarray]] | None = None,
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


def read_placed(
  prefix: str,
  entries: Sequence[_selection.Entry],
  kinds: Sequence[tuple[np.dtype, np.dtype]],
  shardings: Sequence[jax.sharding.Sharding],
  manifest: _manifest.Manifest | None,
  advance: Callable[[int], Any],
) -> list[jax.Array]:
  """Every entry read from `prefix` and placed as its sharding says.

  Args:
    prefix: The TF checkpoint prefix.
    entries: The variables to read, with their checkpoint keys.
    kinds: Per entry, (dtype stored in the checkpoint, dtype saved from).
    shardings: Per entry, where the array goes.
    manifest: The checked manifest, whose shard CRCs are verified; None for
      a plain TF checkpoint.
    advance: Called with 1 after each variable is placed (progress).
  """
  records = manifest.by_key if manifest is not None else {}
  arrays: list[jax.Array] = []
  # TF reads the next variables in worker threads while JAX places this
  # one here (JAX's configuration, such as 64-bit types, is this thread's)
  # and the workers check the CRCs of those already placed. Both release
  # the GIL; at most AHEAD host copies exist at once.
  with concurrent.futures.ThreadPoolExecutor(AHEAD) as pool:

    def submit(i: int) -> concurrent.futures.Future:
      return pool.submit(_read, prefix, entries[i], kinds[i], shardings[i])

    reads = {i: submit(i) for i in range(min(AHEAD, len(entries)))}
    checks = []
    for i, e in enumerate(entries):
      pieces = reads.pop(i).result()
      if i + AHEAD < len(entries):
        reads[i + AHEAD] = submit(i + AHEAD)
      array = place(pieces, tuple(e.shape), shardings[i])
      del pieces
      if e.key in records:
        checks.append(
          pool.submit(_manifest.verify_shards, manifest, records[e.key], array)
        )
      arrays.append(_target.as_target(array, e, kinds[i][1]))
      advance(1)
    for check in checks:
      check.result()
  return arrays
