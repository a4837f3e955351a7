"""`fdt.init` however a user calls it: every spelling, every mesh type."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from support import creation_values

import flax_dtensor as fdt
from flax_dtensor._placement import _init
from flax_dtensor._planning import _plan_build, _plan_view
from flax_dtensor._rules import _meshes

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


def test_init_places_a_variable_on_the_mesh_it_names():
  """A variable's own `mesh=` wins over the mesh `init` is given, as in
  Flax's `shard_value`; the others go on the given mesh."""
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  other = jax.make_mesh((8,), ('data',))
  init = nnx.with_partitioning(
    nnx.initializers.ones, ('embed', None), mesh=other
  )
  model = fdt.init(
    nnx.Linear,
    8,
    4,
    kernel_init=init,
    rngs=nnx.Rngs(0),
    mesh=mesh,
    rules=RULES,
  )
  assert model.kernel.sharding.mesh == other
  assert model.kernel.sharding.spec == P('data', None)
  np.testing.assert_array_equal(np.asarray(model.kernel[...]), np.ones((8, 4)))
  assert model.bias.sharding.mesh == mesh
  np.testing.assert_array_equal(np.asarray(model.bias[...]), np.zeros(4))


# Meshes per model: every variable on the caller's mesh ('one'), or on
# three meshes their `mesh=` metadata names (two disjoint halves of the
# devices and all eight), beside one that names none ('three').
MESHES_PER_MODEL = ('one', 'three')


def _three_meshes(types):
  devices = np.array(jax.devices())
  return (
    jax.sharding.Mesh(
      devices[:4].reshape(2, 2), ('data', 'model'), axis_types=TYPES[types]
    ),
    jax.sharding.Mesh(devices[4:], ('data',), axis_types=TYPES[types][:1]),
    jax.make_mesh((4, 2), ('data', 'model'), axis_types=TYPES[types]),
  )


