"""Every benchmark of flax_dtensor, each measurement in a fresh process.

Usage::

  python benchmarks/run.py                      # everything (~1 hour)
  python benchmarks/run.py --only init,plan --repeat 5
  python benchmarks/run.py --quick              # small sizes, 1 repeat
  python benchmarks/run.py --repo /old/checkout --label before --roles ours

Each case measures flax_dtensor, its peer and the machine's limit in the
same run, on the same state (`cases.py`), the repeats taking turns between
them, and reports min / median / max of the repeats and the ratios of the medians (flax_dtensor's time divided
by the other's: below 1 is faster). Memory is the OS's peak RSS
(``resource.getrusage``) above the process's baseline before the measured
step. Results go to ``--out`` as JSON, under ``--label`` (the docs'
benchmarks page reads ``benchmarks/results.json``: ``current``, and
``before`` if present), and to the terminal. ``--repo`` measures another
checkout of flax_dtensor (its package first on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import itertools
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent


def _case(case, params, methods, ratios=(), repeat=None, note=''):
  return {
    'case': case,
    'params': params,
    'methods': methods,
    'ratios': list(ratios),
    'repeat': repeat,
    'note': note,
  }


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
_TO_TF = {
  'ours': 'fdt',
  'peer': 'orbax',
  'limit': 'dvariable',
  'floor': 'pack',
}
_TO_TF_RATIOS = [('ours', 'peer'), ('ours', 'limit'), ('peer', 'limit')]
_SAVE = {'ours': 'save', 'limit': 'raw_write', 'peer': 'tf_write'}
_RESTORE = {
  'ours': 'restore',
  'limit': 'raw_read',
  'limit_place': 'raw_read_place',
}
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


# One model (512 MiB, every array split over the 8 devices) in 1, 2 and 4
# local processes: each process's peak RSS and the shards it holds, and the
# stall of a background save against a host copy of those shards.
_MULTIPROCESS = {
  'ours': 'save',
  'ours_async': 'save_async',
  'ours_stall': 'save_async_stall',
  'limit': 'host_copy',
  'ours_restore': 'restore',
}


def _multiprocess(arrays, mib, counts, repeat=None):
  return [
    _case(
      'multiprocess',
      {'processes': n, 'arrays': arrays, 'mib': mib},
      _MULTIPROCESS,
      [('ours_stall', 'limit')],
      repeat=repeat,
      note=f'{n} process(es) of {8 // n} devices; peak RSS and seconds of '
      'the process with the largest',
    )
    for n in counts
  ]


# Checkpoints as the devices grow, against orbax-checkpoint in the same run:
# 32 small arrays, each split over every device (one shard per device), so
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
      _case(
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
      _case(
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
      _case(
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
# built and exported inside jax.set_mesh, beside a blocking checkpoint of
# it: peak RSS above the baseline, against the parameter bytes.
def _export_memory(mib):
  return _case(
    'export_memory',
    {'mib': mib},
    {'ours': 'saved_model', 'ours_checkpoint': 'save'},
    note=f'{mib} MiB of float32 parameters on jax.make_mesh((2, 4)) '
    '(Explicit axes), a forward with out_sharding=; peak RSS above the '
    'baseline ÷ param_bytes',
  )


# The command line: each command in a fresh process, against the bare
# interpreter (the floor) and a process that only imports JAX and Flax (what
# a command line importing them at start-up could not go below).
_CLI_CASE = _case(
  'cli',
  {},
  {
    'help': 'help',
    'version': 'version',
    'plan_help': 'plan_help',
    'inspect': 'inspect',
    'floor': 'python',
    'peer': 'import_jax_flax',
  },
  [('help', 'floor'), ('help', 'peer'), ('inspect', 'peer')],
  repeat=5,
  note='`flax-dtensor --help`, `--version`, `plan --help`, and `inspect` of '
  "the demo's export (checkpoint and SavedModel), COLUMNS=80",
)


# A second `fdt.init` of one configuration reuses the first's compiled
# build; Flax's idiom, a jitted factory defined once, is cached by jit.
_INIT_AGAIN = _case(
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


# Every spelling of a factory (`cases.SPELLINGS`: the Rngs made inside it,
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
    _case(
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
# pinning activations against the same step without; each with the peak
# device memory (`memory_stats`) ÷ the parameter bytes.
_GPU_BUILD = {
  'ours': 'fdt_init',
  'peer': 'flax_jit_factory',
  'ours_again': 'fdt_init_again',
  'peer_again': 'flax_jit_factory_again',
  'ours_eager': 'fdt_eager',
  'peer_eager': 'flax_eager',
  'ours_plan': 'fdt_plan',
  'peer_plan': 'flax_eval_shape',
  'ours_step': 'step_constrained',
  'peer_step': 'step_plain',
}
_GPU_RATIOS = [
  ('ours', 'peer'),
  ('ours_again', 'peer_again'),
  ('ours_eager', 'peer_eager'),
  ('ours_plan', 'peer_plan'),
  ('ours_step', 'peer_step'),
]


def _gpu(layers, dim, ffn, vocab, heads, methods=None, **more):
  methods = _GPU_BUILD if methods is None else methods
  return _case(
    'gpu',
    {
      'layers': layers,
      'dim': dim,
      'ffn': ffn,
      'vocab': vocab,
      'heads': heads,
      **more,
    },
    methods,
    [r for r in _GPU_RATIOS if r[0] in methods and r[1] in methods],
    note=f'Llama-like decoder, {layers} blocks, bfloat16, on '
    'jax.make_mesh((devices, 1)) (Explicit axes); peak device memory ÷ '
    'param_bytes',
  )


# The second build where the variables are many and small (200: 50 blocks
# of two Linear layers, width 16), where work per variable shows.
_INIT_AGAIN_SMALL = _case(
  'init',
  {'layers': 50, 'width': 16, 'axes': 'auto'},
  _INIT_AGAIN['methods'],
  [('ours', 'peer'), ('ours_again', 'peer_again')],
  note='200 small variables (50 blocks of Linear(16, 64) + Linear(64, 16)) '
  "on a (2, 4) Auto mesh: first and second call against Flax's jitted "
  'factory',
)


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
  return _case(
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
    _case(
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


def _full():
  return {
    'manager': [_manager(32, 16, 60, 10)],
    'manager_scale': _manager_scale((8, 32, 128)),
    'gpu': [
      _gpu(16, 2048, 5632, 32000, 16),
      _gpu(
        32,
        2048,
        5632,
        32000,
        16,
        {
          k: _GPU_BUILD[k] for k in ('ours', 'peer', 'ours_again', 'peer_again')
        },
      ),
    ],
    'init': [
      _case(
        'init',
        {'layers': 24, 'width': 1024},
        _INIT,
        _INIT_RATIOS,
        note='201M params (768 MiB); (2, 4) Explicit mesh',
      ),
      _case(
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
      _case(
        'init',
        {'layers': layers, 'width': 1024},
        {k: _INIT[k] for k in ('ours', 'ours_eager', 'limit')},
        _INIT_RATIOS[:2],
      )
      for layers in (6, 12, 24, 48, 96)
    ],
    'path_rules': [
      _case(
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
    'hook': [
      _case(
        'hook',
        {'blocks': 24},
        {
          'ours': 'unused',
          'limit': 'flax',
          'routing': 'routing',
          'rules': 'rules',
          'path_rules': 'path_rules',
        },
        [('ours', 'limit'), ('routing', 'limit')],
        note=(
          'building a 24-block model (LayerNorm and 6 Linear each); share '
          "of the time in flax_dtensor's code under cProfile"
        ),
      ),
    ],
    'plan': [
      _case('plan', {'variables': n}, {'ours': 'fdt_plan_factory'})
      for n in (1000, 2500, 5000, 10000)
    ]
    + [
      _case('plan', {'variables': n}, {'peer': 'flax_eval_shape'})
      for n in (250, 500, 1000)
    ],
    'to_tf': [
      _case(
        'to_tf',
        {'arrays': 32, 'mib': 16, 'layouts': layouts, 'warm': warm},
        _TO_TF,
        _TO_TF_RATIOS,
      )
      for layouts in ('mixed', 'product')
      for warm in (False, True)
    ],
    'checkpoint': [
      _case(
        'checkpoint',
        {'arrays': 32, 'mib': 16, 'layouts': layouts},
        _SAVE,
        [('ours', 'limit'), ('ours', 'peer')],
        repeat=5,
      )
      for layouts in ('sharded', 'mixed')
    ]
    + [
      _case(
        'checkpoint',
        {'arrays': 32, 'mib': 16, 'layouts': layouts, 'cache': cache},
        _RESTORE,
        [('ours', 'limit'), ('ours', 'limit_place')],
        repeat=5,
      )
      for layouts in ('sharded', 'mixed')
      for cache in ('hot', 'cold')
    ],
    'single_mesh': [
      _case(
        'to_tf',
        {'arrays': 32, 'mib': 16, 'layouts': layouts, 'warm': warm},
        {'ours': 'fdt_single_mesh', 'peer': 'fdt'},
        [('ours', 'peer')],
        note='to_tf_module(single_mesh=True) against the default (fused)',
      )
      for layouts, warm in (
        ('product', False),
        ('product', True),
        ('sharded', False),
      )
    ]
    + [
      _case(
        'checkpoint',
        {'arrays': 32, 'mib': 16, 'layouts': 'sharded'},
        {'ours': 'save_single_mesh', 'peer': 'save'},
        [('ours', 'peer')],
        repeat=5,
        note='save_checkpoint(single_mesh=True) against the default',
      )
    ],
    'from_tf': [
      _case(
        'from_tf',
        {'arrays': 32, 'mib': 16, 'layouts': layouts},
        {
          'ours': 'same_layout',
          'ours_moved': 'other_layout',
          'peer': 'device_put',
        },
        [('ours_moved', 'peer')],
      )
      for layouts in ('mixed', 'sharded')
    ],
    'cli': [_CLI_CASE],
    'vs_orbax': [
      _case(
        'checkpoint',
        {'arrays': 32, 'mib': 16, 'layouts': 'mixed'},
        _VS_ORBAX_SAVE,
        _VS_ORBAX_SAVE_RATIOS,
        repeat=5,
        note='save (ours flushes; orbax does not, peer_fsync adds it)',
      ),
      _case(
        'checkpoint',
        {'arrays': 32, 'mib': 16, 'layouts': 'mixed', 'again': 4},
        {'ours': 'save', 'limit': 'raw_write'},
        [('ours', 'limit')],
        repeat=5,
        note='the fifth successive save in one process, each into new '
        'files, against the fifth write + fsync of the unique bytes',
      ),
      _case(
        'checkpoint',
        {'arrays': 32, 'mib': 16, 'layouts': 'mixed'},
        _VS_ORBAX_STALL,
        [('ours', 'limit'), ('peer', 'limit')],
        repeat=5,
        note='what an asynchronous save stalls the caller for, against a '
        'host copy of every shard',
      ),
      _case(
        'checkpoint',
        {'arrays': 32, 'mib': 16, 'layouts': 'mixed'},
        _VS_ORBAX_RESTORE,
        [('ours', 'limit_place'), ('ours', 'peer')],
        repeat=5,
        note='restore against reading the unique bytes and placing them',
      ),
    ],
    'multiprocess': _multiprocess(32, 16, (1, 2, 4), repeat=3),
    'checkpoint_scale': _checkpoint_scale(
      (8, 32, 128), (1, 2, 4), (256, 512, 1024, 2048, 4096), repeat=3
    ),
    'export_memory': [_export_memory(2048)],
    'checkpoint_scaling': [
      _case(
        'checkpoint',
        {'arrays': 32, 'mib': mib, 'layouts': 'sharded'},
        {'ours': 'save', 'limit': 'raw_write'},
        [('ours', 'limit')],
      )
      for mib in (4, 8, 16, 32, 64)
    ]
    + [
      _case(
        'checkpoint',
        {'arrays': 32, 'mib': mib, 'layouts': 'sharded'},
        {'ours': 'restore', 'limit': 'raw_read'},
        [('ours', 'limit')],
      )
      for mib in (4, 8, 16, 32, 64)
    ],
  }


def _quick():
  return {
    'manager': [_manager(8, 1, 12, 4)],
    'manager_scale': _manager_scale((8, 32), mib=0.25, steps=20),
    # On one CPU device, as on the one GPU (and without 8 devices' SPMD
    # compiles, which the suite runs it for).
    'gpu': [_gpu(2, 64, 128, 256, 4, cpu_devices=1)],
    'init': [
      _case('init', {'layers': 2, 'width': 256}, _INIT, _INIT_RATIOS),
      {**_INIT_AGAIN, 'params': {'layers': 2, 'width': 256, 'stack': 'vmap'}},
      *_spellings(40),
    ],
    'plan': [
      _case('plan', {'variables': 200}, {'ours': 'fdt_plan_factory'}),
      _case('plan', {'variables': 100}, {'peer': 'flax_eval_shape'}),
    ],
    'to_tf': [
      _case('to_tf', {'arrays': 8, 'mib': 1}, _TO_TF, _TO_TF_RATIOS),
    ],
    'cli': [_CLI_CASE],
    'checkpoint': [
      _case('checkpoint', {'arrays': 8, 'mib': 1}, _SAVE, [('ours', 'limit')]),
      _case(
        'checkpoint', {'arrays': 8, 'mib': 1}, _RESTORE, [('ours', 'limit')]
      ),
    ],
    'vs_orbax': [
      _case('checkpoint', {'arrays': 8, 'mib': 1}, methods, [('ours', 'limit')])
      for methods in (_VS_ORBAX_SAVE, _VS_ORBAX_STALL)
    ]
    + [
      _case(
        'checkpoint',
        {'arrays': 8, 'mib': 1, 'again': 2},
        {'ours': 'save', 'limit': 'raw_write'},
        [('ours', 'limit')],
      )
    ]
    + [
      _case(
        'checkpoint',
        {'arrays': 8, 'mib': 1},
        _VS_ORBAX_RESTORE,
        [('ours', 'limit_place')],
      )
    ],
    'multiprocess': _multiprocess(4, 1, (1, 2)),
    'checkpoint_scale': _checkpoint_scale((8, 32), (1, 2), (256, 512)),
    'export_memory': [_export_memory(128)],
    'single_mesh': [
      _case(
        'to_tf',
        {'arrays': 8, 'mib': 1, 'layouts': 'product'},
        {'ours': 'fdt_single_mesh', 'peer': 'fdt'},
        [('ours', 'peer')],
      ),
    ],
    'from_tf': [
      _case(
        'from_tf',
        {'arrays': 8, 'mib': 1},
        {
          'ours': 'same_layout',
          'ours_moved': 'other_layout',
          'peer': 'device_put',
        },
        [('ours_moved', 'peer')],
      ),
    ],
  }


def _measure(case, method, params, repo, timeout):
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join(
    [str(repo)] + [p for p in [env.get('PYTHONPATH')] if p]
  )
  try:
    proc = subprocess.run(
      [
        sys.executable,
        str(HERE / 'cases.py'),
        case,
        method,
        json.dumps(params),
      ],
      capture_output=True,
      text=True,
      timeout=timeout,
      env=env,
      check=False,
    )
  except subprocess.TimeoutExpired:
    return {'error': f'timed out after {timeout:.0f} s'}
  if proc.returncode:
    tail = (proc.stderr.strip().splitlines() or ['(no output)'])[-1]
    return {'error': f'exit {proc.returncode}: {tail[:300]}'}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _spread(values):
  values = sorted(values)
  return {
    'min': values[0],
    'median': statistics.median(values),
    'max': values[-1],
  }


def _summary(runs):
  ok = [r for r in runs if 'error' not in r]
  if not ok:
    return {'error': runs[-1]['error']}
  out = {
    'seconds': _spread([r['seconds'] for r in ok]),
    'rss_above_baseline_mib': _spread(
      [r['rss_peak_mib'] - r['rss_before_mib'] for r in ok]
    ),
    'runs': len(ok),
  }
  for key in (
    'param_bytes',
    'shards',
    'bytes',
    'copied_bytes',
    'shard_bytes',
    'variables',
    'shard_shape',
    'device',
    'tensorflow_imported',
  ):
    if key in ok[0]:
      out[key] = ok[0][key]
  if 'per_process' in ok[0]:
    # Each process's peak RSS above its baseline (MiB), median of the runs.
    out['per_process_rss_above_baseline_mib'] = [
      statistics.median(
        r['per_process'][i]['rss_peak_mib']
        - r['per_process'][i]['rss_before_mib']
        for r in ok
      )
      for i in range(len(ok[0]['per_process']))
    ]
  for key in ('ours_share', 'ours_calls'):
    if key in ok[0]:
      out[key] = _spread([r[key] for r in ok])
  if ok[0].get('device_peak_bytes') is not None and ok[0].get('param_bytes'):
    # The accelerator's peak bytes in use ÷ the parameter bytes.
    out['device_peak_per_param'] = _spread(
      [r['device_peak_bytes'] / r['param_bytes'] for r in ok]
    )
  if 'import_seconds' in ok[0]:
    out['import_seconds'] = _spread([r['import_seconds'] for r in ok])
    out['heavy_imports'] = sorted({m for r in ok for m in r['heavy_imports']})
  return out


def _ratios(entry):
  out = {}
  for a, b in entry['ratios']:
    mine = entry['methods'].get(a, {}).get('seconds', {}).get('median')
    theirs = entry['methods'].get(b, {}).get('seconds', {}).get('median')
    if mine and theirs:
      out[f'{a}/{b}'] = mine / theirs
  return out


def _machine():
  mem = 0
  try:
    with open('/proc/meminfo') as f:
      mem = int(f.readline().split()[1]) // 1024
  except OSError:
    pass
  versions = {}
  for name in (
    'jax',
    'jaxlib',
    'flax',
    'tensorflow-cpu',
    'orbax-export',
    'numpy',
  ):
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  cpu = platform.processor()
  try:
    with open('/proc/cpuinfo') as f:
      cpu = next(
        (line.split(':', 1)[1].strip() for line in f if 'model name' in line),
        cpu,
      )
  except OSError:
    pass
  return {
    'cpus': os.cpu_count(),
    'cpu': cpu,
    'memory_mib': mem,
    'platform': platform.platform(),
    'python': platform.python_version(),
    'devices': '8 virtual CPU devices (XLA_FLAGS)',
    'versions': versions,
  }


def _growth(results):
  """For each scaling group: cost of doubling, per role (time, memory)."""
  out = _device_growth(results)
  for group in ('init_scaling', 'checkpoint_scaling', 'plan'):
    rows = [r for r in results if r['group'] == group]
    by_role = {}
    for r in rows:
      size = r['params'].get('layers') or r['params'].get('variables')
      size = size or r['params']['arrays'] * r['params']['mib']
      for role, m in r['methods'].items():
        if 'seconds' in m:
          key = f'{role}:{m["method"]}'
          by_role.setdefault(key, []).append(
            (
              size,
              m['seconds']['median'],
              m['rss_above_baseline_mib']['median'],
            )
          )
    for key, points in by_role.items():
      steps = _steps(points)
      if steps:
        out[f'{group}/{key}'] = steps
  return out


def _steps(points):
  """Each step between (size, seconds, MiB) points, sorted by size: how
  much time and memory grow against the size."""
  points = sorted(points)
  return [
    {
      'from': a[0],
      'to': b[0],
      'time_x': b[1] / a[1] if a[1] else None,
      'memory_x': b[2] / a[2] if a[2] > 0 else None,
      'size_x': b[0] / a[0],
    }
    for a, b in itertools.pairwise(points)
  ]


def _device_growth(results):
  """`checkpoint_scale`: each series' growth as the devices double.

  A series is a case and its parameters but the device count: one process,
  several processes, the synthetic manifest.
  """
  series = {}
  for r in results:
    if r['group'] != 'checkpoint_scale':
      continue
    params = {k: v for k, v in r['params'].items() if k != 'devices'}
    mode = 'processes' if 'processes' in params else 'one process'
    for role, m in r['methods'].items():
      if 'seconds' in m:
        key = f'checkpoint_scale/{r["case"]} ({mode})/{role}:{m["method"]}'
        series.setdefault(key, []).append(
          (
            r['params']['devices'],
            m['seconds']['median'],
            m['rss_above_baseline_mib']['median'],
          )
        )
  out = {}
  for key, points in series.items():
    steps = _steps(points)
    if steps:
      out[key] = steps
  return out


def _print_growth(growth):
  for key, steps in growth.items():
    for s in steps:
      time_x = '-' if s['time_x'] is None else f'{s["time_x"]:.2f}x'
      print(
        f'{"growth":<13} {key:<62} {s["from"]:>6g} -> {s["to"]:<6g} '
        f'({s["size_x"]:.0f}x): time {time_x}',
        flush=True,
      )


def run(groups, repeat, repo, timeout, label, roles):
  results = []
  for group, cases in groups.items():
    for spec in cases:
      n = max(repeat, spec['repeat'] or 0) if repeat > 1 else repeat
      entry = {
        'group': group,
        'case': spec['case'],
        'params': spec['params'],
        'note': spec['note'],
        'ratios': spec['ratios'],
        # When and how this entry was measured (a run with --only keeps the
        # other groups of an earlier run, with theirs).
        'measured': {
          'date': _now(),
          'command': _command(),
          'repeat': n,
        },
        'methods': {},
      }
      chosen = {
        role: method
        for role, method in spec['methods'].items()
        if not roles or role in roles
      }
      # Repeats take turns between the roles, so that a machine busier for
      # a while slows every role alike rather than one.
      runs = {role: [] for role in chosen}
      for _ in range(n):
        for role, method in chosen.items():
          runs[role].append(
            _measure(spec['case'], method, spec['params'], repo, timeout)
          )
      for role, method in chosen.items():
        entry['methods'][role] = {'method': method} | _summary(runs[role])
        _print_line(group, spec['params'], role, entry['methods'][role])
      entry['ratio'] = _ratios(entry)
      for name, value in entry['ratio'].items():
        print(f'{"":<13} {"":<48} {name:<22} {value:8.2f}x', flush=True)
      results.append(entry)
  growth = _growth(results)
  _print_growth(growth)
  return {
    'label': label,
    'date': _now(),
    'repeat': repeat,
    'command': _command(),
    'machine': _machine(),
    'results': results,
    'growth': growth,
  }


def _now():
  return datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')


def _command():
  return ' '.join(['python', 'benchmarks/run.py', *sys.argv[1:]])


def _print_line(group, params, role, summary):
  text = json.dumps(params)
  if 'error' in summary:
    print(f'{group:<13} {text:<48} {role:<11} ERROR {summary["error"]}')
    return
  s = summary['seconds']
  mem = summary['rss_above_baseline_mib']['median']
  print(
    f'{group:<13} {text:<48} {role:<11} {summary["method"]:<16} '
    f'{s["min"]:8.2f} {s["median"]:8.2f} {s["max"]:8.2f} s  '
    f'+{mem:7.0f} MiB'
    + (
      f'  device peak {summary["device_peak_per_param"]["median"]:.2f}x params'
      if 'device_peak_per_param' in summary
      else ''
    ),
    flush=True,
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--only', help='Comma-separated groups (default: all).')
  parser.add_argument('--repeat', type=int, default=3)
  parser.add_argument('--quick', action='store_true')
  parser.add_argument('--repo', default=str(REPO))
  parser.add_argument('--label', default='current')
  parser.add_argument(
    '--roles', help='Comma-separated roles to measure (default: all).'
  )
  parser.add_argument('--timeout', type=float, default=3600)
  parser.add_argument('--out', default=str(HERE / 'results.json'))
  args = parser.parse_args()
  groups = _quick() if args.quick else _full()
  if args.only:
    wanted = args.only.split(',')
    unknown = sorted(set(wanted) - set(groups))
    if unknown:
      parser.error(f'unknown groups {unknown}; expected some of {list(groups)}')
    groups = {k: v for k, v in groups.items() if k in wanted}
  repeat = 1 if args.quick else args.repeat
  roles = set(args.roles.split(',')) if args.roles else None
  print(
    f'{"group":<13} {"params":<48} {"role":<11} {"method":<16} '
    f'{"min":>8} {"median":>8} {"max":>8}     peak RSS above baseline'
  )
  report = run(groups, repeat, args.repo, args.timeout, args.label, roles)
  out = pathlib.Path(args.out)
  previous = json.loads(out.read_text()) if out.exists() else {}
  if args.only and args.label in previous:
    # Keep the other groups of an earlier run under the same label, and its
    # date and command (each entry says when it was measured).
    earlier = previous[args.label]
    kept = [r for r in earlier['results'] if r['group'] not in groups]
    for r in kept:
      r.setdefault(
        'measured',
        {
          'date': earlier['date'],
          'command': earlier['command'],
          'repeat': earlier['repeat'],
        },
      )
    report['results'] = kept + report['results']
    report['growth'] = _growth(report['results'])
    for key in ('date', 'command', 'repeat'):
      report[key] = earlier[key]
  previous[args.label] = report
  out.write_text(json.dumps(previous, indent=1) + '\n')
  print(f'wrote {out} ({args.label})')


if __name__ == '__main__':
  main()
