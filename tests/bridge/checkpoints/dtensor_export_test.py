"""Tests of NNX <-> DVariables, checkpoints (flax_dtensor.dtensor)."""

import base64
import json
import os
import re
import socket
import sys
import textwrap

import google_crc32c
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support import manifests

import flax_dtensor as fdt
from flax_dtensor.dtensor._checkpoints import _checkpoint
from flax_dtensor.dtensor._conversion import _convert
from flax_dtensor.dtensor._format import _decode
from flax_dtensor.dtensor._layout import _dtypes
from flax_dtensor.dtensor._storage import _atomic, _temporaries

tf = pytest.importorskip('tensorflow')
fdt_tf = pytest.importorskip('flax_dtensor.dtensor')
dtensor = tf.experimental.dtensor

DTYPES = ['float32', 'bfloat16', 'float16', 'int8', 'int32', 'uint32', 'bool']
# Every dtype a JAX array can have. Each either round-trips bit-exactly
# through save_checkpoint / restore_checkpoint and plain TF, or is refused
# before anything is written. The 64-bit ones run under jax.enable_x64.
ROUND_TRIP_DTYPES = [
  'float32',
  'bfloat16',
  'float16',
  'float8_e4m3fn',
  'float8_e5m2',
  'float8_e4m3fnuz',
  'float8_e4m3b11fnuz',
  'float8_e5m2fnuz',
  'float8_e3m4',
  'float8_e4m3',
  'float8_e8m0fnu',
  'float4_e2m1fn',
  'int2',
  'int4',
  'int8',
  'int16',
  'int32',
  'int64',
  'uint2',
  'uint4',
  'uint8',
  'uint16',
  'uint32',
  'bool',
  'complex64',
  'float64',
  'complex128',
]
REFUSED_DTYPES = ['uint64']
_X64_DTYPES = {'int64', 'uint64', 'float64', 'complex128'}


@pytest.fixture
def transposed_mesh():
  """A (2, 4) Auto mesh whose devices are not in id order."""
  devices = np.asarray(jax.devices()).reshape(4, 2).T
  return jax.sharding.Mesh(
    devices, ('data', 'model'), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )


def _part(names, init=None):
  return nnx.with_partitioning(init or nnx.initializers.lecun_normal(), names)


