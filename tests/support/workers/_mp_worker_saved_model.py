"""Worker of multiprocess_saved_model_test.py: TF exports from 2 processes.

Usage (through multiprocess_util.run_workers): _mp_worker_saved_model.py
OUT_DIR. Every process builds the same model on a transposed (2, 4) mesh
over both processes' devices (each mesh row mixes them), then, together:

- writes ONE SavedModel (gathered onto process 0, which writes it), and
  process 0 saves the input batch and the JAX output for the parent;
- tries a SavedModel over the size limit, one that fails on process 0 only
  (a wrong input signature, traced there alone) and one into an existing
  directory: every process must raise, none left waiting;
- writes a SavedModel of a model whose forward is written for Explicit
  axes, on `jax.make_mesh`'s default mesh over both processes, with a
  polymorphic batch; process 0 saves its input and JAX's output;
- has TF change every DVariable and brings them back with from_tf_module
  onto the row-major mesh (each process reads its own components; JAX moves
  the rest), and saves a single-mesh checkpoint and restores it.

Prints one JSON line starting with 'RESULT '.
"""

from support import multiprocess_util

multiprocess_util.initialize_jax()

# ruff: noqa: E402
import json
import os
import sys

import jax

import flax_dtensor as fdt
import flax_dtensor.dtensor as fdt_tf

fdt_tf.initialize()  # Before any other TF op.

import numpy as np
import tensorflow as tf
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _part(names):
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


