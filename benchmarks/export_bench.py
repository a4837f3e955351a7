"""Checkpoint export and restore throughput versus a NumPy baseline.

Runs on 8 virtual CPU devices in one process. Builds ``--layers`` float32
kernels of ``--width`` x ``--width`` sharded P('data', 'model') on a (2, 4)
mesh, plus one fused-axis kernel P(('data', 'model'), None), then times:

- ``numpy_tofile``: each process's shards written with ``ndarray.tofile``
  into one file per array, then fsync (the floor for writing the bytes).
- ``tf_checkpoint_write``: ``tf.train.Checkpoint(to_tf_module(m)).write``
  (plain TF, one mesh only: the fused kernel is left out).
- ``save_checkpoint``: flax_dtensor's full path (conversion, per-mesh
  sharded saves, merge, metadata, fsync, atomic rename).
- ``restore_checkpoint``: into an abstract model, through DTensor.

Usage::

  python benchmarks/export_bench.py [--layers 8] [--width 4096]

Prints seconds and GB/s per step (best of --repeat), and peak RSS.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import time

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--layers', type=int, default=8)
  parser.add_argument('--width', type=int, default=4096)
  parser.add_argument('--repeat', type=int, default=2)
  parser.add_argument('--dir', default=None, help='scratch directory')
  args = parser.parse_args()

  import jax
  import numpy as np
  from flax import nnx
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import flax_dtensor.dtensor as fdt_tf

  fdt_tf.initialize()
  import tensorflow as tf

  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  width, layers = args.width, args.layers

  def build(seed: int) -> nnx.Dict:
    key = jax.random.key(seed)
    grid = NamedSharding(mesh, P('data', 'model'))
    fused = NamedSharding(mesh, P(('data', 'model'), None))
    out = {}
    for i in range(layers):
      k = jax.random.fold_in(key, i)
      out[f'layer{i}'] = nnx.Param(
        jax.random.normal(k, (width, width), out_sharding=grid)
      )
    out['embed'] = nnx.Param(
      jax.random.normal(key, (width, width), out_sharding=fused)
    )
    return nnx.Dict(out)

  with jax.set_mesh(mesh):
    model = build(0)
  state = nnx.state(model)
  arrays = [v.get_value() for _, v in nnx.to_flat_state(state)]
  nbytes = sum(a.nbytes for a in arrays)
  root = tempfile.mkdtemp(dir=args.dir)
  results: dict[str, float] = {}

  def timed(name: str, fn, size: int = nbytes) -> None:
    best = float('inf')
    for r in range(args.repeat):
      target = os.path.join(root, f'{name}-{r}')
      start = time.perf_counter()
      fn(target)
      best = min(best, time.perf_counter() - start)
      if os.path.isdir(target):
        shutil.rmtree(target)
    results[name] = best
    print(
      f'{name:22s} {best:7.2f} s  {size / best / 1e9:6.2f} GB/s  '
      f'({size / 1e9:.2f} GB)',
      flush=True,
    )

  def numpy_tofile(target: str) -> None:
    os.mkdir(target)
    for i, a in enumerate(arrays):
      for j, shard in enumerate(a.addressable_shards):
        if shard.replica_id:
          continue
        path = os.path.join(target, f'{i}-{j}.bin')
        with open(path, 'wb') as f:
          np.asarray(shard.data).tofile(f)
          f.flush()
          os.fsync(f.fileno())

  grid_only = nnx.State({k: v for k, v in state.items() if k != 'embed'})
  grid_bytes = nbytes - state['embed'].get_value().nbytes

  def tf_write(target: str) -> None:
    module = fdt_tf.to_tf_module(grid_only)
    tf.train.Checkpoint(module).write(os.path.join(target, 'ckpt'))

  def save(target: str) -> None:
    fdt_tf.save_checkpoint(model, target)

  timed('numpy_tofile', numpy_tofile)
  timed('tf_checkpoint_write', tf_write, grid_bytes)
  timed('save_checkpoint', save)

  saved = fdt_tf.save_checkpoint(model, os.path.join(root, 'kept'))
  with jax.set_mesh(mesh):
    abstract = nnx.eval_shape(lambda: build(1))

  def restore(_: str) -> None:
    restored = fdt_tf.restore_checkpoint(saved, abstract, mesh=mesh)
    jax.block_until_ready(nnx.state(restored))

  timed('restore_checkpoint', restore)
  restored = fdt_tf.restore_checkpoint(saved, abstract, mesh=mesh)
  for (_, a), (_, b) in zip(
    nnx.to_flat_state(nnx.state(restored)),
    nnx.to_flat_state(state),
    strict=True,
  ):
    assert np.array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()))
  shutil.rmtree(root)
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
  ratio = results['save_checkpoint'] / results['numpy_tofile']
  print(f'save_checkpoint / numpy_tofile time: {ratio:.2f}x')
  print(f'peak RSS {rss:.2f} GB for {nbytes / 1e9:.2f} GB of parameters')


if __name__ == '__main__':
  main()
