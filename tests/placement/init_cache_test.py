"""`fdt.init` compiles once per model configuration, and never reuses a
wrong build.

A second call with the same factory, compiled-in arguments, mesh, rules
and input shapes runs the first call's compiled build (`_init.builds`
counts compiles and reuses). Anything that changes what the build computes
(a rule, the mesh, the factory's code, a closure's value, a global its
code names, an argument, the seed passed or compiled in) compiles anew,
and the values are checked against a fresh build's. The cache holds no
array or module of the caller's, and `fdt.clear_init_cache` empties it.
"""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import flax_dtensor as fdt
from flax_dtensor._placement import _calls, _init, _init_cache

RULES = fdt.LogicalRules([('embed', 'data'), ('mlp', 'model')])
OTHER_RULES = fdt.LogicalRules([('embed', 'model'), ('mlp', 'data')])
LAYERS = 3


def _user_init(key, shape, dtype=jnp.float32):
  """A user's initializer: `init` cannot know it is pure, so it traces."""
  return jax.random.normal(key, shape, dtype) * 0.1


class Block(nnx.Module):
  """One layer of a user's initializer: a traced build, quick to compile."""

  def __init__(self, width, rngs):
    init = nnx.with_partitioning(_user_init, ('embed', 'mlp'))
    self.up = nnx.Linear(width, 2 * width, kernel_init=init, rngs=rngs)


class Stack(nnx.Module):
  """`LAYERS` blocks stacked by `nnx.vmap`: the traced build's kind."""

  def __init__(self, width, rngs):
    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(
      in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None}
    )
    def make(rngs):
      return Block(width, rngs)

    self.blocks = make(rngs)


@pytest.fixture
def mesh():
  return jax.make_mesh((2, 4), ('data', 'model'))


@pytest.fixture(autouse=True)
def empty_cache():
  fdt.clear_init_cache()
  yield
  fdt.clear_init_cache()


def _counts():
  return _init.builds['compiled'], _init.builds['reused']


def _kernel(model):
  layer = model.blocks.up if isinstance(model, Stack) else model.up
  return np.asarray(layer.kernel[...])


def _fresh(*args, **kwargs):
  """A build with nothing reused."""
  fdt.clear_init_cache()
  return fdt.init(*args, **kwargs)


def test_a_second_call_reuses_the_compiled_build(mesh):
  compiled, reused = _counts()
  first = fdt.init(Stack, 16, nnx.Rngs(0), mesh=mesh, rules=RULES)
  assert _counts() == (compiled + 1, reused)
  second = fdt.init(Stack, 16, nnx.Rngs(0), mesh=mesh, rules=RULES)
  assert _counts() == (compiled + 1, reused + 1)
  np.testing.assert_array_equal(_kernel(first), _kernel(second))
  assert second.blocks.up.kernel.sharding.spec == P(None, 'data', 'model')
  assert second.blocks.up.kernel.sharding.mesh == mesh
  # Another seed passed is another value, not another program.
  third = fdt.init(Stack, 16, nnx.Rngs(1), mesh=mesh, rules=RULES)
  assert _counts() == (compiled + 1, reused + 2)
  fresh = _fresh(Stack, 16, nnx.Rngs(1), mesh=mesh, rules=RULES)
  np.testing.assert_array_equal(_kernel(third), _kernel(fresh))
  assert not np.array_equal(_kernel(first), _kernel(third))
  # The caller's Rngs advance as in an eager call, reused or not.
  rngs, again = nnx.Rngs(0), nnx.Rngs(0)
  fdt.init(Stack, 16, rngs, mesh=mesh, rules=RULES)
  fdt.init(Stack, 16, again, mesh=mesh, rules=RULES)
  assert int(rngs.default.count[...]) == int(again.default.count[...]) > 0


def _widths(width):
  return lambda rngs: Block(width, rngs)


NAMED = 16


def _named(rngs):
  return Block(NAMED, rngs)


def test_what_changes_the_build_compiles_anew(mesh):
  """Each change compiles once, and builds what a fresh call builds."""
  fdt.init(Block, 16, nnx.Rngs(0), mesh=mesh, rules=RULES)
  changes = {
    'rules': lambda: fdt.init(
      Block, 16, nnx.Rngs(0), mesh=mesh, rules=OTHER_RULES
    ),
    'mesh': lambda: fdt.init(
      Block,
      16,
      nnx.Rngs(0),
      mesh=jax.make_mesh((4, 2), ('data', 'model')),
      rules=RULES,
    ),
    'argument': lambda: fdt.init(
      Block, 32, nnx.Rngs(0), mesh=mesh, rules=RULES
    ),
    'factory': lambda: fdt.init(
      lambda rngs: Block(16, rngs), nnx.Rngs(0), mesh=mesh, rules=RULES
    ),
    'closure': lambda: fdt.init(
      _widths(8), nnx.Rngs(0), mesh=mesh, rules=RULES
    ),
  }
  for name, call in changes.items():
    compiled, _ = _counts()
    built = call()
    assert _counts()[0] == compiled + 1, name
    expected = {
      'rules': P('model', 'data'),
      'mesh': P('data', 'model'),
    }.get(name, P('data', 'model'))
    assert built.up.kernel.sharding.spec == expected, name
  # A closure of another value is another build; of the same, the same.
  built = fdt.init(_widths(8), nnx.Rngs(0), mesh=mesh, rules=RULES)
  assert _kernel(built).shape == (8, 16)
  compiled, reused = _counts()
  fdt.init(_widths(8), nnx.Rngs(0), mesh=mesh, rules=RULES)
  assert _counts() == (compiled, reused + 1)
  # A global the factory's code names, changed between calls.
  global NAMED
  first = fdt.init(_named, nnx.Rngs(0), mesh=mesh, rules=RULES)
  NAMED = 24
  try:
    second = fdt.init(_named, nnx.Rngs(0), mesh=mesh, rules=RULES)
  finally:
    NAMED = 16
  assert _kernel(first).shape == (16, 32)
  assert _kernel(second).shape == (24, 48)


