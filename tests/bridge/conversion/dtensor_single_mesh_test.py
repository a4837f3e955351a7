"""Tests of `single_mesh=True`: every variable on one DTensor mesh.

TF's own `tf.train.Checkpoint(...).write` / `read` and a `tf.function`
mixing variables of different original layouts must work on the result,
values must equal the JAX arrays, and the report must say what JAX moved,
where to, and why. `save_checkpoint(..., single_mesh=True)` keeps the
manifest and restores exactly.
"""

import json
import os

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

# 'vocab' over both mesh axes: a fused DTensor mesh by default.
RULES = [('vocab', ('data', 'model')), ('embed', 'data'), ('mlp', 'model')]


def _part(names):
  return nnx.with_partitioning(nnx.initializers.normal(1.0), names)


class Block(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(16, 32, kernel_init=_part(('embed', 'mlp')), rngs=rngs)
    self.down = nnx.Linear(
      32, 16, kernel_init=_part(('mlp', 'embed')), rngs=rngs
    )


class Stacked(nnx.Module):
  """Scan-stacked blocks, an embedding over both axes, a stray scalar."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(
      64, 16, embedding_init=_part(('vocab', None)), rngs=rngs
    )
    # The same layout, transposed: (16, 64) with the 64 over both axes.
    self.unembed = nnx.Param(
      jax.random.normal(rngs.params(), (16, 64)),
      out_sharding=(None, 'vocab'),
    )

    @nnx.split_rngs(splits=3)
    @nnx.vmap(
      in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None}
    )
    def blocks(rngs):
      return Block(rngs)

    self.blocks = blocks(rngs)
    with nnx.use_eager_sharding(False):
      self.step = nnx.BatchStat(jnp.asarray(5, jnp.int32))


def _stacked(mesh, seed=0):
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    model = Stacked(nnx.Rngs(seed))
  # The step counter lives on one device, outside the mesh.
  model.step.set_value(jax.device_put(jnp.asarray(5 + seed), jax.devices()[2]))
  return model


def _flat(module):
  return {
    '/'.join(map(str, p)): v.get_value()
    for p, v in nnx.to_flat_state(nnx.state(module))
  }


def _gathered(v):
  """The global value of a DVariable, gathered by DTensor itself."""
  return _replicated(v.read_value())


@pytest.mark.parametrize('mesh_name', ['explicit', 'auto'])
def test_to_tf_module_on_one_mesh(request, mesh_name, tmp_path):
  mesh = request.getfixturevalue(f'{mesh_name}_mesh')
  model = _stacked(mesh)
  values = _flat(model)
  assert values['embed/embedding'].sharding.spec == P(('data', 'model'), None)
  tf_module, report = fdt_tf.to_tf_module(model, single_mesh=True)
  flat = fdt_tf.flat_variables(tf_module)
  # One DTensor mesh: the JAX mesh's.
  meshes = {
    dtensor.fetch_layout(v.read_value()).mesh.to_string() for v in flat.values()
  }
  assert meshes == {fdt_tf.mesh_to_dtensor(mesh).to_string()}
  for path, v in flat.items():
    name = '/'.join(map(str, path))
    np.testing.assert_array_equal(_gathered(v), np.asarray(values[name]))
  # The report: what moved, from where, to where, why.
  assert report.mesh == {'data': 2, 'model': 4}
  assert report.variables == len(flat) == 7
  relaid = {r.path: r for r in report.relaid}
  assert sorted(relaid) == ['embed/embedding', 'step', 'unembed']
  assert relaid['embed/embedding'].original == "P(('data', 'model'), None)"
  assert relaid['embed/embedding'].spec == P('model')
  assert relaid['unembed'].original == "P(None, ('data', 'model'))"
  assert relaid['unembed'].spec == P(None, 'model')
  assert relaid['unembed'].reason == (
    'dim 1 (64) was sharded over data+model; a DTensor layout shards a '
    "dimension over one mesh axis: kept 'model', the largest, replicated "
    "over 'data'"
  )
  assert relaid['step'].original == 'one device'
  assert relaid['step'].spec == P()
  assert report.moved_bytes == 64 * 16 * 4 * 2 + 4
  text = str(report)
  assert text.startswith(
    '7 variables on one DTensor mesh (data=2, model=4): 3 relaid by JAX '
    '(8.0 KiB).'
  )
  assert "  unembed          P(None, ('data', 'model'))  P(None, 'model')" in (
    text
  )
  # The model is unchanged.
  assert model.embed.embedding.get_value().sharding.spec == P(
    ('data', 'model'), None
  )
  # The layouts JAX kept are zero-copy: the DTensor components are the
  # JAX buffers.
  kernel = model.blocks.up.kernel.get_value()
  components = dtensor.unpack(flat['blocks/up/kernel'].read_value())
  assert {c._numpy().ctypes.data for c in components} == {
    s.data.unsafe_buffer_pointer() for s in kernel.addressable_shards
  }

  # A moved variable costs one copy of its values: the two devices that
  # need each quarter of the table share one buffer.
  components = dtensor.unpack(flat['embed/embedding'].read_value())
  assert len({c._numpy().ctypes.data for c in components}) == 4

  # TF's own checkpoint writes and reads it.
  prefix = tf.train.Checkpoint(tf_module).write(str(tmp_path / 'tf_ckpt'))
  other, _ = fdt_tf.to_tf_module(_stacked(mesh, seed=1), single_mesh=True)
  other_flat = fdt_tf.flat_variables(other)
  assert not np.array_equal(
    _gathered(other_flat['embed/embedding']), values['embed/embedding']
  )
  tf.train.Checkpoint(other).read(prefix).assert_consumed()
  for path, v in other_flat.items():
    name = '/'.join(map(str, path))
    np.testing.assert_array_equal(_gathered(v), np.asarray(values[name]))

  # TF ops mix variables of different original layouts.
  @tf.function
  def mixed(a, b):
    return a + tf.transpose(b), tf.matmul(a, b)

  e, u = np.asarray(values['embed/embedding']), np.asarray(values['unembed'])
  total, product = mixed(flat['embed/embedding'], flat['unembed'])
  np.testing.assert_array_equal(_replicated(total), e + u.T)
  np.testing.assert_allclose(_replicated(product), e @ u, rtol=1e-5, atol=1e-5)


def _replicated(t):
  """A DTensor's global value (TF all-gathers it)."""
  layout = dtensor.Layout.replicated(dtensor.fetch_layout(t).mesh, t.ndim)
  return dtensor.unpack(dtensor.relayout(t, layout))[0].numpy()


def test_the_default_keeps_fused_meshes_which_tf_cannot_write(
  auto_mesh, tmp_path
):
  """Why single_mesh exists: TF's own write fails across DTensor meshes."""
  model = _stacked(auto_mesh)
  tf_module = fdt_tf.to_tf_module(model)
  meshes = {
    dtensor.fetch_layout(v.read_value()).mesh.to_string()
    for v in tf_module.variables
  }
  assert len(meshes) == 3  # The mesh, the fused one, one device.
  with pytest.raises(tf.errors.OpError):
    tf.train.Checkpoint(tf_module).write(str(tmp_path / 'fails'))


def test_save_checkpoint_on_one_mesh_restores_exactly(auto_mesh, tmp_path):
  model = _stacked(auto_mesh)
  values = _flat(model)
  path, report = fdt_tf.save_checkpoint(
    model, tmp_path / 'ckpt', single_mesh=True
  )
  assert sorted(r.path for r in report.relaid) == [
    'embed/embedding',
    'step',
    'unembed',
  ]
  with open(os.path.join(path, 'flax_dtensor.json')) as f:
    records = {
      '/'.join(map(str, r['path'])): r for r in json.load(f)['variables']
    }
  for record in records.values():
    assert record['sharding']['dtensor_layout']['mesh'] == {
      'axis_names': ['data', 'model'],
      'axis_sizes': [2, 4],
    }
  assert records['embed/embedding']['sharding']['spec'] == [['model'], []]
  # The target decides the placement: the fused layout comes back.
  with jax.set_mesh(auto_mesh), fdt.logical_axis_rules(RULES):
    abstract = nnx.eval_shape(lambda: Stacked(nnx.Rngs(3)))
    restored = fdt_tf.restore_checkpoint(path, abstract, mesh=auto_mesh)
  got = _flat(restored)
  for name, want in values.items():
    assert got[name].dtype == want.dtype, name
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want))
  assert got['embed/embedding'].sharding.spec == P(('data', 'model'), None)
  # TF's own reader restores it into variables on one mesh, too.
  tf_module, _ = fdt_tf.to_tf_module(
    _stacked(auto_mesh, seed=2), single_mesh=True
  )
  tf.train.Checkpoint(tf_module).read(
    os.path.join(path, 'ckpt')
  ).assert_consumed()
  for p, v in fdt_tf.flat_variables(tf_module).items():
    name = '/'.join(map(str, p))
    np.testing.assert_array_equal(_gathered(v), np.asarray(values[name]))


