"""A model on several meshes (flax#5127, flax#5105): files and serving.

Its variables name three meshes in their ``mesh=`` metadata: two disjoint
halves of the devices and all eight. `fdt.init` builds it on them; a
checkpoint saves and restores each variable on its own mesh, `to_tf_module`
gives each its own DTensor mesh, and `save_saved_model` serves it (JAX
itself cannot run a forward over arrays on meshes of other devices).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import flax_dtensor as fdt

tf = pytest.importorskip('tensorflow')
fdt_dt = pytest.importorskip('flax_dtensor.dtensor')

RULES = fdt.LogicalRules([('embed', 'data'), ('mlp', 'model')])
_LECUN = nnx.initializers.lecun_normal()


def _meshes():
  devices = np.array(jax.devices())
  explicit = AxisType.Explicit
  return (
    Mesh(devices[:4].reshape(2, 2), ('data', 'model'), (explicit,) * 2),
    Mesh(devices[4:], ('data',), (explicit,)),
    jax.make_mesh((4, 2), ('data', 'model')),
  )


def _towers():
  first, second, third = _meshes()

  class Towers(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Param(
        nnx.with_partitioning(_LECUN, ('embed', 'mlp'), mesh=first)(
          rngs.params(), (16, 32)
        )
      )
      self.b = nnx.Param(
        nnx.with_partitioning(
          _LECUN, ('hidden', None), mesh=second, sharding_rules=RULES_B
        )(rngs.params(), (32, 16))
      )
      self.c = nnx.Param(
        nnx.with_partitioning(_LECUN, ('embed', 'mlp'), mesh=third)(
          rngs.params(), (16, 16)
        )
      )

    def __call__(self, x):
      return (x @ self.a[...]) @ self.b[...] + x @ self.c[...]

  return Towers


RULES_B = (('hidden', 'data'),)  # The variable's own `sharding_rules`.


def _build(seed):
  return fdt.init(_towers(), nnx.Rngs(seed), rules=RULES)


def _where(model):
  """{path: (mesh, spec)} of every variable."""
  return {
    path: (v.get_value().sharding.mesh, v.get_value().sharding.spec)
    for path, v in nnx.to_flat_state(nnx.state(model))
  }


def _expected():
  first, second, third = _meshes()
  return {
    ('a',): (first, P('data', 'model')),
    ('b',): (second, P('data', None)),
    ('c',): (third, P('data', 'model')),
  }


def test_checkpoint_of_a_model_on_several_meshes(tmp_path):
  model = _build(0)
  assert _where(model) == _expected()
  path = fdt_dt.save_checkpoint(model, tmp_path / 'towers')
  target = _build(1)
  for name in ('a', 'b', 'c'):  # Another seed: other values to overwrite.
    assert not np.array_equal(
      getattr(model, name)[...], getattr(target, name)[...]
    )
  fdt_dt.restore_checkpoint(path, target)
  assert _where(target) == _expected()
  for name in ('a', 'b', 'c'):
    np.testing.assert_array_equal(
      np.asarray(getattr(target, name)[...]),
      np.asarray(getattr(model, name)[...]),
    )
  # Into an abstract target, with and without the rules in effect: each
  # variable onto the mesh its metadata names.
  with fdt.logical_axis_rules(RULES):
    abstract = nnx.eval_shape(lambda: _towers()(nnx.Rngs(1)))
    under_rules = fdt_dt.restore_checkpoint(path, abstract)
  with fdt.logical_axis_rules(RULES):
    abstract = nnx.eval_shape(lambda: _towers()(nnx.Rngs(1)))
  for restored in (under_rules, fdt_dt.restore_checkpoint(path, abstract)):
    assert _where(restored) == _expected()
    for name in ('a', 'b', 'c'):
      np.testing.assert_array_equal(
        np.asarray(getattr(restored, name)[...]),
        np.asarray(getattr(model, name)[...]),
      )


def test_tf_module_of_a_model_on_several_meshes():
  model = _build(0)
  module = fdt_dt.to_tf_module(model)
  flat = fdt_dt.flat_variables(module)
  meshes = set()
  for name in ('a', 'b', 'c'):
    variable = flat[(name,)]
    np.testing.assert_array_equal(
      np.asarray(fdt_dt.dtensor_to_array(variable)),
      np.asarray(getattr(model, name)[...]),
    )
    layout = tf.experimental.dtensor.fetch_layout(variable)
    devices = len(layout.mesh.local_devices())
    meshes.add((tuple(layout.mesh.dim_names), devices))
  assert meshes == {
    (('data', 'model'), 4),
    (('data',), 4),
    (('data', 'model'), 8),
  }


def test_saved_model_of_a_model_on_several_meshes_serves(tmp_path):
  model = _build(0)
  x = np.linspace(-1.0, 1.0, 4 * 16, dtype=np.float32).reshape(4, 16)
  with pytest.raises(ValueError, match='Mesh for all inputs should be equal'):
    model(jnp.asarray(x))  # JAX's own refusal: one forward, one mesh.
  out = fdt_dt.save_saved_model(
    model,
    tmp_path / 'served',
    input_signature=[jax.ShapeDtypeStruct((4, 16), jnp.float32)],
  )
  serve = tf.saved_model.load(out).signatures['serving_default']
  (name,) = serve.structured_input_signature[1]
  (got,) = serve(**{name: tf.constant(x)}).values()
  a, b, c = (np.asarray(getattr(model, n)[...], np.float64) for n in 'abc')
  np.testing.assert_allclose(
    got.numpy(), (x @ a) @ b + x @ c, rtol=1e-5, atol=1e-5
  )
