"""`flax-dtensor export`: checkpoints and SavedModels from an Orbax
checkpoint or a manager's step, the values they hold, the inputs a
SavedModel serves, and every refusal. How the CLI tests run: tests/cli/conftest.py.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import textwrap

import numpy as np
import pytest
from flax import nnx
from support import cli_models
from support.cli_helpers import (
  DEMO_TARGET,
  assert_fits,
  bad_input,
  check_checkpoint,
  make_checkpoint,
  ok,
  run_cli,
  user_placement,
)
from support.cli_models import (
  LM_TARGET,
  USER_RULES,
  USER_TARGET,
  user_lm,
  user_model,
)

import flax_dtensor.dtensor as fdt_tf
from flax_dtensor.cli import _command, _loading, _served
from flax_dtensor.demo import verify

# TF DTensor on the suite's 8 devices, before any other TF operation.
pytestmark = pytest.mark.usefixtures('dtensor')


@pytest.fixture(scope='module')
def user_checkpoint(tmp_path_factory):
  """An Orbax checkpoint of `user_model`, and its values."""
  return make_checkpoint(USER_TARGET, tmp_path_factory.mktemp('user'))


def _export_demo(checkpoint, out, *args):
  """`export` of the demo's model from `checkpoint` to `out`."""
  return run_cli(
    'export', DEMO_TARGET, '--checkpoint', checkpoint, '--out', out, *args
  )


def test_export_missing_checkpoint(tmp_path):
  bad_input(
    _export_demo(tmp_path / 'missing', tmp_path / 'out'),
    'Checkpoint',
    'does not exist',
  )


def test_export_not_a_checkpoint(tmp_path):
  (tmp_path / 'empty').mkdir()
  bad_input(
    _export_demo(tmp_path / 'empty', tmp_path / 'out'),
    'holds no Orbax checkpoint',
  )


def test_export_corrupt_checkpoint(tmp_path):
  corrupt = tmp_path / 'corrupt'
  corrupt.mkdir()
  (corrupt / '_CHECKPOINT_METADATA').write_text('{not json')
  (corrupt / '_METADATA').write_text('\x00garbage')
  bad_input(
    _export_demo(corrupt, tmp_path / 'out'),
    'Cannot restore the Orbax checkpoint',
  )
  assert not (tmp_path / 'out' / 'checkpoint').exists()


def test_export_mesh_does_not_match_devices(tmp_path):
  checkpoint = tmp_path / 'ckpt'
  (checkpoint).mkdir()
  (checkpoint / '_METADATA').write_text('{}')
  bad_input(
    _export_demo(
      checkpoint,
      tmp_path / 'out',
      '--mesh',
      'data=4,model=4',
      '--cpu-devices',
      '8',
    ),
    '--mesh data=4,model=4 needs 16 devices, but JAX has 8 (cpu)',
    '--cpu-devices 16',
  )


def test_export_saved_model_needs_input_shape(tmp_path):
  checkpoint = tmp_path / 'ckpt'
  checkpoint.mkdir()
  (checkpoint / '_METADATA').write_text('{}')
  bad_input(
    _export_demo(checkpoint, tmp_path / 'out', '--saved-model'),
    '--saved-model needs',
  )


def test_export_demo_checkpoint_values(demo_export):
  _, out, expected, proc = demo_export
  stdout = ok(proc)
  # TensorFlow runs: none of its output reaches stderr.
  assert proc.stderr == ''
  assert 'Restored' in stdout and 'onto mesh data=2,model=4' in stdout
  report = check_checkpoint(out / 'checkpoint', expected)
  assert report['missing'] == [] and report['extra'] == []
  assert report['max_abs_diff'] == 0.0  # Bit-exact.
  layouts = report['layouts']
  assert layouts['head/kernel']['spec'] == [['data'], ['model']]


def test_export_demo_saved_model_logits(demo_export):
  _, out, expected, proc = demo_export
  ok(proc)
  logits, report = verify.verify_saved_model(
    out / 'saved_model', expected['__tokens__']
  )
  assert not report['jax_imported']
  assert logits.shape == (2, 128, 256)
  np.testing.assert_allclose(
    logits, expected['__logits__'], rtol=1e-4, atol=1e-4
  )


@pytest.mark.parametrize(
  'args, fragments',
  [
    (
      ['--input-shape', 'tokens:128:int32'],  # The batch dim forgotten.
      # Echoed as given: the size written, not the batch symbol.
      ['--input-shape tokens:128:int32', 'does not fit TransformerLM.__call__'],
    ),
    (
      ['--input-shape', 'tokens:1,128:int32', '--method', 'nope'],
      ["--method 'nope'", 'has no such method'],
    ),
  ],
  ids=['no-batch-dim', 'no-method'],
)
def test_export_bad_served_inputs_write_nothing(demo_export, args, fragments):
  tmp, _, _, _ = demo_export
  out = tmp / 'bad_inputs'
  proc = run_cli(
    'export',
    DEMO_TARGET,
    '--checkpoint',
    tmp / 'orbax',
    '--out',
    out,
    '--saved-model',
    *args,
  )
  bad_input(proc, *fragments)
  assert not out.exists()


