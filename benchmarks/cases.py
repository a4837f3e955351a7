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


def _jax():
  import jax

  jax.config.update('jax_num_cpu_devices', 8)
  return jax


# Sharded creation
# ------------------------------------------------------------------------------


def _mlp_stack(layers: int, width: int):
  """`layers` x (Linear(width -> 4 width) + Linear(4 width -> width))."""
  from flax import nnx

  init = nnx.initializers.lecun_normal()

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(
        width,
        4 * width,
        kernel_init=nnx.with_partitioning(init, ('embed', 'mlp')),
        rngs=rngs,
      )
      self.down = nnx.Linear(
        4 * width,
        width,
        kernel_init=nnx.with_partitioning(init, ('mlp', 'embed')),
        rngs=rngs,
      )

  class Stack(nnx.Module):
    def __init__(self, rngs):
      self.blocks = nnx.List([Block(rngs) for _ in range(layers)])

  return Stack


def init(method: str, layers: int, width: int) -> dict:
  jax = _jax()
  from flax import nnx

  import flax_dtensor as fdt

  stack = _mlp_stack(layers, width)
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  rules = [('embed', 'data'), ('mlp', 'model')]
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
    if method == 'flax_jit':  # Flax's eager sharding inside nnx.jit.
      with jax.set_mesh(mesh), nnx.logical_axis_rules(tuple(rules)):
        return nnx.jit(lambda: stack(nnx.Rngs(0)))()
    raise ValueError(method)

  before = _reset_peak()
  start = time.perf_counter()
  model = build()
  jax.block_until_ready(nnx.state(model))
  seconds = time.perf_counter() - start
  params = nnx.state(model, nnx.Param)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
  kernel = model.blocks[0].up.kernel.get_value()
  return {
    'seconds': seconds,
    'rss_before_mib': before,
    'rss_peak_mib': _rss_mib(),
    'param_bytes': nbytes,
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
  """`count` float32 arrays of `mib` MiB each, in the given layouts."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh(
    (2, 4), ('data', 'model'), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  rows = 256
  cols = int(mib * 2**20 / 4 / rows)
  cols -= cols % 8
  specs = _LAYOUTS[layouts]
  out = []
  for i in range(count):
    spec = P(*specs[i % len(specs)])
    value = np.full((rows, cols), i + fill, np.float32)
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
    if method in ('pack', 'dvariable'):
      # The floor: the same shards packed into DTensors (layouts and shard
      # order given), and for 'dvariable' then held by DVariables.
      from flax_dtensor.dtensor import _layouts

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


def _sorted_shards(arr):
  """The array's shards in the order of the layout's local device ids."""
  from flax_dtensor.dtensor import _layouts

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
) -> dict:
  """Writing and reading a checkpoint, and the raw bytes the same way.

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
  reads = method in ('restore', 'raw_read', 'raw_read_place')
  if reads:
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
  before = _reset_peak()
  start = time.perf_counter()
  if method == 'save':
    fdt_tf.save_checkpoint(state, path)
  elif method == 'raw_write':
    for k, (_, _, shard) in enumerate(shards):
      _write(os.path.join(root, f'raw{k}'), shard)
    fd = os.open(root, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
  elif method == 'tf_write':
    tf = sys.modules['tensorflow']
    tf.train.Checkpoint(fdt_tf.to_tf_module(state)).write(path)
  elif method == 'restore':
    out = fdt_tf.restore_checkpoint(path, abstract)
    jax.block_until_ready(jax.tree.leaves(out))
  elif method in ('raw_read', 'raw_read_place'):
    host = {}
    for k, (i, index, shard) in enumerate(shards):
      host[i, index] = np.fromfile(
        os.path.join(root, f'raw{k}'), dtype=shard.dtype
      ).reshape(shard.shape)
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
  seconds = time.perf_counter() - start
  import shutil

  shutil.rmtree(root, ignore_errors=True)
  return {
    'seconds': seconds,
    'rss_before_mib': before,
    'rss_peak_mib': _rss_mib(),
    'bytes': nbytes,
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


def _write(path: str, array) -> None:
  with open(path, 'wb') as f:
    array.tofile(f)
    f.flush()
    os.fsync(f.fileno())


CASES = {'init': init, 'plan': plan, 'to_tf': to_tf, 'checkpoint': checkpoint}


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
