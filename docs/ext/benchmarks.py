"""The ``benchmarks`` directive: ``benchmarks/results.json`` as a page.

``python benchmarks/run.py`` writes the JSON; this renders, at build time,
the machine, the targets (each flax_dtensor measurement as a ratio to its
peer or limit, measured in the same run, before and after), every
measurement, how costs grow when the model doubles, and a plot. So the page
always shows the committed results, and cannot drift from them.

Usage in a MyST page::

  ```{benchmarks}
  ```
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any

from docutils import nodes
from docutils.parsers.rst import Directive
from docutils.parsers.rst import Parser as RstParser
from docutils.utils import new_document
from sphinx.application import Sphinx

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / 'benchmarks' / 'results.json'
PLOT = '_generated/benchmarks.png'

Entry = dict[str, Any]


def _load() -> dict[str, Any]:
  return json.loads(RESULTS.read_text())


def _find(
  report: dict[str, Any] | None,
  group: str,
  role: str | None = None,
  **params: Any,
) -> Entry:
  """The first entry of `group` with these params (and `role` measured)."""
  if report is None:
    return {}
  for entry in report['results']:
    if (
      entry['group'] == group
      and all(entry['params'].get(k) == v for k, v in params.items())
      and (role is None or role in entry.get('methods', {}))
    ):
      return entry
  return {}


def _median(entry: Entry, role: str, what: str = 'seconds') -> float | None:
  method = entry.get('methods', {}).get(role, {})
  return method.get(what, {}).get('median')


def _ratio(entry: Entry, a: str, b: str) -> float | None:
  x, y = _median(entry, a), _median(entry, b)
  return x / y if x and y else None


def _fmt(x: float | None, suffix: str = 'x') -> str:
  return '—' if x is None else f'{x:.2f}{suffix}'


def _init_time(r):
  return _ratio(_find(r, 'init', layers=24), 'ours', 'limit')


def _init_memory(r):
  e = _find(r, 'init', layers=24)
  mib = _median(e, 'ours', 'rss_above_baseline_mib')
  m = e.get('methods', {}).get('ours', {})
  return (
    mib * 2**20 / m['param_bytes'] if mib and m.get('param_bytes') else None
  )


def _double_model(r):
  e = _find(r, 'init_scaling', layers=48)
  mib = _median(e, 'ours', 'rss_above_baseline_mib')
  m = e.get('methods', {}).get('ours', {})
  if not mib or not m.get('param_bytes'):
    return None
  return mib * 2**20 / m['param_bytes']


def _eager_time(r):
  return _ratio(_find(r, 'init', layers=24), 'ours_eager', 'limit')


def _paths(r, a='ours', b='peer'):
  return _ratio(_find(r, 'path_rules', layers=24), a, b)


def _paths_memory(r, role='ours'):
  e = _find(r, 'path_rules', layers=24)
  mib = _median(e, role, 'rss_above_baseline_mib')
  m = e.get('methods', {}).get(role, {})
  return (
    mib * 2**20 / m['param_bytes'] if mib and m.get('param_bytes') else None
  )


def _hook_share(r, role='ours'):
  e = _find(r, 'hook', blocks=24)
  share = e.get('methods', {}).get(role, {}).get('ours_share', {})
  return 100 * share['median'] if share.get('median') is not None else None


def _plan_10k(r):
  return _median(_find(r, 'plan', variables=10000), 'ours')


def _plan_variables(r):
  e = _find(r, 'plan', variables=10000)
  return e.get('methods', {}).get('ours', {}).get('variables')


def _flax_1k(r):
  return _median(_find(r, 'plan', 'peer', variables=1000), 'peer')


def _plan_10k_over_flax_1k(r):
  ours, flax = _plan_10k(r), _flax_1k(r)
  return ours / flax if ours and flax else None


def _plan_growth(r):
  if r is None:
    return None
  steps = r.get('growth', {}).get('plan/ours:fdt_plan_factory', [])
  ratios = [s['time_x'] / s['size_x'] for s in steps if s['time_x']]
  return max(ratios) if ratios else None


def _to_tf(r, layouts='mixed', warm=False, b='peer'):
  return _ratio(
    _find(r, 'to_tf', layouts=layouts, warm=warm, arrays=32), 'ours', b
  )


def _throughput(r, method_params, limit='limit'):
  e = _find(r, 'checkpoint', **method_params)
  x = _ratio(e, 'ours', limit)
  return 1 / x if x else None


def _save(r):
  return _throughput(r, {'layouts': 'sharded', 'arrays': 32, 'mib': 16})


def _save_worst(r):
  e = _find(r, 'checkpoint', layouts='sharded', arrays=32, mib=16)
  ours = e.get('methods', {}).get('ours', {}).get('seconds', {}).get('max')
  raw = _median(e, 'limit')
  return raw / ours if ours and raw else None


def _restore(r, layouts='sharded', cache='hot', limit='limit'):
  return _throughput(
    r, {'layouts': layouts, 'cache': cache, 'arrays': 32, 'mib': 16}, limit
  )


def _single_mesh_time(r, layouts='product'):
  return _ratio(
    _find(r, 'single_mesh', layouts=layouts, warm=False), 'ours', 'peer'
  )


def _single_mesh_memory(r):
  e = _find(r, 'single_mesh', layouts='product', warm=False)
  mib = _median(e, 'ours', 'rss_above_baseline_mib')
  nbytes = e.get('methods', {}).get('ours', {}).get('bytes')
  return mib * 2**20 / nbytes if mib is not None and nbytes else None


def _from_tf_copied(r):
  e = _find(r, 'from_tf', layouts='mixed')
  return e.get('methods', {}).get('ours', {}).get('copied_bytes')


def _mp_above_shards(role, processes=4):
  """Multi-process: the largest peak RSS above what a process must hold,
  divided by the bytes of its shards.

  What it must hold: its shards for a save (held before the step, so in its
  baseline), its shards and its background copy of the shards it writes
  for a background save, the restored shards for a restore.
  """

  def value(r):
    e = _find(r, 'multiprocess', role, processes=processes)
    m = e.get('methods', {}).get(role, {})
    peak = _median(e, role, 'rss_above_baseline_mib')
    shards = m.get('shard_bytes')
    if peak is None or not shards:
      return None
    held = {'ours_async': m.get('copied_bytes', 0), 'ours_restore': shards}
    return (peak * 2**20 - held.get(role, 0)) / shards

  return value


def _export_memory(role):
  """Peak RSS above the baseline of a step on a 2 GiB model on
  `jax.make_mesh`'s default mesh, divided by its parameter bytes."""

  def value(r):
    e = _find(r, 'export_memory', role, mib=2048)
    peak = _median(e, role, 'rss_above_baseline_mib')
    params = e.get('methods', {}).get(role, {}).get('param_bytes')
    return None if peak is None or not params else peak * 2**20 / params

  return value