def test_an_input_of_the_wrong_width_is_named_as_save_saved_model_does():
  """The check before an export, in `save_saved_model`'s words
  (tests/bridge/serving): the input, the shape it needs, the one given."""
  abstract = nnx.eval_shape(lambda: nnx.Linear(64, 8, rngs=nnx.Rngs(0)))
  specs = [_served.parse_input_shape('x:1,48:float32', static_batch=False)]
  with pytest.raises(_command.BadInputError) as raised:
    _served.check_served_inputs(abstract, '__call__', specs)
  assert str(raised.value) == (
    '--input-shape x:1,48:float32 does not fit Linear.__call__: calling it '
    'on inputs of these shapes fails with TypeError: dot_general requires '
    'contracting dimensions to have the same shape, got (48,) and (64,). '
    'Dimension 1 of x is 48 where the forward needs 64: expected '
    'x:1,64:float32, got x:1,48:float32. Pass one --input-shape per '
    'positional input, in order, with the batch dimension first (e.g. '
    'x:1,128:int32).'
  )


EXPLICIT_NET = """
import jax
from flax import nnx
from jax.sharding import PartitionSpec as P


class ExplicitNet(nnx.Module):
  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    self.up = nnx.Linear(
      16, 32, kernel_init=nnx.with_partitioning(init, ('embed', 'mlp')),
      rngs=rngs,
    )
    self.down = nnx.Linear(
      32, 8, kernel_init=nnx.with_partitioning(init, ('mlp', 'embed')),
      rngs=rngs,
    )

  def __call__(self, x):
    h = jax.nn.relu(self.up(x, out_sharding=P(None, 'model')))
    return self.down(h, out_sharding=P())  # Contracts over sharded 'mlp'.


def make():
  return ExplicitNet(nnx.Rngs(0))
"""


def test_export_on_explicit_axes_serves_a_forward_written_for_them(tmp_path):
  """--axis-types explicit: a forward with out_sharding= exports with a
  polymorphic batch and serves every batch size with JAX's values; on the
  default Auto axes the refusal names the option."""
  import warnings

  import orbax.checkpoint as ocp

  (tmp_path / 'explicit_net.py').write_text(EXPLICIT_NET)
  (tmp_path / 'rules.yaml').write_text(
    'logical_axis_rules:\n  - [embed, null]\n  - [mlp, model]\n'
  )
  target = f'{tmp_path / "explicit_net.py"}:make'
  namespace: dict = {}
  exec(compile(EXPLICIT_NET, 'explicit_net.py', 'exec'), namespace)
  with nnx.use_eager_sharding(False):
    model = namespace['make']()
  with warnings.catch_warnings(), ocp.StandardCheckpointer() as checkpointer:
    warnings.simplefilter('ignore')  # Orbax's own deprecations.
    checkpointer.save(tmp_path / 'orbax', nnx.state(model))
    checkpointer.wait_until_finished()
  common = (
    *('--checkpoint', tmp_path / 'orbax', '--rules', tmp_path / 'rules.yaml'),
    *('--saved-model', '--input-shape', 'x:1,16:float32'),
  )
  bad_input(
    run_cli('export', target, '--out', tmp_path / 'auto', *common),
    'ExplicitNet.__call__ is written for Explicit mesh axes',
    'Pass --axis-types explicit',
  )
  assert not (tmp_path / 'auto').exists()
  bad_input(
    run_cli('plan', target, '--axis-types', 'dta=explicit'),
    "'dta' is not an axis of --mesh (its axes: data, model)",
  )
  out = tmp_path / 'explicit'
  ok(
    run_cli('export', target, '--out', out, '--axis-types', 'explicit', *common)
  )
  _serves_rows_as_jax_runs_them(out / 'saved_model', model)


def _serves_rows_as_jax_runs_them(path, model):
  """The SavedModel at `path` serves 1, 3 and 8 rows as `model` computes
  them on one device (a mesh of its axes, each of size 1)."""
  import jax
  import tensorflow as tf

  served = tf.saved_model.load(str(path))
  mesh = jax.make_mesh((1, 1), ('data', 'model'), devices=jax.devices()[:1])
  for rows in (1, 3, 8):
    x = np.random.default_rng(rows).standard_normal((rows, 16), np.float32)
    (got,) = served.serve(tf.constant(x)).values()
    with jax.set_mesh(mesh):
      want = model(jax.numpy.asarray(x))
    np.testing.assert_allclose(
      got.numpy(), np.asarray(want), rtol=1e-5, atol=1e-5
    )