class MLP(nnx.Module):
  """Two sharded layers, batch norm and dropout (which holds an nnx.Rngs)."""

  def __init__(self, rngs, *, din=16, hidden=32, dout=8, dtype=jnp.float32):
    self.layers = nnx.List(
      [
        nnx.Linear(
          din,
          hidden,
          kernel_init=_part(('data', 'model')),
          bias_init=_part(('model',), nnx.initializers.normal()),
          param_dtype=dtype,
          dtype=dtype,
          rngs=rngs,
        ),
        nnx.Linear(
          hidden,
          dout,
          kernel_init=_part(('model', None)),
          param_dtype=dtype,
          dtype=dtype,
          rngs=rngs,
        ),
      ]
    )
    self.norm = nnx.BatchNorm(hidden, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    h = self.norm(jax.nn.relu(self.layers[0](x)).astype(jnp.float32))
    return self.layers[1](self.drop(h).astype(self.layers[1].kernel.dtype))


def _make_mlp(mesh, seed=0, **kwargs):
  with jax.set_mesh(mesh):
    return MLP(nnx.Rngs(seed, dropout=seed + 1), **kwargs)


def _gathered(v):
  """The global value of a DVariable, gathered by DTensor itself."""
  t = v.read_value()
  layout = dtensor.fetch_layout(t)
  full = dtensor.relayout(t, dtensor.Layout.replicated(layout.mesh, t.ndim))
  return dtensor.unpack(full)[0].numpy()


def _bits(x):
  """The dtype, shape and raw bytes of an array, for bit-exact comparisons."""
  x = np.ascontiguousarray(np.asarray(x))
  return x.dtype.name, x.shape, x.tobytes()


def _text(path):
  """'layers/0/kernel' for a path tuple."""
  return '/'.join(map(str, path))


def _records(path):
  """The manifest's variable records, by '/'-joined path."""
  with open(os.path.join(path, 'flax_dtensor.json')) as f:
    variables = json.load(f)['variables']
  return {'/'.join(map(str, r['path'])): r for r in variables}


def _listing(directory):
  return sorted(os.listdir(directory))


def _sharding_axes(arr):
  return tuple(arr.sharding.spec) + (None,) * (
    arr.ndim - len(arr.sharding.spec)
  )


# ---------------------------------------------------------------------------
# to_tf_module
# ---------------------------------------------------------------------------


@pytest.mark.parametrize('mesh_name', ['explicit', 'auto', 'transposed'])
def test_to_tf_module_names_layouts_and_values(request, mesh_name):
  mesh = request.getfixturevalue(f'{mesh_name}_mesh')
  model = _make_mlp(mesh)
  tf_module = fdt_tf.to_tf_module(model, include=nnx.Param)
  flat = fdt_tf.flat_variables(tf_module)
  expected = {
    p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
  }
  assert list(flat) == sorted(expected, key=_text)
  assert sorted(map(_text, flat)) == [
    'layers/0/bias',
    'layers/0/kernel',
    'layers/1/bias',
    'layers/1/kernel',
    'norm/bias',
    'norm/scale',
  ]
  assert len(tf_module.variables) == len(expected)
  assert tf_module.state['layers']['0']['kernel'] is flat['layers/0/kernel']
  for path, var in flat.items():
    arr = expected[path]
    assert var.name == f'{_text(path)}:0'
    assert var.trainable
    assert var.dtype == tf.float32
    assert tuple(var.shape) == arr.shape
    layout = dtensor.fetch_layout(var.read_value())
    want = [a or dtensor.UNSHARDED for a in _sharding_axes(arr)]
    assert list(layout.sharding_specs) == want, path
    np.testing.assert_array_equal(_gathered(var), np.asarray(arr), err_msg=path)
  assert _sharding_axes(expected[('layers', 0, 'kernel')]) == ('data', 'model')


def test_to_tf_module_include_filters(auto_mesh):
  model = _make_mlp(auto_mesh)
  both = fdt_tf.flat_variables(
    fdt_tf.to_tf_module(model, include=(nnx.Param, nnx.BatchStat))
  )
  assert {'norm/mean', 'norm/var', 'layers/0/kernel'} <= set(map(_text, both))
  assert not both['norm/mean'].trainable
  np.testing.assert_array_equal(_gathered(both['norm/var']), np.ones(32))
  everything = fdt_tf.flat_variables(fdt_tf.to_tf_module(model, include=...))
  # RNG state (the Dropout's nnx.Rngs) is skipped by default.
  assert set(everything) == set(both)
  # The default selection is every variable but RNG state.
  assert set(fdt_tf.flat_variables(fdt_tf.to_tf_module(model))) == set(both)
  with_rng = fdt_tf.flat_variables(
    fdt_tf.to_tf_module(model, include=..., exclude=nnx.Nothing)
  )
  assert set(map(_text, with_rng)) - set(map(_text, both)) == {
    'drop/rngs/count',
    'drop/rngs/key',
  }
  key = model.drop.rngs.key.get_value()
  np.testing.assert_array_equal(
    _gathered(with_rng['drop/rngs/key']), jax.random.key_data(key)
  )
  assert with_rng['drop/rngs/count'].dtype == tf.uint32


@pytest.mark.parametrize('dtype', DTYPES)
def test_to_tf_module_keeps_dtypes(explicit_mesh, dtype):
  state = _dtype_state(explicit_mesh, dtype)
  flat = fdt_tf.flat_variables(fdt_tf.to_tf_module(state, include=...))
  arrays = dict(nnx.to_flat_state(state))
  for path, var in flat.items():
    arr = arrays[path].get_value()
    assert var.dtype == tf.as_dtype(np.dtype(dtype)), path
    # DTensor's all-gather adds zeros (so -0.0 comes back as 0.0): compare
    # values there, and bits through the bridge's zero-copy way back.
    np.testing.assert_array_equal(_gathered(var), arr, err_msg=path)
    back = fdt_tf.dtensor_to_array(var, sharding=arr.sharding)
    assert _bits(back) == _bits(arr), path


def test_to_tf_module_aliases_jax_buffers_and_never_writes_them(auto_mesh):
  model = _make_mlp(auto_mesh)
  before = np.asarray(model.layers[0].kernel.get_value()).copy()
  var = fdt_tf.flat_variables(fdt_tf.to_tf_module(model))['layers/0/kernel']
  var.assign(tf.zeros_like(var))
  np.testing.assert_array_equal(_gathered(var), np.zeros_like(before))
  np.testing.assert_array_equal(model.layers[0].kernel.get_value(), before)


def test_to_tf_module_errors(auto_mesh):
  model = _make_mlp(auto_mesh)
  with pytest.raises(fdt.ExportError, match=r'No NNX variable .*nnx.OptState'):
    fdt_tf.to_tf_module(model, include=nnx.OptState)
  with jax.set_mesh(auto_mesh):
    abstract = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
  with pytest.raises(fdt.ExportError, match=r"'layers/0/bias'.*abstract"):
    fdt_tf.to_tf_module(abstract)
  holder = nnx.Dict(tag=nnx.Variable('not an array'))
  with pytest.raises(fdt.ExportError, match=r"'tag'.*hold an array.*str"):
    fdt_tf.to_tf_module(holder, include=...)
  with pytest.raises(fdt.NotAModelError, match=r'NNX module.*got int'):
    fdt_tf.to_tf_module(3)
  with pytest.raises(fdt.NotAModelError, match=r'NNX variables.*leaves.* w\.'):
    fdt_tf.to_tf_module(nnx.State({'w': jnp.ones(3)}), include=...)
  big = nnx.Dict(w=nnx.Variable(np.zeros(3, np.uint64)))
  with pytest.raises(fdt.ExportError, match=r"'w' has dtype uint64"):
    fdt_tf.to_tf_module(big, include=...)


def test_checkpoint_key_and_nnx_path():
  assert (
    fdt_tf.checkpoint_key(('layers', 0, 'attn', 'query', 'kernel'))
    == 'state/layers/0/attn/query/kernel/.ATTRIBUTES/VARIABLE_VALUE'
  )
  assert fdt_tf.checkpoint_key('a.b/c') == (
    'state/a..b/c/.ATTRIBUTES/VARIABLE_VALUE'
  )
  assert fdt_tf.checkpoint_key(('x/y', 'z')) == (
    'state/x.Sy/z/.ATTRIBUTES/VARIABLE_VALUE'
  )
  for path in [('layers', 0, 'kernel'), ('a.b', 'c..d'), ('w',)]:
    assert fdt_tf.nnx_path(fdt_tf.checkpoint_key(path)) == path
  # A '/'-joined str is split, its digit parts read as list indices.
  assert fdt_tf.checkpoint_key('layers/0/kernel') == fdt_tf.checkpoint_key(
    ('layers', 0, 'kernel')
  )
  assert fdt_tf.nnx_path('_CHECKPOINTABLE_OBJECT_GRAPH') is None
  assert fdt_tf.nnx_path('other/w/.ATTRIBUTES/VARIABLE_VALUE') is None


# ---------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------


def _dtype_values(dtype, seed=0):
  rng = np.random.default_rng(seed)
  dtype = np.dtype(jnp.dtype(dtype))
  if dtype == np.bool_:
    return rng.random((8, 16)) > 0.5, np.bool_(True)
  if jnp.issubdtype(dtype, jnp.integer):
    info = ml_dtypes.iinfo(dtype)
    native = dtype if dtype.kind in 'iu' else np.int64  # int4: from int64.
    big = rng.integers(info.min, info.max, (8, 16), endpoint=True, dtype=native)
    return big.astype(dtype), np.asarray(info.max, native).astype(dtype)
  values = rng.standard_normal((8, 16)) * 100
  # Float8 types without infinities turn these into NaNs.
  values[0, :4] = [0.0, -0.0, np.inf, -np.inf]
  if jnp.issubdtype(dtype, jnp.complexfloating):
    values = values + 1j * rng.standard_normal((8, 16))
  return values.astype(dtype), np.asarray(-1.5).astype(dtype)


_SPECS = (P('data', 'model'), P(None, 'model'))


def _dtype_state(mesh, dtype, *, specs=_SPECS):
  """A state of `dtype` arrays: 2 layouts, replicated, and a scalar."""
  matrix, scalar = _dtype_values(dtype)
  arrays = {
    'sharded': jax.device_put(matrix, NamedSharding(mesh, specs[0])),
    'columns': jax.device_put(matrix[:, ::-1], NamedSharding(mesh, specs[1])),
    'replicated': jax.device_put(matrix.T, NamedSharding(mesh, P())),
    'scalar': jax.device_put(scalar, NamedSharding(mesh, P())),
  }
  return nnx.State({k: nnx.Variable(v) for k, v in arrays.items()})


@pytest.mark.parametrize('dtype', ROUND_TRIP_DTYPES)
def test_checkpoint_round_trip_is_bit_exact(explicit_mesh, tmp_path, dtype):
  with jax.enable_x64(dtype in _X64_DTYPES):
    state = _dtype_state(explicit_mesh, dtype)
    assert state['sharded'].get_value().dtype == jnp.dtype(dtype)
    path = fdt_tf.save_checkpoint(state, tmp_path / 'ckpt')
    assert path == str(tmp_path / 'ckpt')
    assert 'checkpoint' in _listing(path)
    stored = _dtypes.STORED_DTYPES.get(np.dtype(jnp.dtype(dtype)))
    record = _records(path)['sharded']
    assert record['dtype'] == dtype
    assert record['stored_dtype'] == (stored or np.dtype(dtype)).name
    # Plain TF reads it: widened dtypes convert back exactly.
    reader = tf.train.load_checkpoint(path)
    for name, var in nnx.to_flat_state(state):
      arr = np.asarray(var.get_value())
      got = reader.get_tensor(fdt_tf.checkpoint_key(name))
      assert got.dtype == (stored or arr.dtype), name
      assert got.shape == arr.shape
      assert _bits(got.astype(arr.dtype)) == _bits(arr), name
    read = fdt_tf.read_checkpoint(path)
    assert list(read) == [
      ('columns',),
      ('replicated',),
      ('scalar',),
      ('sharded',),
    ]
    for (name,), var in nnx.to_flat_state(state):
      assert _bits(read[name]) == _bits(var.get_value()), name
    # Restore into other shardings: through DTensor, relaid out by slices.
    target = _dtype_state(
      explicit_mesh, dtype, specs=(P('model', 'data'), P('data', None))
    )
    for var in target.values():
      var.set_value(jnp.zeros_like(var.get_value()))
    restored = fdt_tf.restore_checkpoint(path, target)
  assert isinstance(restored, nnx.State)
  for (name,), var in nnx.to_flat_state(restored):
    arr = var.get_value()
    assert arr.sharding == target[name].get_value().sharding, name
    assert _bits(arr) == _bits(state[name].get_value()), name
  assert restored['sharded'].get_value().sharding.spec == P('model', 'data')


@pytest.mark.parametrize('dtype', REFUSED_DTYPES)
def test_unstorable_dtypes_are_refused_before_writing(
  explicit_mesh, tmp_path, dtype
):
  with jax.enable_x64(dtype in _X64_DTYPES):
    state = _dtype_state(explicit_mesh, dtype)
    for save in (
      lambda: fdt_tf.save_checkpoint(state, tmp_path / 'ckpt'),
      lambda: fdt_tf.save_saved_model(
        state, tmp_path / 'sm', input_signature=[], method='__repr__'
      ),
      lambda: fdt_tf.to_tf_module(state),
    ):
      with pytest.raises(
        fdt.ExportError,
        match=rf"'columns' has dtype {dtype}.*expected one of .*float8_e4m3fn"
        r'.*Cast it',
      ):
        save()
  assert _listing(tmp_path) == []


def test_to_tf_module_refuses_dtypes_tf_lacks(explicit_mesh):
  state = _dtype_state(explicit_mesh, 'int2')
  with pytest.raises(
    fdt.ExportError,
    match=r"'columns' has dtype int2, for which TensorFlow has no usable"
    r'.*store it widened to int8',
  ):
    fdt_tf.to_tf_module(state)
  # TF holds float8_e4m3fn itself: kept as it is.
  state = _dtype_state(explicit_mesh, 'float8_e4m3fn')
  flat = fdt_tf.flat_variables(fdt_tf.to_tf_module(state))
  assert flat['sharded'].dtype.name == 'float8_e4m3fn'
  arr = state['sharded'].get_value()
  back = fdt_tf.dtensor_to_array(flat['sharded'], sharding=arr.sharding)
  assert _bits(back) == _bits(arr)


def test_checkpoint_widens_only_unreadable_dtypes(auto_mesh, tmp_path):
  values = {
    dtype: jax.device_put(
      _dtype_values(dtype)[0], NamedSharding(auto_mesh, P('data', 'model'))
    )
    for dtype in DTYPES
  }
  state = nnx.State({k: nnx.Variable(v) for k, v in values.items()})
  path = fdt_tf.save_checkpoint(state, tmp_path / 'c', include=...)
  dtypes = tf.train.load_checkpoint(path).get_variable_to_dtype_map()
  stored = {d: dtypes[fdt_tf.checkpoint_key(d)].name for d in DTYPES}
  assert stored == {
    'float32': 'float32',
    'bfloat16': 'bfloat16',
    'float16': 'float32',
    'int8': 'int8',
    'int32': 'int32',
    'uint32': 'int64',
    'bool': 'bool',
  }
  with open(os.path.join(path, 'flax_dtensor.json')) as f:
    meta = json.load(f)
  assert meta['format'] == 'flax_dtensor.checkpoint'
  assert (meta['version'], meta['checksum']) == (5, 'crc32c')
  record = _records(path)['float16']
  shards = record.pop('shards')
  assert record == {
    'path': ['float16'],
    'key': 'state/float16/.ATTRIBUTES/VARIABLE_VALUE',
    'type': 'Variable',
    'dtype': 'float16',
    'stored_dtype': 'float32',
    'shape': [8, 16],
    'key_impl': None,
    'sharding': {
      'kind': 'named',
      'spec': [['data'], ['model']],
      'mesh': {'axis_names': ['data', 'model'], 'axis_sizes': [2, 4]},
      'dtensor_layout': {
        'sharding_specs': ['data', 'model'],
        'mesh': {'axis_names': ['data', 'model'], 'axis_sizes': [2, 4]},
      },
    },
  }
  # One CRC-32C per distinct (2 x 4) block, of the saved dtype's bytes, in
  # row-major order: 4 little-endian bytes each, in base64.
  value = np.asarray(state['float16'].get_value())
  assert shards['blocks'] == [2, 4]
  crcs = np.frombuffer(base64.b64decode(shards['crc32c']), '<u4')
  assert len(crcs) == 8
  for k, (i, j) in enumerate(np.ndindex(2, 4)):
    block = np.ascontiguousarray(value[4 * i : 4 * i + 4, 4 * j : 4 * j + 4])
    assert crcs[k] == google_crc32c.value(block.tobytes())
  # Every file of the checkpoint, with its size.
  for name, record in meta['files'].items():
    assert os.path.getsize(os.path.join(path, name)) == record['bytes']
  assert {'checkpoint', 'ckpt.index'} <= set(meta['files'])


def test_checkpoint_metadata_records_layouts_as_data(
  auto_mesh, transposed_mesh, tmp_path
):
  state = _mixed_state(auto_mesh, transposed_mesh)
  path = fdt_tf.save_checkpoint(state, tmp_path / 'c')
  records = _records(path)
  shardings = {name: r['sharding'] for name, r in records.items()}
  mesh = {'axis_names': ['data', 'model'], 'axis_sizes': [2, 4]}
  # A dimension over two JAX axes is on one fused DTensor axis.
  assert shardings['fused'] == {
    'kind': 'named',
    'spec': [['data', 'model'], []],
    'mesh': mesh,
    'dtensor_layout': {
      'sharding_specs': ['data+model', 'unsharded'],
      'mesh': {'axis_names': ['data+model'], 'axis_sizes': [8]},
    },
  }
  assert shardings['fused_half']['dtensor_layout'] == {
    'sharding_specs': ['unsharded', 'model+data'],
    'mesh': {'axis_names': ['model+data'], 'axis_sizes': [8]},
  }
  assert shardings['replicated']['spec'] == [[], []]
  assert shardings['replicated']['dtensor_layout']['sharding_specs'] == [
    'unsharded',
    'unsharded',
  ]
  assert shardings['one_device'] == {
    'kind': 'single_device',
    'spec': [[], []],
    'mesh': {'axis_names': [], 'axis_sizes': []},
    'dtensor_layout': {
      'sharding_specs': ['unsharded', 'unsharded'],
      'mesh': {'axis_names': ['single_device'], 'axis_sizes': [1]},
    },
  }
  # Each record is the layout DTensor really used.
  for name, var in state.items():
    layout = fdt_tf.layout_for(var.get_value().sharding, 2)
    want = shardings[name]['dtensor_layout']
    assert list(layout.sharding_specs) == want['sharding_specs'], name
    assert list(layout.mesh.dim_names) == want['mesh']['axis_names'], name


def _mixed_state(mesh, other_mesh, seed=0):
  """Arrays on 4 different DTensor meshes (DTensor saves one at a time)."""
  rng = np.random.default_rng(seed)
  specs = {
    'grid': NamedSharding(mesh, P('data', 'model')),
    'fused': NamedSharding(mesh, P(('data', 'model'), None)),
    'fused_half': NamedSharding(mesh, P(None, ('model', 'data'))),
    'other_mesh': NamedSharding(other_mesh, P('model', 'data')),
    'one_device': jax.sharding.SingleDeviceSharding(jax.devices()[5]),
    'replicated': NamedSharding(mesh, P()),
  }
  dtypes = {'fused_half': np.float16, 'one_device': np.int32}
  out = {}
  for name, sharding in specs.items():
    x = (rng.standard_normal((16, 8)) * 50).astype(dtypes.get(name, np.float32))
    out[name] = nnx.Param(jax.device_put(x, sharding))
  return nnx.State(out)


def test_checkpoint_with_arrays_on_several_meshes(
  auto_mesh, transposed_mesh, tmp_path
):
  state = _mixed_state(auto_mesh, transposed_mesh)
  meshes = {
    dtensor.fetch_layout(fdt_tf.array_to_dtensor(v.get_value())).mesh
    for v in state.values()
  }
  assert len(meshes) == 5
  path = fdt_tf.save_checkpoint(state, tmp_path / 'mixed')
  assert not [n for n in _listing(path) if n.startswith('.')]
  reader = tf.train.load_checkpoint(path)
  for name, var in state.items():
    want = np.asarray(var.get_value())
    got = reader.get_tensor(fdt_tf.checkpoint_key(name))
    assert np.array_equal(got.astype(want.dtype), want), name
  # Restore swapping the layouts around, bit-exact.
  target = _mixed_state(transposed_mesh, auto_mesh, seed=1)
  restored = fdt_tf.restore_checkpoint(path, target)
  for name, var in restored.items():
    arr = var.get_value()
    assert arr.sharding == target[name].get_value().sharding, name
    assert _bits(arr) == _bits(state[name].get_value()), name


def test_checkpoint_object_graph_is_tf_checkpoints_own(auto_mesh, tmp_path):
  """tf.train.Checkpoint(...).read works on it, as on its own checkpoints."""
  model = _make_mlp(auto_mesh)
  path = fdt_tf.save_checkpoint(model, tmp_path / 'ours')
  tf_module = fdt_tf.to_tf_module(model)
  theirs = tf.train.Checkpoint(tf_module).write(str(tmp_path / 'theirs'))
  graph = '_CHECKPOINTABLE_OBJECT_GRAPH'
  assert tf.train.load_checkpoint(path).get_tensor(graph) == (
    tf.train.load_checkpoint(theirs).get_tensor(graph)
  )
  for var in tf_module.variables:
    var.assign(tf.zeros_like(var))
  status = tf.train.Checkpoint(tf_module).read(tf.train.latest_checkpoint(path))
  status.assert_consumed()
  flat = fdt_tf.flat_variables(tf_module)
  np.testing.assert_array_equal(
    _gathered(flat['layers/0/kernel']), model.layers[0].kernel.get_value()
  )


@pytest.mark.parametrize('mesh_name', ['explicit', 'transposed'])
def test_restore_into_abstract_module(request, tmp_path, mesh_name):
  mesh = request.getfixturevalue(f'{mesh_name}_mesh')
  model = _make_mlp(mesh, seed=0)
  path = fdt_tf.save_checkpoint(
    model, tmp_path / 'ckpt', include=(nnx.Param, nnx.BatchStat)
  )
  with jax.set_mesh(mesh):
    abstract = nnx.eval_shape(lambda: MLP(nnx.Rngs(7, dropout=8)))
    # The RNG state is not in the checkpoint: an abstract target must not
    # keep it abstract.
    with pytest.raises(
      fdt.ExportError, match=r'drop/rngs/count, drop/rngs/key.*`rng_seed=`'
    ):
      fdt_tf.restore_checkpoint(
        path, abstract, include=(nnx.Param, nnx.BatchStat)
      )
    restored = fdt_tf.restore_checkpoint(
      path, abstract, include=(nnx.Param, nnx.BatchStat), rng_seed=5
    )
  assert restored is abstract
  kernel = restored.layers[0].kernel.get_value()
  assert isinstance(kernel, jax.Array)
  assert kernel.sharding == NamedSharding(mesh, P('data', 'model'))
  want = nnx.state(model, (nnx.Param, nnx.BatchStat))
  got = nnx.state(restored, (nnx.Param, nnx.BatchStat))
  for (p, a), (q, b) in zip(
    nnx.to_flat_state(want), nnx.to_flat_state(got), strict=True
  ):
    assert p == q
    assert b.get_value().sharding.is_equivalent_to(a.get_value().sharding, 2)
    assert _bits(b.get_value()) == _bits(a.get_value()), p
  # The RNG state is seeded from `rng_seed`, deterministically, in JAX
  # arrays (its count too).
  key = restored.drop.rngs.key.get_value()
  assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
  count = restored.drop.rngs.count.get_value()
  assert isinstance(count, jax.Array), type(count)
  assert count.dtype == jnp.uint32
  assert int(count) == 0
  with jax.set_mesh(mesh):
    again = fdt_tf.restore_checkpoint(
      path,
      nnx.eval_shape(lambda: MLP(nnx.Rngs(0))),
      include=(nnx.Param, nnx.BatchStat),
      rng_seed=5,
    )
  np.testing.assert_array_equal(
    jax.random.key_data(again.drop.rngs.key.get_value()),
    jax.random.key_data(key),
  )


def test_restore_into_abstract_state_with_mesh_argument(
  auto_mesh, transposed_mesh, tmp_path
):
  model = _make_mlp(auto_mesh)
  path = fdt_tf.save_checkpoint(model, tmp_path / 'ckpt')
  with jax.set_mesh(transposed_mesh):
    abstract = nnx.state(nnx.eval_shape(lambda: MLP(nnx.Rngs(3))))
  restored = fdt_tf.restore_checkpoint(path, abstract, mesh=transposed_mesh)
  assert isinstance(restored, nnx.State)
  kernel = restored['layers'][0]['kernel'].get_value()
  assert kernel.sharding == NamedSharding(transposed_mesh, P('data', 'model'))
  assert _bits(kernel) == _bits(model.layers[0].kernel.get_value())
  assert set(nnx.to_flat_state(restored).paths) == {
    ('layers', 0, 'bias'),
    ('layers', 0, 'kernel'),
    ('layers', 1, 'bias'),
    ('layers', 1, 'kernel'),
    ('norm', 'bias'),
    ('norm', 'mean'),
    ('norm', 'scale'),
    ('norm', 'var'),
  }


def test_restore_unsharded_target_goes_to_one_device(auto_mesh, tmp_path):
  model = _make_mlp(auto_mesh)
  path = fdt_tf.save_checkpoint(model, tmp_path / 'ckpt')
  with nnx.use_eager_sharding(False):
    plain = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
  assert plain.layers[0].kernel.get_value().sharding is None
  fdt_tf.restore_checkpoint(path, plain, rng_seed=0)
  kernel = plain.layers[0].kernel.get_value()
  assert kernel.sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])
  np.testing.assert_array_equal(kernel, model.layers[0].kernel.get_value())


