"""Tests of flax_dtensor.dtensor.restore_from_tf: JAX -> TF fine-tune -> JAX.

A model trained a few steps in JAX is exported with `trainable=nnx.Param`;
one JAX-free TF process loads it, fine-tunes it with SGD steps and saves
what it changed every way TF users do (`tf.saved_model.save` of the loaded
object and of a wrapper, `tf.train.Checkpoint` `write` and `save`), plus
the malformed checkpoints the refusals are about. Back in JAX, each source
is restored into a fresh model under another mesh and other rules than the
export's, bit for bit with the values TF dumped, placed as the target says.
"""

import json
import textwrap

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from support import processes, warm

import flax_dtensor as fdt

tf = pytest.importorskip('tensorflow')
fdt_tf = pytest.importorskip('flax_dtensor.dtensor')

RULES = [('embed', 'data'), ('mlp', 'model')]
STEPS = 3  # TF's SGD steps.


def _part(names):
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


class Net(nnx.Module):
  """Two annotated layers (and unannotated biases)."""

  def __init__(self, rngs, *, width=16, first='l1'):
    setattr(
      self,
      first,
      nnx.Linear(8, width, kernel_init=_part(('embed', 'mlp')), rngs=rngs),
    )
    self.first = first
    self.l2 = nnx.Linear(
      width, 4, kernel_init=_part(('mlp', 'embed')), rngs=rngs
    )

  def __call__(self, x):
    return self.l2(jax.nn.relu(getattr(self, self.first)(x)))


def _flat(module):
  return {
    '/'.join(map(str, p)): v.get_value()
    for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))
  }


# The one TF process: fine-tune, save every way, write the bad checkpoints.
_SCRIPT = processes.NO_JAX + textwrap.dedent(
  """
  import json, os, sys
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  import numpy as np
  import tensorflow as tf
  from tensorflow.core.protobuf import trackable_object_graph_pb2 as pb

  job = json.load(open(sys.argv[1]))
  out = job['out']
  loaded = tf.saved_model.load(job['saved_model'])
  x = tf.constant(np.load(job['x']))
  first_served = loaded(x)['output_0'].numpy().tolist()
  losses = []
  for _ in range(job['steps']):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(loaded(x)['output_0'] ** 2)
    grads = tape.gradient(loss, loaded.trainable_variables)
    for v, g in zip(loaded.trainable_variables, grads):
      v.assign_sub(0.1 * g)
    losses.append(float(loss))
  os.makedirs(os.path.join(out, 'values'))
  for v in loaded.variables:
    name = v.name.rpartition(':')[0].replace('/', '|')
    np.save(os.path.join(out, 'values', name + '.npy'), v.numpy())
  report = {
    'losses': losses,
    'first_served': first_served,
    'tuned_served': loaded(x)['output_0'].numpy().tolist(),
  }
  # Re-saved as TF users do, its signatures kept and no options: the
  # gradients are saved too.
  try:
    tf.saved_model.save(
      loaded, os.path.join(out, 'resaved'), signatures=loaded.signatures)
    report['resaved'] = 'ok'
  except Exception as e:
    report['resaved'] = f'{type(e).__name__}: {e}'
  # The fallback for a TF that refuses to save the gradients: a re-save
  # that serves (and whose variables restore) but no longer trains.
  tf.saved_model.save(
    loaded,
    os.path.join(out, 'resaved_serve_only'),
    options=tf.saved_model.SaveOptions(experimental_custom_gradients=False),
  )
  wrapper = tf.Module()
  wrapper.base = loaded
  tf.saved_model.save(wrapper, os.path.join(out, 'wrapped'))
  checkpoint = tf.train.Checkpoint(model=loaded)
  checkpoint.write(os.path.join(out, 'written', 'ckpt'))
  report['saved'] = checkpoint.save(os.path.join(out, 'saved', 'ckpt'))
  # The re-saved SavedModel serves the fine-tuned values and still trains.
  again = tf.saved_model.load(os.path.join(out, 'resaved'))
  report['resaved_served'] = again(x)['output_0'].numpy().tolist()
  report['resaved_signatures'] = sorted(again.signatures)
  with tf.GradientTape() as tape:
    loss = tf.reduce_mean(again(x)['output_0'] ** 2)
  grads = tape.gradient(loss, again.trainable_variables)
  report['resaved_grads'] = [g is not None for g in grads]

  # What restore_from_tf refuses.
  def raw(name, tensors):
    tf.raw_ops.SaveV2(
      prefix=os.path.join(out, name, 'ckpt'),
      tensor_names=list(tensors),
      shape_and_slices=[''] * len(tensors),
      tensors=list(tensors.values()))

  def graph(*nodes):
    g = pb.TrackableObjectGraph()
    for children, key in nodes:
      node = g.nodes.add()
      for local_name, node_id in children:
        node.children.add(node_id=node_id, local_name=local_name)
      if key is not None:
        node.attributes.add(
          name='VARIABLE_VALUE', full_name='w', checkpoint_key=key)
    return g.SerializeToString()

  graph_key = '_CHECKPOINTABLE_OBJECT_GRAPH'
  w = tf.zeros([2])
  raw('no_graph', {'state/w/.ATTRIBUTES/VARIABLE_VALUE': w})
  raw('garbage_graph', {graph_key: tf.constant(b'not a proto'), 'w': w})
  raw('empty_graph', {graph_key: tf.constant(graph()), 'w': w})
  raw('dangling', {graph_key: tf.constant(graph(([('state', 7)], None)))})
  raw('loop', {graph_key: tf.constant(graph(
    ([('state', 1)], None), ([('a', 2)], None), ([('b', 1)], None)))})
  raw('no_value', {graph_key: tf.constant(graph(
    ([('state', 1)], None), ([('w', 2)], None), ([], 'nowhere')))})
  tf.train.Checkpoint(v=tf.Variable(1.0)).write(
    os.path.join(out, 'no_state', 'ckpt'))
  tf.train.Checkpoint(
    a=loaded, b=tf.saved_model.load(job['saved_model'])
  ).write(os.path.join(out, 'two_models', 'ckpt'))
  print(json.dumps(report))
  """
)


