"""The export's checksums: of values, of shards and of file chunks.

Version 5 manifests use CRC-32C (Castagnoli, the checksum TF's own bundles
and TensorStore use; `google_crc32c`, in hardware where the CPU has it),
versions 3 and 4 CRC-32 (`zlib`): every function takes the manifest's
checksum name (`_model.READABLE`), by default `current()`. `crc` is the one
hash of values (a shard's bytes in C order, or of the saved dtype it was
widened from); `shard_checksums` hashes the shards a process holds,
`file_sums` the files of an export in `CHUNK_BYTES` chunks (`crc_chunk`,
what `_verify` checks them with too), in a pool of `THREADS` threads.
`StreamSum` hashes a file's chunks from the bytes written into it, in
order, so that a writer need not read its files back.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import google_crc32c._crc32c as _crc32c

from flax_dtensor.dtensor._format import _model

if TYPE_CHECKING:
  import jax

THREADS = max(2, min(8, os.cpu_count() or 2))
# Elements narrowed at a time by `crc`: a bounded scratch copy.
_NARROW_CHUNK = 2**22
# Bytes hashed per call: google_crc32c holds the GIL while it hashes, so
# other Python threads (a training loop beside a background save) wait at
# most this long; zlib lets go of it.
_BLOCK = 2**20


def _crc32c_extend(value: int, data: Any) -> int:
  try:
    return _crc32c.extend(value, data)
  except TypeError:  # It takes bytes and NumPy arrays, not a bytearray.
    return _crc32c.extend(value, bytes(data))


# name -> extend(value so far, bytes): the checksums manifests name.
EXTEND: Mapping[str, Callable[[int, Any], int]] = {
  'crc32': lambda value, data: zlib.crc32(data, value),
  'crc32c': _crc32c_extend,
}


def current() -> str:
  """The checksum the manifests written now use (`_model.VERSION`'s)."""
  return _model.READABLE[_model.VERSION]


def _extend(checksum: str, value: int, data: Any) -> int:
  """`value` extended over `data` (a flat uint8 array), a block at a time."""
  extend = EXTEND[checksum]
  for start in range(0, len(data), _BLOCK):
    value = extend(value, data[start : start + _BLOCK])
  return value


def crc(data: Any, as_dtype: Any = None, checksum: str | None = None) -> int:
  """The checksum of an array's bytes in C order (any dtype, ml_dtypes too).

  With `as_dtype`, of the bytes of its values converted to that dtype: a
  copy stored widened is hashed as the saved dtype it was widened from (an
  exact conversion), a bounded chunk at a time. `checksum` names it
  (`EXTEND`; the current one by default).
  """
  import numpy as np

  checksum = checksum or current()
  flat = np.ascontiguousarray(data).reshape(-1)
  if as_dtype is None or np.dtype(as_dtype) == flat.dtype:
    return _extend(checksum, 0, flat.view(np.uint8))
  value = 0
  for start in range(0, flat.size, _NARROW_CHUNK):
    part = flat[start : start + _NARROW_CHUNK].astype(as_dtype)
    value = _extend(checksum, value, part.view(np.uint8))
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

  Returns one future per array, of `[(global slice, checksum)]`, which
  run beside TF's write.
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


def _read_block() -> memoryview:
  """This thread's read buffer (no NumPy: `inspect --verify` runs without)."""
  block = getattr(_buffers, 'block', None)
  if block is None:
    block = _buffers.block = memoryview(bytearray(_READ_BLOCK))
  return block


def crc_chunk(
  path: str, offset: int, length: int, checksum: str | None = None
) -> int:
  """The checksum of `length` bytes of the file `path` from `offset`."""
  block = _read_block()
  extend = EXTEND[checksum or current()]
  value = 0
  done = 0
  with open(path, 'rb', buffering=0) as f:
    f.seek(offset)
    while done < length:
      n = f.readinto(block[: min(_READ_BLOCK, length - done)])
      if not n:
        break
      value = extend(value, block[:n])
      done += n
  if done != length:
    raise OSError(f'read {done} of {length} bytes at offset {offset}')
  return value


class StreamSum:
  """A file's chunk checksums, from the bytes written into it, in order.

  A writer that hands TF the bytes of a data file adds them here as it
  hashes them (`add`), in the order TF writes them; `finish` then reads
  only what TF wrote past them (the object graph at the end of a bundle)
  and gives the file's `FileSum`, the same one `file_sums` reads back.
  """

  def __init__(self, checksum: str | None = None) -> None:
    self.checksum = checksum or current()
    self.size = 0
    self.chunks: list[int] = []  # Of each whole chunk so far.
    self.value = 0  # Of the chunk being added to.

  def add(self, data: Any) -> None:
    """Adds the next bytes of the file (a flat uint8 array or buffer)."""
    pos = 0
    while pos < len(data):
      room = _model.CHUNK_BYTES - self.size % _model.CHUNK_BYTES
      part = data[pos : pos + room]
      self.value = _extend(self.checksum, self.value, part)
      self.size += len(part)
      pos += len(part)
      if not self.size % _model.CHUNK_BYTES:
        self.chunks.append(self.value)
        self.value = 0

  def finish(self, path: str) -> _model.FileSum | None:
    """The `FileSum` of the file `path`, reading only its bytes past those
    added; None if it holds fewer bytes than were added (then it is not
    what was added, and must be read back whole)."""
    size = os.path.getsize(path)
    if size < self.size:
      return None
    block = _read_block()
    with open(path, 'rb', buffering=0) as f:
      f.seek(self.size)
      while self.size < size:
        n = f.readinto(block[: min(_READ_BLOCK, size - self.size)])
        if not n:
          return None  # Shrunk meanwhile: read back, which reports it.
        self.add(block[:n])
    open_chunk = [self.value] if self.size % _model.CHUNK_BYTES else []
    return _model.FileSum(size, (*self.chunks, *open_chunk))

  def to_json(self) -> list[Any]:
    """What another process needs to finish it (`from_json`)."""
    return [self.checksum, self.size, self.chunks, self.value]

  @classmethod
  def from_json(cls, raw: Any) -> StreamSum:
    out = cls(raw[0])
    out.size, out.chunks, out.value = raw[1], list(raw[2]), raw[3]
    return out


def file_sums(
  root: str,
  names: Sequence[str],
  pool: concurrent.futures.Executor,
  written: Mapping[str, StreamSum] | None = None,
) -> dict[str, _model.FileSum]:
  """Size and chunk checksums of `names` (relative to `root`).

  A file in `written` (by name) is finished from what was hashed as it was
  written (`StreamSum.finish`); the others, and any that does not hold
  what was hashed, are read back, chunks in parallel.
  """
  written = written or {}
  finished = {
    name: pool.submit(written[name].finish, os.path.join(root, name))
    for name in names
    if name in written
  }
  out = {name: f.result() for name, f in finished.items()}
  jobs = {}
  for name in names:
    if out.get(name) is None:
      path = os.path.join(root, name)
      size = os.path.getsize(path)
      jobs[name] = (
        size,
        [
          pool.submit(crc_chunk, path, o, n) for o, n in file_chunks(path, size)
        ],
      )
  for name, (size, futures) in jobs.items():
    out[name] = _model.FileSum(size, tuple(f.result() for f in futures))
  return {name: out[name] for name in names}
