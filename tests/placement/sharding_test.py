"""Tests for placement by mesh axis type, the NNX hook, init and shard_module."""

import concurrent.futures
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support import context_matrix as cm
from support import creation_values

import flax_dtensor as fdt

RULES = fdt.LogicalRules(
  [
    ('batch', 'data'),
    ('embed', 'fsdp'),
    ('embed', 'data'),
    ('mlp', 'model'),
    ('mlp', 'data'),
    ('vocab', None),
  ]
)


def _lecun(axes):
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), axes)


class MLP(nnx.Module):
  """The model of the issue, smaller."""

  def __init__(self, rngs, din=16, dh=64):
    self.up = nnx.Linear(
      din, dh, rngs=rngs, kernel_init=_lecun(('embed', 'mlp'))
    )
    self.down = nnx.Linear(
      dh, din, rngs=rngs, kernel_init=_lecun(('mlp', 'embed'))
    )

  def __call__(self, x):
    h = fdt.with_logical_constraint(self.up(x), ('batch', 'mlp'))
    return self.down(jax.nn.relu(h))


# A model that trains well on the explicit mesh too: 'embed' must not take
# the batch's mesh axis, or the contraction would be ambiguous.
TRAIN_RULES = fdt.LogicalRules(
  [('batch', 'data'), ('embed', None), ('mlp', 'model')]
)


def _unsharded(factory, *args):
  """Builds a model without a mesh (Flax needs eager sharding off for it)."""
  with nnx.use_eager_sharding(False):
    return factory(*args)


def _shard_values_equal(arr, expected):
  """Every addressable shard holds exactly its slice of `expected`."""
  expected = np.asarray(expected)
  for shard in arr.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])


# shard_value
# ------------------------------------------------------------------------------


def test_shard_value_on_each_mesh_type_eager(any_mesh):
  x = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16)
  y = fdt.shard_value(x, ('batch', 'mlp'), mesh=any_mesh, rules=RULES)
  assert y.sharding == NamedSharding(any_mesh, P('data', 'model'))
  assert len({s.device for s in y.addressable_shards}) == 8
  _shard_values_equal(y, x)


def test_shard_value_inside_jit_matches_eager(any_mesh):
  x = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16)
  with jax.set_mesh(any_mesh), fdt.logical_axis_rules(RULES):
    eager = fdt.shard_value(x, ('batch', 'mlp'))
    jitted = jax.jit(lambda v: fdt.shard_value(v * 2, ('batch', 'mlp')))(x)
  assert jitted.sharding.spec == P('data', 'model')
  assert jax.typeof(jitted) == jax.typeof(eager)
  _shard_values_equal(jitted, 2 * np.asarray(x))


def test_mixed_mesh_carries_explicit_and_auto_parts(mixed_mesh):
  """Flax raises on mixed meshes; the result here has the full sharding."""
  x = jnp.ones((8, 16))

  types = []

  @jax.jit
  def f(v):
    y = fdt.shard_value(v, ('batch', 'mlp'))
    types.append(jax.typeof(y))
    return y

  with jax.set_mesh(mixed_mesh), fdt.logical_axis_rules(RULES):
    y = f(x)
  (typ,) = types
  # 'data' is Explicit: it is in the type; 'model' is Auto: in the sharding.
  assert typ.sharding.spec == P('data', None)
  assert y.sharding.spec == P('data', 'model')


def test_product_of_mixed_axis_types_inside_jit_raises(mixed_mesh):
  rules = [('heads', ('data', 'model'))]
  with jax.set_mesh(mixed_mesh), fdt.logical_axis_rules(rules):
    eager = fdt.shard_value(jnp.ones((16,)), ('heads',))
    assert eager.sharding.spec == P(('data', 'model'))
    with pytest.raises(
      fdt.MeshAxisTypeError, match='mixes Explicit and Auto mesh axes'
    ):
      jax.jit(lambda v: fdt.shard_value(v, ('heads',)))(jnp.ones((16,)))


def test_manual_axes_raise(explicit_mesh):
  @jax.shard_map(in_specs=P('data'), out_specs=P('data'))
  def f(v):
    return fdt.shard_value(v, ('batch', None))

  with jax.set_mesh(explicit_mesh), fdt.logical_axis_rules(RULES):
    x = jax.sharding.reshard(jnp.ones((8, 4)), P('data', None))
    with pytest.raises(fdt.MeshAxisTypeError, match=r"\['data'\] are Manual"):
      f(x)


