"""Sharded model creation: flax_dtensor versus Flax NNX's own paths.

Each method runs in a fresh process (so peak RSS is its own) on 8 virtual CPU
devices and builds the same model of stacked Linear layers, every kernel
annotated with logical axes:

- ``unsharded``: eager sharding off, no mesh (the floor).
- ``flax_eager``: Flax's own eager sharding (``nnx.logical_axis_rules``).
- ``flax_jit``: Flax's eager sharding, the model built inside ``nnx.jit``.
- ``fdt_eager``: flax_dtensor's rules context, eager.
- ``fdt_init``: ``fdt.init``: abstract build, then a jitted build with
  output shardings.

Usage::

  python benchmarks/init_bench.py [--layers 8] [--width 2048] [--repeat 3]

Prints wall time (best of --repeat) and peak RSS per method, and ratios
against ``flax_eager`` measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

METHODS = ('unsharded', 'flax_eager', 'flax_jit', 'fdt_eager', 'fdt_init')


def _child(method: str, layers: int, width: int) -> dict:
  os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
  import resource

  import jax
  from flax import nnx

  jax.config.update('jax_num_cpu_devices', 8)
  import flax_dtensor as fdt

  init = nnx.initializers.lecun_normal()

  class Stack(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.List(
        [
          nnx.Linear(
            width,
            2 * width,
            use_bias=False,
            kernel_init=nnx.with_partitioning(init, ('embed', 'mlp')),
            rngs=rngs,
          )
          for _ in range(layers)
        ]
      )

  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  rules = (('embed', 'data'), ('mlp', 'model'))

  def build():
    if method == 'unsharded':
      with nnx.use_eager_sharding(False):
        return Stack(nnx.Rngs(0))
    if method == 'flax_eager':
      with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        return Stack(nnx.Rngs(0))
    if method == 'flax_jit':
      with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        return nnx.jit(lambda: Stack(nnx.Rngs(0)))()
    if method == 'fdt_eager':
      with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
        return Stack(nnx.Rngs(0))
    if method == 'fdt_init':
      return fdt.init(Stack, nnx.Rngs(0), mesh=mesh, rules=rules)
    raise ValueError(method)

  start = time.perf_counter()
  model = build()
  jax.block_until_ready(nnx.state(model))
  seconds = time.perf_counter() - start
  kernel = model.layers[0].kernel.get_value()
  shards = {s.data.shape for s in kernel.addressable_shards}
  params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  return {
    'method': method,
    'seconds': seconds,
    'peak_rss_mib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    'params': params,
    'shard_shapes': sorted(map(list, shards)),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--layers', type=int, default=8)
  parser.add_argument('--width', type=int, default=2048)
  parser.add_argument('--repeat', type=int, default=3)
  parser.add_argument('--methods', default=','.join(METHODS))
  parser.add_argument('--child', help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    print(json.dumps(_child(args.child, args.layers, args.width)))
    return
  results = {}
  for method in args.methods.split(','):
    runs = []
    for _ in range(args.repeat):
      out = subprocess.run(
        [
          sys.executable,
          __file__,
          '--child',
          method,
          '--layers',
          str(args.layers),
          '--width',
          str(args.width),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
      )
      if out.returncode:
        runs.append({'method': method, 'error': out.stderr.strip()[-300:]})
        break
      runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    ok = [r for r in runs if 'error' not in r]
    results[method] = (
      min(ok, key=lambda r: r['seconds'])
      | {'peak_rss_mib': max(r['peak_rss_mib'] for r in ok)}
      if ok
      else runs[-1]
    )
  base = results.get('flax_eager', {})
  print(
    f'{"method":<12} {"seconds":>8} {"vs flax":>8} {"peak RSS MiB":>13} '
    f'{"vs flax":>8}  shards'
  )
  for method, r in results.items():
    if 'error' in r:
      print(f'{method:<12} FAILED: {r["error"]}')
      continue
    t_ratio = (
      r['seconds'] / base['seconds'] if 'seconds' in base else float('nan')
    )
    m_ratio = (
      r['peak_rss_mib'] / base['peak_rss_mib']
      if 'peak_rss_mib' in base
      else float('nan')
    )
    print(
      f'{method:<12} {r["seconds"]:>8.2f} {t_ratio:>7.2f}x '
      f'{r["peak_rss_mib"]:>13.0f} {m_ratio:>7.2f}x  {r["shard_shapes"]}'
    )
  params = next((r['params'] for r in results.values() if 'params' in r), 0)
  print(f'params: {params / 1e6:.1f}M ({params * 4 / 2**20:.0f} MiB float32)')


if __name__ == '__main__':
  main()
