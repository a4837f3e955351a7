"""Reading checkpoint slices on the host and placing them onto devices.

Each process asks TF's checkpoint reader (RestoreV2 on the host CPU) for the
slices its own devices hold, checks every byte read against the manifest's
shard CRCs, and JAX places them. TF reads and checks ahead in worker
threads while JAX places in the calling thread.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from flax_dtensor import _errors
from flax_dtensor.dtensor import _tf, _tf_errors
from flax_dtensor.dtensor._files import _manifest
from flax_dtensor.dtensor._layout import (
  _arrays,
  _layouts,
  _pieces,
  _selection,
  _target,
)

AHEAD = 2
"""Variables TF reads ahead of the one JAX is placing (host copies alive)."""


def slice_spec(shape: Sequence[int], index: _manifest.Index) -> str:
  """TF's ``shape_and_slices`` for one slice: '8 16 0,4:-' ('' if whole)."""
  if all((a, b) == (0, n) for (a, b), n in zip(index, shape, strict=True)):
    return ''
  dims = [
    '-' if (a, b) == (0, n) else f'{a},{b - a}'
    for (a, b), n in zip(index, shape, strict=True)
  ]
  return ' '.join(map(str, shape)) + ' ' + ':'.join(dims)


def _overlap(a: _manifest.Index, b: _manifest.Index) -> _manifest.Index | None:
  out = tuple(
    (max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True)
  )
  return out if all(lo < hi for lo, hi in out) or not out else None


def _to_read(
  shape: tuple[int, ...],
  needed: set[_manifest.Index],
  whole: bool,
  record: _manifest.Record | None,
) -> list[_manifest.Index]:
  """The slices to ask TF for, so that every byte placed can be checked.

  With a manifest, each saved shard that meets a slice this process holds,
  whole: the manifest has a CRC of each saved shard, not of arbitrary
  slices; TF reads a stored slice whole anyway to cut a part of it, and
  returns each one contiguous, so it is hashed without a copy. Without a
  manifest, the whole variable when this process holds all of it (TF reads
  an entry in one pass), else the slices it holds.
  """
  if record is None or not record.shards:
    return [tuple((0, n) for n in shape)] if whole else sorted(needed)
  return sorted(
    index
    for index, _ in record.shards
    if any(_overlap(index, n) is not None for n in needed)
  )


def _within(
  part: _manifest.Index, origin: _manifest.Index
) -> tuple[slice, ...]:
  """The slice `part` of an array, in a block that starts at `origin`."""
  return tuple(
    slice(p0 - o0, p1 - o0)
    for (p0, p1), (o0, _) in zip(part, origin, strict=True)
  )


def _cut(
  read: dict[_manifest.Index, np.ndarray],
  index: _manifest.Index,
  dtype: np.dtype,
) -> np.ndarray:
  """The slice `index` of a variable, from the (checked) slices read."""
  if index in read:
    return read[index]
  for held, data in read.items():
    if _overlap(index, held) == index:
      return data[_within(index, held)]
  out = np.empty([b - a for a, b in index], dtype)
  filled = 0
  for held, data in read.items():
    part = _overlap(index, held)
    if part is not None:
      out[_within(part, index)] = data[_within(part, held)]
      filled += int(np.prod([b - a for a, b in part], dtype=np.int64))
  # Internal: the slices read are the saved shards meeting `index`.
  assert filled == out.size, (index, sorted(read))
  return out


def _read(
  prefix: str,
  entry: _selection.Entry,
  kind: tuple[np.dtype, np.dtype],
  sharding: jax.sharding.Sharding,
  manifest: _manifest.Manifest | None,
) -> dict[_manifest.Index, np.ndarray]:
  """The slices this process's devices hold, read by TF and checked.

  TF reads (`_to_read`) on the host; the values go back to the saved dtype
  (widened on save; exact both ways) and every byte is checked against the
  manifest (`_manifest.verify_read`) before the slices the devices hold are
  cut from them. So no host reads the full model when a variable is
  sharded over processes, though a process may read more of a variable
  than it holds when the layout differs from the saved one. Thread-safe:
  one TF op per call.
  """
  stored, saved = kind
  shape = tuple(entry.shape)
  needed = {
    _layouts.normalize_index(index, shape)
    for index in sharding.addressable_devices_indices_map(shape).values()
  }
  full = tuple((0, n) for n in shape)
  whole = sharding.is_fully_addressable or needed == {full}
  record = manifest.by_key.get(entry.key) if manifest is not None else None
  slices = _to_read(shape, needed, whole, record)
  tf = _tf.tf()
  try:
    with tf.device('/CPU:0'):
      tensors = tf.raw_ops.RestoreV2(
        prefix=prefix,
        tensor_names=[entry.key] * len(slices),
        shape_and_slices=[slice_spec(shape, i) for i in slices],
        dtypes=[tf.as_dtype(stored)] * len(slices),
      )
  except tf.errors.OpError as e:
    raise _errors.DamagedExportError(
      f'TensorFlow failed to read the NNX variable {entry.name!r} from the '
      f'checkpoint {prefix!r}: {_tf_errors.describe(e)}. Check that every '
      'data file of the checkpoint is complete and readable (or that no '
      'other process rewrote it during the read), or re-export it. Nothing '
      'was restored: the target is unchanged.'
    ) from e
  read = {}
  for index, t in zip(slices, tensors, strict=True):
    value = _arrays.tensor_numpy(t)
    read[index] = value.astype(saved) if stored != saved else value
  if record is not None:
    _manifest.verify_read(manifest, record, read)
  return {index: _cut(read, index, saved) for index in needed}


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
  arrays: list[jax.Array] = []
  # TF reads and the CRCs are checked for the next variables in worker
  # threads while JAX places this one here (JAX's configuration, such as
  # 64-bit types, is this thread's). Both release the GIL; at most AHEAD
  # host copies exist at once.
  with concurrent.futures.ThreadPoolExecutor(AHEAD) as pool:

    def submit(i: int) -> concurrent.futures.Future:
      return pool.submit(
        _read, prefix, entries[i], kinds[i], shardings[i], manifest
      )

    reads = {i: submit(i) for i in range(min(AHEAD, len(entries)))}
    for i, e in enumerate(entries):
      pieces = reads.pop(i).result()
      if i + AHEAD < len(entries):
        reads[i + AHEAD] = submit(i + AHEAD)
      array = _pieces.place(pieces, tuple(e.shape), shardings[i])
      del pieces
      arrays.append(_target.as_target(array, e, kinds[i][1]))
      advance(1)
  return arrays
