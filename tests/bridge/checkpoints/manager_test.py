"""`CheckpointManager`: numbered steps, retention, resume, TF at every step.

A small model trained by a deterministic step (exact in float32), saved by
the manager: each step's values are known, so a restore is compared with
the values of that step, and TensorFlow's own readers with JAX's arrays.
"""

import json
import os
import subprocess
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support import processes, warm

import flax_dtensor.dtensor as fdt_dt
from flax_dtensor.dtensor._storage import _background


class Model(nnx.Module):
  def __init__(self, mesh, value=0.0):
    self.w = nnx.Param(
      jax.device_put(
        jnp.full((8, 16), value, jnp.float32),
        NamedSharding(mesh, P('data', 'model')),
      )
    )
    self.b = nnx.Param(
      jax.device_put(
        jnp.full((16,), value, jnp.float32), NamedSharding(mesh, P())
      )
    )


def at_step(step):
  """The model's values after `step` steps: w = b = step (and w's row i +i)."""
  return {
    'w': np.full((8, 16), step, np.float32)
    + np.arange(8, dtype=np.float32)[:, None],
    'b': np.full((16,), step, np.float32),
  }


def train_to(model, step):
  values = at_step(step)
  model.w.set_value(jax.device_put(values['w'], model.w.get_value().sharding))
  model.b.set_value(jax.device_put(values['b'], model.b.get_value().sharding))


def values_of(model):
  return {
    'w': np.asarray(model.w.get_value()),
    'b': np.asarray(model.b.get_value()),
  }


def assert_at(model, step):
  got, want = values_of(model), at_step(step)
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def run(manager, mesh, steps, metrics=None):
  model = Model(mesh)
  for step in steps:
    train_to(model, step)
    manager.save(
      step, model, metrics=None if metrics is None else metrics(step)
    )
  manager.wait()
  return model


@pytest.mark.parametrize('blocking', [False, True])
def test_steps_are_saved_by_interval_and_tf_reads_the_latest(
  explicit_mesh, tmp_path, blocking
):
  manager = fdt_dt.CheckpointManager(
    tmp_path / 'run', save_interval_steps=3, blocking=blocking
  )
  assert manager.latest_step() is None and manager.all_steps() == []
  run(manager, explicit_mesh, range(1, 11))
  assert manager.all_steps() == [3, 6, 9]
  assert manager.latest_step() == 9
  # TensorFlow's own readers: the latest whole step, then its values.
  prefix = tf.train.latest_checkpoint(str(tmp_path / 'run'))
  assert prefix == str(tmp_path / 'run' / '9' / 'ckpt')
  state = tf.train.get_checkpoint_state(str(tmp_path / 'run'))
  assert [
    os.path.basename(os.path.dirname(p))
    for p in state.all_model_checkpoint_paths
  ] == ['3', '6', '9']
  reader = tf.train.load_checkpoint(prefix)
  for name, want in at_step(9).items():
    np.testing.assert_array_equal(
      reader.get_tensor(fdt_dt.checkpoint_key(name)), want
    )
  # And a restore: the latest by default, or a step by number.
  target = Model(explicit_mesh, value=-1.0)
  assert manager.restore(target) is target
  assert_at(target, 9)
  manager.restore(target, step=3)
  assert_at(target, 3)
  assert target.w.get_value().sharding == NamedSharding(
    explicit_mesh, P('data', 'model')
  )
  manager.close()


