"""`fdt.init` however a user calls it: every spelling, every mesh type."""

import contextlib

import creation_values
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import flax_dtensor as fdt
from flax_dtensor._placement import _init

RULES = fdt.LogicalRules(
  [
    ('embed', 'fsdp'),  # No such mesh axis: falls back to 'data'.
    ('embed', 'data'),
    ('mlp', 'model'),
    ('vocab', 'model'),
    ('vocab', None),
  ]
)
TYPES = {
  'explicit': (AxisType.Explicit, AxisType.Explicit),
  'auto': (AxisType.Auto, AxisType.Auto),
  'mixed': (AxisType.Explicit, AxisType.Auto),
}


def _annotated(axes):
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), axes)


def _user_init(key, shape, dtype=jnp.float32):
  """A user's initializer: `init` cannot know it is pure, so it traces."""
  return nnx.initializers.lecun_normal()(key, shape, dtype)


def _block(initializers):
  """A model class whose annotated initializers are of one kind.

  'library': JAX's own (`fdt.init` builds eagerly, each in its shards);
  'user': the user's (`fdt.init` builds under one jit).
  """

  def annotated(axes):
    if initializers == 'library':
      return _annotated(axes)
    return nnx.with_partitioning(_user_init, axes)

  class Block(nnx.Module):
    """Arrays, pytrees and Rngs among positional and keyword arguments."""

    def __init__(self, table, *, rngs, extra, scale=2.0):
      self.table = nnx.Param(table * scale)  # From a positional array.
      self.offset = nnx.Param(extra['offset'] + 1.0)  # From a kwarg pytree.
      self.up = nnx.Linear(
        16, 32, kernel_init=annotated(('embed', 'mlp')), rngs=rngs
      )
      self.emb = nnx.Param(
        annotated(('vocab', 'embed'))(rngs.params(), (10, 16))
      )
      self.dropout = nnx.Dropout(0.5, rngs=rngs)  # Keeps the caller's Rngs.

  return Block


Block = _block('library')
BUILDS = {'library': 'in_shards', 'user': 'traced'}


def _inputs():
  return jnp.arange(6.0), {'offset': jnp.full((3,), 0.5)}


def _eager_unsharded():
  rngs = nnx.Rngs(0)
  table, extra = _inputs()
  with nnx.use_eager_sharding(False):
    model = Block(table, rngs=rngs, extra=extra)
  return model, rngs


EXPECTED = {
  ('table',): P(),
  ('offset',): P(),
  ('up', 'kernel'): P('data', 'model'),
  ('up', 'bias'): P(),
  ('emb',): P(None, 'data'),  # 10 % 4: 'vocab' falls back to None.
}


def _canonical(spec, ndim):
  entries = tuple(spec) + (None,) * (ndim - len(spec))
  return tuple(entries)


def _check(model, rngs, mesh, plan_specs, flax_specs):
  """Values, placement, plan, nnx.get_partition_spec and Rngs agree."""
  eager, eager_rngs = _eager_unsharded()
  eager_params = dict(nnx.to_flat_state(nnx.state(eager, nnx.Param)))
  for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    value = variable.get_value()
    creation_values.assert_close(
      value, eager_params[path].get_value(), err_msg=str(path)
    )
    assert value.sharding.mesh == mesh  # Same devices and axis types.
    placed = _canonical(value.sharding.spec, value.ndim)
    assert placed == _canonical(EXPECTED[path], value.ndim), path
    assert placed == _canonical(plan_specs[path], value.ndim), path
    assert placed == _canonical(flax_specs[path], value.ndim), path
  # The caller's Rngs advanced exactly as in an eager build, and the RNG
  # state the model keeps (Dropout's stream) is the eager build's.
  assert int(rngs.params.count[...]) == int(eager_rngs.params.count[...])
  assert int(rngs.default.count[...]) == int(eager_rngs.default.count[...])
  ours = dict(nnx.to_flat_state(nnx.state(model, nnx.RngState)))
  theirs = dict(nnx.to_flat_state(nnx.state(eager, nnx.RngState)))
  assert ours.keys() == theirs.keys() and ours
  for path, variable in ours.items():
    a, b = variable.get_value(), theirs[path].get_value()
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
      a, b = jax.random.key_data(a), jax.random.key_data(b)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize('initializers', list(BUILDS))
