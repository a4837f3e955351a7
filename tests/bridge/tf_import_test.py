"""TensorFlow's import-time noise is dropped at the descriptor level."""

import os
import sys

import pytest
from support import processes, warm

from flax_dtensor.dtensor import _tf

ONEDNN = (
  'I0000 00:00:1795374549.070362    2500 port.cc:153] oneDNN custom '
  'operations are on. You may see slightly different numerical results.\n'
)
ABSL = (
  'WARNING: All log messages before absl::InitializeLog() is called are '
  'written to STDERR\n'
)


def test_start_up_noise_is_dropped_and_the_rest_kept(capfd):
  with _tf.cpp_noise_dropped():
    os.write(2, ABSL.encode())
    os.write(2, ONEDNN.encode())
    os.write(2, b'E0000 00:00:1.0  1 x.cc:1] a real error\n')
    print('python-level line', file=sys.stderr)
  err = capfd.readouterr().err
  assert 'oneDNN' not in err and 'absl::InitializeLog' not in err
  assert 'a real error' in err and 'python-level line' in err


def test_our_messages_stay_live_and_nested_blocks_capture_once(capfd):
  """Within a block our own output goes to the real stderr at once (a
  restore's progress bar); what others wrote there comes after, once the
  outermost block ends, and TF's noise never."""
  from flax_dtensor import _output

  with _tf.cpp_noise_dropped():
    _output.stream().write('ours, live\n')
    _output.stream().flush()
    with _tf.cpp_noise_dropped():
      os.write(2, ONEDNN.encode())
      os.write(2, b'inner\n')
    assert capfd.readouterr().err == 'ours, live\n'  # Not yet the others'.
    os.write(2, b'outer\n')
  assert _output.stream() is sys.stderr  # The routing is undone.
  assert capfd.readouterr().err == 'inner\nouter\n'


def test_importing_tensorflow_through_flax_dtensor_prints_nothing():
  code = (
    'from flax_dtensor.dtensor import _tf\n'
    'tf = _tf.tf()\n'
    'print(tf.constant(2.0).numpy() * 2)\n'
  )
  proc = processes.run_python('-c', code)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip() == '4.0'
  assert 'oneDNN' not in proc.stderr
  assert 'absl::InitializeLog' not in proc.stderr


# A user's program that imports TensorFlow itself, before flax_dtensor: TF
# has read TF_CPP_MIN_LOG_LEVEL (unset) and printed its start-up lines
# already. After the mark, `initialize()` must keep TF's lines away, and our
# own (`progress=True`) must come through.
TF_FIRST = """
import os, sys, tempfile
import tensorflow as tf
os.write(2, b'MARK\\n')
import jax
jax.config.update('jax_num_cpu_devices', 8)
from flax import nnx
import flax_dtensor as fdt
from flax_dtensor import dtensor as fdt_dt

fdt_dt.initialize()
mesh = jax.make_mesh((2, 4), ('data', 'model'))
init = nnx.with_partitioning(nnx.initializers.ones, ('embed', 'mlp'))
with jax.set_mesh(mesh), fdt.logical_axis_rules(
    [('embed', 'data'), ('mlp', 'model')]):
  model = nnx.Linear(8, 16, kernel_init=init, rngs=nnx.Rngs(0))
out = tempfile.mkdtemp()
fdt_dt.save_checkpoint(model, out + '/ckpt', progress=True)
fdt_dt.save_saved_model(model, out + '/sm', progress=True,
                        input_signature=[tf.TensorSpec([None, 8], tf.float32)])
print('saved', float(fdt_dt.read_checkpoint(out + '/ckpt')[('kernel',)].sum()))
"""

# The lines issue reports name; what TF prints differs by host (NOTES.md),
# so only their absence is asserted, and the control run shows that the
# DTensor ones do appear on this host when nothing keeps them away.
TF_LINES = (
  'absl::InitializeLog',
  'cpu_feature_guard',
  'cache key lookup missed',
)


# What the user's program had imported before flax_dtensor, in its order:
# TensorFlow first, with TF_CPP_MIN_LOG_LEVEL unset, then JAX and Flax. A
# pool of forks that imported these once (and neither flax_dtensor, the
# subject, nor TF's runtime or JAX's backend, which each fork starts).
TF_FIRST_IMPORTS = ('numpy', 'tensorflow', 'jax', 'jax.numpy', 'flax.nnx')


@pytest.fixture(scope='module')
def tf_first_pool():
  pool = warm.Pool(
    TF_FIRST_IMPORTS,
    env=processes.clean_env(
      TF_CPP_MIN_LOG_LEVEL=None,
      XLA_FLAGS=None,
      OPENBLAS_NUM_THREADS='1',
      OMP_NUM_THREADS='1',
    ),
  )
  yield pool
  pool.close()


def _run_tf_first(pool, **env):
  """TF_FIRST in a fork of `pool`: what it wrote to stderr after the mark.

  TensorFlow read TF_CPP_MIN_LOG_LEVEL (unset) at its import, in the pool;
  the script's own environment is what flax_dtensor then reads, as a
  program's that set the variable after importing TensorFlow (unset and
  '0' are the same level to TensorFlow's C++ logging).
  """
  env = processes.clean_env(**{'TF_CPP_MIN_LOG_LEVEL': None, **env})
  proc = pool.run_code(TF_FIRST, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.strip() == 'saved 128.0'
  return proc.stderr.partition('MARK\n')[2]


def test_initialize_quiets_tensorflow_imported_before_flax_dtensor(
  tf_first_pool,
):
  """Two programs that import TensorFlow first (what the test is about:
  nothing of ours imported before it), each writing a SavedModel: forks of
  a pool that imported TensorFlow, JAX and Flax as they do."""
  after = _run_tf_first(tf_first_pool)
  for line in TF_LINES:
    assert line not in after, after
  # Our own messages come through.
  assert 'flax_dtensor: tracing and writing a SavedModel' in after, after
  # The user's own setting stands: with TF_CPP_MIN_LOG_LEVEL=0 TF's INFO
  # lines stay (and prove that there is something to keep away).
  assert 'cache key lookup missed' in _run_tf_first(
    tf_first_pool, TF_CPP_MIN_LOG_LEVEL='0'
  )
