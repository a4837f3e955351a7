"""Fine-tuning exported models in TF: `save_saved_model(..., trainable=)`.

One case per way users stand: the mesh's axis types (Explicit, Auto, one
of each), its size (1, 2 and 8 devices, and 3, which divides no dimension
of the model), the export inside `jax.set_mesh` or not, the model built
under the rules or by `fdt.init`, and the `trainable=` filter. Every
SavedModel is exported here, once, and served by one JAX-free TF process:
its gradients (a `tf.GradientTape` over ``loaded.trainable_variables``)
against JAX's `nnx.grad` of the same loss, variable by variable, and, for
one case, Keras 3's `TFSMLayer` trained by `model.fit`.
"""

import contextlib
import dataclasses
import itertools
import json
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import processes, warm

import flax_dtensor as fdt

tf = pytest.importorskip('tensorflow')
fdt_tf = pytest.importorskip('flax_dtensor.dtensor')

E, A = jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto
RULES = [('embed', None), ('mlp', 'model'), ('out', None)]
AXIS_TYPES = {'explicit': (E, E), 'auto': (A, A), 'mixed': (E, A)}
# Mesh shapes over ('data', 'model') by device count: 3 divides no
# dimension of the model (8, 16, 4), so the rules replicate everything.
SHAPES = {1: (1, 1), 2: (1, 2), 3: (1, 3), 8: (2, 4)}
TRAINABLE = {
  'param': nnx.Param,
  'true': True,
  'false': False,
  'kernels': nnx.PathContains('kernel'),
}
BATCH = 5


class Temperature(nnx.Variable):
  """A variable that is not a Param: trainable only when asked."""


def _init(init, names):
  return nnx.with_partitioning(init, names)


class MLP(nnx.Module):
  """A sharded block as users write it: its hidden features over 'model',
  gathered (by logical axes) before the contraction that leaves them."""

  def __init__(self, rngs, forward='logical'):
    self.forward = forward  # How the contraction of the hidden features
    # is written: a logical constraint before it, or its `out_sharding`.
    self.up = nnx.Linear(
      8,
      16,
      kernel_init=_init(nnx.initializers.lecun_normal(), ('embed', 'mlp')),
      bias_init=_init(nnx.initializers.normal(0.1), ('mlp',)),
      rngs=rngs,
    )
    self.norm = nnx.LayerNorm(
      16,
      scale_init=_init(nnx.initializers.ones, ('mlp',)),
      bias_init=_init(nnx.initializers.zeros, ('mlp',)),
      rngs=rngs,
    )
    self.down = nnx.Linear(
      16,
      4,
      kernel_init=_init(nnx.initializers.lecun_normal(), ('mlp', 'out')),
      rngs=rngs,
    )
    self.temperature = Temperature(jnp.full((4,), 0.5))

  def __call__(self, x):
    h = jnp.tanh(self.norm(self.up(x)))
    if self.forward == 'out_sharding':  # A bare PartitionSpec, as JAX asks.
      return self.down(h, out_sharding=jax.P()) * self.temperature[...][None]
    h = fdt.with_logical_constraint(h, (None, 'embed'), rules=RULES)
    return self.down(h) * self.temperature[...][None]


@dataclasses.dataclass(frozen=True)
class Case:
  """How one model is built and exported."""

  kind: str  # A key of AXIS_TYPES.
  devices: int  # A key of SHAPES.
  set_mesh: bool  # The export inside `jax.set_mesh(mesh)`.
  build: str = 'rules'  # 'rules' (eager, under the rules) or 'init'.
  trainable: str | None = 'param'  # A key of TRAINABLE, None: not given.
  forward: str = 'logical'  # MLP's `forward`.

  @property
  def id(self):
    where = 'set' if self.set_mesh else 'unset'
    return (
      f'{self.kind}-{self.devices}dev-{where}-{self.build}-'
      f'{self.trainable or "default"}-{self.forward}'
    )