BATCH_SHARDED_NET = EXPLICIT_NET.replace(
  '  def __call__(self, x):\n',
  "  def __call__(self, x):\n    x = jax.sharding.reshard(x, P('data', None))\n",
)


def _saved_user_net(tmp_path, source, name):
  """The user's file `name` of `source` (its factory `make`), rules.yaml
  and an Orbax checkpoint of its model (orbax/), in `tmp_path`: the
  factory and the model saved."""
  import orbax.checkpoint as ocp

  (tmp_path / name).write_text(source)
  (tmp_path / 'rules.yaml').write_text(
    'logical_axis_rules:\n  - [embed, null]\n  - [mlp, model]\n'
  )
  namespace: dict = {}
  exec(compile(source, name, 'exec'), namespace)
  with nnx.use_eager_sharding(False):
    model = namespace['make']()
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / 'orbax', nnx.state(model))
    checkpointer.wait_until_finished()
  return namespace['make'], model


def test_export_traces_its_inputs_where_save_saved_model_does(tmp_path):
  """A forward that splits its batch over an Explicit axis (as bonsai's
  models do): the command line's check of --input-shape traces it on the
  serving mesh, as `save_saved_model` does, and the export serves every
  batch size (it blamed the right input shape: 'does not evenly divide
  the dimension size b')."""
  assert 'reshard(x' in BATCH_SHARDED_NET
  _, model = _saved_user_net(tmp_path, BATCH_SHARDED_NET, 'batch_net.py')
  out = tmp_path / 'out'
  ok(
    run_cli(
      'export',
      f'{tmp_path / "batch_net.py"}:make',
      *('--checkpoint', tmp_path / 'orbax', '--out', out),
      *('--rules', tmp_path / 'rules.yaml', '--axis-types', 'explicit'),
      *('--saved-model', '--input-shape', 'x:1,16:float32'),
    )
  )
  _serves_rows_as_jax_runs_them(out / 'saved_model', model)


def test_export_refuses_to_overwrite(demo_export):
  tmp, out, _, proc = demo_export
  ok(proc)
  bad_input(
    _export_demo(tmp / 'orbax', out),
    'already exists',
    '--overwrite',
  )


def _export_user(
  checkpoint, out, *args, target=USER_TARGET, rules=USER_RULES, **kwargs
):
  """`export` of `target` from `checkpoint` to `out`, with `rules` written
  to rules.yaml beside `out`."""
  rules_file = out.parent / 'rules.yaml'
  rules_file.write_text(rules)
  return run_cli(
    'export',
    target,
    *('--checkpoint', checkpoint, '--rules', rules_file, '--out', out),
    *args,
    **kwargs,
  )


def test_export_and_inspect_user_factory(user_checkpoint, tmp_path):
  orbax, expected = user_checkpoint
  out = tmp_path / 'out'
  stdout = ok(
    _export_user(orbax, out, '--mesh', 'data=2,model=4', env={'COLUMNS': '80'})
  )
  assert_fits(stdout, 80, [orbax, out / 'checkpoint'])
  report = check_checkpoint(out / 'checkpoint', expected)
  assert report['missing'] == [] and report['extra'] == []
  assert report['max_abs_diff'] == 0.0
  assert set(report['layouts']) == {
    'hidden/bias',
    'hidden/kernel',
    'out/kernel',
  }
  stdout = ok(run_cli('inspect', out / 'checkpoint'))
  assert '3 variables' in stdout
  (line,) = [x for x in stdout.splitlines() if 'hidden/kernel' in x]
  assert '(16, 6)' in line and 'float32' in line
  assert "P('data', None)" in line and 'data,unsharded' in line
  assert 'JAX mesh data=2,model=4; DTensor mesh data=2,model=4' in stdout


