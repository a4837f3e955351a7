"""Two local processes write ONE SavedModel; plain TF serves it without JAX.

The workers (tests/support/workers/_mp_worker_saved_model.py, started by
multiprocess_util) run jax.distributed on 127.0.0.1 with 4 CPU devices each
and a DTensor client of their own, on a transposed (2, 4) mesh spanning both processes. In the
same run they check that refusals and a failure on process 0 alone reach
every process, and bring TF-changed DVariables back with from_tf_module. The
parent then serves the SavedModel in a process where JAX cannot be
imported (a fork of the TensorFlow-only pool), compares with the JAX output the workers computed, and runs TF's
own `saved_model_cli show --all` on it.
"""

import json
import os
import re
import sys
import textwrap

import numpy as np
import pytest
from support import multiprocess_util, processes, warm

pytest.importorskip('tensorflow')


WORKER = processes.WORKERS_DIR / '_mp_worker_saved_model.py'
TIMEOUT = 400

_SERVE_SCRIPT = processes.NO_JAX + textwrap.dedent(
  """
  import json, os, sys
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  import numpy as np
  import tensorflow as tf
  loaded = tf.saved_model.load(sys.argv[1])
  serve = loaded.signatures['serving_default']
  out = serve(features=tf.constant(np.load(sys.argv[2])))
  saved = sys.argv[4] if len(sys.argv) > 4 else 'logits'
  np.save(sys.argv[3], out[saved].numpy())
  print(json.dumps({
    'outputs': sorted(out),
    'probs_sum': (
      out['probs'].numpy().sum(axis=1).tolist() if 'probs' in out else None
    ),
    'variables': sorted(v.name for v in serve.variables),
    'jax_modules': sorted(
      m for m, v in sys.modules.items() if m.startswith('jax') and v is not None
    ),
  }))
  """
)


def _results(out_dir):
  outputs = multiprocess_util.run_workers(
    WORKER, 2, args=[str(out_dir)], timeout=TIMEOUT, devices_per_process=4
  )
  return [
    processes.result(out, context=f'(worker {i})')
    for i, out in enumerate(outputs)
  ]


def test_two_processes_write_one_saved_model(tmp_path):
  results = _results(tmp_path)
  assert [r['process'] for r in results] == [0, 1]
  sm = str(tmp_path / 'sm')
  for r in results:
    assert r['path'] == sm
    # Refused on every process, before anything moved or was written.
    kind, message = r['too_big']
    assert kind == 'ExportError'
    assert re.search(
      r'gathers the model onto process 0.*expected at most '
      r'max_gather_bytes=\d+ .* got \d+ .*larger `max_gather_bytes=`',
      message,
    ), message
    kind, message = r['exists']
    assert (kind, 'already exists' in message) == ('ExportError', True)
    assert r['from_tf_mismatched'] == [], r
    assert r['relaid'] == [['down/kernel', "P('model',)"]]
    assert r['single_mesh_mismatched'] == [], r
    assert r['down_spec'] == "P(('data', 'model'), None)"
  # The wrong signature fails where it is traced, on process 0; process 1
  # raises too, with process 0's reason, rather than waiting.
  first, message = results[0]['broken']
  assert first == 'ExportError', results[0]['broken']  # In our words.
  assert '(32,) and (64,)' in message
  assert re.search(
    r'expected \S+ \[None, 64\], got \S+ \[None, 32\]', message
  ), message
  kind, other = results[1]['broken']
  assert kind == 'PeerError'  # Process 0 failed: a peer, to process 1.
  assert other.startswith(
    f'Writing the SavedModel on process 0 failed: {first}: {message[:40]}'
  )
  assert other.endswith(
    "Every process stops here: fix the cause (process 0's log has the "
    'details) and run the export again.'
  )
  # Only what succeeded is there; no temporary directory is left.
  assert sorted(os.listdir(tmp_path)) == [
    'ckpt',
    'explicit_sm',
    'explicit_want.npy',
    'sm',
    'want.npy',
    'x.npy',
    'x8.npy',
  ]
  assert {'saved_model.pb', 'variables', 'assets'} <= set(os.listdir(sm))

  # Served by plain TF, JAX blocked, in a process of its own.
  script = tmp_path / 'serve.py'
  script.write_text(_SERVE_SCRIPT)
  served = warm.tf_only().run(
    script, sm, tmp_path / 'x.npy', tmp_path / 'got.npy', timeout=TIMEOUT
  )
  assert served.returncode == 0, served.stderr[-4000:]
  report = json.loads(served.stdout.strip().splitlines()[-1])
  assert report['jax_modules'] == []
  assert report['outputs'] == ['logits', 'probs']
  np.testing.assert_allclose(report['probs_sum'], 1.0, rtol=1e-5)
  assert report['variables'] == [
    'down/bias:0',
    'down/kernel:0',
    'norm/bias:0',
    'norm/mean:0',
    'norm/scale:0',
    'norm/var:0',
    'up/bias:0',
    'up/kernel:0',
  ]
  want = np.load(tmp_path / 'want.npy')
  got = np.load(tmp_path / 'got.npy')
  assert got.shape == want.shape == (5, 16)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

  # The model written for Explicit axes, exported from jax.make_mesh's
  # default mesh over both processes: served at every batch, odd ones
  # included, each row as JAX computed it on the mesh.
  x8 = np.load(tmp_path / 'x8.npy')
  explicit_want = np.load(tmp_path / 'explicit_want.npy')
  for rows in (8, 3, 1):
    np.save(tmp_path / f'x{rows}rows.npy', x8[:rows])
    served = warm.tf_only().run(
      script,
      tmp_path / 'explicit_sm',
      tmp_path / f'x{rows}rows.npy',
      tmp_path / f'got{rows}.npy',
      'output_0',
      timeout=TIMEOUT,
    )
    assert served.returncode == 0, served.stderr[-4000:]
    assert (
      json.loads(served.stdout.strip().splitlines()[-1])['jax_modules'] == []
    )
    np.testing.assert_allclose(
      np.load(tmp_path / f'got{rows}.npy'),
      explicit_want[:rows],
      rtol=1e-5,
      atol=1e-5,
    )

  # TF's own tool reads the signature we wrote.
  cli = os.path.join(os.path.dirname(sys.executable), 'saved_model_cli')
  shown = processes.run([cli, 'show', '--all', '--dir', sm], timeout=TIMEOUT)
  assert shown.returncode == 0, shown.stderr[-4000:]
  text = shown.stdout
  serving = text[text.index("signature_def['serving_default']") :]
  for name, dims in [
    ("inputs['features']", '(-1, 64)'),
    ("outputs['logits']", '(-1, 16)'),
    ("outputs['probs']", '(-1, 16)'),
  ]:
    assert re.search(
      re.escape(name)
      + r' tensor_info:\s+dtype: DT_FLOAT\s+shape: '
      + re.escape(dims),
      serving,
    ), (name, serving[:2000])
