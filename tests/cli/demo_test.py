"""Tests of the demo package: corpus, batches, model, rules."""

import doctest
import importlib
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_dtensor as fdt
from flax_dtensor.demo import data, train
from flax_dtensor.demo import model as model_lib


@pytest.mark.parametrize(
  'name', ['flax_dtensor.demo.model', 'flax_dtensor.demo.train']
)
def test_docstring_examples(name):
  result = doctest.testmod(importlib.import_module(name))
  assert result.attempted > 0 and result.failed == 0


def test_corpus_is_shipped_plain_ascii():
  text = data.corpus_text()
  assert 100_000 < len(text) < 300_000
  assert "ALICE'S ADVENTURES IN WONDERLAND" in text
  assert text.isascii()
  assert data.decode(data.encode(text[:1000])) == text[:1000]


def test_batches_and_held_out_split():
  train_tokens, held_out = data.split_tokens()
  assert len(held_out) == pytest.approx(
    0.1 * (len(train_tokens) + len(held_out)), abs=1
  )
  batch = next(data.Batches(train_tokens, 4, 16, seed=0))
  assert batch.shape == (4, 17) and batch.dtype == np.int32
  again = next(data.Batches(train_tokens, 4, 16, seed=0))
  np.testing.assert_array_equal(batch, again)
  fixed = data.held_out_batch(8, 128)
  assert fixed.shape == (8, 129)
  # The held-out rows come from the end of the text, never from training.
  text = data.decode(fixed[0])
  assert text in data.decode(held_out)


def test_batches_refuse_short_text():
  with pytest.raises(ValueError, match='Expected more than 17 tokens'):
    data.Batches(np.zeros(10, np.int32), 2, 16)


def test_model_runs_on_one_device_without_rules():
  # The docstring example's model and shape: the eager ops it compiled
  # (~40) serve this forward too, whichever of the two runs first.
  lm = model_lib.make_model(layers=1)
  logits = lm(jnp.zeros((2, 16), jnp.int32))
  assert logits.shape == (2, 16, 256)
  assert bool(jnp.isfinite(logits).all())


def test_every_param_has_logical_axes_the_rules_know():
  abstract = nnx.eval_shape(lambda: model_lib.make_model())
  rules = train.default_rules()
  for path, param in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
    axes = param.get_metadata('out_sharding', None)
    assert axes, path
    assert set(axes) <= set(rules.names), (path, axes)


def test_default_plan_on_a_2x4_mesh():
  mesh = jax.sharding.AbstractMesh(
    (2, 4),
    ('data', 'model'),
    axis_types=(jax.sharding.AxisType.Auto,) * 2,
  )
  rules = train.default_rules()
  with jax.sharding.use_abstract_mesh(mesh), fdt.logical_axis_rules(rules):
    abstract = nnx.eval_shape(model_lib.make_model)
  plan = fdt.plan(abstract, mesh=mesh, rules=rules)
  P = jax.sharding.PartitionSpec
  assert plan['head/kernel'].spec == P('data', 'model')
  assert plan['embed/embedding'].spec == P('model', 'data')
  assert plan['layers/0/attn/out/kernel'].spec == P('model', None, 'data')
  assert plan['final_norm/scale'].spec == P(None)
  assert plan.bytes_per_device < 1.2 * plan.ideal_bytes_per_device