# Every kind and size under `jax.set_mesh`; outside it, 8 Explicit
# devices; and the forwards written with `out_sharding` (Explicit axes ask
# for it), inside and outside.
MESH_CASES = (
  [
    Case(kind, n, True, build='init' if (k + i) % 2 else 'rules')
    for k, kind in enumerate(AXIS_TYPES)
    for i, n in enumerate((1, 2, 8))
  ]
  + [Case('explicit', 8, False), Case('explicit', 3, True)]
  + [
    Case('explicit', 8, True, forward='out_sharding'),
    Case('mixed', 8, False, forward='out_sharding'),
  ]
)
FILTER_CASES = [
  Case('explicit', 8, True, trainable=t) for t in (None, 'true')
] + [Case('auto', 2, False, trainable='kernels')]
CASES = MESH_CASES + FILTER_CASES
# Keras trains the mixed mesh's model of 8 devices, exported under it.
KERAS_CASE = next(
  c for c in MESH_CASES if (c.kind, c.devices, c.set_mesh) == ('mixed', 8, True)
)


# One JAX-free process serves every SavedModel: the variables it lists, the
# served outputs, the gradients of sum(out**2) over the trainable variables
# (or, for a serve-only export, what TF does when asked for them), and one
# Keras TFSMLayer trained by model.fit. Arrays in .npy files, the rest JSON.
_SCRIPT = processes.NO_JAX + textwrap.dedent(
  """
  import json, os, sys, traceback
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  import numpy as np
  import tensorflow as tf

  job = json.load(open(sys.argv[1]))
  out = job['out']
  x = tf.constant(np.load(job['x']))
  report = {}
  def served(name, path):
    loaded = tf.saved_model.load(path)
    entry = {
      'variables': [v.name for v in loaded.variables],
      'trainable': [v.name for v in loaded.trainable_variables],
      'trainable_flags': [v.trainable for v in loaded.variables],
      'regularization_losses': len(loaded.regularization_losses),
    }
    np.save(os.path.join(out, f'{name}_call.npy'),
            loaded(x)['output_0'].numpy())
    np.save(os.path.join(out, f'{name}_serve.npy'),
            loaded.serve(x)['output_0'].numpy())
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(loaded(x)['output_0'] ** 2)
    grads = tape.gradient(loss, loaded.trainable_variables)
    for i, g in enumerate(grads):
      np.save(os.path.join(out, f'{name}_grad_{i}.npy'), g.numpy())
    if not loaded.trainable_variables:
      # Serve-only: nothing is watched unless asked; asked, TF refuses.
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(loaded(x)['output_0'] ** 2)
      entry['unwatched'] = [
        g is None for g in tape.gradient(loss, loaded.variables)
      ]
      try:
        with tf.GradientTape() as tape:
          tape.watch(loaded.variables)
          loss = tf.reduce_sum(loaded(x)['output_0'] ** 2)
        tape.gradient(loss, loaded.variables)
        entry['watched'] = None
      except Exception as e:  # Raised by the call, under the tape.
        entry['watched'] = [type(e).__name__, str(e)[:300]]
    return entry

  def trained(path, fit_x, fit_y):
    import keras
    layer = keras.layers.TFSMLayer(
      path, call_endpoint='serving_default', trainable=True)
    weights = {}
    for i, w in enumerate(layer.trainable_weights):
      weights[w.value.name] = i
      np.save(os.path.join(out, f'keras_weight_{i}.npy'), w.numpy())

    class Head(keras.Model):
      def __init__(self):
        super().__init__()
        self.served = layer

      def call(self, inputs):
        return self.served(inputs)['output_0']

    model = Head()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss='mse')
    fit = model.fit(np.load(fit_x), np.load(fit_y), epochs=5, batch_size=8,
                    shuffle=False, verbose=0)
    return {
      'trainable_weights': weights,
      'non_trainable_weights': len(layer.non_trainable_weights),
      'losses': fit.history['loss'],
    }

  # Each case on its own: one that fails says why, and the others run.
  jobs = [(name, served, (name, path)) for name, path in job['models'].items()]
  if job['keras']:
    jobs.append(('keras', trained, job['keras']))
  for name, run, args in jobs:
    try:
      report[name] = run(*args)
    except Exception:
      report[name] = {'error': traceback.format_exc()[-3000:]}
  print(json.dumps(report))
  """
)


