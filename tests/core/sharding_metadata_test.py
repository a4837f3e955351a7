"""Flax's sharding metadata in each of its forms, through the hook.

``out_sharding`` may hold logical names, a ``NamedSharding`` or a
``jax.experimental.layout.Format`` (a sharding and a device-local layout).
Each form is placed at creation, answered by ``nnx.get_partition_spec``,
planned, typed by ``nnx.get_abstract_model`` and ``nnx.as_abstract``, and
restored into what those return: the same spec everywhere, and the
Format's layout kept wherever an array is placed.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.layout import Format, Layout
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_dtensor as fdt

tf = pytest.importorskip('tensorflow')
from flax_dtensor import dtensor as fdt_tf  # noqa: E402

SPEC = P('data', 'model')
VALUES = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
ROW_MAJOR, COLUMN_MAJOR = (0, 1), (1, 0)


# Restores go through TensorFlow DTensor, set up once a session.
pytestmark = pytest.mark.usefixtures('dtensor')


def _mesh(kind):
  types = {'auto': AxisType.Auto, 'explicit': AxisType.Explicit}[kind]
  return jax.make_mesh((2, 4), ('data', 'model'), axis_types=(types,) * 2)


def _forms(mesh):
  named = NamedSharding(mesh, SPEC)
  return {
    'named_sharding': (named, None),
    'format_row_major': (Format(Layout(ROW_MAJOR), named), ROW_MAJOR),
    'format_column_major': (Format(Layout(COLUMN_MAJOR), named), COLUMN_MAJOR),
  }


def _rules(kind):
  if kind == 'none':
    return contextlib.nullcontext()
  if kind == 'flax':
    return nnx.logical_axis_rules((('embed', 'data'),))
  return fdt.logical_axis_rules([('embed', 'data')])


def _make(out_sharding):
  def make():
    return nnx.Dict(
      {'w': nnx.Param(jnp.asarray(VALUES), out_sharding=out_sharding)}
    )

  return make


def _layout(array):
  return tuple(array.format.layout.major_to_minor)


@pytest.mark.parametrize('rules', ['none', 'flax', 'ours'])
@pytest.mark.parametrize('kind', ['auto', 'explicit'])
@pytest.mark.parametrize(
  'form', ['named_sharding', 'format_row_major', 'format_column_major']
)
def test_each_form_is_placed_planned_and_queried_alike(form, kind, rules):
  mesh = _mesh(kind)
  out_sharding, layout = _forms(mesh)[form]
  with jax.set_mesh(mesh), _rules(rules):
    model = _make(out_sharding)()
    queried = nnx.get_partition_spec(nnx.state(model))['w'].get_value()
    planned = fdt.plan(model)['w']
  w = model['w'].get_value()
  assert w.sharding.spec == SPEC == queried == planned.spec
  assert not planned.misplaced
  if layout is not None:
    assert _layout(w) == layout
  np.testing.assert_array_equal(np.asarray(w), VALUES)


@pytest.mark.parametrize(
  'form', ['named_sharding', 'format_row_major', 'format_column_major']
)
def test_abstract_models_keep_the_form_and_restores_fill_them(form, tmp_path):
  mesh = _mesh('auto')
  out_sharding, layout = _forms(mesh)[form]
  make = _make(out_sharding)
  with jax.set_mesh(mesh):
    saved = fdt_tf.save_checkpoint(make(), tmp_path / 'ckpt')
    _, abstract_state = nnx.get_abstract_model(make, mesh)
    as_abstract = nnx.as_abstract(nnx.eval_shape(make))
  for target in (abstract_state, as_abstract):
    value = target['w'].get_value()
    assert isinstance(value, jax.ShapeDtypeStruct)
    assert value.sharding.spec == SPEC
    written = getattr(value.format, 'layout', None) if layout else None
    assert (written and tuple(written.major_to_minor)) == (layout or None)
    restored = fdt_tf.restore_checkpoint(saved, target)
    w = restored['w'].get_value()
    assert w.sharding.spec == SPEC
    if layout is not None:
      assert _layout(w) == layout
    np.testing.assert_array_equal(np.asarray(w), VALUES)


def test_init_and_shard_module_keep_a_format_layout():
  mesh = _mesh('auto')
  fmt = Format(Layout(COLUMN_MAJOR), NamedSharding(mesh, SPEC))
  built = fdt.init(_make(fmt), mesh=mesh, rules=[('embed', 'data')])
  assert built['w'].get_value().sharding.spec == SPEC
  assert _layout(built['w'].get_value()) == COLUMN_MAJOR
  np.testing.assert_array_equal(np.asarray(built['w'].get_value()), VALUES)
  # Built where eager sharding is off, then placed by shard_module.
  with nnx.use_eager_sharding(False):
    loose = _make(fmt)()
  assert not isinstance(loose['w'].get_value().sharding, NamedSharding)
  fdt.shard_module(loose, mesh=mesh, rules=[('embed', 'data')])
  w = loose['w'].get_value()
  assert w.sharding.spec == SPEC and _layout(w) == COLUMN_MAJOR
  np.testing.assert_array_equal(np.asarray(w), VALUES)
