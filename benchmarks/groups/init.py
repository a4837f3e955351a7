"""Sharded creation: `fdt.init` and eager creation against Flax's eager
sharding, Flax inside ``nnx.jit`` and unsharded creation (groups `init`,
`init_scaling`, `path_rules`), and every spelling of a factory.
"""

from __future__ import annotations

import time

import harness
import models


def init(
  method: str, layers: int, width: int, stack: str = 'list', axes: str = ''
) -> dict:
  """One build, timed: `method` of `layers` blocks (a list, or with `stack`
  'vmap' stacked by ``nnx.vmap``), on a (2, 4) mesh of Explicit axes (Auto
  for 'vmap', or with `axes` 'auto'). A method ending in ``_again`` is
  timed on its second call of the same configuration (the first untimed)."""
  jax = harness.cpu_jax()
  from flax import nnx

  import flax_dtensor as fdt

  again = method.endswith('_again')
  method = method.removesuffix('_again')
  stack_ = models.mlp_stack(
    layers,
    width,
    annotated=not method.endswith('_paths'),
    vmap=stack == 'vmap',
  )
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  if stack == 'vmap' or axes == 'auto':  # Flax's idiom: an Auto mesh.
    mesh = jax.make_mesh(
      (2, 4), ('data', 'model'), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )
  stack = stack_
  rules = [('embed', 'data'), ('mlp', 'model')]
  path_rules = fdt.LogicalRules(rules, path_rules=models.PATH_RULES)
  jax.block_until_ready(jax.numpy.zeros(8) + 1)  # Start the backend.

  def build():
    if method == 'unsharded':
      with nnx.use_eager_sharding(False):
        return stack(nnx.Rngs(0))
    if method == 'flax_eager':
      with jax.set_mesh(mesh), nnx.logical_axis_rules(tuple(rules)):
        return stack(nnx.Rngs(0))
    if method == 'fdt_eager':
      with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
        return stack(nnx.Rngs(0))
    if method == 'replicated':  # Every device holds every parameter.
      with (
        jax.set_mesh(mesh),
        fdt.logical_axis_rules([('embed', None), ('mlp', None)]),
      ):
        return stack(nnx.Rngs(0))
    if method == 'fdt_init':
      return fdt.init(stack, nnx.Rngs(0), mesh=mesh, rules=rules)
    if method == 'fdt_init_paths':  # Un-annotated, by path rules.
      return fdt.init(stack, nnx.Rngs(0), mesh=mesh, rules=path_rules)
    if method == 'fdt_eager_paths':  # Created whole, then moved once.
      with jax.set_mesh(mesh), fdt.logical_axis_rules(path_rules):
        return stack(nnx.Rngs(0))
    if method == 'unsharded_paths':
      with nnx.use_eager_sharding(False):
        return stack(nnx.Rngs(0))
    if method == 'flax_jit':  # Flax's eager sharding inside nnx.jit.
      with jax.set_mesh(mesh), nnx.logical_axis_rules(tuple(rules)):
        return nnx.jit(lambda: stack(nnx.Rngs(0)))()
    if method == 'flax_jit_factory':  # Flax's idiom: a jitted factory.
      with jax.set_mesh(mesh), nnx.logical_axis_rules(tuple(rules)):
        return jitted_factory()
    raise ValueError(method)

  @nnx.jit
  def jitted_factory():
    """Flax's documented idiom, defined once (its compile is cached): the
    model built under jit, its state constrained to its partition specs."""
    model = stack(nnx.Rngs(0))
    state = nnx.state(model)
    specs = nnx.get_partition_spec(state)
    nnx.update(model, jax.lax.with_sharding_constraint(state, specs))
    return model

  model, seconds, before = _time_build(build, again)
  blocks = model.blocks
  first = blocks[0] if isinstance(blocks, nnx.List) else blocks
  return _measured(seconds, before, model, first.up.kernel.get_value())


def _time_build(build, again):
  """What `build` returns, the seconds it took to build and the RSS (MiB)
  before it; after an untimed first call when `again`."""
  import jax  # Set up by the caller's `harness.cpu_jax()`.
  from flax import nnx

  if again:  # The first call of this configuration, untimed.
    jax.block_until_ready(nnx.state(build()))
  before = harness.reset_peak()
  start = time.perf_counter()
  built = build()
  jax.block_until_ready(nnx.state(built))
  return built, time.perf_counter() - start, before


