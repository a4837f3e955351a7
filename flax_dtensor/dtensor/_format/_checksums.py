"""The export's checksums: CRC-32 of values, of shards and of file chunks.

`crc` is the one hash of values (a shard's bytes in C order, or of the
saved dtype it was widened from); `shard_checksums` hashes the shards a
process holds, `file_sums` every file of an export in `CHUNK_BYTES`
chunks (`crc_chunk`, what `_verify` checks them with too), in a pool of
`THREADS` threads: zlib releases the GIL.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from flax_dtensor.dtensor._format import _model

if TYPE_CHECKING:
  import jax

THREADS = max(2, min(8, os.cpu_count() or 2))
# Elements narrowed at a time by `crc`: a bounded scratch copy.
_NARROW_CHUNK = 2**22


def crc(data: Any, as_dtype: Any = None) -> int:
  """CRC-32 of an array's bytes in C order (any dtype, ml_dtypes too).

  With `as_dtype`, of the bytes of its values converted to that dtype: a
  copy stored widened is hashed as the saved dtype it was widened from (an
  exact conversion), a bounded chunk at a time.
  """
  import numpy as np

  flat = np.ascontiguousarray(data).reshape(-1)
  if as_dtype is None or np.dtype(as_dtype) == flat.dtype:
    return zlib.crc32(flat.view(np.uint8))
  value = 0
  for start in range(0, flat.size, _NARROW_CHUNK):
    part = flat[start : start + _NARROW_CHUNK].astype(as_dtype)
    value = zlib.crc32(part.view(np.uint8), value)
  return value


def _global_index(index: Sequence[slice], shape: Sequence[int]) -> _model.Index:
  out = []
  for s, size in zip(index, shape, strict=True):
    start, stop, _ = s.indices(size)
    out.append((start, stop))
  return tuple(out)


def shard_checksums(
  values: Sequence[jax.Array], pool: concurrent.futures.Executor
) -> list[concurrent.futures.Future]:
  """Starts hashing each array's distinct addressable shards in `pool`.

  Returns one future per array, of `[(global slice, CRC-32)]`. zlib
  releases the GIL, so the hashing runs beside TF's write.
  """

  def work(value: jax.Array) -> list[tuple[_model.Index, int]]:
    seen: dict[_model.Index, int] = {}
    for shard in value.addressable_shards:
      index = _global_index(shard.index, value.shape)
      if index not in seen:
        seen[index] = crc(shard.data)
    return sorted(seen.items())

  return [pool.submit(work, v) for v in values]


def file_chunks(path: str, size: int) -> list[tuple[int, int]]:
  return [
    (o, min(_model.CHUNK_BYTES, size - o))
    for o in range(0, size, _model.CHUNK_BYTES)
  ]


# Files are hashed through one small buffer per thread, reused: reading a
# 64 MiB chunk into a fresh bytes object costs more in first-touch page
# faults than the read and the CRC together. (Not mmap: a file truncated
# while mapped kills the process with SIGBUS.)
_READ_BLOCK = 2**20
_buffers = threading.local()


def crc_chunk(path: str, offset: int, length: int) -> int:
  block = getattr(_buffers, 'block', None)
  if block is None:
    block = _buffers.block = memoryview(bytearray(_READ_BLOCK))
  crc = 0
  done = 0
  with open(path, 'rb', buffering=0) as f:
    f.seek(offset)
    while done < length:
      n = f.readinto(block[: min(_READ_BLOCK, length - done)])
      if not n:
        break
      crc = zlib.crc32(block[:n], crc)
      done += n
  if done != length:
    raise OSError(f'read {done} of {length} bytes at offset {offset}')
  return crc


def file_sums(
  root: str, names: Sequence[str], pool: concurrent.futures.Executor
) -> dict[str, _model.FileSum]:
  """Size and chunk CRCs of `names` (relative to `root`), chunks in parallel."""
  jobs = {}
  sizes = {}
  for name in names:
    path = os.path.join(root, name)
    sizes[name] = os.path.getsize(path)
    jobs[name] = [
      pool.submit(crc_chunk, path, o, n)
      for o, n in file_chunks(path, sizes[name])
    ]
  return {
    name: _model.FileSum(sizes[name], tuple(f.result() for f in futures))
    for name, futures in jobs.items()
  }