class Logical(nnx.Module):
  """Params annotated with logical axes (resolved by the rules)."""

  def __init__(self, rngs):
    init = nnx.initializers.normal()
    self.up = nnx.Param(
      init(rngs.params(), (16, 32)), out_sharding=('embed', 'mlp')
    )
    self.down = nnx.Param(
      init(rngs.params(), (32, 16)), out_sharding=('mlp', 'embed')
    )
    self.bias = nnx.Param(jnp.zeros(32), out_sharding=('mlp',))
    self.plain = nnx.Param(jnp.arange(8.0))  # No logical axes.


_LOGICAL_RULES = [('embed', 'data'), ('mlp', 'model')]


@pytest.mark.parametrize('mesh_name', ['explicit', 'auto'])
def test_restore_resolves_logical_axes_by_the_rules(
  request, tmp_path, mesh_name
):
  mesh = request.getfixturevalue(f'{mesh_name}_mesh')
  with jax.set_mesh(mesh), fdt.logical_axis_rules(_LOGICAL_RULES):
    saved = Logical(nnx.Rngs(0))
  assert saved.up.get_value().sharding.spec == P('data', 'model')
  path = fdt_tf.save_checkpoint(saved, tmp_path / 'ckpt')
  # A target built unsharded (on one device), with its annotations.
  with nnx.use_eager_sharding(False):
    target = Logical(nnx.Rngs(1))
  assert target.up.get_value().sharding.is_fully_replicated
  assert len(target.up.get_value().sharding.device_set) == 1
  with jax.set_mesh(mesh), fdt.logical_axis_rules(_LOGICAL_RULES):
    fdt_tf.restore_checkpoint(path, target)
    specs = nnx.get_partition_spec(nnx.state(target))
  for name in ('up', 'down', 'bias'):
    arr = getattr(target, name).get_value()
    want = specs[name].get_value()
    assert arr.sharding == NamedSharding(mesh, want), name
    assert _bits(arr) == _bits(getattr(saved, name).get_value()), name
  assert target.down.get_value().sharding.spec == P('model', 'data')
  # Without logical axes: the value's own sharding (one device), as before.
  plain = target.plain.get_value()
  assert plain.sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])
  np.testing.assert_array_equal(plain, np.arange(8.0))


