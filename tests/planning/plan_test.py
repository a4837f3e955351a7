"""Tests for fdt.plan and ShardingPlan."""

import json
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P
from support import many_axes

import flax_dtensor as fdt

RULES = fdt.LogicalRules(
  [
    ('embed', 'fsdp'),
    ('embed', 'data'),
    ('mlp', 'model'),
    ('mlp', 'data'),
    ('vocab', None),
  ]
)
MESH = AbstractMesh((2, 4), ('data', 'model'))


def _abstract_model():
  # Flax's own eager sharding needs a mesh for annotated variables; an
  # abstract model built without one has eager sharding off.
  with nnx.use_eager_sharding(False):
    return nnx.eval_shape(lambda: Model(nnx.Rngs(0)))


class Model(nnx.Module):
  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    self.embed = nnx.Embed(
      num_embeddings=10,
      features=16,
      embedding_init=nnx.with_partitioning(init, ('vocab', 'embed')),
      rngs=rngs,
    )
    self.up = nnx.Linear(
      16,
      6,
      kernel_init=nnx.with_partitioning(init, ('embed', 'mlp')),
      param_dtype=jnp.bfloat16,
      rngs=rngs,
    )
    self.count = nnx.BatchStat(jnp.zeros((), jnp.int32))


def test_plan_on_abstract_model_allocates_nothing():
  abstract = _abstract_model()
  assert isinstance(abstract.up.kernel.get_value(), jax.ShapeDtypeStruct)
  plan = fdt.plan(abstract, mesh=MESH, rules=RULES)
  assert [e.path for e in plan.entries] == [
    'count',
    'embed/embedding',
    'up/bias',
    'up/kernel',
  ]
  kernel = plan['up/kernel']
  assert kernel.shape == (16, 6)
  assert kernel.dtype == 'bfloat16'
  assert kernel.kind == 'Param'
  assert kernel.logical_axes == ('embed', 'mlp')
  # Rules are scanned in order: 'embed' skips 'fsdp' and claims 'data';
  # 'mlp' skips 'model' (6 % 4 != 0) and finds 'data' taken.
  assert kernel.spec == P('data', None)
  assert kernel.bytes == 16 * 6 * 2
  assert kernel.bytes_per_device == 8 * 6 * 2
  assert kernel.fallbacks == (
    "dim 0 ('embed'): 'fsdp': the mesh has no axis 'fsdp' (axes: "
    "['data', 'model'])",
    "dim 1 ('mlp'): 'model': dim size 6 is not divisible by 4 (mesh axes "
    "['model'])",
    "dim 1 ('mlp'): 'data': mesh axis 'data' already shards dim 0 ('embed')",
  )
  embedding = plan['embed/embedding']
  assert embedding.spec == P(None, 'data')
  assert embedding.bytes_per_device == 10 * 8 * 4
  count = plan['count']
  assert (count.kind, count.shape, count.logical_axes) == (
    'BatchStat',
    (),
    None,
  )
  assert count.bytes == count.bytes_per_device == 4


def test_plan_totals_against_ideal():
  abstract = _abstract_model()
  plan = fdt.plan(abstract, mesh=MESH, rules=RULES)
  total = 4 + 10 * 16 * 4 + 6 * 2 + 16 * 6 * 2
  assert plan.total_bytes == total
  assert plan.num_devices == 8
  assert plan.ideal_bytes_per_device == total / 8
  assert plan.bytes_per_device == 4 + 10 * 8 * 4 + 6 * 2 + 8 * 6 * 2
  text = plan.render(100)
  assert 'Sharding plan: mesh data=2, model=4 (8 devices)' in text
  assert '432 B per device of 848 B in 4 variables; ideal 106 B (4.08x)' in text
  assert 'up/kernel' in text


def test_plan_to_json_round_trips():
  abstract = _abstract_model()
  plan = fdt.plan(abstract, mesh=MESH, rules=RULES)
  data = json.loads(plan.to_json())
  assert data['mesh'] == {'data': 2, 'model': 4}
  assert data['total_bytes'] == plan.total_bytes
  kernel = next(v for v in data['variables'] if v['path'] == 'up/kernel')
  assert kernel['spec'] == ['data', None]
  assert kernel['logical_axes'] == ['embed', 'mlp']
  assert len(kernel['fallbacks']) == 3