class Net(nnx.Module):
  """A sharded MLP: a dimension over both axes, batch norm, dropout."""

  def __init__(self, rngs):
    self.up = nnx.Linear(
      64, 128, kernel_init=_part(('data', 'model')), rngs=rngs
    )
    self.norm = nnx.BatchNorm(128, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.down = nnx.Linear(
      128, 16, kernel_init=_part((('data', 'model'), None)), rngs=rngs
    )

  def __call__(self, x):
    return self.down(self.drop(self.norm(jax.nn.gelu(self.up(x)))))

  def predict(self, x):
    logits = self(x)
    return {'logits': logits, 'probs': jax.nn.softmax(logits)}


class ExplicitNet(nnx.Module):
  """A forward written for Explicit axes: the batch over 'data', each
  matmul told where its result goes (the second contracts 'mlp')."""

  def __init__(self, rngs):
    self.up = nnx.Linear(
      64, 128, kernel_init=_part(('embed', 'mlp')), rngs=rngs
    )
    self.down = nnx.Linear(
      128, 16, kernel_init=_part(('mlp', 'embed')), rngs=rngs
    )

  def __call__(self, x):
    x = jax.sharding.reshard(x, P('data', None))
    h = jax.nn.gelu(self.up(x, out_sharding=P('data', 'model')))
    return self.down(h, out_sharding=P('data', None))


def _mesh(kind):
  devices = np.asarray(jax.devices())
  devices = devices.reshape(4, 2).T if kind == 'transposed' else devices
  return jax.sharding.Mesh(
    devices.reshape(2, 4),
    ('data', 'model'),
    axis_types=(jax.sharding.AxisType.Auto,) * 2,
  )


def _global(x, mesh):
  """The same host array on every process, as one replicated global array."""
  return jax.device_put(x, NamedSharding(mesh, P()))


def _gathered(x):
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _flat(module, kind=...):
  return {
    '/'.join(map(str, p)): v.get_value()
    for p, v in nnx.to_flat_state(nnx.state(module, kind))
  }


def _error(call):
  try:
    call()
  except Exception as e:  # Reported to the parent, which checks the type.
    return [type(e).__name__, str(e)]
  return None


def main():
  out_dir = sys.argv[1]
  pid = jax.process_index()
  mesh = _mesh('transposed')
  rng = np.random.default_rng(0)
  with jax.set_mesh(mesh):
    model = Net(nnx.Rngs(0, dropout=1))
    # Batch statistics move away from their initial values.
    model(_global(rng.standard_normal((32, 64)).astype(np.float32) * 2, mesh))
  assert not model.up.kernel.get_value().is_fully_addressable
  serving = nnx.view(model, deterministic=True, use_running_average=True)
  x = rng.standard_normal((5, 64)).astype(np.float32)
  with jax.set_mesh(mesh):
    want = _gathered(serving.predict(_global(x, mesh))['logits'])
  if pid == 0:
    np.save(os.path.join(out_dir, 'x.npy'), x)
    np.save(os.path.join(out_dir, 'want.npy'), want)

  signature = [tf.TensorSpec([None, 64], tf.float32, name='features')]
  sm = os.path.join(out_dir, 'sm')
  path = fdt_tf.save_saved_model(
    serving, sm, input_signature=signature, method='predict'
  )
  param_bytes = sum(
    int(np.prod(v.shape)) * v.dtype.itemsize
    for v in _flat(model, (nnx.Param, nnx.BatchStat)).values()
  )
  too_big = _error(
    lambda: fdt_tf.save_saved_model(
      serving,
      os.path.join(out_dir, 'too_big'),
      input_signature=signature,
      max_gather_bytes=param_bytes // 2,
    )
  )
  # Traced on process 0 only: the others learn of the failure.
  broken = _error(
    lambda: fdt_tf.save_saved_model(
      serving,
      os.path.join(out_dir, 'broken'),
      input_signature=[tf.TensorSpec([None, 32], tf.float32)],
    )
  )
  exists = _error(
    lambda: fdt_tf.save_saved_model(serving, sm, input_signature=signature)
  )

  # jax.make_mesh's default mesh (every axis Explicit) over both processes.
  explicit = jax.make_mesh((2, 4), ('data', 'model'))
  x8 = rng.standard_normal((8, 64)).astype(np.float32)
  with (
    jax.set_mesh(explicit),
    fdt.logical_axis_rules([('embed', None), ('mlp', 'model')]),
  ):
    net = ExplicitNet(nnx.Rngs(3))
    explicit_want = _gathered(net(_global(x8, explicit)))
    fdt_tf.save_saved_model(
      net, os.path.join(out_dir, 'explicit_sm'), input_signature=signature
    )
  if pid == 0:
    np.save(os.path.join(out_dir, 'x8.npy'), x8)
    np.save(os.path.join(out_dir, 'explicit_want.npy'), explicit_want)

  # TF changes every variable; from_tf_module brings them back onto the
  # row-major mesh, whose shards other processes' components hold.
  tf_module = fdt_tf.to_tf_module(model, include=(nnx.Param, nnx.BatchStat))
  for v in tf_module.variables:
    v.assign(v.read_value() * 2 + 1)
  expected = {
    k: _gathered(v) * 2 + 1
    for k, v in _flat(model, (nnx.Param, nnx.BatchStat)).items()
  }
  row_major = _mesh('row_major')
  with jax.set_mesh(row_major):
    abstract = nnx.eval_shape(lambda: Net(nnx.Rngs(5, dropout=6)))
  back = fdt_tf.from_tf_module(tf_module, abstract, mesh=row_major, rng_seed=0)
  from_tf_mismatched = []
  for name, v in _flat(back, (nnx.Param, nnx.BatchStat)).items():
    assert v.sharding.mesh == row_major, name
    if not np.array_equal(_gathered(v), expected[name]):
      from_tf_mismatched.append(name)

  # One DTensor mesh for every variable, across processes.
  ckpt, report = fdt_tf.save_checkpoint(
    model, os.path.join(out_dir, 'ckpt'), single_mesh=True
  )
  with jax.set_mesh(mesh):
    abstract = nnx.eval_shape(lambda: Net(nnx.Rngs(7, dropout=8)))
  restored = fdt_tf.restore_checkpoint(ckpt, abstract, mesh=mesh, rng_seed=0)
  original = _flat(model, (nnx.Param, nnx.BatchStat))
  single_mesh_mismatched = [
    name
    for name, v in _flat(restored, (nnx.Param, nnx.BatchStat)).items()
    if not np.array_equal(_gathered(v), _gathered(original[name]))
  ]

  result = {
    'process': pid,
    'path': path,
    'too_big': too_big,
    'broken': broken,
    'exists': exists,
    'from_tf_mismatched': from_tf_mismatched,
    'relaid': [(r.path, str(r.spec)) for r in report.relaid],
    'single_mesh_mismatched': single_mesh_mismatched,
    'down_spec': str(restored.down.kernel.get_value().sharding.spec),
    'listing': sorted(os.listdir(out_dir)),
  }
  print('RESULT ' + json.dumps(result), flush=True)
  multihost_utils.sync_global_devices('worker-done')


if __name__ == '__main__':
  main()
