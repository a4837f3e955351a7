"""Worker of multiprocess_manager_test.py: a loop told it will be preempted.

Usage (through multiprocess_util.run_workers): _mp_worker_preempted.py
RUN_DIR. Every process builds the same two variables on a (2, N) mesh over
all processes' devices and takes one exact step at a time (+1), asking the
manager to save each (its interval, 10**6 steps, is never due). At step 5,
process 1 alone receives SIGTERM, as a scheduler's notice reaches one host;
JAX's preemption service tells every process, which then agree on the step
to save at (`reached_preemption`), save it, and stop. Prints one JSON line
starting with 'RESULT '.
"""

from support import multiprocess_util, processes

multiprocess_util.initialize_jax()

# ruff: noqa: E402
import json
import os
import signal
import sys
import time

import jax

import flax_dtensor.dtensor as fdt_dt

fdt_dt.initialize()  # Before any other TF op.


run_dir = sys.argv[1]
model = multiprocess_util.zeros_model()
manager = fdt_dt.CheckpointManager(
  run_dir, save_interval_steps=10**6, save_on_preemption=True
)
step_up = jax.jit(lambda x: x + 1.0)
saved_at = None
for step in range(1, 2000):  # About 10 s; JAX's sync takes about 1 s.
  model['w'].set_value(step_up(model['w'].get_value()))
  model['b'].set_value(step_up(model['b'].get_value()))
  if step == 5 and jax.process_index() == 1:
    os.kill(os.getpid(), signal.SIGTERM)
  if manager.save(step, model):
    saved_at = step
    break
  time.sleep(0.005)  # The notice travels while the loop goes on.
manager.close()
print(
  processes.RESULT
  + json.dumps(
    {
      'process': jax.process_index(),
      'saved_at': saved_at,
      'steps': manager.all_steps(),
    }
  ),
  flush=True,
)