def _mp_stall(processes):
  def value(r):
    e = _find(r, 'multiprocess', 'ours_stall', processes=processes)
    return _ratio(e, 'ours_stall', 'limit')

  return value


def _exactly(report, group, **params):
  """The entry of `group` with exactly these params."""
  return next(
    (
      e
      for e in (report or {}).get('results', [])
      if e['group'] == group and e['params'] == params
    ),
    {},
  )


def _scale(role, b=None, **params):
  """`checkpoint_scale`: a role's median seconds, or its ratio to `b`."""

  def value(r):
    e = _exactly(r, 'checkpoint_scale', **params)
    return _ratio(e, role, b) if b else _median(e, role)

  return value


def _vs_orbax(method):
  """The `vs_orbax` entry where ours is `method` (save, restore, ...)."""

  def value(r):
    e = next(
      (
        e
        for e in (r or {}).get('results', [])
        if e['group'] == 'vs_orbax'
        and e['methods'].get('ours', {}).get('method') == method
      ),
      {},
    )
    return _ratio(e, 'ours', 'peer')

  return value


def _manager(a, b, group='manager', **params):
  """`group`'s ratio of role `a` to `b` (the 512 MiB loop by default)."""
  params = params or {'arrays': 32, 'mib': 16, 'steps': 60, 'every': 10}

  def value(r):
    return _ratio(_exactly(r, group, **params), a, b)

  return value