def test_an_unannotated_model_exports_and_restores_by_its_path_rules(
  auto_mesh, tmp_path
):
  """A model without sharding metadata (tests/support/unannotated_model.py): the
  DVariables' layouts, and a restore into a target built without a mesh,
  follow the path rules as the plan reports them."""
  from support import unannotated_model as um

  rules = fdt.LogicalRules(um.LOGICAL_RULES, path_rules=um.PATH_RULES)
  with jax.set_mesh(auto_mesh), fdt.logical_axis_rules(rules):
    saved = um.make_small()
  plan = fdt.plan(um.make_small, mesh=auto_mesh, rules=rules)
  flat = fdt_tf.flat_variables(fdt_tf.to_tf_module(saved))
  head = flat[('head', 'kernel')]
  assert list(dtensor.fetch_layout(head.read_value()).sharding_specs) == [
    'data',
    'model',
  ]
  np.testing.assert_array_equal(
    _gathered(head), np.asarray(saved.head.kernel[...])
  )
  path = fdt_tf.save_checkpoint(saved, tmp_path / 'ckpt')
  with nnx.use_eager_sharding(False):
    target = um.make_small()  # Unsharded, on one device.
  fdt_tf.restore_checkpoint(path, target, rules=rules, mesh=auto_mesh)
  covered = 0
  for p, v in nnx.to_flat_state(nnx.state(target)):
    arr, entry = v.get_value(), plan[_text(p)]
    assert _bits(arr) == _bits(
      dict(nnx.to_flat_state(nnx.state(saved)))[p][...]
    )
    if entry.source.startswith('path rule'):
      covered += 1
      assert arr.sharding == NamedSharding(auto_mesh, entry.spec), p
  assert covered == 8
  assert target.layers[0].mlp.up.kernel[...].sharding.spec == P('data', 'model')


def test_restore_rules_and_mesh_arguments(auto_mesh, tmp_path):
  with jax.set_mesh(auto_mesh), fdt.logical_axis_rules(_LOGICAL_RULES):
    saved = Logical(nnx.Rngs(0))
  path = fdt_tf.save_checkpoint(saved, tmp_path / 'ckpt')
  with nnx.use_eager_sharding(False):
    target = Logical(nnx.Rngs(1))
  # No context at all: the arguments alone; other rules than at save time.
  swapped = [('embed', 'model'), ('mlp', 'data')]
  fdt_tf.restore_checkpoint(path, target, rules=swapped, mesh=auto_mesh)
  up = target.up.get_value()
  assert up.sharding == NamedSharding(auto_mesh, P('model', 'data'))
  assert _bits(up) == _bits(saved.up.get_value())
  # Flax's own rules context counts too; an abstract target as well.
  with nnx.use_eager_sharding(False):
    abstract = nnx.eval_shape(lambda: Logical(nnx.Rngs(2)))
  assert abstract.up.get_value().sharding is None
  with jax.set_mesh(auto_mesh):
    with nnx.logical_axis_rules([('embed', None), ('mlp', 'data')]):
      fdt_tf.restore_checkpoint(path, abstract)
  assert abstract.up.get_value().sharding.spec == P(None, 'data')
  assert _bits(abstract.down.get_value()) == _bits(saved.down.get_value())
  # A logical axis the rules do not know: refused before anything is read.
  with nnx.use_eager_sharding(False):
    other = Logical(nnx.Rngs(3))
  with pytest.raises(fdt.UnknownLogicalAxisError, match=r'embed'):
    fdt_tf.restore_checkpoint(
      path, other, rules=[('mlp', 'model')], mesh=auto_mesh
    )
  assert len(other.up.get_value().sharding.device_set) == 1


def test_optimizer_state_round_trip(auto_mesh, tmp_path):
  model = _make_mlp(auto_mesh)
  with jax.set_mesh(auto_mesh):
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    x = jnp.ones((4, 16))

    def loss(m):
      return jnp.mean(m(x) ** 2)

    @nnx.jit  # One compile, where the step op by op made 120.
    def step(model, optimizer):
      optimizer.update(model, nnx.grad(loss)(model))

    step(model, optimizer)
  assert int(optimizer.step.get_value()) == 1
  path = fdt_tf.save_checkpoint(
    optimizer, tmp_path / 'opt', include=nnx.OptState
  )
  keys = set(map(_text, fdt_tf.read_checkpoint(path)))
  assert {'step', 'opt_state/0/count', 'opt_state/0/mu/layers/0/kernel'} <= keys
  assert 'opt_state/0/nu/norm/scale' in keys
  reader = tf.train.load_checkpoint(path)
  assert reader.get_tensor(fdt_tf.checkpoint_key('step')) == 1
  with jax.set_mesh(auto_mesh):
    abstract = nnx.eval_shape(
      lambda: nnx.Optimizer(MLP(nnx.Rngs(5)), optax.adamw(1e-3), wrt=nnx.Param)
    )
    restored = fdt_tf.restore_checkpoint(path, abstract, include=nnx.OptState)
  assert restored.step.get_value().dtype == jnp.uint32
  assert int(restored.step.get_value()) == 1
  want = nnx.to_flat_state(nnx.state(optimizer, nnx.OptState))
  got = nnx.to_flat_state(nnx.state(restored, nnx.OptState))
  assert len(want) == len(got) == len(keys)
  for (p, a), (q, b) in zip(want, got, strict=True):
    assert p == q
    assert _bits(b.get_value()) == _bits(a.get_value()), p
  mu = restored.opt_state[0].mu['layers'][0]['kernel'].get_value()
  assert mu.sharding.spec == P('data', 'model')


