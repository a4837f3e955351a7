"""Two local processes save ONE checkpoint; plain single-process TF reads it.

Each worker (tests/support/workers/_mp_worker_export.py, started by
multiprocess_util) runs jax.distributed on 127.0.0.1 with 4 CPU devices and
a DTensor client of its own; together they shard a model over a (2, 4) mesh spanning both processes
(row-major, and transposed so each mesh row mixes the processes), save it
with `save_checkpoint` (each data file's checksums hashed by its writer, not
read back), check that a second save and a process-local array
are refused on both, restore it onto the other layout and overwrite it. The
parent then reads the checkpoint in a fresh process with plain TensorFlow (no
JAX, no DTensor) and compares with the global values the workers gathered.
"""

import concurrent.futures
import json
import os
import textwrap

import numpy as np
import pytest
from support import multiprocess_util, processes, warm

pytest.importorskip('tensorflow')
from flax_dtensor.dtensor._format import _decode, _verify

NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 4
WORKER = processes.WORKERS_DIR / '_mp_worker_export.py'
TIMEOUT = 400

_READ_SCRIPT = processes.NO_JAX + textwrap.dedent(
  """
  import json, os, sys
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  import numpy as np
  import tensorflow as tf
  reader = tf.train.load_checkpoint(sys.argv[1])
  out, dtypes = {}, {}
  for key, dtype in reader.get_variable_to_dtype_map().items():
    if key.endswith('/.ATTRIBUTES/VARIABLE_VALUE'):
      value = reader.get_tensor(key)
      dtypes[key] = dtype.name
      # .npz has no bfloat16: store it as float32 (exact).
      out[key] = value.astype(np.float32) if dtype.name == 'bfloat16' else value
  np.savez(sys.argv[2], **out)
  print(json.dumps(dtypes))
  """
)


def _launch(out_dir, kind):
  """Runs the workers; returns each one's RESULT dict."""
  outputs = multiprocess_util.run_workers(
    WORKER,
    NUM_PROCESSES,
    args=[str(out_dir), kind],
    timeout=TIMEOUT,
    devices_per_process=DEVICES_PER_PROCESS,
  )
  return [
    processes.result(out, context=f'(worker {i})')
    for i, out in enumerate(outputs)
  ]


def _plain_tf_read(checkpoint, out):
  script = os.path.join(os.path.dirname(out), 'read.py')
  with open(script, 'w') as f:
    f.write(_READ_SCRIPT)
  done = warm.tf_only().run(script, checkpoint, out, timeout=TIMEOUT)
  assert done.returncode == 0, done.stderr[-4000:]
  dtypes = json.loads(done.stdout.strip().splitlines()[-1])
  with np.load(out) as data:
    return dict(data), dtypes


@pytest.mark.parametrize('kind', ['default', 'transposed'])
def test_two_processes_write_one_checkpoint(tmp_path, kind):
  results = _launch(tmp_path, kind)
  assert [r['process'] for r in results] == [0, 1]
  for r in results:
    assert r['processes'] == NUM_PROCESSES
    assert r['devices'] == NUM_PROCESSES * DEVICES_PER_PROCESS
    assert r['local_devices'] == DEVICES_PER_PROCESS
    assert r['refused'], r
    assert r['mismatched'] == [], r
    assert r['restored_spec'] == "P('model', 'data')"
    assert r['leftovers'] == [], r
    assert "'w' lives on the devices of processes [" in r['local_error']
    assert 'checkpoint' in r['files']
    data = [f for f in r['files'] if f.startswith('ckpt.data-')]
    # A bundle per process, or (transposed: bundles of 256 bytes or more)
    # at least 2 per process; and the object graph's.
    count = len(data)
    assert (count == 3) if kind == 'default' else (count >= 5), data
    assert data == [f'ckpt.data-{k:05d}-of-{count:05d}' for k in range(count)]
    assert 'flax_dtensor.json' in r['files']
  assert sorted(os.listdir(tmp_path)) == [
    'ckpt',
    'expected.npz',
    'expected_dtypes.json',
  ]
  # Every data file's checksums, hashed by the process that wrote it from
  # the bytes it handed TF and carried to process 0 under the merged name,
  # are the file's as read back: `inspect --verify` finds it intact.
  manifest = _decode.read(str(tmp_path / 'ckpt'))
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    assert _verify.problems_of(manifest, pool) == []
  assert manifest.checksum == 'crc32c'

  with np.load(tmp_path / 'expected.npz') as data:
    expected = dict(data)
  assert sorted(expected) == [
    'counts',
    'dense/bias',
    'dense/kernel',
    'embed/embedding',
    'half',
    'out/bias',
    'out/kernel',
    'step',
  ]
  with open(tmp_path / 'expected_dtypes.json') as f:
    expected_dtypes = json.load(f)
  read, dtypes = _plain_tf_read(
    str(tmp_path / 'ckpt'), str(tmp_path / 'read.npz')
  )
  suffix = '/.ATTRIBUTES/VARIABLE_VALUE'
  assert sorted(read) == sorted(f'state/{k}{suffix}' for k in expected)
  for name, want in expected.items():
    got = read[f'state/{name}{suffix}']
    assert got.shape == want.shape, name
    if name == 'step':
      # Saved again, with overwrite=True, after step 7 -> 8.
      assert got == 8
      continue
    # float16 and uint32 are stored widened; values are exact.
    assert np.array_equal(got.astype(want.dtype), want), name
    assert np.array_equal(got, want.astype(got.dtype)), name
  assert expected_dtypes['half'] == 'float16'
  assert expected_dtypes['counts'] == 'uint32'
  assert expected_dtypes['out/kernel'] == 'bfloat16'
  assert dtypes == {
    f'state/{k}{suffix}': {'float16': 'float32', 'uint32': 'int64'}.get(d, d)
    for k, d in expected_dtypes.items()
  }