def _name(path):
  """The TF variable name of an NNX path, as the export names it."""
  return '/'.join(map(str, path)) + ':0'


def _np(x):
  return np.asarray(jax.device_get(x))


def _built(case, mesh):
  if case.build == 'init':
    return fdt.init(MLP, nnx.Rngs(0), mesh=mesh, rules=RULES)
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    return MLP(nnx.Rngs(0), forward=case.forward)


def _mesh(case):
  return jax.make_mesh(
    SHAPES[case.devices],
    ('data', 'model'),
    axis_types=AXIS_TYPES[case.kind],
    devices=jax.devices()[: case.devices],
  )


@nnx.jit(static_argnums=2)
def _reference(model, x, selected):
  """JAX's output and gradients of the loss TF differentiates."""
  loss = lambda m: jnp.sum(m(x) ** 2)  # noqa: E731
  grads = nnx.grad(loss, argnums=nnx.DiffState(0, selected))(model)
  return model(x), nnx.state(grads, selected)


def _exported(case, model, mesh, directory, x):
  """Exports `case`'s model; what JAX says of it."""
  kwargs = {}
  if case.trainable is not None:
    kwargs['trainable'] = TRAINABLE[case.trainable]
  where = jax.set_mesh(mesh) if case.set_mesh else contextlib.nullcontext()
  with where:
    path = fdt_tf.save_saved_model(
      model,
      directory,
      input_signature=[tf.TensorSpec([None, 8], tf.float32, 'x')],
      **kwargs,
    )
  with jax.set_mesh(mesh):
    out, grads = _reference(model, x, TRAINABLE[case.trainable or 'false'])
  flat = nnx.to_flat_state(nnx.state(model))
  return {
    'path': path,
    'out': _np(out),
    'variables': {_name(p): _np(v[...]) for p, v in flat},
    'shards': {
      _name(p): v[...].sharding.shard_shape(v[...].shape) for p, v in flat
    },
    'grads': {_name(p): _np(v[...]) for p, v in nnx.to_flat_state(grads)},
  }


@pytest.fixture(scope='module')
def served(tmp_path_factory):
  """Every case exported, then served by one TF process: (JAX's, TF's)."""
  folder = tmp_path_factory.mktemp('fine_tune')
  rng = np.random.default_rng(0)
  x = rng.standard_normal((BATCH, 8)).astype(np.float32)
  np.save(folder / 'x.npy', x)
  np.save(folder / 'fit_x.npy', rng.standard_normal((32, 8), np.float32))
  np.save(folder / 'fit_y.npy', rng.standard_normal((32, 4), np.float32))
  jax_side, models = {}, {}
  for case in CASES:  # One model per mesh and spelling, exported by each.
    key = (case.kind, case.devices, case.build, case.forward)
    try:
      if key not in models:
        mesh = _mesh(case)
        models[key] = _built(case, mesh), mesh
      jax_side[case.id] = _exported(case, *models[key], folder / case.id, x)
    except Exception as e:  # That case's tests fail with it.
      jax_side[case.id] = e
  exported = {k: e for k, e in jax_side.items() if isinstance(e, dict)}
  keras = exported.get(KERAS_CASE.id)
  job = {
    'out': str(folder),
    'x': str(folder / 'x.npy'),
    'models': {name: e['path'] for name, e in exported.items()},
    'keras': keras
    and [keras['path'], str(folder / 'fit_x.npy'), str(folder / 'fit_y.npy')],
  }
  (folder / 'job.json').write_text(json.dumps(job))
  script = folder / 'serve.py'
  script.write_text(_SCRIPT)
  proc = warm.tf_only().run(script, folder / 'job.json')
  assert proc.returncode == 0, proc.stderr[-4000:]
  report = json.loads(proc.stdout.strip().splitlines()[-1])
  return folder, jax_side, report


