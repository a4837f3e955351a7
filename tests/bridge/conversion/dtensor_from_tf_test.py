"""Tests of flax_dtensor.dtensor.from_tf_module: TF variables back into NNX.

Values TensorFlow changed (an `assign` on every DVariable, Keras Adam steps
on one) must arrive in JAX, placed by the rules, on Explicit, Auto and
mixed meshes, across a change of mesh shape and device order. Placements
are checked against `fdt.plan` and `nnx.get_partition_spec`; buffers by
address (the way back does not copy where the layout is kept).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_dtensor as fdt

tf = pytest.importorskip('tensorflow')
fdt_tf = pytest.importorskip('flax_dtensor.dtensor')
dtensor = tf.experimental.dtensor

RULES = [('embed', 'data'), ('mlp', 'model')]


def _part(names, init=None):
  return nnx.with_partitioning(init or nnx.initializers.lecun_normal(), names)


class Tower(nnx.Module):
  """Layers in a dict, batch norm, dropout, and an unannotated projection."""

  def __init__(self, rngs, *, width=32):
    self.blocks = nnx.Dict(
      inp=nnx.Linear(
        16,
        width,
        kernel_init=_part(('embed', 'mlp')),
        bias_init=_part(('mlp',), nnx.initializers.normal()),
        rngs=rngs,
      ),
      out=nnx.Linear(width, 8, kernel_init=_part(('mlp', 'embed')), rngs=rngs),
    )
    self.norm = nnx.BatchNorm(width, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.proj = nnx.Linear(8, 4, rngs=rngs)  # No logical axes.

  def __call__(self, x):
    h = self.norm(jax.nn.relu(self.blocks['inp'](x)))
    return self.proj(self.blocks['out'](self.drop(h)))


def _tower(mesh, seed=0, rules=RULES):
  with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
    return Tower(nnx.Rngs(seed, dropout=seed + 1))


def _abstract_tower(mesh, rules=RULES):
  with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
    return nnx.eval_shape(lambda: Tower(nnx.Rngs(7, dropout=8)))


def _flat(module, kind=...):
  return {
    '/'.join(map(str, p)): v.get_value()
    for p, v in nnx.to_flat_state(nnx.state(module, kind))
  }


def _changed_by_tf(tf_module):
  """Every variable becomes 2 * value + 1 by TF; returns the new values."""
  out = {}
  for path, v in fdt_tf.flat_variables(tf_module).items():
    v.assign(v.read_value() * 2 + 1)
    out['/'.join(map(str, path))] = v
  return out


def _pointers(array):
  return {
    s.device: s.data.unsafe_buffer_pointer() for s in array.addressable_shards
  }


def _check_placed_as_planned(model, mesh, rules):
  """Actual placement = fdt.plan's spec = nnx.get_partition_spec's."""
  plan = fdt.plan(model, mesh=mesh, rules=rules)
  with fdt.logical_axis_rules(rules):
    pspecs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
  for path, value in _flat(model, nnx.Param).items():
    assert value.sharding.mesh == mesh, path
    spec = plan[path].spec
    assert _strip(value.sharding.spec) == _strip(spec), (path, spec)
  for path, spec in nnx.to_flat_state(pspecs):
    name = '/'.join(map(str, path))
    placed = _flat(model, nnx.Param)[name].sharding.spec
    assert _strip(placed) == _strip(spec.get_value()), name


def _strip(spec):
  """A PartitionSpec's entries without trailing Nones."""
  entries = list(spec)
  while entries and entries[-1] is None:
    entries.pop()
  return tuple(entries)


# The way back, by values
# ------------------------------------------------------------------------------