def test_retention_keeps_the_newest_every_period_and_the_best(
  explicit_mesh, tmp_path
):
  # The loss is lowest at steps 2 and 5; steps divisible by 4 are kept for
  # good; the newest two always.
  losses = {
    1: 9.0,
    2: 0.5,
    3: 8.0,
    4: 7.0,
    5: 0.25,
    6: 6.0,
    7: 5.0,
    8: 4.0,
    9: 3.0,
    10: 2.0,
  }
  manager = fdt_dt.CheckpointManager(
    tmp_path / 'run',
    max_to_keep=2,
    keep_period=4,
    best_fn=lambda m: m['loss'],
    best_mode='min',
    keep_best=2,
  )
  run(
    manager, explicit_mesh, range(1, 11), metrics=lambda s: {'loss': losses[s]}
  )
  assert manager.all_steps() == [2, 4, 5, 8, 9, 10]
  assert manager.metrics(5) == {'loss': 0.25}
  assert manager.metrics(3) == {}  # Removed with its step.
  # The files say the same to any reader.
  recorded = json.loads(
    (tmp_path / 'run' / 'flax_dtensor_steps.json').read_text()
  )
  assert sorted(recorded['steps'], key=int) == ['2', '4', '5', '8', '9', '10']
  state = tf.train.get_checkpoint_state(str(tmp_path / 'run'))
  assert state.model_checkpoint_path.endswith(os.path.join('10', 'ckpt'))
  # Nothing but the steps and the two files (no step half removed).
  assert sorted(os.listdir(tmp_path / 'run')) == sorted(
    ['2', '4', '5', '8', '9', '10', 'checkpoint', 'flax_dtensor_steps.json']
  )
  # A new manager over the same folder reads the metrics back.
  again = fdt_dt.CheckpointManager(tmp_path / 'run')
  assert again.metrics(2) == {'loss': 0.5}
  target = Model(explicit_mesh)
  again.restore(target, step=5)
  assert_at(target, 5)


def test_without_a_limit_every_step_is_kept(explicit_mesh, tmp_path):
  manager = fdt_dt.CheckpointManager(tmp_path / 'run', keep_period=2)
  run(manager, explicit_mesh, [1, 2, 3, 5])
  assert manager.all_steps() == [1, 2, 3, 5]


def test_a_damaged_latest_step_falls_back_to_the_newest_good_one(
  explicit_mesh, tmp_path
):
  manager = fdt_dt.CheckpointManager(tmp_path / 'run')
  run(manager, explicit_mesh, [1, 2, 3])
  damage(tmp_path / 'run' / '3')
  target = Model(explicit_mesh, value=-1.0)
  with pytest.warns(
    fdt_dt.CheckpointStepWarning,
    match=r'Restored step 2 of .*, not the latest: step 3 is damaged \(.*'
    r'ckpt\.data-00000-of-00001 bytes 0\.\.\d+ changed',
  ):
    manager.restore(target)
  assert_at(target, 2)
  assert manager.restored_step == 2
  # Asked for by number, the damaged step is refused, the target unchanged.
  with pytest.raises(fdt_dt.DamagedExportError, match='is damaged'):
    manager.restore(target, step=3)
  assert_at(target, 2)
  assert manager.restored_step == 2


def damage(step_dir):
  """Flips the first byte of a step's data file."""
  (data,) = [n for n in os.listdir(step_dir) if n.startswith('ckpt.data')]
  with open(step_dir / data, 'r+b') as f:
    byte = f.read(1)[0]
    f.seek(0)
    f.write(bytes([byte ^ 0xFF]))
  return (step_dir / data).read_bytes()


def test_a_loop_resumes_after_the_step_restored_not_a_damaged_latest(
  explicit_mesh, tmp_path
):
  manager = fdt_dt.CheckpointManager(tmp_path / 'run', save_interval_steps=2)
  assert manager.restored_step is None
  run(manager, explicit_mesh, range(1, 11))
  assert manager.all_steps() == [2, 4, 6, 8, 10]
  damaged = damage(tmp_path / 'run' / '10')
  manager.close()

  # A fresh run over the same folder: the documented loop.
  manager = fdt_dt.CheckpointManager(tmp_path / 'run', save_interval_steps=2)
  model = Model(explicit_mesh, value=-1.0)
  with pytest.warns(
    fdt_dt.CheckpointStepWarning,
    match=r'Restored step 8 of .*, not the latest: step 10 is damaged .*'
    r"the next save moves them aside, to '10\.damaged', as the run goes on "
    r'from step 8: resume from `manager\.restored_step \+ 1`',
  ):
    start = 1
    if manager.latest_step() is not None:
      manager.restore(model)
      start = manager.restored_step + 1
  assert start == 9
  assert manager.latest_step() == 10  # Damaged, still listed until a save.
  assert_at(model, 8)  # Bit for bit.
  for step in range(start, 13):  # One step: from step s's values to s + 1's.
    model.w.set_value(model.w.get_value() + 1.0)
    model.b.set_value(model.b.get_value() + 1.0)
    manager.save(step, model)
  manager.wait()
  assert_at(model, 12)
  assert manager.all_steps() == [2, 4, 6, 8, 10, 12]
  for step in (8, 10, 12):  # Step 10 written again, by the resumed loop.
    target = Model(explicit_mesh, value=-1.0)
    manager.restore(target, step=step)
    assert manager.restored_step == step
    assert_at(target, step)
  prefix = tf.train.latest_checkpoint(str(tmp_path / 'run'))
  assert prefix == str(tmp_path / 'run' / '12' / 'ckpt')
  # The damaged step is kept aside for a look, byte for byte.
  aside = tmp_path / 'run' / '10.damaged'
  (data,) = [n for n in os.listdir(aside) if n.startswith('ckpt.data')]
  assert (aside / data).read_bytes() == damaged
  manager.close()


