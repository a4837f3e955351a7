"""A second `fdt.init` of a model of many variables is one compiled call.

The first build of a configuration records how each variable was made
(`_placement/_replay.py`); a second call computes them all in one program,
rebuilds the module and advances the caller's `nnx.Rngs` as the factory
does. Checked by values against an unsharded eager build of the same seed
(`creation_values`), on each kind of mesh; builds the replay would get
wrong are built as before.
"""

import collections
import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from support import creation_values

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


# Every spelling of a factory
# ------------------------------------------------------------------------------


class Wide(nnx.Module):
  """`SMALL` arrays: annotated kernels and plain zero biases, of `width`."""

  def __init__(self, rngs, width=8):
    kernel = nnx.with_partitioning(
      nnx.initializers.lecun_normal(), ('embed', 'mlp')
    )
    self.layers = nnx.List(
      [
        nnx.Linear(width, width, kernel_init=kernel, rngs=rngs)
        for _ in range(SMALL // 2)
      ]
    )


def _with_optimizer(seed, width):
  """A factory building the model and its `nnx.Optimizer` (mu, nu, counts)."""

  def make():
    model = Wide(nnx.Rngs(seed), width=width)
    return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

  return make, (), {}


# Each: (seed, width) -> the factory, its positional and keyword arguments.
SPELLINGS = {
  'Rngs made inside': lambda seed, width: (
    lambda: Wide(nnx.Rngs(seed), width=width),
    (),
    {},
  ),
  'Rngs passed in': lambda seed, width: (
    lambda rngs: Wide(rngs, width=width),
    (nnx.Rngs(seed),),
    {},
  ),
  'keyword arguments': lambda seed, width: (
    Wide,
    (),
    {'rngs': nnx.Rngs(seed), 'width': width},
  ),
  'positional size': lambda seed, width: (Wide, (nnx.Rngs(seed), width), {}),
  'functools.partial': lambda seed, width: (
    functools.partial(Wide, width=width),
    (nnx.Rngs(seed),),
    {},
  ),
  'with its optimizer': _with_optimizer,
}


def _spelled(spelling, seed, width, mesh):
  factory, args, kwargs = SPELLINGS[spelling](seed, width)
  return fdt.init(factory, *args, mesh=mesh, rules=RULES, **kwargs)


def _eager(spelling, seed, width):
  """The same spelling built eagerly by Flax alone, unsharded."""
  factory, args, kwargs = SPELLINGS[spelling](seed, width)
  with nnx.use_eager_sharding(False):
    return factory(*args, **kwargs)


def _assert_same(ours, theirs, where):
  a, b = jax.tree.leaves(nnx.state(ours)), jax.tree.leaves(nnx.state(theirs))
  assert len(a) == len(b) >= SMALL, where
  for i, (x, y) in enumerate(zip(a, b, strict=True)):
    assert x.shape == y.shape, f'{where} #{i}'
    creation_values.assert_close(
      _data(x), np.asarray(_data(y)), err_msg=f'{where} #{i}'
    )


def _kernel(built):
  model = built[0] if isinstance(built, tuple) else built
  return np.asarray(model.layers[1].kernel[...])


@pytest.mark.parametrize('spelling', list(SPELLINGS))
def test_every_spelling_of_a_factory_is_replayed_and_never_stale(spelling):
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  before = collections.Counter(_init.builds)
  first = _spelled(spelling, 0, 8, mesh)
  second = _spelled(spelling, 0, 8, mesh)
  took = collections.Counter(_init.builds)
  took.subtract(before)
  assert +took == {'in_shards': 1, 'replayed': 1}, spelling
  _assert_same(first, _eager(spelling, 0, 8), 'first')
  _assert_same(second, _eager(spelling, 0, 8), 'second')
  model = second[0] if isinstance(second, tuple) else second
  assert model.layers[0].kernel.sharding.spec == P('data', 'model')
  # Another seed: its own values (a new build where the seed is compiled
  # in, the same build where it is passed), never the first's.
  seed_1 = _spelled(spelling, 1, 8, mesh)
  _assert_same(seed_1, _eager(spelling, 1, 8), 'seed 1')
  assert not np.array_equal(_kernel(seed_1), _kernel(first))
  # Another size: a new build.
  in_shards = _init.builds['in_shards']
  wider = _spelled(spelling, 0, 16, mesh)
  assert _init.builds['in_shards'] == in_shards + 1
  _assert_same(wider, _eager(spelling, 0, 16), 'width 16')
  # And the first configuration again: its values, replayed.
  replayed = _init.builds['replayed']
  again = _spelled(spelling, 0, 8, mesh)
  assert _init.builds['replayed'] == replayed + 1
  _assert_same(again, _eager(spelling, 0, 8), 'seed 0 again')
