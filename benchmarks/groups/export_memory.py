"""Export on ``jax.make_mesh``'s default mesh: the peak RSS of
`save_saved_model` and of a blocking `save_checkpoint` (group
`export_memory`).
"""

from __future__ import annotations

import os
import time

import harness
import models


def export_memory(method: str, mib: int) -> dict:
  """One step of a model of `mib` MiB on `jax.make_mesh`'s default mesh.

  The model (square float32 layers, `models.explicit_stack`) is built by
  `fdt.init` inside ``jax.set_mesh(jax.make_mesh((2, 4), ('data',
  'model')))`` (every axis Explicit) and the step runs there:
  `saved_model` (`save_saved_model` with a polymorphic batch) or `save`
  (a blocking `save_checkpoint`). A small model's SavedModel is written
  first, so TensorFlow's one-time start-up is not counted. The peak RSS
  above the baseline, divided by `param_bytes`, is the figure.
  """

  jax = harness.cpu_jax()
  from flax import nnx

  import flax_dtensor as fdt
  from flax_dtensor import dtensor as fdt_tf

  fdt_tf.initialize()
  import tensorflow as tf

  if method not in ('saved_model', 'save'):
    raise ValueError(method)
  layers = max(2, mib // 64)
  rules = [('embed', None), ('mlp', 'model')]
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  spec = [tf.TensorSpec([None, models.EXPORT_WIDTH], tf.float32)]
  with harness.scratch('fdt_export_') as root:
    with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
      small = fdt.init(models.explicit_stack(jax, nnx, 2), nnx.Rngs(0))
      fdt_tf.save_saved_model(
        small, os.path.join(root, 'warm'), input_signature=spec
      )
      fdt_tf.save_checkpoint(small, os.path.join(root, 'warm_ckpt'))
      del small
      model = fdt.init(models.explicit_stack(jax, nnx, layers), nnx.Rngs(0))
      jax.block_until_ready(nnx.state(model))
      param_bytes = sum(
        v.nbytes for v in jax.tree.leaves(nnx.state(model, nnx.Param))
      )
      harness.release_free_memory()
      before = harness.reset_peak()
      start = time.perf_counter()
      if method == 'saved_model':
        fdt_tf.save_saved_model(
          model, os.path.join(root, 'sm'), input_signature=spec
        )
      else:
        fdt_tf.save_checkpoint(model, os.path.join(root, 'ckpt'))
      seconds = time.perf_counter() - start
      peak = harness.rss_mib()
  return harness.result(seconds, before, peak, param_bytes=param_bytes)


# built and exported inside jax.set_mesh, beside a blocking checkpoint of
# it: peak RSS above the baseline, against the parameter bytes.
def _export_memory(mib):
  return harness.case(
    'export_memory',
    {'mib': mib},
    {'ours': 'saved_model', 'ours_checkpoint': 'save'},
    note=f'{mib} MiB of float32 parameters on jax.make_mesh((2, 4)) '
    '(Explicit axes), a forward with out_sharding=; peak RSS above the '
    'baseline ÷ param_bytes',
  )


CASES = {'export_memory': export_memory}


def full():
  return {'export_memory': [_export_memory(2048)]}


def quick():
  return {'export_memory': [_export_memory(128)]}