@pytest.mark.parametrize('mode', ['graph', 'tree'])
@pytest.mark.parametrize('rngs_made', ['inside', 'outside'])
@pytest.mark.parametrize('rules_via', ['context', 'argument'])
@pytest.mark.parametrize('mesh_via', ['context', 'argument'])
@pytest.mark.parametrize('types', list(TYPES))
def test_init_spellings(
  types, mesh_via, rules_via, rngs_made, mode, initializers
):
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=TYPES[types])
  builds = dict(_init.builds)
  table, extra = _inputs()
  with contextlib.ExitStack() as stack:
    stack.enter_context(nnx.set_graph_mode(mode == 'graph'))
    rngs = nnx.Rngs(0) if rngs_made == 'outside' else None
    if mesh_via == 'context':
      stack.enter_context(jax.set_mesh(mesh))
    if rules_via == 'context':
      stack.enter_context(fdt.logical_axis_rules(RULES))
    if rngs is None:
      rngs = nnx.Rngs(0)  # Made under the caller's mesh, if any.
    key_sharding = rngs.params.key[...].sharding
    model = fdt.init(
      _block(initializers),
      table,
      rngs=rngs,
      extra=extra,
      **({'mesh': mesh} if mesh_via == 'argument' else {}),
      **({'rules': RULES} if rules_via == 'argument' else {}),
    )
    with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
      plan = fdt.plan(model)
      flax_specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
  assert rngs.params.key[...].sharding == key_sharding  # Unchanged.
  path = BUILDS[initializers]
  assert _init.builds[path] == builds.get(path, 0) + 1
  plan_specs = {tuple(e.path.split('/')): e.spec for e in plan.entries}
  flat = {p: v.get_value() for p, v in nnx.to_flat_state(flax_specs)}
  _check(model, rngs, mesh, plan_specs, flat)


@pytest.mark.parametrize('types', list(TYPES))
def test_init_under_flax_rules_places_like_flax(types):
  """Plain-tuple rules from Flax's context keep Flax's semantics in init."""
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=TYPES[types])
  flax_rules = (('mlp', 'data'), ('mlp', 'model'), ('embed', None))
  with jax.set_mesh(mesh), nnx.logical_axis_rules(flax_rules):
    model = fdt.init(
      nnx.Linear,
      8,
      16,
      kernel_init=_annotated(('embed', 'mlp')),
      rngs=nnx.Rngs(0),
    )
    reported = nnx.get_partition_spec(nnx.state(model))['kernel'].get_value()
    planned = fdt.plan(model)['kernel'].spec
  # The last rule for 'mlp' wins, as Flax's own eager creation does.
  assert model.kernel.sharding.spec == P(None, 'model')
  assert reported == planned == P(None, 'model')
  if types != 'mixed':  # Flax itself refuses mixed meshes.
    with jax.set_mesh(mesh), nnx.logical_axis_rules(flax_rules):
      eager = nnx.Linear(
        8, 16, kernel_init=_annotated(('embed', 'mlp')), rngs=nnx.Rngs(0)
      )
    assert eager.kernel.sharding.spec == model.kernel.sharding.spec


def test_init_returns_other_graph_nodes():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))

  def factory(rngs):
    a = nnx.Linear(16, 32, kernel_init=_annotated(('embed', 'mlp')), rngs=rngs)
    return a, nnx.Linear(
      32, 16, kernel_init=_annotated(('mlp', 'embed')), rngs=rngs
    )

  first, second = fdt.init(factory, nnx.Rngs(0), mesh=mesh, rules=RULES)
  assert first.kernel.sharding.spec == P('data', 'model')
  assert second.kernel.sharding.spec == P('model', 'data')