def _checked(want, got):
  """JAX's and TF's sides of a case, or the failure of either."""
  if isinstance(want, Exception):
    raise AssertionError('the export failed') from want
  assert 'error' not in got, got['error']
  return want, got


def _case(served, case):
  folder, jax_side, report = served
  return (folder, *_checked(jax_side[case.id], report.get(case.id)))


@pytest.mark.parametrize('case', CASES, ids=lambda c: c.id)
def test_served_outputs_equal_jax(served, case):
  folder, want, got = _case(served, case)
  for endpoint in ('call', 'serve'):
    np.testing.assert_allclose(
      np.load(folder / f'{case.id}_{endpoint}.npy'),
      want['out'],
      rtol=1e-5,
      atol=1e-6,
    )
  assert sorted(got['variables']) == sorted(want['variables'])
  assert got['regularization_losses'] == 0


@pytest.mark.parametrize('case', CASES, ids=lambda c: c.id)
def test_trainable_variables_are_those_the_filter_selects(served, case):
  _, want, got = _case(served, case)
  assert sorted(got['trainable']) == sorted(want['grads'])
  flags = dict(zip(got['variables'], got['trainable_flags'], strict=True))
  assert flags == {n: n in want['grads'] for n in want['variables']}


@pytest.mark.parametrize(
  'case',
  [c for c in CASES if c.trainable not in (None, 'false')],
  ids=lambda c: c.id,
)
def test_tf_gradients_equal_jax_gradients(served, case):
  folder, want, got = _case(served, case)
  assert got['trainable']
  for i, name in enumerate(got['trainable']):
    np.testing.assert_allclose(
      np.load(folder / f'{case.id}_grad_{i}.npy'),
      want['grads'][name],
      rtol=1e-5,
      atol=1e-5,
      err_msg=name,
    )


@pytest.mark.parametrize(
  'case',
  [c for c in CASES if c.trainable in (None, 'false')],
  ids=lambda c: c.id,
)
def test_a_serve_only_export_holds_no_gradient(served, case):
  _, want, got = _case(served, case)
  assert got['trainable'] == []
  # Not trainable, so not watched: no gradient, and no error.
  assert got['unwatched'] == [True] * len(want['variables'])
  # Watched by hand: TF refuses, with jax2tf's reason.
  kind, message = got['watched']
  assert kind == 'LookupError'
  assert 'Gradient explicitly disabled' in message
  assert 'does not support gradients' in message


@pytest.mark.parametrize('case', MESH_CASES, ids=lambda c: c.id)
def test_the_hidden_features_are_split_where_they_divide(served, case):
  """Over 'model' where its size divides them; on 3 devices (a 'model' of
  3, which divides no dimension), the rules replicate every variable."""
  _, want, _ = _case(served, case)
  model_size = SHAPES[case.devices][1]
  split = 1 if 16 % model_size else model_size
  shards = want['shards']
  assert shards['up/kernel:0'] == (8, 16 // split)
  assert shards['norm/scale:0'] == (16 // split,)
  assert shards['down/kernel:0'] == (16 // split, 4)


def test_keras_trains_the_served_variables(served):
  folder, jax_side, report = served
  want, got = _checked(jax_side[KERAS_CASE.id], report.get('keras'))
  # Keras lists the SavedModel's own variables: the Params trainable, the
  # temperature not.
  assert sorted(got['trainable_weights']) == sorted(want['grads'])
  assert got['non_trainable_weights'] == 1
  for name, i in got['trainable_weights'].items():
    np.testing.assert_array_equal(
      np.load(folder / f'keras_weight_{i}.npy'), want['variables'][name]
    )
  losses = got['losses']
  assert all(b < a for a, b in itertools.pairwise(losses)), losses
