"""Worker of the dead-peer run (fault_runs.py): process 1 dies mid-save.

Usage (through multiprocess_util.run_workers, with may_die=[1]):
_mp_worker_dead_peer.py OUT_DIR MOMENT. Both processes save version 1 of a
model sharded over both; then they overwrite it with version 2, and process
1 kills itself (SIGKILL; a thread watches the files) at MOMENT:

- 'in-write': as soon as the save's temporary directory exists, before or
  while it writes its shards; process 0 writes its own and is left waiting
  for it at our barrier, bounded by FLAX_DTENSOR_PEER_TIMEOUT (the run sets
  it);
- 'at-barrier': as soon as its own part of the manifest appears, its shards
  written, so process 0 is left waiting for it at that barrier;
- 'in-restore': instead of overwriting, both restore version 1 into a
  target of other values, and process 1 dies as its restore begins;
  process 0 reads its part and then waits for process 1 to confirm its own.

Either way process 0 must fail in our words, naming process 1, long before
JAX's own heartbeat timeout (100 s) would abort it; a restore must leave
its target unchanged; and after a failed save, it reads the checkpoint
back with plain TF (`read_after`, the sum of its values): its TensorFlow
still works.
Process 0 prints one
JSON line starting with 'RESULT ', then leaves at once: at exit, JAX's
shutdown would wait for the dead process until its heartbeat timeout.
"""

from support import multiprocess_util

multiprocess_util.initialize_jax()

# ruff: noqa: E402
import json
import os
import signal
import sys

import jax

import flax_dtensor.dtensor as fdt_tf

fdt_tf.initialize()  # Before any other TF op; starts the heartbeat.

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_dtensor as fdt

VARIABLES = 8
SHAPE = (8, 256)


def values(version):
  """Variable i of `version`, as the parent computes it too."""
  return {
    f'v{i}': jnp.arange(SHAPE[0] * SHAPE[1], dtype=jnp.float32).reshape(SHAPE)
    + 1000 * version
    + i
    for i in range(VARIABLES)
  }


def model(mesh, version):
  sharding = NamedSharding(mesh, P('data', 'model'))
  return nnx.Dict(
    {
      name: nnx.Param(jax.device_put(value, sharding))
      for name, value in values(version).items()
    }
  )


def restore(mesh, ckpt, out_dir):
  """Process 1 dies as the restore begins; process 0 reports and leaves."""
  other = jax.make_mesh((2, 4), ('model', 'data'))  # Another layout.
  target = model(other, 7)
  if jax.process_index() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
  result = {'process': 0, 'error': None}
  try:
    fdt_tf.restore_checkpoint(ckpt, target)
  except fdt.ExportError as e:
    result['error'] = str(e)
    result['kind'] = type(e).__name__
  sevens = values(7)
  result['unchanged'] = all(
    np.array_equal(
      np.asarray(shard.data), np.asarray(sevens[name])[shard.index]
    )
    for name, variable in target.items()
    for shard in variable[...].addressable_shards
  )
  result['listing'] = sorted(os.listdir(out_dir))
  print('RESULT ' + json.dumps(result), flush=True)
  os._exit(0)


def main():
  out_dir = sys.argv[1]
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  ckpt = os.path.join(out_dir, 'ckpt')
  fdt_tf.save_checkpoint(model(mesh, 1), ckpt)
  new = model(mesh, 2)
  if sys.argv[2] == 'in-restore':
    restore(mesh, ckpt, out_dir)
  if jax.process_index() == 1:
    tmp = os.path.join(out_dir, '.ckpt.tmp-*')
    if sys.argv[2] == 'in-write':
      multiprocess_util.die_when(tmp)
    else:
      multiprocess_util.die_when(os.path.join(tmp, 'flax_dtensor.part-1.json'))
  result = {'process': jax.process_index(), 'error': None}
  try:
    fdt_tf.save_checkpoint(new, ckpt, overwrite=True)
  except fdt.ExportError as e:
    result['error'] = str(e)
    result['kind'] = type(e).__name__
  result['listing'] = sorted(os.listdir(out_dir))
  # Plain TF, this process alone (no other process to meet).
  reader = sys.modules['tensorflow'].train.load_checkpoint(ckpt)
  result['read_after'] = float(
    sum(
      reader.get_tensor(fdt_tf.checkpoint_key(name)).sum() for name in values(1)
    )
  )
  print('RESULT ' + json.dumps(result), flush=True)
  os._exit(0)


if __name__ == '__main__':
  main()