def test_shard_value_without_mesh_raises():
  with pytest.raises(fdt.MeshError, match=r'no mesh is set.*jax.set_mesh'):
    fdt.shard_value(jnp.ones(4), ('batch',), rules=RULES)


def test_non_divisible_falls_back_instead_of_failing_in_jax(explicit_mesh):
  # Flax would hand P(None, 'model') to JAX, which raises for 6 % 4.
  x = jnp.arange(16 * 6, dtype=jnp.float32).reshape(16, 6)
  y = fdt.shard_value(x, ('embed', 'mlp'), mesh=explicit_mesh, rules=RULES)
  assert y.sharding.spec == P('data', None)
  _shard_values_equal(y, x)


def test_with_logical_constraint_is_a_noop_without_rules_or_mesh(auto_mesh):
  x = jnp.ones((8, 16))
  assert fdt.with_logical_constraint(x, ('batch', 'mlp')) is x
  with fdt.logical_axis_rules(RULES):
    assert fdt.with_logical_constraint(x, ('batch', 'mlp')) is x
  with jax.set_mesh(auto_mesh), fdt.logical_axis_rules(RULES):
    y = jax.jit(lambda v: fdt.with_logical_constraint(v, ('batch', 'mlp')))(x)
  assert y.sharding.spec == P('data', 'model')


# The NNX hook
# ------------------------------------------------------------------------------


def test_params_sharded_at_creation_on_each_mesh_type(any_mesh):
  with jax.set_mesh(any_mesh), fdt.logical_axis_rules(RULES):
    model = MLP(nnx.Rngs(0))
    specs = nnx.get_partition_spec(nnx.state(model))
  # 'embed' -> 'fsdp' is missing, falls back to 'data'; 'mlp' -> 'model'.
  assert model.up.kernel.sharding == NamedSharding(any_mesh, P('data', 'model'))
  assert model.down.kernel.sharding.spec == P('model', 'data')
  # Flax's own query agrees with the placement.
  assert specs['up']['kernel'].get_value() == P('data', 'model')
  assert specs['down']['kernel'].get_value() == P('model', 'data')
  # Values are those of an unsharded build.
  plain = _unsharded(MLP, nnx.Rngs(0))
  creation_values.assert_close(
    model.up.kernel.get_value(), plain.up.kernel.get_value()
  )


def test_get_named_sharding_agrees_with_placement(explicit_mesh):
  rules = RULES.prepend([('mlp', 'data')])  # Now 'mlp' prefers 'data'.
  with jax.set_mesh(explicit_mesh), fdt.logical_axis_rules(rules):
    model = MLP(nnx.Rngs(0))
    state = nnx.state(model)
    named = dict(
      nnx.to_flat_state(nnx.get_named_sharding(state, explicit_mesh))
    )
  for path, variable in nnx.to_flat_state(state):
    value = variable.get_value()
    assert named[path].get_value().is_equivalent_to(value.sharding, value.ndim)
  # 'mlp' takes 'data' first, so 'embed' finds 'data' taken.
  assert model.up.kernel.sharding.spec == P(None, 'data')


