"""A model nobody wrote for flax_dtensor, sharded entirely by path rules.

`unannotated_model.DecoderLM` carries no sharding metadata at all. Under
path rules, every API gives each variable the same placement: the plan,
``nnx.get_partition_spec`` (and ``get_named_sharding``, ``eval_shape``),
eager construction, `fdt.init`, `fdt.shard_module` (and restores, in
dtensor_export_test.py); on Explicit, Auto and mixed meshes. Placements
are checked by each array's spec and by the values of its shards.
"""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P
from support import creation_values
from support import unannotated_model as um

import flax_dtensor as fdt
from flax_dtensor._placement import _init
from flax_dtensor._rules import _partition_specs

RULES = fdt.LogicalRules(um.LOGICAL_RULES, path_rules=um.PATH_RULES)
ABSTRACT = AbstractMesh((2, 4), ('data', 'model'))
MIN_BYTES = 4096  # The model's smallest kernel is 16 KiB, its biases < 4 KiB.


def _flat(tree):
  return {'/'.join(map(str, p)): v for p, v in nnx.to_flat_state(tree)}


def _canonical(spec, ndim):
  return _partition_specs.canonical(spec, ndim)


def _check_shards_by_value(array):
  """Every shard holds exactly its block of the whole array."""
  whole = np.asarray(array)
  for shard in array.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), whole[shard.index])


def test_the_plan_shows_a_path_rule_for_every_large_variable():
  plan = fdt.plan(um.make_model, mesh=ABSTRACT, rules=RULES)
  large = [e for e in plan.entries if e.bytes >= MIN_BYTES]
  assert len(large) == 2 + um.LAYERS * 6
  for e in large:
    assert e.source.startswith('path rule #'), (e.path, e.source)
    assert e.bytes_per_device == e.bytes // 8, e.path
  assert plan['layers/1/attn/query/kernel'].source == (
    "path rule #1 'attn/(query|key|value)/kernel$'"
  )
  assert plan['layers/1/attn/query/kernel'].spec == P('data', 'model', None)
  assert plan['embed/embedding'].logical_axes == ('vocab', 'embed')
  small = [e for e in plan.entries if e.bytes < MIN_BYTES]
  assert {e.source for e in small} == {'none (replicated)'}
  assert not fdt.check(um.make_model, RULES, ABSTRACT, min_bytes=MIN_BYTES)
  # The table shows the source, the JSON keeps it.
  lines = [line.strip() for line in plan.render(200).splitlines()]
  header = next(line for line in lines if line.startswith('path'))
  assert header.split()[-3:] == ['source', 'per', 'device']
  row = next(line for line in lines if line.startswith('head/kernel'))
  assert "path rule #5 'head/kernel$'" in row
  again = fdt.ShardingPlan.from_json(plan.to_json())
  assert again['head/kernel'].source == "path rule #5 'head/kernel$'"


def test_a_typo_in_a_pattern_is_found():
  typo = [*um.PATH_RULES]
  typo[3] = (r'mlp/upp/kernel$', typo[3][1])
  report = fdt.check(
    um.make_model,
    RULES.replace(path_rules=typo),
    ABSTRACT,
    min_bytes=MIN_BYTES,
  )
  assert report.codes() == ('unmatched-path-rule', 'unannotated-replicated')
  unmatched = report.findings[0]
  assert unmatched.subject == "path rule #3 'mlp/upp/kernel$'"
  assert 'matches no variable path' in unmatched.message
  replicated = [f for f in report.findings[1:]]
  assert [f.subject for f in replicated] == [
    'layers/0/mlp/up/kernel',
    'layers/1/mlp/up/kernel',
  ]
  assert (
    r"such as (r'layers/\d+/mlp/up/kernel$', P(...))" in replicated[0].message
  )
  assert "dim 0 (64) by 'data', 'model'" in replicated[0].message