def test_restores_refuse_what_is_not_there(explicit_mesh, tmp_path):
  manager = fdt_dt.CheckpointManager(tmp_path / 'run')
  target = Model(explicit_mesh)
  with pytest.raises(
    fdt_dt.ExportNotFoundError, match=r'holds no whole step to restore'
  ):
    manager.restore(target)
  run(manager, explicit_mesh, [4])
  with pytest.raises(
    fdt_dt.ExportNotFoundError,
    match=r'holds no whole step 5; it holds 4\. Pass one of those',
  ):
    manager.restore(target, step=5)
  # A folder that is not a step, or a step half written, is not listed.
  (tmp_path / 'run' / 'notes').mkdir()
  (tmp_path / 'run' / '7').mkdir()
  (tmp_path / 'run' / '.8.tmp-x').mkdir()
  assert manager.all_steps() == [4]


@pytest.mark.parametrize(
  'kwargs, match',
  [
    (
      {'max_to_keep': 0},
      r'max_to_keep must be a positive int; got 0\. Pass None',
    ),
    (
      {'save_interval_steps': 1.5},
      r'save_interval_steps must be a positive int; got 1\.5',
    ),
    ({'keep_best': 2}, r'keep_best and best_fn go together'),
    ({'best_fn': len}, r'keep_best and best_fn go together'),
    ({'best_mode': 'low'}, r"best_mode must be 'max' or 'min'; got 'low'"),
    (
      {'when_busy': 'queue'},
      r"when_busy must be 'wait' or 'skip'; got 'queue'",
    ),
    (
      {'preemption_seconds': 0},
      r'preemption_seconds must be a positive number or None; got 0',
    ),
  ],
)
def test_settings_are_checked(tmp_path, kwargs, match):
  with pytest.raises(fdt_dt.CheckpointManagerError, match=match):
    fdt_dt.CheckpointManager(tmp_path / 'run', **kwargs)
  assert not (tmp_path / 'run').exists()


def test_steps_and_metrics_are_checked(explicit_mesh, tmp_path):
  manager = fdt_dt.CheckpointManager(tmp_path / 'run', blocking=True)
  model = Model(explicit_mesh)
  manager.save(5, model)
  with pytest.raises(
    fdt_dt.CheckpointManagerError,
    match=r'Step 5 is not above the latest saved step, 5, in .*Save a later step',
  ):
    manager.save(5, model)
  with pytest.raises(
    fdt_dt.CheckpointManagerError,
    match=r'A step is a non-negative int; got str',
  ):
    manager.save('6', model)
  with pytest.raises(
    fdt_dt.CheckpointManagerError,
    match=r'non-negative int below 10\*\*18; got -1',
  ):
    manager.save(-1, model)
  with pytest.raises(
    fdt_dt.CheckpointManagerError, match=r"metrics\['loss'\] is nan"
  ):
    manager.save(6, model, metrics={'loss': float('nan')})
  with pytest.raises(
    fdt_dt.CheckpointManagerError,
    match=r"metrics\['loss'\] is str, not a number",
  ):
    manager.save(6, model, metrics={'loss': 'low'})
  with pytest.raises(
    fdt_dt.CheckpointManagerError, match=r'metrics must be a mapping'
  ):
    manager.save(6, model, metrics=[0.5])
  assert manager.all_steps() == [5]
  # A JAX scalar is a number.
  assert manager.save(6, model, metrics={'loss': jnp.float32(0.5)})
  assert manager.metrics(6) == {'loss': 0.5}