def _measured(seconds, before, model, kernel):
  """The result of one build of `model`, whose `kernel` shows its shards."""
  import jax
  from flax import nnx

  params = nnx.state(model, nnx.Param)
  return harness.result(
    seconds,
    before,
    harness.rss_mib(),
    param_bytes=sum(x.nbytes for x in jax.tree.leaves(params)),
    shard_shape=list(kernel.addressable_shards[0].data.shape),
  )


# The spellings of a factory: where the `nnx.Rngs` lives, and what else the
# factory builds. Each is (ours, Flax's): `fdt.init` of it, and the same
# factory under `nnx.jit`, the way Flax's sharding guide writes it.
SPELLINGS = (
  'rngs_inside',
  'rngs_passed',
  'keywords',
  'partial',
  'optimizer',
)


def init_spelling(method: str, spelling: str, layers: int, width: int) -> dict:
  """One build of `layers` annotated ``nnx.Linear(width, width)``, spelled
  as `spelling` (`SPELLINGS`), on a (2, 4) mesh (jax.make_mesh's default
  axis types): `method` 'fdt_init' or 'flax_jit' (an ``nnx.jit`` of the
  same factory, defined once, under ``jax.set_mesh`` and Flax's rules). A
  method ending in ``_again`` is timed on its second call (the first
  untimed)."""
  import functools

  jax = harness.cpu_jax()
  import optax
  from flax import nnx

  import flax_dtensor as fdt

  again = method.endswith('_again')
  method = method.removesuffix('_again')
  rules = [('embed', 'data'), ('mlp', 'model')]
  mesh = jax.make_mesh((2, 4), ('data', 'model'))

  class Model(nnx.Module):
    def __init__(self, rngs, width=width):
      kernel = nnx.with_partitioning(
        nnx.initializers.lecun_normal(), ('embed', 'mlp')
      )
      self.layers = nnx.List(
        [
          nnx.Linear(width, width, kernel_init=kernel, rngs=rngs)
          for _ in range(layers)
        ]
      )

  def with_optimizer():
    model = Model(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

  # Each: the factory, and how it is called (fdt.init's extra arguments).
  factory, args, kwargs = {
    'rngs_inside': (lambda: Model(nnx.Rngs(0)), (), {}),
    'rngs_passed': (Model, (nnx.Rngs,), {}),
    'keywords': (Model, (), {'rngs': nnx.Rngs, 'width': width}),
    'partial': (functools.partial(Model, width=width), (nnx.Rngs,), {}),
    'optimizer': (with_optimizer, (), {}),
  }[spelling]

  def fresh(x):  # A new nnx.Rngs(0) at each call, as a user writes it.
    return x(0) if x is nnx.Rngs else x

  static = tuple(k for k, v in kwargs.items() if v is not nnx.Rngs)
  jitted = nnx.jit(factory, static_argnames=static)
  jax.block_until_ready(jax.numpy.zeros(8) + 1)  # Start the backend.

  def build():
    a = [fresh(x) for x in args]
    k = {n: fresh(x) for n, x in kwargs.items()}
    if method == 'fdt_init':
      return fdt.init(factory, *a, mesh=mesh, rules=rules, **k)
    if method == 'flax_jit':
      with jax.set_mesh(mesh), nnx.logical_axis_rules(tuple(rules)):
        return jitted(*a, **k)
    raise ValueError(method)

  built, seconds, before = _time_build(build, again)
  model = built[0] if isinstance(built, tuple) else built
  return _measured(seconds, before, model, model.layers[0].kernel.get_value())


_INIT = {
  'ours': 'fdt_init',
  'ours_eager': 'fdt_eager',
  'peer': 'flax_eager',
  'limit': 'unsharded',
}
_INIT_RATIOS = [
  ('ours', 'limit'),
  ('ours_eager', 'limit'),
  ('ours_eager', 'peer'),
]


# A second `fdt.init` of one configuration reuses the first's compiled
# build; Flax's idiom, a jitted factory defined once, is cached by jit.
_INIT_AGAIN = harness.case(
  'init',
  {'layers': 8, 'width': 1024, 'stack': 'vmap'},
  {
    'ours': 'fdt_init',
    'peer': 'flax_jit_factory',
    'ours_again': 'fdt_init_again',
    'peer_again': 'flax_jit_factory_again',
  },
  [('ours', 'peer'), ('ours_again', 'peer_again')],
  note='8 blocks stacked by nnx.vmap (67M params, the traced build), on a '
  '(2, 4) Auto mesh: the first call, and a second of the same '
  "configuration, against Flax's idiom (an @nnx.jit factory constraining "
  'the state to nnx.get_partition_spec, defined once: cached after its '
  'first call)',
)


# Every spelling of a factory (`SPELLINGS`: the Rngs made inside it,
# passed in, keyword arguments, functools.partial, the optimizer built in
# it), each against Flax's `nnx.jit` of the same factory in the same run:
# the first call and a second of the same configuration.
_SPELLING_METHODS = {
  'ours': 'fdt_init',
  'peer': 'flax_jit',
  'ours_again': 'fdt_init_again',
  'peer_again': 'flax_jit_again',
}


def _spellings(layers, width=64):
  return [
    harness.case(
      'init_spelling',
      {'spelling': spelling, 'layers': layers, 'width': width},
      _SPELLING_METHODS,
      [('ours', 'peer'), ('ours_again', 'peer_again')],
      note=f'{layers} annotated nnx.Linear({width}, {width}) ({2 * layers} '
      f'arrays), spelled {spelling}, on a (2, 4) mesh of Explicit axes',
    )
    for spelling in (
      'rngs_inside',
      'rngs_passed',
      'keywords',
      'partial',
      'optimizer',
    )
  ]


# One accelerator (`--only gpu`; no TensorFlow needed): a Llama-like decoder
# in bfloat16 on jax.make_mesh's default mesh over the local devices. The
# first and second build against Flax's jitted factory, eager creation
# against Flax's, the plan against nnx.eval_shape, and a jitted train step


# The second build where the variables are many and small (200: 50 blocks
# of two Linear layers, width 16), where work per variable shows.
_INIT_AGAIN_SMALL = harness.case(
  'init',
  {'layers': 50, 'width': 16, 'axes': 'auto'},
  _INIT_AGAIN['methods'],
  [('ours', 'peer'), ('ours_again', 'peer_again')],
  note='200 small variables (50 blocks of Linear(16, 64) + Linear(64, 16)) '
  "on a (2, 4) Auto mesh: first and second call against Flax's jitted "
  'factory',
)


CASES = {'init': init, 'init_spelling': init_spelling}


def full():
  return {
    'init': [
      harness.case(
        'init',
        {'layers': 24, 'width': 1024},
        _INIT,
        _INIT_RATIOS,
        note='201M params (768 MiB); (2, 4) Explicit mesh',
      ),
      harness.case(
        'init',
        {'layers': 6, 'width': 1024},
        {'ours': 'fdt_init', 'peer': 'flax_jit', 'limit': 'unsharded'},
        [('ours', 'peer'), ('ours', 'limit')],
        note="Flax's eager sharding inside nnx.jit, at 1/4 the size",
      ),
      _INIT_AGAIN,
      _INIT_AGAIN_SMALL,
      *_spellings(100),
    ],
    'init_scaling': [
      harness.case(
        'init',
        {'layers': layers, 'width': 1024},
        {k: _INIT[k] for k in ('ours', 'ours_eager', 'limit')},
        _INIT_RATIOS[:2],
      )
      for layers in (6, 12, 24, 48, 96)
    ],
    'path_rules': [
      harness.case(
        'init',
        {'layers': 24, 'width': 1024},
        {
          'ours': 'fdt_init_paths',
          'ours_eager': 'fdt_eager_paths',
          'peer': 'fdt_init',
          'limit': 'unsharded_paths',
        },
        [('ours', 'peer'), ('ours', 'limit'), ('ours_eager', 'limit')],
        note=(
          '201M params without annotations, placed by path rules, against '
          'the annotated stack of the same size; (2, 4) Explicit mesh'
        ),
      ),
    ],
  }


def quick():
  return {
    'init': [
      harness.case('init', {'layers': 2, 'width': 256}, _INIT, _INIT_RATIOS),
      {**_INIT_AGAIN, 'params': {'layers': 2, 'width': 256, 'stack': 'vmap'}},
      *_spellings(40),
    ],
  }
