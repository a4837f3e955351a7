"""Checkpoints against orbax-checkpoint, the same 512 MiB state in one
run: its save, background save, stall and restore (group `vs_orbax`; the
`checkpoint` case runs them, the methods named ``orbax_*``).
"""

from __future__ import annotations

import os
import time

import harness


def orbax_step(method: str, state, path: str, start: float) -> float:
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


# Against orbax-checkpoint, the same 512 MiB state in one run. Orbax does
# not fsync what it writes: `peer_fsync` adds the flush ours does.
_VS_ORBAX_SAVE = {
  'ours': 'save',
  'ours_async': 'save_async',
  'limit': 'raw_write',
  'peer': 'orbax_save',
  'peer_fsync': 'orbax_save_fsync',
  'peer_async': 'orbax_async',
}
_VS_ORBAX_SAVE_RATIOS = [
  ('ours', 'limit'),
  ('ours', 'peer'),
  ('ours', 'peer_fsync'),
  ('ours_async', 'peer_async'),
]
_VS_ORBAX_STALL = {
  'ours': 'save_async_stall',
  'limit': 'host_copy',
  'peer': 'orbax_async_stall',
}
_VS_ORBAX_RESTORE = {
  'ours': 'restore',
  'limit_place': 'raw_read_place',
  'peer': 'orbax_restore',
}


CASES = {}  # Its methods run in the `checkpoint` case.


def _mixed(note, methods, ratios, **params):
  """A `checkpoint` case of 512 MiB in 32 arrays of mixed layouts, 5 runs."""
  params = {'arrays': 32, 'mib': 16, 'layouts': 'mixed', **params}
  return harness.case('checkpoint', params, methods, ratios, 5, note)


def full():
  return {
    'vs_orbax': [
      _mixed(
        'save (ours flushes; orbax does not, peer_fsync adds it)',
        _VS_ORBAX_SAVE,
        _VS_ORBAX_SAVE_RATIOS,
      ),
      _mixed(
        'the fifth successive save in one process, each into new files, '
        'against the fifth write + fsync of the unique bytes',
        {'ours': 'save', 'limit': 'raw_write'},
        [('ours', 'limit')],
        again=4,
      ),
      _mixed(
        'what an asynchronous save stalls the caller for, against a host '
        'copy of every shard',
        _VS_ORBAX_STALL,
        [('ours', 'limit'), ('peer', 'limit')],
      ),
      _mixed(
        'restore against reading the unique bytes and placing them',
        _VS_ORBAX_RESTORE,
        [('ours', 'limit_place'), ('ours', 'peer')],
      ),
    ],
  }


def quick():
  return {
    'vs_orbax': [
      harness.case(
        'checkpoint', {'arrays': 8, 'mib': 1}, methods, [('ours', 'limit')]
      )
      for methods in (_VS_ORBAX_SAVE, _VS_ORBAX_STALL)
    ]
    + [
      harness.case(
        'checkpoint',
        {'arrays': 8, 'mib': 1, 'again': 2},
        {'ours': 'save', 'limit': 'raw_write'},
        [('ours', 'limit')],
      )
    ]
    + [
      harness.case(
        'checkpoint',
        {'arrays': 8, 'mib': 1},
        _VS_ORBAX_RESTORE,
        [('ours', 'limit_place')],
      )
    ],
  }