@pytest.mark.parametrize('target_kind', ['abstract', 'concrete'])
def test_kept_rng_state_restores_bit_exact(auto_mesh, tmp_path, target_kind):
  """A checkpoint that kept the RNG state (`exclude=nnx.Nothing`) restores
  it, with everything else, into a target from `nnx.eval_shape` as into a
  concrete model: JAX arrays, the same bits, the same next numbers."""
  model = _make_mlp(auto_mesh, seed=0)
  model.drop.rngs()  # Advance the count.
  path = fdt_tf.save_checkpoint(model, tmp_path / 'all', exclude=nnx.Nothing)
  with jax.set_mesh(auto_mesh):
    if target_kind == 'abstract':
      target = nnx.eval_shape(lambda: MLP(nnx.Rngs(3, dropout=4)))
      assert isinstance(target.drop.rngs.key.get_value(), jax.ShapeDtypeStruct)
    else:
      target = MLP(nnx.Rngs(3, dropout=4))
    restored = fdt_tf.restore_checkpoint(path, target, exclude=nnx.Nothing)
  want = nnx.to_flat_state(nnx.state(model))
  got = nnx.to_flat_state(nnx.state(restored))
  assert [p for p, _ in got] == [p for p, _ in want]
  assert ('drop', 'rngs', 'key') in dict(got)
  for (p, a), (_, b) in zip(want, got, strict=True):
    a, b = a.get_value(), b.get_value()
    assert isinstance(b, jax.Array), (p, type(b))
    assert b.dtype == a.dtype, p
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
      assert jax.random.key_impl(b) == jax.random.key_impl(a)
      a, b = jax.random.key_data(a), jax.random.key_data(b)
    assert _bits(b) == _bits(a), p
  assert int(restored.drop.rngs.count.get_value()) == 1
  np.testing.assert_array_equal(
    jax.random.key_data(restored.drop.rngs()),
    jax.random.key_data(model.drop.rngs()),
  )


def test_rng_keys_round_trip_on_request(auto_mesh, tmp_path):
  model = _make_mlp(auto_mesh, seed=0)
  model.drop.rngs()  # Advance the count.
  path = fdt_tf.save_checkpoint(
    model, tmp_path / 'rng', include=nnx.RngState, exclude=nnx.Nothing
  )
  read = fdt_tf.read_checkpoint(path)
  assert set(map(_text, read)) == {'drop/rngs/count', 'drop/rngs/key'}
  assert read['drop/rngs/count'].dtype == np.uint32
  meta = _records(path)['drop/rngs/key']
  assert meta['key_impl'] == 'threefry2x32'
  assert meta['stored_dtype'] == 'int64'
  other = _make_mlp(auto_mesh, seed=10)
  fdt_tf.restore_checkpoint(
    path, other, include=nnx.RngState, exclude=nnx.Nothing
  )
  for a, b in [
    (other.drop.rngs.key.get_value(), model.drop.rngs.key.get_value())
  ]:
    assert jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(
      jax.random.key_data(a), jax.random.key_data(b)
    )
  assert int(other.drop.rngs.count.get_value()) == 1
  # And the next random numbers agree.
  np.testing.assert_array_equal(
    jax.random.uniform(other.drop.rngs()), jax.random.uniform(model.drop.rngs())
  )


def test_default_selection_skips_rngs_without_error(auto_mesh, tmp_path):
  model = _make_mlp(auto_mesh)
  path = fdt_tf.save_checkpoint(model, tmp_path / 'c', include=...)
  assert not [k for k in fdt_tf.read_checkpoint(path) if 'rngs' in k]
  fresh = _make_mlp(auto_mesh, seed=4)
  key_before = jax.random.key_data(fresh.drop.rngs.key.get_value())
  fdt_tf.restore_checkpoint(path, fresh, include=...)
  np.testing.assert_array_equal(
    fresh.norm.mean.get_value(), model.norm.mean.get_value()
  )
  np.testing.assert_array_equal(
    jax.random.key_data(fresh.drop.rngs.key.get_value()), key_before
  )


def test_path_components_with_dots_are_readable(auto_mesh, tmp_path):
  arr = jax.device_put(np.arange(8.0), NamedSharding(auto_mesh, P('model')))
  state = nnx.State({'v1.2': {'w': nnx.Param(arr)}})
  path = fdt_tf.save_checkpoint(state, tmp_path / 'c')
  keys = tf.train.load_checkpoint(path).get_variable_to_shape_map()
  assert fdt_tf.checkpoint_key('v1.2/w') in keys
  assert fdt_tf.checkpoint_key('v1.2/w') == (
    'state/v1..2/w/.ATTRIBUTES/VARIABLE_VALUE'
  )
  np.testing.assert_array_equal(fdt_tf.read_checkpoint(path)['v1.2/w'], arr)


def test_restore_errors(auto_mesh, tmp_path):
  model = _make_mlp(auto_mesh)
  path = fdt_tf.save_checkpoint(model, tmp_path / 'ckpt')
  params_only = fdt_tf.save_checkpoint(
    model, tmp_path / 'params', include=nnx.Param
  )
  with pytest.raises(
    fdt.ExportError,
    match=r'lacks 2 variables the target needs: norm/mean \(key '
    r"'state/norm/mean/.*holds 6 variables.*`include=nnx.Param`",
  ):
    fdt_tf.restore_checkpoint(params_only, _make_mlp(auto_mesh))
  wider = _make_mlp(auto_mesh, hidden=64)
  with pytest.raises(
    fdt.ExportError,
    match=r"Shape mismatch for 7 variables: 'layers/0/bias'.*\(64,\).*"
    r"\(32,\); 'layers/0/kernel'.*'norm/var': the target expects \(64,\), "
    r'it holds \(32,\)\. Build the target with the shapes that were saved.*'
    r'leave these variables out with `include=`/`exclude=`',
  ):
    fdt_tf.restore_checkpoint(path, wider)
  half = _make_mlp(auto_mesh, dtype=jnp.bfloat16)
  with pytest.raises(
    fdt.ExportError,
    match=r"Dtype mismatch for 4 variables: 'layers/0/bias'.*expects "
    r"bfloat16.*has float32.*'layers/1/kernel': the target expects "
    r'bfloat16, it has float32.*build the target with dtype float32',
  ):
    fdt_tf.restore_checkpoint(path, half)
  with pytest.raises(fdt_tf.ExportNotFoundError, match=r'got .*, which holds'):
    fdt_tf.restore_checkpoint(tmp_path, model)
  with pytest.raises(fdt_tf.ExportNotFoundError, match=r"got '.*missing'"):
    fdt_tf.read_checkpoint(tmp_path / 'missing')
  with jax.set_mesh(auto_mesh):
    abstract = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
  with pytest.raises(fdt.ExportError, match=r"'layers/0/bias'.*abstract mesh"):
    fdt_tf.restore_checkpoint(path, abstract)
  other = jax.make_mesh((4, 2), ('data', 'model'))
  with pytest.raises(fdt.ExportError, match=r'expected the same axis names'):
    fdt_tf.restore_checkpoint(path, abstract, mesh=other)
  # The failed restores left the module untouched.
  assert isinstance(abstract.layers[0].kernel.get_value(), jax.ShapeDtypeStruct)


# A hidden size of 48, not 32: every variable of that width differs, and
# the target expects (first) what the checkpoint holds (second).
WIDER_BY_16 = [
  ('layers/0/bias', (48,), (32,)),
  ('layers/0/kernel', (16, 48), (16, 32)),
  ('layers/1/kernel', (48, 8), (32, 8)),
  ('norm/bias', (48,), (32,)),
  ('norm/mean', (48,), (32,)),
  ('norm/scale', (48,), (32,)),
  ('norm/var', (48,), (32,)),
]


def _assert_names_every_shape(message, mismatches, source):
  assert message.startswith(
    f'Shape mismatch for {len(mismatches)} variables: '
  ), message
  (name, want, held), *rest = mismatches
  assert (
    f'{name!r}: the target expects {want}, {source} holds {held}; ' in message
  ), message
  for name, want, held in rest:
    assert f'{name!r}: the target expects {want}, it holds {held}' in (
      message
    ), message
  assert message.count('the target expects') == len(mismatches)
  assert 'Build the target with the shapes that were saved' in message