def test_which_axis_a_dimension_keeps():
  """The largest of its axes (the first on a tie) that divides it."""
  from flax_dtensor.dtensor._conversion import _single_mesh

  devices = np.asarray(jax.devices())
  cube = jax.sharding.Mesh(devices.reshape(2, 2, 2), ('a', 'b', 'c'))
  wide = jax.sharding.Mesh(devices.reshape(2, 4), ('data', 'model'))
  tall = jax.sharding.Mesh(devices.reshape(4, 2), ('data', 'model'))
  cases = [
    (wide, P(('data', 'model')), (16,), P('model'), 1),
    (wide, P(('model', 'data')), (16,), P('model'), 1),
    (cube, P(('b', 'a'), 'c'), (8, 4), P('b', 'c'), 1),
    (cube, P(('a', 'b', 'c')), (8,), P('a'), 1),
    (wide, P('data', 'model'), (4, 8), P('data', 'model'), 0),
  ]
  for mesh, spec, shape, want, notes in cases:
    got, why = _single_mesh.spec_on(mesh, NamedSharding(mesh, spec), shape)
    assert (got, len(why)) == (want, notes), (spec, got, why)
  # From another mesh: an axis is kept only where it divides the dimension.
  got, why = _single_mesh.spec_on(
    tall, NamedSharding(wide, P('model', 'data')), (8, 6)
  )
  assert got == P('model')
  assert why == [
    'dim 1 (6) was sharded over data, which this mesh cannot shard it '
    'over: replicated'
  ]
  # Moved onto the main mesh (the one holding the most bytes).
  state = nnx.State(
    {
      'big': nnx.Param(
        jax.device_put(
          np.ones((8, 8), np.float32), NamedSharding(tall, P('data'))
        )
      ),
      'small': nnx.Param(
        jax.device_put(np.arange(8.0), NamedSharding(wide, P('model')))
      ),
    }
  )
  tf_module, report = fdt_tf.to_tf_module(state, single_mesh=True)
  assert report.mesh == {'data': 4, 'model': 2}
  (moved,) = report.relaid
  assert moved.path == 'small'
  assert moved.original == "P('model') on mesh(data=2, model=4; Auto, Auto)"
  assert moved.spec == P('model')
  assert moved.reason == 'on another mesh: laid out on this one'
  np.testing.assert_array_equal(
    _gathered(fdt_tf.flat_variables(tf_module)['small']), np.arange(8.0)
  )
  _, report = fdt_tf.to_tf_module(
    nnx.State({'big': state['big']}), single_mesh=True
  )
  assert (
    str(report)
    == '1 variables on one DTensor mesh (data=4, model=2): none relaid.'
  )