@pytest.fixture(scope='module')
def chain(tmp_path_factory):
  """Trained in JAX, exported, fine-tuned and saved by TF: the paths, the
  JAX-trained values, the TF-dumped values and TF's report."""
  tmp = tmp_path_factory.mktemp('from_tf')
  mesh = jax.make_mesh(
    (2, 4), ('data', 'model'), axis_types=(AxisType.Auto,) * 2
  )
  x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
      loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
      optimizer.update(model, grads)
      return loss

    for _ in range(2):
      step(model, optimizer, x)
    exported = fdt_tf.save_saved_model(
      model,
      tmp / 'exported',
      input_signature=[tf.TensorSpec([None, 8], tf.float32)],
      trainable=nnx.Param,
    )
    trained = {k: np.asarray(v) for k, v in _flat(model).items()}
    served = np.asarray(model(x))
  np.save(tmp / 'x.npy', x)
  job = tmp / 'job.json'
  job.write_text(
    json.dumps(
      {
        'saved_model': exported,
        'x': str(tmp / 'x.npy'),
        'out': str(tmp),
        'steps': STEPS,
      }
    )
  )
  script = tmp / 'fine_tune.py'
  script.write_text(_SCRIPT)
  done = warm.tf_only().run(script, job)
  assert done.returncode == 0, done.stderr[-4000:]
  report = json.loads(done.stdout.strip().splitlines()[-1])
  tuned = {
    f.stem.replace('|', '/'): np.load(f) for f in (tmp / 'values').iterdir()
  }
  return {
    'root': tmp,
    'exported': exported,
    'trained': trained,
    'served': served,
    'tuned': tuned,
    'report': report,
  }


def _target_mesh(kind):
  if kind == 'explicit_4x2':
    return (
      jax.make_mesh((4, 2), ('data', 'model')),
      [('embed', 'model'), ('mlp', 'data')],
    )
  return (
    jax.make_mesh((8,), ('x',), axis_types=(AxisType.Auto,)),
    [('embed', None), ('mlp', 'x')],
  )


def _fresh(kind, **kwargs):
  """A model built anew under another mesh and rules than the export's."""
  mesh, rules = _target_mesh(kind)
  with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
    return Net(nnx.Rngs(5), **kwargs), mesh, rules


def _source(chain, name):
  root = chain['root']
  return {
    'exported': chain['exported'],
    'resaved': root / 'resaved',
    'resaved_serve_only': root / 'resaved_serve_only',
    'wrapped': root / 'wrapped',
    'written': root / 'written' / 'ckpt',
    'saved_dir': root / 'saved',
    'saved_prefix': chain['report']['saved'],
  }[name]


# The chain, bit for bit
# ------------------------------------------------------------------------------


def test_tf_fine_tuned_the_export(chain):
  report = chain['report']
  # TF served JAX's trained values, then its steps changed every variable.
  np.testing.assert_allclose(
    np.array(report['first_served']), chain['served'], rtol=1e-5, atol=1e-6
  )
  assert report['losses'][-1] < report['losses'][0]
  assert sorted(chain['tuned']) == sorted(chain['trained'])
  for name, tuned in chain['tuned'].items():
    assert not np.array_equal(tuned, chain['trained'][name]), name