def test_shadowed_path_rules_are_found():
  annotated = nnx.with_partitioning(nnx.initializers.ones, ('embed', 'mlp'))

  def factory():
    return nnx.Linear(64, 256, kernel_init=annotated, rngs=nnx.Rngs(0))

  rules = fdt.LogicalRules(
    um.LOGICAL_RULES,
    path_rules=[
      ('bias$', P('model')),
      (r'b\w+$', P('data')),  # Takes nothing 'bias$' has not taken.
      ('kernel$', P('model', 'data')),  # Loses to the annotation.
    ],
  )
  report = fdt.check(
    factory, rules, ABSTRACT, min_bytes=1, allow=['unused-rule']
  )
  assert [(f.code, f.subject) for f in report.findings] == [
    ('shadowed-path-rule', r"path rule #1 'b\\w+$'"),
    ('shadowed-path-rule', "path rule #2 'kernel$'"),
  ]
  assert "e.g. 'bias' by path rule #0 'bias$'" in report.findings[0].message
  assert 'win unless the rule says override=True' in report.findings[1].message
  forced = rules.replace(
    path_rules=[
      rules.path_rules[0],
      fdt.PathRule('kernel$', P('model', 'data'), override=True),
    ]
  )
  assert not fdt.check(
    factory, forced, ABSTRACT, min_bytes=1, allow=['unused-rule']
  )
  assert fdt.plan(factory, mesh=ABSTRACT, rules=forced)['kernel'].spec == P(
    'model', 'data'
  )


MESHES = {
  'explicit': (AxisType.Explicit, AxisType.Explicit),
  'auto': (AxisType.Auto, AxisType.Auto),
  'mixed': (AxisType.Explicit, AxisType.Auto),
}


@pytest.mark.parametrize(
  'mesh_name, factory',
  [
    ('explicit', um.make_small),
    ('auto', um.make_small),
    ('mixed', um.make_small),
    ('auto', um.make_stacked),
  ],
  ids=['explicit', 'auto', 'mixed', 'auto-stacked'],
)
def test_plan_partition_spec_and_placement_agree(mesh_name, factory):
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=MESHES[mesh_name])
  plan = fdt.plan(factory, mesh=mesh, rules=RULES)
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    eager = factory()
    specs = _flat(nnx.get_partition_spec(nnx.state(eager)))
    named = _flat(nnx.get_named_sharding(nnx.state(eager), mesh))
    abstract = _flat(nnx.state(nnx.eval_shape(factory)))
  before = dict(_init.builds)
  built = fdt.init(factory, mesh=mesh, rules=RULES)
  assert _init.builds['traced'] == before.get('traced', 0) + 1
  eager_state, built_state = _flat(nnx.state(eager)), _flat(nnx.state(built))
  assert set(eager_state) == set(built_state) == {e.path for e in plan.entries}
  sharded = 0
  for path, variable in eager_state.items():
    value, again = variable[...], built_state[path][...]
    n = value.ndim
    want = _canonical(plan[path].spec, n)
    assert _canonical(value.sharding.spec, n) == want, path
    assert _canonical(again.sharding.spec, n) == want, path
    assert _canonical(specs[path].get_value(), n) == want, path
    assert _canonical(named[path].get_value().spec, n) == want, path
    assert _canonical(abstract[path].get_value().sharding.spec, n) == want, path
    assert value.sharding.mesh == again.sharding.mesh == mesh
    # fdt.init builds the same values (compiled otherwise: within the
    # bound), in the same blocks.
    creation_values.assert_close(again, np.asarray(value), err_msg=str(path))
    _check_shards_by_value(again)
    sharded += any(want)
  assert sharded == 2 + 6  # One block, or the stacked blocks.


def _reference_logits(factory, tokens):
  with nnx.use_eager_sharding(False):
    return np.asarray(nnx.jit(lambda m, t: m(t))(factory(), tokens))


MIXED_RULES = RULES.replace(unknown='replicate').prepend([('embed', None)])


@pytest.mark.parametrize(
  'mesh_name, factory',
  [
    ('auto', um.make_small),
    ('auto', um.make_stacked),
    ('mixed', um.make_small),
  ],
  ids=['auto', 'auto-stacked', 'mixed'],
)
def test_the_path_ruled_model_runs_and_computes_the_same(mesh_name, factory):
  """A forward pass under jit. (On an all-Explicit mesh JAX refuses the
  sharded embedding's gather; with 'embed' on the mixed mesh's Explicit
  axis it refuses the contraction: the rules keep 'embed' whole there.)"""
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=MESHES[mesh_name])
  rules = MIXED_RULES if mesh_name == 'mixed' else RULES
  tokens = um.tokens()
  with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
    model = factory()
  head = model.head.kernel[...]
  assert head.sharding.spec == (
    P(None, 'model') if mesh_name == 'mixed' else P('data', 'model')
  )
  with jax.set_mesh(mesh):
    logits = nnx.jit(lambda m, t: m(t))(model, tokens)
  np.testing.assert_allclose(
    np.asarray(logits),
    _reference_logits(factory, tokens),
    rtol=2e-5,
    atol=2e-5,
  )


