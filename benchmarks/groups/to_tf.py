"""Export to TensorFlow: `to_tf_module` against orbax-export's
``dtensor_utils`` and TF's own floor (group `to_tf`), and
``single_mesh=True`` against the default (group `single_mesh`).
"""

from __future__ import annotations

import sys
import time

import harness
import models
import numpy as np


def to_tf(
  method: str,
  arrays: int,
  mib: float,
  layouts: str = 'mixed',
  warm: bool = False,
) -> dict:
  """JAX arrays to DTensor variables.

  `warm`: convert other arrays of the same layouts first, so TF's one-time
  costs (compiling its variable ops for each layout) are paid outside the
  measurement.
  """
  jax = harness.cpu_jax()
  from flax import nnx

  from flax_dtensor import dtensor as fdt_tf

  fdt_tf.initialize()
  tf = sys.modules['tensorflow']
  dt = tf.experimental.dtensor
  mesh, values = models.sharded_arrays(jax, arrays, mib, layouts)

  def method_for(values):
    state = nnx.State(
      {f'v{i}': nnx.Param(a) for i, (a, _) in enumerate(values)}
    )
    if method == 'orbax':
      from orbax.export import dtensor_utils

      dmesh = dtensor_utils.jax_mesh_to_dtensor_mesh(mesh)  # Not timed.
      return lambda: [
        dt.DVariable(
          dtensor_utils.jax_array_to_dtensor(
            a,
            spec,
            dmesh,
            jax_mesh=mesh,
            allow_multi_axis_sharding_consolidation=True,
          )
        )
        for a, spec in values
      ]
    if method == 'fdt':
      return lambda: fdt_tf.to_tf_module(state)
    if method == 'fdt_single_mesh':
      return lambda: fdt_tf.to_tf_module(state, single_mesh=True)
    if method in ('pack', 'dvariable'):
      # The floor: the same shards packed into DTensors (layouts and shard
      # order given), and for 'dvariable' then held by DVariables.
      from flax_dtensor.dtensor._layout import _layouts

      layouts_ = [_layouts.layout_for(a.sharding, a.ndim) for a, _ in values]
      shards = [
        [np.asarray(s.data) for s in _sorted_shards(a)] for a, _ in values
      ]
      if method == 'pack':
        return lambda: [
          dt.pack(x, layout) for x, layout in zip(shards, layouts_, strict=True)
        ]
      return lambda: [
        dt.DVariable(dt.pack(x, layout))
        for x, layout in zip(shards, layouts_, strict=True)
      ]
    raise ValueError(method)

  if warm:
    _, others = models.sharded_arrays(jax, arrays, mib, layouts, fill=arrays)
    method_for(others)()
    del others
  run = method_for(values)
  before = harness.reset_peak()
  start = time.perf_counter()
  out = run()
  seconds = time.perf_counter() - start
  del out
  return {
    'seconds': seconds,
    'rss_before_mib': before,
    'rss_peak_mib': harness.rss_mib(),
    'bytes': sum(a.nbytes for a, _ in values),
  }


def _sorted_shards(arr):
  """The array's shards in the order of the layout's local device ids."""
  from flax_dtensor.dtensor._layout import _layouts

  dmesh, _, record = _layouts.layout_parts(arr.sharding, arr.ndim)
  by_device = {s.device: s for s in arr.addressable_shards}
  return [
    by_device[record.devices.flat[int(g)]] for g in dmesh.local_device_ids()
  ]


_TO_TF = {
  'ours': 'fdt',
  'peer': 'orbax',
  'limit': 'dvariable',
  'floor': 'pack',
}
_TO_TF_RATIOS = [('ours', 'peer'), ('ours', 'limit'), ('peer', 'limit')]


CASES = {'to_tf': to_tf}


def full():
  return {
    'to_tf': [
      harness.case(
        'to_tf',
        {'arrays': 32, 'mib': 16, 'layouts': layouts, 'warm': warm},
        _TO_TF,
        _TO_TF_RATIOS,
      )
      for layouts in ('mixed', 'product')
      for warm in (False, True)
    ],
    'single_mesh': [
      harness.case(
        'to_tf',
        {'arrays': 32, 'mib': 16, 'layouts': layouts, 'warm': warm},
        {'ours': 'fdt_single_mesh', 'peer': 'fdt'},
        [('ours', 'peer')],
        note='to_tf_module(single_mesh=True) against the default (fused)',
      )
      for layouts, warm in (
        ('product', False),
        ('product', True),
        ('sharded', False),
      )
    ]
    + [
      harness.case(
        'checkpoint',
        {'arrays': 32, 'mib': 16, 'layouts': 'sharded'},
        {'ours': 'save_single_mesh', 'peer': 'save'},
        [('ours', 'peer')],
        repeat=5,
        note='save_checkpoint(single_mesh=True) against the default',
      )
    ],
  }


def quick():
  return {
    'to_tf': [
      harness.case('to_tf', {'arrays': 8, 'mib': 1}, _TO_TF, _TO_TF_RATIOS),
    ],
    'single_mesh': [
      harness.case(
        'to_tf',
        {'arrays': 8, 'mib': 1, 'layouts': 'product'},
        {'ours': 'fdt_single_mesh', 'peer': 'fdt'},
        [('ours', 'peer')],
      ),
    ],
  }