def test_plan_uses_context_and_matches_placement(explicit_mesh):
  with jax.set_mesh(explicit_mesh), fdt.logical_axis_rules(RULES):
    model = Model(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    plan = fdt.plan(opt)
    assert fdt.plan(model)['up/kernel'].spec == P('data', None)
  by_path = {e.path: e for e in plan.entries}
  assert model.up.kernel.sharding.spec == P('data', None)
  # Adam's moments are planned, and placed, like their params.
  mu = by_path['opt_state/0/mu/up/kernel']
  assert mu.spec == P('data', None) and mu.kind == 'OptVariable'
  assert opt.opt_state[0].mu['up']['kernel'].sharding.spec == P('data', None)


def test_plan_on_a_state():
  abstract = _abstract_model()
  plan = fdt.plan(nnx.state(abstract, nnx.Param), mesh=MESH, rules=RULES)
  assert [e.path for e in plan.entries] == [
    'embed/embedding',
    'up/bias',
    'up/kernel',
  ]


def test_plan_without_mesh_counts_one_device():
  abstract = _abstract_model()
  plan = fdt.plan(abstract, rules=RULES)
  assert plan.num_devices == 1 and plan.mesh_axes is None
  # Without a mesh, Linen semantics: 'fsdp' is taken on trust.
  assert plan['up/kernel'].spec == P('fsdp', 'model')
  assert plan.bytes_per_device == plan.total_bytes
  assert 'no mesh' in str(plan)


def test_plan_rng_keys_are_counted():
  abstract = nnx.eval_shape(lambda: nnx.Dropout(0.5, rngs=nnx.Rngs(0)))
  assert jax.dtypes.issubdtype(
    abstract.rngs.key.get_value().dtype, jax.dtypes.prng_key
  )
  plan = fdt.plan(abstract, mesh=MESH, rules=RULES)
  key = next(e for e in plan.entries if e.kind == 'RngKey')
  assert key.bytes == 8  # A threefry key is two uint32 words.


def test_plan_errors_name_the_path():
  abstract = _abstract_model()
  with pytest.raises(
    fdt.UnknownLogicalAxisError,
    match=r"\['mlp'\] are not mentioned by any "
    r'rule at up/kernel',
  ):
    fdt.plan(abstract, mesh=MESH, rules=[('embed', None), ('vocab', None)])
  with pytest.raises(KeyError, match='No variable at'):
    fdt.plan(abstract, mesh=MESH, rules=RULES)['nope']


def test_plan_a_large_mesh_on_a_small_machine():
  """An abstract mesh of 256 devices: nothing is allocated or placed."""
  big = AbstractMesh((16, 16), ('data', 'model'))
  with jax.sharding.use_abstract_mesh(big), fdt.logical_axis_rules(RULES):
    abstract = nnx.eval_shape(lambda: Model(nnx.Rngs(0)))
    plan = fdt.plan(abstract)
  assert plan.num_devices == 256
  # 16 % 16 == 0: 'embed' takes 'data'; 'mlp' (6) fits nowhere.
  assert plan['up/kernel'].spec == P('data', None)
  assert abstract.up.kernel.get_value().sharding.spec == P('data', None)


def test_plan_reports_actual_placement_of_concrete_arrays(explicit_mesh):
  """A model placed under other rules: the plan says so, and counts truly."""
  with nnx.use_eager_sharding(False):
    model = Model(nnx.Rngs(0))  # Unsharded: every array on one device.
  plan = fdt.plan(model, mesh=explicit_mesh, rules=RULES)
  kernel = plan['up/kernel']
  assert kernel.spec == P('data', None)
  assert kernel.placed is None  # Single-device arrays carry no spec.
  assert kernel.bytes_per_device == kernel.bytes
  with (
    jax.set_mesh(explicit_mesh),
    fdt.logical_axis_rules(
      [('embed', None), ('mlp', None), ('vocab', 'model')]
    ),
  ):
    other = Model(nnx.Rngs(0))
  plan = fdt.plan(other, mesh=explicit_mesh, rules=RULES)
  embedding = plan['embed/embedding']
  assert embedding.spec == P(None, 'data')
  assert embedding.placed == P(None, None) or embedding.placed == P()
  assert embedding.misplaced
  assert embedding.bytes_per_device == 10 * 16 * 4  # Replicated, in fact.
  assert plan['up/bias'].misplaced is False
  assert "P(None, 'data') (placed P(" in plan.render(200)
  assert plan.to_dict()['variables'][1]['placed'] is not None


def test_plan_sorts_paths_naturally():
  class Stack(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.List(
        [nnx.Linear(2, 2, use_bias=False, rngs=rngs) for _ in range(12)]
      )

  with nnx.use_eager_sharding(False):
    abstract = nnx.eval_shape(lambda: Stack(nnx.Rngs(0)))
  paths = [e.path for e in fdt.plan(abstract, mesh=MESH, rules=RULES).entries]
  assert paths == [f'layers/{i}/kernel' for i in range(12)]


def test_plan_of_a_factory_builds_it_abstractly():
  def factory():
    return Model(nnx.Rngs(0))

  from_factory = fdt.plan(factory, mesh=MESH, rules=RULES)
  from_model = fdt.plan(_abstract_model(), mesh=MESH, rules=RULES)
  assert from_factory.to_dict() == from_model.to_dict()
  assert from_factory['up/kernel'].spec == P('data', None)

  # Nothing was allocated: a 40 GB model plans in a blink.
  def huge():
    return nnx.Linear(
      100_000,
      100_000,
      kernel_init=nnx.with_partitioning(
        nnx.initializers.zeros, ('embed', 'mlp')
      ),
      rngs=nnx.Rngs(0),
    )

  entry = fdt.plan(huge, mesh=MESH, rules=RULES)['kernel']
  assert entry.bytes == 100_000 * 100_000 * 4
  assert entry.bytes_per_device == entry.bytes // 8


def test_plan_of_a_factory_that_builds_no_model_is_an_error():
  with pytest.raises(
    fdt.NotAModelError,
    match=r"Expected the factory '.*<lambda>' to return an NNX module.*got int: 3",
  ):
    fdt.plan(lambda: 3, mesh=MESH, rules=RULES)


def test_planning_a_factory_never_walks_the_trace(monkeypatch):
  """The cost that makes Flax's eval_shape quadratic is never paid.

  Each ``nnx.Rngs`` call makes Flax read ``.sharding`` of a traced value,
  and JAX builds that error's message by walking every equation traced so
  far (jax 0.10; from jax 0.11 the message costs nothing). Counted, not
  timed: zero walks in fdt.plan, and, where JAX walks, one per RNG call in
  Flax's own nnx.eval_shape.
  """
  from jax._src.interpreters import partial_eval

  walks = []
  original = partial_eval.DynamicJaxprTracer._origin_msg

  def counted(self):
    walks.append(1)
    return original(self)

  monkeypatch.setattr(partial_eval.DynamicJaxprTracer, '_origin_msg', counted)
  jax.jit(lambda x: getattr(x, 'sharding', None) and x)(1.0)
  walks_on_sharding = bool(walks)
  walks.clear()
  init = nnx.with_partitioning(nnx.initializers.ones, ('embed', 'mlp'))

  class Many(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.List(
        [nnx.Linear(4, 4, use_bias=False, kernel_init=init, rngs=rngs)] * 0
        + [
          nnx.Linear(4, 4, use_bias=False, kernel_init=init, rngs=rngs)
          for _ in range(50)
        ]
      )

  plan = fdt.plan(lambda: Many(nnx.Rngs(0)), mesh=MESH, rules=RULES)
  assert len(plan.entries) == 50
  assert walks == []
  if walks_on_sharding:  # The count works: Flax's own build pays it.
    with nnx.use_eager_sharding(False):
      nnx.eval_shape(lambda: Many(nnx.Rngs(0)))
    assert len(walks) >= 50


# A MaxText-style mesh: 12 axes, most of size 1 (tests/support/many_axes.py)
# ------------------------------------------------------------------------------


@pytest.mark.parametrize(
  'a, b, ndim, same',
  [
    (
      P(('fsdp', 'context', 'expert'), 'stage', 'tensor'),
      P('fsdp', None, 'tensor'),
      3,
      True,
    ),
    (P(('fsdp',), None), P('fsdp'), 2, True),
    (P('fsdp', None, None), P('fsdp'), 3, True),
    (P(('data', 'fsdp', 'stage', 'tensor')), P(('fsdp', 'tensor')), 2, True),
    (P('stage', 'expert'), P(), 2, True),
    (P(('fsdp', 'tensor')), P(('tensor', 'fsdp')), 2, False),
    (P('fsdp', 'tensor'), P('tensor', 'fsdp'), 2, False),
    (P(None, 'tensor'), P('tensor'), 2, False),
    (P(('fsdp', 'context')), P(), 1, False),
  ],
  ids=[
    'size-1-axes',
    'one-tuple',
    'trailing-nones',
    'size-1-axes-around',
    'only-size-1-axes',
    'order-of-axes',
    'swapped-dims',
    'another-dim',
    'sharded-or-not',
  ],
)
def test_same_placement_is_what_jax_says(a, b, ndim, same):
  from flax_dtensor._rules import _partition_specs

  mesh = many_axes.mesh()
  assert _partition_specs.same_placement(a, b, ndim, many_axes.SIZES) is same
  assert _partition_specs.same_placement(b, a, ndim, many_axes.SIZES) is same
  # JAX's own answer: the same devices hold the same blocks.
  jax_says = NamedSharding(mesh, a).is_equivalent_to(
    NamedSharding(mesh, b), ndim
  )
  assert jax_says is same


def _stacked_placed_without_unit_axes(wrong):
  """The stacked model built under the rules, then each array placed by its
  spec without the axes of size 1, except `wrong`: {path: spec}."""
  mesh = many_axes.mesh()
  with jax.set_mesh(mesh), fdt.logical_axis_rules(many_axes.RULES):
    model = many_axes.Stacked(nnx.Rngs(0))
  for name, spec in wrong.items():
    many_axes.place(getattr(model, name), mesh, spec)
  for name in many_axes.PARAMS:
    if name not in wrong:
      variable = getattr(model, name)
      raw = variable.get_value().sharding.spec
      many_axes.place(variable, mesh, many_axes.without_unit_axes(raw))
  return model, mesh


def test_placements_equal_but_for_axes_of_size_1_are_where_the_rules_say():
  model, mesh = _stacked_placed_without_unit_axes(
    {'wi': P('tensor', None, 'fsdp')}
  )
  plan = fdt.plan(model, mesh=mesh, rules=many_axes.RULES)
  assert [e.path for e in plan.entries] == list(many_axes.PARAMS)
  wo = plan['wo']
  # The raw spec stays on the entry; the array is placed without the axes
  # of size 1: the same devices hold the same blocks, as JAX says.
  assert wo.spec == P(
    ('tensor', 'tensor_transpose', 'tensor_sequence'),
    'stage',
    ('fsdp', 'sequence', 'context', 'expert'),
  )
  assert wo.placed == P('tensor', None, 'fsdp')
  assert model.wo.get_value().sharding.is_equivalent_to(
    NamedSharding(mesh, wo.spec), 3
  )
  assert wo.display_spec == wo.display_placed == P('tensor', None, 'fsdp')
  assert plan['final_norm'].display_spec == P('fsdp')
  # Only the one really placed elsewhere is misplaced, with its reason.
  assert [e.path for e in plan.entries if e.misplaced] == ['wi']
  assert plan['wi'].misplaced_reason.startswith('placed by other rules')
  assert not model.wi.get_value().sharding.is_equivalent_to(
    NamedSharding(mesh, plan['wi'].spec), 3
  )
  assert all(e.misplaced_reason is None for e in plan.entries if e.path != 'wi')
  text = plan.render(200)
  assert ' '.join(text.split()).startswith(
    'Sharding plan: mesh fsdp=2, tensor=4 (8 devices; size 1, not shown in '
    'specs: ' + ', '.join(many_axes.UNIT) + ')'
  )
  assert "P('fsdp', None, 'tensor') (placed P('tensor', None, 'fsdp'))" in text
  (row,) = [x for x in text.splitlines() if x.lstrip().startswith('wo ')]
  assert re.search(
    r"\('mlp', 'layers', 'embed'\) +P\('tensor', None, 'fsdp'\) +768 B$", row
  ), row
  assert 'Not where the rules say: 1 variable' in text
  for name in many_axes.UNIT:
    assert repr(name) not in text, name
  # The JSON keeps the raw spec, and reads back to the same verdicts.
  data = plan.to_dict()['variables'][many_axes.PARAMS.index('wo')]
  assert data['spec'] == [
    ['tensor', 'tensor_transpose', 'tensor_sequence'],
    'stage',
    ['fsdp', 'sequence', 'context', 'expert'],
  ]
  assert data['placed'] == ['tensor', None, 'fsdp']
  back = fdt.ShardingPlan.from_json(plan.to_json())
  assert [e.path for e in back.entries if e.misplaced] == ['wi']
  assert back.render(200) == text


def _on_three_meshes():
  """A factory of flax#5127's shape: each Param names its mesh (two of
  them halves of the devices) and its own `sharding_rules`."""
  import numpy as np

  devices = np.array(jax.devices())
  first = jax.sharding.Mesh(devices[:4].reshape(2, 2), ('a', 'b'))
  second = jax.sharding.Mesh(devices[4:], ('c',))
  third = jax.make_mesh((2, 2, 2), ('x', 'y', 'z'))

  class Model(nnx.Module):
    def __init__(self):
      self.p1 = nnx.Param(
        jnp.ones((16, 16)),
        out_sharding=('A', 'B'),
        mesh=first,
        sharding_rules=(('A', 'a'), ('B', 'b')),
      )
      self.p2 = nnx.Param(
        jnp.ones((16, 16)),
        out_sharding=('C', None),
        mesh=second,
        sharding_rules=(('C', 'c'),),
      )
      self.p3 = nnx.Param(
        jnp.ones((16, 16, 16)),
        out_sharding=('X', 'Y', 'Z'),
        mesh=third,
        sharding_rules=(('X', 'x'), ('Y', 'y'), ('Z', 'z')),
      )

  return Model


def test_a_variable_on_a_mesh_of_its_own_shows_its_size_1_axes():
  """The headline names the size-1 axes it hides for the plan's mesh only:
  a spec on a variable's own mesh is shown whole."""
  import numpy as np

  devices = np.array(jax.devices())
  own = jax.sharding.Mesh(devices[6:8].reshape(1, 2), ('data', 'model'))
  init = nnx.with_partitioning(
    nnx.initializers.lecun_normal(), ('embed', 'mlp'), mesh=own
  )
  with fdt.logical_axis_rules([('embed', 'data'), ('mlp', 'model')]):
    model = nnx.Linear(4, 8, kernel_init=init, use_bias=False, rngs=nnx.Rngs(0))
    plan = fdt.plan(model)
  assert model.kernel[...].sharding.spec == P('data', 'model')
  entry = plan['kernel']
  assert (entry.spec, entry.display_spec) == (P('data', 'model'),) * 2
  assert "P('data', 'model')" in plan.table().render(width=200)


@pytest.mark.parametrize('plan_mesh', ['none', 'another'])
def test_plan_over_several_meshes_names_each(plan_mesh):
  """Each variable's own mesh, its bytes per device there, the devices
  they span together; as data, in JSON and in the views."""
  mesh = (
    None if plan_mesh == 'none' else jax.make_mesh((2, 4), ('data', 'model'))
  )
  plan = fdt.plan(_on_three_meshes(), mesh=mesh)
  want = {
    'p1': ('a=2, b=2 (devices 0-3)', {'a': 2, 'b': 2}, P('a', 'b'), 4),
    'p2': ('c=4 (devices 4-7)', {'c': 4}, P('c', None), 4),
    'p3': (
      'x=2, y=2, z=2 (devices 0-7)',
      {'x': 2, 'y': 2, 'z': 2},
      P('x', 'y', 'z'),
      8,
    ),
  }
  for path, (label, axes, spec, split) in want.items():
    entry = plan[path]
    assert (entry.mesh, entry.mesh_axes, entry.spec) == (label, axes, spec)
    assert entry.bytes_per_device == entry.bytes // split, path
  assert plan.num_devices == 8
  back = fdt.ShardingPlan.from_json(plan.to_json())
  assert [(e.mesh, e.mesh_axes) for e in back.entries] == [
    (e.mesh, e.mesh_axes) for e in plan.entries
  ]
  assert back.to_dict() == plan.to_dict()
  text = plan.table().render(width=200)
  assert ' mesh ' in text.splitlines()[3]  # The column's header.
  for label, *_ in want.values():
    assert label in text
    assert label in plan.to_html()
  head = text.splitlines()[0]
  if mesh is None:
    assert head.startswith('Sharding plan: 3 meshes named by the variables')
  else:
    assert head.startswith(
      'Sharding plan: mesh data=2, model=4 (8 devices), and 3 more meshes'
    )


def test_plan_on_one_mesh_shows_no_mesh_column():
  init = nnx.with_partitioning(nnx.initializers.ones, ('embed', 'mlp'))
  plan = fdt.plan(
    lambda: nnx.Linear(8, 16, kernel_init=init, rngs=nnx.Rngs(0)),
    mesh=MESH,
    rules=RULES,
  )
  assert all(e.mesh is None for e in plan.entries)
  assert 'mesh' not in plan.to_dict()['variables'][0]
  header = plan.table().render(width=200).splitlines()[3]
  assert 'spec' in header and ' mesh ' not in header
