"""Writing checkpoint shards with TF's plain SaveV2 on the host.

Every save writes this way, blocking or not: no DTensor op and no
collective runs (TF DTensor's sharded save costs a SaveV2 per device,
barriers and a merge, and grows faster than the shards). `own` gives each
saved shard (a distinct slice of a variable) to one process holding it,
replicas spread over the processes; `hand_over` gives this process's to
TF as they are (a blocking save: TF reads the JAX buffers themselves,
through DLPack, where the dtype is stored as it is), `snapshot` copies them
into host buffers first (a background save, so that the caller may
overwrite its arrays); and `write` writes them as one TF bundle of this
process (`write_parts`: as several bundles at once, where there is twice
`PART_BYTES` or more to write), hashing each shard meanwhile and, from the
same bytes, the chunks of the data file TF writes them into (`_hash`), so
that no file is read back (`Written`). Process 0 merges every bundle into
the checkpoint (`_checkpoint`).
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
from flax_dtensor.dtensor._conversion import _selection
from flax_dtensor.dtensor._format import _checksums, _model
from flax_dtensor.dtensor._layout import _pieces
from flax_dtensor.dtensor._storage import _host_read

# Dtypes NumPy cannot hand over through DLPack, and the same-size dtype TF
# reinterprets (`tf.bitcast`, no copy) as them. Others it has no
# reinterpretation for (int4, uint4) are copied into TF.
_DLPACK_VIEWS = {'bfloat16': np.uint16}


@dataclasses.dataclass(frozen=True)
class Piece:
  """One saved shard this process writes.

  Attributes:
    variable: Its variable's position among the save's entries.
    index: Its global slice.
    data: Its values in the stored dtype (widened exactly where the
      checkpoint widens): a host copy (C-contiguous, 64-byte aligned), or
      the JAX shard itself (`jax.Array`) where it is stored as it is and
      the caller waits for the write.
    saved: The dtype it is hashed as (the variable's saved dtype).
  """

  variable: int
  index: _model.Index
  data: np.ndarray | jax.Array
  saved: np.dtype


def _index(index: tuple[slice, ...], shape: tuple[int, ...]) -> _model.Index:
  return tuple(
    (s.start or 0, n if s.stop is None else s.stop)
    for s, n in zip(index, shape, strict=True)
  )


def own(values: Sequence[jax.Array]) -> list[dict[_model.Index, Any]]:
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
    local = {}
    for shard in value.addressable_shards:
      local.setdefault(_index(shard.index, shape), shard)
    if value.is_fully_addressable and jax.process_count() == 1:
      out.append(local)  # The only holder of every slice.
      continue
    holders: dict[_model.Index, set[int]] = {}
    for device, index in value.sharding.devices_indices_map(shape).items():
      holders.setdefault(_index(index, shape), set()).add(device.process_index)
    mine = {}
    for k, index in enumerate(sorted(holders)):
      processes = sorted(holders[index])
      if processes[(i + k) % len(processes)] == me:
        mine[index] = local[index]
    out.append(mine)
  return out


def hand_over(
  entries: Sequence[_selection.Entry], values: Sequence[jax.Array]
) -> list[Piece]:
  """The saved shards this process writes, without copying them.

  A shard stored as it is stays the JAX shard, which TF reads through
  DLPack; a widened one is converted into a host buffer (the checkpoint
  must hold the widened values). For a blocking save: the arrays must not
  change until the write is done.
  """
  pieces = []
  for i, (entry, mine) in enumerate(zip(entries, own(values), strict=True)):
    widened = entry.stored_dtype != entry.dtype
    for index, shard in sorted(mine.items()):
      data = shard.data
      if widened:
        data = np.asarray(data).astype(entry.stored_dtype)
      pieces.append(Piece(i, index, data, np.dtype(entry.dtype)))
  return pieces


def snapshot(
  entries: Sequence[_selection.Entry], values: Sequence[jax.Array]
) -> list[Piece]:
  """Copies of the saved shards this process writes, complete on return.

  Each is copied once, with NumPy, into an aligned host buffer of the
  stored dtype (widening exactly where the checkpoint widens), on
  `COPY_THREADS` threads (NumPy lets go of the GIL while it copies): a
  background save holds the caller only this long. The caller may then
  donate or overwrite the arrays.
  """
  pieces, copies = [], []
  for i, (entry, mine) in enumerate(zip(entries, own(values), strict=True)):
    for index, shard in sorted(mine.items()):
      source = np.asarray(shard.data)
      data = _pieces.aligned_empty(source.shape, entry.stored_dtype)
      copies.append((data, source))
      pieces.append(Piece(i, index, data, np.dtype(entry.dtype)))
  total = sum(source.nbytes for _, source in copies)
  threads = min(COPY_THREADS, len(copies), max(1, total // _COPY_TASK_BYTES))
  if threads <= 1:
    for data, source in copies:
      np.copyto(data, source, casting='unsafe')
    return pieces
  # Largest first, so that the threads end together.
  copies.sort(key=lambda c: -c[1].nbytes)
  with concurrent.futures.ThreadPoolExecutor(
    threads, thread_name_prefix='flax_dtensor copy'
  ) as pool:
    for done in [
      pool.submit(np.copyto, data, source, casting='unsafe')
      for data, source in copies
    ]:
      done.result()
  return pieces


COPY_THREADS = min(8, os.cpu_count() or 1)
"""Threads a background save copies the state to host memory on."""

# Below this many bytes a copy is one thread's (threads cost more than they
# save on a small state).
_COPY_TASK_BYTES = 8 * 2**20


def _tensor(data: np.ndarray | jax.Array) -> Any:
  """A TF tensor on the host CPU viewing `data` (no copy, where TF can)."""
  tf = _tf.tf()
  if isinstance(data, jax.Array):
    try:
      return tf.experimental.dlpack.from_dlpack(data.__dlpack__())
    except Exception:  # A dtype DLPack lacks (int4), a device TF lacks.
      return tf.convert_to_tensor(np.asarray(data))
  view = _DLPACK_VIEWS.get(data.dtype.name)
  try:
    if view is None:
      return tf.experimental.dlpack.from_dlpack(data.__dlpack__())
    shared = tf.experimental.dlpack.from_dlpack(data.view(view).__dlpack__())
    return tf.bitcast(shared, tf.as_dtype(data.dtype))
  except BufferError:  # int4, uint4: no DLPack type.
    return tf.convert_to_tensor(data)


def _hash(pieces: Sequence[Piece], stream: _checksums.StreamSum) -> list[int]:
  """Each piece's checksum, and `stream` fed the bytes TF writes of them.

  TF's bundle holds the pieces' bytes one after another, in the order
  given to SaveV2 (`_save`): hashed here in that order, a block at a
  time, each block twice while it is in cache (its shard's checksum, its
  file's chunk), so that the file need not be read back. A piece stored
  widened is hashed as its saved dtype, and its widened bytes go in the
  file's checksum.
  """
  out = []
  for piece in pieces:
    flat = np.asarray(piece.data).reshape(-1).view(np.uint8)
    if piece.saved != piece.data.dtype:
      out.append(_checksums.crc(piece.data, piece.saved, stream.checksum))
      stream.add(flat)
      continue
    value = 0
    for start in range(0, flat.size, _HASH_BLOCK):
      block = flat[start : start + _HASH_BLOCK]
      value = _checksums.EXTEND[stream.checksum](value, block)
      stream.add(block)
    out.append(value)
  return out


# Bytes hashed at a time: each block's second hash finds it in cache.
_HASH_BLOCK = 2**20
# Bytes compared at each end of a bundle's pieces (`_laid_out`).
_PROBE_BYTES = 4096


def _laid_out(prefix: str, pieces: Sequence[Piece]) -> bool:
  """Whether the bundle's data file starts with the first piece's bytes and
  holds the last one's where they would follow one another.

  What the derived file checksums assume of TF's writer, probed at both
  ends: if a TF release lays its bundles out otherwise, the file is read
  back instead (`_checksums.file_sums`).
  """
  if not pieces:
    return True
  sizes = [p.data.nbytes for p in pieces]
  first = np.asarray(pieces[0].data).reshape(-1).view(np.uint8)
  last = np.asarray(pieces[-1].data).reshape(-1).view(np.uint8)
  head = first[:_PROBE_BYTES]
  tail = last[max(0, last.size - _PROBE_BYTES) :]
  path = data_file(prefix)
  try:
    with open(path, 'rb', buffering=0) as f:
      got_head = os.pread(f.fileno(), head.size, 0)
      got_tail = os.pread(f.fileno(), tail.size, sum(sizes) - tail.size)
  except OSError:
    return False
  return got_head == head.tobytes() and got_tail == tail.tobytes()


def data_file(prefix: str) -> str:
  """The one data file of a bundle SaveV2 wrote as `prefix`."""
  return f'{prefix}.data-00000-of-00001'


def _save(
  entries: Sequence[_selection.Entry],
  pieces: Sequence[Piece],
  prefix: str,
  extra: dict[str, Any],
) -> None:
  """One TF SaveV2 of `pieces` (and `extra`'s whole tensors) as `prefix`."""
  tf = _tf.tf()
  keys = [e.key for e in entries]
  with tf.device('/CPU:0'):
    tf.raw_ops.SaveV2(
      prefix=prefix,
      tensor_names=[keys[p.variable] for p in pieces] + list(extra),
      shape_and_slices=[
        _host_read.slice_spec(entries[p.variable].shape, p.index)
        for p in pieces
      ]
      + [''] * len(extra),
      tensors=[_tensor(p.data) for p in pieces] + list(extra.values()),
    )


def _by_variable(
  entries: Sequence[_selection.Entry],
  pieces: Sequence[Piece],
  crcs: Sequence[int],
) -> list[list[tuple[_model.Index, int]]]:
  out: list[list[tuple[_model.Index, int]]] = [[] for _ in entries]
  for p, crc in zip(pieces, crcs, strict=True):
    out[p.variable].append((p.index, crc))
  return [sorted(shards) for shards in out]


@dataclasses.dataclass
class Written:
  """What a process wrote: its shards' checksums and its bundles.

  Attributes:
    shards: Per variable, the (slice, checksum) of each shard written.
    bundles: The prefixes of the TF bundles written.
    streams: Per bundle written, the checksums of its data file as hashed
      while it was written (`_checksums.StreamSum`, to finish once the
      file has its final name); None for one that must be read back.
  """

  shards: list[list[tuple[_model.Index, int]]]
  bundles: list[str]
  streams: list[_checksums.StreamSum | None]


def _write_one(
  entries: Sequence[_selection.Entry],
  pieces: Sequence[Piece],
  prefix: str,
  pool: concurrent.futures.Executor,
  extra: dict[str, Any],
) -> tuple[list[int], _checksums.StreamSum | None]:
  """One bundle: TF writes on this thread while `pool` hashes."""
  stream = _checksums.StreamSum()
  hashed = pool.submit(_hash, pieces, stream)
  try:
    if pieces or extra:
      _save(entries, pieces, prefix, extra)
  finally:
    concurrent.futures.wait([hashed])
  return hashed.result(), _checked(stream, prefix, pieces)


def _checked(
  stream: _checksums.StreamSum, prefix: str, pieces: Sequence[Piece]
) -> _checksums.StreamSum | None:
  return stream if _laid_out(prefix, pieces) else None


def write(
  entries: Sequence[_selection.Entry],
  pieces: Sequence[Piece],
  prefix: str,
  pool: concurrent.futures.Executor,
  extra: dict[str, Any] | None = None,
) -> Written:
  """Writes `pieces` as the TF bundle `prefix`, hashing them meanwhile.

  `extra` adds whole tensors by key (the object graph, when this bundle is
  the checkpoint itself), after the pieces. A process with nothing to
  write writes no bundle.
  """
  crcs, stream = _write_one(entries, pieces, prefix, pool, extra or {})
  written = bool(pieces or extra)
  return Written(
    _by_variable(entries, pieces, crcs),
    [prefix] if written else [],
    [stream] if written else [],
  )


PART_BYTES = 64 * 2**20
"""The least a process writes per TF bundle: more bytes, more bundles.

One SaveV2 writes on one thread. A process with more to write splits it
into bundles of at least this many bytes, at most one per thread of the
write's pool (`parts`), written at once; the checkpoint is their merge,
TF's own sharded format (`ckpt.data-00000-of-0000N`).
"""


def parts(pieces: Sequence[Piece], threads: int) -> int:
  """How many bundles a process writes `pieces` in, with `threads` threads."""
  nbytes = sum(p.data.nbytes for p in pieces)
  return max(1, min(threads, nbytes // PART_BYTES))


def write_parts(
  entries: Sequence[_selection.Entry],
  pieces: Sequence[Piece],
  prefix: str,
  pool: concurrent.futures.Executor,
  count: int,
) -> Written:
  """Writes `pieces` as `count` TF bundles at once, hashing them meanwhile.

  The bundles are `prefix-0`, `prefix-1`, ..., of about equal bytes: this
  thread writes the first, `pool` the others and hashes each bundle's
  pieces as TF writes them (no task in `pool` waits for another, so any
  pool size will do; `count` at most its threads keeps one for hashing
  while the bundles are written).
  """
  groups: list[list[Piece]] = [[] for _ in range(count)]
  sizes = [0] * count
  for p in sorted(pieces, key=lambda p: -p.data.nbytes):
    k = sizes.index(min(sizes))
    groups[k].append(p)
    sizes[k] += p.data.nbytes
  groups = [g for g in groups if g]
  prefixes = [f'{prefix}-{k}' for k in range(len(groups))]
  streams = [_checksums.StreamSum() for _ in groups]
  writes = [
    pool.submit(_save, entries, g, f, {})
    for g, f in zip(groups[1:], prefixes[1:], strict=True)
  ]
  hashes = [
    pool.submit(_hash, g, stream)
    for g, stream in zip(groups, streams, strict=True)
  ]
  try:
    if groups:
      _save(entries, groups[0], prefixes[0], {})
  finally:
    concurrent.futures.wait(writes + hashes)  # None left, whatever happened.
  for w in writes:
    w.result()
  ordered = [p for g in groups for p in g]
  crcs = [c for h in hashes for c in h.result()]
  return Written(
    _by_variable(entries, ordered, crcs),
    prefixes,
    [
      _checked(stream, f, g)
      for stream, f, g in zip(streams, prefixes, groups, strict=True)
    ],
  )


def flush(prefixes: Sequence[str]) -> None:
  """Flushes the files of the TF bundles `prefixes` to disk."""
  for prefix in prefixes:
    directory, base = os.path.split(prefix)
    for name in os.listdir(directory):
      if name.startswith(base + '.'):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
          os.fsync(fd)
        finally:
          os.close(fd)
