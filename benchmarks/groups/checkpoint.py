"""Checkpoints: `save_checkpoint` and `restore_checkpoint` against raw
NumPy writes and reads of the same bytes and TF's own writer (groups
`checkpoint`, `checkpoint_scaling`); orbax-checkpoint's methods are its
peer in `vs_orbax`.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import harness
import models
import numpy as np

from groups import vs_orbax


def checkpoint(
  method: str,
  arrays: int,
  mib: float,
  cache: str = 'hot',
  layouts: str = 'mixed',
  target: str = 'saved',
  again: int = 0,
) -> dict:
  """Writing and reading a checkpoint, and the raw bytes the same way.

  `again`: for `save` and `raw_write`, that many writes of the same state
  into new files first, in this process (as a training loop saves): the
  one timed is the next.

  The limits write each distinct shard to its own file with NumPy (and
  fsync), read them back with NumPy, and for `raw_read_place` also place
  them on the devices as the restore does. `cache='cold'` evicts the files
  from the page cache (``posix_fadvise``) before a read. `target=
  'transposed'` restores each array onto the mesh axes of its dimensions
  swapped (`P('model', 'data')` for `P('data', 'model')`): no device then
  holds a saved shard, and every byte read is cut and checked on the host.
  """
  jax = harness.cpu_jax()
  from flax import nnx

  from flax_dtensor import dtensor as fdt_tf

  fdt_tf.initialize()
  _, values = models.sharded_arrays(jax, arrays, mib, layouts)
  state = nnx.State({f'v{i}': nnx.Param(a) for i, (a, _) in enumerate(values)})
  nbytes = sum(a.nbytes for a, _ in values)
  root = tempfile.mkdtemp(prefix='fdt_bench_', dir=os.environ.get('BENCH_DIR'))
  path = os.path.join(root, 'ckpt')
  # Each distinct shard once: [(array index, shard index, host bytes)].
  shards = [
    (i, index, np.asarray(s.data))
    for i, (a, _) in enumerate(values)
    for index, s in {str(s.index): s for s in a.addressable_shards}.items()
  ]
  reads = method in ('restore', 'raw_read', 'raw_read_place', 'orbax_restore')
  if reads:
    if method == 'orbax_restore':
      vs_orbax.orbax_step('orbax_save', state, os.path.join(root, 'orbax'), 0.0)
    fdt_tf.save_checkpoint(state, path)
    for k, (_, _, shard) in enumerate(shards):
      _write(os.path.join(root, f'raw{k}'), shard)
    abstract = jax.tree.map(
      lambda v: v, state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    if target == 'transposed':
      from jax.sharding import NamedSharding
      from jax.sharding import PartitionSpec as P

      for i, (_, spec) in enumerate(values):
        variable = abstract[f'v{i}']
        swapped = P(*reversed(tuple(spec) + (None,) * (2 - len(spec))))
        value = variable.get_value()
        variable.set_value(
          jax.device_put(value, NamedSharding(value.sharding.mesh, swapped))
        )
    shapes = [(a.shape, a.sharding) for a, _ in values]
    del state, values  # Only what the restore creates stays.
    if cache == 'cold':
      _evict(root)
  if again and method not in ('save', 'raw_write'):
    raise ValueError(f'again= is for save and raw_write, not {method}')
  for k in range(again):  # Earlier writes, each into new files.
    if method == 'save':
      fdt_tf.save_checkpoint(state, os.path.join(root, f'earlier{k}'))
    else:
      earlier = os.path.join(root, f'earlier{k}')
      os.mkdir(earlier)
      for j, (_, _, shard) in enumerate(shards):
        _write(os.path.join(earlier, f'raw{j}'), shard)
      _fsync_dir(earlier)
  before = harness.reset_peak()
  start = time.perf_counter()
  if method == 'save':
    fdt_tf.save_checkpoint(state, path)
  elif method == 'save_single_mesh':
    fdt_tf.save_checkpoint(state, path, single_mesh=True)
  elif method == 'raw_write':
    for k, (_, _, shard) in enumerate(shards):
      _write(os.path.join(root, f'raw{k}'), shard)
    _fsync_dir(root)
  elif method == 'save_async_stall':
    handle = fdt_tf.save_checkpoint(state, path, blocking=False)
    seconds = time.perf_counter() - start
    handle.wait()
  elif method == 'save_async':
    fdt_tf.save_checkpoint(state, path, blocking=False).wait()
  elif method == 'host_copy':
    # The state copied to host memory: each distinct shard once.
    copies = [np.array(shard, copy=True) for _, _, shard in shards]
    del copies
  elif method.startswith('orbax_'):
    tree = abstract if method == 'orbax_restore' else state
    seconds = vs_orbax.orbax_step(method, tree, path, start)
  elif method == 'tf_write':
    tf = sys.modules['tensorflow']
    tf.train.Checkpoint(fdt_tf.to_tf_module(state)).write(path)
  elif method == 'restore':
    out = fdt_tf.restore_checkpoint(path, abstract)
    jax.block_until_ready(jax.tree.leaves(out))
  elif method in ('raw_read', 'raw_read_place'):
    host = {}
    for k, (i, index, shard) in enumerate(shards):
      # Into 64-byte-aligned buffers, which JAX on CPU places without a
      # copy (one buffer for all replicas): the floor at its best.
      host[i, index] = _aligned_read(os.path.join(root, f'raw{k}'), shard)
    if method == 'raw_read_place':
      placed = []
      for i, (shape, sharding) in enumerate(shapes):
        devices = sharding.addressable_devices_indices_map(shape)
        bufs = jax.device_put(
          [host[i, str(index)] for index in devices.values()], list(devices)
        )
        placed.append(
          jax.make_array_from_single_device_arrays(shape, sharding, bufs)
        )
      jax.block_until_ready(placed)
  else:
    raise ValueError(method)
  if method not in ('save_async_stall', 'orbax_async_stall'):
    seconds = time.perf_counter() - start

  shutil.rmtree(root, ignore_errors=True)
  return {
    'seconds': seconds,
    'rss_before_mib': before,
    'rss_peak_mib': harness.rss_mib(),
    'bytes': nbytes,
  }


def _fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _evict(root: str) -> None:
  """Drops the files under `root` from the page cache."""
  for directory, _, names in os.walk(root):
    for name in names:
      fd = os.open(os.path.join(directory, name), os.O_RDONLY)
      try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      finally:
        os.close(fd)


def _aligned_read(path: str, like: np.ndarray) -> np.ndarray:
  """The file's bytes in a 64-byte-aligned array shaped like `like`."""
  raw = np.empty(like.nbytes + 64, np.uint8)
  start = (-raw.ctypes.data) % 64
  out = raw[start : start + like.nbytes]
  with open(path, 'rb', buffering=0) as f:
    assert f.readinto(out) == like.nbytes, path
  return out.view(like.dtype).reshape(like.shape)


