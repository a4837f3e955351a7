"""The way back from TensorFlow: `from_tf_module` onto the same layouts and
onto others, against ``jax.device_put`` (group `from_tf`).
"""

from __future__ import annotations

import sys
import time

import harness
import models


def from_tf(
  method: str, arrays: int, mib: float, layouts: str = 'mixed'
) -> dict:
  """DVariables (from `to_tf_module`) back into JAX arrays.

  `same_layout` restores into the layouts exported, `other_layout` into
  every array's spec reversed; `device_put` is JAX moving the same arrays
  to those other layouts (its own way of copying them). `copied_bytes` sums
  the result's distinct buffers that are not one of TF's components (by
  address): 0 when nothing was copied.
  """
  jax = harness.cpu_jax()
  from flax import nnx
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from flax_dtensor import dtensor as fdt_tf

  fdt_tf.initialize()
  dt = sys.modules['tensorflow'].experimental.dtensor
  mesh, values = models.sharded_arrays(jax, arrays, mib, layouts)
  state = nnx.State({f'v{i}': nnx.Param(a) for i, (a, _) in enumerate(values)})
  tf_module = fdt_tf.to_tf_module(state)
  other = {
    f'v{i}': NamedSharding(mesh, P(*reversed((tuple(spec) + (None,) * 2)[:2])))
    for i, (_, spec) in enumerate(values)
  }
  if method == 'same_layout':
    target = state
  elif method in ('other_layout', 'device_put'):
    target = nnx.State(
      {
        k: nnx.Param(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=other[k]))
        for k, v in ((k, state[k].get_value()) for k in other)
      }
    )
  else:
    raise ValueError(method)
  tf_buffers = {
    c._numpy().ctypes.data
    for v in tf_module.variables
    for c in dt.unpack(v.read_value())
  }
  before = harness.reset_peak()
  start = time.perf_counter()
  if method == 'device_put':
    out = [jax.device_put(state[k].get_value(), s) for k, s in other.items()]
  else:
    restored = fdt_tf.from_tf_module(tf_module, target)
    out = [v.get_value() for _, v in nnx.to_flat_state(restored)]
  jax.block_until_ready(out)
  seconds = time.perf_counter() - start
  new_buffers = {
    s.data.unsafe_buffer_pointer(): s.data.nbytes
    for a in out
    for s in a.addressable_shards
  }
  copied = sum(n for p, n in new_buffers.items() if p not in tf_buffers)
  return {
    'seconds': seconds,
    'rss_before_mib': before,
    'rss_peak_mib': harness.rss_mib(),
    'bytes': sum(a.nbytes for a, _ in values),
    'copied_bytes': copied,
  }


CASES = {'from_tf': from_tf}
_FROM_TF = {
  'ours': 'same_layout',
  'ours_moved': 'other_layout',
  'peer': 'device_put',
}


def full():
  return {
    'from_tf': [
      harness.case(
        'from_tf',
        {'arrays': 32, 'mib': 16, 'layouts': layouts},
        _FROM_TF,
        [('ours_moved', 'peer')],
      )
      for layouts in ('mixed', 'sharded')
    ],
  }


def quick():
  return {
    'from_tf': [
      harness.case(
        'from_tf',
        {'arrays': 8, 'mib': 1},
        _FROM_TF,
        [('ours_moved', 'peer')],
      ),
    ],
  }