def _scale_growth(role, method, start, stop):
  """Time growth of a one-process series from `start` to `stop` devices."""

  def value(r):
    steps = (
      (r or {})
      .get('growth', {})
      .get(
        f'checkpoint_scale/checkpoint_scale (one process)/{role}:{method}', []
      )
    )
    times = {s['from']: s['time_x'] for s in steps}
    x, total = start, 1.0
    while x < stop:
      if not times.get(x):
        return None
      total *= times[x]
      x = next(s['to'] for s in steps if s['from'] == x)
    return total

  return value


def _manifest_scale(role, what='seconds', devices=4096):
  def value(r):
    e = _exactly(r, 'checkpoint_scale', variables=1000, devices=devices)
    v = _median(e, role, what)
    return v / 1024 if v is not None and what != 'seconds' else v

  return value


def _cli(role, what='seconds'):
  def value(r):
    return _median(_find(r, 'cli', role), role, what)

  return value


def _cli_heavy(r):
  method = _find(r, 'cli', 'help').get('methods', {}).get('help', {})
  heavy = method.get('heavy_imports')
  return None if heavy is None else len(heavy)


# One row per target: (what, its value from a report, its format, the
# target as text, whether a value meets it; None for context rows).
TARGETS: list[tuple[str, Callable[[Any], float | None], str, str, Any]] = [
  (
    '`flax-dtensor --help`, a fresh process: time to answer',
    _cli('help'),
    ' ms',
    '< 300 ms',
    lambda v: v < 0.3,
  ),
  (
    '`flax-dtensor --version`',
    _cli('version'),
    ' ms',
    '< 300 ms',
    lambda v: v < 0.3,
  ),
  (
    '`flax-dtensor plan --help`',
    _cli('plan_help'),
    ' ms',
    '< 300 ms',
    lambda v: v < 0.3,
  ),
  (
    "`flax-dtensor inspect` of the demo's export (checkpoint and SavedModel)",
    _cli('inspect'),
    ' ms',
    '< 1 s',
    lambda v: v < 1.0,
  ),
  (
    '`--help`: of JAX, Flax, TensorFlow, NumPy, optax, Orbax, how many it '
    'imports (`python -X importtime`)',
    _cli_heavy,
    '',
    '0',
    lambda v: v == 0,
  ),
  (
    'a process that only imports JAX and Flax (what `--help` cost when the '
    'package imported them)',
    _cli('peer'),
    ' ms',
    '(the peer)',
    None,
  ),
  (
    'the bare interpreter, `python -c pass`',
    _cli('floor'),
    ' ms',
    '(the floor)',
    None,
  ),
  (
    '`fdt.init`, 201M-param MLP stack: time ÷ unsharded creation',
    _init_time,
    'x',
    '≤ 1.0x',
    lambda v: v <= 1.0,
  ),
  (
    'same: peak RSS above the baseline ÷ parameter bytes',
    _init_memory,
    'x',
    '≤ 1.5x',
    lambda v: v <= 1.5,
  ),
  (
    'same at twice the size (403M params, 1.5 GiB): peak RSS ÷ parameter bytes',
    _double_model,
    'x',
    'succeeds, ≤ 1.5x',
    lambda v: v <= 1.5,
  ),
  (
    '`fdt.init` of 8 blocks stacked by `nnx.vmap` (67M params, the traced '
    "build): time ÷ Flax's idiom, a jitted factory constraining the state "
    'to `nnx.get_partition_spec`',
    lambda r: _ratio(_find(r, 'init', stack='vmap'), 'ours', 'peer'),
    'x',
    '≤ 1.1x',
    lambda v: v <= 1.1,
  ),
  (
    "same, a second call of the same configuration: time ÷ Flax's jitted "
    'factory called again (cached by jit)',
    lambda r: _ratio(
      _find(r, 'init', stack='vmap'), 'ours_again', 'peer_again'
    ),
    'x',
    '≤ 1.5x',
    lambda v: v <= 1.5,
  ),
  (
    'eager creation under `fdt.logical_axis_rules` + `jax.set_mesh`: '
    'time ÷ unsharded creation',
    _eager_time,
    'x',
    '≤ 1.5x',
    lambda v: v <= 1.5,
  ),
  (
    '`fdt.init` of the same stack without annotations, by path rules '
    "(creation order): time ÷ the annotated stack's `fdt.init`",
    _paths,
    'x',
    '≤ 1.1x',
    lambda v: v <= 1.1,
  ),
  (
    'same: peak RSS above the baseline ÷ parameter bytes',
    _paths_memory,
    'x',
    '≤ 1.2x',
    lambda v: v <= 1.2,
  ),
  (
    'eager construction of it under path rules: time ÷ unsharded creation',
    lambda r: _paths(r, 'ours_eager', 'limit'),
    'x',
    '≤ 1.5x',
    lambda v: v <= 1.5,
  ),
  (
    'same: peak RSS above the baseline ÷ parameter bytes',
    lambda r: _paths_memory(r, 'ours_eager'),
    'x',
    '≤ 1.5x',
    lambda v: v <= 1.5,
  ),
  (
    'building a 24-block model, no rules made: share of the time in '
    "flax_dtensor's code (cProfile)",
    _hook_share,
    '%',
    '≤ 0.3%',
    lambda v: v <= 0.3,
  ),
  (
    'same, once rules of ours have been made (none in effect): the module '
    'routing of path rules adds a frame per module',
    lambda r: _hook_share(r, 'routing'),
    '%',
    '',
    None,
  ),
  (
    '`fdt.plan(factory)`, 10,000 variables: seconds',
    _plan_10k,
    ' s',
    '',
    None,
  ),
  (
    "same ÷ Flax's `nnx.eval_shape` of 1,000 variables",
    _plan_10k_over_flax_1k,
    'x',
    '≤ 1.0x',
    lambda v: v <= 1.0,
  ),
  (
    '`fdt.plan(factory)`: variables planned (10,000 built)',
    _plan_variables,
    '',
    '10,000 (not an empty plan)',
    lambda v: v == 10000,
  ),
  (
    "Flax's `nnx.eval_shape` alone, 1,000 variables: seconds",
    _flax_1k,
    ' s',
    '(the peer)',
    None,
  ),
  (
    '`fdt.plan(factory)`: worst time growth ÷ size growth between sizes',
    _plan_growth,
    'x',
    '≈ 1 (linear)',
    lambda v: v <= 1.3,
  ),
  (
    '`to_tf_module`, 512 MiB in 32 arrays, mixed layouts: time ÷ orbax-export',
    _to_tf,
    'x',
    "≤ 0.5x, or TF's floor shown",
    lambda v: v <= 0.5,
  ),
  (
    "same: time ÷ TF's floor (`dtensor.pack` + `DVariable` of the same shards)",
    lambda r: _to_tf(r, b='limit'),
    'x',
    '(the floor)',
    None,
  ),
  (
    "orbax-export: time ÷ TF's floor",
    lambda r: _ratio(
      _find(r, 'to_tf', layouts='mixed', warm=False, arrays=32),
      'peer',
      'limit',
    ),
    'x',
    '(the peer)',
    None,
  ),
  (
    'same, product sharding (one dimension over both mesh axes): time ÷ '
    'orbax-export',
    lambda r: _to_tf(r, layouts='product'),
    'x',
    '≤ 0.5x',
    lambda v: v <= 0.5,
  ),
  (
    '`to_tf_module(single_mesh=True)`, 512 MiB in 32 arrays, each with a '
    'dimension over both mesh axes: time ÷ the default (fused, zero-copy)',
    _single_mesh_time,
    'x',
    '(the cost of moving them)',
    None,
  ),
  (
    'same: peak RSS above the baseline ÷ the bytes moved',
    _single_mesh_memory,
    'x',
    '≤ 1.1x (one copy)',
    lambda v: v <= 1.1,
  ),
  (
    'same, 32 arrays of which 1 in 3 moves: time ÷ the default',
    lambda r: _single_mesh_time(r, 'sharded'),
    'x',
    '(the cost of moving them)',
    None,
  ),
  (
    '`save_checkpoint(single_mesh=True)`, same arrays: time ÷ the default '
    '(median of 5)',
    lambda r: _ratio(
      _find(r, 'single_mesh', layouts='sharded', arrays=32, mib=16, warm=None),
      'ours',
      'peer',
    ),
    'x',
    '(the cost of moving them)',
    None,
  ),
  (
    '`from_tf_module`, 512 MiB from `to_tf_module`, layouts kept: bytes '
    'copied (by buffer address)',
    _from_tf_copied,
    '',
    '0 (no copy)',
    lambda v: v == 0,
  ),
  (
    'same: milliseconds',
    lambda r: 1000 * _median(_find(r, 'from_tf', layouts='mixed'), 'ours'),
    ' ms',
    '',
    None,
  ),
  (
    '`from_tf_module` onto other layouts: time ÷ `jax.device_put` of the '
    'same arrays to them',
    lambda r: _ratio(
      _find(r, 'from_tf', layouts='mixed'), 'ours_moved', 'peer'
    ),
    'x',
    '≤ 1.0x',
    lambda v: v <= 1.0,
  ),
  (
    '`save_checkpoint` throughput ÷ raw NumPy write + fsync (median of 5)',
    _save,
    'x',
    '≥ 0.8x',
    lambda v: v >= 0.8,
  ),
  (
    'same, the slowest of 5 repeats',
    _save_worst,
    'x',
    '≥ 0.8x (stable)',
    lambda v: v >= 0.8,
  ),
  (
    '`restore_checkpoint` throughput ÷ raw NumPy read (page cache hot)',
    _restore,
    'x',
    '≥ 0.8x, or the limit shown',
    lambda v: v >= 0.8,
  ),
  (
    'same, files evicted from the page cache first',
    lambda r: _restore(r, cache='cold'),
    'x',
    '≥ 0.8x, or the limit shown',
    lambda v: v >= 0.8,
  ),
  (
    '`restore_checkpoint` throughput ÷ raw NumPy read placed on the devices '
    '(`jax.device_put`)',
    lambda r: _restore(r, limit='limit_place'),
    'x',
    '(the limit for JAX arrays)',
    None,
  ),
  (
    'blocking `save_checkpoint` of 32 arrays on 128 devices (one shard per '
    "device, one process): time ÷ orbax-checkpoint's `StandardCheckpointer`",
    _scale('ours', 'peer', devices=128),
    'x',
    '≤ 1.0x',
    lambda v: v <= 1.0,
  ),
  (
    'same ÷ orbax + fsync (ours flushes; orbax does not)',
    _scale('ours', 'peer_fsync', devices=128),
    'x',
    '',
    None,
  ),
  (
    'restore of those 128 shards onto 8 devices: time ÷ orbax-checkpoint',
    _scale('ours_restore', 'peer_restore', devices=128),
    'x',
    '≤ 1.0x',
    lambda v: v <= 1.0,
  ),
  (
    'blocking save: time growth from 32 to 128 devices (4x the shards)',
    _scale_growth('ours', 'save', 32, 128),
    'x',
    '≤ 4.4x',
    lambda v: v <= 4.4,
  ),
  (
    'restore on 8 devices, 512 MiB in 32 arrays, mixed layouts: time ÷ '
    'orbax-checkpoint',
    _vs_orbax('restore'),
    'x',
    '≤ 0.5x (2x faster)',
    lambda v: v <= 0.5,
  ),
  (
    'a training loop saving 512 MiB every 10 steps with `CheckpointManager`: '
    "time ÷ the same loop with orbax-checkpoint's `CheckpointManager`",
    _manager('ours', 'peer'),
    'x',
    '≤ 1.0x',
    lambda v: v <= 1.0,
  ),
  (
    "same, 32 arrays of 4 MiB on 128 devices: time ÷ orbax-checkpoint's",
    _manager(
      'ours',
      'peer',
      'manager_scale',
      arrays=32,
      mib=4,
      steps=60,
      every=10,
      devices=128,
    ),
    'x',
    '≤ 1.0x',
    lambda v: v <= 1.0,
  ),
  (
    'what a save holds the loop beyond the wait for the save before ÷ a '
    'host copy of the state',
    _manager('ours_hold', 'limit_copy'),
    'x',
    '≤ 1.5x',
    lambda v: v <= 1.5,
  ),
  (
    'manifest of 1,000 variables on 4,096 devices (4.1M shards): a host '
    "reads it and finds its shards' checksums: seconds",
    _manifest_scale('ours'),
    ' s',
    '≤ 2 s',
    lambda v: v <= 2,
  ),
  (
    'same: peak RSS above the baseline, GiB',
    _manifest_scale('ours', 'rss_above_baseline_mib'),
    ' GiB',
    '≤ 0.5 GiB',
    lambda v: v <= 0.5,
  ),
  (
    '`flax-dtensor inspect` of it, a fresh process: seconds',
    _manifest_scale('ours_inspect'),
    ' s',
    '≤ 5 s',
    lambda v: v <= 5,
  ),
  (
    'blocking save of 512 MiB in 4 processes (2 devices each): peak RSS '
    "above each process's shards ÷ its shard bytes",
    _mp_above_shards('ours'),
    'x',
    '≤ 0.25x',
    lambda v: v <= 0.25,
  ),
  (
    'same, background save until written: above its shards and its copy of '
    'those it writes',
    _mp_above_shards('ours_async'),
    'x',
    '≤ 0.25x',
    lambda v: v <= 0.25,
  ),
  (
    'same, restore: above the shards it restores',
    _mp_above_shards('ours_restore'),
    'x',
    '≤ 0.25x',
    lambda v: v <= 0.25,
  ),
  (
    "SavedModel of a 2 GiB model built and exported on `jax.make_mesh`'s "
    'default mesh (Explicit axes), inside `jax.set_mesh`: peak RSS above '
    'the baseline ÷ parameter bytes',
    _export_memory('ours'),
    'x',
    '≤ 0.5x',
    lambda v: v <= 0.5,
  ),
  (
    'same model, blocking checkpoint (beside it)',
    _export_memory('ours_checkpoint'),
    'x',
    '≤ 0.5x',
    lambda v: v <= 0.5,
  ),
  (
    "background save in 2 processes: the caller's stall ÷ a NumPy copy of "
    "the process's shards",
    _mp_stall(2),
    'x',
    '≤ 1.5x',
    lambda v: v <= 1.5,
  ),
  (
    'same in 4 processes',
    _mp_stall(4),
    'x',
    '≤ 1.5x',
    lambda v: v <= 1.5,
  ),
]