@pytest.mark.parametrize(
  'set_rules',
  [
    lambda r: nnx.logical_axis_rules(r),
    lambda r: _core_rules(r),
  ],
  ids=['nnx.logical_axis_rules', 'flax.core.spmd.set_logical_axis_rules'],
)
def test_flax_semantics_outside_our_context(explicit_mesh, set_rules):
  """Rules set with Flax's own context keep Flax's semantics, in every API.

  With these rules the two semantics differ: Flax's dict takes the last
  rule for 'mlp' ('model'); flax_dtensor's priority takes the first
  ('data').
  """
  rules = (('mlp', 'data'), ('mlp', 'model'), ('embed', None))
  assert fdt.logical_to_mesh_axes(
    (None, 'mlp'), rules=rules, mesh=explicit_mesh
  ) == P(None, 'data')
  with jax.set_mesh(explicit_mesh), set_rules(rules):
    model = MLP(nnx.Rngs(0))
    reported = nnx.get_partition_spec(nnx.state(model))
    plan = fdt.plan(model)
    resolved = fdt.logical_to_mesh_axes((None, 'mlp'))
    with nnx.use_eager_sharding(False):
      unsharded = MLP(nnx.Rngs(0))
    fdt.shard_module(unsharded)
    built = fdt.init(MLP, nnx.Rngs(0))
    y = jax.jit(lambda x: fdt.with_logical_constraint(x, ('embed', 'mlp')))(
      jnp.ones((8, 16))
    )
  for spec in (
    model.up.kernel.sharding.spec,
    reported['up']['kernel'].get_value(),
    plan['up/kernel'].spec,
    resolved,
    unsharded.up.kernel.sharding.spec,
    built.up.kernel.sharding.spec,
    y.sharding.spec,
  ):
    assert spec == P(None, 'model')


def _core_rules(rules):
  import contextlib

  from flax.core import spmd as core_spmd

  @contextlib.contextmanager
  def scope():
    old = core_spmd.get_logical_axis_rules()
    core_spmd.set_logical_axis_rules(rules)
    try:
      yield
    finally:
      core_spmd.set_logical_axis_rules(old)

  return scope()


def test_unknown_name_fails_early_at_creation(explicit_mesh):
  class Bad(nnx.Module):
    def __init__(self, rngs):
      self.w = nnx.Param(
        nnx.with_partitioning(nnx.initializers.ones, ('embed', 'hidden'))(
          rngs.params(), (4, 8)
        )
      )

  with jax.set_mesh(explicit_mesh), fdt.logical_axis_rules(RULES):
    with pytest.raises(
      fdt.UnknownLogicalAxisError, match=r"\['hidden'\] are not mentioned"
    ):
      Bad(nnx.Rngs(0))


def test_creation_inside_nnx_jit(auto_mesh):
  with jax.set_mesh(auto_mesh), fdt.logical_axis_rules(RULES):
    model = nnx.jit(lambda: MLP(nnx.Rngs(0)))()
  assert model.up.kernel.sharding.spec == P('data', 'model')
  plain = _unsharded(MLP, nnx.Rngs(0))
  creation_values.assert_close(
    model.up.kernel.get_value(), plain.up.kernel.get_value()
  )


def test_variable_sharding_rules_metadata_take_priority(explicit_mesh):
  init = nnx.with_partitioning(
    nnx.initializers.ones, ('embed', 'mlp'), sharding_rules=(('mlp', None),)
  )
  with jax.set_mesh(explicit_mesh), fdt.logical_axis_rules(RULES):
    layer = nnx.Linear(16, 8, kernel_init=init, rngs=nnx.Rngs(0))
    spec = nnx.get_partition_spec(nnx.state(layer))['kernel'].get_value()
  assert layer.kernel.sharding.spec == P('data', None)
  assert spec == P('data', None)


def test_legacy_sharding_names_metadata_is_read(explicit_mesh):
  with jax.set_mesh(explicit_mesh), fdt.logical_axis_rules(RULES):
    with pytest.warns(
      DeprecationWarning, match="'sharding_names' is deprecated"
    ):
      p = nnx.Param(jnp.ones((8, 16)), sharding_names=('batch', 'mlp'))
  assert p.get_value().sharding.spec == P('data', 'model')


def test_optimizer_state_is_placed_like_params(any_mesh):
  with jax.set_mesh(any_mesh), fdt.logical_axis_rules(TRAIN_RULES):
    model = MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    x, h = jnp.ones((8, 16)), jnp.ones((8, 64))

    def loss_fn(m):
      # Each contraction is over an unsharded input dim, so the explicit
      # mesh needs no `out_sharding`.
      return jnp.mean(m.up(x) ** 2) + jnp.mean(m.down(h) ** 2)

    @nnx.jit
    def step(model, opt, x):
      loss, grads = nnx.value_and_grad(loss_fn)(model)
      opt.update(model, grads)
      return loss

    losses = [float(step(model, opt, x)) for _ in range(3)]
  adam = opt.opt_state[0]
  for name in ('up', 'down'):
    kernel = getattr(model, name).kernel.get_value()
    assert adam.mu[name]['kernel'].get_value().sharding == kernel.sharding
    assert adam.nu[name]['kernel'].get_value().sharding == kernel.sharding
  assert losses[-1] < losses[0]