@pytest.mark.parametrize('mesh_name', ['explicit', 'auto', 'mixed'])
def test_values_tf_changed_arrive_in_jax(request, mesh_name):
  mesh = request.getfixturevalue(f'{mesh_name}_mesh')
  model = _tower(mesh)
  before = _flat(model)
  tf_module = fdt_tf.to_tf_module(model)
  _changed_by_tf(tf_module)
  expected = {
    k: np.asarray(v) * 2 + 1 for k, v in before.items() if 'rngs' not in k
  }
  # Into the model itself (concrete, updated in place) ...
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    returned = fdt_tf.from_tf_module(tf_module, model)
  assert returned is model
  after = _flat(model)
  for path, want in expected.items():
    np.testing.assert_array_equal(np.asarray(after[path]), want, err_msg=path)
    assert after[path].sharding == before[path].sharding, path
  # RNG state is left alone by default.
  assert after['drop/rngs/count'] is before['drop/rngs/count']
  # ... and into an abstract model, placed by other rules.
  other = [('embed', 'model'), ('mlp', 'data')]
  abstract = _abstract_tower(mesh, other)
  with jax.set_mesh(mesh), fdt.logical_axis_rules(other):
    filled = fdt_tf.from_tf_module(tf_module, abstract, rng_seed=0)
  values = _flat(filled)
  for path, want in expected.items():
    np.testing.assert_array_equal(np.asarray(values[path]), want, err_msg=path)
  assert values['blocks/inp/kernel'].sharding.spec == P('model', 'data')
  assert values['blocks/out/kernel'].sharding.spec == P('data', 'model')
  _check_placed_as_planned(filled, mesh, other)


def test_keras_optimizer_steps_arrive_in_jax(auto_mesh):
  """Adam steps taken by TF on a DVariable equal the same steps on tf.Variable."""
  import keras

  model = _tower(auto_mesh)
  tf_module = fdt_tf.to_tf_module(model, include=nnx.Param)
  kernel = fdt_tf.flat_variables(tf_module)['blocks/inp/kernel']
  reference = tf.Variable(np.asarray(model.blocks['inp'].kernel.get_value()))
  x = tf.constant(np.random.default_rng(0).standard_normal((4, 16)), tf.float32)

  def steps(variable, x):
    @tf.function
    def gradient():
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.tanh(tf.matmul(x, variable)) ** 2)
      return tape.gradient(loss, variable)

    optimizer = keras.optimizers.Adam(0.05)
    for _ in range(3):
      optimizer.apply_gradients([(gradient(), variable)])

  steps(reference, x)
  mesh = dtensor.fetch_layout(kernel.read_value()).mesh
  # The optimizer's own variables (Adam's moments) go on the kernel's
  # DTensor mesh, whatever mesh DTensor used last in this process.
  with dtensor.default_mesh(mesh):
    steps(kernel, dtensor.copy_to_mesh(x, dtensor.Layout.replicated(mesh, 2)))
  want = reference.numpy()
  assert not np.allclose(want, model.blocks['inp'].kernel.get_value())
  with jax.set_mesh(auto_mesh), fdt.logical_axis_rules(RULES):
    state = fdt_tf.from_tf_module(
      tf_module, nnx.state(model, nnx.Param), include=nnx.Param
    )
  got = state['blocks']['inp']['kernel'].get_value()
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
  assert got.sharding.spec == P('data', 'model')
  # A state target gives a new state: the model keeps its values.
  assert not np.allclose(
    np.asarray(model.blocks['inp'].kernel.get_value()), want
  )


def test_across_a_change_of_mesh_shape(auto_mesh):
  model = _tower(auto_mesh)
  tf_module = fdt_tf.to_tf_module(model, include=nnx.Param)
  _changed_by_tf(tf_module)
  want = {k: np.asarray(v) * 2 + 1 for k, v in _flat(model, nnx.Param).items()}
  for shape in [(4, 2), (8, 1), (1, 8)]:
    mesh = jax.make_mesh(
      shape, ('data', 'model'), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )
    abstract = _abstract_tower(mesh)
    with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
      state = fdt_tf.from_tf_module(
        tf_module, nnx.state(abstract, nnx.Param), include=nnx.Param
      )
    got = {
      '/'.join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)
    }
    assert sorted(got) == sorted(want)
    for path, value in got.items():
      np.testing.assert_array_equal(np.asarray(value), want[path], err_msg=path)
      assert value.sharding.mesh == mesh
    assert got['blocks/inp/kernel'].sharding.spec == P('data', 'model')