def _value(fn, report, fmt):
  try:
    v = fn(report)
  except (KeyError, TypeError, ZeroDivisionError):
    v = None
  if v is None:
    return None, '—'
  if fmt == '':
    return v, f'{v:,}'
  if fmt == ' ms':
    return v, f'{v * 1000:,.0f} ms'
  if fmt == ' GiB':
    return v, f'{v:.3f} GiB'
  return v, (f'{v:.2f}{fmt}' if fmt != ' s' else f'{v:.1f} s')


def _list_table(
  header: list[str], rows: list[list[str]], widths=None
) -> list[str]:
  lines = ['.. list-table::', '   :header-rows: 1']
  if widths:
    lines.append('   :widths: ' + ' '.join(map(str, widths)))
  lines.append('')
  for row in [header, *rows]:
    lines.append('   * - ' + (row[0] or ' '))
    lines += [f'     - {c or " "}' for c in row[1:]]
  lines.append('')
  return lines


def _targets_table(data: dict[str, Any]) -> list[str]:
  now, before = data.get('current'), data.get('before')
  rows = []
  for what, fn, fmt, target, ok in TARGETS:
    v, text = _value(fn, now, fmt)
    _, was = _value(fn, before, fmt) if before else (None, '—')
    status = ''
    if ok is not None and v is not None:
      status = 'met' if ok(v) else 'not met: see below'
    rows.append([what, was, text, target, status])
  return _list_table(
    ['What', 'Before', 'Now', 'Target', ''], rows, widths=[46, 10, 10, 20, 14]
  )