# shard_module and init
# ------------------------------------------------------------------------------


def test_shard_module_places_an_unsharded_model(mixed_mesh):
  model = _unsharded(MLP, nnx.Rngs(0))
  before = np.asarray(model.up.kernel.get_value())
  out = fdt.shard_module(model, mesh=mixed_mesh, rules=RULES)
  assert out is model
  assert model.up.kernel.sharding == NamedSharding(
    mixed_mesh, P('data', 'model')
  )
  _shard_values_equal(model.up.kernel.get_value(), before)
  # Unannotated variables end on the mesh too, replicated, as planned.
  bias = model.up.bias.get_value()
  assert bias.sharding == NamedSharding(mixed_mesh, P())
  plan = fdt.plan(model, mesh=mixed_mesh, rules=RULES)
  assert plan['up/bias'].spec == P(None) and not plan['up/bias'].misplaced


def test_shard_module_error_names_the_path(explicit_mesh):
  model = _unsharded(MLP, nnx.Rngs(0))
  with pytest.raises(
    fdt.UnknownLogicalAxisError,
    match=r"not mentioned by any rule at down/kernel \(logical axes \('mlp', ",
  ):
    fdt.shard_module(model, mesh=explicit_mesh, rules=[('batch', 'data')])


def test_init_equals_eager_build_and_is_sharded(any_mesh):
  rngs = nnx.Rngs(0)
  model = fdt.init(MLP, rngs, din=16, mesh=any_mesh, rules=RULES)
  plain_rngs = nnx.Rngs(0)
  plain = _unsharded(MLP, plain_rngs)
  assert model.up.kernel.sharding == NamedSharding(any_mesh, P('data', 'model'))
  assert model.down.kernel.sharding.spec == P('model', 'data')
  assert model.up.bias.sharding.is_equivalent_to(
    NamedSharding(any_mesh, P()), 1
  )
  for a, b in zip(
    jax.tree.leaves(nnx.state(model, nnx.Param)),
    jax.tree.leaves(nnx.state(plain, nnx.Param)),
    strict=True,
  ):
    creation_values.assert_close(a, b)
  # The caller's Rngs advanced exactly as in an eager build.
  assert int(rngs.params.count[...]) == int(plain_rngs.params.count[...])


def test_init_uses_context_mesh_and_rules(explicit_mesh):
  with jax.set_mesh(explicit_mesh), fdt.logical_axis_rules(RULES):
    model = fdt.init(lambda: MLP(nnx.Rngs(1)))
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  kernel = model.up.kernel.get_value()
  # Typed on the caller's Explicit mesh, although built on an Auto copy.
  assert jax.typeof(kernel).sharding.spec == P('data', 'model')
  assert kernel.sharding == NamedSharding(explicit_mesh, P('data', 'model'))
  assert opt.opt_state[0].mu['up']['kernel'].sharding == kernel.sharding


def test_init_without_mesh_raises():
  with pytest.raises(fdt.MeshError, match='Expected a concrete mesh'):
    fdt.init(MLP, nnx.Rngs(0), rules=RULES)