@pytest.mark.parametrize('order', ['reversed', 'transposed', 'shuffled'])
def test_permuted_device_orders(order):
  """DTensor ids are mesh positions: a naive mapping would permute values."""
  devices = np.asarray(jax.devices())
  permuted = {
    'reversed': devices[::-1],
    'transposed': devices.reshape(4, 2).T.reshape(-1),
    'shuffled': devices[[5, 2, 7, 0, 3, 6, 1, 4]],
  }[order]
  source = jax.make_mesh((2, 4), ('data', 'model'), devices=permuted)
  target = jax.make_mesh((2, 4), ('data', 'model'))
  model = _tower(source)
  tf_module = fdt_tf.to_tf_module(model, include=nnx.Param)
  _changed_by_tf(tf_module)
  want = {k: np.asarray(v) * 2 + 1 for k, v in _flat(model, nnx.Param).items()}
  for mesh, rules in [
    (target, RULES),
    (source, [('embed', 'model'), ('mlp', 'data')]),
  ]:
    abstract = _abstract_tower(mesh, rules)
    with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
      state = fdt_tf.from_tf_module(
        tf_module, nnx.state(abstract, nnx.Param), include=nnx.Param
      )
    for path, variable in nnx.to_flat_state(state):
      name = '/'.join(map(str, path))
      value = variable.get_value()
      np.testing.assert_array_equal(np.asarray(value), want[name], err_msg=name)
      # Each device holds exactly its slice.
      for shard in value.addressable_shards:
        np.testing.assert_array_equal(
          np.asarray(shard.data), want[name][shard.index], err_msg=name
        )


# Buffers: no copy where the layout is kept
# ------------------------------------------------------------------------------


def test_the_way_back_keeps_the_buffers(transposed_mesh):
  """Same layout: each JAX shard is the buffer TF's component holds."""
  model = _tower(transposed_mesh)
  tf_module = fdt_tf.to_tf_module(model, include=nnx.Param)
  flat = fdt_tf.flat_variables(tf_module)
  before = _flat(model, nnx.Param)
  with jax.set_mesh(transposed_mesh), fdt.logical_axis_rules(RULES):
    state = fdt_tf.from_tf_module(
      tf_module, nnx.state(model, nnx.Param), include=nnx.Param
    )
  back = {
    '/'.join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)
  }
  kernel = 'blocks/inp/kernel'
  # A sharded variable never written by TF: the original JAX buffers.
  assert back[kernel].sharding == before[kernel].sharding
  assert _pointers(back[kernel]) == _pointers(before[kernel])
  for path, value in back.items():
    components = dtensor.unpack(flat[path].read_value())
    addresses = {c._numpy().ctypes.data for c in components}
    assert set(_pointers(value).values()) <= addresses, path
  # TF copies before it writes: the JAX arrays keep their values.
  flat[kernel].assign(flat[kernel].read_value() * 0)
  np.testing.assert_array_equal(
    np.asarray(back[kernel]), np.asarray(before[kernel])
  )
  assert float(tf.reduce_sum(tf.abs(flat[kernel].read_value()))) == 0


@pytest.fixture
def transposed_mesh():
  devices = np.asarray(jax.devices()).reshape(4, 2).T
  return jax.sharding.Mesh(
    devices, ('data', 'model'), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )


# Other sources: dicts, lists, DVariables TF users made, plain variables
# ------------------------------------------------------------------------------


def test_a_dict_keyed_by_path(auto_mesh):
  model = _tower(auto_mesh)
  flat = fdt_tf.flat_variables(fdt_tf.to_tf_module(model, include=nnx.Param))
  keyed = {}
  for i, (path, v) in enumerate(flat.items()):
    keyed['/'.join(map(str, path)) if i % 2 else path] = v
  target = nnx.state(_tower(auto_mesh, seed=3), nnx.Param)
  with jax.set_mesh(auto_mesh), fdt.logical_axis_rules(RULES):
    state = fdt_tf.from_tf_module(keyed, target, include=nnx.Param)
  want = _flat(model, nnx.Param)
  for path, v in nnx.to_flat_state(state):
    name = '/'.join(map(str, path))
    np.testing.assert_array_equal(
      np.asarray(v.get_value()), np.asarray(want[name])
    )


def test_dvariables_tf_users_made(auto_mesh):
  """A DTensor mesh of TF's own device order, variables named by path."""
  rng = np.random.default_rng(1)
  kernel = rng.standard_normal((16, 32)).astype(np.float32)
  bias = rng.standard_normal(32).astype(np.float32)
  tf_mesh = dtensor.create_mesh(
    [('x', 4), ('y', 2)], device_type='CPU', use_xla_spmd=False
  )
  variables = [
    dtensor.DVariable(
      dtensor.copy_to_mesh(kernel, dtensor.Layout.replicated(tf_mesh, 2)),
      name='kernel',
    ),
    dtensor.DVariable(
      dtensor.copy_to_mesh(bias, dtensor.Layout.replicated(tf_mesh, 1)),
      name='bias',
    ),
  ]
  sharded = dtensor.Layout(['x', 'y'], tf_mesh)
  variables[0].assign(dtensor.relayout(variables[0].read_value() + 1, sharded))
  with jax.set_mesh(auto_mesh), fdt.logical_axis_rules(RULES):
    layer = nnx.Linear(
      16, 32, kernel_init=_part(('embed', 'mlp')), rngs=nnx.Rngs(0)
    )
    fdt_tf.from_tf_module(variables, layer)
  assert layer.kernel.get_value().sharding.spec == P('data', 'model')
  np.testing.assert_array_equal(
    np.asarray(layer.kernel.get_value()), kernel + 1
  )
  np.testing.assert_array_equal(np.asarray(layer.bias.get_value()), bias)


