"""One measurement, in a fresh process: ``python cases.py CASE METHOD ARGS``.

Prints one JSON line: wall seconds of the measured step, and the process's
peak RSS from the OS (``resource.getrusage``) before the step (the runtime's
baseline: Python, JAX, the backend, TF where used) and after it. `run.py`
calls it; each case compares flax_dtensor with its peer and with the
machine's limit, measured the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
import warnings

import numpy as np

os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
warnings.simplefilter('ignore')


def _status_mib(field: str) -> float | None:
  try:
    with open('/proc/self/status') as f:
      for line in f:
        if line.startswith(field + ':'):
          return int(line.split()[1]) / 1024
  except OSError:
    pass
  return None


def _reset_peak() -> float:
  """Starts a new peak-RSS window; returns the resident MiB it starts from.

  On Linux, writing 5 to /proc/self/clear_refs resets the high-water mark
  (VmHWM) to the current RSS, so a peak reached while importing or starting
  the backend cannot hide the peak of the measured step. Elsewhere the
  process's lifetime peak (ru_maxrss) stands in.
  """
  try:
    with open('/proc/self/clear_refs', 'w') as f:
      f.write('5')
  except OSError:
    return _rss_mib()
  current = _status_mib('VmRSS')
  return _rss_mib() if current is None else current


def _rss_mib() -> float:
  """Peak resident MiB since the last `_reset_peak()` (or process start)."""
  peak = _status_mib('VmHWM')
  if peak is not None:
    return peak
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _jax(devices: int = 8):
  import jax

  jax.config.update('jax_num_cpu_devices', devices)
  return jax


# Sharded creation
# ------------------------------------------------------------------------------


# The un-annotated stack's path rules: the annotated stack's placement.
PATH_RULES = [
  (r'up/kernel$', ('embed', 'mlp')),
  (r'down/kernel$', ('mlp', 'embed')),
]


def _mlp_stack(
  layers: int, width: int, annotated: bool = True, vmap: bool = False
):
  """`layers` x (Linear(width -> 4 width) + Linear(4 width -> width)).

  Annotated with logical axes, or, with `annotated=False`, as plain
  ``nnx.Linear`` layers with no sharding metadata (placed by `PATH_RULES`).
  With `vmap`, the blocks are stacked by ``nnx.vmap`` (one array per kind
  of weight, a leading layer dimension): `fdt.init` builds it traced.
  """
  from flax import nnx

  init = nnx.initializers.lecun_normal()

  def kernel_init(axes):
    return nnx.with_partitioning(init, axes) if annotated else init

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(
        width, 4 * width, kernel_init=kernel_init(('embed', 'mlp')), rngs=rngs
      )
      self.down = nnx.Linear(
        4 * width, width, kernel_init=kernel_init(('mlp', 'embed')), rngs=rngs
      )

  class Stack(nnx.Module):
    def __init__(self, rngs):
      self.blocks = nnx.List([Block(rngs) for _ in range(layers)])

  class VmapStack(nnx.Module):
    def __init__(self, rngs):
      @nnx.split_rngs(splits=layers)
      @nnx.vmap(
        in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None}
      )
      def make(rngs):
        return Block(rngs)

      self.blocks = make(rngs)

  return VmapStack if vmap else Stack


def init(
  method: str, layers: int, width: int, stack: str = 'list', axes: str = ''
) -> dict:
  """One build, timed: `method` of `layers` blocks (a list, or with `stack`
  'vmap' stacked by ``nnx.vmap``), on a (2, 4) mesh of Explicit axes (Auto
  for 'vmap', or with `axes` 'auto'). A method ending in ``_again`` is
  timed on its second call of the same configuration (the first untimed)."""
  jax = _jax()
  from flax import nnx

  import flax_dtensor as fdt

  again = method.endswith('_again')
  method = method.removesuffix('_again')
  stack_ = _mlp_stack(
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
  path_rules = fdt.LogicalRules(rules, path_rules=PATH_RULES)
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

  if again:  # The first call of this configuration, untimed.
    jax.block_until_ready(nnx.state(build()))
  before = _reset_peak()
  start = time.perf_counter()
  model = build()
  jax.block_until_ready(nnx.state(model))
  seconds = time.perf_counter() - start
  params = nnx.state(model, nnx.Param)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
  blocks = model.blocks
  first = blocks[0] if isinstance(blocks, nnx.List) else blocks
  kernel = first.up.kernel.get_value()
  return {
    'seconds': seconds,
    'rss_before_mib': before,
    'rss_peak_mib': _rss_mib(),
    'param_bytes': nbytes,
    'shard_shape': list(kernel.addressable_shards[0].data.shape),
  }


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

  jax = _jax()
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

  if again:  # The first call of this configuration, untimed.
    jax.block_until_ready(nnx.state(build()))
  before = _reset_peak()
  start = time.perf_counter()
  built = build()
  jax.block_until_ready(nnx.state(built))
  seconds = time.perf_counter() - start
  model = built[0] if isinstance(built, tuple) else built
  kernel = model.layers[0].kernel.get_value()
  return {
    'seconds': seconds,
    'rss_before_mib': before,
    'rss_peak_mib': _rss_mib(),
    'param_bytes': sum(
      x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param))
    ),
    'shard_shape': list(kernel.addressable_shards[0].data.shape),
  }


# Planning
# ------------------------------------------------------------------------------


def _many_variables(n: int):
  """A model with `n` annotated variables (n / 2 bias-free Linear layers)."""
  from flax import nnx

  init = nnx.with_partitioning(
    nnx.initializers.lecun_normal(), ('embed', 'mlp')
  )

  class Many(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.List(
        [
          nnx.Linear(64, 64, use_bias=False, kernel_init=init, rngs=rngs)
          for _ in range(n)
        ]
      )

  return lambda: Many(nnx.Rngs(0))


def plan(method: str, variables: int) -> dict:
  jax = _jax()
  from flax import nnx

  import flax_dtensor as fdt

  mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
  rules = fdt.LogicalRules([('embed', 'data'), ('mlp', 'model')])
  factory = _many_variables(variables)
  before = _reset_peak()
  start = time.perf_counter()
  if method == 'fdt_plan_factory':
    result = fdt.plan(factory, mesh=mesh, rules=rules)
    count = len(result.entries)
  elif method == 'flax_eval_shape':
    with (
      jax.sharding.use_abstract_mesh(mesh),
      nnx.logical_axis_rules(tuple(rules)),
    ):
      abstract = nnx.eval_shape(factory)
    count = len(jax.tree.leaves(nnx.state(abstract)))
  elif method == 'eval_shape_then_plan':
    with jax.sharding.use_abstract_mesh(mesh), fdt.logical_axis_rules(rules):
      abstract = nnx.eval_shape(factory)
      count = len(fdt.plan(abstract).entries)
  else:
    raise ValueError(method)
  seconds = time.perf_counter() - start
  return {
    'seconds': seconds,
    'rss_before_mib': before,
    'rss_peak_mib': _rss_mib(),
    'variables': count,
  }


# Export to TensorFlow
# ------------------------------------------------------------------------------

_LAYOUTS = {
  'mixed': (
    ('data', 'model'),
    ('model', 'data'),
    (None, 'model'),
    ('data', None),
    (None, None),
  ),
  # One dimension over both mesh axes: DTensor has no such layout on the
  # (2, 4) mesh; flax_dtensor fuses the axes, orbax-export reshards.
  'product': ((('data', 'model'), None),),
  # Every array split over all 8 devices (FSDP and tensor parallelism).
  'sharded': (('data', 'model'), ('model', 'data'), (('data', 'model'), None)),
}


def _arrays(jax, count: int, mib: float, layouts: str = 'mixed', fill=0):
  """`count` float32 arrays of `mib` MiB each, in the given layouts, on
  a (2, n / 2) mesh of the n devices.

  Their values are random normal (seeded by `fill` and the array's
  position), as trained weights are: a constant array would let a writer
  that compresses (orbax-checkpoint's zstd, on by default) write almost
  nothing.
  """
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  devices = jax.device_count()
  mesh = jax.make_mesh(
    (2, devices // 2),
    ('data', 'model'),
    axis_types=(jax.sharding.AxisType.Auto,) * 2,
  )
  rows = 256
  cols = int(mib * 2**20 / 4 / rows)
  cols -= cols % 8
  specs = _LAYOUTS[layouts]
  out = []
  for i in range(count):
    spec = P(*specs[i % len(specs)])
    rng = np.random.default_rng(i + fill)
    value = rng.standard_normal((rows, cols), dtype=np.float32)
    out.append((jax.device_put(value, NamedSharding(mesh, spec)), spec))
  jax.block_until_ready([a for a, _ in out])
  return mesh, out


def to_tf(
  method: str,
  arrays: int,
  mib: float,
  layouts: str = 'mixed',
  warm: bool = False,
) -> dict:
  """JAX arrays to DTensor variables.

  `warm`: convert other arrays of the same layouts first, so TF's one-time
  costs (compiling its variable ops for each layout) are paid outside the
  measurement.
  """
  jax = _jax()
  from flax import nnx

  from flax_dtensor import dtensor as fdt_tf

  fdt_tf.initialize()
  tf = sys.modules['tensorflow']
  dt = tf.experimental.dtensor
  mesh, values = _arrays(jax, arrays, mib, layouts)

  def method_for(values):
    state = nnx.State(
      {f'v{i}': nnx.Param(a) for i, (a, _) in enumerate(values)}
    )
    if method == 'orbax':
      from orbax.export import dtensor_utils

      dmesh = dtensor_utils.jax_mesh_to_dtensor_mesh(mesh)  # Not timed.
      return lambda: [
        dt.DVariable(
          dtensor_utils.jax_array_to_dtensor(
            a,
            spec,
            dmesh,
            jax_mesh=mesh,
            allow_multi_axis_sharding_consolidation=True,
          )
        )
        for a, spec in values
      ]
    if method == 'fdt':
      return lambda: fdt_tf.to_tf_module(state)
    if method == 'fdt_single_mesh':
      return lambda: fdt_tf.to_tf_module(state, single_mesh=True)
    if method in ('pack', 'dvariable'):
      # The floor: the same shards packed into DTensors (layouts and shard
      # order given), and for 'dvariable' then held by DVariables.
      from flax_dtensor.dtensor._layout import _layouts

      layouts_ = [_layouts.layout_for(a.sharding, a.ndim) for a, _ in values]
      shards = [
        [np.asarray(s.data) for s in _sorted_shards(a)] for a, _ in values
      ]
      if method == 'pack':
        return lambda: [
          dt.pack(x, layout) for x, layout in zip(shards, layouts_, strict=True)
        ]
      return lambda: [
        dt.DVariable(dt.pack(x, layout))
        for x, layout in zip(shards, layouts_, strict=True)
      ]
    raise ValueError(method)

  if warm:
    _, others = _arrays(jax, arrays, mib, layouts, fill=arrays)
    method_for(others)()
    del others
  run = method_for(values)
  before = _reset_peak()
  start = time.perf_counter()
  out = run()
  seconds = time.perf_counter() - start
  del out
  return {
    'seconds': seconds,
    'rss_before_mib': before,
    'rss_peak_mib': _rss_mib(),
    'bytes': sum(a.nbytes for a, _ in values),
  }


def _fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _sorted_shards(arr):
  """The array's shards in the order of the layout's local device ids."""
  from flax_dtensor.dtensor._layout import _layouts

  dmesh, _, record = _layouts.layout_parts(arr.sharding, arr.ndim)
  by_device = {s.device: s for s in arr.addressable_shards}
  return [
    by_device[record.devices.flat[int(g)]] for g in dmesh.local_device_ids()
  ]


# Checkpoints
# ------------------------------------------------------------------------------


def checkpoint(
  method: str,
  arrays: int,
  mib: float,
  cache: str = 'hot',
  layouts: str = 'mixed',
  target: str = 'saved',
  again: int = 0,
) -> dict:
  """Writing and reading a checkpoint, and the raw bytes the same way.

  `again`: for `save` and `raw_write`, that many writes of the same state
  into new files first, in this process (as a training loop saves): the
  one timed is the next.

  The limits write each distinct shard to its own file with NumPy (and
  fsync), read them back with NumPy, and for `raw_read_place` also place
  them on the devices as the restore does. `cache='cold'` evicts the files
  from the page cache (``posix_fadvise``) before a read. `target=
  'transposed'` restores each array onto the mesh axes of its dimensions
  swapped (`P('model', 'data')` for `P('data', 'model')`): no device then
  holds a saved shard, and every byte read is cut and checked on the host.
  """
  jax = _jax()
  from flax import nnx

  from flax_dtensor import dtensor as fdt_tf

  fdt_tf.initialize()
  _, values = _arrays(jax, arrays, mib, layouts)
  state = nnx.State({f'v{i}': nnx.Param(a) for i, (a, _) in enumerate(values)})
  nbytes = sum(a.nbytes for a, _ in values)
  root = tempfile.mkdtemp(prefix='fdt_bench_', dir=os.environ.get('BENCH_DIR'))
  path = os.path.join(root, 'ckpt')
  # Each distinct shard once: [(array index, shard index, host bytes)].
  shards = [
    (i, index, np.asarray(s.data))
    for i, (a, _) in enumerate(values)
    for index, s in {str(s.index): s for s in a.addressable_shards}.items()
  ]
  reads = method in ('restore', 'raw_read', 'raw_read_place', 'orbax_restore')
  if reads:
    if method == 'orbax_restore':
      _orbax('orbax_save', state, os.path.join(root, 'orbax'), 0.0)
    fdt_tf.save_checkpoint(state, path)
    for k, (_, _, shard) in enumerate(shards):
      _write(os.path.join(root, f'raw{k}'), shard)
    abstract = jax.tree.map(
      lambda v: v, state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    if target == 'transposed':
      from jax.sharding import NamedSharding
      from jax.sharding import PartitionSpec as P

      for i, (_, spec) in enumerate(values):
        variable = abstract[f'v{i}']
        swapped = P(*reversed(tuple(spec) + (None,) * (2 - len(spec))))
        value = variable.get_value()
        variable.set_value(
          jax.device_put(value, NamedSharding(value.sharding.mesh, swapped))
        )
    shapes = [(a.shape, a.sharding) for a, _ in values]
    del state, values  # Only what the restore creates stays.
    if cache == 'cold':
      _evict(root)
  if again and method not in ('save', 'raw_write'):
    raise ValueError(f'again= is for save and raw_write, not {method}')
  for k in range(again):  # Earlier writes, each into new files.
    if method == 'save':
      fdt_tf.save_checkpoint(state, os.path.join(root, f'earlier{k}'))
    else:
      earlier = os.path.join(root, f'earlier{k}')
      os.mkdir(earlier)
      for j, (_, _, shard) in enumerate(shards):
        _write(os.path.join(earlier, f'raw{j}'), shard)
      _fsync_dir(earlier)
  before = _reset_peak()
  start = time.perf_counter()
  if method == 'save':
    fdt_tf.save_checkpoint(state, path)
  elif method == 'save_single_mesh':
    fdt_tf.save_checkpoint(state, path, single_mesh=True)
  elif method == 'raw_write':
    for k, (_, _, shard) in enumerate(shards):
      _write(os.path.join(root, f'raw{k}'), shard)
    _fsync_dir(root)
  elif method == 'save_async_stall':
    handle = fdt_tf.save_checkpoint(state, path, blocking=False)
    seconds = time.perf_counter() - start
    handle.wait()
  elif method == 'save_async':
    fdt_tf.save_checkpoint(state, path, blocking=False).wait()
  elif method == 'host_copy':
    # The state copied to host memory: each distinct shard once.
    copies = [np.array(shard, copy=True) for _, _, shard in shards]
    del copies
  elif method.startswith('orbax_'):
    tree = abstract if method == 'orbax_restore' else state
    seconds = _orbax(method, tree, path, start)
  elif method == 'tf_write':
    tf = sys.modules['tensorflow']
    tf.train.Checkpoint(fdt_tf.to_tf_module(state)).write(path)
  elif method == 'restore':
    out = fdt_tf.restore_checkpoint(path, abstract)
    jax.block_until_ready(jax.tree.leaves(out))
  elif method in ('raw_read', 'raw_read_place'):
    host = {}
    for k, (i, index, shard) in enumerate(shards):
      # Into 64-byte-aligned buffers, which JAX on CPU places without a
      # copy (one buffer for all replicas): the floor at its best.
      host[i, index] = _aligned_read(os.path.join(root, f'raw{k}'), shard)
    if method == 'raw_read_place':
      placed = []
      for i, (shape, sharding) in enumerate(shapes):
        devices = sharding.addressable_devices_indices_map(shape)
        bufs = jax.device_put(
          [host[i, str(index)] for index in devices.values()], list(devices)
        )
        placed.append(
          jax.make_array_from_single_device_arrays(shape, sharding, bufs)
        )
      jax.block_until_ready(placed)
  else:
    raise ValueError(method)
  if method not in ('save_async_stall', 'orbax_async_stall'):
    seconds = time.perf_counter() - start

  shutil.rmtree(root, ignore_errors=True)
  return {
    'seconds': seconds,
    'rss_before_mib': before,
    'rss_peak_mib': _rss_mib(),
    'bytes': nbytes,
  }


def _orbax(method: str, state, path: str, start: float) -> float:
  """orbax-checkpoint's save or restore of `state`; the seconds measured.

  `orbax_save` is its synchronous `Checkpointer`; `orbax_async` is
  `StandardCheckpointer.save` then `wait_until_finished()`, and
  `orbax_async_stall` the time until that save returns. Orbax does not
  fsync the files it writes: `orbax_save_fsync` adds the flush ours does.
  """
  import jax
  import orbax.checkpoint as ocp
  from flax import nnx

  orbax = os.path.join(os.path.dirname(path), 'orbax')
  tree = nnx.to_pure_dict(state)
  if method in ('orbax_save', 'orbax_save_fsync'):
    ocp.Checkpointer(ocp.StandardCheckpointHandler()).save(
      orbax, args=ocp.args.StandardSave(tree)
    )
    if method == 'orbax_save_fsync':
      for directory, _, names in os.walk(orbax):
        for name in [*names, '.']:
          fd = os.open(os.path.join(directory, name), os.O_RDONLY)
          os.fsync(fd)
          os.close(fd)
  elif method in ('orbax_async', 'orbax_async_stall'):
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(orbax, tree)
    stall = time.perf_counter() - start
    checkpointer.wait_until_finished()
    checkpointer.close()
    if method == 'orbax_async_stall':
      return stall
  elif method == 'orbax_restore':
    abstract = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
      tree,
    )
    restored = ocp.StandardCheckpointer().restore(orbax, abstract)
    jax.block_until_ready(restored)
  else:
    raise ValueError(method)
  return time.perf_counter() - start


# The way back from TensorFlow
# ------------------------------------------------------------------------------


def from_tf(
  method: str, arrays: int, mib: float, layouts: str = 'mixed'
) -> dict:
  """DVariables (from `to_tf_module`) back into JAX arrays.

  `same_layout` restores into the layouts exported, `other_layout` into
  every array's spec reversed; `device_put` is JAX moving the same arrays
  to those other layouts (its own way of copying them). `copied_bytes` sums
  the result's distinct buffers that are not one of TF's components (by
  address): 0 when nothing was copied.
  """
  jax = _jax()
  from flax import nnx
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from flax_dtensor import dtensor as fdt_tf

  fdt_tf.initialize()
  dt = sys.modules['tensorflow'].experimental.dtensor
  mesh, values = _arrays(jax, arrays, mib, layouts)
  state = nnx.State({f'v{i}': nnx.Param(a) for i, (a, _) in enumerate(values)})
  tf_module = fdt_tf.to_tf_module(state)
  other = {
    f'v{i}': NamedSharding(mesh, P(*reversed((tuple(spec) + (None,) * 2)[:2])))
    for i, (_, spec) in enumerate(values)
  }
  if method == 'same_layout':
    target = state
  elif method in ('other_layout', 'device_put'):
    target = nnx.State(
      {
        k: nnx.Param(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=other[k]))
        for k, v in ((k, state[k].get_value()) for k in other)
      }
    )
  else:
    raise ValueError(method)
  tf_buffers = {
    c._numpy().ctypes.data
    for v in tf_module.variables
    for c in dt.unpack(v.read_value())
  }
  before = _reset_peak()
  start = time.perf_counter()
  if method == 'device_put':
    out = [jax.device_put(state[k].get_value(), s) for k, s in other.items()]
  else:
    restored = fdt_tf.from_tf_module(tf_module, target)
    out = [v.get_value() for _, v in nnx.to_flat_state(restored)]
  jax.block_until_ready(out)
  seconds = time.perf_counter() - start
  new_buffers = {
    s.data.unsafe_buffer_pointer(): s.data.nbytes
    for a in out
    for s in a.addressable_shards
  }
  copied = sum(n for p, n in new_buffers.items() if p not in tf_buffers)
  return {
    'seconds': seconds,
    'rss_before_mib': before,
    'rss_peak_mib': _rss_mib(),
    'bytes': sum(a.nbytes for a, _ in values),
    'copied_bytes': copied,
  }


def _evict(root: str) -> None:
  """Drops the files under `root` from the page cache."""
  for directory, _, names in os.walk(root):
    for name in names:
      fd = os.open(os.path.join(directory, name), os.O_RDONLY)
      try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      finally:
        os.close(fd)


def _aligned_read(path: str, like: np.ndarray) -> np.ndarray:
  """The file's bytes in a 64-byte-aligned array shaped like `like`."""
  raw = np.empty(like.nbytes + 64, np.uint8)
  start = (-raw.ctypes.data) % 64
  out = raw[start : start + like.nbytes]
  with open(path, 'rb', buffering=0) as f:
    assert f.readinto(out) == like.nbytes, path
  return out.view(like.dtype).reshape(like.shape)


def _write(path: str, array) -> None:
  with open(path, 'wb') as f:
    array.tofile(f)
    f.flush()
    os.fsync(f.fileno())


# The hook's cost
# ------------------------------------------------------------------------------


def hook(method: str, blocks: int) -> dict:
  """Building a `blocks`-block model (LayerNorm and 6 Linear each): seconds,
  and the share of the build's time spent in flax_dtensor's code (cProfile).

  ``flax``: flax_dtensor never used (Flax alone, the limit). ``unused``:
  the hook installed (a public name used), no rules of ours made, so
  modules are built by Flax's own metaclass call. ``routing``: a
  `LogicalRules` made, none in effect (module construction routed through
  the hook from then on). ``rules``: logical rules without path rules in
  effect. ``path_rules``: under path rules and a mesh, every kernel placed
  when the model's constructor returns.
  """
  import cProfile
  import pstats

  jax = _jax()
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.norm = nnx.LayerNorm(256, rngs=rngs)
      self.linears = nnx.List(
        [nnx.Linear(256, 256, rngs=rngs) for _ in range(6)]
      )

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.blocks = nnx.List([Block(rngs) for _ in range(blocks)])

  if method not in ('flax', 'unused', 'routing', 'rules', 'path_rules'):
    raise ValueError(method)
  if method != 'flax':
    import flax_dtensor as fdt

    # The first public name used installs the hook (`import flax_dtensor`
    # is lazy); the first rules made route module construction.
    if method == 'unused':
      fdt.get_logical_axis_rules()  # A public name: the hook goes in.
    else:
      rules = fdt.LogicalRules(
        [('embed', 'data'), ('mlp', 'model')],
        path_rules=[('kernel$', (..., 'mlp'))]
        if method == 'path_rules'
        else [],
      )
  mesh = jax.make_mesh((2, 4), ('data', 'model'))

  def build():
    if method in ('rules', 'path_rules'):
      with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
        model = Model(nnx.Rngs(0))
    else:
      model = Model(nnx.Rngs(0))
    jax.block_until_ready(nnx.state(model))
    return model

  build()  # Compiles what the build compiles.
  before = _reset_peak()
  times = []
  for _ in range(7):  # The fastest build: the least disturbed by others.
    start = time.perf_counter()
    build()
    times.append(time.perf_counter() - start)
  seconds = min(times)
  peak = _rss_mib()
  # On a shared machine a profile also times other processes' turns,
  # wherever they land: the least disturbed of 5 builds is reported.
  shares, calls = [], 0
  for _ in range(5):
    profile = cProfile.Profile()
    profile.enable()
    build()
    profile.disable()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    ours = [
      (nc, tt)
      for (file, _, _), (_, nc, tt, _, _) in stats.items()
      if f'{os.sep}flax_dtensor{os.sep}' in file
    ]
    total = sum(tt for (_, _, tt, _, _) in stats.values())
    shares.append(sum(tt for _, tt in ours) / total)
    calls = sum(nc for nc, _ in ours)
  return {
    'seconds': seconds,
    'rss_before_mib': before,
    'rss_peak_mib': peak,
    'ours_share': min(shares),
    'ours_calls': calls,
  }


# The command line
# ------------------------------------------------------------------------------

# What each method runs, in a fresh process: the CLI, and its peers (the
# interpreter alone; what a command line importing JAX and Flax at start-up
# could not go below).
_COMMANDS = {
  'python': ['-c', 'pass'],
  'import_jax_flax': ['-c', 'import jax, flax.nnx'],
  'help': ['-m', 'flax_dtensor', '--help'],
  'version': ['-m', 'flax_dtensor', '--version'],
  'plan_help': ['-m', 'flax_dtensor', 'plan', '--help'],
  'inspect': ['-m', 'flax_dtensor', 'inspect', '{export}'],
}
# Top-level packages that would show a command paying for more than it
# needs, as `python -X importtime` lists them.
_HEAVY = ('jax', 'jaxlib', 'flax', 'tensorflow', 'numpy', 'optax', 'orbax')


_DEMO_EXPORT = """
import os, sys
import jax
jax.config.update('jax_num_cpu_devices', 8)
import flax_dtensor as fdt
from flax_dtensor import dtensor as fdt_tf
from flax_dtensor.demo import model, train
fdt_tf.initialize()
import tensorflow as tf
auto = (jax.sharding.AxisType.Auto,) * 2
mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=auto)
with jax.set_mesh(mesh), fdt.logical_axis_rules(train.default_rules()):
  lm = model.make_model()
fdt_tf.save_checkpoint(lm, os.path.join(sys.argv[1], 'checkpoint'))
fdt_tf.save_saved_model(lm, os.path.join(sys.argv[1], 'saved_model'),
    input_signature=[tf.TensorSpec([None, 128], tf.int32, name='tokens')])
"""


def _demo_export(root: str) -> str:
  """The demo model's export (checkpoint and SavedModel), as the demo
  writes it, in a fresh directory under `root`. Written by another process:
  this one stays as small as a shell, so the measured child's peak RSS is
  its own."""
  import subprocess

  out = tempfile.mkdtemp(prefix='fdt_bench_cli_', dir=root)
  subprocess.run(
    [sys.executable, '-c', _DEMO_EXPORT, out],
    check=True,
    capture_output=True,
    timeout=600,
  )
  return out


def cli(method: str) -> dict:
  """Wall seconds of one command in a fresh process (the machine's own
  start-up included, as a user waits for it), its peak RSS, and, from a
  second run under ``python -X importtime``, the seconds spent importing
  and which heavy packages it imported."""
  import subprocess

  args = list(_COMMANDS[method])
  export = None
  if '{export}' in args:
    export = _demo_export(os.environ.get('BENCH_DIR') or tempfile.gettempdir())
    args = [a.replace('{export}', export) for a in args]
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  env['COLUMNS'] = '80'
  # Elsewhere than a checkout, so that `-m flax_dtensor` is the one on
  # PYTHONPATH (run.py --repo), not one in the current directory.
  cwd = tempfile.mkdtemp(prefix='fdt_bench_cwd_')
  with tempfile.TemporaryFile() as err:
    start = time.perf_counter()
    proc = subprocess.Popen(
      [sys.executable, *args],
      stdout=subprocess.DEVNULL,
      stderr=err,
      env=env,
      cwd=cwd,
    )
    _, status, usage = os.wait4(proc.pid, 0)  # This child's own peak RSS.
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
      err.seek(0)
      raise RuntimeError(err.read().decode()[-500:])
  peak = usage.ru_maxrss / 1024
  traced = subprocess.run(
    [sys.executable, '-X', 'importtime', *args],
    capture_output=True,
    env=env,
    cwd=cwd,
    timeout=600,
    check=False,
  )
  import_us, heavy = 0, set()
  for line in traced.stderr.decode().splitlines():
    # "import time: self [us] | cumulative | imported package"
    parts = line.split('|')
    if len(parts) != 3 or not line.startswith('import time:'):
      continue
    name = parts[2].rstrip()
    if name == name.lstrip() or not parts[1].strip().isdigit():
      continue
    if len(name) - len(name.lstrip()) == 1:  # A top-level import.
      import_us += int(parts[1])
    if name.strip().split('.')[0] in _HEAVY:
      heavy.add(name.strip().split('.')[0])
  if export is not None:
    shutil.rmtree(export, ignore_errors=True)
  shutil.rmtree(cwd, ignore_errors=True)
  return {
    'seconds': seconds,
    'rss_before_mib': 0.0,
    'rss_peak_mib': peak,
    'import_seconds': import_us / 1e6,
    'heavy_imports': sorted(heavy),
  }


# Memory per process across process counts
# ------------------------------------------------------------------------------

_MP_METHODS = ('save', 'save_async', 'save_async_stall', 'host_copy', 'restore')


def multiprocess(method: str, processes: int, arrays: int, mib: float) -> dict:
  """One step of one model in `processes` local processes (8 devices in all).

  Each process runs `_mp_step` (JAX's distributed runtime on 127.0.0.1,
  `8 // processes` CPU devices, DTensor set up from JAX) and reports its
  seconds, its peak RSS above its baseline before the step, and the bytes
  of the shards it holds. A restore reads a checkpoint that other
  processes wrote before (so that no memory of the state is in its
  baseline). The result is the slowest process's seconds and the largest
  peak of them, with every process's figures in `per_process`.
  """

  if method not in _MP_METHODS:
    raise ValueError(method)
  root = tempfile.mkdtemp(prefix='fdt_mp_', dir=os.environ.get('BENCH_DIR'))
  params = {'arrays': arrays, 'mib': mib, 'processes': processes, 'root': root}
  try:
    if method == 'restore':
      _launch('prepare', params)
    outs = _launch(method, params)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  return {
    'seconds': max(o['seconds'] for o in outs),
    'rss_before_mib': 0.0,
    'rss_peak_mib': max(o['rss_peak_mib'] - o['rss_before_mib'] for o in outs),
    'shard_bytes': max(o['shard_bytes'] for o in outs),
    'copied_bytes': max(o['copied_bytes'] for o in outs),
    'per_process': outs,
  }


def _release_free_memory() -> None:
  """Hands the C heap's free memory back to the OS (glibc's `malloc_trim`).

  Building the state frees host copies; left in the heap, a step reuses
  them without its RSS growing, and its peak above the baseline would
  understate what it allocates.
  """
  import ctypes
  import gc

  gc.collect()
  try:
    ctypes.CDLL('libc.so.6').malloc_trim(0)
  except (OSError, AttributeError):
    pass


def _warm_up(jax, nnx, fdt_tf, path: str) -> None:
  """A save and a restore of one small sharded array, before the measure.

  TensorFlow's runtime, its kernels and DTensor's mesh are set up on the
  first save of a process, once: that is not what a save of the model
  costs, so it stays out of its peak.
  """
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh(
    (2, 4), ('data', 'model'), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  sharding = NamedSharding(mesh, P('data', 'model'))
  small = jax.make_array_from_callback(
    (8, 64), sharding, lambda index: np.ones((8, 64), np.float32)[index]
  )
  state = nnx.State({'w': nnx.Param(small)})
  fdt_tf.save_checkpoint(state, path, overwrite=True)
  fdt_tf.save_checkpoint(state, path, overwrite=True, blocking=False).wait()
  jax.block_until_ready(fdt_tf.restore_checkpoint(path, state))
  multihost_utils.sync_global_devices('warm')


def _launch(method: str, params: dict, step: str = '_mp_step') -> list[dict]:
  """Runs `step` in `params['processes']` processes; their results."""
  import socket
  import subprocess

  processes = params['processes']
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  env = {k: v for k, v in os.environ.items() if not k.startswith('DTENSOR_')}
  per_process = params.get('devices', 8) // processes
  env['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={per_process}'
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        __file__,
        step,
        method,
        json.dumps({**params, 'process': i, 'port': port}),
      ],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(processes)
  ]
  outs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=1800)
      if p.returncode:
        raise RuntimeError(f'process exited {p.returncode}: {err[-2000:]}')
      outs.append(json.loads(out.strip().splitlines()[-1]))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return outs


