"""TensorFlow's import-time noise is dropped at the descriptor level."""

import os
import subprocess
import sys

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
  with _tf._start_up_noise_dropped():
    os.write(2, ABSL.encode())
    os.write(2, ONEDNN.encode())
    os.write(2, b'E0000 00:00:1.0  1 x.cc:1] a real error\n')
    print('python-level line', file=sys.stderr)
  err = capfd.readouterr().err
  assert 'oneDNN' not in err and 'absl::InitializeLog' not in err
  assert 'a real error' in err and 'python-level line' in err


def test_importing_tensorflow_through_flax_dtensor_prints_nothing():
  code = (
    'from flax_dtensor.dtensor import _tf\n'
    'tf = _tf.tf()\n'
    'print(tf.constant(2.0).numpy() * 2)\n'
  )
  proc = subprocess.run(
    [sys.executable, '-c', code],
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip() == '4.0'
  assert 'oneDNN' not in proc.stderr
  assert 'absl::InitializeLog' not in proc.stderr
