"""Tests of flax_dtensor.dtensor.save_saved_model, served by plain TF."""

import json
import os
import pathlib
import re
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support import forwards, processes, warm

import flax_dtensor as fdt

tf = pytest.importorskip('tensorflow')
fdt_tf = pytest.importorskip('flax_dtensor.dtensor')

# Runs in a fresh process that cannot import JAX (TF imports it when it is
# installed, for TFLite's JAX converter; blocking it proves we need none of it)
# and never initializes DTensor: plain TF serving.
_SERVE_SCRIPT = processes.NO_JAX + textwrap.dedent(
  """
  import json, os, sys
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  import numpy as np
  import tensorflow as tf
  from tensorflow.dtensor.python import accelerator_util

  job = json.load(open(sys.argv[1]))
  report = {}
  for name, model in job['models'].items():
    loaded = tf.saved_model.load(model['path'])
    serve = loaded.signatures['serving_default']
    out = {}
    for i, x in enumerate(model['inputs']):
      result = serve(**{k: tf.constant(np.load(v)) for k, v in x.items()})
      for k, t in result.items():
        file = f'{name}_{i}_{k}.npy'.replace('/', '|')
        np.save(os.path.join(job['out'], file), t.numpy())
        out.setdefault(k, []).append(list(t.shape))
    for v in serve.variables:
      np.save(os.path.join(job['out'], f'{name}_var_{v.name}'.replace('/', '|')
                           + '.npy'), v.numpy())
    report[name] = {
      'outputs': out,
      'variables': sorted(v.name for v in serve.variables),
      'devices': sorted({v.device for v in serve.variables}),
      'inputs': sorted(serve.structured_input_signature[1]),
    }
  if job['checkpoint']:
    reader = tf.train.load_checkpoint(job['checkpoint'])
    for key in reader.get_variable_to_shape_map():
      if key.endswith('VARIABLE_VALUE'):
        np.save(
          os.path.join(job['out'], 'ckpt_' + key.replace('/', '|') + '.npy'),
          reader.get_tensor(key))
  report['jax_modules'] = sorted(
    m for m, v in sys.modules.items() if m.startswith('jax') and v is not None)
  report['dtensor_initialized'] = bool(accelerator_util.is_initialized())
  print(json.dumps(report))
  """
)


def _part(names):
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


class Net(nnx.Module):
  """A sharded MLP with batch norm and dropout, and a two-output method."""

  def __init__(self, rngs, *, din=64, hidden=256, dout=16, dtype=jnp.float32):
    typed = {'param_dtype': dtype, 'dtype': dtype, 'rngs': rngs}
    up, down = _part(('data', 'model')), _part(('model', None))
    self.up = nnx.Linear(din, hidden, kernel_init=up, **typed)
    self.norm = nnx.BatchNorm(hidden, **typed)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.down = nnx.Linear(hidden, dout, kernel_init=down, **typed)

  def __call__(self, x):
    return self.down(self.drop(self.norm(jax.nn.gelu(self.up(x)))))

  def features(self, x, scale):
    h = self.up(x)
    return {'hidden': h, 'scaled': self.down(h) * scale[:, None]}


class Mixed(nnx.Module):
  """Params on several DTensor meshes: a fused axis, one device, a grid."""

  def __init__(self, mesh):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    self.w = nnx.Param(
      jax.device_put(w, NamedSharding(mesh, P(('data', 'model'), None)))
    )
    v = rng.standard_normal((32, 8)).astype(np.float32)
    self.v = nnx.Param(
      jax.device_put(v, NamedSharding(mesh, P('data', 'model')))
    )
    self.b = nnx.Param(
      jax.device_put(np.float32(rng.standard_normal(8)), jax.devices()[3])
    )

  def __call__(self, x):
    # Only ever traced for export (JAX refuses mixed devices eagerly).
    return jnp.tanh(x @ self.w[...]) @ self.v[...] + self.b[...][None]


class Float8(nnx.Module):
  """float8 weights: one dtype TF has (e4m3fn), one it lacks (e8m0fnu)."""

  def __init__(self, mesh):
    rng = np.random.default_rng(4)
    w = rng.standard_normal((64, 16)).astype(jnp.float8_e4m3fn)
    self.w = nnx.Param(
      jax.device_put(w, NamedSharding(mesh, P('data', 'model')))
    )
    scale = (2.0 ** rng.integers(-3, 4, 16)).astype(jnp.float8_e8m0fnu)
    self.scale = nnx.Param(jax.device_put(scale, NamedSharding(mesh, P())))

  def __call__(self, x):
    w = self.w[...].astype(jnp.float32)
    return (x @ w) * self.scale[...].astype(jnp.float32)[None]


def _trained(mesh, dtype=jnp.float32):
  """A Net whose batch statistics moved away from their initial values."""
  with jax.set_mesh(mesh):
    net = Net(nnx.Rngs(0, dropout=1), dtype=dtype)
    net(jax.random.normal(jax.random.key(2), (32, 64), dtype) * 3 + 1)
  return nnx.view(net, deterministic=True, use_running_average=True)


def _param_bytes(module):
  state = nnx.state(module, (nnx.Param, nnx.BatchStat))
  return sum(v.get_value().nbytes for _, v in nnx.to_flat_state(state))


def _largest_constants(path):
  """Sizes of the biggest constants in a SavedModel's graph and functions."""
  from tensorflow.core.protobuf import saved_model_pb2

  proto = saved_model_pb2.SavedModel()
  with open(os.path.join(path, 'saved_model.pb'), 'rb') as f:
    proto.ParseFromString(f.read())
  sizes = {'const': 0, 'xla_module': 0}
  for graph in proto.meta_graphs:
    nodes = list(graph.graph_def.node)
    for fn in graph.graph_def.library.function:
      nodes.extend(fn.node_def)
    for node in nodes:
      if node.op == 'Const':
        size = len(node.attr['value'].tensor.SerializeToString())
        sizes['const'] = max(sizes['const'], size)
      if node.op == 'XlaCallModule':
        sizes['xla_module'] = max(
          sizes['xla_module'], len(node.attr['module'].s)
        )
  return sizes