@pytest.mark.parametrize(
  'name',
  [
    'resaved',
    'resaved_serve_only',
    'wrapped',
    'written',
    'saved_dir',
    'saved_prefix',
    'exported',
  ],
)
@pytest.mark.parametrize('kind', ['explicit_4x2', 'auto_8'])
def test_each_source_restores_bit_for_bit(chain, name, kind):
  model, mesh, rules = _fresh(kind)
  before = _flat(model)
  with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
    returned = fdt_tf.restore_from_tf(_source(chain, name), model)
  assert returned is model
  want = chain['trained'] if name == 'exported' else chain['tuned']
  after = _flat(model)
  assert sorted(after) == sorted(want)
  for path, value in after.items():
    np.testing.assert_array_equal(np.asarray(value), want[path], err_msg=path)
    assert value.sharding == before[path].sharding, path
  # Placed by the target's rules, not the export's.
  kernel = after['l1/kernel'].sharding
  assert kernel.mesh == mesh
  assert tuple(kernel.spec) == (
    ('model', 'data') if kind == 'explicit_4x2' else (None, 'x')
  )


def test_an_abstract_target(chain):
  mesh, rules = _target_mesh('explicit_4x2')
  with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
    abstract = nnx.eval_shape(lambda: Net(nnx.Rngs(5)))
    model = fdt_tf.restore_from_tf(chain['root'] / 'resaved', abstract)
    reference = Net(nnx.Rngs(5))
  placed = _flat(reference)
  for path, value in _flat(model).items():
    np.testing.assert_array_equal(np.asarray(value), chain['tuned'][path])
    assert value.sharding == placed[path].sharding, path


def test_the_loaded_object_in_memory(chain):
  """The third source: TF and JAX in one process, the loaded object."""
  loaded = tf.saved_model.load(chain['exported'])
  kernel = loaded.state['l2']['kernel']
  kernel.assign(kernel.read_value() * 2 + 1)
  want = {
    k: v * 2 + 1 if k == 'l2/kernel' else v for k, v in chain['trained'].items()
  }
  wrapper = tf.Module()  # A TF user's module holding it.
  wrapper.base = loaded
  for restore, source in [
    (fdt_tf.restore_from_tf, loaded),
    (fdt_tf.restore_from_tf, wrapper),
    (fdt_tf.from_tf_module, loaded),
  ]:
    model, mesh, rules = _fresh('auto_8')
    before = _flat(model)
    with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
      restore(source, model)
    for path, value in _flat(model).items():
      np.testing.assert_array_equal(np.asarray(value), want[path], path)
      assert value.sharding == before[path].sharding, path
  wrapper.other = tf.saved_model.load(chain['exported'])
  with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
    _refused(
      model,
      wrapper,
      fdt.ExportError,
      r'Module holds 2 objects with a `state` of exported variables: base, '
      r'other\. Expected one; pass the one to restore from \(e\.g\. '
      r'`from_tf_module\(source\.base, target\)`\)',
    )


# Re-saving a trainable export in TF
# ------------------------------------------------------------------------------


def test_resaving_a_trainable_export(chain):
  """`tf.saved_model.save(loaded, directory)` of a trainable export, with no
  options, saves it with its gradients: the re-saved SavedModel serves the
  fine-tuned values and TF differentiates it again."""
  report = chain['report']
  assert report['resaved'] == 'ok'
  np.testing.assert_array_equal(
    np.array(report['resaved_served'], np.float32),
    np.array(report['tuned_served'], np.float32),
  )
  assert report['resaved_grads'] == [True] * 4
  assert report['resaved_signatures'] == ['serving_default']


def test_inspect_lists_what_tf_saved_by_nnx_path(chain):
  """`flax-dtensor inspect` of the SavedModel TF saved again and of a
  `tf.train.Checkpoint` holding it (no manifest, TF's own keys): the
  model's variables by NNX path, TF's own (`save_counter`) by TF's name."""
  from support.cli_helpers import ok, run_cli

  shown = ok(run_cli('inspect', chain['root'] / 'resaved'))
  paths = sorted(chain['tuned'])
  assert f'{len(paths)} variables' in shown, shown
  for path in paths:
    assert path in shown, (path, shown)
  assert 'serving_default' in shown
  saved = ok(run_cli('inspect', chain['root'] / 'saved'))
  assert f'{len(paths) + 1} variables' in saved, saved
  for path in [*paths, 'save_counter']:
    assert path in saved, (path, saved)