def test_export_takes_a_step_of_a_checkpoint_managers_run(tmp_path):
  """A run saved by `CheckpointManager` (steps 1 to 3, each its own values)
  exports its latest whole step, or the one `--step` names, onto the
  command line's mesh; `--step` is refused where it cannot apply."""
  import jax

  import flax_dtensor as fdt

  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  rules = fdt.LogicalRules.from_yaml_text(USER_RULES)
  model = fdt.init(user_model, mesh=mesh, rules=rules)
  run = tmp_path / 'run'
  manager = fdt_tf.CheckpointManager(run)
  values = {}
  for step in (1, 2, 3):
    kernel = model.hidden.kernel
    kernel.set_value(kernel.get_value() + 1.0)
    manager.save(step, model)
    values[step] = np.asarray(kernel.get_value())
  manager.close()
  rules_file = tmp_path / 'rules.yaml'
  rules_file.write_text(USER_RULES)
  args = ['export', USER_TARGET, '--checkpoint', run, '--rules', rules_file]
  for step in (None, 2):
    out = tmp_path / f'out-{step}'
    more = [] if step is None else ['--step', str(step)]
    stdout = ok(run_cli(*args, *more, '--out', out))
    assert str(run / str(step or 3)) in stdout  # What was restored.
    saved = fdt_tf.read_checkpoint(out / 'checkpoint')
    np.testing.assert_array_equal(saved['hidden/kernel'], values[step or 3])
  bad_input(
    run_cli(*args, '--step', '7', '--out', tmp_path / 'x'),
    '--step 7:',
    'holds no whole step 7; its latest steps are 1, 2, 3',
  )
  orbax = tmp_path / 'orbax'
  bad_input(
    run_cli(
      *args[:3], str(orbax), *args[4:], '--step', '1', '--out', tmp_path / 'x'
    ),
    '--step applies to a CheckpointManager directory',
  )
  empty = tmp_path / 'empty'
  empty.mkdir()
  (empty / 'flax_dtensor_steps.json').write_text('{"steps": {}}')
  bad_input(
    run_cli(*args[:3], str(empty), *args[4:], '--out', tmp_path / 'x'),
    'holds no whole step yet: nothing to export',
  )


def test_export_into_an_empty_current_directory(
  user_checkpoint, tmp_path, monkeypatch
):
  """`--out .` in an empty directory writes the run there (its parts moved
  in from a hidden folder inside it, the directory itself kept); once it
  holds a run, `--out .` is refused before any work."""
  orbax, expected = user_checkpoint
  here = tmp_path / 'here'
  here.mkdir()
  monkeypatch.chdir(here)
  rules = tmp_path / 'rules.yaml'
  rules.write_text(USER_RULES)
  args = ['export', USER_TARGET, '--checkpoint', orbax, '--rules', rules]
  args += ['--out', '.']
  ok(run_cli(*args))
  assert sorted(os.listdir(here)) == ['checkpoint']
  report = check_checkpoint(here / 'checkpoint', expected)
  assert report['max_abs_diff'] == 0.0 and report['missing'] == []
  assert pathlib.Path.cwd() == here
  line = bad_input(run_cli(*args, '--overwrite'), "--out '.' is the current")
  assert 'and is not empty' in line
  assert sorted(os.listdir(here)) == ['checkpoint']


def test_export_single_mesh(user_checkpoint, tmp_path):
  """--single-mesh: one DTensor mesh, what moved printed, values exact."""
  orbax, expected = user_checkpoint
  rules = textwrap.dedent("""\
    logical_axis_rules:
      - ['features', ['data', 'model']]
      - ['hidden', null]
      - ['classes', null]
    """)
  out = tmp_path / 'out'
  stdout = ok(
    _export_user(
      orbax, out, '--mesh', 'data=2,model=4', '--single-mesh', rules=rules
    )
  )
  assert (
    '3 variables on one DTensor mesh (data=2, model=4): 1 relaid by JAX'
    in stdout
  )
  (line,) = [x for x in stdout.splitlines() if x.startswith('  hidden/kernel')]
  assert line.split() == [
    'hidden/kernel',
    "P(('data',",
    "'model'),",
    'None)',
    "P('model')",
  ]
  assert "kept 'model', the largest, replicated over 'data'" in ' '.join(
    stdout.split()
  )
  report = check_checkpoint(out / 'checkpoint', expected)
  assert report['missing'] == [] and report['extra'] == []
  assert report['max_abs_diff'] == 0.0
  kernel = report['layouts']['hidden/kernel']
  assert kernel['spec'] == [['model'], []]
  assert kernel['dtensor_layout'] == {
    'sharding_specs': ['model', 'unsharded'],
    'mesh': {'axis_names': ['data', 'model'], 'axis_sizes': [2, 4]},
  }


def test_export_is_all_or_nothing(user_checkpoint, tmp_path):
  """A SavedModel that fails leaves no checkpoint behind, nor the --out."""
  orbax, _ = user_checkpoint
  out = tmp_path / 'out'
  args = (orbax, out, '--saved-model', '--input-shape')
  # A wrong feature size (8, the model takes 16): tracing the model fails,
  # after the checkpoint was written.
  failed = _export_user(*args, 'x:1,8:float32')
  assert failed.returncode != 0
  assert not out.exists()
  assert sorted(os.listdir(tmp_path)) == ['rules.yaml']
  # The corrected command runs, as if the first had never happened.
  ok(_export_user(*args, 'x:1,16:float32'))
  assert sorted(os.listdir(out)) == ['checkpoint', 'saved_model']