def _serve_in_plain_tf(tmp_path, models, checkpoint=None):
  job = {
    'models': models,
    'checkpoint': checkpoint and str(checkpoint),
    'out': str(tmp_path),
  }
  job_path = tmp_path / 'job.json'
  job_path.write_text(json.dumps(job))
  script = tmp_path / 'serve.py'
  script.write_text(_SERVE_SCRIPT)
  out = warm.tf_only().run(script, job_path)
  assert out.returncode == 0, out.stderr[-4000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def _save_inputs(tmp_path, name, arrays):
  paths = {}
  for key, value in arrays.items():
    path = tmp_path / f'{name}_{key}.npy'
    np.save(path, value)
    paths[key] = str(path)
  return paths


@pytest.fixture(scope='module')
def trained_exports(tmp_path_factory):
  """The trained Net in float32 and float16 on the (2, 4) Auto mesh, each
  with its SavedModel (a batch of 64 features of its dtype); read, never
  changed, by the tests of this module."""
  mesh = jax.make_mesh(
    (2, 4), ('data', 'model'), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  tmp = tmp_path_factory.mktemp('trained')
  exports = {}
  for name, dtype in (('net', jnp.float32), ('net16', jnp.float16)):
    net = _trained(mesh, dtype=dtype)
    path = fdt_tf.save_saved_model(
      net, tmp / name, input_signature=[tf.TensorSpec([None, 64], dtype)]
    )
    exports[name] = (net, path)
  return exports


def test_saved_model_serves_in_plain_tf_without_jax(
  auto_mesh, trained_exports, tmp_path
):
  (net, sm), (net16, sm16) = trained_exports['net'], trained_exports['net16']
  rng = np.random.default_rng(0)
  sm_features = fdt_tf.save_saved_model(
    net,
    tmp_path / 'features',
    method='features',
    input_signature=[
      # Symbolic 'b' and the TF spec's leading None are one batch dimension.
      jax.ShapeDtypeStruct(jax.export.symbolic_shape('b, 64'), jnp.float32),
      tf.TensorSpec([None], tf.float32, name='scale'),
    ],
  )
  net8 = Float8(auto_mesh)
  sm8 = fdt_tf.save_saved_model(
    net8,
    tmp_path / 'net8',
    input_signature=[tf.TensorSpec([None, 64], tf.float32)],
  )
  mixed = Mixed(auto_mesh)
  sm_mixed = fdt_tf.save_saved_model(
    mixed,
    tmp_path / 'mixed',
    input_signature=[tf.TensorSpec([None, 64], tf.float32)],
  )
  # The save did not change the model's own arrays.
  assert mixed.w.get_value().sharding.spec == P(('data', 'model'), None)
  ckpt = fdt_tf.save_checkpoint(
    net, tmp_path / 'ckpt', include=(nnx.Param, nnx.BatchStat)
  )
  xs = [rng.standard_normal((b, 64)).astype(np.float32) for b in (1, 7)]
  scale = rng.standard_normal(5).astype(np.float32)
  x5 = rng.standard_normal((5, 64)).astype(np.float32)
  models = {
    'net': {
      'path': sm,
      'inputs': [
        _save_inputs(tmp_path, f'net{i}', {'input_0': x})
        for i, x in enumerate(xs)
      ],
    },
    'features': {
      'path': sm_features,
      'inputs': [
        _save_inputs(tmp_path, 'feat', {'input_0': x5, 'scale': scale})
      ],
    },
    'net16': {
      'path': sm16,
      'inputs': [
        _save_inputs(tmp_path, 'n16', {'input_0': xs[1].astype(np.float16)})
      ],
    },
    'mixed': {
      'path': sm_mixed,
      'inputs': [_save_inputs(tmp_path, 'mixed', {'input_0': xs[1]})],
    },
    'net8': {
      'path': sm8,
      'inputs': [_save_inputs(tmp_path, 'n8', {'input_0': xs[1]})],
    },
  }
  report = _serve_in_plain_tf(tmp_path, models, ckpt)
  assert report['jax_modules'] == []
  assert not report['dtensor_initialized']

  # Outputs match JAX's forward pass (batch sizes 1 and 7: polymorphic),
  # jitted: a compile a model and shape, not one an op.
  def forward(model, x):
    return forwards.jitted(model)(x)

  assert report['net']['inputs'] == ['input_0']
  assert report['net']['outputs'] == {'output_0': [[1, 16], [7, 16]]}
  for i, x in enumerate(xs):
    got = np.load(tmp_path / f'net_{i}_output_0.npy')
    want = np.asarray(forward(net, x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert report['features']['inputs'] == ['input_0', 'scale']
  feats = forwards.jitted(net, 'features')(x5, scale)
  for k in ('hidden', 'scaled'):
    got = np.load(tmp_path / f'features_0_{k}.npy')
    np.testing.assert_allclose(got, feats[k], rtol=1e-5, atol=1e-5)
  got = np.load(tmp_path / 'mixed_0_output_0.npy')
  w, v, b = (np.asarray(p.get_value()) for p in (mixed.w, mixed.v, mixed.b))
  want = np.tanh(xs[1] @ w) @ v + b
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert report['mixed']['variables'] == ['b:0', 'v:0', 'w:0']
  got16 = np.load(tmp_path / 'net16_0_output_0.npy')
  assert got16.dtype == np.float16
  want16 = np.asarray(forward(net16, xs[1].astype(np.float16)))
  np.testing.assert_allclose(got16, want16, rtol=2e-2, atol=2e-2)
  # float8 variables are stored as float32 and converted back inside the
  # served JAX function (TF has no float8_e8m0fnu at all).
  got8 = np.load(tmp_path / 'net8_0_output_0.npy')
  np.testing.assert_allclose(got8, forward(net8, xs[1]), rtol=1e-6, atol=1e-5)
  scale8 = np.load(tmp_path / 'net8_var_scale:0.npy')
  assert scale8.dtype == np.float32
  np.testing.assert_array_equal(
    scale8, np.asarray(net8.scale.get_value()).astype(np.float32)
  )

  # The serving function reads the model's variables, which hold its values.
  names = [
    'down/bias:0',
    'down/kernel:0',
    'norm/bias:0',
    'norm/mean:0',
    'norm/scale:0',
    'norm/var:0',
    'up/bias:0',
    'up/kernel:0',
  ]
  assert report['net']['variables'] == names
  assert len(report['net']['devices']) == 1
  state = dict(nnx.to_flat_state(nnx.state(net, (nnx.Param, nnx.BatchStat))))
  for name in names:
    path = tuple(name[:-2].split('/'))
    value = np.load(tmp_path / ('net_var_' + name.replace('/', '|') + '.npy'))
    np.testing.assert_array_equal(value, state[path].get_value(), err_msg=name)
    ckpt_value = np.load(
      tmp_path
      / ('ckpt_' + fdt_tf.checkpoint_key(name[:-2]).replace('/', '|') + '.npy')
    )
    np.testing.assert_array_equal(ckpt_value, state[path].get_value())
  assert np.abs(state[('norm', 'mean')].get_value()).max() > 0.01
  # float16 variables are stored widened and cast back in the graph.
  kernel16 = np.load(tmp_path / 'net16_var_up|kernel:0.npy')
  assert kernel16.dtype == np.float32
  np.testing.assert_array_equal(
    kernel16, np.asarray(net16.up.kernel.get_value()).astype(np.float32)
  )

  # No weights are baked into the graph.
  params = _param_bytes(net)
  assert params > 60_000
  sizes = _largest_constants(sm)
  assert sizes['xla_module'] > 0
  assert sizes['xla_module'] < params / 10, sizes
  assert sizes['const'] < 1024, sizes
  # The graph's size is TensorFlow's and JAX's business; what is ours is that
  # no weight's bytes are in it.
  with open(os.path.join(sm, 'saved_model.pb'), 'rb') as f:
    graph = f.read()
  kernels = [
    np.asarray(v.get_value())
    for path, v in nnx.to_flat_state(nnx.state(net, nnx.Param))
    if path[-1] == 'kernel'
  ]
  assert len(kernels) == 2
  data = b''.join(
    f.read_bytes()
    for f in pathlib.Path(sm, 'variables').glob('variables.data*')
  )
  for kernel in kernels:
    assert kernel.std() > 0
    for row in kernel[:4]:
      # Two values: a sharded kernel is stored in slices, each row split.
      chunk = row[:2].tobytes()
      assert chunk in data  # where the weights are
      assert chunk not in graph


class Constrained(nnx.Module):
  """A MaxText-style block: a step counter and RNG state (0-d arrays)
  beside sharded params, and a forward that constrains its activations on
  the model's own mesh, by a NamedSharding, a bare PartitionSpec or logical
  names (`fdt.shard_value`)."""

  def __init__(self, rngs, mesh, constrain):
    self.up = nnx.Linear(16, 64, kernel_init=_part(('embed', 'mlp')), rngs=rngs)
    self.down = nnx.Linear(64, 8, kernel_init=_part(('mlp', None)), rngs=rngs)
    self.step = nnx.Variable(jnp.array(7, jnp.int32))
    self.rngs = nnx.Rngs(3)  # Baked in (RNG state is not exported).
    self.mesh = mesh
    self.constrain = constrain

  def _constrained(self, x, spec, names):
    if self.constrain == 'named':
      return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))
    if self.constrain == 'bare':
      return jax.lax.with_sharding_constraint(x, spec)
    if self.constrain == 'logical':
      return fdt.shard_value(x, names)
    return x

  def __call__(self, x):
    h = self._constrained(self.up(x), P('data', 'model'), ('batch', 'mlp'))
    h = jax.nn.relu(h) + self.rngs.default.count[...].astype(h.dtype)
    y = self._constrained(self.down(h), P('data', None), ('batch', None))
    return y * self.step[...].astype(y.dtype)


CONSTRAINED_RULES = [('batch', 'data'), ('embed', 'data'), ('mlp', 'model')]


def _modules_of(path):
  """The StableHLO modules of a SavedModel's XlaCallModule ops."""
  from tensorflow.core.protobuf import saved_model_pb2

  proto = saved_model_pb2.SavedModel()
  with open(os.path.join(path, 'saved_model.pb'), 'rb') as f:
    proto.ParseFromString(f.read())
  return [
    node.attr['module'].s
    for graph in proto.meta_graphs
    for fn in graph.graph_def.library.function
    for node in fn.node_def
    if node.op == 'XlaCallModule'
  ]


def test_exports_with_sharding_ops_serve_in_plain_tf(auto_mesh, tmp_path):
  """Exported inside `jax.set_mesh` with 0-d variables, and with activation
  constraints (even bare PartitionSpecs exported outside any mesh context),
  JAX writes Shardy (`sdy`) ops that TF's Python StableHLO reader does not
  know but TF's XlaCallModule runs: written, and served in a JAX-free TF
  process with JAX's values."""
  spec = [tf.TensorSpec([None, 16], tf.float32)]
  models, paths = {}, {}
  with jax.set_mesh(auto_mesh), fdt.logical_axis_rules(CONSTRAINED_RULES):
    for name in ('scalar', 'named', 'logical', 'bare'):
      constrain = None if name == 'scalar' else name
      models[name] = Constrained(nnx.Rngs(0), auto_mesh, constrain)
    for name in ('scalar', 'named', 'logical'):
      paths[name] = fdt_tf.save_saved_model(
        models[name], tmp_path / name, input_signature=spec
      )
  # Outside any mesh context: traced under the variables' mesh.
  paths['bare'] = fdt_tf.save_saved_model(
    models['bare'], tmp_path / 'bare', input_signature=spec
  )
  for name, path in paths.items():
    modules = _modules_of(path)
    assert modules, name
    for module in modules:
      assert b'sdy.' in module, name  # What TF's Python reader refuses.
  rng = np.random.default_rng(8)
  xs = [rng.standard_normal((b, 16)).astype(np.float32) for b in (2, 6)]
  jobs = {
    name: {
      'path': path,
      'inputs': [
        _save_inputs(tmp_path, f'{name}{i}', {'input_0': x})
        for i, x in enumerate(xs)
      ],
    }
    for name, path in paths.items()
  }
  report = _serve_in_plain_tf(tmp_path, jobs)
  assert report['jax_modules'] == []
  with jax.set_mesh(auto_mesh), fdt.logical_axis_rules(CONSTRAINED_RULES):
    for name, model in models.items():
      assert report[name]['outputs'] == {'output_0': [[2, 8], [6, 8]]}, name
      assert report[name]['variables'] == [
        'down/bias:0',
        'down/kernel:0',
        'step:0',
        'up/bias:0',
        'up/kernel:0',
      ]
      for i, x in enumerate(xs):
        got = np.load(tmp_path / f'{name}_{i}_output_0.npy')
        want = np.asarray(model(x))
        assert np.abs(want).max() > 1.0
        np.testing.assert_allclose(
          got, want, rtol=1e-5, atol=1e-5, err_msg=name
        )


def test_polymorphic_exports_under_explicit_axes(
  mixed_mesh, tmp_path, monkeypatch
):
  """Under a mesh with an Explicit axis, JAX constrains the checks of
  polymorphic dimensions to a sharding, which TF's XlaCallModule loads but
  cannot compile where it serves. The export removes those constraints:
  it serves, inside the mesh as outside. Proved load-bearing: without the
  removal the export is refused before writing (our check), and written
  anyway, TF cannot serve it."""
  from flax_dtensor.dtensor._serving import _reexport, _serialization

  rules = [('embed', None), ('mlp', 'model')]  # The Auto axis only.
  with jax.set_mesh(mixed_mesh), fdt.logical_axis_rules(rules):
    model = nnx.Linear(
      16, 8, kernel_init=_part(('embed', 'mlp')), rngs=nnx.Rngs(0)
    )
  xs = [
    np.random.default_rng(b).standard_normal((b, 16)).astype(np.float32)
    for b in (1, 3, 4)
  ]
  wants = [np.asarray(model(x)) for x in xs]
  polymorphic = [tf.TensorSpec([None, 16], tf.float32)]
  with jax.set_mesh(mixed_mesh):
    inside = fdt_tf.save_saved_model(
      model, tmp_path / 'inside', input_signature=polymorphic
    )
  outside = fdt_tf.save_saved_model(
    model, tmp_path / 'outside', input_signature=polymorphic
  )
  for path in (inside, outside):
    served = tf.saved_model.load(path).signatures['serving_default']
    for x, want in zip(xs, wants, strict=True):
      (got,) = served(input_0=tf.constant(x)).values()
      np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
  monkeypatch.setattr(
    _serialization, 'unconstrain_shape_checks', lambda module: 0
  )
  _reexport.clear()  # What was traced before without the patch.
  with jax.set_mesh(mixed_mesh):
    with pytest.raises(
      fdt.ExportError,
      match=r'save_saved_model: JAX .* exported the forward pass '
      r'\(XlaCallModule\) under a mesh with Explicit axes, and so constrained '
      r'the checks of its polymorphic input dimensions to a sharding, which '
      r'flax_dtensor removes .* could not in this JAX release .*Nothing was '
      r'written\. Give `input_signature` static shapes',
    ):
      fdt_tf.save_saved_model(
        model, tmp_path / 'refused', input_signature=polymorphic
      )
    assert not (tmp_path / 'refused').exists()
    monkeypatch.setattr(
      _serialization, 'has_constrained_shape_checks', lambda loaded: False
    )
    _reexport.clear()
    unchecked = fdt_tf.save_saved_model(
      model, tmp_path / 'unchecked', input_signature=polymorphic
    )
  served = tf.saved_model.load(unchecked).signatures['serving_default']
  with pytest.raises(
    tf.errors.InvalidArgumentError, match='expects static assert_what'
  ):
    served(input_0=tf.constant(xs[0]))


def test_a_bare_constraint_without_any_mesh_is_explained(tmp_path):
  """Variables on one device and no mesh in context: nothing names a mesh
  for `with_sharding_constraint(x, P('data'))`."""
  with nnx.use_eager_sharding(False):
    model = Constrained(nnx.Rngs(0), None, 'bare')
  assert not isinstance(model.up.kernel.get_value().sharding, NamedSharding)
  with pytest.raises(
    fdt.ExportError,
    match=r'Tracing Constrained\.__call__ for the SavedModel failed: it '
    r'constrains a sharding with a bare PartitionSpec, which needs a mesh in '
    r'context, and none is set, nor are the exported variables laid out on '
    r'one \(with_sharding_constraint requires a non-empty mesh.*\)\. Export '
    r'inside `with jax\.set_mesh\(mesh\):`',
  ):
    fdt_tf.save_saved_model(
      model, tmp_path / 'sm', input_signature=[tf.TensorSpec([None, 16])]
    )
  assert os.listdir(tmp_path) == []


def test_saved_model_variables_are_loaded_model_variables(trained_exports):
  net, sm = trained_exports['net']
  loaded = tf.saved_model.load(sm)
  flat = fdt_tf.flat_variables(loaded)
  names = ['/'.join(map(str, k)) for k in flat]
  assert sorted(names) == [
    'down/bias',
    'down/kernel',
    'norm/bias',
    'norm/mean',
    'norm/scale',
    'norm/var',
    'up/bias',
    'up/kernel',
  ]
  serving = loaded.signatures['serving_default']
  assert {v.name for v in serving.variables} == {f'{k}:0' for k in names}
  # The manifest records the signatures as TF reads them (what `inspect`
  # shows without TensorFlow).
  from flax_dtensor.dtensor._format import _decode, _model

  (name,) = loaded.signatures
  recorded = _decode.read(sm).signatures
  assert list(recorded) == [name]

  def specs(structure):
    return {
      k: _model.TensorSpec(tuple(v.shape), v.dtype.name)
      for k, v in structure.items()
    }

  assert recorded[name].inputs == specs(serving.structured_input_signature[1])
  assert recorded[name].outputs == specs(serving.structured_outputs)
  assert recorded[name].inputs['input_0'].shape == (None, 64)
  reader = tf.train.load_checkpoint(os.path.join(sm, 'variables', 'variables'))
  np.testing.assert_array_equal(
    reader.get_tensor(fdt_tf.checkpoint_key('up/kernel')),
    net.up.kernel.get_value(),
  )


def test_saved_model_records_its_variables(auto_mesh, trained_exports):
  net16, sm = trained_exports['net16']
  with open(os.path.join(sm, 'assets', 'flax_dtensor.json')) as f:
    meta = json.load(f)
  assert meta['format'] == 'flax_dtensor.saved_model'
  assert meta['checkpoint_prefix'] == 'variables/variables'
  records = {'/'.join(map(str, r['path'])): r for r in meta['variables']}
  kernel = records['up/kernel']
  assert kernel['type'] == 'Param'
  assert (kernel['dtype'], kernel['stored_dtype']) == ('float16', 'float32')
  assert kernel['sharding']['spec'] == [['data'], ['model']]
  assert kernel['sharding']['dtensor_layout'] == {
    'sharding_specs': ['data', 'model'],
    'mesh': {'axis_names': ['data', 'model'], 'axis_sizes': [2, 4]},
  }
  assert records['norm/mean']['type'] == 'BatchStat'
  # Every file of the SavedModel is recorded, with its size.
  for name, record in meta['files'].items():
    assert os.path.getsize(os.path.join(sm, name)) == record['bytes']
  assert {'saved_model.pb', 'variables/variables.index'} <= set(meta['files'])
  # The SavedModel's variables read back in their own dtypes, through it.
  prefix = os.path.join(sm, 'variables', 'variables')
  read = fdt_tf.read_checkpoint(prefix)
  assert read['up/kernel'].dtype == np.float16
  np.testing.assert_array_equal(read['up/kernel'], net16.up.kernel.get_value())
  with jax.set_mesh(auto_mesh):
    abstract = nnx.eval_shape(lambda: Net(nnx.Rngs(5), dtype=jnp.float16))
    restored = fdt_tf.restore_checkpoint(prefix, abstract, rng_seed=0)
  for name in ('up', 'down'):
    a = getattr(net16, name).kernel.get_value()
    b = getattr(restored, name).kernel.get_value()
    assert b.dtype == jnp.float16
    assert b.sharding == a.sharding
    np.testing.assert_array_equal(b, a)
  np.testing.assert_array_equal(
    restored.norm.mean.get_value(), net16.norm.mean.get_value()
  )


def test_saved_model_errors(auto_mesh, tmp_path):
  net = _trained(auto_mesh)
  spec = [tf.TensorSpec([None, 64], tf.float32)]
  with pytest.raises(fdt.ExportError, match=r"`method`.*'forward'.*Net"):
    fdt_tf.save_saved_model(
      net, tmp_path / 'a', input_signature=spec, method='forward'
    )
  with pytest.raises(
    fdt.ExportError,
    match=r'tf.TensorSpec, a\s+jax.ShapeDtypeStruct or None.*index 0',
  ):
    fdt_tf.save_saved_model(
      net, tmp_path / 'b', input_signature=[np.zeros((2, 64))]
    )
  with pytest.raises(fdt.ExportError, match=r'one polymorphic shape per input'):
    fdt_tf.save_saved_model(
      net,
      tmp_path / 'c',
      input_signature=spec,
      polymorphic_shapes=['(b, 64)', '(b,)'],
    )
  (tmp_path / 'taken').mkdir()
  with pytest.raises(fdt.ExportError, match=r'already exists'):
    fdt_tf.save_saved_model(net, tmp_path / 'taken', input_signature=spec)
  fdt_tf.save_saved_model(
    net, tmp_path / 'taken', input_signature=spec, overwrite=True
  )
  assert 'saved_model.pb' in os.listdir(tmp_path / 'taken')
  assert sorted(os.listdir(tmp_path)) == ['taken']


def test_polymorphic_shape_strings():
  from flax_dtensor.dtensor._serving import _inputs

  shape = _inputs.polymorphic_shape
  assert shape(tf.TensorSpec([None, 16]), 0) == '(b, 16)'
  assert shape(tf.TensorSpec([None]), 1) == '(b,)'
  assert shape(tf.TensorSpec([None, None, 3]), 2) == '(b, d2_1, 3)'
  assert shape(tf.TensorSpec([4, 16]), 0) is None
  assert shape(tf.TensorSpec(None), 0) is None


def _xla_call_module_versions(path):
  from tensorflow.core.protobuf import saved_model_pb2

  proto = saved_model_pb2.SavedModel()
  with open(os.path.join(path, 'saved_model.pb'), 'rb') as f:
    proto.ParseFromString(f.read())
  return {
    node.attr['version'].i
    for graph in proto.meta_graphs
    for fn in graph.graph_def.library.function
    for node in fn.node_def
    if node.op == 'XlaCallModule'
  }


def test_calling_convention_follows_what_tf_runs(
  auto_mesh, tmp_path, monkeypatch
):
  from flax_dtensor.dtensor._serving import _saved_model, _serialization

  net = _trained(auto_mesh)
  spec = [tf.TensorSpec([None, 64], tf.float32)]
  current = jax.config.jax_export_calling_convention_version
  assert current <= _serialization._tf_max_calling_convention()
  sm = fdt_tf.save_saved_model(net, tmp_path / 'now', input_signature=spec)
  assert _xla_call_module_versions(sm) == {current}
  # An older TF: export with the newest version both run, set for the
  # exporting thread only (other threads keep the global setting).
  oldest = jax.export.minimum_supported_calling_convention_version
  monkeypatch.setattr(
    _serialization, '_tf_max_calling_convention', lambda: oldest
  )
  seen = {}
  write = _saved_model._write_saved_model

  def spy(*args):
    seen['here'] = jax.config.jax_export_calling_convention_version
    other = threading.Thread(
      target=lambda: seen.setdefault(
        'other', jax.config.jax_export_calling_convention_version
      )
    )
    other.start()
    other.join()
    return write(*args)

  monkeypatch.setattr(_saved_model, '_write_saved_model', spy)
  sm = fdt_tf.save_saved_model(net, tmp_path / 'old', input_signature=spec)
  assert _xla_call_module_versions(sm) == {oldest}
  assert seen == {'here': oldest, 'other': current}
  assert jax.config.jax_export_calling_convention_version == current
  monkeypatch.setattr(
    _serialization, '_tf_max_calling_convention', lambda: oldest - 1
  )
  with pytest.raises(
    fdt.ExportError, match=rf'up to {oldest - 1} only.*newer tensorflow-cpu'
  ):
    fdt_tf.save_saved_model(net, tmp_path / 'none', input_signature=spec)
  assert sorted(os.listdir(tmp_path)) == ['now', 'old']


def _none_in_shape_dtype_struct():
  """A ShapeDtypeStruct with a None dimension, where this JAX allows one."""
  try:
    return jax.ShapeDtypeStruct((None, 64), jnp.float32)
  except ValueError:  # jax >= 0.11: symbolic dimensions only.
    return None


def test_polymorphic_inputs_spelled_every_way(auto_mesh, tmp_path):
  """tf.TensorSpec and symbolic ShapeDtypeStructs serve any batch size."""
  net = _trained(auto_mesh)
  spellings = {
    'tensor_spec': tf.TensorSpec([None, 64], tf.float32),
    'symbolic': jax.ShapeDtypeStruct(
      jax.export.symbolic_shape('batch, 64'), jnp.float32
    ),
  }
  if _none_in_shape_dtype_struct() is not None:
    spellings['none'] = _none_in_shape_dtype_struct()
  x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
  want = np.asarray(net(x))
  for name, spec in spellings.items():
    path = fdt_tf.save_saved_model(net, tmp_path / name, input_signature=[spec])
    served = tf.saved_model.load(path).signatures['serving_default']
    (inputs,) = served.structured_input_signature[1].values()
    assert inputs.shape.as_list() == [None, 64], name
    (got,) = served(input_0=tf.constant(x)).values()
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def test_stablehlo_is_written_for_the_installed_tensorflow(
  auto_mesh, tmp_path, monkeypatch
):
  """The artifact's StableHLO version is one TF's own reader reads."""
  from flax_dtensor.dtensor._serving import _serialization

  net = _trained(auto_mesh)
  spec = [tf.TensorSpec([None, 64], tf.float32)]
  tf_version = _serialization.tf_stablehlo_version()
  path = fdt_tf.save_saved_model(net, tmp_path / 'sm', input_signature=spec)
  (written,) = set(_artifact_versions(path))
  assert _version(written) <= _version(tf_version)
  assert _version(written) <= _version(_serialization.jax_stablehlo_target())
  # A TF reading only an older StableHLO gets that older version.
  monkeypatch.setattr(_serialization, 'tf_stablehlo_version', lambda: '1.0.0')
  path = fdt_tf.save_saved_model(net, tmp_path / 'old', input_signature=spec)
  assert set(_artifact_versions(path)) == {'1.0.0'}
  x = np.ones((3, 64), np.float32)
  served = tf.saved_model.load(path).signatures['serving_default']
  (got,) = served(input_0=tf.constant(x)).values()
  np.testing.assert_allclose(got.numpy(), net(x), rtol=1e-5, atol=1e-5)


def _call_module(module):
  """A traced function whose one XlaCallModule holds `module` (never run)."""
  from tensorflow.compiler.tf2xla.python import xla

  @tf.function(autograph=False)
  def call(x):
    return xla.call_module(
      [x],
      version=9,
      module=module,
      Sout=[tf.TensorShape([2])],
      Tout=[tf.float32],
      platforms=['CPU'],
    )

  return call.get_concrete_function(tf.TensorSpec([2], tf.float32))


def test_a_module_tf_cannot_load_is_refused_before_writing(tmp_path):
  from flax_dtensor.dtensor._serving import _serialization

  reads = _serialization.tf_stablehlo_version()
  cases = {
    # Not a portable artifact at all.
    'garbage': b'ML\xefR not a StableHLO artifact',
    # A header of a version TF reads, and a body it cannot parse.
    'broken': b'ML\xefR\x0dStableHLO_v' + reads.encode() + b'\x00\x01\xff',
  }
  messages = {}
  for name, module in cases.items():
    with pytest.raises(
      fdt.ExportError,
      match=r'export: the installed TensorFlow .* cannot load the StableHLO '
      r'module that JAX .* wrote for the forward pass \(XlaCallModule\)\. '
      r".*TensorFlow's XlaCallModule loader, the one that serves the "
      r'SavedModel, said: failed to deserialize StableHLO module.*\. Nothing '
      r'was written\. Install a TensorFlow',
    ) as raised:
      _serialization.check_readable(_call_module(module), 'export')
    messages[name] = str(raised.value)
  assert 'is not a StableHLO portable artifact' in messages['garbage']
  # The version is not the cause: said so, not "expected up to X, got X".
  assert (
    f'Its StableHLO version, {reads}, is one this TensorFlow reads (up to '
    f'{reads}): what it refuses is in the module itself.'
  ) in messages['broken']
  for message in messages.values():
    assert 'newer than' not in message
    assert 'Expected StableHLO' not in message


def test_no_stablehlo_target_writes_what_tf_cannot_serve(
  auto_mesh, tmp_path, monkeypatch
):
  """With JAX's own StableHLO target (past what TF 2.21 reads on jax 0.12),
  the export is refused before writing, or what it writes serves in TF."""
  from flax_dtensor.dtensor._serving import _serialization

  jax_target = _serialization.jax_stablehlo_target()
  monkeypatch.setattr(_serialization, 'target_for_tf', lambda: jax_target)
  net = _trained(auto_mesh)
  x = np.ones((3, 64), np.float32)
  try:
    path = fdt_tf.save_saved_model(
      net,
      tmp_path / 'sm',
      input_signature=[tf.TensorSpec([None, 64], tf.float32)],
    )
  except fdt.ExportError as e:
    reads = _serialization.tf_stablehlo_version()
    assert _version(jax_target) > _version(reads)
    assert (
      f'JAX wrote StableHLO {jax_target}, newer than the newest this '
      f"TensorFlow reads, {reads}. TensorFlow's XlaCallModule loader"
    ) in str(e)
    assert os.listdir(tmp_path) == []
  else:
    assert set(_artifact_versions(path)) == {jax_target}
    served = tf.saved_model.load(path).signatures['serving_default']
    (got,) = served(input_0=tf.constant(x)).values()
    np.testing.assert_allclose(got.numpy(), net(x), rtol=1e-5, atol=1e-5)


def _version(text):
  return tuple(int(p) for p in text.split('.'))


def _artifact_versions(path):
  from tensorflow.core.protobuf import saved_model_pb2

  proto = saved_model_pb2.SavedModel()
  with open(os.path.join(path, 'saved_model.pb'), 'rb') as f:
    proto.ParseFromString(f.read())
  return [
    re.search(rb'StableHLO_v([\d.]+)', node.attr['module'].s)[1].decode()
    for graph in proto.meta_graphs
    for fn in graph.graph_def.library.function
    for node in fn.node_def
    if node.op == 'XlaCallModule'
  ]


# Methods in another library's style: None arguments, pytree results
# ------------------------------------------------------------------------------


class TinyLM(nnx.Module):
  """An LLM written in another library's style: the forward pass takes
  `(tokens, positions, cache, attention_mask)` and returns `(logits,
  cache)`; called with `cache=None`, it returns `(logits, None)`."""

  traced = 0  # Calls of a method: each trace of the export calls it once.

  def __init__(self, rngs, *, vocab=64, embed=32, heads=4, max_len=32):
    self.embed = nnx.Embed(vocab, embed, rngs=rngs)
    self.pos = nnx.Embed(max_len, embed, rngs=rngs)
    self.qkv = nnx.Param(
      _part((None, None, 'model', None))(
        rngs.params(), (3, embed, heads, embed // heads)
      )
    )
    self.out = nnx.Param(
      _part(('model', None, None))(
        rngs.params(), (heads, embed // heads, embed)
      )
    )
    self.norm = nnx.RMSNorm(embed, rngs=rngs)

  def _layers(self, tokens, positions, attention_mask):
    TinyLM.traced += 1
    x = self.embed(tokens) + self.pos(positions)
    q, k, v = jnp.einsum('btd,sdhk->sbthk', x, self.qkv[...])
    scores = jnp.einsum('bthk,bshk->bhts', q, k) / np.sqrt(q.shape[-1])
    scores = jnp.where(attention_mask[:, None], scores, -1e9)
    probs = jax.nn.softmax(scores, axis=-1)
    h = jnp.einsum('bhts,bshk->bthk', probs, v)
    x = x + jnp.einsum('bthk,hkd->btd', h, self.out[...])
    return x, probs, self.embed.attend(self.norm(x))

  def __call__(self, tokens, positions, cache, attention_mask):
    # A real model would fill a given cache; served without one here.
    _, _, logits = self._layers(tokens, positions, attention_mask)
    return logits, cache

  def nested(self, tokens, positions, cache, attention_mask):
    x, probs, logits = self._layers(tokens, positions, attention_mask)
    return {
      'logits': logits,
      'cache': cache,
      'hidden': {'residual': x, 'attention': {'probs': probs, 'none': None}},
      'stats': [None, x.mean(-1)],
    }

  def scattered(self, tokens, positions, cache, attention_mask):
    x, probs, logits = self._layers(tokens, positions, attention_mask)
    return (None, logits, (None, x), cache, [probs, None])

  def tagged(self, tokens, positions, cache, attention_mask):
    return self(tokens, positions, cache, attention_mask)[0], 'v1'

  def clashing(self, tokens, positions, cache, attention_mask):
    logits = self(tokens, positions, cache, attention_mask)[0]
    return {'a/b': logits, 'a': {'b': logits}}

  def nothing(self, tokens, positions, cache, attention_mask):
    del tokens, positions, attention_mask
    return cache, [None]


def _tiny_lm(mesh):
  with jax.set_mesh(mesh):
    return TinyLM(nnx.Rngs(7))


def _lm_batch(rng, batch, length, vocab=64):
  tokens = rng.integers(0, vocab, (batch, length)).astype(np.int32)
  positions = np.broadcast_to(np.arange(length, dtype=np.int32), tokens.shape)
  mask = np.tril(np.ones((length, length), bool))
  mask = np.broadcast_to(mask, (batch, length, length))
  return {
    'tokens': tokens,
    'positions': np.ascontiguousarray(positions),
    'mask': np.ascontiguousarray(mask),
  }


# The LLM's signature, as its users write it: the cache is None.
LM_SIGNATURE = [
  tf.TensorSpec([None, 16], tf.int32),
  tf.TensorSpec([None, 16], tf.int32),
  None,
  tf.TensorSpec([None, 16, 16], tf.bool),
]
# Any batch and any sequence length: one symbol 't' for every length.
LM_ANY_LENGTH = [
  tf.TensorSpec([None, None], tf.int32, name='tokens'),
  tf.TensorSpec([None, None], tf.int32, name='positions'),
  None,
  tf.TensorSpec([None, None, None], tf.bool, name='mask'),
]


def _served_inputs(tmp_path, name, batch, names):
  """The batch's arrays, saved under the signature's input names."""
  return _save_inputs(
    tmp_path, name, {n: batch[k] for n, k in zip(names, batch, strict=True)}
  )


def test_llm_with_a_none_cache_serves_in_plain_tf(auto_mesh, tmp_path):
  """A language model whose cache is None serves in plain TensorFlow, at
  a fixed length and at any length, from each of its methods.

  Slow: four SavedModels (one of a fixed length, three of any length, each
  its own trace and export), all served in one TensorFlow process.
  """
  model = _tiny_lm(auto_mesh)
  rng = np.random.default_rng(5)
  sm = fdt_tf.save_saved_model(
    model,
    tmp_path / 'lm',
    input_signature=LM_SIGNATURE,
    # One per input (the arrays only): what `input_signature` derives.
    polymorphic_shapes=['(b, 16)', '(b, 16)', '(b, 16, 16)'],
  )
  any_length = {}
  for method in ('__call__', 'nested', 'scattered'):
    any_length[method] = fdt_tf.save_saved_model(
      model,
      tmp_path / f'any_{method}',
      method=method,
      input_signature=LM_ANY_LENGTH,
      # One per entry of `input_signature`, None where it has None.
      polymorphic_shapes=['(b, t)', '(b, t)', None, '(b, t, t)'],
    )
  fixed = [_lm_batch(rng, b, 16) for b in (1, 3)]
  varied = [_lm_batch(rng, 2, 16), _lm_batch(rng, 3, 9)]
  positional = ['input_0', 'input_1', 'input_3']
  named = ['tokens', 'positions', 'mask']
  models = {
    'lm': {
      'path': sm,
      'inputs': [
        _served_inputs(tmp_path, f'lm{i}', x, positional)
        for i, x in enumerate(fixed)
      ],
    },
  }
  for method, path in any_length.items():
    models[method] = {
      'path': path,
      'inputs': [
        _served_inputs(tmp_path, f'{method}{i}', x, named)
        for i, x in enumerate(varied)
      ],
    }
  report = _serve_in_plain_tf(tmp_path, models)
  assert report['jax_modules'] == []

  # Jitted: a compile a method and shape, not one an op.
  def jax_outputs(method, x):
    call = forwards.jitted(model, method)
    return call(x['tokens'], x['positions'], None, x['mask'])

  # The None argument is no input of the signature; `(logits, None)` is
  # served as output_0.
  assert report['lm']['inputs'] == positional
  assert report['lm']['outputs'] == {'output_0': [[1, 16, 64], [3, 16, 64]]}
  for i, x in enumerate(fixed):
    logits, cache = jax_outputs('__call__', x)
    assert cache is None
    got = np.load(tmp_path / f'lm_{i}_output_0.npy')
    np.testing.assert_allclose(got, logits, rtol=1e-5, atol=1e-5)
  # Any sequence length, by one symbol 't'.
  assert report['__call__']['inputs'] == ['mask', 'positions', 'tokens']
  assert report['__call__']['outputs'] == {
    'output_0': [[2, 16, 64], [3, 9, 64]]
  }
  for i, x in enumerate(varied):
    logits, _ = jax_outputs('__call__', x)
    got = np.load(tmp_path / f'__call___{i}_output_0.npy')
    np.testing.assert_allclose(got, logits, rtol=1e-5, atol=1e-5)
  # A dict with str keys: named by its keys, joined by '/'; None left out.
  assert report['nested']['outputs'] == {
    'hidden/attention/probs': [[2, 4, 16, 16], [3, 4, 9, 9]],
    'hidden/residual': [[2, 16, 32], [3, 9, 32]],
    'logits': [[2, 16, 64], [3, 9, 64]],
    'stats/1': [[2, 16], [3, 9]],
  }
  # A tuple with None at several places: output_0, 1, 2 in leaf order.
  assert report['scattered']['outputs'] == {
    'output_0': [[2, 16, 64], [3, 9, 64]],
    'output_1': [[2, 16, 32], [3, 9, 32]],
    'output_2': [[2, 4, 16, 16], [3, 4, 9, 9]],
  }
  for i, x in enumerate(varied):
    want = jax_outputs('nested', x)
    nested = {
      'logits': want['logits'],
      'hidden/residual': want['hidden']['residual'],
      'hidden/attention/probs': want['hidden']['attention']['probs'],
      'stats/1': want['stats'][1],
    }
    for key, value in nested.items():
      got = np.load(tmp_path / f'nested_{i}_{key}.npy'.replace('/', '|'))
      np.testing.assert_allclose(got, value, rtol=1e-5, atol=1e-5)
    want = [v for v in jax.tree.leaves(jax_outputs('scattered', x))]
    for j, value in enumerate(want):
      got = np.load(tmp_path / f'scattered_{i}_output_{j}.npy')
      np.testing.assert_allclose(got, value, rtol=1e-5, atol=1e-5)


def test_a_signature_that_does_not_fit_is_refused_before_tracing(
  auto_mesh, tmp_path
):
  model = _tiny_lm(auto_mesh)
  without_cache = [s for s in LM_SIGNATURE if s is not None]
  method = r'TinyLM\.__call__\(tokens, positions, cache, attention_mask\)'
  TinyLM.traced = 0
  with pytest.raises(
    fdt.ExportError,
    match=rf'Expected `input_signature` to fit {method}, which takes 4 '
    r'positional arguments; got 3 entries: \[TensorSpec\(\[None, 16\], '
    r'int32\), .*None for an argument passed as None',
  ):
    fdt_tf.save_saved_model(
      model, tmp_path / 'a', input_signature=without_cache
    )
  with pytest.raises(
    fdt.ExportError, match=rf'fit {method}, which takes 4 .* got 5 entries'
  ):
    fdt_tf.save_saved_model(
      model, tmp_path / 'b', input_signature=[*LM_SIGNATURE, None]
    )
  with pytest.raises(
    fdt.ExportError, match=r'`input_signature` to be a list .* got TensorSpec'
  ):
    fdt_tf.save_saved_model(
      model, tmp_path / 'c', input_signature=LM_SIGNATURE[0]
    )
  assert TinyLM.traced == 0
  assert os.listdir(tmp_path) == []


def test_polymorphic_shapes_around_none_arguments(auto_mesh, tmp_path):
  model = _tiny_lm(auto_mesh)
  with pytest.raises(
    fdt.ExportError,
    match=r'Expected None in `polymorphic_shapes` where `input_signature` '
    r"has None \(at \[2\]\), got \['\(b, 16\)', '\(b, 16\)', '\(b,\)'",
  ):
    fdt_tf.save_saved_model(
      model,
      tmp_path / 'a',
      input_signature=LM_SIGNATURE,
      polymorphic_shapes=['(b, 16)', '(b, 16)', '(b,)', '(b, 16, 16)'],
    )
  with pytest.raises(
    fdt.ExportError,
    match=r'one polymorphic shape per input \(3\) \(or one per entry of '
    r'`input_signature`, 4, with None where it has None\), got 2',
  ):
    fdt_tf.save_saved_model(
      model,
      tmp_path / 'b',
      input_signature=LM_SIGNATURE,
      polymorphic_shapes=['(b, 16)', '(b, 16)'],
    )
  assert os.listdir(tmp_path) == []


def test_symbols_of_their_own_that_meet_are_explained(auto_mesh, tmp_path):
  """[None, None] specs: each non-leading None is a symbol of its own."""
  model = _tiny_lm(auto_mesh)
  with pytest.raises(fdt.ExportError) as raised:
    fdt_tf.save_saved_model(
      model, tmp_path / 'sm', input_signature=LM_ANY_LENGTH
    )
  message = str(raised.value)
  assert message.startswith(
    'Tracing TinyLM.__call__ for the SavedModel failed where its polymorphic '
    'dimensions meet ('
  ), message
  assert (
    "In `input_signature`, a leading None is the batch 'b', shared by every "
    'input, and any other None is a size of its own, which JAX cannot know '
    'to equal another: tokens (b, d0_1), positions (b, d1_1), mask (b, d3_1, '
    'd3_2). Give the dimensions that are always equal one name with '
    '`polymorphic_shapes=` (one per entry of `input_signature`), e.g. '
    "polymorphic_shapes=['(b, t)', '(b, t)', None, '(b, t, t)'] if all are "
    'one length (e.g. a sequence length), or '
    "polymorphic_shapes=['(b, d1)', '(b, d1)', None, '(b, d1, d2)'] if "
    'those at the same position are.'
  ) in message, message
  # Chained to JAX's error, which is not ours.
  assert raised.value.__cause__ is not None
  assert not isinstance(raised.value.__cause__, fdt.FlaxDTensorError)
  assert os.listdir(tmp_path) == []
  # The first suggestion is what the serving test above exports.


def test_an_input_of_the_wrong_width_is_named_with_the_shape_it_needs(
  auto_mesh, tmp_path
):
  """JAX's refusal to contract 48 with 64, in our words: which input, the
  shape the forward needs and the one given (the command line's words)."""
  net = _trained(auto_mesh)
  with pytest.raises(fdt.ExportError) as raised:
    fdt_tf.save_saved_model(
      net,
      tmp_path / 'sm',
      input_signature=[tf.TensorSpec([None, 48], tf.float32, name='x')],
    )
  message = str(raised.value)
  assert message.startswith(
    '`input_signature` [TensorSpec([None, 48], float32)] does not fit '
    'Net.__call__: calling it on inputs of these shapes fails with '
    'TypeError: dot_general requires contracting dimensions to have the '
    'same shape, got (48,) and (64,). '
  ), message
  assert (
    'Dimension 1 of x is 48 where the forward needs 64: expected x '
    '[None, 64], got x [None, 48].'
  ) in message, message
  assert message.endswith(
    'Give one entry per positional parameter, in order, each of the shape '
    'the method takes (the batch dimension first).'
  ), message
  assert isinstance(raised.value.__cause__, TypeError)
  assert os.listdir(tmp_path) == []


def test_a_failure_that_names_no_symbol_of_its_own_is_jax_s(
  auto_mesh, tmp_path
):
  """Only a failure naming a symbol of their own is put in our words."""
  model = _tiny_lm(auto_mesh)
  wrong_dtype = [
    tf.TensorSpec([None, None], tf.float32),  # Tokens of the wrong dtype.
    tf.TensorSpec([None, None], tf.int32),
    None,
    tf.TensorSpec([None, None, None], tf.bool),
  ]
  # Flax's own error, about the dtype: raised as it is.
  with pytest.raises(Exception) as raised:
    fdt_tf.save_saved_model(model, tmp_path / 'sm', input_signature=wrong_dtype)
  assert not isinstance(raised.value, fdt.FlaxDTensorError), raised.value
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
  'method, match',
  [
    (
      'tagged',
      r'Expected the result of TinyLM\.tagged to hold only arrays and None, '
      r"got str at result\[1\]: 'v1'\. Return arrays",
    ),
    (
      'clashing',
      r'Expected each array of the result of TinyLM\.clashing to have a name '
      r"of its own, got 'a/b' twice: at result\['a'\]\['b'\] and "
      r"result\['a/b'\] \(the keys of nested dicts are joined by '/'\)",
    ),
    (
      'nothing',
      r'Expected the result of TinyLM\.nothing to hold at least one array, '
      r'got \(None, \[None\]\)',
    ),
  ],
  ids=['not-an-array', 'one-name-twice', 'no-array'],
)
def test_results_that_cannot_be_served(auto_mesh, tmp_path, method, match):
  model = _tiny_lm(auto_mesh)
  with pytest.raises(fdt.ExportError, match=match):
    fdt_tf.save_saved_model(
      model, tmp_path / 'sm', method=method, input_signature=LM_SIGNATURE
    )
  assert os.listdir(tmp_path) == []


def test_named_outputs():
  from flax_dtensor.dtensor._serving import _signature

  x, y = np.zeros(2), np.ones(3)
  named = _signature.named_outputs
  assert named(x, 'f') == {'output_0': x}
  assert named((x, None, [None, y]), 'f') == {'output_0': x, 'output_1': y}
  assert named({'b': {'c': x, 'd': None}, 'a': [y]}, 'f') == {
    'b/c': x,
    'a/0': y,
  }
  assert named({1: x, 2: y}, 'f') == {'output_0': x, 'output_1': y}
  assert named([np.float32(1.0), 2], 'f') == {
    'output_0': np.float32(1.0),
    'output_1': 2,
  }
  with pytest.raises(
    fdt.ExportError, match=r"got object at result\['a'\]\[0\]: <object"
  ):
    named({'a': [object()]}, 'f')
  with pytest.raises(
    fdt.ExportError, match=r'result of f to be a pytree .* cannot flatten'
  ):
    named({'a': x, 0: y}, 'f')


def test_parameters_and_suggestions():
  from flax_dtensor.dtensor._serving import _input_checks, _inputs

  class M(nnx.Module):
    def a(self, x, y=None, *, z=1):
      pass

    def b(self, x, *rest):
      pass

    def c(self, x, *, mode):
      pass

  m = M()
  a = _inputs.parameters(m, 'a')
  assert a.method == 'M.a(x, y=..., *, z=...)'
  assert a.takes() == 'takes from 1 to 2 positional arguments'
  assert [a.fits(n) for n in range(4)] == [False, True, True, False]
  b = _inputs.parameters(m, 'b')
  assert b.takes() == 'takes at least 1 positional argument'
  assert b.fits(9) and not b.fits(0)
  c = _inputs.parameters(m, 'c')
  assert c.takes() == (
    'needs the keyword-only argument(s) `mode`, which a signature cannot give'
  )
  assert not c.fits(1)
  suggested = _input_checks.suggested_dims
  assert suggested([(None, None), None, (None, None, None)]) == [
    [('b', 't'), None, ('b', 't', 't')],
    [('b', 'd1'), None, ('b', 'd1', 'd2')],
  ]
  assert suggested([(None, None, 3), ('b', 'n')]) == [
    [('b', 't', 3), ('b', 'n')]
  ]