@pytest.mark.parametrize('target', ['module', 'abstract', 'manager'])
def test_a_restore_names_every_mismatch_at_once(auto_mesh, tmp_path, target):
  model = _make_mlp(auto_mesh)
  path = fdt_tf.save_checkpoint(model, tmp_path / 'ckpt')
  wider = _make_mlp(auto_mesh, hidden=48)
  if target == 'abstract':
    with jax.set_mesh(auto_mesh):
      wider = nnx.eval_shape(lambda: MLP(nnx.Rngs(0), hidden=48))
  before = jax.tree.map(np.asarray, nnx.state(wider, nnx.Param))
  if target == 'manager':
    manager = fdt_tf.CheckpointManager(tmp_path / 'run', blocking=True)
    manager.save(1, model)
    restore = lambda t: manager.restore(t)  # noqa: E731
    ckpt = tmp_path / 'run' / '1' / 'ckpt'
  else:
    restore = lambda t: fdt_tf.restore_checkpoint(path, t)  # noqa: E731
    ckpt = tmp_path / 'ckpt' / 'ckpt'
  with pytest.raises(fdt.ExportError) as info:
    restore(wider)
  _assert_names_every_shape(
    str(info.value), WIDER_BY_16, f"the checkpoint '{ckpt}'"
  )
  # The target is unchanged.
  jax.tree.map(
    np.testing.assert_array_equal,
    before,
    jax.tree.map(np.asarray, nnx.state(wider, nnx.Param)),
  )
  if target == 'manager':
    assert manager.restored_step is None  # Nothing was restored.
    manager.close()


def test_shape_and_dtype_mismatches_are_named_together(auto_mesh, tmp_path):
  path = fdt_tf.save_checkpoint(_make_mlp(auto_mesh), tmp_path / 'ckpt')
  target = _make_mlp(auto_mesh, hidden=48, dtype=jnp.bfloat16)
  with pytest.raises(fdt.ExportError) as info:
    fdt_tf.restore_checkpoint(path, target)
  message = str(info.value)
  _assert_names_every_shape(
    message.split(' Dtype mismatch')[0],
    WIDER_BY_16,
    f"the checkpoint '{tmp_path / 'ckpt' / 'ckpt'}'",
  )
  dtypes = message.split(' Dtype mismatch', 1)[1]
  assert dtypes.startswith(' for 4 variables: '), message
  for name in ('layers/0/bias', 'layers/0/kernel', 'layers/1/bias'):
    assert f'{name!r}: the target expects bfloat16, ' in dtypes, message
  assert "'layers/1/kernel': the target expects bfloat16, it has float32 " in (
    dtypes
  )
  assert 'convert_dtypes=True' in dtypes
  assert dtypes.count('the target expects') == 4
  # Asked to convert, the shapes alone are named.
  with pytest.raises(fdt.ExportError) as info:
    fdt_tf.restore_checkpoint(path, target, convert_dtypes=True)
  assert 'Dtype mismatch' not in str(info.value)
  assert str(info.value).count('the target expects') == len(WIDER_BY_16)


def test_a_restore_of_a_huge_mismatch_names_the_first_eight(tmp_path):
  saved = nnx.Dict({f'p{i:02d}': nnx.Param(jnp.zeros((2,))) for i in range(20)})
  path = fdt_tf.save_checkpoint(saved, tmp_path / 'ckpt')
  target = nnx.Dict(
    {f'p{i:02d}': nnx.Param(jnp.zeros((3,))) for i in range(20)}
  )
  with pytest.raises(
    fdt.ExportError,
    match=r"^Shape mismatch for 20 variables: 'p00': the target expects "
    r"\(3,\), the checkpoint '.*' holds \(2,\); 'p01': the target expects "
    r"\(3,\), it holds \(2,\);.*'p07': the target expects \(3,\), it holds "
    r'\(2,\); and 12 more\. Build the target',
  ) as info:
    fdt_tf.restore_checkpoint(path, target)
  assert str(info.value).count('the target expects') == 8
  assert "'p08'" not in str(info.value)


def test_a_missing_variable_and_other_shapes_are_named_together(
  auto_mesh, tmp_path
):
  path = fdt_tf.save_checkpoint(_make_mlp(auto_mesh), tmp_path / 'ckpt')
  wider = _make_mlp(auto_mesh, hidden=48)
  wider.extra = nnx.Param(jnp.zeros((3,)))
  with pytest.raises(fdt.ExportError) as info:
    fdt_tf.restore_checkpoint(path, wider)
  message = str(info.value)
  lacking, shapes = message.split(' Shape mismatch', 1)
  assert lacking.startswith(
    f"The checkpoint '{tmp_path / 'ckpt' / 'ckpt'}' has no variable 'extra' "
    "(key 'state/extra/.ATTRIBUTES/VARIABLE_VALUE'), which the target needs."
  ), message
  _assert_names_every_shape(
    'Shape mismatch' + shapes,
    WIDER_BY_16,
    f"the checkpoint '{tmp_path / 'ckpt' / 'ckpt'}'",
  )
  np.testing.assert_array_equal(wider.extra.get_value(), np.zeros(3))


def test_extra_missing_shape_and_dtype_misfits_are_named_together(tmp_path):
  """A variable the target lacks does not hide the others' misfits."""
  saved = nnx.Dict(
    a=nnx.Param(jnp.zeros((4, 4))),
    b=nnx.Param(jnp.zeros((4,))),
    c=nnx.Param(jnp.zeros((2,))),
    d=nnx.Param(jnp.zeros((3,))),
  )
  path = fdt_tf.save_checkpoint(saved, tmp_path / 'ckpt')
  target = nnx.Dict(
    a=nnx.Param(jnp.ones((8, 4))),
    b=nnx.Param(jnp.ones((4,), jnp.bfloat16)),
    c=nnx.Param(jnp.ones((2,))),
    e=nnx.Param(jnp.ones((5,))),
  )
  with pytest.raises(
    fdt.ExportError,
    match=r'holds 1 variable\(s\) the target does not have: d; and it lacks '
    r"1 of the target's variables: e\..*Shape mismatch for 'a': the target "
    r"expects \(8, 4\), the checkpoint '.*' holds \(4, 4\)\..*Dtype "
    r"mismatch for 'b': the target expects bfloat16, the checkpoint '.*' has "
    r'float32',
  ):
    fdt_tf.restore_checkpoint(path, target)
  for name, shape in [('a', (8, 4)), ('b', (4,)), ('c', (2,)), ('e', (5,))]:
    np.testing.assert_array_equal(
      np.asarray(target[name].get_value(), np.float32), np.ones(shape)
    )


def _narrow_target(dtype):
  return nnx.Dict(w=nnx.Param(jnp.zeros((2, 4), dtype)))


@pytest.mark.parametrize('target_dtype', ['float16', 'uint32', 'bfloat16'])
def test_restore_never_narrows_a_saved_dtype(tmp_path, target_dtype):
  """A float32 checkpoint does not restore into a narrower target."""
  saved = nnx.Dict(w=nnx.Param(jnp.asarray([[1e-8, 70000.0, 1.5, -2.0]] * 2)))
  path = fdt_tf.save_checkpoint(saved, tmp_path / 'f32')
  target = _narrow_target(target_dtype)
  with pytest.raises(
    fdt.ExportError,
    match=rf"Dtype mismatch for 'w': the target expects {target_dtype}, the "
    r"checkpoint '.*f32/ckpt' has float32 \(saved as float32, stored as "
    r'float32\)\. A restore does not convert unless asked.*build the '
    r'target with dtype float32.*`convert_dtypes=True`.*`include=`/`exclude=`',
  ):
    fdt_tf.restore_checkpoint(path, target)
  np.testing.assert_array_equal(target['w'].get_value(), 0)
  # Asked for, the conversion is JAX's `astype`.
  fdt_tf.restore_checkpoint(path, target, convert_dtypes=True)
  np.testing.assert_array_equal(
    np.asarray(target['w'].get_value()),
    np.asarray(saved['w'].get_value().astype(target['w'].get_value().dtype)),
  )


def test_restore_compares_the_saved_dtype_not_the_stored_one(tmp_path):
  # A float16 checkpoint is stored as float32, and restores into float16
  # (not into float32, which its stored dtype would allow).
  saved = nnx.Dict(w=nnx.Param(jnp.full((2, 4), 0.1, jnp.float16)))
  path = fdt_tf.save_checkpoint(saved, tmp_path / 'f16')
  assert (
    tf.train.load_checkpoint(path).get_tensor(fdt_tf.checkpoint_key('w')).dtype
    == np.float32
  )
  with pytest.raises(
    fdt.ExportError,
    match=r'expects float32.*has float16 \(saved as float16, stored as float32',
  ):
    fdt_tf.restore_checkpoint(path, _narrow_target('float32'))
  target = fdt_tf.restore_checkpoint(path, _narrow_target('float16'))
  assert _bits(target['w'].get_value()) == _bits(saved['w'].get_value())