def _machine(report: dict[str, Any]) -> list[str]:
  m = report['machine']
  versions = ', '.join(f'{k} {v}' for k, v in m['versions'].items() if v)
  return [
    f'Measured {report["date"][:10]} with ``{report["command"]}`` on '
    f'{m["cpus"]} cores ({m["cpu"]}), {m["memory_mib"] / 1024:.0f} GiB of '
    f'memory, {m["devices"]}, Python {m["python"]}; {versions}. Each '
    f'number is the median of {report["repeat"]} fresh processes (5 for '
    'checkpoints) unless the table says otherwise; min and max are in the '
    'JSON.' + ''.join(_later_groups(report)),
    '',
  ]


def _later_groups(report: dict[str, Any]) -> list[str]:
  """A sentence per group measured in a later run (``--only``)."""
  later: dict[str, dict[str, Any]] = {}
  for e in report['results']:
    measured = e.get('measured')
    if measured and measured['date'] != report['date']:
      later.setdefault(e['group'], measured)
  return [
    f' The ``{group}`` group was measured {m["date"][:10]} with '
    f'``{m["command"]}``, the median of {m["repeat"]} fresh processes.'
    for group, m in sorted(later.items())
  ]


def _all_rows(report: dict[str, Any]) -> list[str]:
  rows = []
  for e in report['results']:
    params = ', '.join(f'{k}={v}' for k, v in e['params'].items())
    for role, m in e['methods'].items():
      if 'error' in m:
        rows.append([e['group'], params, role, m['method'], m['error'], '', ''])
        continue
      s = m['seconds']
      rows.append(
        [
          e['group'],
          params,
          role,
          f'``{m["method"]}``',
          f'{s["median"]:.3f}',
          f'{s["min"]:.3f} – {s["max"]:.3f}',
          f'{m["rss_above_baseline_mib"]["median"]:.0f}',
        ]
      )
  return _list_table(
    [
      'Group',
      'Parameters',
      'Role',
      'Method',
      'Median s',
      'Min – max s',
      'Peak RSS above baseline, MiB',
    ],
    rows,
  )