def test_shard_module_places_a_model_built_without_a_mesh(auto_mesh):
  with nnx.use_eager_sharding(False):
    model = um.make_model()
  kernel = model.layers[0].mlp.up.kernel[...]
  assert kernel.sharding.num_devices == 1
  fdt.shard_module(model, mesh=auto_mesh, rules=RULES)
  plan = fdt.plan(model, mesh=auto_mesh, rules=RULES)
  covered = 0
  for path, variable in _flat(nnx.state(model)).items():
    value = variable[...]
    if not plan[path].source.startswith('path rule'):
      # Replicated on the mesh, as the plan says.
      assert value.sharding.mesh == auto_mesh, path
      assert not any(value.sharding.spec), path
      assert plan[path].spec == P(*(None,) * value.ndim), path
      continue
    covered += 1
    want = _canonical(plan[path].spec, value.ndim)
    assert _canonical(value.sharding.spec, value.ndim) == want, path
    assert not plan[path].misplaced
  assert covered == 2 + um.LAYERS * 6
  moved = model.layers[0].mlp.up.kernel[...]
  assert moved.sharding.spec == P('data', 'model')
  np.testing.assert_array_equal(np.asarray(moved), np.asarray(kernel))
  _check_shards_by_value(moved)


def test_eager_placement_happens_when_the_outermost_constructor_returns(
  explicit_mesh,
):
  seen = {}

  class Outer(nnx.Module):
    def __init__(self, rngs):
      self.mlp = um.Mlp(rngs)
      # The inner constructor has returned: nothing is placed yet.
      seen['inside'] = self.mlp.up.kernel[...].sharding.spec

  with jax.set_mesh(explicit_mesh), fdt.logical_axis_rules(RULES):
    outer = Outer(nnx.Rngs(0))
    # Outermost itself: its paths are 'up/kernel', ..., which the rules'
    # 'mlp/up/kernel$' does not match.
    alone = um.Mlp(nnx.Rngs(0))
  assert not any(seen['inside'])  # Replicated, as Flax created it.
  assert outer.mlp.up.kernel[...].sharding.spec == P('data', 'model')
  assert outer.mlp.down.kernel[...].sharding.spec == P('model', 'data')
  assert not any(alone.up.kernel[...].sharding.spec)
  assert fdt.plan(alone, rules=RULES)['up/kernel'].source == (
    'none (replicated)'
  )
  np.testing.assert_array_equal(
    np.asarray(outer.mlp.up.kernel[...]), np.asarray(alone.up.kernel[...])
  )
  _check_shards_by_value(outer.mlp.up.kernel[...])
  # Eager sharding off: nothing moves (as for annotated variables).
  with (
    jax.set_mesh(explicit_mesh),
    fdt.logical_axis_rules(RULES),
    nnx.use_eager_sharding(False),
  ):
    untouched = um.Mlp(nnx.Rngs(0))
  assert not any(untouched.up.kernel[...].sharding.spec)


def test_rules_without_path_rules_leave_construction_alone(explicit_mesh):
  with jax.set_mesh(explicit_mesh), fdt.logical_axis_rules(um.LOGICAL_RULES):
    model = um.Mlp(nnx.Rngs(0))
  assert not any(model.up.kernel[...].sharding.spec)
  plan = fdt.plan(model, rules=um.LOGICAL_RULES)
  assert plan['up/kernel'].source == 'none (replicated)'


def test_an_orbax_checkpoint_restores_by_path_rules(auto_mesh, tmp_path):
  """The restore behind `flax-dtensor export`: an Orbax checkpoint of the
  unsharded model, read into its path-ruled placement."""
  ocp = pytest.importorskip('orbax.checkpoint')
  from flax_dtensor.dtensor._checkpoints import _orbax

  with nnx.use_eager_sharding(False):
    saved = um.make_small()
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / 'state', nnx.state(saved))
    checkpointer.wait_until_finished()
  abstract = nnx.eval_shape(um.make_small)
  restored = _orbax.restore(tmp_path / 'state', abstract, auto_mesh, RULES)
  plan = fdt.plan(um.make_small, mesh=auto_mesh, rules=RULES)
  want, got = _flat(nnx.state(saved)), _flat(nnx.state(restored))
  for path, variable in got.items():
    value = variable[...]
    np.testing.assert_array_equal(
      np.asarray(value), np.asarray(want[path][...])
    )
    n = value.ndim
    assert _canonical(value.sharding.spec, n) == _canonical(
      plan[path].spec, n
    ), path
  assert restored.head.kernel[...].sharding.spec == P('data', 'model')
