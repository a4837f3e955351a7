"""Worker of scale_runs.py: one model saved and restored across process counts.

Usage (through multiprocess_util.run_workers, without DTENSOR_* variables):
_mp_worker_scale.py ROOT two|four. `initialize()` sets DTensor up from JAX
alone. Prints 'RESULT ' JSON lines as it goes (merged by scale_runs):

- two (2 processes, 4 devices each, a (2, 4) mesh): saves the model in
  the background to ROOT/c2 and donates every array saved at once; saves
  it blocking to ROOT/c2_blocking while that save is pending (TF's
  collectives on this thread, the background save's barriers on its own);
  restores ROOT/c2 onto another layout with the save still pending (the
  restore waits for it); and exits with a background save to
  ROOT/c2_exit pending (the interpreter waits for it).
- four (4 processes, 2 devices each, a (4, 2) mesh): restores ROOT/c2
  onto the new mesh shape and onto another layout, counting the bytes each
  process reads (/proc/self/io); saves the restored model in the
  background to ROOT/c4, and exports it as a SavedModel to ROOT/s4; then
  overwrites ROOT/c4 in the background while process `scale_runs.DEAD` is
  killed once its bundle is written: every other process's `wait()` must
  raise, naming it. The survivors leave at once (JAX's shutdown would wait
  for the dead process).
"""

from support import multiprocess_util

multiprocess_util.initialize_jax()

# ruff: noqa: E402
import json
import os
import sys
import time

import jax

import flax_dtensor.dtensor as fdt_tf

fdt_tf.initialize()  # No DTENSOR_* variable: set from JAX.

import tensorflow as tf
from flax import nnx
from support import scale_runs

import flax_dtensor as fdt


def report(**values):
  print('RESULT ' + json.dumps(values), flush=True)


def make_mesh(shape):
  return jax.make_mesh(
    shape, ('data', 'model'), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )


def restore(path, target):
  """Restores `target`: what it holds, and the bytes read for `w` alone."""
  before = scale_runs.rchar()
  fdt_tf.restore_checkpoint(path, target, include=nnx.PathContains('w'))
  read_w = scale_runs.rchar() - before
  fdt_tf.restore_checkpoint(path, target)
  return {
    'read_w': read_w,
    'held_w': scale_runs.held(target, 'w'),
    'mismatched': scale_runs.mismatched(target, 1),
  }


def two(root):
  mesh = make_mesh((2, 4))
  c2 = os.path.join(root, 'c2')
  saved = scale_runs.model(mesh, 1)
  start = time.perf_counter()
  handle = fdt_tf.save_checkpoint(saved, c2, blocking=False)
  stall = time.perf_counter() - start
  # Training goes on at once: every array saved is donated to a step.
  step = jax.jit(lambda x: x + 1, donate_argnums=0)
  donated = []
  for name in scale_runs.VARIABLES:
    variable = getattr(saved, name)
    old = variable[...]
    variable.set_value(step(old))
    donated.append(old.is_deleted())
  # A blocking save (TF collectives on this thread) beside the pending one.
  fdt_tf.save_checkpoint(
    scale_runs.model(mesh, 1), os.path.join(root, 'c2_blocking')
  )
  # A restore of the path waits for the pending save to it.
  other = scale_runs.model(mesh, 0, scale_runs.SWAPPED)
  fdt_tf.restore_checkpoint(c2, other)
  report(
    process=jax.process_index(),
    jobs=os.environ.get('DTENSOR_JOBS'),
    client_id=os.environ.get('DTENSOR_CLIENT_ID'),
    job_name=os.environ.get('DTENSOR_JOB_NAME'),
    stall=stall,
    donated=donated,
    done_before_restore_returned=handle.done(),
    result=handle.result(),
    restored_mismatched=scale_runs.mismatched(other, 1),
  )
  # Left pending: the interpreter waits for it at exit.
  fdt_tf.save_checkpoint(
    scale_runs.model(mesh, 1),
    os.path.join(root, 'c2_exit'),
    blocking=False,
  )


def four(root):
  mesh = make_mesh((4, 2))
  c2 = os.path.join(root, 'c2')
  report(
    process=jax.process_index(),
    jobs=os.environ.get('DTENSOR_JOBS'),
    client_id=os.environ.get('DTENSOR_CLIENT_ID'),
  )
  report(restore_same=restore(c2, scale_runs.model(mesh, 0)))
  swapped = scale_runs.model(mesh, 0, scale_runs.SWAPPED)
  report(restore_swapped=restore(c2, swapped))
  fdt_tf.save_checkpoint(swapped, os.path.join(root, 'c4'), blocking=False)
  fdt_tf.save_saved_model(
    swapped,
    os.path.join(root, 's4'),
    input_signature=[tf.TensorSpec([None, 1024], tf.float32)],
  )
  report(saved=True)
  # Process DEAD dies once its part of the overwrite is written.
  if jax.process_index() == scale_runs.DEAD:
    multiprocess_util.die_when(
      os.path.join(root, '.c4.tmp-*', '.parts', f'process{scale_runs.DEAD}-*')
    )
  start = time.monotonic()
  handle = fdt_tf.save_checkpoint(
    scale_runs.model(mesh, 2),
    os.path.join(root, 'c4'),
    overwrite=True,
    blocking=False,
  )
  error = kind = None
  try:
    handle.wait()
  except fdt.ExportError as e:
    error, kind = str(e), type(e).__name__
  report(
    dead_peer={
      'error': error,
      'kind': kind,
      'seconds': time.monotonic() - start,
    }
  )
  os._exit(0)


if __name__ == '__main__':
  {'two': two, 'four': four}[sys.argv[2]](sys.argv[1])