def _user_training_state(optimizer, *, ema=False):
  """`user_model` over 8 devices on 'data' and its `optimizer` (an optax
  transformation), in an nnx.Dict; with a copy of the model as `ema`."""
  with user_placement():
    model = user_model()
    more = {'ema': user_model()} if ema else {}
    return nnx.Dict(
      model=model,
      **more,
      optimizer=nnx.Optimizer(model, optimizer, wrt=nnx.Param),
    )


@pytest.fixture(scope='module')
def user_steps(tmp_path_factory):
  """A CheckpointManager folder of a training state: `user_model` under
  model/, a copy of it under ema/, and its optimizer under optimizer/."""
  import optax

  steps = tmp_path_factory.mktemp('user_steps') / 'steps'
  state = _user_training_state(optax.sgd(0.1), ema=True)
  manager = fdt_tf.CheckpointManager(steps)
  manager.save(1, state)
  manager.wait()
  manager.close()
  return steps


def test_export_part_of_a_manager_step(user_steps, tmp_path):
  """--part model exports the model's variables of a training state's
  step, as saved; the other groups are left out."""
  stdout = ok(_export_user(user_steps, tmp_path / 'out', '--part', 'model'))
  assert 'restored model/' in stdout and 'note:' not in stdout
  saved = fdt_tf.read_checkpoint(user_steps / '1')
  expected = {
    '/'.join(map(str, k[1:])): v for k, v in saved.items() if k[0] == 'model'
  }
  report = check_checkpoint(tmp_path / 'out' / 'checkpoint', expected)
  assert report['missing'] == [] and report['extra'] == []
  assert report['max_abs_diff'] == 0.0


@pytest.mark.parametrize(
  'args, target, fragments',
  [
    (
      [],
      USER_TARGET,
      [
        'holds the variables of the model under 2 groups: ema/, model/.',
        'Pass --part NAME to choose one (e.g. --part ema)',
      ],
    ),
    (
      ['--part', 'nope'],
      USER_TARGET,
      [
        '--part nope:',
        'holds no variable under nope/',
        'Its groups: ema/ (3 variables), model/ (3), optimizer/ (1).',
      ],
    ),
    (
      ['--part', 'model'],
      f'{cli_models.FILE}:user_hidden_only',
      [
        "The part model/ of the checkpoint '",
        'holds 1 variable(s) the target does not have: out/kernel',
      ],
    ),
    (
      ['--part', '/'],
      USER_TARGET,
      ["Malformed --part '/'", 'e.g. model'],
    ),
    (
      [],
      f'{cli_models.FILE}:user_model_with_head',
      [
        "and it lacks 5 of the target's variables: head/bias, head/kernel, "
        'hidden/bias, hidden/kernel, out/kernel.',
        'pass a TARGET that builds the model that was saved (the same '
        'configuration), or pass --part NAME for the group holding the '
        'model (it may be ema/ (3 variables), model/ (3)).',
      ],
    ),
  ],
  ids=[
    'two-groups-match',
    'no-such-part',
    'extra-in-part',
    'empty-part',
    'no-group-fits',
  ],
)
def test_export_part_refused(user_steps, tmp_path, args, target, fragments):
  bad_input(
    _export_user(user_steps, tmp_path / 'out', *args, target=target),
    *fragments,
  )
  assert not (tmp_path / 'out').exists()


def test_export_part_allow_extra(user_steps, tmp_path):
  """--allow-extra: the part's variables the model lacks are ignored."""
  stdout = ok(
    _export_user(
      user_steps,
      tmp_path / 'out',
      '--part',
      'model',
      '--allow-extra',
      target=f'{cli_models.FILE}:user_hidden_only',
    )
  )
  assert 'restored model/' in stdout
  saved = {
    '/'.join(map(str, k)): v
    for k, v in fdt_tf.read_checkpoint(tmp_path / 'out' / 'checkpoint').items()
  }
  assert sorted(saved) == ['hidden/bias', 'hidden/kernel']
  np.testing.assert_array_equal(
    saved['hidden/kernel'],
    fdt_tf.read_checkpoint(user_steps / '1')['model/hidden/kernel'],
  )