def test_a_seed_compiled_in_compiles_anew():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))

  def make(seed):
    return Block(16, nnx.Rngs(seed))

  zero = fdt.init(make, 0, mesh=mesh, rules=RULES)
  one = fdt.init(make, 1, mesh=mesh, rules=RULES)
  np.testing.assert_array_equal(
    _kernel(one), _kernel(_fresh(make, 1, mesh=mesh, rules=RULES))
  )
  assert not np.array_equal(_kernel(zero), _kernel(one))


def test_what_a_key_cannot_pin_down_is_never_kept(mesh):
  """An array in a closure, a mutable value compiled in, an array a class
  reads from a global: each call compiles, and sees the current value."""
  table = jnp.ones((16, 32))

  def with_table(rngs):
    model = Block(16, rngs)
    model.up.kernel.set_value(model.up.kernel[...] * 0 + table)
    return model

  class Config:  # A mutable object: nothing says it is the same.
    width = 16

  for factory, args in (
    (with_table, ()),
    (lambda rngs, config: Block(config.width, rngs), (Config(),)),
  ):
    assert (
      _init_cache.key(
        factory,
        _calls.Split([*args, nnx.Rngs(0)], None, [len(args)]),
        RULES,
        mesh,
      )
      is None
    )
  compiled, reused = _counts()
  fdt.init(with_table, nnx.Rngs(0), mesh=mesh, rules=RULES)
  fdt.init(with_table, nnx.Rngs(0), mesh=mesh, rules=RULES)
  assert _counts() == (compiled + 2, reused)
  # A global array a module's __init__ reads: the trace captures it.
  compiled, reused = _counts()
  first = fdt.init(Holder, mesh=mesh, rules=RULES)
  global HELD
  HELD = jnp.full((8, 16), 2.0)
  try:
    second = fdt.init(Holder, mesh=mesh, rules=RULES)
  finally:
    HELD = jnp.ones((8, 16))
  assert _counts() == (compiled + 2, reused)
  np.testing.assert_array_equal(np.asarray(first.w[...]), 1.0)
  np.testing.assert_array_equal(np.asarray(second.w[...]), 2.0)


HELD = jnp.ones((8, 16))


class Holder(nnx.Module):
  def __init__(self):
    self.w = nnx.Param(
      nnx.with_partitioning(lambda *_: HELD, ('embed', 'mlp'))(None, (8, 16))
    )


def test_the_cache_holds_nothing_of_the_callers(mesh):
  rngs = nnx.Rngs(0)
  passed = jax.device_put(jnp.ones(8))
  model = fdt.init(
    lambda rngs, x: Block(16, rngs), rngs, passed, mesh=mesh, rules=RULES
  )
  refs = [weakref.ref(x) for x in (rngs, passed, model)]
  assert len(_init_cache._builds._data) == 1
  del rngs, passed, model
  gc.collect()
  assert [r() for r in refs] == [None] * 3


def test_clear_init_cache_forgets_every_build(mesh):
  fdt.init(Block, 16, nnx.Rngs(0), mesh=mesh, rules=RULES)
  compiled, reused = _counts()
  fdt.clear_init_cache()
  assert len(_init_cache._builds._data) == 0
  fdt.init(Block, 16, nnx.Rngs(0), mesh=mesh, rules=RULES)
  assert _counts() == (compiled + 1, reused)


def test_an_annotated_initializer_passed_in_is_part_of_the_key(mesh):
  """`fdt.init(nnx.Linear, ..., kernel_init=nnx.with_partitioning(...))`:
  the initializer's closure (its metadata dict, its names) is keyed by
  content, so the same one reuses and other names build anew."""

  def kernel(names):
    return nnx.with_partitioning(_user_init, names)

  def build(axes):
    return fdt.init(
      nnx.Linear,
      8,
      16,
      kernel_init=kernel(axes),
      rngs=nnx.Rngs(0),
      mesh=mesh,
      rules=RULES,
    )

  compiled, reused = _counts()
  build(('embed', 'mlp'))
  same = build(('embed', 'mlp'))
  assert _counts() == (compiled + 1, reused + 1)
  other = build(('mlp', 'embed'))
  assert _counts() == (compiled + 2, reused + 1)
  assert same.kernel.sharding.spec == P('data', 'model')
  assert other.kernel.sharding.spec == P('model', 'data')


def test_an_eager_build_skips_its_abstract_pass_the_second_time(mesh):
  """A model of library initializers builds eagerly, in its shards; the
  second call knows so without the abstract pass."""

  def make(rngs):
    init = nnx.with_partitioning(
      nnx.initializers.lecun_normal(), ('embed', 'mlp')
    )
    return nnx.Linear(16, 32, kernel_init=init, rngs=rngs)

  in_shards, reused = _init.builds['in_shards'], _init.builds['reused']
  first = fdt.init(make, nnx.Rngs(0), mesh=mesh, rules=RULES)
  second = fdt.init(make, nnx.Rngs(0), mesh=mesh, rules=RULES)
  assert _init.builds['in_shards'] == in_shards + 2
  assert _init.builds['reused'] == reused + 1
  np.testing.assert_array_equal(
    np.asarray(first.kernel[...]), np.asarray(second.kernel[...])
  )
  assert second.kernel.sharding.spec == P('data', 'model')