def test_plain_tf_variables_and_a_loaded_saved_model(auto_mesh, tmp_path):
  model = _tower(auto_mesh)
  serving = nnx.view(model, deterministic=True, use_running_average=True)
  path = fdt_tf.save_saved_model(
    serving, tmp_path / 'sm', input_signature=[tf.TensorSpec([None, 16])]
  )
  loaded = tf.saved_model.load(path)
  target = _abstract_tower(auto_mesh)
  with jax.set_mesh(auto_mesh), fdt.logical_axis_rules(RULES):
    fdt_tf.from_tf_module(loaded, target, rng_seed=0)
  want = _flat(model)
  for path, value in _flat(target).items():
    if 'rngs' in path:
      continue
    np.testing.assert_array_equal(np.asarray(value), np.asarray(want[path]))
  plain = {'blocks/out/bias': tf.Variable(np.arange(8, dtype=np.float32))}
  state = fdt_tf.from_tf_module(
    plain, nnx.State({'blocks': {'out': {'bias': model.blocks['out'].bias}}})
  )
  np.testing.assert_array_equal(
    np.asarray(state['blocks']['out']['bias'].get_value()), np.arange(8)
  )


def test_dtypes_and_rng_keys(auto_mesh):
  """bfloat16 and uint32 as they are; RNG keys as key data, when asked."""
  with jax.set_mesh(auto_mesh):
    state = nnx.State(
      {
        'w': nnx.Param(
          jax.device_put(
            jnp.arange(32, dtype=jnp.bfloat16).reshape(8, 4),
            NamedSharding(auto_mesh, P('data', 'model')),
          )
        ),
        'n': nnx.BatchStat(jnp.arange(8, dtype=jnp.uint32)),
        'key': nnx.RngKey(jax.random.key(3)),
      }
    )
  tf_module = fdt_tf.to_tf_module(state, exclude=nnx.Nothing)
  back = fdt_tf.from_tf_module(
    tf_module, jax.tree.map(lambda x: x, state), exclude=nnx.Nothing
  )
  assert back['w'].get_value().dtype == jnp.bfloat16
  np.testing.assert_array_equal(back['w'].get_value(), state['w'].get_value())
  assert back['w'].get_value().sharding.spec == P('data', 'model')
  np.testing.assert_array_equal(back['n'].get_value(), np.arange(8))
  np.testing.assert_array_equal(
    jax.random.key_data(back['key'].get_value()),
    jax.random.key_data(state['key'].get_value()),
  )


# Errors
# ------------------------------------------------------------------------------


