"""JAX -> TF DTensor conversion: flax_dtensor versus orbax-export's dtensor_utils.

Both convert the same sharded JAX arrays to DTensors in one process on 8
virtual CPU devices. For each (mesh device order, PartitionSpec) case, the
DTensor is gathered by TF (a relayout to replicated) and compared with the
JAX array, so a wrong device mapping shows up as ``WRONG VALUES``; a refused
layout shows as ``refused``; and a layout changed to fit (orbax's
"consolidation" of product sharding) is reported as ``layout changed``.
Then both convert a model-sized set of arrays and the times are compared in
the same run.

Usage::

  pip install --group bench   # orbax-export
  python benchmarks/dtensor_bench.py [--arrays 64] [--mib 4] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

jax.config.update('jax_num_cpu_devices', 8)

from flax_dtensor import dtensor as fdt_dtensor  # noqa: E402


def _meshes():
  devices = np.array(jax.devices())
  types = (jax.sharding.AxisType.Auto,) * 2
  names = ('data', 'model')
  return {
    'make_mesh': jax.make_mesh((2, 4), names, axis_types=types),
    'reversed': jax.sharding.Mesh(
      devices[::-1].reshape(2, 4), names, axis_types=types
    ),
    'transposed': jax.sharding.Mesh(
      devices.reshape(4, 2).T, names, axis_types=types
    ),
  }


SPECS = {
  "P('data','model')": P('data', 'model'),
  "P('model','data')": P('model', 'data'),
  "P(('data','model'))": P(('data', 'model'), None),
  "P(('model','data'))": P(('model', 'data'), None),
  "P(None,'model')": P(None, 'model'),
}


def _gather(t):
  from tensorflow.experimental import dtensor

  layout = dtensor.fetch_layout(t)
  full = dtensor.relayout(t, dtensor.Layout.replicated(layout.mesh, t.ndim))
  return np.asarray(dtensor.unpack(full)[0])


def _ours(arr):
  return fdt_dtensor.array_to_dtensor(arr)


def _orbax(arr, mesh, spec, cache):
  from orbax.export import dtensor_utils

  if mesh not in cache:
    cache[mesh] = dtensor_utils.jax_mesh_to_dtensor_mesh(mesh)
  return dtensor_utils.jax_array_to_dtensor(
    arr,
    spec,
    cache[mesh],
    jax_mesh=mesh,
    allow_multi_axis_sharding_consolidation=True,
  )


def _check(name, convert, arr, spec):
  try:
    t = convert()
  except Exception as e:
    return f'refused ({type(e).__name__})'
  from tensorflow.experimental import dtensor

  layout = dtensor.fetch_layout(t)
  ok = np.array_equal(_gather(t), np.asarray(arr))
  sharded = [s for s in layout.sharding_specs if s != dtensor.UNSHARDED]
  want = [e for e in spec if e is not None]
  changed = len(sharded) != len(want) or (
    name == 'orbax' and any(isinstance(e, tuple) and len(e) > 1 for e in want)
  )
  if not ok:
    return 'WRONG VALUES'
  return 'ok, layout changed' if changed else 'ok'


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--arrays', type=int, default=64)
  parser.add_argument('--mib', type=float, default=4.0)
  parser.add_argument('--repeat', type=int, default=5)
  args = parser.parse_args()
  warnings.simplefilter('ignore')
  fdt_dtensor.initialize()
  meshes = _meshes()
  cache: dict = {}

  print('Correctness (TF gather == JAX array):')
  print(f'  {"mesh":<11} {"spec":<20} {"flax_dtensor":<20} orbax-export')
  tally = {'flax_dtensor': 0, 'orbax': 0}
  total = 0
  for mesh_name, mesh in meshes.items():
    for spec_name, spec in SPECS.items():
      x = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
      arr = jax.device_put(x, NamedSharding(mesh, spec))
      ours = _check('ours', lambda a=arr: _ours(a), arr, spec)
      theirs = _check(
        'orbax',
        lambda a=arr, m=mesh, s=spec: _orbax(a, m, s, cache),
        arr,
        spec,
      )
      total += 1
      tally['flax_dtensor'] += ours == 'ok'
      tally['orbax'] += theirs == 'ok'
      print(f'  {mesh_name:<11} {spec_name:<20} {ours:<20} {theirs}')
  print(
    f'  exact and lossless: flax_dtensor {tally["flax_dtensor"]}/{total}, '
    f'orbax-export {tally["orbax"]}/{total}'
  )

  mesh = meshes['make_mesh']
  n = int(args.mib * 2**20 / 4)
  cols = 1024
  rows = max(8, n // cols // 8 * 8)
  arrays = [
    jax.device_put(
      np.full((rows, cols), i, np.float32),
      NamedSharding(mesh, P('data', 'model')),
    )
    for i in range(args.arrays)
  ]
  size = sum(a.nbytes for a in arrays) / 2**20

  def timed(fn):
    best = float('inf')
    for _ in range(args.repeat):
      start = time.perf_counter()
      out = [fn(a) for a in arrays]
      best = min(best, time.perf_counter() - start)
      del out
    return best

  ours = timed(_ours)
  theirs = timed(lambda a: _orbax(a, mesh, P('data', 'model'), cache))
  fresh_mesh = timed(
    lambda a: _orbax(a, mesh, P('data', 'model'), {})
  )  # orbax without a cached mesh: a jitted collective per call.
  product = P(('data', 'model'), None)
  arrays = [jax.device_put(a, NamedSharding(mesh, product)) for a in arrays]
  ours_product = timed(_ours)
  theirs_product = timed(lambda a: _orbax(a, mesh, product, cache))
  print(
    f'\nConversion of {args.arrays} arrays ({size:.0f} MiB), best of '
    f'{args.repeat}:'
  )
  print(f'  flax_dtensor.array_to_dtensor      {ours * 1e3:8.2f} ms  1.00x')
  print(
    f'  orbax jax_array_to_dtensor         {theirs * 1e3:8.2f} ms  '
    f'{theirs / ours:.2f}x'
  )
  print(
    f'  orbax incl. jax_mesh_to_dtensor_mesh {fresh_mesh * 1e3:6.2f} ms  '
    f'{fresh_mesh / ours:.2f}x'
  )
  print(f'Product sharding {product} (orbax reshards onto one axis):')
  print(
    f'  flax_dtensor.array_to_dtensor      {ours_product * 1e3:8.2f} ms  1.00x'
  )
  print(
    f'  orbax jax_array_to_dtensor         {theirs_product * 1e3:8.2f} ms  '
    f'{theirs_product / ours_product:.2f}x'
  )


if __name__ == '__main__':
  main()
