"""Worker of manager_test.py: a training loop saving with CheckpointManager.

Usage (through multiprocess_util.run_workers): _mp_worker_manager.py RUN_DIR
LAST_STEP. Every process builds the same two variables on a (2, N) mesh over
all processes' devices, resumes from the manager's latest whole step if
there is one, then takes one exact step at a time (+1) up to LAST_STEP,
saving each in the background. Prints one JSON line starting with 'RESULT '.
"""

from support import multiprocess_util, processes

multiprocess_util.initialize_jax()

# ruff: noqa: E402
import json
import sys

import jax
import numpy as np

import flax_dtensor.dtensor as fdt_dt

fdt_dt.initialize()  # Before any other TF op.


run_dir, last = sys.argv[1], int(sys.argv[2])
model = multiprocess_util.zeros_model()
manager = fdt_dt.CheckpointManager(run_dir, max_to_keep=2)
start = (manager.latest_step() or 0) + 1
if start > 1:
  manager.restore(model)
step_up = jax.jit(lambda x: x + 1.0)
for step in range(start, last + 1):
  model['w'].set_value(step_up(model['w'].get_value()))
  model['b'].set_value(step_up(model['b'].get_value()))
  manager.save(step, model)
manager.close()
print(
  processes.RESULT
  + json.dumps(
    {
      'process': jax.process_index(),
      'start': start,
      'steps': manager.all_steps(),
      'b': float(np.asarray(model['b'].get_value().addressable_data(0))[0]),
    }
  ),
  flush=True,
)