def test_export_the_model_of_an_orbax_training_state(tmp_path):
  """An Orbax checkpoint of nnx.state of a model and its optimizer: the
  model's part is found by its paths, read alone, and exported as saved."""
  import optax
  import orbax.checkpoint as ocp

  state = _user_training_state(optax.adam(0.1))
  orbax = tmp_path / 'orbax'
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(orbax, nnx.state(state))
    checkpointer.wait_until_finished()
  out = tmp_path / 'out'
  stdout = ok(_export_user(orbax, out))
  assert (
    f"note: '{orbax}' holds model/ (3 variables), optimizer/ (8); exporting "
    'model/'
  ) in ' '.join(stdout.split())
  expected = {
    '/'.join(map(str, k)): np.asarray(v.get_value())
    for k, v in nnx.to_flat_state(nnx.state(state['model']))
  }
  report = check_checkpoint(out / 'checkpoint', expected)
  assert report['missing'] == [] and report['extra'] == []
  assert report['max_abs_diff'] == 0.0


def _flip(path, offset, count=10):
  data = bytearray(path.read_bytes())
  offset = offset if offset >= 0 else len(data) + offset
  for i in range(offset, offset + count):
    data[i] ^= 0xFF
  path.write_bytes(bytes(data))


def _largest_data_file(orbax):
  return max(
    (orbax / 'ocdbt.process_0' / 'd').iterdir(), key=lambda p: p.stat().st_size
  )


UNVERIFIED = (
  "note: Orbax checkpoints carry no checksum of their arrays' bytes: "
  "TensorStore checked the OCDBT manifest's and tree nodes' CRC-32C and "
  "each chunk's framing as it read them, but damage inside the values "
  'cannot be detected. Steps of flax_dtensor.dtensor.CheckpointManager '
  'carry a CRC-32C of every byte.'
)


def test_export_says_orbax_values_are_unverified(demo_export, tmp_path):
  """10 bytes flipped inside a stored array (offset 2000 of the largest
  data file): Orbax's format has no checksum that covers them, so the
  export reads them as they are and says, before writing, that they could
  not be checked; the exported values are the damaged ones."""
  tmp, _, expected, _ = demo_export
  orbax = tmp_path / 'orbax'
  shutil.copytree(tmp / 'orbax', orbax)
  _flip(_largest_data_file(orbax), 2000)
  out = tmp_path / 'out'
  stdout = ok(
    run_cli('export', DEMO_TARGET, '--checkpoint', orbax, '--out', out)
  )
  assert UNVERIFIED in ' '.join(stdout.split())
  saved = {
    '/'.join(map(str, k)): v
    for k, v in fdt_tf.read_checkpoint(out / 'checkpoint').items()
  }
  assert sorted(saved) == sorted(k for k in expected if '__' not in k)
  wrong = sum(int((saved[k] != expected[k]).sum()) for k in saved)
  assert wrong > 0  # What the format cannot detect, exported as read.


@pytest.mark.parametrize(
  'damage, fragments',
  [
    (
      lambda orbax: _flip(orbax / 'manifest.ocdbt', -1, 1),
      ['Error decoding manifest: CRC-32C checksum verification failed'],
    ),
    (
      lambda orbax: _flip(
        max((orbax / 'd').iterdir(), key=lambda p: p.stat().st_size), -1, 1
      ),
      ['Error decoding b-tree node: CRC-32C checksum verification failed'],
    ),
  ],
  ids=['manifest-crc', 'tree-node-crc'],
)
# Orbax's restore leaves coroutines behind when TensorStore fails; they
# complain when collected ("Event loop is closed"), which is not ours.
@pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')
def test_export_refuses_damage_orbax_detects(
  user_checkpoint, tmp_path, damage, fragments
):
  """What the format checks (CRC-32C of OCDBT's manifest and tree nodes)
  is checked before anything is written: exit 2, in our words."""
  orbax = tmp_path / 'orbax'
  shutil.copytree(user_checkpoint[0], orbax)
  damage(orbax)
  out = tmp_path / 'out'
  proc = _export_user(orbax, out)
  bad_input(
    proc,
    f'The Orbax checkpoint {str(orbax)!r} is damaged',
    *fragments,
    'Nothing was written. Export from an intact copy',
  )
  assert not out.exists()


LM_SHAPES = (
  '--input-shape',
  'tokens:1,t:int32',
  '--input-shape',
  'positions:1,t:int32',
  '--input-shape',
  'cache:none',
  '--input-shape',
  'mask:1,t,t:bool',
)


