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


def _rss_mib() -> float:
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
    raise ValueError(method)

  before = _rss_mib()
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
  before = _rss_mib()
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

_LAYOUTS = (
  ('data', 'model'),
  ('model', 'data'),
  (None, 'model'),
  ('data', None),
  (None, None),
)


def _arrays(jax, count: int, mib: float):
  """`count` float32 arrays of `mib` MiB each, in mixed layouts."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh(
    (2, 4), ('data', 'model'), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  rows = 256
  cols = int(mib * 2**20 / 4 / rows)
  cols -= cols % 8
  out = []
  for i in range(count):
    spec = P(*_LAYOUTS[i % len(_LAYOUTS)])
    value = np.full((rows, cols), i, np.float32)
    out.append((jax.device_put(value, NamedSharding(mesh, spec)), spec))
  jax.block_until_ready([a for a, _ in out])
  return mesh, out


def to_tf(method: str, arrays: int, mib: float) -> dict:
  jax = _jax()
  from flax import nnx

  from flax_dtensor import dtensor as fdt_tf

  fdt_tf.initialize()
  mesh, values = _arrays(jax, arrays, mib)
  tf = sys.modules['tensorflow']
  dt = tf.experimental.dtensor
  state = nnx.State({f'v{i}': nnx.Param(a) for i, (a, _) in enumerate(values)})
  prepare = None
  if method == 'orbax':
    from orbax.export import dtensor_utils

    dmesh = dtensor_utils.jax_mesh_to_dtensor_mesh(mesh)  # Not timed.

    def run():
      return [
        dt.DVariable(
          dtensor_utils.jax_array_to_dtensor(a, spec, dmesh, jax_mesh=mesh)
        )
        for a, spec in values
      ]
  elif method == 'fdt':

    def run():
      return fdt_tf.to_tf_module(state)
  elif method == 'pack':
    # The floor: pack the same shards into DTensors, layouts given.
    from flax_dtensor.dtensor import _layouts

    layouts = [_layouts.layout_for(a.sharding, a.ndim) for a, _ in values]
    prepare = [
      [np.asarray(s.data) for s in _sorted_shards(a, layout)]
      for (a, _), layout in zip(values, layouts, strict=True)
    ]

    def run():
      return [
        dt.pack(shards, layout)
        for shards, layout in zip(prepare, layouts, strict=True)
      ]
  else:
    raise ValueError(method)
  before = _rss_mib()
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


def _sorted_shards(arr, layout):
  """The array's shards in the order of the layout's local device ids."""
  from flax_dtensor.dtensor import _layouts

  dmesh, _, record = _layouts.layout_parts(arr.sharding, arr.ndim)
  by_device = {s.device: s for s in arr.addressable_shards}
  return [
    by_device[record.devices.flat[int(g)]] for g in dmesh.local_device_ids()
  ]


# Checkpoints
# ------------------------------------------------------------------------------


def checkpoint(method: str, arrays: int, mib: float) -> dict:
  jax = _jax()
  from flax import nnx

  from flax_dtensor import dtensor as fdt_tf

  fdt_tf.initialize()
  _, values = _arrays(jax, arrays, mib)
  state = nnx.State({f'v{i}': nnx.Param(a) for i, (a, _) in enumerate(values)})
  nbytes = sum(a.nbytes for a, _ in values)
  root = tempfile.mkdtemp(prefix='fdt_bench_', dir=os.environ.get('BENCH_DIR'))
  path = os.path.join(root, 'ckpt')
  shards = [
    np.asarray(s.data)
    for a, _ in values
    for s in {str(s.index): s for s in a.addressable_shards}.values()
  ]
  if method in ('restore', 'raw_read'):
    fdt_tf.save_checkpoint(state, path)
    for i, shard in enumerate(shards):
      _write(os.path.join(root, f'raw{i}'), shard)
  before = _rss_mib()
  start = time.perf_counter()
  if method == 'save':
    fdt_tf.save_checkpoint(state, path)
  elif method == 'raw_write':
    for i, shard in enumerate(shards):
      _write(os.path.join(root, f'raw{i}'), shard)
    fd = os.open(root, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
  elif method == 'tf_write':
    tf = sys.modules['tensorflow']
    tf.train.Checkpoint(fdt_tf.to_tf_module(state)).write(path)
  elif method == 'restore':
    abstract = jax.tree.map(
      lambda v: v, state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    fdt_tf.restore_checkpoint(path, abstract)
  elif method == 'raw_read':
    for i, shard in enumerate(shards):
      np.fromfile(os.path.join(root, f'raw{i}'), dtype=shard.dtype)
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