@pytest.mark.parametrize(
  'text, match',
  [
    ('{', r'is not JSON'),
    ('[]', r'has no "steps" object'),
    ('{"steps": {"x": {}}}', r"step 'x' is not a step number"),
    (
      '{"steps": {"3": {"loss": "low"}}}',
      r"step 3, metric 'loss' is str, not a number",
    ),
    (
      '{"steps": {"3": {"loss": true}}}',
      r"step 3, metric 'loss' is bool, not a number",
    ),
  ],
)
def test_a_malformed_metrics_file_is_refused(tmp_path, text, match):
  (tmp_path / 'run').mkdir()
  (tmp_path / 'run' / 'flax_dtensor_steps.json').write_text(text)
  with pytest.raises(
    fdt_dt.MalformedExportError, match=match + r'.*remove the file'
  ):
    fdt_dt.CheckpointManager(tmp_path / 'run')


def test_a_save_while_one_is_written_waits_or_is_skipped(
  explicit_mesh, tmp_path, monkeypatch
):
  """The first save's write is held until the test lets it go."""
  release = threading.Event()
  started = _background.start

  def held_start(directory, work, **kwargs):
    def held(*pools):
      release.wait(60)
      return work(*pools)

    return started(directory, held, **kwargs)

  monkeypatch.setattr(_background, 'start', held_start)
  model = Model(explicit_mesh)
  skip = fdt_dt.CheckpointManager(tmp_path / 'skip', when_busy='skip')
  train_to(model, 1)
  assert skip.save(1, model)
  train_to(model, 2)
  with pytest.warns(
    fdt_dt.CheckpointStepWarning,
    match=r'Step 2 was not saved: the save before it is still being written',
  ):
    assert not skip.save(2, model)
  assert skip.all_steps() == []  # Step 1 is not whole yet: not visible.
  release.set()
  skip.wait()
  assert skip.all_steps() == [1]
  target = Model(explicit_mesh)
  skip.restore(target)
  assert_at(target, 1)  # The values of the call, not the later ones.

  # 'wait': the second save waits for the first, then is written.
  release.clear()
  waits = fdt_dt.CheckpointManager(tmp_path / 'wait')
  train_to(model, 1)
  assert waits.save(1, model)
  train_to(model, 2)
  threading.Timer(0.5, release.set).start()
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    assert waits.save(2, model)
  waits.close()
  assert waits.all_steps() == [1, 2]
  waits.restore(target, step=1)
  assert_at(target, 1)
  waits.restore(target)
  assert_at(target, 2)


FOLLOWER = """
import json, os, sys, time
sys.modules['jax'] = None  # JAX cannot be imported here.
import numpy as np
import tensorflow as tf
run, last = sys.argv[1], int(sys.argv[2])
seen = {}
deadline = time.monotonic() + 300
while time.monotonic() < deadline:
  prefix = tf.train.latest_checkpoint(run)
  if prefix is not None:
    step = int(os.path.basename(os.path.dirname(prefix)))
    if step not in seen:
      try:
        b = tf.train.load_checkpoint(prefix).get_tensor('state/b/.ATTRIBUTES/VARIABLE_VALUE')
      except tf.errors.NotFoundError:  # Removed by the retention meanwhile.
        continue
      seen[step] = float(np.unique(b)[0])
    if step == last:
      break
  time.sleep(0.02)
print(json.dumps({'jax': sys.modules['jax'] is not None, 'seen': seen}))
"""


def test_a_tensorflow_process_follows_the_run(explicit_mesh, tmp_path):
  """A plain TF process (no JAX) reads each latest step while the loop
  saves: every step it sees is whole, with that step's values."""
  assert fdt_dt.checkpoint_key('b') == 'state/b/.ATTRIBUTES/VARIABLE_VALUE'
  script = tmp_path / 'follow.py'
  script.write_text(FOLLOWER)
  run_dir = tmp_path / 'run'
  manager = fdt_dt.CheckpointManager(run_dir, max_to_keep=2)
  model = Model(explicit_mesh)
  train_to(model, 1)
  manager.save(1, model)
  manager.wait()
  # A fork of the TensorFlow-only pool: it follows from the loop's start,
  # not after TensorFlow's import.
  with (
    open(tmp_path / 'out', 'w+') as out,
    open(tmp_path / 'err', 'w+') as err,
  ):
    follower = warm.tf_only().start(
      script, run_dir, '12', env=processes.reader_env(), stdout=out, stderr=err
    )
    for step in range(2, 13):
      train_to(model, step)
      manager.save(step, model)
    manager.close()
    status = follower.wait(processes.TIMEOUT)
    out.seek(0)
    err.seek(0)
    out, err = out.read(), err.read()
  assert status == 0, err
  report = json.loads(out.strip().splitlines()[-1])
  assert report['jax'] is False
  seen = {int(k): v for k, v in report['seen'].items()}
  assert 12 in seen and all(v == float(k) for k, v in seen.items()), seen
  assert manager.all_steps() == [11, 12]