@pytest.fixture(scope='module')
def lm_checkpoint(tmp_path_factory):
  """An Orbax checkpoint of the user's LLM, its rules, and its logits on
  batches of two sequence lengths (`{tokens,positions,mask,logits}_LEN`)."""
  import jax
  import orbax.checkpoint as ocp

  import flax_dtensor as fdt

  tmp = tmp_path_factory.mktemp('lm')
  mesh = jax.make_mesh(
    (8,), ('data',), axis_types=(jax.sharding.AxisType.Auto,)
  )
  with (
    jax.set_mesh(mesh),
    fdt.logical_axis_rules(
      [('features', 'data'), ('hidden', None), ('classes', None)]
    ),
  ):
    model = _loading.load_target(LM_TARGET)()
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp / 'orbax', nnx.state(model))
    checkpointer.wait_until_finished()
  rng = np.random.default_rng(0)
  arrays = {}
  for batch, length in ((2, 8), (3, 5)):
    tokens = rng.integers(0, 64, (batch, length)).astype(np.int32)
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), tokens.shape)
    mask = np.broadcast_to(
      np.tril(np.ones((length, length), bool)), (batch, length, length)
    )
    logits, cache = model(tokens, positions, None, mask)
    assert cache is None
    for k, v in (
      ('tokens', tokens),
      ('positions', positions),
      ('mask', mask),
      ('logits', logits),
    ):
      arrays[f'{k}_{length}'] = np.asarray(v)
  (tmp / 'rules.yaml').write_text(USER_RULES)
  return tmp, arrays


def _export_lm(tmp: pathlib.Path, out: pathlib.Path, *args: str):
  return run_cli(
    'export',
    LM_TARGET,
    '--checkpoint',
    tmp / 'orbax',
    '--rules',
    tmp / 'rules.yaml',
    '--out',
    out,
    '--saved-model',
    *args,
  )


def test_export_llm_style_saved_model(lm_checkpoint):
  """cache:none passes None; t is one length for every input."""
  import tensorflow as tf

  tmp, expected = lm_checkpoint
  proc = _export_lm(tmp, tmp / 'out', *LM_SHAPES)
  ok(proc)
  assert proc.stderr == ''
  served = tf.saved_model.load(str(tmp / 'out' / 'saved_model'))
  serve = served.signatures['serving_default']
  assert sorted(serve.structured_input_signature[1]) == [
    'mask',
    'positions',
    'tokens',
  ]
  for length in (8, 5):
    result = serve(
      **{
        k: tf.constant(expected[f'{k}_{length}'])
        for k in ('tokens', 'positions', 'mask')
      }
    )
    assert sorted(result) == ['output_0']
    np.testing.assert_allclose(
      result['output_0'].numpy(), expected[f'logits_{length}'], atol=1e-5
    )


@pytest.mark.parametrize(
  'args, fragments',
  [
    (
      [*LM_SHAPES[:4], *LM_SHAPES[6:]],  # No cache:none.
      [
        # Echoed as given, in save_saved_model's words.
        'Expected --input-shape to fit UserLM.__call__(tokens, positions, '
        'cache, attention_mask), which takes 4 positional arguments; got 3 '
        'entries: tokens:1,t:int32, positions:1,t:int32, mask:1,t,t:bool.',
        'NAME:none for an argument passed as None (e.g. --input-shape '
        'cache:none)',
      ],
    ),
    (
      [
        *('--input-shape', 'tokens:1,?:int32'),
        *('--input-shape', 'positions:1,?:int32'),
        *('--input-shape', 'cache:none'),
        *('--input-shape', 'mask:1,?,?:bool'),
      ],
      [
        'Tracing UserLM.__call__ for the SavedModel failed where its '
        'polymorphic dimensions meet',
        'Each ? dimension is a size of its own (to JAX: '
        'tokens:b,d0_1:int32, positions:b,d1_1:int32, mask:b,d3_1,d3_2:bool)',
        'e.g. --input-shape tokens:b,t:int32 --input-shape '
        'positions:b,t:int32 --input-shape cache:none --input-shape '
        'mask:b,t,t:bool if all are one length',
        '--input-shape mask:b,d1,d2:bool if those at the same position are',
      ],
    ),
    (
      [*LM_SHAPES, '--method', 'tagged'],
      [
        'Expected the result of UserLM.tagged to hold only arrays and None, '
        "got str at result[1]: 'v1'"
      ],
    ),
    (
      [*LM_SHAPES[:-1], 'mask:1,max,t:bool'],
      [
        'Malformed --input-shape mask:1,max,t:bool: JAX cannot read its '
        'dimensions (b, max, t)'
      ],
    ),
  ],
  ids=['no-cache', 'lengths-of-their-own', 'not-an-array', 'jax-name'],
)
def test_export_llm_style_bad_inputs(lm_checkpoint, args, fragments):
  tmp, _ = lm_checkpoint
  out = tmp / 'bad'
  bad_input(_export_lm(tmp, out, *args), *fragments)
  assert not out.exists()


def _lm_signature(*, cache=True, extra=False, lengths='t'):
  """The Python `input_signature` that LM_SHAPES-like flags give."""
  import tensorflow as tf

  own = lengths == '?'
  signature = [
    tf.TensorSpec([None, None], tf.int32, name='tokens'),
    tf.TensorSpec([None, None], tf.int32, name='positions'),
    *([None] if cache else []),
    tf.TensorSpec([None, None, None], tf.bool, name='mask'),
    *([None] if extra else []),
  ]
  polymorphic = None if own else ['(b, t)', '(b, t)', None, '(b, t, t)']
  return signature, polymorphic