def _seconds(e: Entry, role: str) -> str:
  v = _median(e, role)
  return '—' if v is None else f'{v:.3f}'


def _scale_tables(report: dict[str, Any]) -> list[str]:
  """`checkpoint_scale`: ours beside orbax-checkpoint, and the manifest."""
  entries = [e for e in report['results'] if e['group'] == 'checkpoint_scale']
  rows = []
  for e in entries:
    if e['case'] != 'checkpoint_scale':
      continue
    p = e['params']
    where = (
      f'{p["processes"]} × 2 devices'
      if 'processes' in p
      else f'1 process, {p["devices"]} devices'
    )
    rows.append(
      [
        where,
        _seconds(e, 'ours'),
        _seconds(e, 'ours_async'),
        _seconds(e, 'peer'),
        _seconds(e, 'peer_fsync'),
        _fmt(_ratio(e, 'ours', 'peer')),
        _seconds(e, 'ours_restore'),
        _seconds(e, 'peer_restore'),
        _fmt(_ratio(e, 'ours_restore', 'peer_restore')),
      ]
    )
  lines = []
  if rows:
    lines += [
      'Seconds, medians; 32 float32 arrays of shape (devices, 64), each '
      'split over every device (one shard per device); the restore onto 8 '
      'devices in one process, onto every device across processes; '
      "orbax-checkpoint's ``StandardCheckpointer`` in the same run (its save "
      'waited for; it does not fsync, "+ fsync" flushes its files after).',
      '',
      *_list_table(
        [
          'Where',
          'blocking save',
          'background save',
          'orbax save',
          'orbax save + fsync',
          'save ÷ orbax',
          'restore',
          'orbax restore',
          'restore ÷ orbax',
        ],
        rows,
      ),
    ]
  meta = []
  for e in entries:
    if e['case'] != 'manifest_scale':
      continue
    m = e['methods'].get('ours', {})
    mib = _median(e, 'ours', 'rss_above_baseline_mib')
    meta.append(
      [
        f'{e["params"]["devices"]:,}',
        f'{m.get("shards", 0):,}',
        f'{m.get("bytes", 0) / 2**20:.1f} MiB',
        _seconds(e, 'ours'),
        '—' if mib is None else f'{mib:.0f}',
        _seconds(e, 'ours_inspect'),
        _seconds(e, 'ours_write'),
      ]
    )
  if meta:
    lines += [
      'The manifest of a synthetic checkpoint of 1,000 variables, each '
      'split over every device of 8-device hosts: what a restore of one '
      'host does with it before TensorFlow reads (read, check, find its '
      "shards' checksums), ``flax-dtensor inspect`` (a fresh process), and "
      'process 0 writing it; seconds, medians.',
      '',
      *_list_table(
        [
          'Devices',
          'Shards',
          'Manifest',
          "A host's metadata step",
          'its peak above baseline, MiB',
          'inspect',
          'write',
        ],
        meta,
      ),
    ]
  return lines