@pytest.mark.parametrize(
  ('saved', 'target_dtype'),
  [(np.float32, 'float16'), (np.int64, 'uint32'), (np.float16, 'float32')],
)
def test_restore_plain_tf_checkpoint_needs_the_same_dtype(
  tmp_path, saved, target_dtype
):
  """Without flax_dtensor.json, the dtype TF holds must be the target's."""
  root = tf.Module()
  root.state = {'w': tf.Variable(np.asarray([[1, 2, 3, 700]] * 2, saved))}
  prefix = tf.train.Checkpoint(root).write(str(tmp_path / 'plain'))
  name = np.dtype(saved).name
  with pytest.raises(
    fdt.ExportError,
    match=rf'expects {target_dtype}.*has {name} \(holds {name}, and it has '
    r'no manifest saying otherwise\).*`convert_dtypes=True`',
  ):
    fdt_tf.restore_checkpoint(prefix, _narrow_target(target_dtype))
  target = fdt_tf.restore_checkpoint(
    prefix, _narrow_target(target_dtype), convert_dtypes=True
  )
  np.testing.assert_array_equal(
    np.asarray(target['w'].get_value()),
    np.asarray(
      jnp.asarray(np.asarray([[1, 2, 3, 700]] * 2, saved)).astype(target_dtype)
    ),
  )


def _edit_record(meta, **changes):
  (record,) = meta['variables']
  record.update(changes)


def test_restore_checks_the_metadata(tmp_path):
  saved = nnx.Dict(w=nnx.Param(jnp.ones((2, 4), jnp.float16)))
  path = fdt_tf.save_checkpoint(saved, tmp_path / 'c')
  meta_path = os.path.join(path, 'flax_dtensor.json')
  with open(meta_path) as f:
    original = f.read()
  # A dtype edited to another one stored alike: the index agrees, the
  # shard CRCs (over the saved bytes) do not.
  manifests.edit(path, lambda m: _edit_record(m, dtype='bfloat16'))
  with pytest.raises(
    fdt_tf.MalformedExportError,
    match=r'is recorded as bfloat16 stored as float32, but bfloat16 is '
    r'stored as bfloat16.*Nothing was read into TensorFlow',
  ):
    fdt_tf.read_checkpoint(path)

  manifests.edit(path, lambda m: _edit_record(m, dtype='float99'))
  for read in (
    lambda: fdt_tf.restore_checkpoint(path, _narrow_target('float16')),
    lambda: fdt_tf.read_checkpoint(path),
  ):
    with pytest.raises(
      fdt.ExportError, match=r"records the dtype 'float99'.*Upgrade jax"
    ):
      read()
  for text in ('{not json', '{"format": "flax_dtensor.checkpoint"}', '[]'):
    with open(meta_path, 'w') as f:
      f.write(text)
    for read in (
      lambda: fdt_tf.restore_checkpoint(path, _narrow_target('float16')),
      lambda: fdt_tf.read_checkpoint(path),
    ):
      with pytest.raises(
        fdt_tf.MalformedExportError,
        match=r"flax_dtensor.json' is not a valid flax_dtensor manifest.*"
        r'inspect --verify PATH.*move the file away only for a checkpoint '
        r'you trust',
      ):
        read()
  with open(meta_path, 'w') as f:
    f.write(original)
  assert fdt_tf.read_checkpoint(path)['w'].dtype == np.float16
  # Without it, the checkpoint holds float32: restored as float32 only.
  os.remove(meta_path)
  assert fdt_tf.read_checkpoint(path)['w'].dtype == np.float32
  target = fdt_tf.restore_checkpoint(path, _narrow_target('float32'))
  np.testing.assert_array_equal(target['w'].get_value(), 1)


# Each runs in a fresh process: a truncated checkpoint, or a file where TF's
# writer needs a directory. Both are plain TF ops on the host, which leave
# TF working: the script saves and restores again.
_TF_FAILURE_SCRIPT = textwrap.dedent(
  """
  import os, sys
  import jax, jax.numpy as jnp
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P
  import flax_dtensor as fdt
  from flax_dtensor import dtensor as fdt_tf
  from flax_dtensor.dtensor._checkpoints import _checkpoint

  fdt_tf.initialize()
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  state = nnx.Dict(
    w=nnx.Param(jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P()))),
    v=nnx.Param(jax.device_put(jnp.ones(8), NamedSharding(mesh, P()))),
  )
  root = sys.argv[2]
  if sys.argv[1] == 'read':
    path = fdt_tf.save_checkpoint(state, os.path.join(root, 'ckpt'))
    # Without its manifest (as if plain TF had written it), TF itself meets
    # the damage.
    os.remove(os.path.join(path, 'flax_dtensor.json'))
    for name in os.listdir(path):
      if name.startswith('ckpt.data'):
        with open(os.path.join(path, name), 'r+b') as f:
          f.truncate(16)
    run = lambda: fdt_tf.restore_checkpoint(path, state)
  else:
    open(os.path.join(root, 'a_file'), 'w').close()
    prefix = _checkpoint.PREFIX
    _checkpoint.PREFIX = os.path.join(root, 'a_file', 'ckpt')
    run = lambda: fdt_tf.save_checkpoint(state, os.path.join(root, 'new'))
  try:
    run()
  except fdt.ExportError as e:
    print('ERROR ' + ' '.join(str(e).split()))
  print('FILES ' + ' '.join(sorted(os.listdir(root))))
  if sys.argv[1] == 'write':
    _checkpoint.PREFIX = prefix
  again = fdt_tf.save_checkpoint(state, os.path.join(root, 'again'))
  back = fdt_tf.restore_checkpoint(again, state)
  print('AFTER ' + str(float(back['w'][...].sum())))
  """
)


@pytest.mark.parametrize(
  ('what', 'pattern', 'files'),
  [
    (
      'read',
      r"TensorFlow failed to read the NNX variables? '(v|w)'(, '(v|w)')? "
      r"from the checkpoint '.*/ckpt/ckpt': (OutOfRange|DataLoss)Error: "
      r'.*Check that '
      r'every data file of the checkpoint is complete and readable \(or that '
      r'no other process rewrote it during the read\), or re-export it\. '
      r'Nothing was restored: the target is unchanged\.$',
      'ckpt',
    ),
    (
      'write',
      r"Writing the checkpoint '.*/new' failed in TensorFlow: "
      r'(FailedPrecondition|NotFound)Error: .*a_file.*Check the disk space, '
      r'the permissions and the path',
      'a_file',
    ),
  ],
  ids=['read', 'write'],
)
def test_tf_errors_name_the_variables(
  warm_pool, tmp_path, what, pattern, files
):
  script = tmp_path / 'script.py'
  script.write_text(_TF_FAILURE_SCRIPT)
  root = tmp_path / 'root'
  root.mkdir()
  out = warm_pool.run(script, what, root)
  assert out.returncode == 0, out.stderr[-4000:]
  lines = dict(line.split(' ', 1) for line in out.stdout.strip().splitlines())
  with pytest.raises(fdt.ExportError, match=pattern):
    raise fdt.ExportError(lines['ERROR'])
  # Nothing half-written is left behind.
  assert lines['FILES'] == files
  # TF still works in that process.
  assert lines['AFTER'] == '128.0'


def test_batch_norm_statistics_round_trip_by_default(auto_mesh, tmp_path):
  model = _make_mlp(auto_mesh, seed=0)
  with jax.set_mesh(auto_mesh):
    model(jax.random.normal(jax.random.key(1), (8, 16)) * 3 + 1)
  mean = model.norm.mean.get_value()
  assert not np.allclose(mean, 0)
  path = fdt_tf.save_checkpoint(model, tmp_path / 'ckpt')
  assert {('norm', 'mean'), ('norm', 'var')} <= set(
    fdt_tf.read_checkpoint(path)
  )
  fresh = _make_mlp(auto_mesh, seed=3)
  np.testing.assert_array_equal(fresh.norm.mean.get_value(), 0)
  fdt_tf.restore_checkpoint(path, fresh)
  for name in ('mean', 'var', 'scale', 'bias'):
    a = getattr(model.norm, name).get_value()
    b = getattr(fresh.norm, name).get_value()
    assert _bits(b) == _bits(a), name
  assert _bits(fresh.layers[0].kernel.get_value()) == _bits(
    model.layers[0].kernel.get_value()
  )
  # And the restored model computes what the saved one does.
  x = jax.random.normal(jax.random.key(2), (4, 16))
  with jax.set_mesh(auto_mesh):
    eval_model = nnx.view(model, deterministic=True, use_running_average=True)
    eval_fresh = nnx.view(fresh, deterministic=True, use_running_average=True)
    np.testing.assert_array_equal(eval_fresh(x), eval_model(x))


