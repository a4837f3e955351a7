"""Eager creation under our rules: each initializer computes only its shards.

Whatever the spelling, a variable created under ``jax.set_mesh`` and
`fdt.logical_axis_rules` holds the values of an unsharded build (within
`creation_values.MAX_ULP`), sits where `fdt.plan` and
``nnx.get_partition_spec`` say, and a JAX or Flax initializer is compiled
once per distinct initializer, not once per layer.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from support import creation_values

import flax_dtensor as fdt
from flax_dtensor._placement import _creation

RULES = fdt.LogicalRules(
  [('embed', 'fsdp'), ('embed', 'data'), ('mlp', 'model'), ('heads', 'model')]
)
TYPES = {
  'explicit': (AxisType.Explicit, AxisType.Explicit),
  'auto': (AxisType.Auto, AxisType.Auto),
  'mixed': (AxisType.Explicit, AxisType.Auto),
}
lecun = nnx.initializers.lecun_normal


def _mesh(types='explicit'):
  return jax.make_mesh((2, 4), ('data', 'model'), axis_types=TYPES[types])


# Each spelling builds a model from an `nnx.Rngs`; all place 'embed' on
# 'data' and 'mlp' on 'model' (a dimension an annotation leaves out: None).
SPELLINGS = {
  'with_partitioning': lambda r: nnx.Linear(
    16, 32, kernel_init=nnx.with_partitioning(lecun(), ('embed', 'mlp')), rngs=r
  ),
  'with_metadata': lambda r: nnx.Linear(
    16,
    32,
    kernel_init=nnx.with_metadata(lecun(), out_sharding=('embed', 'mlp')),
    rngs=r,
  ),
  'deprecated_sharding_names': lambda r: nnx.Linear(
    16,
    32,
    kernel_init=nnx.with_metadata(lecun(), sharding_names=('embed', 'mlp')),
    rngs=r,
  ),
  'jax_initializer': lambda r: nnx.Linear(
    16,
    32,
    kernel_init=nnx.with_partitioning(
      jax.nn.initializers.normal(0.02), ('embed', 'mlp')
    ),
    rngs=r,
  ),
  'partial': lambda r: nnx.Linear(
    16,
    32,
    kernel_init=nnx.with_partitioning(
      functools.partial(jax.random.uniform, minval=-0.1, maxval=0.1),
      ('embed', 'mlp'),
    ),
    rngs=r,
  ),
  'bfloat16': lambda r: nnx.Linear(
    16,
    32,
    param_dtype=jnp.bfloat16,
    kernel_init=nnx.with_partitioning(lecun(), ('embed', 'mlp')),
    rngs=r,
  ),
  'bias': lambda r: nnx.Linear(
    16,
    32,
    kernel_init=nnx.with_partitioning(lecun(), ('embed', 'mlp')),
    bias_init=nnx.with_partitioning(nnx.initializers.ones, ('mlp',)),
    rngs=r,
  ),
  'embed': lambda r: nnx.Embed(
    16,
    32,
    embedding_init=nnx.with_partitioning(
      nnx.initializers.normal(1.0), ('embed', 'mlp')
    ),
    rngs=r,
  ),
  'conv': lambda r: nnx.Conv(
    4,
    32,
    (3, 3),
    kernel_init=nnx.with_partitioning(lecun(), (None, None, 'embed', 'mlp')),
    rngs=r,
  ),
  'linear_general': lambda r: nnx.LinearGeneral(
    16,
    (4, 8),
    kernel_init=nnx.with_partitioning(lecun(), ('embed', 'heads', None)),
    rngs=r,
  ),
  'einsum': lambda r: nnx.Einsum(
    'ab,bc->ac',
    (16, 32),
    kernel_init=nnx.with_partitioning(lecun(), ('embed', 'mlp')),
    rngs=r,
  ),
  'direct_call': lambda r: nnx.Dict(
    w=nnx.Param(
      nnx.with_partitioning(lecun(), ('embed', 'mlp'))(r.params(), (16, 32))
    )
  ),
  # Fewer names than dimensions: the missing trailing ones are None.
  'short_annotation': lambda r: nnx.Linear(
    16, 32, kernel_init=nnx.with_partitioning(lecun(), ('embed',)), rngs=r
  ),
  # flax#5127's spelling: Flax's deprecated `sharding=`, one name.
  'deprecated_sharding_short': lambda r: nnx.Dict(
    w=nnx.Param(lecun()(r.params(), (16, 32)), sharding=('embed',))
  ),
}
# Flax's deprecated metadata names, and what Flax says of each.
DEPRECATED = {
  'deprecated_sharding_names': "'sharding_names' is deprecated",
  'deprecated_sharding_short': "'sharding' is deprecated",
}


def _canon(spec, ndim):
  """A spec with one entry per dimension (P() == P(None, None))."""
  return tuple(spec) + (None,) * (ndim - len(spec))


def _flat(model):
  return dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))


def _build(spelling, rngs):
  if spelling not in DEPRECATED:
    return SPELLINGS[spelling](rngs)
  with pytest.warns(DeprecationWarning, match=DEPRECATED[spelling]):
    return SPELLINGS[spelling](rngs)


def _unsharded(spelling):
  with nnx.use_eager_sharding(False):
    return _build(spelling, nnx.Rngs(0))


@pytest.mark.parametrize('rngs_made', ['inside', 'outside'])
@pytest.mark.parametrize('types', list(TYPES))
@pytest.mark.parametrize('spelling', list(SPELLINGS))
def test_eager_creation_matches_an_unsharded_build(spelling, types, rngs_made):
  mesh = _mesh(types)
  rngs = nnx.Rngs(0) if rngs_made == 'outside' else None
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    model = _build(spelling, rngs or nnx.Rngs(0))
    plan = fdt.plan(model)
    reported = dict(
      nnx.to_flat_state(nnx.get_partition_spec(nnx.state(model, nnx.Param)))
    )
  expected = _flat(_unsharded(spelling))
  ours = _flat(model)
  assert ours.keys() == expected.keys()
  for path, variable in ours.items():
    value = variable.get_value()
    creation_values.assert_close(
      value, expected[path].get_value(), err_msg=str(path)
    )
    assert value.sharding.mesh == mesh  # The caller's axis types.
    entry = plan['/'.join(map(str, path))]
    assert not entry.misplaced
    assert value.sharding.is_equivalent_to(
      jax.sharding.NamedSharding(mesh, entry.spec), value.ndim
    )
    assert _canon(reported[path].get_value(), value.ndim) == _canon(
      entry.spec, value.ndim
    )
  assert any(e.spec != P() for e in plan.entries)  # Really sharded.


def test_a_library_initializer_compiles_once_for_all_layers():
  """``lecun_normal()`` called per layer: one compiled initializer."""
  mesh = _mesh()
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    _creation.clear_caches()
    layers = [
      nnx.Linear(
        16,
        32,
        kernel_init=nnx.with_partitioning(lecun(), ('embed', 'mlp')),
        rngs=nnx.Rngs(i),
      )
      for i in range(6)
    ]
  assert len(_creation._compiled._data) == 1
  values = [np.asarray(layer.kernel[...]) for layer in layers]
  assert all(not np.array_equal(values[0], v) for v in values[1:])


def test_a_jitted_initializer_sees_only_its_shard():
  """Inside the compiled initializer, XLA is asked for the sharded output."""
  mesh = _mesh()
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    _creation.clear_caches()
    nnx.Linear(
      64,
      128,
      kernel_init=nnx.with_partitioning(lecun(), ('embed', 'mlp')),
      rngs=nnx.Rngs(0),
    )
  ((key, jitted),) = _creation._compiled._data.items()
  assert key[1] == P('data', 'model')
  (shard,) = {
    tuple(s.data.shape)
    for s in jitted(jax.random.key(0)).addressable_shards  # Runs as cached.
  }
  assert shard == (32, 32)


def test_a_users_initializer_runs_as_written_every_time():
  """No trace is reused for code that may read changing state."""
  mesh = _mesh()
  calls = []

  def from_numpy(key, shape, dtype=jnp.float32):
    calls.append(type(key))
    return jnp.asarray(np.random.default_rng(len(calls)).normal(size=shape))

  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    a, b = (
      nnx.Linear(
        16,
        32,
        kernel_init=nnx.with_partitioning(from_numpy, ('embed', 'mlp')),
        rngs=nnx.Rngs(0),
      )
      for _ in range(2)
    )
  assert len(calls) == 2 and not issubclass(calls[0], jax.core.Tracer)
  for i, layer in enumerate((a, b), 1):
    np.testing.assert_array_equal(
      np.asarray(layer.kernel[...]),
      np.random.default_rng(i).normal(size=(16, 32)).astype(np.float32),
    )
    assert layer.kernel[...].sharding.spec == P('data', 'model')


@pytest.mark.parametrize('how', ['metadata', 'context'])
def test_eager_sharding_off_leaves_the_value_unsharded(how):
  mesh = _mesh()
  init = nnx.with_partitioning(lecun(), ('embed', 'mlp'))
  with contextlib.ExitStack() as stack:
    stack.enter_context(jax.set_mesh(mesh))
    stack.enter_context(fdt.logical_axis_rules(RULES))
    if how == 'context':
      stack.enter_context(nnx.use_eager_sharding(False))
      init = nnx.with_partitioning(lecun(), ('embed', 'mlp'))
    else:
      init = nnx.with_metadata(
        lecun(), out_sharding=('embed', 'mlp'), eager_sharding=False
      )
    layer = nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0))
    plan = fdt.plan(layer)
  assert _canon(layer.kernel[...].sharding.spec, 2) == (None, None)
  assert plan['kernel'].misplaced  # Planned P('data', 'model'), not there.


def test_flax_rules_keep_flax_eager_creation():
  """Plain tuples in Flax's context: Flax's own (last-write-wins) placement."""
  mesh = _mesh()
  rules = (('mlp', 'data'), ('mlp', 'model'), ('embed', None))
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    _creation.clear_caches()
    layer = nnx.Linear(
      16,
      32,
      kernel_init=nnx.with_partitioning(lecun(), ('embed', 'mlp')),
      rngs=nnx.Rngs(0),
    )
  assert layer.kernel[...].sharding.spec == P(None, 'model')
  assert not _creation._compiled._data  # Not routed.


def test_an_unknown_name_raises_as_before():
  mesh = _mesh()
  with (
    jax.set_mesh(mesh),
    fdt.logical_axis_rules(RULES),
    pytest.raises(
      fdt.UnknownLogicalAxisError,
      match=r"\['hidden'\] are not mentioned by any rule",
    ),
  ):
    nnx.Linear(
      16,
      32,
      kernel_init=nnx.with_partitioning(lecun(), ('embed', 'hidden')),
      rngs=nnx.Rngs(0),
    )


def test_a_non_dividing_rule_falls_back_in_eager_creation():
  """Shape-aware fallbacks decide the shards the initializer computes."""
  mesh = _mesh()
  rules = fdt.LogicalRules([('mlp', 'model'), ('mlp', 'data')])
  with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
    layer = nnx.Linear(
      16,
      6,  # 6 % 4 != 0: 'model' is skipped, 'data' (2) divides.
      kernel_init=nnx.with_partitioning(lecun(), (None, 'mlp')),
      rngs=nnx.Rngs(0),
    )
  assert layer.kernel[...].sharding.spec == P(None, 'data')
  # Shards of 3 columns: on AVX-512 with jax 0.12, XLA's vector code for
  # erf_inv rounds some of them otherwise than for 6 (up to 2 ulps here).
  creation_values.assert_close(
    layer.kernel[...],
    nnx.Linear(16, 6, kernel_init=lecun(), rngs=nnx.Rngs(0)).kernel[...],
  )


def test_creation_inside_jit_is_flax_own_trace():
  """Traced creation (the user's own nnx.jit) is placed by constraints."""
  mesh = _mesh('auto')

  @nnx.jit
  def make(rngs):
    return nnx.Linear(
      16,
      32,
      kernel_init=nnx.with_partitioning(lecun(), ('embed', 'mlp')),
      rngs=rngs,
    )

  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    _creation.clear_caches()
    layer = make(nnx.Rngs(0))
  assert layer.kernel[...].sharding.spec == P('data', 'model')
  assert not _creation._compiled._data
  creation_values.assert_close(
    layer.kernel[...], _unsharded('bias').kernel[...]
  )


@pytest.mark.parametrize('dtype', [np.float32, ml_dtypes.bfloat16])
def test_the_value_bound_is_the_stated_number_of_ulps(dtype):
  """`creation_values.assert_close` passes at MAX_ULP, fails one beyond."""
  base = np.linspace(-2, 2, 24, dtype=np.float32).astype(dtype).reshape(4, 6)
  ints = np.dtype(f'i{base.dtype.itemsize}')
  positive = base > 0
  bound = creation_values.MAX_ULP

  def moved(n):  # Each value n representable values away from zero.
    bits = base.view(ints).copy()
    bits[positive] += n
    return bits.view(base.dtype)

  np.testing.assert_array_equal(
    creation_values.ulps(moved(bound), base), np.where(positive, bound, 0)
  )
  creation_values.assert_close(moved(bound), base)
  with pytest.raises(AssertionError):
    creation_values.assert_close(moved(bound + 1), base)
  with pytest.raises(AssertionError, match=r'float64'):
    creation_values.assert_close(base.astype(np.float64), base)
