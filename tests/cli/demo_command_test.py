"""`flax-dtensor demo` run as a user runs it: training, export, verify,
resume, and what it refuses. How the CLI tests run: tests/cli/conftest.py.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from support.cli_helpers import (
  DEMO_TARGET,
  assert_fits,
  bad_input,
  check_checkpoint,
  ok,
  run_cli,
)

import flax_dtensor.dtensor as fdt_tf
from flax_dtensor.cli import _loading

# TF DTensor on the suite's 8 devices, before any other TF operation.
pytestmark = pytest.mark.usefixtures('dtensor')


def test_demo_mesh_does_not_match_cpu_devices(tmp_path):
  bad_input(
    run_cli(
      'demo',
      '--mesh',
      'data=4,model=4',
      '--cpu-devices',
      '8',
      '--out',
      tmp_path / 'demo',
    ),
    'needs 16 devices, but JAX has 8',
  )
  assert not (tmp_path / 'demo').exists()


def test_demo_trains_exports_and_verifies(tmp_path):
  """The demo end to end, as a user runs it, under the rules that `plan
  --suggest` proposes for it: the suggestion -> training round trip
  (`plan ... --suggest --budget 300KiB --write sug.yaml && demo --rules
  sug.yaml`). The forward's 'batch', traced on the demo's own inputs, has
  rules; without them the demo stopped at it.

  It saves its steps every 10; run again with `--resume` after its last
  step is lost (as a run killed after step 10 left it), it trains steps
  11 to 20 again into equal values, bit for bit.

  Slow: it trains 20 steps (and 10 again), exports a checkpoint and a
  SavedModel, and serves it in the TensorFlow-only process the demo itself
  starts (twice).
  """
  suggested = tmp_path / 'sug.yaml'
  suggest = ['--suggest', '--budget', '300KiB', '--write', suggested]
  said = ok(run_cli('plan', DEMO_TARGET, *suggest))
  said = ' '.join(said.split())
  assert '(traced on int32[16,128])' in said
  assert "'batch' -> 'data', None" in said
  assert 'per device fits the budget of 300.0 KiB' in said
  assert _loading.load_rules(str(suggested)).candidates('batch') == (
    'data',
    None,
  )
  out = tmp_path / 'demo'
  narrow = {'COLUMNS': '80'}  # Piped, as in a CI log.
  stdout = ok(run_cli(*_demo_args(suggested, out), env=narrow))
  # Piped: plain progress lines, nothing animated; 80 columns, no line
  # ending in spaces, paths whole or broken after a '/'.
  assert_fits(stdout, 80, [out / 'saved_model', out / 'summary.json'])
  assert stdout.startswith(
    'flax-dtensor demo on 8 devices (cpu), mesh data=2,model=4\n'
    '20 steps of 16 sequences, seed 0\n'
  )
  steps = re.findall(r'^train step (\d+)/20  loss \d\.\d{3}  ', stdout, re.M)
  assert steps[0] == '1' and steps[-1] == '20', stdout
  # The writes and the verification (~12 s) each say so as they start.
  phases = [
    'write Orbax checkpoint…',
    'write DTensor checkpoint…',
    'write SavedModel…',
    'verify in TF-only subprocess…',
  ]
  lines = stdout.splitlines()
  trained = max(
    i for i, x in enumerate(lines) if x.startswith('train step 20/')
  )
  at = [lines.index(p) for p in phases]
  assert trained < at[0] and at == sorted(at), stdout
  summary = json.loads((out / 'summary.json').read_text())
  assert summary['steps'] == 20 and len(summary['losses']) == 20
  assert summary['loss_first'] > 5.0  # ~ln(256): uniform over bytes.
  assert summary['loss_last'] < summary['loss_first'] - 2.0
  assert summary['max_abs_logits_diff'] < 1e-3
  assert not summary['tf_subprocess']['jax_imported']
  for name in ('orbax', 'checkpoint', 'saved_model'):
    assert (out / name).is_dir()
    assert summary['bytes'][name] > 1_000_000
  for text in ('Sharding plan', 'Files written', 'Timings', 'Results'):
    assert text in stdout
  copied = (out / 'rules.yaml').read_text()
  assert copied.startswith(suggested.read_text())
  assert copied.startswith('# Rules proposed by flax_dtensor.suggest_rules')
  _exports_the_model_of_its_steps(out, suggested)
  _resumes_into_equal_values(out, suggested, summary)


def _demo_args(rules, out):
  """The demo test's run: 20 steps under `rules`, saving every 10."""
  return (
    'demo',
    '--rules',
    rules,
    '--steps',
    '20',
    '--save-every',
    '10',
    '--out',
    out,
  )


