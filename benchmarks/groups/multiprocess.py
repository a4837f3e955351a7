"""Memory per process across process counts: one model in 1, 2 and 4 local
processes, with JAX's distributed runtime on 127.0.0.1 (group
`multiprocess`).
"""

from __future__ import annotations

import json
import os
import time

import harness
import models
import numpy as np

_MP_METHODS = ('save', 'save_async', 'save_async_stall', 'host_copy', 'restore')


def multiprocess(method: str, processes: int, arrays: int, mib: float) -> dict:
  """One step of one model in `processes` local processes (8 devices in all).

  Each process runs `_mp_step` (JAX's distributed runtime on 127.0.0.1,
  `8 // processes` CPU devices, DTensor set up from JAX) and reports its
  seconds, its peak RSS above its baseline before the step, and the bytes
  of the shards it holds. A restore reads a checkpoint that other
  processes wrote before (so that no memory of the state is in its
  baseline). The result is the slowest process's seconds and the largest
  peak of them, with every process's figures in `per_process`.
  """

  if method not in _MP_METHODS:
    raise ValueError(method)
  with harness.scratch('fdt_mp_') as root:
    params = {'arrays': arrays, 'mib': mib, 'processes': processes}
    params['root'] = root
    if method == 'restore':
      harness.launch('prepare', params)
    outs = harness.launch(method, params)
  return harness.slowest(outs, 'shard_bytes', 'copied_bytes')


def _warm_up(jax, nnx, fdt_tf, path: str) -> None:
  """A save and a restore of one small sharded array, before the measure.

  TensorFlow's runtime, its kernels and DTensor's mesh are set up on the
  first save of a process, once: that is not what a save of the model
  costs, so it stays out of its peak.
  """
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh(
    (2, 4), ('data', 'model'), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  sharding = NamedSharding(mesh, P('data', 'model'))
  small = jax.make_array_from_callback(
    (8, 64), sharding, lambda index: np.ones((8, 64), np.float32)[index]
  )
  state = nnx.State({'w': nnx.Param(small)})
  fdt_tf.save_checkpoint(state, path, overwrite=True)
  fdt_tf.save_checkpoint(state, path, overwrite=True, blocking=False).wait()
  jax.block_until_ready(fdt_tf.restore_checkpoint(path, state))
  multihost_utils.sync_global_devices('warm')


def _mp_step(
  method: str,
  arrays: int,
  mib: float,
  processes: int,
  root: str,
  process: int,
  port: int,
) -> dict:
  """`multiprocess`'s step in one of its processes (or `prepare` its file)."""
  jax = harness.jax_of_process(8 // processes, processes, process, port)
  from flax import nnx
  from jax.experimental import multihost_utils

  from flax_dtensor import dtensor as fdt_tf

  fdt_tf.initialize()
  path = os.path.join(root, 'ckpt')
  if method == 'restore':
    # Only the target's shardings: nothing of the state was ever here.
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh(
      (2, 4), ('data', 'model'), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )
    specs = models.LAYOUTS['sharded']
    cols = int(mib * 2**20 / 4 / 256)
    cols -= cols % 8
    target = nnx.State(
      {
        f'v{i}': nnx.Param(
          jax.ShapeDtypeStruct(
            (256, cols),
            np.float32,
            sharding=NamedSharding(mesh, P(*specs[i % len(specs)])),
          )
        )
        for i in range(arrays)
      }
    )
  else:
    _, values = models.sharded_arrays(jax, arrays, mib, 'sharded')
    state = nnx.State(
      {f'v{i}': nnx.Param(a) for i, (a, _) in enumerate(values)}
    )
    # The distinct shards this process holds.
    shards = [
      s.data
      for a, _ in values
      for s in {str(s.index): s for s in a.addressable_shards}.values()
    ]
  if method != 'host_copy':
    _warm_up(jax, nnx, fdt_tf, os.path.join(root, 'warm'))
  multihost_utils.sync_global_devices('before')
  harness.release_free_memory()
  before = harness.reset_peak()
  start = time.perf_counter()
  copied = 0
  if method in ('save', 'prepare'):
    fdt_tf.save_checkpoint(state, path, overwrite=True)
  elif method in ('save_async', 'save_async_stall'):
    handle = fdt_tf.save_checkpoint(state, path, overwrite=True, blocking=False)
    stall = time.perf_counter() - start
    from flax_dtensor.dtensor._storage import _host_write

    copied = sum(  # The shards this process writes (all float32).
      s.data.nbytes
      for mine in _host_write.own([a for a, _ in values])
      for s in mine.values()
    )
    handle.wait()
  elif method == 'host_copy':
    copies = [np.array(d, copy=True) for d in shards]
    del copies
  elif method == 'restore':
    out = fdt_tf.restore_checkpoint(path, target)
    shards = [
      s.data
      for a in jax.block_until_ready(jax.tree.leaves(out))
      for s in {str(s.index): s for s in a.addressable_shards}.values()
    ]
  seconds = (
    stall if method == 'save_async_stall' else time.perf_counter() - start
  )
  peak = harness.rss_mib()
  multihost_utils.sync_global_devices('after')
  result = harness.result(
    seconds,
    before,
    peak,
    shard_bytes=sum(d.nbytes for d in shards),
    copied_bytes=copied,
    process=process,
  )
  print(json.dumps(result), flush=True)
  os._exit(0)  # JAX's shutdown at exit would wait for the slowest process.


# One model (512 MiB, every array split over the 8 devices) in 1, 2 and 4
# local processes: each process's peak RSS and the shards it holds, and the
# stall of a background save against a host copy of those shards.
_MULTIPROCESS = {
  'ours': 'save',
  'ours_async': 'save_async',
  'ours_stall': 'save_async_stall',
  'limit': 'host_copy',
  'ours_restore': 'restore',
}


def _multiprocess(arrays, mib, counts, repeat=None):
  return [
    harness.case(
      'multiprocess',
      {'processes': n, 'arrays': arrays, 'mib': mib},
      _MULTIPROCESS,
      [('ours_stall', 'limit')],
      repeat=repeat,
      note=f'{n} process(es) of {8 // n} devices; peak RSS and seconds of '
      'the process with the largest',
    )
    for n in counts
  ]


# Checkpoints as the devices grow, against orbax-checkpoint in the same run:
# 32 small arrays, each split over every device (one shard per device), so


CASES = {'multiprocess': multiprocess, '_mp_step': _mp_step}


def full():
  return {'multiprocess': _multiprocess(32, 16, (1, 2, 4), repeat=3)}


def quick():
  return {'multiprocess': _multiprocess(4, 1, (1, 2))}
