"""A second `fdt.init` of a model of many variables is one compiled call.

The first build of a configuration records how each variable was made
(`_placement/_replay.py`); a second call computes them all in one program,
rebuilds the module and advances the caller's `nnx.Rngs` as the factory
does. Checked by values against an unsharded eager build of the same seed
(`creation_values`), on each kind of mesh; builds the replay would get
wrong are built as before.
"""

import creation_values
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import flax_dtensor as fdt
from flax_dtensor._placement import _init, _replay

RULES = [('embed', 'data'), ('mlp', 'model')]
# The tests lower the threshold (`MIN_ARRAYS`, 64) to this, so that each
# replay's program is quick to compile: the logic is the same.
SMALL = 12
BLOCKS = SMALL // 4  # Two Linear layers, two arrays each.


class Block(nnx.Module):
  """Annotated kernels from Flax's initializers; unannotated zero biases."""

  def __init__(self, rngs, dropout=False):
    kernel = nnx.with_partitioning(
      nnx.initializers.lecun_normal(), ('embed', 'mlp')
    )
    back = nnx.with_partitioning(
      nnx.initializers.lecun_normal(), ('mlp', 'embed')
    )
    self.up = nnx.Linear(8, 16, kernel_init=kernel, rngs=rngs)
    self.down = nnx.Linear(16, 8, kernel_init=back, rngs=rngs)
    # A Dropout forks the caller's stream: a stream of its own, whose key
    # is a draw (from the factory traced in the replay's program).
    self.drop = nnx.Dropout(0.1, rngs=rngs) if dropout else None


class Stack(nnx.Module):
  def __init__(self, rngs, blocks=BLOCKS, dropout=False):
    self.blocks = nnx.List([Block(rngs, dropout) for _ in range(blocks)])


class Keeper(Stack):
  """A model keeping the caller's own `nnx.Rngs`: a node of the arguments."""

  def __init__(self, rngs):
    super().__init__(rngs)
    self.rngs = rngs


def make(rngs):
  return Stack(rngs)


def _unsharded(factory, seed):
  """The same model built eagerly with no sharding, and its Rngs after."""
  rngs = nnx.Rngs(seed)
  with nnx.use_eager_sharding(False):
    return factory(rngs), rngs