TRAIN = """
import os, sys
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from flax import nnx
import flax_dtensor.dtensor as fdt_dt

run, last = sys.argv[1], int(sys.argv[2])
fdt_dt.initialize()
mesh = jax.make_mesh((2, 4), ('data', 'model'))
w = nnx.Param(jax.device_put(jnp.zeros((8, 16)), NamedSharding(mesh, P('data', 'model'))))
b = nnx.Param(jax.device_put(jnp.zeros((16,)), NamedSharding(mesh, P())))
model = nnx.Dict(w=w, b=b)
manager = fdt_dt.CheckpointManager(run, max_to_keep=3)
start = (manager.latest_step() or 0) + 1
if start > 1:
  manager.restore(model)
  assert float(model['b'].get_value()[0]) == start - 1
for step in range(start, last + 1):
  # One step of "training": exact in float32, each step's values known.
  model['w'].set_value(model['w'].get_value() + 1.0)
  model['b'].set_value(model['b'].get_value() + 1.0)
  manager.save(step, model)
  print('STEP', step, flush=True)
manager.close()
print('DONE', flush=True)
"""

KILL_MOMENTS = 4


def _on_eight_devices():
  return processes.clean_env(
    XLA_FLAGS='--xla_force_host_platform_device_count=8'
  )


def _start_piped(warm_pool, script, source, arg):
  """Writes `source` to `script` and starts it on eight devices, with the
  run folder (a `run` beside it) and `arg`; its output piped."""
  script.write_text(source)
  return warm_pool.start(
    script,
    str(script.parent / 'run'),
    arg,
    env=_on_eight_devices(),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
  )


@pytest.mark.parametrize('moment', range(KILL_MOMENTS))
def test_a_loop_killed_at_any_moment_resumes_from_its_latest_whole_step(
  warm_pool, tmp_path, moment
):
  """SIGKILL to a training loop at a seeded moment (after step 2 to 9 was
  handed to the manager, then 0 to 0.3 s more, inside a background
  write or between them); the latest whole step restores with the values
  of that step, and the loop resumed from it ends as an uninterrupted run."""
  import random
  import signal
  import time

  rng = random.Random(1000 + moment)
  after_step, delay = rng.randint(2, 9), rng.uniform(0.0, 0.3)
  run_dir = tmp_path / 'run'
  script = tmp_path / 'train.py'
  case = _start_piped(warm_pool, script, TRAIN, '40')
  with case.stdout, case.stderr:
    try:
      deadline = time.monotonic() + processes.TIMEOUT
      while True:
        line = case.stdout.readline().decode()
        assert line, case.stderr.read().decode()
        if line == f'STEP {after_step}\n':
          break
        assert time.monotonic() < deadline
      time.sleep(delay)
      os.killpg(case.pid, signal.SIGKILL)
      case.wait(processes.TIMEOUT)
    finally:
      case.kill()
  manager = fdt_dt.CheckpointManager(run_dir, max_to_keep=3)
  latest = manager.latest_step()
  assert latest is not None and 1 <= latest <= 40
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  for step in manager.all_steps():  # Every step listed is whole.
    target = nnx.Dict(
      w=nnx.Param(
        jax.device_put(
          jnp.full((8, 16), -1.0), NamedSharding(mesh, P('data', 'model'))
        )
      ),
      b=nnx.Param(
        jax.device_put(jnp.full((16,), -1.0), NamedSharding(mesh, P()))
      ),
    )
    manager.restore(target, step=step)
    np.testing.assert_array_equal(
      target['w'].get_value(), np.full((8, 16), step, np.float32)
    )
    np.testing.assert_array_equal(
      target['b'].get_value(), np.full((16,), step, np.float32)
    )
  # Resumed to the end: as the uninterrupted run at step 40.
  proc = warm_pool.run(script, str(run_dir), '40', env=_on_eight_devices())
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.splitlines()[0] == f'STEP {latest + 1}'
  assert proc.stdout.splitlines()[-1] == 'DONE'
  assert manager.all_steps() == [38, 39, 40]
  final = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(run_dir)))
  np.testing.assert_array_equal(
    final.get_tensor(fdt_dt.checkpoint_key('w')),
    np.full((8, 16), 40, np.float32),
  )