def test_restore_from_a_plain_tf_checkpoint(tmp_path):
  """A checkpoint written by TF alone, with the same keys, restores too."""
  kernel = np.arange(6, dtype=np.float16).reshape(2, 3)
  root = tf.Module()
  root.state = {'w': tf.Variable(kernel)}
  prefix = tf.train.Checkpoint(root).write(str(tmp_path / 'plain'))
  target = nnx.Dict(w=nnx.Param(jnp.zeros((2, 3), jnp.float16)))
  fdt_tf.restore_checkpoint(prefix, target)
  assert _bits(target['w'].get_value()) == _bits(kernel)


# ---------------------------------------------------------------------------
# Atomic writes
# ---------------------------------------------------------------------------


def test_existing_target_is_refused_unless_overwrite(auto_mesh, tmp_path):
  first = _make_mlp(auto_mesh, seed=0)
  second = _make_mlp(auto_mesh, seed=1)
  target = tmp_path / 'ckpt'
  fdt_tf.save_checkpoint(first, target)
  with pytest.raises(fdt.ExportError, match=r'already exists.*overwrite=True'):
    fdt_tf.save_checkpoint(second, target)
  kernel = fdt_tf.read_checkpoint(target)['layers/0/kernel']
  np.testing.assert_array_equal(kernel, first.layers[0].kernel.get_value())
  fdt_tf.save_checkpoint(second, target, overwrite=True)
  kernel = fdt_tf.read_checkpoint(target)['layers/0/kernel']
  np.testing.assert_array_equal(kernel, second.layers[0].kernel.get_value())
  assert _listing(tmp_path) == ['ckpt']
  (tmp_path / 'file').write_text('x')
  with pytest.raises(fdt.ExportError, match=r"'.*file' already exists"):
    fdt_tf.save_checkpoint(first, tmp_path / 'file')
  # A missing parent is created (tests/bridge/storage/parents_test.py); a
  # file in its way is refused.
  with pytest.raises(fdt.ExportError, match=r"'.*file' is a file"):
    fdt_tf.save_checkpoint(first, tmp_path / 'file' / 'no' / 'ckpt')


@pytest.mark.parametrize('overwrite', [False, True])
def test_interrupted_save_leaves_nothing(
  auto_mesh, tmp_path, monkeypatch, overwrite
):
  model = _make_mlp(auto_mesh)
  target = tmp_path / 'ckpt'
  if overwrite:
    fdt_tf.save_checkpoint(model, target, include=nnx.BatchStat)
  seen = []

  def fail(directory, *args, **kwargs):
    seen.append(_listing(directory))
    raise RuntimeError('disk on fire')

  monkeypatch.setattr(_checkpoint, 'write_manifest', fail)
  with pytest.raises(RuntimeError, match='disk on fire'):
    fdt_tf.save_checkpoint(model, target, overwrite=overwrite)
  # The checkpoint data had been written into the temporary directory.
  assert 'ckpt.index' in seen[0]
  if overwrite:
    assert _listing(tmp_path) == ['ckpt']
    assert set(fdt_tf.read_checkpoint(target)) == {
      ('norm', 'mean'),
      ('norm', 'var'),
    }
  else:
    assert _listing(tmp_path) == []


def test_interrupted_rename_keeps_the_old_export(tmp_path, monkeypatch):
  target = tmp_path / 'out'
  target.mkdir()
  (target / 'old.txt').write_text('old')
  # Only an export of this package may be overwritten: it has a manifest.
  (target / 'flax_dtensor.json').write_text(
    json.dumps(
      {
        'format': 'flax_dtensor.checkpoint',
        'version': 3,
        'checkpoint_prefix': 'ckpt',
        'files': {},
        'variables': [],
      }
    )
  )
  real_rename = os.rename
  calls = []

  def flaky_rename(src, dst):
    calls.append((os.path.basename(src), os.path.basename(dst)))
    if len(calls) == 2:
      raise OSError('rename failed')
    return real_rename(src, dst)

  monkeypatch.setattr(_atomic.os, 'rename', flaky_rename)
  with pytest.raises(OSError, match='rename failed'):
    with _atomic.atomic_directory(
      target, overwrite=True, is_export=_decode.is_export
    ) as tmp:
      with open(os.path.join(tmp, 'new.txt'), 'w') as f:
        f.write('new')
  # Both names say who writes them: token, pid, start time, host.
  label = re.escape(_temporaries._host_label(socket.gethostname()))
  writer = rf'[0-9a-f]{{8}}-{os.getpid()}-\d+-{label}'
  assert re.fullmatch(rf'\.out\.old-{writer}', calls[0][1])
  assert re.fullmatch(rf'\.out\.tmp-{writer}', calls[1][0])
  assert _listing(tmp_path) == ['out']
  assert (target / 'old.txt').read_text() == 'old'
  assert sorted(os.listdir(target)) == ['flax_dtensor.json', 'old.txt']


# ---------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------


def test_progress_bar_only_when_asked_or_on_a_terminal(
  auto_mesh, tmp_path, capsys, monkeypatch
):
  model = _make_mlp(auto_mesh)
  fdt_tf.save_checkpoint(model, tmp_path / 'quiet')
  assert capsys.readouterr().err == ''
  fdt_tf.save_checkpoint(model, tmp_path / 'shown', progress=True)
  err = capsys.readouterr().err
  # One TF op writes every shard: the save says what and how long.
  assert re.search(
    r'writing 8 variables \(.* MiB\).*wrote .*shown in [0-9.]+s', err, re.S
  ), err
  monkeypatch.setattr(_convert, 'PROGRESS_MIN_VARIABLES', 2)
  monkeypatch.setattr(sys.stderr, 'isatty', lambda: True)
  fdt_tf.save_checkpoint(model, tmp_path / 'tty')
  assert 'writing 8 variables' in capsys.readouterr().err
  fdt_tf.save_checkpoint(model, tmp_path / 'off', progress=False)
  assert capsys.readouterr().err == ''
  fdt_tf.restore_checkpoint(tmp_path / 'off', model, progress=True)
  # On a terminal the bar is live (ANSI codes), and removed when done.
  err = re.sub(r'\x1b\[[0-9;?]*[A-Za-z]', '', capsys.readouterr().err)
  assert 'reading 8 variables' in err
  assert re.search(r'flax_dtensor: restoring .*8/8 var', err), err
  fdt_tf.restore_checkpoint(tmp_path / 'off', model, progress=False)
  assert capsys.readouterr().err == ''


_NO_DTENSOR_SCRIPT = textwrap.dedent(
  """
  import sys
  import jax, jax.numpy as jnp, numpy as np
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P
  from flax_dtensor import dtensor as fdt_tf

  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  target = nnx.Dict(
    w=nnx.Param(jax.device_put(jnp.zeros((8, 16)), NamedSharding(mesh, P('model', 'data'))))
  )
  w = fdt_tf.restore_checkpoint(sys.argv[1], target)['w'][...]
  print('SPEC', w.sharding.spec)
  print('EQUAL', np.array_equal(np.asarray(w), np.arange(128.0).reshape(8, 16)))
  tf = sys.modules['tensorflow']
  print('TF_CPUS', len(tf.config.list_logical_devices('CPU')))
  """
)


def test_restore_needs_no_dtensor(warm_pool, explicit_mesh, tmp_path):
  """A restore into JAX reads with plain TF: no `initialize()` needed."""
  state = nnx.Dict(
    w=nnx.Param(
      jax.device_put(
        jnp.arange(128.0).reshape(8, 16),
        NamedSharding(explicit_mesh, P('data', 'model')),
      )
    )
  )
  path = fdt_tf.save_checkpoint(state, tmp_path / 'ckpt')
  script = tmp_path / 'script.py'
  script.write_text(_NO_DTENSOR_SCRIPT)
  out = warm_pool.run(script, path)
  assert out.returncode == 0, out.stderr[-4000:]
  lines = dict(line.split(' ', 1) for line in out.stdout.strip().splitlines())
  assert lines == {
    'SPEC': "P('model', 'data')",  # The target's layout, not the saved one.
    'EQUAL': 'True',
    'TF_CPUS': '1',  # TF ran without DTensor's 8 logical devices.
  }


@pytest.mark.parametrize('entry', ['save_checkpoint', 'to_tf_module'])
def test_an_abstract_model_is_refused_naming_its_variable(tmp_path, entry):
  """A model of `nnx.eval_shape` has no values to write: our error, before
  anything is written."""
  abstract = nnx.eval_shape(lambda: nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
  call = {
    'save_checkpoint': lambda: fdt_tf.save_checkpoint(
      abstract, tmp_path / 'ckpt'
    ),
    'to_tf_module': lambda: fdt_tf.to_tf_module(abstract),
  }[entry]
  with pytest.raises(
    fdt.ExportError,
    match=r"Expected a concrete array in the NNX variable 'bias', got an "
    r'abstract ShapeDtypeStruct\(shape=\(3,\).*nnx\.eval_shape.*fill it '
    'first with restore_checkpoint',
  ):
    call()
  assert not (tmp_path / 'ckpt').exists()
