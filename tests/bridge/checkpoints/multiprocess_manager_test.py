"""`CheckpointManager` in a multi-process run, resumed on another count.

Two processes (4 CPU devices each) save steps 1 to 3 with the manager;
four processes (2 devices each) resume from its latest whole step and go on
to step 5; then this process (8 devices) restores the latest step, and
plain TensorFlow reads it, each with the values of an uninterrupted run.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support import multiprocess_util, processes

import flax_dtensor.dtensor as fdt_dt

WORKER = processes.WORKERS_DIR / '_mp_worker_manager.py'


def _run(run_dir, processes_, last):
  outputs = multiprocess_util.run_workers(
    WORKER,
    processes_,
    args=[str(run_dir), str(last)],
    timeout=300,
    devices_per_process=8 // processes_,
  )
  return [
    processes.result(out, context=f'(worker {i})')
    for i, out in enumerate(outputs)
  ]


@pytest.mark.multiprocess
def test_a_run_saved_by_two_processes_resumes_on_four_and_on_one(tmp_path):
  run_dir = tmp_path / 'run'
  first = _run(run_dir, 2, 3)
  assert [(r['process'], r['start'], r['b']) for r in first] == [
    (0, 1, 3.0),
    (1, 1, 3.0),
  ]
  assert all(r['steps'] == [2, 3] for r in first)
  again = _run(run_dir, 4, 5)
  assert [(r['start'], r['b']) for r in again] == [(4, 5.0)] * 4
  assert all(r['steps'] == [4, 5] for r in again)
  # One process of 8 devices, on another layout.
  mesh = jax.make_mesh((4, 2), ('data', 'model'))
  target = nnx.Dict(
    w=nnx.Param(
      jax.device_put(
        jnp.zeros((8, 16)), NamedSharding(mesh, P('model', 'data'))
      )
    ),
    b=nnx.Param(
      jax.device_put(jnp.zeros((16,)), NamedSharding(mesh, P('data')))
    ),
  )
  manager = fdt_dt.CheckpointManager(run_dir)
  assert manager.latest_step() == 5
  manager.restore(target)
  np.testing.assert_array_equal(
    target['w'].get_value(), np.full((8, 16), 5.0, np.float32)
  )
  np.testing.assert_array_equal(
    target['b'].get_value(), np.full((16,), 5.0, np.float32)
  )
  assert target['w'].get_value().sharding == NamedSharding(
    mesh, P('model', 'data')
  )
  reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(run_dir)))
  np.testing.assert_array_equal(
    reader.get_tensor(fdt_dt.checkpoint_key('b')),
    np.full((16,), 5.0, np.float32),
  )


PREEMPTED = processes.WORKERS_DIR / '_mp_worker_preempted.py'


@pytest.mark.multiprocess
def test_a_preemption_notice_to_one_process_saves_one_step_on_all(tmp_path):
  """SIGTERM reaches process 1 alone; both agree on a step, save it whole
  and stop; one process then resumes there with the run's values."""
  run_dir = tmp_path / 'run'
  outputs = multiprocess_util.run_workers(
    PREEMPTED, 2, args=[str(run_dir)], timeout=300, devices_per_process=4
  )
  results = [
    processes.result(out, context=f'(worker {i})')
    for i, out in enumerate(outputs)
  ]
  (step,) = {r['saved_at'] for r in results}
  assert step is not None and step > 5
  # Saved at the step they agreed on, and only there.
  assert [(r['process'], r['steps']) for r in results] == [
    (0, [step]),
    (1, [step]),
  ]
  # Resumed on one process of 8 devices, on another layout.
  mesh = jax.make_mesh((4, 2), ('data', 'model'))
  target = nnx.Dict(
    w=nnx.Param(
      jax.device_put(
        jnp.zeros((8, 16)), NamedSharding(mesh, P('model', 'data'))
      )
    ),
    b=nnx.Param(jax.device_put(jnp.zeros((16,)), NamedSharding(mesh, P()))),
  )
  manager = fdt_dt.CheckpointManager(run_dir)
  assert manager.latest_step() == step
  manager.restore(target)
  np.testing.assert_array_equal(
    target['w'].get_value(), np.full((8, 16), step, np.float32)
  )
  np.testing.assert_array_equal(
    target['b'].get_value(), np.full((16,), step, np.float32)
  )
  reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(run_dir)))
  np.testing.assert_array_equal(
    reader.get_tensor(fdt_dt.checkpoint_key('w')),
    np.full((8, 16), step, np.float32),
  )
