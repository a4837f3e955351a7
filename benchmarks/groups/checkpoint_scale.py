"""Checkpoints as the device count grows, against orbax-checkpoint in the
same run, in one process and in several, and a synthetic manifest's
restore, `inspect` and write (group `checkpoint_scale`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

import harness
import numpy as np

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
  with harness.scratch('fdt_scale_') as root:
    params = {'arrays': arrays, 'devices': devices, 'root': root}
    if processes == 1:
      return _scale_step(method, **params, processes=1, process=0, port=0)
    outs = harness.launch(
      method, params | {'processes': processes}, step='_scale_step'
    )
  return harness.slowest(outs)


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

  jax = harness.jax_of_process(devices // processes, processes, process, port)
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
  before = harness.reset_peak()
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
  peak = harness.rss_mib()
  multihost_utils.sync_global_devices('after')
  nbytes = arrays * devices * 64 * 4
  result = harness.result(seconds, before, peak, bytes=nbytes, process=process)
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

  from flax_dtensor.dtensor._format import _encode, _grid, _model

  hosts = devices // 8
  mesh = _model.MeshAxes(('data', 'model'), (hosts, 8))
  layouts = [
    # (shape, JAX spec, DTensor specs, DTensor mesh)
    ((hosts * 4, 256), (('data',), ('model',)), ('data', 'model'), mesh),
    ((8 * 64, hosts * 2), (('model',), ('data',)), ('model', 'data'), mesh),
    (
      (devices * 2, 128),
      (('data', 'model'), ()),
      ('data+model', 'unsharded'),
      _model.MeshAxes(('data+model',), (devices,)),
    ),
  ]
  rng = random.Random(0)
  records = []
  for i in range(variables):
    shape, spec, dspecs, dmesh = layouts[i % len(layouts)]
    sharding = _model.ShardingRecord('named', spec, mesh, dspecs, dmesh)
    blocks = _model.blocks_of(sharding, shape)
    crcs = array.array(
      _grid.U32, rng.getrandbits(32 * devices).to_bytes(4 * devices, 'little')
    )
    path = ('layers', i // 10, f'w{i % 10}')
    records.append(
      _model.Record(
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
    'checkpoint': _model.FileSum(65, (0,)),
    'ckpt.index': _model.FileSum(1 << 20, (0,)),
    **{
      f'ckpt.data-{h:05d}-of-{hosts:05d}': _model.FileSum(1 << 30, (0,) * 16)
      for h in range(hosts)
    },
  }
  # What `inspect` looks for in a checkpoint directory.
  with open(os.path.join(root, 'checkpoint'), 'w') as f:
    f.write('model_checkpoint_path: "ckpt"\n')
  open(os.path.join(root, 'ckpt.index'), 'w').close()
  _encode.write(
    _model.Manifest(
      _model.CHECKPOINT_FORMAT,
      _model.VERSION,
      root,
      'ckpt',
      files,
      tuple(records),
    )
  )


def manifest_scale(method: str, variables: int, devices: int) -> dict:
  """The manifest of a checkpoint of `devices` devices, in 8-device hosts.

  `restore_metadata`: what a restore of host 0 does with the manifest
  before TF reads anything: reads and checks it (`_decode.read`), then,
  for each variable, finds the regions that host's 8 devices read and the
  shards' CRCs it checks them against. `inspect`: ``flax-dtensor
  inspect`` of it, a fresh process timed from outside. `write`: the
  manifest written by process 0, from its records. The checkpoint is
  synthetic (`_synthetic_manifest`): no data files, only what describes
  them.
  """
  import subprocess

  with harness.scratch('fdt_meta_') as root:
    if method == 'write':
      before = harness.reset_peak()
      start = time.perf_counter()
      _synthetic_manifest(root, variables, devices)
      seconds = time.perf_counter() - start
      peak = harness.rss_mib()
    else:
      _synthetic_manifest(root, variables, devices)
    nbytes = os.path.getsize(os.path.join(root, 'flax_dtensor.json'))
    if method == 'restore_metadata':
      from flax_dtensor.dtensor._format import _decode
      from flax_dtensor.dtensor._storage import _host_read

      harness.release_free_memory()
      before = harness.reset_peak()
      start = time.perf_counter()
      manifest = _decode.read(root)
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
      peak = harness.rss_mib()
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
  shards = variables * devices
  return harness.result(seconds, before, peak, bytes=nbytes, shards=shards)


# that what is measured is what grows with the shards. Orbax does not fsync
# what it writes: `peer_fsync` adds the flush ours does.
_SCALE = {
  'ours': 'save',
  'ours_async': 'save_async',
  'ours_restore': 'restore',
  'peer': 'orbax_save',
  'peer_fsync': 'orbax_save_fsync',
  'peer_restore': 'orbax_restore',
}
_SCALE_RATIOS = [
  ('ours', 'peer'),
  ('ours', 'peer_fsync'),
  ('ours_restore', 'peer_restore'),
]
# The manifest of a synthetic checkpoint of 1,000 variables, each split over
# every device of 8-device hosts: what a restore of one host does with it
# before TF reads, `inspect`, and process 0 writing it.
_MANIFEST_SCALE = {
  'ours': 'restore_metadata',
  'ours_inspect': 'inspect',
  'ours_write': 'write',
}


def _checkpoint_scale(one, several, manifest, repeat=None):
  return (
    [
      harness.case(
        'checkpoint_scale',
        {'devices': d},
        _SCALE,
        _SCALE_RATIOS,
        repeat=repeat,
        note=f'one process of {d} devices; the restore onto 8 of them',
      )
      for d in one
    ]
    + [
      harness.case(
        'checkpoint_scale',
        {'devices': 2 * n, 'processes': n},
        _SCALE,
        _SCALE_RATIOS,
        repeat=repeat,
        note=f'{n} process(es) of 2 devices; the slowest process',
      )
      for n in several
    ]
    + [
      harness.case(
        'manifest_scale',
        {'variables': 1000, 'devices': d},
        _MANIFEST_SCALE,
        repeat=repeat,
        note=f'synthetic: 1,000 variables over {d} devices in 8-device hosts',
      )
      for d in manifest
    ]
  )


# A SavedModel of one model on jax.make_mesh's default mesh (Explicit axes),


CASES = {
  'checkpoint_scale': checkpoint_scale,
  '_scale_step': _scale_step,
  'manifest_scale': manifest_scale,
}


def full():
  return {
    'checkpoint_scale': _checkpoint_scale(
      (8, 32, 128), (1, 2, 4), (256, 512, 1024, 2048, 4096), repeat=3
    ),
  }


def quick():
  return {'checkpoint_scale': _checkpoint_scale((8, 32), (1, 2), (256, 512))}
