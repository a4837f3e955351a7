"""Writing checkpoint shards from host memory, off the caller's thread.

A background save (`save_checkpoint(..., blocking=False)`) cannot use TF
DTensor's sharded save there: that write is collective across the DTensor
clients (TF collectives on the mesh), and collectives issued from two
threads of every process (the save's, and the caller's next export) pair up
in different orders and hang. So `own` gives each saved shard (a distinct
slice of a variable) to one process holding it, replicas spread over them;
`snapshot` copies this process's into host buffers of the stored dtype on
the caller's thread; and `write` hands them without another copy (DLPack)
to TF's plain SaveV2 on the host CPU, as a bundle of this process, hashing
each shard meanwhile. No DTensor op and no collective runs: process 0
merges every process's bundle into the checkpoint (`_checkpoint`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from flax_dtensor.dtensor import _tf
from flax_dtensor.dtensor._files import _host_read, _manifest
from flax_dtensor.dtensor._layout import _layouts, _pieces, _selection

# Dtypes NumPy cannot hand over through DLPack, and the same-size dtype TF
# reinterprets (`tf.bitcast`, no copy) as them. Others it has no
# reinterpretation for (int4, uint4) are copied into TF.
_DLPACK_VIEWS = {'bfloat16': np.uint16}


@dataclasses.dataclass(frozen=True)
class Piece:
  """One saved shard this process writes, copied to host memory.

  Attributes:
    variable: Its variable's position among the save's entries.
    index: Its global slice.
    data: Its values in the stored dtype (widened exactly where the
      checkpoint widens), C-contiguous and 64-byte aligned.
    saved: The dtype it is hashed as (the variable's saved dtype).
  """

  variable: int
  index: _manifest.Index
  data: np.ndarray
  saved: np.dtype


def own(values: Sequence[jax.Array]) -> list[dict[_manifest.Index, Any]]:
  """Per array, the saved shards this process writes: {slice: a local shard}.

  Every distinct slice of an array is written once in the job, by one of
  the processes holding it: the k-th slice of the i-th array by holder
  (i + k) mod (its number of holders), so replicated arrays are spread
  over the processes. Every process computes the same answer from the
  shardings alone.
  """
  me = jax.process_index()
  out = []
  for i, value in enumerate(values):
    shape = tuple(value.shape)
    holders: dict[_manifest.Index, set[int]] = {}
    for device, index in value.sharding.devices_indices_map(shape).items():
      key = _layouts.normalize_index(index, shape)
      holders.setdefault(key, set()).add(device.process_index)
    local = {}
    for shard in value.addressable_shards:
      local.setdefault(_layouts.normalize_index(shard.index, shape), shard)
    mine = {}
    for k, index in enumerate(sorted(holders)):
      processes = sorted(holders[index])
      if processes[(i + k) % len(processes)] == me:
        mine[index] = local[index]
    out.append(mine)
  return out


def snapshot(
  entries: Sequence[_selection.Entry], values: Sequence[jax.Array]
) -> list[Piece]:
  """Copies of the saved shards this process writes, complete on return.

  Each is copied once, with NumPy, into an aligned host buffer of the
  stored dtype (widening exactly where the checkpoint widens). The caller
  may then donate or overwrite the arrays.
  """
  pieces = []
  for i, (entry, mine) in enumerate(zip(entries, own(values), strict=True)):
    for index, shard in sorted(mine.items()):
      source = np.asarray(shard.data)
      data = _pieces.aligned_empty(source.shape, entry.stored_dtype)
      np.copyto(data, source, casting='unsafe')
      pieces.append(Piece(i, index, data, np.dtype(entry.dtype)))
  return pieces


def _tensor(data: np.ndarray) -> Any:
  """A TF tensor on the host CPU viewing `data` (no copy, where TF can)."""
  tf = _tf.tf()
  view = _DLPACK_VIEWS.get(data.dtype.name)
  try:
    if view is None:
      return tf.experimental.dlpack.from_dlpack(data.__dlpack__())
    shared = tf.experimental.dlpack.from_dlpack(data.view(view).__dlpack__())
    return tf.bitcast(shared, tf.as_dtype(data.dtype))
  except BufferError:  # int4, uint4: no DLPack type.
    return tf.convert_to_tensor(data)


def write(
  entries: Sequence[_selection.Entry],
  pieces: Sequence[Piece],
  prefix: str,
  pool: concurrent.futures.Executor,
) -> list[list[tuple[_manifest.Index, int]]]:
  """Writes `pieces` as the TF bundle `prefix`; their CRCs per variable.

  TF writes on this thread while `pool` hashes; then the bundle is flushed
  to disk. A process with nothing to write writes no bundle.
  """
  hashes = [pool.submit(_manifest.crc, p.data, p.saved) for p in pieces]
  if pieces:
    tf = _tf.tf()
    with tf.device('/CPU:0'):
      tf.raw_ops.SaveV2(
        prefix=prefix,
        tensor_names=[entries[p.variable].key for p in pieces],
        shape_and_slices=[
          _host_read.slice_spec(entries[p.variable].shape, p.index)
          for p in pieces
        ],
        tensors=[_tensor(p.data) for p in pieces],
      )
    directory, base = os.path.split(prefix)
    for name in os.listdir(directory):
      if name.startswith(base + '.'):
        _flush(os.path.join(directory, name))
  out: list[list[tuple[_manifest.Index, int]]] = [[] for _ in entries]
  for p, h in zip(pieces, hashes, strict=True):
    out[p.variable].append((p.index, h.result()))
  return [sorted(shards) for shards in out]


def _flush(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)