def test_issue_example_runs_on_all_axis_types(any_mesh):
  """The user code of the core issue, as written."""

  class Big(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(
        512, 2048, rngs=rngs, kernel_init=_lecun(('embed', 'mlp'))
      )
      self.down = nnx.Linear(
        2048, 512, rngs=rngs, kernel_init=_lecun(('mlp', 'embed'))
      )

  rules = fdt.LogicalRules(
    [
      ('batch', 'data'),
      ('embed', 'fsdp'),
      ('mlp', 'model'),
      ('mlp', 'data'),
      ('vocab', None),
    ]
  )
  with jax.set_mesh(any_mesh), fdt.logical_axis_rules(rules):
    model = Big(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    plan = fdt.plan(model)
  assert model.up.kernel.sharding.spec == P(None, 'model')
  assert opt.opt_state[0].mu['up']['kernel'].sharding.spec == P(None, 'model')
  assert plan['up/kernel'].spec == P(None, 'model')
  assert plan['up/kernel'].fallbacks == (
    "dim 0 ('embed'): 'fsdp': the mesh has no axis 'fsdp' (axes: "
    "['data', 'model'])",
  )
  assert 'up/kernel' in str(plan)


def test_hook_semantics_do_not_depend_on_history(warm_pool):
  """LogicalRules in Flax's own context mean flax_dtensor semantics, even
  before any flax_dtensor context was ever entered in the process (a fork
  of the warm pool, which imported flax_dtensor and used nothing)."""
  code = '\n'.join(
    [
      'import jax',
      "jax.config.update('jax_num_cpu_devices', 8)",
      'from flax import nnx',
      'import flax_dtensor as fdt',
      "mesh = jax.make_mesh((2, 4), ('data', 'model'))",
      "rules = fdt.LogicalRules([('mlp', 'model'), ('mlp', 'data')])",
      'with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):',
      '  p = nnx.Param(',
      "    nnx.with_partitioning(nnx.initializers.ones, (None, 'mlp'))(",
      '      jax.random.key(0), (2, 8)))',
      'print(p.get_value().sharding.spec)',
    ]
  )
  out = warm_pool.run_code(code, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  # Flax's last-write-wins dict would give P(None, 'data').
  assert out.stdout.strip() == "P(None, 'model')"


def test_variables_created_in_32_threads_follow_their_own_rules(
  explicit_mesh,
):
  """32 threads, each in its own rules, all inside them at once.

  Each thread resolves and places its layer's variables abstractly
  (`nnx.eval_shape`: our hook's whole path, no device work) while the
  others do the same, then creates it for real. The real creations take
  turns: XLA's CPU client can deadlock when many threads run computations
  over the same 8 devices at once (seen under two pytest workers), which is
  XLA's matter, not the rules'. Every context stays open throughout, so each
  creation still happens beside 31 other threads' rules.
  """
  n = 32
  barrier = threading.Barrier(n)
  devices = threading.Lock()

  def make(i):
    return nnx.Linear(
      8, 16, kernel_init=_lecun(('embed', 'mlp')), rngs=nnx.Rngs(i)
    )

  def work(i):
    axis = ('data', 'model')[i % 2]
    with (
      jax.set_mesh(explicit_mesh),
      fdt.logical_axis_rules([('embed', None), ('mlp', axis)]),
    ):
      barrier.wait(timeout=60)
      abstract = nnx.eval_shape(lambda: make(i))
      planned = abstract.kernel.get_value().sharding.spec
      barrier.wait(timeout=60)
      with devices:
        layer = make(i)
      reported = nnx.get_partition_spec(nnx.state(layer))['kernel']
      barrier.wait(timeout=60)
    return i, planned, layer.kernel.sharding.spec, reported.get_value()

  with concurrent.futures.ThreadPoolExecutor(n) as pool:
    for i, planned, placed, reported in pool.map(work, range(n)):
      expected = P(None, ('data', 'model')[i % 2])
      assert planned == placed == reported == expected


def test_concrete_array_with_only_an_abstract_mesh_raises():
  mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
  with pytest.raises(
    fdt.MeshError,
    match=r'a concrete array outside jit, where JAX needs the devices; got '
    r'the abstract mesh\(data=2, model=4; \w+, \w+\) \(passed as `mesh=`\)',
  ):
    fdt.shard_value(jnp.ones((8, 4)), ('batch', None), mesh=mesh, rules=RULES)
  x = jnp.ones((8, 4))  # Made outside: JAX 0.12 makes none under it.
  with (
    jax.sharding.use_abstract_mesh(mesh),
    fdt.logical_axis_rules(RULES),
    pytest.raises(
      fdt.MeshError,
      match=r'got the abstract mesh\(data=2, model=4; \w+, \w+\) \(in '
      r'effect by `jax.sharding.use_abstract_mesh`\), which has none',
    ),
  ):
    fdt.with_logical_constraint(x, ('batch', None))


@pytest.mark.parametrize('jit', ['jax.jit', 'nnx.jit'])
def test_with_logical_constraint_on_an_array_a_jitted_function_closes_over(
  any_mesh, jit
):
  """A train step that closes over its batch: the constraint places the
  captured array as it places a traced one, and as eagerly."""
  mesh = any_mesh
  x = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16)
  wrap = jax.jit if jit == 'jax.jit' else nnx.jit
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    captured = wrap(
      lambda: fdt.with_logical_constraint(x, ('batch', 'mlp')) * 2.0
    )()
    traced = wrap(
      lambda v: fdt.with_logical_constraint(v, ('batch', 'mlp')) * 2.0
    )(x)
    eager = fdt.with_logical_constraint(x, ('batch', 'mlp')) * 2.0
    # JAX's own spelling, in the same place, for the mesh's axis types.
    reference = jax.jit(
      lambda: cm.constrain(x, mesh, P('data', 'model'), bare=True) * 2.0
    )()
  for out in (captured, traced, eager):
    assert jax.typeof(out) == jax.typeof(reference)
    assert out.sharding.is_equivalent_to(reference.sharding, 2)
    _shard_values_equal(out, np.asarray(x) * 2.0)


# Fewer logical names than dimensions: Flax's reading, everywhere
# ------------------------------------------------------------------------------


class _Short(nnx.Module):
  """The annotation of flax#5127's repro: one name for a matrix."""

  def __init__(self):
    self.w = nnx.Param(
      jnp.arange(256, dtype=jnp.float32).reshape(16, 16), out_sharding=('C',)
    )


def test_fewer_names_than_dims_place_as_flax_reads_them(any_mesh):
  """('C',) on a matrix is ('C', None): eager creation, creation inside
  `nnx.jit`, `fdt.init`, `nnx.get_partition_spec` and `fdt.plan` agree,
  with plain Flax's placement."""
  mesh = any_mesh
  rules = [('C', 'data')]
  expected = P('data', None)
  with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
    eager = _Short()
    jitted = nnx.jit(_Short)()
    built = fdt.init(_Short)
    reported = nnx.get_partition_spec(nnx.state(eager))['w'].get_value()
    planned = fdt.plan(_Short)['w']
  for model in (eager, jitted, built):
    spec = model.w[...].sharding.spec  # P('data',) on Auto axes.
    assert (*spec, *(None,) * (2 - len(spec))) == tuple(expected)
    _shard_values_equal(model.w[...], np.arange(256).reshape(16, 16))
  assert tuple(reported) == tuple(expected)
  assert planned.spec == expected
  assert planned.logical_axes == ('C', None)
  if mesh.axis_types[0] != mesh.axis_types[1]:
    return  # Flax refuses mixed meshes.
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    flax_own = _Short()
  assert flax_own.w[...].sharding.is_equivalent_to(
    NamedSharding(mesh, expected), 2
  )


def test_more_names_than_dims_is_an_error(explicit_mesh):
  with (
    jax.set_mesh(explicit_mesh),
    fdt.logical_axis_rules(RULES),
    pytest.raises(
      fdt.ShardingResolutionError,
      match=r'at most one logical axis per dimension: the array has shape '
      r"\(16,\) \(rank 1\) but got 2 logical axes \('embed', 'mlp'\)",
    ),
  ):
    nnx.Param(jnp.ones((16,)), out_sharding=('embed', 'mlp'))


def test_a_constraint_on_one_device_is_typed_alike_eagerly_and_under_jit():
  """On an Explicit mesh of one device, a size-1 axis is in the type
  (f32[32@data,16]): the eager constraint gives what jit gives, as
  `reshard` does, so the same code means the same thing in both."""
  mesh = jax.make_mesh((1,), ('data',))
  rules = [('batch', 'data'), ('embed', None)]
  with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
    # Made here, as a forward makes it: on the mesh, P(None, None).
    x = jnp.arange(32 * 16, dtype=jnp.float32).reshape(32, 16)
    eager = fdt.with_logical_constraint(x, ('batch', 'embed'))
    jitted = jax.jit(
      lambda v: fdt.with_logical_constraint(v, ('batch', 'embed'))
    )(x)
    reference = jax.sharding.reshard(x, P('data', None))
  assert jax.typeof(eager) == jax.typeof(jitted) == jax.typeof(reference)
  assert str(jax.typeof(eager)) == 'float32[32@data,16]'
  np.testing.assert_array_equal(eager, x)