def _growth_rows(report: dict[str, Any]) -> list[str]:
  rows = []
  for key, steps in report.get('growth', {}).items():
    for s in steps:
      rows.append(
        [
          f'``{key}``',
          f'{s["from"]:g} → {s["to"]:g} ({s["size_x"]:.1f}x)',
          _fmt(s['time_x']),
          _fmt(s['memory_x']),
        ]
      )
  return _list_table(
    ['What', 'Size', 'Time grows', 'Memory grows'],
    rows,
    widths=[40, 24, 18, 18],
  )


def _plot(data: dict[str, Any], path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use('Agg')
  from matplotlib import pyplot as plt

  report = data['current']
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))

  def series(group, role, key):
    points = []
    for e in report['results']:
      m = e['methods'].get(role, {})
      if e['group'] == group and 'seconds' in m:
        points.append((key(e['params']), m['seconds']['median']))
    return sorted(points)

  def draw(ax, group, roles, key, xlabel, title):
    for role, label in roles:
      points = series(group, role, key)
      if points:
        ax.plot(*zip(*points, strict=True), marker='o', label=label)
    ax.set_xscale('log', base=2)
    ax.set_yscale('log')
    ax.set_xlabel(xlabel)
    ax.set_ylabel('seconds (median)')
    ax.set_title(title)
    ax.grid(True, which='both', alpha=0.3)
    ax.legend()

  layers = lambda p: p['layers'] * 8.4  # noqa: E731 - M params per layer.
  draw(
    axes[0],
    'init_scaling',
    [
      ('ours', '`fdt.init`'),
      ('ours_eager', 'eager, flax_dtensor rules'),
      ('limit', 'unsharded (limit)'),
    ],
    layers,
    'million parameters',
    'Sharded creation',
  )
  draw(
    axes[1],
    'plan',
    [('ours', '`fdt.plan(factory)`'), ('peer', "Flax's `nnx.eval_shape`")],
    lambda p: p['variables'],
    'variables',
    'Planning from a factory',
  )
  mib = lambda p: p['arrays'] * p['mib']  # noqa: E731
  for role, method, label in (
    ('ours', 'save', '`save_checkpoint`'),
    ('limit', 'raw_write', 'NumPy write + fsync'),
    ('ours', 'restore', '`restore_checkpoint`'),
    ('limit', 'raw_read', 'NumPy read'),
  ):
    points = sorted(
      (mib(e['params']), e['methods'][role]['seconds']['median'])
      for e in report['results']
      if e['group'] == 'checkpoint_scaling'
      and e['methods'].get(role, {}).get('method') == method
      and 'seconds' in e['methods'][role]
    )
    if points:
      axes[2].plot(*zip(*points, strict=True), marker='o', label=label)
  axes[2].set_xscale('log', base=2)
  axes[2].set_yscale('log')
  axes[2].set_xlabel('MiB (32 arrays, sharded 8 ways)')
  axes[2].set_ylabel('seconds (median)')
  axes[2].set_title('Checkpoints')
  axes[2].grid(True, which='both', alpha=0.3)
  axes[2].legend()
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