def test_train_step_lowers_the_loss():
  mesh = jax.make_mesh(
    (2, 4), ('data', 'model'), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  tokens = data.split_tokens()[0]
  batches = data.Batches(tokens, 8, 32, seed=0)
  with jax.set_mesh(mesh), fdt.logical_axis_rules(train.default_rules()):
    lm = model_lib.make_model(layers=1, max_length=32)
    optimizer = train.make_optimizer(lm, steps=15)
    assert lm.head.kernel[...].sharding.spec == jax.P('data', 'model')
    losses = [
      float(train.train_step(lm, optimizer, train.shard_batch(next(batches))))
      for _ in range(15)
    ]
    held_out = train.shard_batch(data.held_out_batch(8, 32))
    final = float(train.eval_loss(lm, held_out))
  assert losses[0] > 5.0
  assert losses[-1] < losses[0] - 1.5
  assert final < losses[0] - 1.5


def test_training_bar_says_compiling_until_the_first_step_ends():
  import io

  import rich.console

  from flax_dtensor.demo import run

  console = rich.console.Console(file=io.StringIO(), width=120)
  with run._training_bar(console) as progress:
    task = progress.add_task('train', total=3, status='compiling…')
    first = progress.columns[3].render(progress.tasks[task]).plain
  assert first == 'compiling…'
  assert run._status(2.3456, 0, 0.0) == 'loss 2.346  measuring speed…'
  assert run._status(2.0, 5, 12345.6) == 'loss 2.000  12,346 tokens/s'


def test_piped_progress_is_a_line_every_few_seconds():
  import io

  import rich.console

  from flax_dtensor.demo import run

  def progress(show):
    buffer = io.StringIO()
    console = rich.console.Console(file=buffer, width=80)  # Not a terminal.
    clock = iter([0.0, 1.0, 4.0, 9.0, 12.0, 13.0, 25.0, 26.0]).__next__
    with run._Progress(console, 7, show=show, every=10.0, clock=clock) as bar:
      for step in range(7):
        bar.update(step, 6.0 - step / 2, 1000.0 * step)
    return buffer.getvalue().splitlines()

  # After the first step, when 10 s have passed since the last line, and
  # after the last step.
  assert progress(show=True) == [
    'train step 1/7  loss 6.000  compiled  1 s',
    'train step 4/7  loss 4.500  3,000 tokens/s  12 s',
    'train step 6/7  loss 3.500  5,000 tokens/s  25 s',
    'train step 7/7  loss 3.000  6,000 tokens/s  26 s',
  ]
  assert progress(show=False) == []  # --quiet


def test_resumed_progress_counts_the_trainings_steps():
  """Resumed from step 4 of 7: 'train step 5/7' (compiling), not '1/3'."""
  import io

  import rich.console

  from flax_dtensor.demo import run

  buffer = io.StringIO()
  console = rich.console.Console(file=buffer, width=80)  # Not a terminal.
  clock = iter([0.0, 1.0, 4.0, 15.0]).__next__
  with run._Progress(
    console, 7, first=4, show=True, every=10.0, clock=clock
  ) as bar:
    for step in range(4, 7):
      bar.update(step, 6.0 - step / 2, 1000.0 * step)
  assert buffer.getvalue().splitlines() == [
    'train step 5/7  loss 4.000  compiled  1 s',
    'train step 7/7  loss 3.000  6,000 tokens/s  15 s',
  ]


def test_summary_at_80_columns_keeps_paths_whole():
  import io

  import rich.console
  from support.output_util import assert_fits

  from flax_dtensor.demo import run

  out = pathlib.Path('/tmp', *['a_rather_long_directory_name'] * 3, 'out')
  files = {k: str(out / k) for k in ('orbax', 'checkpoint', 'saved_model')}
  summary = {
    'files': files,
    'bytes': {k: 1_234_567 for k in files},
    'seconds': {'build model + optimizer': 1.5, 'train (incl. compile)': 60.0},
    'total_seconds': 61.5,
    'losses': [5.5 - i / 100 for i in range(300)],
    'loss_min': 2.51,
    'max_abs_logits_diff': 2.9e-6,
    'max_abs_logits': 8.3,
    'held_out_shape': [8, 128],
    'tf_subprocess': {'jax_imported': False},
  }
  buffer = io.StringIO()
  console = rich.console.Console(file=buffer, width=80)
  run._print_summary(console, summary, out)
  text = '\n'.join(line.rstrip() for line in buffer.getvalue().splitlines())
  assert_fits(
    text, 80, [*files.values(), out / 'rules.yaml', out / 'summary.json']
  )
  assert 'rules (YAML, for --rules)' in text
  assert '1.2 MiB' in text and '61.5' in text
  assert '5.50 5.07 4.65 4.22 3.79 3.36 2.94 2.51' in text  # Eight, spread.


def test_a_write_shows_while_it_runs_unless_quiet():
  """Piped, a line as it starts; on a terminal, rich's spinner with the
  seconds elapsed, gone when done; quiet, nothing."""
  import io

  import rich.console

  from flax_dtensor import _output

  def shown(terminal, show):
    buffer = io.StringIO()
    console = rich.console.Console(
      file=buffer, width=80, force_terminal=terminal
    )
    with _output.step('write SavedModel', show=show, console=console):
      console.print('inside', highlight=False)
    return buffer.getvalue()

  assert shown(False, True) == 'write SavedModel…\ninside\n'
  assert shown(False, False) == 'inside\n'
  live = shown(True, True)
  assert 'write SavedModel' in live and '0:00:0' in live
  assert live != 'inside\n'
  assert shown(True, False) == 'inside\n'


def test_a_failed_run_folder_stays_removed_after_late_writes(tmp_path):
  """A write that fails while another library's thread still writes into
  the run's temporary (Orbax's TensorStore writes go on after the first
  fails, and make their folders again): the temporary is removed again
  once that thread is done, and the previous output is left as it was."""
  import errno
  import os
  import threading
  import time

  from flax_dtensor.cli import _run_folder

  out = tmp_path / 'out'
  out.mkdir()
  (out / 'rules.yaml').write_text('previous\n')
  late = threading.Event()

  def write_late(folder):
    time.sleep(0.3)  # After the failure, and after the first removal.
    (folder / 'orbax' / 'ocdbt.process_0' / 'd').mkdir(parents=True)
    late.set()

  with pytest.raises(fdt.ExportError, match=r"'.*out'.*File too large"):
    with _run_folder.writing(out, needed=1) as tmp:
      threading.Thread(target=write_late, args=(tmp,), daemon=True).start()
      raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))
  assert late.is_set()
  assert sorted(p.name for p in tmp_path.iterdir()) == ['out']
  assert (out / 'rules.yaml').read_text() == 'previous\n'
  assert [p.name for p in out.iterdir()] == ['rules.yaml']


def test_a_run_folder_that_stays_after_a_failure_is_named(
  tmp_path, monkeypatch
):
  """A writer that keeps writing into the run's temporary past the bound:
  the error says where the partial output is left, not that it was
  removed."""
  import errno
  import os
  import re
  import threading

  from flax_dtensor.cli import _run_folder

  monkeypatch.setattr(_run_folder, '_LATE_WRITES_LIMIT_SECONDS', 0.3)
  out = tmp_path / 'out'
  out.mkdir()
  stop = threading.Event()

  def keep_writing(folder):
    while not stop.is_set():
      try:  # Races the removal: either may win a step.
        (folder / 'late').mkdir(parents=True, exist_ok=True)
      except OSError:
        pass

  from flax_dtensor._errors import DiskFullError

  with pytest.raises(
    DiskFullError,
    match=r"is unchanged, and the partial one may be left at '.*' \(some",
  ) as info:
    with _run_folder.writing(out, needed=1) as tmp:
      writer = threading.Thread(target=keep_writing, args=(tmp,), daemon=True)
      writer.start()
      raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))
  stop.set()
  writer.join(10)
  message = str(info.value)
  assert 'was removed' not in message
  assert re.search(
    rf"and the partial one may be left at '{re.escape(str(tmp))}' \("
    r'something kept writing there, or it could not be deleted\): delete it '
    r'if it is there\.',
    message,
  ), message