def test_init_keeps_a_sharded_input_array_where_it_is():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  x = jax.device_put(
    jnp.arange(8.0), jax.sharding.NamedSharding(mesh, P('data'))
  )

  class Holder(nnx.Module):
    def __init__(self, x):
      self.x = nnx.Param(x * 2)

  model = fdt.init(Holder, x, mesh=mesh, rules=RULES)
  np.testing.assert_array_equal(np.asarray(model.x[...]), np.arange(8.0) * 2)
  plan = fdt.plan(model, rules=RULES)
  assert plan['x'].placed == model.x[...].sharding.spec
  assert not plan['x'].misplaced


@pytest.mark.parametrize('types', list(TYPES))
def test_init_of_a_factory_capturing_its_rngs_names_the_fix(types):
  """An nnx.Rngs from the enclosing scope, not passed: Flax refuses it in
  the trace (TraceContextError); ours names the argument to pass, and
  passing it builds."""
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=TYPES[types])
  rngs = nnx.Rngs(0)

  def make():
    return nnx.Linear(
      16, 32, kernel_init=_annotated(('embed', 'mlp')), rngs=rngs
    )

  with pytest.raises(
    fdt.FactoryError,
    match=r"could not trace '[^']*make'.*captured from the enclosing scope.*"
    r'RngCount.*`fdt\.init\(make, rngs\)`',
  ):
    fdt.init(make, mesh=mesh, rules=RULES)
  built = fdt.init(
    lambda rngs: nnx.Linear(
      16, 32, kernel_init=_annotated(('embed', 'mlp')), rngs=rngs
    ),
    rngs,
    mesh=mesh,
    rules=RULES,
  )
  assert built.kernel.sharding.spec == P('data', 'model')
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    eager = nnx.Linear(
      16, 32, kernel_init=_annotated(('embed', 'mlp')), rngs=nnx.Rngs(0)
    )
  np.testing.assert_array_equal(
    np.asarray(built.kernel[...]), np.asarray(eager.kernel[...])
  )


def test_init_without_a_mesh_raises():
  with pytest.raises(
    fdt.MeshError, match=r'Expected a concrete mesh for `fdt\.init`'
  ):
    fdt.init(nnx.Linear, 2, 4, rngs=nnx.Rngs(0), rules=RULES)


def test_init_with_an_abstract_mesh_raises():
  mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
  # Made outside: from jax 0.11, JAX itself runs no eager op (as nnx.Rngs's
  # key) while only an abstract mesh is set.
  rngs = nnx.Rngs(0)
  with jax.sharding.use_abstract_mesh(mesh):
    with pytest.raises(fdt.MeshError, match='got the abstract'):
      fdt.init(nnx.Linear, 2, 4, rngs=rngs, rules=RULES)
  with pytest.raises(fdt.MeshError, match='got the abstract'):
    fdt.init(nnx.Linear, 2, 4, rngs=rngs, rules=RULES, mesh=mesh)


def test_init_refuses_a_variable_on_another_mesh():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  other = jax.make_mesh((8,), ('data',))
  init = nnx.with_partitioning(
    nnx.initializers.ones, ('embed', None), mesh=other
  )
  with pytest.raises(
    fdt.MeshError, match=r'at kernel names mesh\(data=8; Explicit\)'
  ):
    fdt.init(
      nnx.Linear,
      8,
      4,
      kernel_init=init,
      rngs=nnx.Rngs(0),
      mesh=mesh,
      rules=RULES,
    )


def test_init_unknown_name_names_the_path():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  with pytest.raises(
    fdt.UnknownLogicalAxisError,
    match=r"\['hidden'\] are not mentioned by any rule at kernel",
  ):
    fdt.init(
      nnx.Linear,
      8,
      4,
      kernel_init=_annotated(('embed', 'hidden')),
      rngs=nnx.Rngs(0),
      mesh=mesh,
      rules=RULES,
    )