def _towers(meshes, *, unplaced=True):
  """Variables on the meshes of `meshes` (None: the caller's), a JAX
  initializer's and a user's value among them, with `sharding_rules=`
  metadata naming what the global rules do not."""
  a, b, c = meshes

  class Towers(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(
        16,
        32,
        kernel_init=nnx.with_partitioning(
          nnx.initializers.lecun_normal(), ('embed', 'mlp'), mesh=a
        ),
        rngs=rngs,
      )
      self.b = nnx.Param(
        _user_init(rngs.params(), (32, 16)),
        out_sharding=('C', None),
        mesh=b,
        sharding_rules=(('C', 'data'),),
      )
      self.c = nnx.Param(
        nnx.with_partitioning(_user_init, ('embed', 'mlp'), mesh=c)(
          rngs.params(), (16, 16)
        )
      )
      if unplaced:
        self.d = nnx.Param(_annotated(('embed', None))(rngs.params(), (16, 8)))

  return Towers


def _expected_towers(meshes, caller):
  """{path: (mesh, spec)}; None meshes are the caller's."""
  a, b, c = (m if m is not None else caller for m in meshes)
  out = {
    ('a', 'kernel'): (a, P('data', 'model')),
    ('b',): (b, P('data', None)),
    ('c',): (c, P('data', 'model')),
  }
  if caller is not None:
    out[('d',)] = (caller, P('data', None))
    out[('a', 'bias')] = (caller, P())
  return out


def _check_towers(model, rngs, towers, expected, plan, caller):
  """Values (an unsharded eager build's), mesh and spec of every variable,
  the plan's mesh and spec, and the Rngs as an eager call leaves them."""
  eager_rngs = nnx.Rngs(0)
  with nnx.use_eager_sharding(False):
    eager = towers(eager_rngs)
  want = dict(nnx.to_flat_state(nnx.state(eager, nnx.Param)))
  got = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  assert got.keys() == want.keys()
  for path, variable in got.items():
    value = variable.get_value()
    creation_values.assert_close(
      value, want[path].get_value(), err_msg=str(path)
    )
    if path not in expected:
      continue
    mesh, spec = expected[path]
    assert value.sharding.mesh == mesh, path
    assert _canonical(value.sharding.spec, value.ndim) == _canonical(
      spec, value.ndim
    ), path
    entry = plan['/'.join(path)]
    assert _canonical(entry.spec, value.ndim) == _canonical(spec, value.ndim)
    if mesh != caller:  # On a mesh of its own: the plan names it.
      assert entry.mesh == _plan_build.mesh_label(mesh), path
      assert entry.mesh_axes == _meshes.axis_sizes(mesh), path
    else:
      assert entry.mesh is None, path
  assert int(rngs.params.count[...]) == int(eager_rngs.params.count[...])


@pytest.mark.parametrize('types', list(TYPES))
@pytest.mark.parametrize('mesh_via', ['none', 'context', 'argument'])
@pytest.mark.parametrize('meshes', MESHES_PER_MODEL)
def test_init_meshes_per_model(meshes, mesh_via, types):
  """Each variable on the mesh its metadata names, with its spec; the
  others on the caller's mesh, if one is given."""
  if meshes == 'one' and mesh_via == 'none':  # No mesh anywhere: refused.
    with pytest.raises(fdt.MeshError, match=r'but no mesh is set\. Set one'):
      fdt.init(_towers((None,) * 3, unplaced=False), nnx.Rngs(0), rules=RULES)
    return
  caller = (
    None
    if mesh_via == 'none'
    else jax.make_mesh((2, 4), ('data', 'model'), axis_types=TYPES[types])
  )
  named = _three_meshes(types) if meshes == 'three' else (None,) * 3
  towers = _towers(named, unplaced=caller is not None)
  rngs = nnx.Rngs(0)
  with contextlib.ExitStack() as stack:
    if mesh_via == 'context':
      stack.enter_context(jax.set_mesh(caller))
    model = fdt.init(
      towers,
      rngs,
      rules=RULES,
      **({'mesh': caller} if mesh_via == 'argument' else {}),
    )
  plan = fdt.plan(model, mesh=caller, rules=RULES)
  _check_towers(
    model, rngs, towers, _expected_towers(named, caller), plan, caller
  )
  if meshes == 'three':
    text = _plan_view.mesh_text(plan)
    for m in {x for x in named if x != caller}:
      assert _plan_build.mesh_label(m) in text


def test_init_without_any_mesh_names_the_variables_lacking_one():
  towers = _towers(_three_meshes('explicit'))
  with pytest.raises(
    fdt.MeshError,
    match=r'no mesh is set, and the variables at d name none in '
    r'their `mesh` metadata',
  ):
    fdt.init(towers, nnx.Rngs(0), rules=RULES)


def test_init_of_flax_5127_places_each_variable_on_its_mesh():
  """flax#5127's model, every Param naming its mesh and local rules, no
  rules in effect: `fdt.init` places them as Flax's eager build does (where
  Flax's `nnx.jit` of it moves the third onto the first's mesh)."""
  mesh1 = jax.make_mesh((2, 4), ('a', 'b'))
  mesh2 = jax.make_mesh((2, 2, 2), ('x', 'y', 'z'))
  mesh3 = jax.sharding.Mesh(
    np.array(jax.devices()[4:]), ('c',), axis_types=(AxisType.Explicit,)
  )

  class Model(nnx.Module):
    def __init__(self):
      self.p1 = nnx.Param(
        jnp.arange(256.0).reshape(16, 16),
        out_sharding=('A', 'B'),
        mesh=mesh1,
        sharding_rules=(('A', 'a'), ('B', 'b')),
      )
      self.p2 = nnx.Param(
        jnp.arange(4096.0).reshape(16, 16, 16),
        out_sharding=('X', 'Y', 'Z'),
        mesh=mesh2,
        sharding_rules=(('X', 'x'), ('Y', 'y'), ('Z', 'z')),
      )
      self.p3 = nnx.Param(
        -jnp.arange(256.0).reshape(16, 16),
        out_sharding=('C', None),
        mesh=mesh3,
        sharding_rules=(('C', 'c'),),
      )

  model = fdt.init(Model)
  eager = Model()
  for name, mesh, spec in (
    ('p1', mesh1, P('a', 'b')),
    ('p2', mesh2, P('x', 'y', 'z')),
    ('p3', mesh3, P('c', None)),
  ):
    value = getattr(model, name)[...]
    assert value.sharding.mesh == mesh, name
    assert value.sharding.spec == spec, name
    assert value.sharding == getattr(eager, name)[...].sharding, name
    np.testing.assert_array_equal(
      np.asarray(value), np.asarray(getattr(eager, name)[...])
    )
  plan = fdt.plan(model)
  assert plan['p3'].mesh == 'c=4 (devices 4-7)'
  assert plan['p3'].bytes_per_device == 16 * 16 * 4 // 4
  assert plan.num_devices == 8


@pytest.mark.parametrize('types', ['explicit', 'auto'])
def test_eager_creation_on_the_meshes_variables_name(types):
  """Under a context mesh, a variable naming another mesh (of other
  devices) goes there, by value and spec, as with `fdt.init`."""
  caller = jax.make_mesh((2, 4), ('data', 'model'), axis_types=TYPES[types])
  named = _three_meshes(types)
  towers = _towers(named)
  rngs = nnx.Rngs(0)
  with jax.set_mesh(caller), fdt.logical_axis_rules(RULES):
    model = towers(rngs)
  plan = fdt.plan(model, mesh=caller, rules=RULES)
  _check_towers(
    model, rngs, towers, _expected_towers(named, caller), plan, caller
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