def _write(path: str, array) -> None:
  with open(path, 'wb') as f:
    array.tofile(f)
    f.flush()
    os.fsync(f.fileno())


_SAVE = {'ours': 'save', 'limit': 'raw_write', 'peer': 'tf_write'}
_RESTORE = {
  'ours': 'restore',
  'limit': 'raw_read',
  'limit_place': 'raw_read_place',
}


CASES = {'checkpoint': checkpoint}


def full():
  return {
    'checkpoint': [
      harness.case(
        'checkpoint',
        {'arrays': 32, 'mib': 16, 'layouts': layouts},
        _SAVE,
        [('ours', 'limit'), ('ours', 'peer')],
        repeat=5,
      )
      for layouts in ('sharded', 'mixed')
    ]
    + [
      harness.case(
        'checkpoint',
        {'arrays': 32, 'mib': 16, 'layouts': layouts, 'cache': cache},
        _RESTORE,
        [('ours', 'limit'), ('ours', 'limit_place')],
        repeat=5,
      )
      for layouts in ('sharded', 'mixed')
      for cache in ('hot', 'cold')
    ],
    'checkpoint_scaling': [
      harness.case(
        'checkpoint',
        {'arrays': 32, 'mib': mib, 'layouts': 'sharded'},
        {'ours': 'save', 'limit': 'raw_write'},
        [('ours', 'limit')],
      )
      for mib in (4, 8, 16, 32, 64)
    ]
    + [
      harness.case(
        'checkpoint',
        {'arrays': 32, 'mib': mib, 'layouts': 'sharded'},
        {'ours': 'restore', 'limit': 'raw_read'},
        [('ours', 'limit')],
      )
      for mib in (4, 8, 16, 32, 64)
    ],
  }


def quick():
  return {
    'checkpoint': [
      harness.case(
        'checkpoint', {'arrays': 8, 'mib': 1}, _SAVE, [('ours', 'limit')]
      ),
      harness.case(
        'checkpoint', {'arrays': 8, 'mib': 1}, _RESTORE, [('ours', 'limit')]
      ),
    ],
  }
