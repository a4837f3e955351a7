"""Path-ruled variables created in their shards, by creation order.

Models built in several styles (nnx.List, nnx.Dict, loops, shared modules,
nnx.vmap-stacked layers) under path rules, eagerly and with `fdt.init`:
every variable is where the plan and ``nnx.get_partition_spec`` say, its
values equal an unsharded build of the same seed bit for bit, and the plan
says how each was created. A constructor whose second build differs from
the abstract one is detected and never misplaced.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AxisType
from support import creation_values

import flax_dtensor as fdt
from flax_dtensor._placement import _creation, _creation_order, _init

RULES = fdt.LogicalRules(
  [('embed', 'data'), ('mlp', 'model')],
  path_rules=[
    (r'(up|a|shared)/kernel$', ('embed', 'mlp')),
    (r'(down|b)/kernel$', ('mlp', 'embed')),
    (r'stacked/kernel$', (..., 'embed', 'mlp')),
    (r'table/embedding$', ('mlp', 'embed')),
  ],
)


def _mesh(kind='explicit'):
  types = {'auto': AxisType.Auto, 'explicit': AxisType.Explicit}[kind]
  return jax.make_mesh((2, 4), ('data', 'model'), axis_types=(types,) * 2)


class Block(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(16, 64, rngs=rngs)
    self.down = nnx.Linear(64, 16, rngs=rngs)


class InAList(nnx.Module):
  def __init__(self, rngs):
    self.blocks = nnx.List([Block(rngs) for _ in range(3)])


class InADict(nnx.Module):
  def __init__(self, rngs):
    self.layers = nnx.Dict(
      {'first': Block(rngs), 'second': Block(rngs), 'third': Block(rngs)}
    )


class InALoop(nnx.Module):
  def __init__(self, rngs):
    for i in range(3):
      setattr(self, f'block{i}', Block(rngs))
    self.table = nnx.Embed(64, 16, rngs=rngs)


class Shared(nnx.Module):
  def __init__(self, rngs):
    shared = nnx.Linear(16, 64, rngs=rngs)
    self.shared = shared
    self.again = shared  # The same module at a second path.
    self.down = nnx.Linear(64, 16, rngs=rngs)


class Stacked(nnx.Module):
  def __init__(self, rngs):
    @nnx.split_rngs(splits=4)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return nnx.Linear(16, 64, rngs=rngs)

    self.stacked = create(rngs)
    self.down = nnx.Linear(64, 16, rngs=rngs)


STYLES = [InAList, InADict, InALoop, Shared, Stacked]


def _flat(model):
  return {
    '/'.join(map(str, path)): v
    for path, v in nnx.to_flat_state(nnx.state(model))
  }


def _padded(spec, ndim):
  return (*spec, *[None] * (ndim - len(spec)))


def _unsharded(cls):
  with nnx.use_eager_sharding(False):
    return cls(nnx.Rngs(0))


def _assert_as_planned(model, mesh):
  plan = fdt.plan(model, mesh=mesh, rules=RULES)
  with fdt.logical_axis_rules(RULES):
    queried = _flat(nnx.get_partition_spec(nnx.state(model)))
  reference = _flat(_unsharded(type(model)))
  for path, variable in _flat(model).items():
    value = variable.get_value()
    entry = plan[path]
    assert not entry.misplaced, path
    specs = (value.sharding.spec, entry.spec, queried[path].get_value())
    assert len({_padded(s, value.ndim) for s in specs}) == 1, (path, specs)
    creation_values.assert_close(
      value, reference[path].get_value(), err_msg=path
    )
  return plan


@pytest.mark.parametrize('kind', ['explicit', 'auto'])
@pytest.mark.parametrize('cls', STYLES, ids=lambda c: c.__name__)
def test_eager_creation_places_every_style_as_planned(cls, kind):
  mesh = _mesh(kind)
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    model = cls(nnx.Rngs(0))
  plan = _assert_as_planned(model, mesh)
  ruled = [e for e in plan.entries if e.source.startswith('path rule')]
  assert ruled
  for e in ruled:
    if cls is Stacked and e.path.startswith('stacked/'):
      # Built inside nnx.vmap: moved when the constructor returned.
      assert e.creation.startswith('moved when the outermost constructor'), e
      assert 'inside a transform such as nnx.vmap' in e.creation
    else:
      assert e.creation == _creation_order.IN_SHARDS, e


@pytest.mark.parametrize('cls', STYLES, ids=lambda c: c.__name__)
def test_init_builds_every_style_as_planned(cls):
  mesh = _mesh()
  before = dict(_init.builds)
  model = fdt.init(cls, nnx.Rngs(0), mesh=mesh, rules=RULES)
  _assert_as_planned(model, mesh)
  took = {k: _init.builds[k] - before.get(k, 0) for k in _init.builds}
  # Built inside nnx.vmap, the stacked kernel cannot be computed in its
  # shards eagerly: the traced build takes it. The others, eagerly.
  expected = 'traced' if cls is Stacked else 'in_shards'
  assert took.get(expected) == 1, took


def test_leaf_modules_compile_once_per_distinct_leaf():
  mesh = _mesh()
  _creation.clear_caches()
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    InAList(nnx.Rngs(0))
    InAList(nnx.Rngs(1))
  # Block's 'up' and 'down' Linear: two programs for six leaves, twice.
  assert len(_creation.leaves._data) == 2


class Flaky(nnx.Module):
  """Builds in another order each time it is constructed."""

  builds = 0

  def __init__(self, rngs):
    Flaky.builds += 1
    if Flaky.builds % 2:
      self.a = nnx.Linear(16, 64, rngs=rngs)
      self.b = nnx.Embed(64, 16, rngs=rngs)
    else:
      self.b = nnx.Embed(64, 16, rngs=rngs)
      self.a = nnx.Linear(16, 64, rngs=rngs)


class Growing(nnx.Module):
  """A leaf whose size differs each time it is constructed."""

  builds = 0

  def __init__(self, rngs):
    Growing.builds += 1
    self.a = nnx.Linear(16, 32 * (Growing.builds % 2 + 1), rngs=rngs)


@pytest.mark.parametrize(
  'cls, reason',
  [
    (
      Flaky,
      'the construction order differed from the abstract build at '
      'module #1 (Embed, expected Linear)',
    ),
    (
      Growing,
      'Linear at a made variables bias float32[32], kernel '
      'float32[16, 32], where the abstract build made bias float32[64]',
    ),
  ],
  ids=['order', 'shape'],
)
def test_a_build_unlike_the_abstract_one_is_detected(cls, reason):
  cls.builds = 0
  mesh = _mesh()
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    model = cls(nnx.Rngs(0))
  plan = fdt.plan(model, mesh=mesh, rules=RULES)
  entry = plan['a/kernel']
  assert entry.source.startswith('path rule')
  assert not entry.misplaced
  assert model.a.kernel.get_value().sharding.spec == entry.spec
  if cls is Flaky:
    assert entry.creation == (
      f'moved when the outermost constructor returned: {reason}'
    )
    assert 'Created, then moved: 1 variable' in plan.render(200)
  else:  # Built in shards as predicted; its placement fit its path.
    assert entry.creation.startswith(
      'in its shards as the abstract build predicted them, checked against '
      f'its path when the outermost constructor returned: {reason}'
    )
  # fdt.init, which needs every kernel in its shards, takes the traced build.
  cls.builds = 0
  before = _init.builds['traced']
  fdt.init(cls, nnx.Rngs(0), mesh=mesh, rules=RULES)
  assert _init.builds['traced'] == before + 1
  assert reason.startswith(('the construction', 'Linear'))


def test_a_users_initializer_runs_as_written_then_moves():
  calls = []

  def mine(key, shape, dtype=jnp.float32):
    calls.append(shape)
    return jax.random.normal(key, shape, dtype)

  class Custom(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(16, 64, kernel_init=mine, rngs=rngs)

  mesh = _mesh()
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    model = Custom(nnx.Rngs(0))
  assert calls == [(16, 64), (16, 64)]  # The abstract build, then this one.
  entry = fdt.plan(model, mesh=mesh, rules=RULES)['up/kernel']
  assert model.up.kernel.get_value().sharding.spec == entry.spec
  assert entry.creation.startswith("moved when Linear's constructor returned")
  assert 'a function of your own' in entry.creation