# The same bad input, as flags and as `input_signature`: (the flags, the
# keywords of `save_saved_model`, the words both say).
SAID_ALIKE = {
  'arity': (
    [*LM_SHAPES[:4], *LM_SHAPES[6:]],
    dict(cache=False),
    r'to fit UserLM\.__call__\(tokens, positions, cache, attention_mask\), '
    r'which takes 4 positional arguments; got 3 entries: ',
  ),
  'slot': (
    [*LM_SHAPES, '--input-shape', 'extra:none'],
    dict(extra=True),
    r'to fit UserLM\.__call__\(tokens, positions, cache, attention_mask\), '
    r'which takes 4 positional arguments; got 5 entries: ',
  ),
  'own-symbol': (
    [
      *('--input-shape', 'tokens:1,?:int32'),
      *('--input-shape', 'positions:1,?:int32'),
      *('--input-shape', 'cache:none'),
      *('--input-shape', 'mask:1,?,?:bool'),
    ],
    dict(lengths='?'),
    r'^(error: )?Tracing UserLM\.__call__ for the SavedModel failed where '
    r'its polymorphic dimensions meet \(.+\)\. .*a size of its own.*which '
    r'JAX cannot know to equal another.* e\.g\. .* if all are one length '
    r'\(e\.g\. a sequence length\), or .* if those at the same position '
    r'are\.$',
  ),
}


@pytest.mark.parametrize('check', list(SAID_ALIKE), ids=list(SAID_ALIKE))
def test_served_inputs_are_refused_in_save_saved_model_s_words(
  lm_checkpoint, tmp_path, check
):
  """One check of the served inputs (dtensor._serving): `flax-dtensor
  export` and `fdt_tf.save_saved_model` refuse the same bad input with
  the same message, each naming the inputs its own way."""
  import jax

  import flax_dtensor as fdt

  flags, keywords, said = SAID_ALIKE[check]
  tmp, _ = lm_checkpoint
  line = bad_input(_export_lm(tmp, tmp_path / 'cli', *flags))
  assert re.search(said, line), line
  mesh = jax.make_mesh(
    (8,), ('data',), axis_types=(jax.sharding.AxisType.Auto,)
  )
  rules = [('features', 'data'), ('hidden', None), ('classes', None)]
  with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
    model = user_lm()
    signature, polymorphic = _lm_signature(**keywords)
    with pytest.raises(fdt.ExportError, match=said):
      fdt_tf.save_saved_model(
        model,
        tmp_path / 'python',
        input_signature=signature,
        polymorphic_shapes=polymorphic,
      )
  assert not (tmp_path / 'python').exists()
  assert not (tmp_path / 'cli').exists()


def test_a_forward_for_explicit_axes_on_auto_ones_is_refused_alike(tmp_path):
  """The Auto-axes check of the served inputs: `flax-dtensor export` on
  the default Auto axes and `fdt_tf.save_saved_model` of the model on an
  Auto mesh say the same, each with its own fix."""
  import jax
  import tensorflow as tf

  import flax_dtensor as fdt

  said = (
    r'ExplicitNet\.__call__ is written for Explicit mesh axes \(it says '
    r'where results go, with out_sharding= or jax\.sharding\.reshard\), but '
    r"the mesh's axes are Auto: JAX refuses it \(.+\)\. "
  )
  make, _ = _saved_user_net(tmp_path, EXPLICIT_NET, 'explicit_net.py')
  line = bad_input(
    run_cli(
      'export',
      f'{tmp_path / "explicit_net.py"}:make',
      *('--checkpoint', tmp_path / 'orbax', '--out', tmp_path / 'cli'),
      *('--rules', tmp_path / 'rules.yaml'),
      *('--saved-model', '--input-shape', 'x:1,16:float32'),
    ),
    'Pass --axis-types explicit',
  )
  assert re.search(said, line), line
  mesh = jax.make_mesh(
    (2, 4), ('data', 'model'), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  with (
    jax.set_mesh(mesh),
    fdt.logical_axis_rules([('embed', None), ('mlp', 'model')]),
  ):
    model = make()
    with pytest.raises(
      fdt.ExportError, match=said + r'Place the model on a mesh of Explicit'
    ):
      fdt_tf.save_saved_model(
        model,
        tmp_path / 'python',
        input_signature=[tf.TensorSpec([None, 16], tf.float32, name='x')],
      )
  assert not (tmp_path / 'python').exists()