PREEMPTED = """
import sys, time
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from flax import nnx
import flax_dtensor.dtensor as fdt_dt

run, checks = sys.argv[1], sys.argv[2] == 'checks'
fdt_dt.initialize()
mesh = jax.make_mesh((2, 4), ('data', 'model'))
model = nnx.Dict(
  b=nnx.Param(jax.device_put(jnp.zeros((16,)), NamedSharding(mesh, P())))
)
manager = fdt_dt.CheckpointManager(
  run, save_interval_steps=1000, save_on_preemption=True, preemption_seconds=2
)
for step in range(1, 100000):
  model['b'].set_value(model['b'].get_value() + 1.0)
  print('STEP', step, flush=True)
  if not checks:  # A loop that never looks: the bound ends it.
    time.sleep(0.05)
    continue
  if manager.reached_preemption(step):
    manager.save(step, model)  # Off the interval: saved, and whole.
    print('SAVED', step, manager.all_steps(), flush=True)
    manager.close()
    sys.exit(143)
  manager.save(step, model)
  time.sleep(0.02)
"""


@pytest.mark.parametrize('loop', ['checks', 'never_checks'])
def test_a_preempted_loop_saves_its_step_within_the_bound(
  warm_pool, tmp_path, loop
):
  import signal
  import time

  run_dir = tmp_path / 'run'
  case = _start_piped(warm_pool, tmp_path / 'preempted.py', PREEMPTED, loop)
  with case.stdout, case.stderr:
    try:
      while case.stdout.readline() != b'STEP 5\n':
        assert case.poll() is None, case.stderr.read().decode()
      sent = time.monotonic()
      case.send_signal(signal.SIGTERM)
      status = case.wait(processes.TIMEOUT)
      seconds = time.monotonic() - sent
    finally:
      case.kill()
    out, err = case.stdout.read().decode(), case.stderr.read().decode()
  assert status == 143, err
  manager = fdt_dt.CheckpointManager(run_dir)
  if loop == 'checks':
    (saved,) = [line for line in out.splitlines() if line.startswith('SAVED')]
    step = int(saved.split()[1])
    assert step >= 5 and saved == f'SAVED {step} [{step}]'
    assert manager.all_steps() == [step]
    mesh = jax.make_mesh((2, 4), ('data', 'model'))
    target = nnx.Dict(
      b=nnx.Param(jax.device_put(jnp.zeros((16,)), NamedSharding(mesh, P())))
    )
    manager.restore(target)
    np.testing.assert_array_equal(
      target['b'].get_value(), np.full((16,), step, np.float32)
    )
  else:
    # No step was due; the bound (2 s) ended the process, and said so.
    assert 1.5 < seconds < 20
    assert manager.all_steps() == []
    assert err.splitlines()[-1].startswith(
      'flax_dtensor: preempted (SIGTERM) 2 s ago and not yet ended: exiting now.'
    )


def test_the_preemption_handler_is_the_managers_until_it_closes(tmp_path):
  import signal

  before = signal.getsignal(signal.SIGTERM)
  manager = fdt_dt.CheckpointManager(tmp_path / 'run', save_on_preemption=True)
  assert signal.getsignal(signal.SIGTERM) == manager._on_sigterm
  assert not manager.reached_preemption(3)
  manager.close()
  assert signal.getsignal(signal.SIGTERM) == before
  # Without it, no handler and never preempted.
  plain = fdt_dt.CheckpointManager(tmp_path / 'run')
  assert signal.getsignal(signal.SIGTERM) == before
  assert not plain.reached_preemption(3)


