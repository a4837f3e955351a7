"""SavedModel export: `save_saved_model` against orbax-export's
``JaxModule`` + ``ExportManager`` (group `saved_model`).
"""

from __future__ import annotations

import os
import sys
import time

import harness
import models

# The stack's logical axes on the (2, 4) mesh: 'mlp' split over 'model'.
_STACK_RULES = [('embed', None), ('mlp', 'model')]


def _model(jax, nnx, name: str, seed: int, mib: int):
  """The model to export and its input's spec (shape, dtype name).

  `demo`: the demo's language model (`make_model`, one device). `stack`:
  `models.mlp_stack` of width 1024 (32 MiB of float32 per block, `mib` /
  32 blocks) with a ReLU forward, built by `fdt.init` on a (2, 4) mesh of
  Auto axes, 'mlp' split over 'model'.
  """
  if name == 'demo':
    from flax_dtensor.demo import model as demo

    return demo.make_model(seed=seed), (
      [None, demo.Config().max_length],
      'int32',
    )
  if name != 'stack':
    raise ValueError(name)
  import flax_dtensor as fdt

  width = 1024
  base = models.mlp_stack(max(1, mib // 32), width)

  class Served(base):
    def __call__(self, x):
      for block in self.blocks:
        x = block.down(jax.nn.relu(block.up(x)))
      return x

  mesh = jax.make_mesh(
    (2, 4), ('data', 'model'), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  with jax.set_mesh(mesh), fdt.logical_axis_rules(_STACK_RULES):
    model = fdt.init(Served, nnx.Rngs(seed))
  jax.block_until_ready(nnx.state(model))
  return model, ([None, width], 'float32')


def _size(directory: str) -> int:
  """The bytes of every file under `directory`."""
  return sum(
    os.path.getsize(os.path.join(root, f))
    for root, _, files in os.walk(directory)
    for f in files
  )


def saved_model(
  method: str, model: str, export: str = 'serve', mib: int = 0
) -> dict:
  """One SavedModel export of `model` (`_model`), timed from the model.

  `export`: `serve` (no gradient), `trainable` (every Param trainable, the
  gradient saved), or `again` (the same model exported once untimed, its
  params then replaced by another seed's, and the second export into a new
  directory timed). `fdt`: `save_saved_model(model, dir,
  input_signature=...)` (``trainable=nnx.Param``). `orbax`: ``nnx.split``,
  ``JaxModule(params, apply_fn)`` with a polymorphic batch
  (``trainable=True`` and ``jax2tf_kwargs={'with_gradient': True}``),
  ``ExportManager(..., [ServingConfig('serving_default', ...)]).save(dir)``;
  `again` times ``update_variables`` and ``save``. TensorFlow is imported
  and `flax_dtensor.dtensor.initialize()` called before, for both. `bytes`
  is the SavedModel's size on disk, `param_bytes` the model's.
  """
  jax = harness.cpu_jax()
  from flax import nnx

  from flax_dtensor import dtensor as fdt_tf

  fdt_tf.initialize()
  tf = sys.modules['tensorflow']
  if method not in ('fdt', 'orbax') or export not in (
    'serve',
    'trainable',
    'again',
  ):
    raise ValueError(f'{method} {export}')
  net, (shape, dtype) = _model(jax, nnx, model, 0, mib)
  spec = tf.TensorSpec(shape, getattr(tf, dtype))
  trainable = export == 'trainable'
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(net)))

  def fdt_export(directory):
    fdt_tf.save_saved_model(
      net,
      directory,
      input_signature=[spec],
      trainable=nnx.Param if trainable else False,
    )

  manager = []

  def orbax_export(directory):
    from orbax.export import ExportManager, JaxModule, ServingConfig

    graphdef, params, rest = nnx.split(net, nnx.Param, ...)

    def apply_fn(params, x):
      return nnx.merge(graphdef, params, rest)(x)

    module = JaxModule(
      params,
      apply_fn,
      trainable=trainable,
      input_polymorphic_shape='b, ...',
      jax2tf_kwargs={'with_gradient': True} if trainable else None,
    )
    manager[:] = [
      module,
      ExportManager(
        module, [ServingConfig('serving_default', input_signature=[spec])]
      ),
    ]
    manager[1].save(directory)

  def orbax_again(directory):
    module, export_manager = manager
    module.update_variables(nnx.state(net, nnx.Param))
    export_manager.save(directory)

  first = fdt_export if method == 'fdt' else orbax_export
  with harness.scratch('fdt_saved_model_') as root:
    step = first
    if export == 'again':
      first(os.path.join(root, 'first'))
      other, _ = _model(jax, nnx, model, 1, mib)
      nnx.update(net, nnx.state(other))
      jax.block_until_ready(nnx.state(net))
      del other
      step = fdt_export if method == 'fdt' else orbax_again
    harness.release_free_memory()
    directory = os.path.join(root, 'out')
    before = harness.reset_peak()
    start = time.perf_counter()
    step(directory)
    seconds = time.perf_counter() - start
    peak = harness.rss_mib()
    size = _size(directory)
  return harness.result(
    seconds, before, peak, bytes=size, param_bytes=param_bytes
  )


_METHODS = {'ours': 'fdt', 'peer': 'orbax'}
_NOTES = {
  'serve': 'export without gradients; bytes: the SavedModel on disk',
  'trainable': 'export with the gradient (every Param trainable); bytes: '
  'the SavedModel on disk',
  'again': 'the second export of the same model with new weights, into a '
  'new directory (the first untimed)',
}


def _case(model, export, mib=0):
  params = {'model': model, 'export': export}
  if mib:
    params['mib'] = mib
  return harness.case(
    'saved_model',
    params,
    _METHODS,
    [('ours', 'peer')],
    note=f'{model}: {_NOTES[export]}',
  )


CASES = {'saved_model': saved_model}


def full():
  return {
    'saved_model': [
      _case(model, export, mib)
      for model, mib in (('demo', 0), ('stack', 128))
      for export in ('serve', 'trainable', 'again')
    ]
  }


def quick():
  return {
    'saved_model': [
      _case('demo', export) for export in ('serve', 'trainable', 'again')
    ]
  }