def _data(x):
  """A typed key's data; any other array as it is."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(x)
  return x


def _assert_values(model, expected, where, arrays=SMALL):
  ours = jax.tree.leaves(nnx.state(model))
  theirs = jax.tree.leaves(nnx.state(expected))
  assert len(ours) == len(theirs) == arrays
  for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
    creation_values.assert_close(
      _data(a), np.asarray(_data(b)), err_msg=f'{where} #{i}'
    )


@pytest.fixture(autouse=True)
def empty_cache(monkeypatch):
  monkeypatch.setattr(_replay, 'MIN_ARRAYS', SMALL)
  fdt.clear_init_cache()
  yield
  fdt.clear_init_cache()


MESHES = {
  'make_mesh default (Explicit)': {},
  'Auto': {'axis_types': (AxisType.Auto,) * 2},
  'mixed': {'axis_types': (AxisType.Explicit, AxisType.Auto)},
}


@pytest.mark.parametrize('kind', list(MESHES))
def test_a_second_build_is_one_call_with_the_first_builds_values(kind):
  mesh = jax.make_mesh((2, 4), ('data', 'model'), **MESHES[kind])
  before = dict(_init.builds)
  first = fdt.init(make, nnx.Rngs(0), mesh=mesh, rules=RULES)
  rngs = nnx.Rngs(0)
  second = fdt.init(make, rngs, mesh=mesh, rules=RULES)
  took = {k: _init.builds[k] - before.get(k, 0) for k in _init.builds}
  assert {k: v for k, v in took.items() if v} == {
    'in_shards': 1,
    'replayed': 1,
  }
  expected, expected_rngs = _unsharded(make, 0)
  _assert_values(first, expected, 'first')
  _assert_values(second, expected, 'second')
  # The same placement as the first build's, on the caller's mesh.
  for a, b in zip(
    jax.tree.leaves(nnx.state(first)),
    jax.tree.leaves(nnx.state(second)),
    strict=True,
  ):
    assert a.sharding == b.sharding
  assert second.blocks[0].up.kernel.sharding.mesh == mesh
  assert second.blocks[0].up.kernel.sharding.spec == P('data', 'model')
  # The caller's stream advanced as the factory's draws advance it.
  assert int(rngs.params.count[...]) == int(expected_rngs.params.count[...])
  np.testing.assert_array_equal(
    jax.random.key_data(rngs.params()),
    jax.random.key_data(expected_rngs.params()),
  )
  # A module of its own: a new graph, its variables new objects.
  assert second is not first
  assert second.blocks[0].up.kernel is not first.blocks[0].up.kernel
  assert isinstance(second.blocks[0].up.kernel, nnx.Param)


def test_a_changed_seed_is_a_changed_value_not_a_new_build():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  fdt.init(make, nnx.Rngs(0), mesh=mesh, rules=RULES)
  before = dict(_init.builds)
  other = fdt.init(make, nnx.Rngs(7), mesh=mesh, rules=RULES)
  assert _init.builds['replayed'] == before.get('replayed', 0) + 1
  assert _init.builds['in_shards'] == before.get('in_shards', 0)
  expected, _ = _unsharded(make, 7)
  _assert_values(other, expected, 'seed 7')
  seed_0, _ = _unsharded(make, 0)
  assert not np.array_equal(
    np.asarray(other.blocks[2].up.kernel[...]),
    np.asarray(seed_0.blocks[2].up.kernel[...]),
  )


def test_a_stream_drawn_before_the_build_draws_on_from_where_it_is():
  """Counts are read at each call: a stream already used gives the draws
  an eager build from that point gives."""
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  fdt.init(make, nnx.Rngs(0), mesh=mesh, rules=RULES)
  rngs = nnx.Rngs(3)
  rngs.params()
  rngs.params()
  model = fdt.init(make, rngs, mesh=mesh, rules=RULES)
  expected_rngs = nnx.Rngs(3)
  expected_rngs.params()
  expected_rngs.params()
  with nnx.use_eager_sharding(False):
    expected = make(expected_rngs)
  _assert_values(model, expected, 'drawn twice before')
  assert int(rngs.params.count[...]) == int(expected_rngs.params.count[...])


def test_a_model_with_streams_of_its_own_replays_them():
  """Dropout layers fork the caller's stream: their keys are draws too."""
  mesh = jax.make_mesh((2, 4), ('data', 'model'))

  def factory(rngs):
    return Stack(rngs, dropout=True)

  fdt.init(factory, nnx.Rngs(0), mesh=mesh, rules=RULES)
  before = _init.builds['replayed']
  rngs = nnx.Rngs(5)
  model = fdt.init(factory, rngs, mesh=mesh, rules=RULES)
  assert _init.builds['replayed'] == before + 1
  expected, expected_rngs = _unsharded(factory, 5)
  # Per block: 4 Linear arrays and the Dropout stream's key and count.
  _assert_values(model, expected, 'seed 5', arrays=6 * BLOCKS)
  assert int(rngs.default.count[...]) == int(expected_rngs.default.count[...])


@pytest.mark.parametrize(
  'factory, why',
  [
    (Keeper, "holds the caller's Rngs"),
    (lambda rngs: Stack(rngs, blocks=BLOCKS - 1), f'under {SMALL} arrays'),
  ],
  ids=['shares a node', 'few arrays'],
)
def test_builds_a_replay_would_get_wrong_are_built_as_before(factory, why):
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  fdt.init(factory, nnx.Rngs(0), mesh=mesh, rules=RULES)
  before = dict(_init.builds)
  rngs = nnx.Rngs(0)
  model = fdt.init(factory, rngs, mesh=mesh, rules=RULES)
  assert _init.builds['replayed'] == before.get('replayed', 0), why
  assert _init.builds['reused'] == before.get('reused', 0) + 1, why
  expected, _ = _unsharded(factory, 0)
  for i, (a, b) in enumerate(
    zip(
      jax.tree.leaves(nnx.state(model)),
      jax.tree.leaves(nnx.state(expected)),
      strict=True,
    )
  ):
    creation_values.assert_close(
      _data(a), np.asarray(_data(b)), err_msg=f'#{i}'
    )
  if factory is Keeper:
    assert model.rngs is rngs  # The caller's own, as an eager build holds.