def _resumes_into_equal_values(out, rules, summary):
  """The demo's steps: 10 and 20, each a whole TF checkpoint; step 20
  damaged, `--resume` goes on from step 10, the step restored, and trains
  11 to 20 again into the same bits."""
  from flax_dtensor.dtensor._storage import _steps

  steps_dir = out.parent / 'demo-steps'
  assert summary['steps_dir'] == str(steps_dir)
  assert summary['saved_steps'] == [10, 20] and summary['resumed_from'] is None
  assert _steps.whole_steps(str(steps_dir)) == [10, 20]
  # TensorFlow's own state file names the latest whole step.
  state = (steps_dir / 'checkpoint').read_text()
  assert state.splitlines()[0] == 'model_checkpoint_path: "20/ckpt"'
  before = _checkpoint_bytes(steps_dir / '20')
  data = sorted((steps_dir / '20').glob('ckpt.data-*'))[0]
  damaged = bytearray(data.read_bytes())
  damaged[0] ^= 0xFF
  data.write_bytes(bytes(damaged))
  stdout = ok(run_cli(*_demo_args(rules, out), '--resume', '-q'))
  assert (
    f'resumed from step 10 of 20 ({steps_dir}); passed over the damaged '
    'step 20 (moved aside, as 20.damaged, by the next save)'
  ) in ' '.join(stdout.split())
  # Kept aside for a look, as it was.
  assert (steps_dir / '20.damaged' / data.name).read_bytes() == damaged
  again = json.loads((out / 'summary.json').read_text())
  assert again['resumed_from'] == 10 and again['saved_steps'] == [10, 20]
  assert again['losses'] == summary['losses'][10:]
  assert _checkpoint_bytes(steps_dir / '20') == before


def _exports_the_model_of_its_steps(out, rules):
  """`export --checkpoint` on the demo's own steps folder: its latest step
  holds the model under model/ beside optimizer/; export finds the model's
  part by its paths, says so, and writes the values of that step."""
  steps_dir = out.parent / 'demo-steps'
  exported = out.parent / 'exported'
  stdout = ok(
    run_cli(
      'export',
      DEMO_TARGET,
      '--checkpoint',
      steps_dir,
      '--rules',
      rules,
      '--out',
      exported,
    )
  )
  assert (
    f"note: '{steps_dir / '20'}' holds model/ (24 variables), optimizer/ "
    f"(51); exporting model/, which holds {DEMO_TARGET}'s variables "
    '(--part chooses another).'
  ) in ' '.join(stdout.split())
  step = fdt_tf.read_checkpoint(steps_dir / '20')
  expected = {
    '/'.join(map(str, k[1:])): v for k, v in step.items() if k[0] == 'model'
  }
  report = check_checkpoint(exported / 'checkpoint', expected)
  assert report['missing'] == [] and report['extra'] == []
  assert report['max_abs_diff'] == 0.0  # Bit-exact: step 20's model.


def _checkpoint_bytes(step_dir):
  """Each tensor of a step's TF checkpoint, by name, as bytes (read by
  plain TensorFlow, its manifest checked)."""
  return {
    name: np.asarray(value).tobytes()
    for name, value in fdt_tf.read_checkpoint(step_dir).items()
  }


@pytest.mark.parametrize(
  'make, args, fragments',
  [
    (
      lambda d: d.mkdir(),
      ['--resume'],
      ['--resume', 'holds no whole step to go on from'],
    ),
    (
      lambda d: d.write_text('x'),
      [],
      ['--steps-dir', 'is a file; expected a folder of training steps'],
    ),
  ],
  ids=['resume-with-no-step', 'steps-dir-a-file'],
)
def test_demo_refuses_steps_it_cannot_use(tmp_path, make, args, fragments):
  steps_dir = tmp_path / 'steps'
  make(steps_dir)
  proc = run_cli(
    'demo', '--out', tmp_path / 'out', '--steps-dir', steps_dir, *args
  )
  bad_input(proc, *fragments)
  assert not (tmp_path / 'out').exists()


def test_demo_without_tensorflow_names_the_extra(warm_pool, tmp_path):
  """Where TensorFlow is not installed (a GPU machine's image): exit 2 and
  the extra to install, before any work; not a bug to report."""
  script = tmp_path / 'no_tf.py'
  script.write_text(
    'import sys\n'
    "sys.modules['tensorflow'] = None  # Not installed, to every import.\n"
    'from flax_dtensor.cli import main\n'
    "sys.argv = ['flax-dtensor', 'demo', '--steps', '1', '--out', sys.argv[1]]\n"
    'main()\n'
  )
  proc = warm_pool.run(script, str(tmp_path / 'out'))
  assert proc.returncode == 2, proc.stderr
  line = proc.stderr.splitlines()[-1]
  assert line.startswith(
    'error: flax_dtensor.dtensor needs TensorFlow, which could not be '
    'imported. Install it with: pip install "flax-dtensor[tf]"'
  ), line
  assert 'report' not in line, line
  assert not (tmp_path / 'out').exists()
