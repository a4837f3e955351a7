"""A training loop that checkpoints: `CheckpointManager` against
orbax-checkpoint's and against no saving (groups `manager`,
`manager_scale`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import harness
import models
import numpy as np


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
  jax = harness.cpu_jax(devices)
  from flax import nnx

  kind, _, what = method.partition('_')
  _, out = models.sharded_arrays(jax, arrays, mib, 'mixed')
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
    before = harness.reset_peak()
    start = time.perf_counter()
    jax.device_get([state[n].get_value() for n in names])
    return {
      'seconds': time.perf_counter() - start,
      'rss_before_mib': before,
      'rss_peak_mib': harness.rss_mib(),
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
  before = harness.reset_peak()
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
    'rss_peak_mib': harness.rss_mib(),
    'saves': len(stalls),
  }


# A training loop saving every few steps with a checkpoint manager, ours
# and orbax-checkpoint's, against the same loop without: the loop's
# slowdown, each save's stall against a host copy of the state, and the
# restore of the latest step.
_MANAGER = {
  'limit': 'plain',
  'ours': 'ours',
  'peer': 'orbax',
  'ours_stall': 'ours_stall',
  'peer_stall': 'orbax_stall',
  'ours_wait': 'ours_wait',
  'peer_wait': 'orbax_wait',
  'ours_hold': 'ours_hold',
  'peer_hold': 'orbax_hold',
  'ours_nosync': 'oursnosync',
  'ours_nosync_wait': 'oursnosync_wait',
  'limit_copy': 'host_copy',
  'ours_restore': 'ours_restore',
  'peer_restore': 'orbax_restore',
}
_MANAGER_RATIOS = [
  ('ours', 'limit'),
  ('peer', 'limit'),
  ('ours', 'peer'),
  ('ours_stall', 'limit_copy'),
  ('peer_stall', 'limit_copy'),
  ('ours_wait', 'peer_wait'),
  ('ours_hold', 'limit_copy'),
  ('peer_hold', 'limit_copy'),
  ('ours_nosync', 'peer'),
  ('ours_nosync_wait', 'peer_wait'),
  ('ours_restore', 'peer_restore'),
]


def _manager(arrays, mib, steps, every):
  return harness.case(
    'manager',
    {'arrays': arrays, 'mib': mib, 'steps': steps, 'every': every},
    _MANAGER,
    _MANAGER_RATIOS,
    note=f'{steps} jitted steps over {arrays} arrays of {mib} MiB on a (2, 4) '
    f'mesh, saving every {every} (2 kept); stall: the median save call; '
    'wait: the part of it spent on the save before',
  )


# The same loop as the devices grow (a 128 MiB state, so that 128 virtual
# devices fit the machine): how a save's cost grows with the shards, ours
# beside orbax-checkpoint's.
_MANAGER_SCALE = {
  k: _MANAGER[k] for k in ('limit', 'ours', 'peer', 'ours_wait', 'peer_wait')
}

_MANAGER_SCALE_RATIOS = [
  ('ours', 'limit'),
  ('peer', 'limit'),
  ('ours', 'peer'),
  ('ours_wait', 'peer_wait'),
]


def _manager_scale(devices, mib=4, steps=60, repeat=None):
  return [
    harness.case(
      'manager',
      {'arrays': 32, 'mib': mib, 'steps': steps, 'every': 10, 'devices': d},
      _MANAGER_SCALE,
      _MANAGER_SCALE_RATIOS,
      repeat=repeat,
      note=f'{steps} jitted steps over 32 arrays of {mib} MiB on a '
      f'(2, {d // 2}) mesh, saving every 10 (2 kept)',
    )
    for d in devices
  ]


CASES = {'manager': manager}


def full():
  return {
    'manager': [_manager(32, 16, 60, 10)],
    'manager_scale': _manager_scale((8, 32, 128)),
  }


def quick():
  return {
    'manager': [_manager(8, 1, 12, 4)],
    'manager_scale': _manager_scale((8, 32), mib=0.25, steps=20),
  }