# Refusals
# ------------------------------------------------------------------------------


def _refused(target, source, error, match, **kwargs):
  before = {k: np.asarray(v) for k, v in _flat(target).items()}
  with pytest.raises(error, match=match):
    fdt_tf.restore_from_tf(source, target, **kwargs)
  for path, value in _flat(target).items():
    np.testing.assert_array_equal(np.asarray(value), before[path], path)


def test_a_target_with_other_names(chain):
  model, mesh, rules = _fresh('auto_8', first='inp')
  with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
    _refused(
      model,
      chain['root'] / 'resaved',
      fdt.ExportError,
      r"The TF checkpoint '.*resaved/variables/variables' holds 2 "
      r'variable\(s\) the target does not have: l1/bias, l1/kernel; and it '
      r"lacks 2 of the target's variables: inp/bias, inp/kernel\. Expected "
      r'a TF checkpoint of this model: .*`allow_extra=True`',
    )


def test_a_target_of_other_shapes(chain):
  model, mesh, rules = _fresh('auto_8', width=32)
  with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
    _refused(
      model,
      chain['root'] / 'written' / 'ckpt',
      fdt.ExportError,
      r"Shape mismatch for 3 variables: 'l1/bias': the target expects "
      r"\(32,\), the TF checkpoint '.*written/ckpt' holds \(16,\); "
      r"'l1/kernel': the target expects \(8, 32\), it holds \(8, 16\); "
      r"'l2/kernel': the target expects \(32, 4\), it holds \(16, 4\)\.",
    )


_NOT_AN_EXPORT = {
  'missing': (
    fdt_tf.ExportNotFoundError,
    r"'.*missing' does not exist \(nor '.*missing\.index'\)\. Pass a "
    r'SavedModel directory',
  ),
  'written': (
    fdt_tf.ExportNotFoundError,
    r"'.*written' holds the TF checkpoint prefix '.*written/ckpt' but no TF "
    r'`checkpoint` file naming one .*Pass the prefix itself, e\.g\. '
    r"restore_from_tf\('.*written/ckpt', model\)",
  ),
  'values': (
    fdt_tf.ExportNotFoundError,
    r"got '.*values', which holds no TF checkpoint",
  ),
  'no_graph/ckpt': (
    fdt_tf.MalformedExportError,
    r"The TF checkpoint '.*no_graph/ckpt' has no object graph "
    r'\(_CHECKPOINTABLE_OBJECT_GRAPH\): expected one written by TF 2',
  ),
  'garbage_graph/ckpt': (
    fdt_tf.MalformedExportError,
    r"The object graph of the TF checkpoint '.*garbage_graph/ckpt' does "
    r'not parse',
  ),
  'empty_graph/ckpt': (
    fdt_tf.MalformedExportError,
    r"The object graph of the TF checkpoint '.*empty_graph/ckpt' is "
    r'empty',
  ),
  'dangling/ckpt': (
    fdt_tf.MalformedExportError,
    r"'.*dangling/ckpt' names the object 7, but holds 1",
  ),
  'loop/ckpt': (
    fdt_tf.MalformedExportError,
    r"'.*loop/ckpt' loops at 'a/b'",
  ),
  'no_value/ckpt': (
    fdt_tf.MalformedExportError,
    r"'.*no_value/ckpt' names 1 variable\(s\) it holds no value for: w\.",
  ),
  'no_state/ckpt': (
    fdt_tf.MalformedExportError,
    r"'.*no_state/ckpt' holds no object with a `state` of variables",
  ),
  'two_models/ckpt': (
    fdt.ExportError,
    r"'.*two_models/ckpt' holds 2 objects with a `state` of variables, "
    r"under 'a', 'b': expected one.*tf\.train\.Checkpoint\(model=wrapper\.a\)",
  ),
}


@pytest.mark.parametrize('name', list(_NOT_AN_EXPORT))
def test_what_is_no_export_of_this_model(chain, name):
  error, match = _NOT_AN_EXPORT[name]
  model, mesh, rules = _fresh('auto_8')
  with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
    _refused(model, chain['root'] / name, error, match)


def test_something_else_than_a_path_or_a_tf_object(chain):
  model, mesh, rules = _fresh('auto_8')
  with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
    _refused(
      model,
      3,
      fdt.ExportError,
      r'Expected the TF checkpoint or SavedModel as a str or os\.PathLike, '
      r'or a TF object holding a SavedModel of save_saved_model \(what '
      r'tf\.saved_model\.load returned, or a module holding it\), got int: '
      r'3\. Pass a SavedModel directory',
    )