def test_errors(auto_mesh):
  model = _tower(auto_mesh)
  tf_module = fdt_tf.to_tf_module(model, include=nnx.Param)
  flat = fdt_tf.flat_variables(tf_module)
  params = nnx.state(model, nnx.Param)
  with pytest.raises(
    fdt.ExportError,
    match=r'The tf\.Module lacks 2 variables the target needs: norm/mean, '
    r'norm/var\. It holds 8 variables:.*narrower `include=`',
  ):
    fdt_tf.from_tf_module(tf_module, model)
  with pytest.raises(
    fdt.ExportError,
    match=r'The dict of TF variables holds 1 variable\(s\) the target does '
    r'not have: extra.*`allow_extra=True`',
  ):
    fdt_tf.from_tf_module(
      {**flat, 'extra': flat['proj/bias']}, params, include=nnx.Param
    )
  fdt_tf.from_tf_module(
    {**flat, 'extra': flat['proj/bias']},
    params,
    include=nnx.Param,
    allow_extra=True,
  )
  swapped = {**flat, ('proj', 'bias'): flat['blocks/out/bias']}
  with pytest.raises(
    fdt.ExportError,
    match=r"Shape mismatch for 'proj/bias': the target expects \(4,\), the "
    r'dict of TF variables holds \(8,\)\. Build the target',
  ):
    fdt_tf.from_tf_module(swapped, params, include=nnx.Param)
  narrow = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  with pytest.raises(
    fdt.ExportError,
    match=r"Dtype mismatch for 8 variables: 'blocks/inp/bias': the target "
    r"expects bfloat16, the tf\.Module has float32; 'blocks/inp/kernel': the "
    r"target expects bfloat16, it has float32;.* 'proj/kernel': the target "
    r'expects bfloat16, it has float32\. A restore does not convert.*'
    r'`convert_dtypes=True`, or leave these variables out',
  ):
    fdt_tf.from_tf_module(tf_module, narrow, include=nnx.Param)
  converted = fdt_tf.from_tf_module(
    tf_module, narrow, include=nnx.Param, convert_dtypes=True
  )
  kernel = converted['blocks']['inp']['kernel'].get_value()
  assert kernel.dtype == jnp.bfloat16
  np.testing.assert_array_equal(
    kernel, model.blocks['inp'].kernel.get_value().astype(jnp.bfloat16)
  )
  with pytest.raises(
    fdt.ExportError,
    match=r"holds two TF variables for the NNX path 'proj/bias': "
    r"\('proj', 'bias'\) and 'proj/bias'",
  ):
    fdt_tf.from_tf_module(
      {('proj', 'bias'): flat['proj/bias'], 'proj/bias': flat['proj/bias']},
      params,
    )
  with pytest.raises(fdt.ExportError, match=r'got the key 3 \(int\)'):
    fdt_tf.from_tf_module({3: flat['proj/bias']}, params)
  with pytest.raises(
    fdt.ExportError,
    match=r"Expected a TF variable or tensor for the NNX path 'proj/bias', "
    r'got ndarray',
  ):
    fdt_tf.from_tf_module({'proj/bias': np.zeros(4)}, params)
  with pytest.raises(
    fdt.ExportError, match=r'Expected a tf\.Module from to_tf_module.*got Tower'
  ):
    fdt_tf.from_tf_module(model, params)
  with pytest.raises(fdt.ExportError, match=r'got a list holding ndarray'):
    fdt_tf.from_tf_module([np.zeros(4)], params)
  with pytest.raises(fdt.NotAModelError):
    fdt_tf.from_tf_module(tf_module, lambda: model)
  abstract = _abstract_tower(auto_mesh)
  with pytest.raises(
    fdt.ExportError,
    match=r"'blocks/inp/bias' has a sharding on an abstract mesh.*"
    r'jax\.set_mesh\(mesh\), or pass `mesh=`',
  ):
    fdt_tf.from_tf_module(tf_module, abstract, include=nnx.Param)
  with pytest.raises(
    fdt.ExportError,
    match=r'The target is abstract, and 4 of its variables are not restored:'
    r' drop/rngs/count, drop/rngs/key, norm/mean, norm/var',
  ):
    fdt_tf.from_tf_module(
      tf_module, abstract, include=nnx.Param, mesh=auto_mesh
    )


def test_a_wider_target_names_every_mismatch_at_once(auto_mesh):
  tf_module = fdt_tf.to_tf_module(_tower(auto_mesh), include=nnx.Param)
  with jax.set_mesh(auto_mesh), fdt.logical_axis_rules(RULES):
    wider = Tower(nnx.Rngs(0, dropout=1), width=48)
  before = _flat(wider, nnx.Param)
  with pytest.raises(fdt.ExportError) as info:
    fdt_tf.from_tf_module(tf_module, wider, include=nnx.Param)
  assert str(info.value) == (
    "Shape mismatch for 5 variables: 'blocks/inp/bias': the target expects "
    "(48,), the tf.Module holds (32,); 'blocks/inp/kernel': the target "
    "expects (16, 48), it holds (16, 32); 'blocks/out/kernel': the target "
    "expects (48, 8), it holds (32, 8); 'norm/bias': the target expects "
    "(48,), it holds (32,); 'norm/scale': the target expects (48,), it "
    'holds (32,). Build the target with the shapes that were exported (the '
    'same model configuration), or leave these variables out with '
    '`include=`/`exclude=`.'
  )
  after = _flat(wider, nnx.Param)
  for name, value in before.items():  # Unchanged.
    np.testing.assert_array_equal(after[name], value, err_msg=name)
