"""Worker of multiprocess_export_test.py: one checkpoint from 2 processes.

Usage (through multiprocess_util.run_workers): _mp_worker_export.py OUT_DIR
MESH_KIND. Every process builds the same model on a (2, 4) mesh over both
processes' devices (4 each), saves ONE checkpoint with all of them, checks
that a second save and a process-local array are refused on every process,
restores the checkpoint onto another layout, and overwrites it. Process 0
writes the global values (gathered with process_allgather) to
OUT_DIR/expected.npz for the parent to compare with a plain TF read. Prints
one JSON line starting with 'RESULT '.
"""

from support import multiprocess_util

multiprocess_util.initialize_jax()

# ruff: noqa: E402
import json
import os
import sys

import jax

import flax_dtensor.dtensor as fdt_tf

fdt_tf.initialize()  # Before any other TF op.

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

import flax_dtensor as fdt


def _part(names):
  return nnx.with_partitioning(nnx.initializers.normal(1.0), names)


class Model(nnx.Module):
  """Sharded layers plus odd dtypes (widened in checkpoints) and a scalar."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(
      16, 32, embedding_init=_part(('model', 'data')), rngs=rngs
    )
    self.dense = nnx.Linear(
      32,
      64,
      kernel_init=_part(('data', 'model')),
      bias_init=_part(('model',)),
      rngs=rngs,
    )
    self.out = nnx.Linear(
      64,
      8,
      kernel_init=_part(('model', None)),
      param_dtype=jnp.bfloat16,
      rngs=rngs,
    )
    self.drop = nnx.Dropout(0.1, rngs=rngs)
    self.half = nnx.Param(
      jax.random.normal(rngs.params(), (8, 32), jnp.float16),
      out_sharding=('data', 'model'),
    )
    self.counts = nnx.Param(
      jax.random.bits(rngs.params(), (16, 4), jnp.uint32),
      out_sharding=(('data', 'model'), None),
    )
    self.step = nnx.Param(jnp.asarray(7, jnp.int32))


def _mesh(kind):
  devices = np.asarray(jax.devices())
  if kind == 'transposed':
    # Each mesh row mixes both processes' devices.
    devices = devices.reshape(4, 2).T
  else:
    devices = devices.reshape(2, 4)
  return jax.sharding.Mesh(
    devices, ('data', 'model'), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )


def _flat(module):
  state = nnx.state(module, nnx.Param)
  return {
    '/'.join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)
  }


def _npz_safe(x):
  return x.astype(np.float32) if x.dtype == jnp.bfloat16 else x


def main():
  out_dir, kind = sys.argv[1], sys.argv[2]
  pid = jax.process_index()
  mesh = _mesh(kind)
  with jax.set_mesh(mesh):
    model = Model(nnx.Rngs(0))
  values = _flat(model)
  assert not values['dense/kernel'].is_fully_addressable
  assert values['dense/kernel'].sharding.spec == P('data', 'model')

  ckpt = os.path.join(out_dir, 'ckpt')
  if kind == 'transposed':
    # Each process writes several bundles at once (at least 2: the pool
    # has 2 threads or more), all merged into the one checkpoint.
    from flax_dtensor.dtensor._storage import _host_write

    _host_write.PART_BYTES = 256
  path = fdt_tf.save_checkpoint(model, ckpt)
  assert path == ckpt, path

  # Refused consistently on every process (no process left waiting).
  refused = False
  try:
    fdt_tf.save_checkpoint(model, ckpt)
  except fdt.ExportError as e:
    refused = 'already exists' in str(e)

  expected = {
    name: np.asarray(multihost_utils.process_allgather(v, tiled=True))
    for name, v in values.items()
  }
  if pid == 0:
    # .npz has no bfloat16: store it as float32 (exact), dtypes aside.
    np.savez(
      os.path.join(out_dir, 'expected.npz'),
      **{k: _npz_safe(v) for k, v in expected.items()},
    )
    with open(os.path.join(out_dir, 'expected_dtypes.json'), 'w') as f:
      json.dump({k: str(v.dtype) for k, v in expected.items()}, f)

  # Restore onto the other mesh layout: each process reads its own slices.
  other = _mesh('transposed' if kind != 'transposed' else 'default')
  with jax.set_mesh(other):
    abstract = nnx.eval_shape(lambda: Model(nnx.Rngs(1)))
    restored = fdt_tf.restore_checkpoint(ckpt, abstract, rng_seed=0)
  restored_values = _flat(restored)
  mismatched = []
  for name, v in restored_values.items():
    assert v.sharding.mesh == other, name
    gathered = np.asarray(multihost_utils.process_allgather(v, tiled=True))
    want = expected[name]
    if gathered.dtype != want.dtype or gathered.tobytes() != want.tobytes():
      mismatched.append(name)
  spec = restored_values['embed/embedding'].sharding.spec

  # An array on this process's devices only is refused on every process
  # alike (rather than leaving the others waiting in a collective).
  local = nnx.State({'w': nnx.Param(jnp.ones(4))})
  local_error = ''
  try:
    fdt_tf.save_checkpoint(local, os.path.join(out_dir, 'local'))
  except fdt.ExportError as e:
    local_error = str(e)

  # Overwrite from every process.
  with jax.set_mesh(mesh):
    model.step.set_value(jnp.asarray(8, jnp.int32))
  fdt_tf.save_checkpoint(model, ckpt, overwrite=True)
  leftovers = sorted(n for n in os.listdir(out_dir) if n.startswith('.'))

  result = {
    'process': pid,
    'processes': jax.process_count(),
    'devices': jax.device_count(),
    'local_devices': jax.local_device_count(),
    'refused': refused,
    'mismatched': mismatched,
    'restored_spec': str(spec),
    'leftovers': leftovers,
    'local_error': local_error,
    'files': sorted(os.listdir(ckpt)),
  }
  print('RESULT ' + json.dumps(result), flush=True)
  multihost_utils.sync_global_devices('worker-done')


if __name__ == '__main__':
  main()