def _jax_of_process(devices: int, processes: int, process: int, port: int):
  """JAX with `devices` CPU devices, in process `process` of `processes`
  (a coordinator on 127.0.0.1:`port` when there are several)."""
  jax = _jax()
  jax.config.update('jax_num_cpu_devices', devices)
  if processes > 1:
    jax.distributed.initialize(
      coordinator_address=f'127.0.0.1:{port}',
      coordinator_bind_address=f'127.0.0.1:{port}',
      num_processes=processes,
      process_id=process,
    )
  return jax


def _mp_step(
  method: str,
  arrays: int,
  mib: float,
  processes: int,
  root: str,
  process: int,
  port: int,
) -> dict:
  """`multiprocess`'s step in one of its processes (or `prepare` its file)."""
  jax = _jax_of_process(8 // processes, processes, process, port)
  from flax import nnx
  from jax.experimental import multihost_utils

  from flax_dtensor import dtensor as fdt_tf

  fdt_tf.initialize()
  path = os.path.join(root, 'ckpt')
  if method == 'restore':
    # Only the target's shardings: nothing of the state was ever here.
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh(
      (2, 4), ('data', 'model'), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )
    specs = _LAYOUTS['sharded']
    cols = int(mib * 2**20 / 4 / 256)
    cols -= cols % 8
    target = nnx.State(
      {
        f'v{i}': nnx.Param(
          jax.ShapeDtypeStruct(
            (256, cols),
            np.float32,
            sharding=NamedSharding(mesh, P(*specs[i % len(specs)])),
          )
        )
        for i in range(arrays)
      }
    )
  else:
    _, values = _arrays(jax, arrays, mib, 'sharded')
    state = nnx.State(
      {f'v{i}': nnx.Param(a) for i, (a, _) in enumerate(values)}
    )
    # The distinct shards this process holds.
    shards = [
      s.data
      for a, _ in values
      for s in {str(s.index): s for s in a.addressable_shards}.values()
    ]
  if method != 'host_copy':
    _warm_up(jax, nnx, fdt_tf, os.path.join(root, 'warm'))
  multihost_utils.sync_global_devices('before')
  _release_free_memory()
  before = _reset_peak()
  start = time.perf_counter()
  copied = 0
  if method in ('save', 'prepare'):
    fdt_tf.save_checkpoint(state, path, overwrite=True)
  elif method in ('save_async', 'save_async_stall'):
    handle = fdt_tf.save_checkpoint(state, path, overwrite=True, blocking=False)
    stall = time.perf_counter() - start
    from flax_dtensor.dtensor._files import _host_write

    copied = sum(  # The shards this process writes (all float32).
      s.data.nbytes
      for mine in _host_write.own([a for a, _ in values])
      for s in mine.values()
    )
    handle.wait()
  elif method == 'host_copy':
    copies = [np.array(d, copy=True) for d in shards]
    del copies
  elif method == 'restore':
    out = fdt_tf.restore_checkpoint(path, target)
    shards = [
      s.data
      for a in jax.block_until_ready(jax.tree.leaves(out))
      for s in {str(s.index): s for s in a.addressable_shards}.values()
    ]
  seconds = (
    stall if method == 'save_async_stall' else time.perf_counter() - start
  )
  peak = _rss_mib()
  multihost_utils.sync_global_devices('after')
  result = {
    'seconds': seconds,
    'rss_before_mib': before,
    'rss_peak_mib': peak,
    'shard_bytes': sum(d.nbytes for d in shards),
    'copied_bytes': copied,
    'process': process,
  }
  print(json.dumps(result), flush=True)
  os._exit(0)  # JAX's shutdown at exit would wait for the slowest process.


# Checkpoints as the device count grows
# ------------------------------------------------------------------------------

_SCALE_METHODS = (
  'save',
  'save_async',
  'restore',
  'orbax_save',
  'orbax_save_fsync',
  'orbax_restore',
)


def checkpoint_scale(
  method: str, devices: int, processes: int = 1, arrays: int = 32
) -> dict:
  """A checkpoint of `arrays` float32 arrays of shape (devices, 64), each
  split over all `devices` devices (one shard per device), against
  orbax-checkpoint's `StandardCheckpointer` on the same state.

  In one process of `devices` CPU devices, or in `processes` local
  processes of `devices // processes` devices each (JAX's distributed
  runtime on 127.0.0.1), where the slowest process's seconds count.
  `save` and `orbax_save` wait until the files are written
  (`orbax_save_fsync` then flushes orbax's files, as ours are flushed);
  `save_async` is a background save, waited for. A restore reads what the
  same process saved before (not timed): in one process onto 8 of its
  devices, across processes onto the whole mesh. The state is small: the
  cost measured is the one that grows with the shards.
  """

  if method not in _SCALE_METHODS:
    raise ValueError(method)
  root = tempfile.mkdtemp(prefix='fdt_scale_', dir=os.environ.get('BENCH_DIR'))
  params = {'arrays': arrays, 'devices': devices, 'root': root}
  try:
    if processes == 1:
      return _scale_step(method, **params, processes=1, process=0, port=0)
    outs = _launch(
      method, params | {'processes': processes}, step='_scale_step'
    )
  finally:
    shutil.rmtree(root, ignore_errors=True)
  return {
    'seconds': max(o['seconds'] for o in outs),
    'rss_before_mib': 0.0,
    'rss_peak_mib': max(o['rss_peak_mib'] - o['rss_before_mib'] for o in outs),
    'per_process': outs,
  }


def _scale_step(
  method: str,
  arrays: int,
  devices: int,
  root: str,
  processes: int,
  process: int,
  port: int,
) -> dict:
  """`checkpoint_scale`'s measurement in one of its processes."""

  jax = _jax_of_process(devices // processes, processes, process, port)
  from flax import nnx
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from flax_dtensor import dtensor as fdt_tf

  fdt_tf.initialize()
  if jax.device_count() != devices:
    raise RuntimeError(f'{jax.device_count()} devices, not {devices}')
  mesh = jax.make_mesh(
    (devices,), ('x',), axis_types=(jax.sharding.AxisType.Auto,)
  )
  sharding = NamedSharding(mesh, P('x'))
  shape = (devices, 64)
  # The same random values in every process (seeded), as trained weights.
  full = [
    np.random.default_rng(i).standard_normal(shape, dtype=np.float32)
    for i in range(arrays)
  ]
  state = nnx.State(
    {
      f'v{i}': nnx.Param(
        jax.make_array_from_callback(
          shape, sharding, lambda index, i=i: full[i][index]
        )
      )
      for i in range(arrays)
    }
  )
  if processes == 1:
    onto = jax.make_mesh(
      (min(8, devices),),
      ('x',),
      axis_types=(jax.sharding.AxisType.Auto,),
      devices=jax.devices()[: min(8, devices)],
    )
    target_sharding = NamedSharding(onto, P('x'))
  else:
    target_sharding = sharding
  target = nnx.State(
    {
      k: nnx.Param(
        jax.ShapeDtypeStruct(shape, np.float32, sharding=target_sharding)
      )
      for k in state
    }
  )
  ours = os.path.join(root, 'ckpt')
  orbax = os.path.join(root, 'orbax')
  if method == 'restore':
    fdt_tf.save_checkpoint(state, ours)
  elif method == 'orbax_restore':
    _orbax_scale('orbax_save', state, orbax)
  multihost_utils.sync_global_devices('before')
  before = _reset_peak()
  start = time.perf_counter()
  if method == 'save':
    fdt_tf.save_checkpoint(state, ours)
  elif method == 'save_async':
    fdt_tf.save_checkpoint(state, ours, blocking=False).wait()
  elif method == 'restore':
    out = fdt_tf.restore_checkpoint(ours, target)
    jax.block_until_ready(jax.tree.leaves(out))
  else:
    _orbax_scale(method, target if method == 'orbax_restore' else state, orbax)
  seconds = time.perf_counter() - start
  peak = _rss_mib()
  multihost_utils.sync_global_devices('after')
  result = {
    'seconds': seconds,
    'rss_before_mib': before,
    'rss_peak_mib': peak,
    'bytes': arrays * devices * 64 * 4,
    'process': process,
  }
  if processes == 1:
    shutil.rmtree(root, ignore_errors=True)
    return result
  print(json.dumps(result), flush=True)
  os._exit(0)  # JAX's shutdown at exit would wait for the slowest process.


def _orbax_scale(method: str, tree, path: str) -> None:
  """orbax-checkpoint's `StandardCheckpointer`: a save, waited for (then
  its files flushed, for `orbax_save_fsync`), or a restore onto `tree`'s
  shardings."""
  import jax
  import orbax.checkpoint as ocp
  from flax import nnx

  pure = nnx.to_pure_dict(tree)
  checkpointer = ocp.StandardCheckpointer()
  if method == 'orbax_restore':
    abstract = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
      pure,
    )
    jax.block_until_ready(checkpointer.restore(path, abstract))
    return
  checkpointer.save(path, pure)
  checkpointer.wait_until_finished()
  checkpointer.close()
  if method == 'orbax_save_fsync' and jax.process_index() == 0:
    for directory, _, names in os.walk(path):
      for name in [*names, '.']:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def _synthetic_manifest(root: str, variables: int, devices: int) -> None:
  """The manifest of a checkpoint of `variables` variables, each split over
  all `devices` devices of a (devices / 8, 8) mesh ('data', 'model'), as
  `save_checkpoint` writes it (random CRCs, no data files)."""
  import array
  import random

  from flax_dtensor.dtensor._files import _grid, _manifest

  hosts = devices // 8
  mesh = _manifest.MeshAxes(('data', 'model'), (hosts, 8))
  layouts = [
    # (shape, JAX spec, DTensor specs, DTensor mesh)
    ((hosts * 4, 256), (('data',), ('model',)), ('data', 'model'), mesh),
    ((8 * 64, hosts * 2), (('model',), ('data',)), ('model', 'data'), mesh),
    (
      (devices * 2, 128),
      (('data', 'model'), ()),
      ('data+model', 'unsharded'),
      _manifest.MeshAxes(('data+model',), (devices,)),
    ),
  ]
  rng = random.Random(0)
  records = []
  for i in range(variables):
    shape, spec, dspecs, dmesh = layouts[i % len(layouts)]
    sharding = _manifest.ShardingRecord('named', spec, mesh, dspecs, dmesh)
    blocks = _manifest.blocks_of(sharding, shape)
    crcs = array.array(
      _grid.U32, rng.getrandbits(32 * devices).to_bytes(4 * devices, 'little')
    )
    path = ('layers', i // 10, f'w{i % 10}')
    records.append(
      _manifest.Record(
        path=path,
        key=f'layers/{i // 10}/w{i % 10}/.ATTRIBUTES/VARIABLE_VALUE',
        type='Param',
        dtype='float32',
        stored_dtype='float32',
        shape=shape,
        key_impl=None,
        sharding=sharding,
        shards=_grid.ShardGrid(shape, blocks, crcs),
      )
    )
  files = {
    'checkpoint': _manifest.FileSum(65, (0,)),
    'ckpt.index': _manifest.FileSum(1 << 20, (0,)),
    **{
      f'ckpt.data-{h:05d}-of-{hosts:05d}': _manifest.FileSum(1 << 30, (0,) * 16)
      for h in range(hosts)
    },
  }
  # What `inspect` looks for in a checkpoint directory.
  with open(os.path.join(root, 'checkpoint'), 'w') as f:
    f.write('model_checkpoint_path: "ckpt"\n')
  open(os.path.join(root, 'ckpt.index'), 'w').close()
  _manifest.write(
    _manifest.Manifest(
      _manifest.CHECKPOINT_FORMAT,
      _manifest.VERSION,
      root,
      'ckpt',
      files,
      tuple(records),
    )
  )


def manifest_scale(method: str, variables: int, devices: int) -> dict:
  """The manifest of a checkpoint of `devices` devices, in 8-device hosts.

  `restore_metadata`: what a restore of host 0 does with the manifest
  before TF reads anything: reads and checks it (`_manifest.read`), then,
  for each variable, finds the regions that host's 8 devices read and the
  shards' CRCs it checks them against. `inspect`: ``flax-dtensor
  inspect`` of it, a fresh process timed from outside. `write`: the
  manifest written by process 0, from its records. The checkpoint is
  synthetic (`_synthetic_manifest`): no data files, only what describes
  them.
  """
  import subprocess

  root = tempfile.mkdtemp(prefix='fdt_meta_', dir=os.environ.get('BENCH_DIR'))
  try:
    if method == 'write':
      before = _reset_peak()
      start = time.perf_counter()
      _synthetic_manifest(root, variables, devices)
      seconds = time.perf_counter() - start
      peak = _rss_mib()
    else:
      _synthetic_manifest(root, variables, devices)
    nbytes = os.path.getsize(os.path.join(root, 'flax_dtensor.json'))
    if method == 'restore_metadata':
      from flax_dtensor.dtensor._files import _host_read, _manifest

      _release_free_memory()
      before = _reset_peak()
      start = time.perf_counter()
      manifest = _manifest.read(root)
      checked = 0
      for record in manifest.records:
        # Host 0's 8 devices: data index 0, every model index.
        needed = set()
        for m in range(8):
          index = []
          for axes, n, b in zip(
            record.sharding.spec,
            record.shape,
            record.shards.blocks,
            strict=True,
          ):
            step = n // b
            k = {(): 0, ('data',): 0, ('model',): m}.get(axes, m)
            index.append((k * step, (k + 1) * step) if axes else (0, n))
          needed.add(tuple(index))
        for region in _host_read.regions(record.shape, needed, False, record):
          checked += sum(1 for _ in record.shards.inside(region))
      seconds = time.perf_counter() - start
      peak = _rss_mib()
      if checked != 8 * len(manifest.records):
        raise RuntimeError(f'{checked} shards checked')
    elif method == 'inspect':
      env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
      env['COLUMNS'] = '80'
      with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(
          [sys.executable, '-m', 'flax_dtensor', 'inspect', root],
          stdout=subprocess.DEVNULL,
          stderr=err,
          env=env,
          cwd=tempfile.gettempdir(),
        )
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status):
          err.seek(0)
          raise RuntimeError(err.read().decode()[-500:])
      before, peak = 0.0, usage.ru_maxrss / 1024
    elif method != 'write':
      raise ValueError(method)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  return {
    'seconds': seconds,
    'rss_before_mib': before,
    'rss_peak_mib': peak,
    'bytes': nbytes,
    'shards': variables * devices,
  }


# Export on jax.make_mesh's default mesh
# ------------------------------------------------------------------------------

_EXPORT_WIDTH = 4096  # Each layer's kernel: 64 MiB of float32.


def _explicit_stack(jax, nnx, layers: int):
  """A stack of square layers with a forward written for Explicit axes.

  Kernels alternate ('embed', 'mlp') and ('mlp', 'embed'); each call says
  where its result goes (`out_sharding=`): the second contracts over the
  sharded 'mlp'.
  """
  from jax.sharding import PartitionSpec as P

  ones = nnx.initializers.ones

  class Stack(nnx.Module):
    def __init__(self, rngs):
      self.count = layers
      for i in range(layers):
        names = ('embed', 'mlp') if i % 2 == 0 else ('mlp', 'embed')
        layer = nnx.Linear(
          _EXPORT_WIDTH,
          _EXPORT_WIDTH,
          use_bias=False,
          kernel_init=nnx.with_partitioning(ones, names),
          rngs=rngs,
        )
        setattr(self, f'layer{i}', layer)

    def __call__(self, x):
      for i in range(self.count):
        spec = P(None, 'model') if i % 2 == 0 else P()
        x = getattr(self, f'layer{i}')(x, out_sharding=spec)
      return x

  return Stack


def export_memory(method: str, mib: int) -> dict:
  """One step of a model of `mib` MiB on `jax.make_mesh`'s default mesh.

  The model (square float32 layers, `_explicit_stack`) is built by
  `fdt.init` inside ``jax.set_mesh(jax.make_mesh((2, 4), ('data',
  'model')))`` (every axis Explicit) and the step runs there:
  `saved_model` (`save_saved_model` with a polymorphic batch) or `save`
  (a blocking `save_checkpoint`). A small model's SavedModel is written
  first, so TensorFlow's one-time start-up is not counted. The peak RSS
  above the baseline, divided by `param_bytes`, is the figure.
  """

  jax = _jax()
  from flax import nnx

  import flax_dtensor as fdt
  from flax_dtensor import dtensor as fdt_tf

  fdt_tf.initialize()
  import tensorflow as tf

  if method not in ('saved_model', 'save'):
    raise ValueError(method)
  layers = max(2, mib // 64)
  rules = [('embed', None), ('mlp', 'model')]
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  root = tempfile.mkdtemp(prefix='fdt_export_', dir=os.environ.get('BENCH_DIR'))
  spec = [tf.TensorSpec([None, _EXPORT_WIDTH], tf.float32)]
  try:
    with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
      small = fdt.init(_explicit_stack(jax, nnx, 2), nnx.Rngs(0))
      fdt_tf.save_saved_model(
        small, os.path.join(root, 'warm'), input_signature=spec
      )
      fdt_tf.save_checkpoint(small, os.path.join(root, 'warm_ckpt'))
      del small
      model = fdt.init(_explicit_stack(jax, nnx, layers), nnx.Rngs(0))
      jax.block_until_ready(nnx.state(model))
      param_bytes = sum(
        v.nbytes for v in jax.tree.leaves(nnx.state(model, nnx.Param))
      )
      _release_free_memory()
      before = _reset_peak()
      start = time.perf_counter()
      if method == 'saved_model':
        fdt_tf.save_saved_model(
          model, os.path.join(root, 'sm'), input_signature=spec
        )
      else:
        fdt_tf.save_checkpoint(model, os.path.join(root, 'ckpt'))
      seconds = time.perf_counter() - start
      peak = _rss_mib()
  finally:
    shutil.rmtree(root, ignore_errors=True)
  return {
    'seconds': seconds,
    'rss_before_mib': before,
    'rss_peak_mib': peak,
    'param_bytes': param_bytes,
  }


# One accelerator: a Llama-like decoder
# ------------------------------------------------------------------------------

# Each block's logical axes, as a Llama port annotates them.
GPU_RULES = [
  ('embed', 'data'),
  ('heads', 'model'),
  ('mlp', 'model'),
  ('vocab', 'model'),
  ('batch', 'data'),
]


def _decoder(layers: int, dim: int, ffn: int, vocab: int, heads: int):
  """A Llama-like decoder in bfloat16, annotated with logical axes: a
  factory ``make(rngs)`` and a loss ``loss(model, tokens)``. Its forward
  pins the activations' sharding with `fdt.with_logical_constraint` when
  `constrained` (a no-op without rules)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  import flax_dtensor as fdt

  dtype = jnp.bfloat16

  def ann(init, names):
    return nnx.with_partitioning(init, names)

  def linear(i, o, names, rngs):
    return nnx.Linear(
      i,
      o,
      use_bias=False,
      dtype=dtype,
      param_dtype=dtype,
      kernel_init=ann(nnx.initializers.lecun_normal(), names),
      rngs=rngs,
    )

  def norm(rngs):
    return nnx.RMSNorm(
      dim,
      dtype=dtype,
      param_dtype=dtype,
      scale_init=ann(nnx.initializers.ones, ('embed',)),
      rngs=rngs,
    )

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.attn_norm = norm(rngs)
      self.q = linear(dim, dim, ('embed', 'heads'), rngs)
      self.k = linear(dim, dim, ('embed', 'heads'), rngs)
      self.v = linear(dim, dim, ('embed', 'heads'), rngs)
      self.o = linear(dim, dim, ('heads', 'embed'), rngs)
      self.mlp_norm = norm(rngs)
      self.gate = linear(dim, ffn, ('embed', 'mlp'), rngs)
      self.up = linear(dim, ffn, ('embed', 'mlp'), rngs)
      self.down = linear(ffn, dim, ('mlp', 'embed'), rngs)

    def __call__(self, x, constrained):
      def pin(y, names):
        return fdt.with_logical_constraint(y, names) if constrained else y

      b, t, _ = x.shape
      h = self.attn_norm(x)
      q, k, v = (
        f(h).reshape(b, t, heads, dim // heads)
        for f in (self.q, self.k, self.v)
      )
      att = jnp.einsum('bthd,bshd->bhts', q, k) / jnp.sqrt(dim // heads)
      att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
      att = jax.nn.softmax(att.astype(jnp.float32), axis=-1).astype(dtype)
      y = jnp.einsum('bhts,bshd->bthd', att, v).reshape(b, t, dim)
      x = pin(x + self.o(y), ('batch', None, 'embed'))
      h = self.mlp_norm(x)
      h = pin(jax.nn.silu(self.gate(h)) * self.up(h), ('batch', None, 'mlp'))
      return pin(x + self.down(h), ('batch', None, 'embed'))

  class Decoder(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(
        vocab,
        dim,
        dtype=dtype,
        param_dtype=dtype,
        embedding_init=ann(nnx.initializers.normal(0.02), ('vocab', 'embed')),
        rngs=rngs,
      )
      self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
      self.norm = norm(rngs)
      self.head = linear(dim, vocab, ('embed', 'vocab'), rngs)

    def __call__(self, tokens, constrained=False):
      x = self.embed(tokens)
      for block in self.blocks:
        x = block(x, constrained)
      return self.head(self.norm(x)).astype(jnp.float32)

  def loss(model, tokens, constrained):
    logits = model(tokens[:, :-1], constrained)
    labels = jax.nn.one_hot(tokens[:, 1:], vocab)
    return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), axis=-1))

  return Decoder, loss


def _device_peak() -> int | None:
  """The accelerator's peak bytes in use (None where it keeps no count,
  e.g. CPU)."""
  import jax

  stats = jax.local_devices()[0].memory_stats()
  return None if not stats else stats.get('peak_bytes_in_use')


def gpu(
  method: str,
  layers: int,
  dim: int,
  ffn: int,
  vocab: int,
  heads: int,
  batch: int = 1,
  seq: int = 128,
  steps: int = 5,
  cpu_devices: int = 8,
) -> dict:
  """One measurement on the first accelerator (or the CPU, `--quick`):
  the decoder built, planned or trained, on ``jax.make_mesh``'s default
  mesh (Explicit axes) over every local device. A method ending in
  ``_again`` is timed on its second call of the same configuration.
  `cpu_devices`: the CPU's device count, where there is no accelerator.

  `memory_stats` gives the peak device memory; a peak from before the
  step is not reset (JAX cannot), so each measurement is its own process
  and builds nothing before it.
  """
  import jax
  from flax import nnx

  import flax_dtensor as fdt

  # No TensorFlow here: the group runs where it is not installed.
  jax.config.update('jax_num_cpu_devices', cpu_devices)
  tf_before = 'tensorflow' in sys.modules
  Decoder, loss = _decoder(layers, dim, ffn, vocab, heads)
  mesh = jax.make_mesh((len(jax.devices()), 1), ('data', 'model'))
  rules = GPU_RULES
  flax_rules = tuple(rules)
  jax.block_until_ready(jax.numpy.zeros(8) + 1)  # Start the backend.

  @nnx.jit
  def jitted_factory():
    """Flax's documented idiom, defined once: built under jit, the state
    constrained to its partition specs."""
    model = Decoder(nnx.Rngs(0))
    state = nnx.state(model)
    nnx.update(
      model,
      jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)),
    )
    return model

  again = method.endswith('_again')
  base = method.removesuffix('_again')

  def build():
    if base == 'fdt_init':
      return fdt.init(Decoder, nnx.Rngs(0), mesh=mesh, rules=rules)
    if base == 'flax_jit_factory':
      with jax.set_mesh(mesh), nnx.logical_axis_rules(flax_rules):
        return jitted_factory()
    if base == 'fdt_eager':
      with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
        return Decoder(nnx.Rngs(0))
    if base == 'flax_eager':
      with jax.set_mesh(mesh), nnx.logical_axis_rules(flax_rules):
        return Decoder(nnx.Rngs(0))
    if base == 'fdt_plan':
      return fdt.plan(lambda: Decoder(nnx.Rngs(0)), mesh=mesh, rules=rules)
    if base == 'flax_eval_shape':
      with jax.set_mesh(mesh), nnx.logical_axis_rules(flax_rules):
        return nnx.eval_shape(lambda: Decoder(nnx.Rngs(0)))
    raise ValueError(method)

  def ready(x):
    if isinstance(x, nnx.Module):
      jax.block_until_ready(nnx.state(x))
    return x

  result: dict = {}
  if base in ('step_constrained', 'step_plain'):
    import optax

    # The step on Auto axes: the decoder's forward is written for them (an
    # FSDP rule's contracting dimensions would need out_sharding= on
    # Explicit ones), and there the constraint is with_sharding_constraint.
    mesh = jax.make_mesh(
      mesh.axis_sizes,
      mesh.axis_names,
      axis_types=(jax.sharding.AxisType.Auto,) * 2,
    )
    with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
      model = fdt.init(Decoder, nnx.Rngs(0), mesh=mesh, rules=rules)
      optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
      constrained = base == 'step_constrained'

      @nnx.jit
      def step(model, optimizer, tokens):
        value, grads = nnx.value_and_grad(loss)(model, tokens, constrained)
        optimizer.update(model, grads)
        return value

      tokens = jax.random.randint(
        jax.random.key(1), (batch * len(jax.devices()), seq + 1), 0, vocab
      )
      tokens = jax.device_put(tokens, jax.NamedSharding(mesh, jax.P('data')))
      jax.block_until_ready(step(model, optimizer, tokens))  # Compiled.
      before = _reset_peak()
      times = []
      for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(step(model, optimizer, tokens))
        times.append(time.perf_counter() - start)
      seconds = float(np.median(times))
  else:
    if again:  # The first call of this configuration, untimed.
      ready(build())
    before = _reset_peak()
    start = time.perf_counter()
    model = ready(build())
    seconds = time.perf_counter() - start
    if isinstance(model, nnx.Module):
      params = nnx.state(model, nnx.Param)
      result['param_bytes'] = sum(
        x.size * x.dtype.itemsize for x in jax.tree.leaves(params)
      )
  result.update(
    seconds=seconds,
    rss_before_mib=before,
    rss_peak_mib=_rss_mib(),
    device_peak_bytes=_device_peak(),
    device=jax.devices()[0].device_kind,
    tensorflow_imported=tf_before or 'tensorflow' in sys.modules,
  )
  return result


# A training loop that checkpoints
# ------------------------------------------------------------------------------


def manager(
  method: str,
  arrays: int,
  mib: float,
  steps: int,
  every: int,
  devices: int = 8,
) -> dict:
  """A loop of `steps` jitted steps over `arrays` arrays of `mib` MiB (the
  state) sharded over `devices` devices, saving every `every` steps with a
  checkpoint manager
  that keeps 2: ours (`ours`; `oursnosync` with every fsync skipped, as
  orbax-checkpoint writes, a measure of the flushes' share),
  orbax-checkpoint's (`orbax`), or none (`plain`). `*_stall` reports the
  median seconds a save holds the loop, `*_wait` the part of it spent
  waiting for the save before it to be written (each manager waits so,
  before it copies), `*_hold` the rest (the copy), `*_restore` the restore
  of the latest step after the loop; `host_copy` the copy of the state to
  host memory (what the rest of a stall cannot go below).
  """
  jax = _jax(devices)
  from flax import nnx

  kind, _, what = method.partition('_')
  _, out = _arrays(jax, arrays, mib, 'mixed')
  state = nnx.Dict({f'a{i}': nnx.Param(a) for i, (a, _) in enumerate(out)})
  names = list(state.keys())
  # Values stay as random as the weights it starts from (x * 0.5 + 1
  # would make every array 2.0, which compresses to nothing).
  step = jax.jit(lambda xs: [0.5 - x for x in xs], donate_argnums=0)

  def train():
    new = step([state[n].get_value() for n in names])
    for n, v in zip(names, new, strict=True):
      state[n].set_value(v)

  train()  # Compiled.
  jax.block_until_ready([state[n].get_value() for n in names])
  root = tempfile.mkdtemp(
    prefix='fdt_bench_manager_', dir=os.environ.get('BENCH_DIR')
  )
  try:
    return _manager_loop(
      jax, kind, what, state, names, train, root, steps, every
    )
  finally:
    shutil.rmtree(root, ignore_errors=True)


def _manager_loop(jax, kind, what, state, names, train, root, steps, every):
  """`manager`'s measure, its steps' checkpoints under `root`."""
  from flax import nnx

  if kind == 'host':  # The state copied to host memory, once.
    before = _reset_peak()
    start = time.perf_counter()
    jax.device_get([state[n].get_value() for n in names])
    return {
      'seconds': time.perf_counter() - start,
      'rss_before_mib': before,
      'rss_peak_mib': _rss_mib(),
    }
  if kind in ('ours', 'oursnosync'):
    import flax_dtensor.dtensor as fdt_dt

    if kind == 'oursnosync':
      # A measure, not a mode of ours: every `os.fsync` of this process
      # skipped, as orbax-checkpoint writes (its files reach the disk when
      # the kernel writes them back), to tell the flushes' share apart.
      os.fsync = lambda fd: None
    fdt_dt.initialize()
    mgr = fdt_dt.CheckpointManager(
      os.path.join(root, 'run'), save_interval_steps=every, max_to_keep=2
    )

    def save(i):
      return mgr.save(i, state)

    wait, due = mgr.wait, mgr.should_save
  elif kind == 'orbax':
    import orbax.checkpoint as ocp

    mgr = ocp.CheckpointManager(
      os.path.join(root, 'run'),
      options=ocp.CheckpointManagerOptions(
        save_interval_steps=every, max_to_keep=2
      ),
    )

    def save(i):
      tree = nnx.to_pure_dict(nnx.state(state))
      return mgr.save(i, args=ocp.args.StandardSave(tree))

    wait, due = mgr.wait_until_finished, mgr.should_save
  elif kind == 'plain':

    def save(i):
      return False

    def wait():
      return None

    def due(i):
      return False
  else:
    raise ValueError(kind)
  stalls, waits = [], []
  before = _reset_peak()
  start = time.perf_counter()
  for i in range(1, steps + 1):
    train()
    began = time.perf_counter()
    if due(i):  # What `save` waits for first: timed apart.
      wait()
    waited = time.perf_counter() - began
    if save(i):
      stalls.append(time.perf_counter() - began)
      waits.append(waited)
  wait()
  jax.block_until_ready([state[n].get_value() for n in names])
  seconds = time.perf_counter() - start
  if what == 'stall':
    seconds = float(np.median(stalls))
  elif what == 'wait':
    seconds = float(np.median(waits))
  elif what == 'hold':  # The save call itself, the wait apart.
    held = [s - w for s, w in zip(stalls, waits, strict=True)]
    seconds = float(np.median(held))
  elif what == 'restore':
    start = time.perf_counter()
    if kind.startswith('ours'):
      mgr.restore(state)
      jax.block_until_ready([state[n].get_value() for n in names])
    else:
      abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
        nnx.to_pure_dict(nnx.state(state)),
      )
      restored = mgr.restore(
        mgr.latest_step(), args=ocp.args.StandardRestore(abstract)
      )
      jax.block_until_ready(restored)
    seconds = time.perf_counter() - start
  if kind in ('ours', 'oursnosync', 'orbax'):
    mgr.close()
  return {
    'seconds': seconds,
    'rss_before_mib': before,
    'rss_peak_mib': _rss_mib(),
    'saves': len(stalls),
  }


CASES = {
  'manager': manager,
  'gpu': gpu,
  'export_memory': export_memory,
  'init': init,
  'init_spelling': init_spelling,
  'plan': plan,
  'to_tf': to_tf,
  'checkpoint': checkpoint,
  'from_tf': from_tf,
  'hook': hook,
  'cli': cli,
  'multiprocess': multiprocess,
  '_mp_step': _mp_step,
  'checkpoint_scale': checkpoint_scale,
  '_scale_step': _scale_step,
  'manifest_scale': manifest_scale,
}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('case', choices=sorted(CASES))
  parser.add_argument('method')
  parser.add_argument('params', help='JSON object of keyword arguments')
  args = parser.parse_args()
  result = CASES[args.case](args.method, **json.loads(args.params))
  print(json.dumps(result))


if __name__ == '__main__':
  main()