def test_inspect_lists_the_steps_and_verifies_each(explicit_mesh, tmp_path):
  manager = fdt_dt.CheckpointManager(tmp_path / 'run', max_to_keep=2)
  run(manager, explicit_mesh, [1, 2, 3])
  (tmp_path / 'run' / '.4.tmp-host-1-2').mkdir()  # A save stopped midway.
  from support import cli_runner  # The command line, in this process.

  env = {'COLUMNS': '200'}
  proc = cli_runner.run('inspect', str(tmp_path / 'run'), env=env)
  assert proc.returncode == 0, proc.stderr
  lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
  assert (
    lines[0]
    == f'Checkpoints by step {tmp_path / "run"}: 2 whole steps, latest 3'
  )
  rows = [line.split(None, 3) for line in lines[3:]]
  assert [r[0] for r in rows] == ['2', '3', '.4.tmp-host-1-2']
  assert rows[0][3] == 'whole'
  assert rows[1][3] == "whole, latest (TensorFlow's checkpoint file names it)"
  assert rows[2][1:3] == ['0', 'B'] and rows[2][3].startswith(
    'not whole: being written'
  )
  # Each whole step's size, as on disk.
  size = sum(
    p.stat().st_size for p in (tmp_path / 'run' / '2').rglob('*') if p.is_file()
  )
  assert rows[0][1:3] == [f'{size / 1024:.1f}', 'KiB']
  # --verify checks each step: a damaged one is named, exit 1.
  data = next((tmp_path / 'run' / '2').glob('ckpt.data-*'))
  data.write_bytes(b'\0' * data.stat().st_size)
  proc = cli_runner.run('inspect', '--verify', str(tmp_path / 'run'), env=env)
  assert proc.returncode == 1, proc.stderr
  assert proc.stdout.count('intact:') == 1
  assert 'damaged: 1 problem' in proc.stdout
  assert f'{data.name} bytes 0..' in proc.stdout


def test_a_state_file_that_is_not_text_names_no_latest_step(
  explicit_mesh, tmp_path
):
  """TensorFlow's `checkpoint` state file comes from elsewhere: bytes that
  are not UTF-8 leave the steps readable, and `inspect` names no latest."""
  from support import cli_runner  # The command line, in this process.

  manager = fdt_dt.CheckpointManager(tmp_path / 'run')
  run(manager, explicit_mesh, [1, 2])
  (tmp_path / 'run' / 'checkpoint').write_bytes(b'\xff\xfe not text')
  assert manager.all_steps() == [1, 2]
  proc = cli_runner.run(
    'inspect', str(tmp_path / 'run'), env={'COLUMNS': '200'}
  )
  assert proc.returncode == 0, proc.stderr
  assert '2 whole steps, latest 2' in proc.stdout
  assert 'checkpoint file names it' not in proc.stdout


def test_resume_from_a_steps_folder_that_is_not_there_is_refused(tmp_path):
  from support import cli_runner  # The command line, in this process.

  missing = tmp_path / 'no-such-run'
  proc = cli_runner.run(
    'demo',
    '--resume',
    '--steps-dir',
    str(missing),
    '--out',
    str(tmp_path / 'o'),
  )
  assert proc.returncode == 2, proc.stderr
  assert f"--resume: '{missing}' holds no whole step to go on from" in (
    proc.stderr
  )
  assert not missing.exists()


def test_resume_is_refused_only_past_an_intact_step(explicit_mesh, tmp_path):
  from support import cli_runner  # The command line, in this process.

  from flax_dtensor.cli import demo

  run(fdt_dt.CheckpointManager(tmp_path / 'run'), explicit_mesh, [2, 4])
  proc = cli_runner.run(
    'demo',
    '--resume',
    '--steps',
    '4',
    '--steps-dir',
    str(tmp_path / 'run'),
    '--out',
    str(tmp_path / 'o'),
  )
  assert proc.returncode == 2, proc.stderr
  assert 'holds step 4, and --steps is 4: nothing is left to train' in (
    proc.stderr
  )
  # Step 4 damaged: the run goes on from step 2, as the restore does.
  damage(tmp_path / 'run' / '4')
  assert demo._check_resumable(tmp_path / 'run', 4) is None
  damage(tmp_path / 'run' / '2')  # Both: left to the restore to refuse.
  assert demo._check_resumable(tmp_path / 'run', 4) is None