class Benchmarks(Directive):
  has_content = False

  def run(self) -> list[nodes.Node]:
    env = self.state.document.settings.env
    env.note_dependency(str(RESULTS))
    data = _load()
    report = data['current']
    lines = [*_machine(report), '.. rubric:: Targets', '']
    lines += _targets_table(data)
    if 'before' in data:
      lines += [
        '"Before" is the same command on the code before this work '
        f"({data['before']['date'][:10]}, flax_dtensor's own measurements "
        'only).',
        '',
      ]
    scale = _scale_tables(report)
    if scale:
      lines += ['.. rubric:: Checkpoints as the devices grow', '', *scale]
    lines += ['.. rubric:: Scaling', '']
    lines += [f'.. image:: /{PLOT}', '   :width: 100%', '']
    lines += _growth_rows(report)
    lines += ['.. rubric:: Every measurement', '']
    lines += _all_rows(report)
    # The lines are reStructuredText (list tables, rubrics, an image):
    # parsed as such, whatever the page's own markup (MyST here).
    document = new_document('<benchmarks>', self.state.document.settings)
    RstParser().parse('\n'.join(lines), document)
    return document.children


def _make_plot(app: Sphinx) -> None:
  if RESULTS.exists():
    _plot(_load(), pathlib.Path(app.srcdir) / PLOT)


def setup(app: Sphinx) -> dict[str, bool]:
  app.add_directive('benchmarks', Benchmarks)
  app.connect('builder-inited', _make_plot)
  return {'parallel_read_safe': True, 'parallel_write_safe': True}
