"""A model in another library's style (tests/support/gemma_style.py).

Mesh-axis annotations set with ``nnx.Param(value, sharding=...)``, einsum
layers, and an import that turns Flax's eager sharding off: the plan,
``fdt.check``, eager creation, ``fdt.init``, ``fdt.shard_module``,
checkpoints and the command line agree with each other and with where the
arrays are, by values.
"""

import contextlib
import json
import os
import warnings

import flax
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from support import creation_values, forwards, processes, warm

import flax_dtensor as fdt

# That library's own spelling; Flax deprecates it.
pytestmark = pytest.mark.filterwarnings(
  "ignore:'sharding' is deprecated:DeprecationWarning"
)

ROOT = os.path.dirname(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
SUPPORT = os.path.join(ROOT, 'tests', 'support')


@pytest.fixture
def gemma():
  """The module, imported as a user's program imports it: from then on the
  flag is off. Restored after the test, so no other test sees it."""
  before = flax.config.flax_always_shard_variable
  from support import gemma_style

  flax.config.update('flax_always_shard_variable', False)
  try:
    yield gemma_style
  finally:
    flax.config.update('flax_always_shard_variable', before)


@pytest.fixture(scope='module')
def initialized():
  """`initialized(kind)`: fdt.init of the model on the (2, 4) mesh of that
  kind, its rules from the mesh's axes; built once per module and kind (each
  `fdt.init` compiles the model's whole initialization), called inside
  tests, with eager sharding off as `gemma` leaves it."""
  built = {}

  def get(kind='auto'):
    if kind not in built:
      from support import gemma_style

      mesh = _mesh(kind)
      rules = fdt.LogicalRules.for_mesh_axes(mesh)
      built[kind] = fdt.init(gemma_style.make_model, mesh=mesh, rules=rules)
    return built[kind]

  return get


def _mesh(kind='auto'):
  types = {'auto': AxisType.Auto, 'explicit': AxisType.Explicit}[kind]
  return jax.make_mesh((2, 4), ('fsdp', 'tp'), axis_types=(types,) * 2)


def _placement(model):
  return {
    '/'.join(map(str, path)): v.get_value().sharding.spec
    for path, v in nnx.to_flat_state(nnx.state(model))
  }


def _values(model):
  return {
    '/'.join(map(str, path)): np.asarray(v.get_value())
    for path, v in nnx.to_flat_state(nnx.state(model))
  }


def _assert_agree(model, mesh, rules):
  """plan = nnx.get_partition_spec = where the arrays are, every variable."""
  with fdt.logical_axis_rules(rules):
    plan = fdt.plan(model, mesh=mesh)
    queried = {
      '/'.join(map(str, p)): v.get_value()
      for p, v in nnx.to_flat_state(nnx.get_partition_spec(nnx.state(model)))
    }
  placed = _placement(model)
  assert {e.path: e.spec for e in plan.entries} == queried == placed
  assert not any(e.misplaced for e in plan.entries)
  return plan


def test_importing_it_turns_eager_sharding_off():
  """In a process of its own: what importing the module does."""
  code = (
    'import flax\n'
    'from support import gemma_style\n'
    'print(flax.config.flax_always_shard_variable)'
  )
  proc = processes.run_python(
    '-W',
    'ignore',
    '-c',
    code,
    env=processes.clean_env(support=True),
    timeout=120,
  )
  assert proc.stdout.strip() == 'False', proc.stderr[-2000:]


@pytest.mark.parametrize('how', ['ours', 'flax', 'none'])
def test_plan_of_a_factory_under_every_way_rules_are_set(gemma, how):
  mesh = _mesh()
  context = {
    'ours': lambda: fdt.logical_axis_rules(
      fdt.LogicalRules.for_mesh_axes(mesh)
    ),
    'flax': lambda: nnx.logical_axis_rules((('fsdp', 'fsdp'), ('tp', 'tp'))),
    'none': contextlib.nullcontext,
  }[how]
  with context():
    plan = fdt.plan(gemma.make_model, mesh=mesh)
    report = fdt.check(gemma.make_model, mesh=mesh)
  assert plan['embedder/input_embedding'].spec == P('tp', 'fsdp')
  assert plan['layers/0/attn/kv_einsum/w'].spec == P(None, 'tp', 'fsdp', None)
  assert plan['layers/1/mlp/gating_einsum'].spec == P(None, 'fsdp', 'tp')
  assert len(plan.entries) == 30
  sizes = {'fsdp': 2, 'tp': 4}
  assert plan.bytes_per_device == sum(
    e.bytes // np.prod([sizes[a] for a in e.spec if a is not None])
    for e in plan.entries
  )
  # The import turned eager sharding off: calling the factory would create
  # every variable the rules shard (all 30) unplaced, and check says so.
  assert report.codes() == ('eager-sharding-off',), str(report)
  sharded = [e.path for e in plan.entries if any(e.spec)]
  assert [f.subject for f in report.findings] == sharded
  assert len(sharded) == 30
  with context(), nnx.use_eager_sharding(True):
    assert not fdt.check(gemma.make_model, mesh=mesh)


def test_flax_rules_are_checked_with_flax_semantics(gemma):
  mesh = _mesh()
  with nnx.logical_axis_rules((('tp', 'fsdp'), ('tp', 'tp'), ('fsdp', 'fsdp'))):
    report = fdt.check(
      gemma.make_model, mesh=mesh, allow=['eager-sharding-off']
    )
  (finding,) = report.findings
  assert finding.code == 'shadowed-rule'
  assert finding.subject == "('tp', 'fsdp')"
  assert 'the later rule' in finding.message and 'last rule' in finding.message


def test_no_rules_and_a_name_that_is_no_mesh_axis(gemma):
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  with pytest.raises(
    fdt.UnknownLogicalAxisError,
    match=r"maps to 'tp', which is not an axis of the mesh .* No rules are in "
    r"effect, so Flax's semantics apply: each name in an annotation is used "
    r'as a mesh axis name\. .*for_mesh_axes',
  ):
    fdt.plan(gemma.make_model, mesh=mesh)


@pytest.mark.parametrize('kind', ['auto', 'explicit'])
def test_eager_sharding_off_is_said_once_and_reported(gemma, kind):
  mesh = _mesh(kind)
  rules = fdt.LogicalRules.for_mesh_axes(mesh)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always', fdt.EagerShardingOffWarning)
    with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
      model = gemma.make_model()
      gemma.make_model(1)  # The same block: said once.
    with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
      gemma.make_model(2)  # Another block: said again.
  said = [w for w in caught if w.category is fdt.EagerShardingOffWarning]
  assert len(said) == 2
  assert str(said[0].message).startswith(
    'flax_dtensor did not place 30 variables of Transformer that the rules '
    'in effect cover'
  )
  assert 'flax_always_shard_variable is False' in str(said[0].message)
  # Points at the line that called the outermost constructor.
  assert said[0].filename == gemma.__file__
  # Nothing was placed, and the plan and the check say why.
  assert all(not any(spec) for spec in _placement(model).values())
  plan = fdt.plan(model, mesh=mesh, rules=rules)
  assert all(e.misplaced for e in plan.entries)
  assert plan['layers/0/attn/q_einsum/w'].misplaced_reason.startswith(
    'created while eager sharding was off'
  )
  assert 'Not where the rules say: 30 variables' in str(plan)
  report = fdt.check(model, rules, mesh)
  assert report.codes() == ('eager-sharding-off',)
  assert len(report.findings) == 30


def test_a_deliberate_use_eager_sharding_false_is_not_warned(gemma):
  mesh = _mesh()
  flax.config.update('flax_always_shard_variable', True)
  with warnings.catch_warnings():
    warnings.simplefilter('error', fdt.EagerShardingOffWarning)
    with (
      jax.set_mesh(mesh),
      fdt.logical_axis_rules(fdt.LogicalRules.for_mesh_axes(mesh)),
      nnx.use_eager_sharding(False),
    ):
      model = gemma.make_model()
  plan = fdt.plan(model, mesh=mesh, rules=fdt.LogicalRules.for_mesh_axes(mesh))
  assert all(e.misplaced_reason for e in plan.entries)


@pytest.mark.parametrize('kind', ['auto', 'explicit'])
def test_every_entry_point_places_as_planned(gemma, initialized, kind):
  mesh = _mesh(kind)
  rules = fdt.LogicalRules.for_mesh_axes(mesh)
  plain = _values(gemma.make_model())
  # Eager creation, eager sharding turned back on for the build.
  with (
    nnx.use_eager_sharding(True),
    jax.set_mesh(mesh),
    fdt.logical_axis_rules(rules),
  ):
    eager = gemma.make_model()
  # fdt.init, whatever the flag.
  built = initialized(kind)
  # shard_module on a model built unplaced.
  moved = fdt.shard_module(gemma.make_model(), mesh=mesh, rules=rules)
  for model in (eager, built, moved):
    plan = _assert_agree(model, mesh, rules)
    assert plan['layers/2/attn/q_einsum/w'].spec == P('tp', 'fsdp', None)
    values = _values(model)
    assert values.keys() == plain.keys()
    for path, value in plain.items():
      if model is moved:  # Placed, not computed: bit for bit.
        np.testing.assert_array_equal(values[path], value, err_msg=path)
      else:
        creation_values.assert_close(values[path], value, err_msg=path)


def test_shard_module_puts_uncovered_variables_on_the_mesh(gemma):
  mesh = _mesh()
  rules = fdt.LogicalRules([('fsdp', 'fsdp')], unknown='replicate')
  model = gemma.make_model()
  model.extra = nnx.Param(jax.numpy.arange(8.0))  # No annotation at all.
  assert not isinstance(
    model.extra.get_value().sharding, jax.sharding.NamedSharding
  )
  fdt.shard_module(model, mesh=mesh, rules=rules)
  extra = model.extra.get_value()
  assert extra.sharding.mesh == mesh and extra.sharding.spec == P()
  np.testing.assert_array_equal(np.asarray(extra), np.arange(8.0))
  plan = fdt.plan(model, mesh=mesh, rules=rules)
  # One entry per dimension, as jax.typeof spells the same placement.
  assert plan['extra'].spec == P(None) and not plan['extra'].misplaced
  assert plan['extra'].source == 'none (replicated)'


def test_checkpoints_round_trip_onto_another_mesh(gemma, initialized, tmp_path):
  tf = pytest.importorskip('tensorflow')
  del tf
  from flax_dtensor import dtensor as fdt_tf

  fdt_tf.initialize()
  model = initialized('auto')
  path = fdt_tf.save_checkpoint(model, tmp_path / 'ckpt')
  other = jax.make_mesh((4, 2), ('fsdp', 'tp'))
  with (
    jax.set_mesh(other),
    fdt.logical_axis_rules(fdt.LogicalRules.for_mesh_axes(other)),
  ):
    target = nnx.eval_shape(lambda: gemma.make_model(7))
    restored = fdt_tf.restore_checkpoint(path, target)
  _assert_agree(restored, other, fdt.LogicalRules.for_mesh_axes(other))
  want = _values(model)
  for key, value in _values(restored).items():
    np.testing.assert_array_equal(value, want[key], err_msg=key)


def test_the_plan_shows_path_rules_that_annotations_shadow(gemma):
  mesh = _mesh()
  rules = fdt.LogicalRules.for_mesh_axes(
    mesh, path_rules=[('einsum/w$', P('fsdp'))]
  )
  plan = fdt.plan(gemma.make_model, mesh=mesh, rules=rules)
  entry = plan['layers/0/attn/q_einsum/w']
  assert entry.spec == P('tp', 'fsdp', None)
  assert entry.source == (
    "annotation (over path rule #0 'einsum/w$', which has no override=True)"
  )
  assert plan['final_norm/scale'].source == 'annotation'
  text = plan.render(width=240)  # The table, with its long sources.
  header = next(line for line in text.splitlines() if 'path' in line)
  assert 'source' in header


def test_for_mesh_axes_refuses_what_is_not_a_mesh():
  with pytest.raises(
    fdt.LogicalRulesError, match=r'Expected a mesh or a sequence of its axis'
  ):
    fdt.LogicalRules.for_mesh_axes('fsdp')


def _cli(*args):
  """`flax-dtensor ARGS`, run in this process (tests/support/cli_runner.py).

  The command imports gemma_style.py as a user's file, which turns eager
  sharding off: the tests that call it take the `gemma` fixture, which
  turns it back on after them.
  """
  from support import cli_runner

  return cli_runner.run(*args, env={'COLUMNS': '200'})


def test_the_command_line_takes_mesh_axis_annotations_as_they_are(gemma):
  del gemma  # The flag restored after the command imports the module.
  target = os.path.join(SUPPORT, 'gemma_style.py') + ':make_model'
  mesh = ('--mesh', 'fsdp=2,tp=4')
  proc = _cli('plan', target, *mesh, '--mesh-axis-names', '--json')
  assert proc.returncode == 0, proc.stderr[-3000:]
  variables = {v['path']: v for v in json.loads(proc.stdout)['variables']}
  assert variables['embedder/input_embedding']['spec'] == ['tp', 'fsdp']
  assert variables['layers/3/mlp/linear']['spec'] == ['tp', 'fsdp']
  assert len(variables) == 30
  # The only findings: importing the module turned eager sharding off, so
  # calling the factory creates each variable unplaced.
  proc = _cli('plan', target, *mesh, '--mesh-axis-names', '--check', '--json')
  assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
  findings = json.loads(proc.stdout)['findings']
  assert {f['code'] for f in findings} == {'eager-sharding-off'}
  assert sorted(f['subject'] for f in findings) == sorted(variables)
  # Without it, the demo's rules name none of these axes: bad input (2).
  proc = _cli('plan', target, *mesh)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert '--mesh-axis-names' in proc.stderr


# Serves a SavedModel in a process that cannot import JAX: argv[1] the
# SavedModel, then an .npz of inputs and the .npz to write the outputs to,
# for each batch; prints the input names.
_SERVE = (
  processes.NO_JAX
  + """
import sys, json
import numpy as np, tensorflow as tf
serve = tf.saved_model.load(sys.argv[1]).signatures['serving_default']
for inputs_file, outputs_file in zip(sys.argv[2::2], sys.argv[3::2]):
  with np.load(inputs_file) as f:
    inputs = {k: tf.constant(f[k]) for k in f.files}
  out = serve(**inputs)
  np.savez(outputs_file, **{k: v.numpy() for k, v in out.items()})
print(json.dumps(sorted(serve.structured_input_signature[1])))
"""
)


def _served_without_jax(path, batches, tmp_path):
  """(input names, [outputs of each batch]): served in a process of its own
  that cannot import JAX."""
  args = []
  for i, inputs in enumerate(batches):
    np.savez(tmp_path / f'inputs_{i}.npz', **inputs)
    args += [tmp_path / f'inputs_{i}.npz', tmp_path / f'outputs_{i}.npz']
  script = tmp_path / 'serve.py'
  script.write_text(_SERVE)
  proc = warm.tf_only().run(script, path, *args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  outputs = []
  for i in range(len(batches)):
    with np.load(tmp_path / f'outputs_{i}.npz') as f:
      outputs.append(dict(f))
  return json.loads(proc.stdout.strip().splitlines()[-1]), outputs


def _served(path, inputs):
  """(input names, outputs): served in this process's TensorFlow."""
  import tensorflow as tf

  serve = tf.saved_model.load(str(path)).signatures['serving_default']
  out = serve(**{k: tf.constant(v) for k, v in inputs.items()})
  names = sorted(serve.structured_input_signature[1])
  return names, {k: v.numpy() for k, v in out.items()}


def _llm_inputs(gemma, batch, length):
  tokens = (np.arange(batch * length).reshape(batch, length) * 7) % 256
  positions = np.broadcast_to(np.arange(length), (batch, length))
  return {
    'tokens': tokens.astype(np.int32),
    'positions': np.ascontiguousarray(positions, np.int32),
    'mask': np.asarray(gemma.causal_mask(length, batch)),
  }


SIZES = ((1, 5), (3, 9))


def test_its_forward_serves_in_plain_tensorflow(gemma, initialized, tmp_path):
  """(tokens, positions, cache=None, mask) -> (logits, None), no wrapper;
  served in a process of its own, without JAX."""
  pytest.importorskip('tensorflow')
  import tensorflow as tf

  from flax_dtensor import dtensor as fdt_tf

  fdt_tf.initialize()
  model = initialized('auto')
  path = fdt_tf.save_saved_model(
    model,
    tmp_path / 'sm',
    input_signature=[
      tf.TensorSpec([None, None], tf.int32, name='tokens'),
      tf.TensorSpec([None, None], tf.int32, name='positions'),
      None,
      tf.TensorSpec([None, None, None], tf.bool, name='mask'),
    ],
    polymorphic_shapes=['(b, t)', '(b, t)', None, '(b, t, t)'],
  )
  batches = [_llm_inputs(gemma, batch, length) for batch, length in SIZES]
  names, served = _served_without_jax(path, batches, tmp_path)
  assert names == ['mask', 'positions', 'tokens']
  forward = forwards.jitted(model)  # A compile a size, not one an op.
  for inputs, outputs in zip(batches, served, strict=True):
    assert list(outputs) == ['output_0']
    logits, cache = forward(
      inputs['tokens'], inputs['positions'], None, inputs['mask']
    )
    assert cache is None
    np.testing.assert_allclose(
      outputs['output_0'], np.asarray(logits), rtol=1e-5, atol=1e-5
    )


def test_the_command_line_exports_it_and_serves_it(gemma, tmp_path):
  pytest.importorskip('tensorflow')
  pytest.importorskip('orbax.checkpoint')
  target = os.path.join(SUPPORT, 'gemma_style.py') + ':make_model'
  import orbax.checkpoint as ocp

  from flax_dtensor import dtensor as fdt_tf

  fdt_tf.initialize()  # Before any other TensorFlow operation.
  # An Orbax checkpoint of the model, as training in that library writes it
  # (eager sharding off: the module's import turned it off).
  with (
    warnings.catch_warnings(),
    ocp.StandardCheckpointer() as checkpointer,
  ):
    warnings.simplefilter('ignore')  # Orbax's own deprecations.
    checkpointer.save(tmp_path / 'orbax', nnx.state(gemma.make_model()))
    checkpointer.wait_until_finished()
  proc = _cli(
    'export',
    target,
    '--checkpoint',
    str(tmp_path / 'orbax'),
    '--out',
    str(tmp_path / 'out'),
    '--mesh',
    'fsdp=2,tp=4',
    '--mesh-axis-names',
    '--saved-model',
    *('--input-shape', 'tokens:1,t:int32'),
    *('--input-shape', 'positions:1,t:int32'),
    *('--input-shape', 'cache:none'),
    *('--input-shape', 'mask:1,t,t:bool'),
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  inputs = _llm_inputs(gemma, 2, 7)
  names, outputs = _served(tmp_path / 'out' / 'saved_model', inputs)
  assert names == ['mask', 'positions', 'tokens']
  with nnx.use_eager_sharding(False):
    model = gemma.make_model()
  logits, _ = model(inputs['tokens'], inputs['positions'], None, inputs['mask'])
  np.testing.assert_allclose(
    outputs['output_0'], np.asarray(logits), rtol=1e-5, atol=1e-5
  )
