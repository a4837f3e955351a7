"""The harness every benchmark group shares.

In a case's own process (`measure.py`): the peak-RSS window
(`reset_peak`, `rss_mib`), JAX on N CPU devices (`cpu_jax`), a scratch
folder (`scratch`), the launcher of a case's several processes (`launch`,
`jax_of_process`), and a measurement's result (`result`; `slowest`, of
several processes).

In `run.py`'s process: a case's record (`case`: its parameters, the method
of each role, the ratios to report), the fresh-process runner (`measure`:
one ``measure.py CASE METHOD PARAMS``, its one JSON line), the one-process
runner (`measure_in_one`: a case's every measurement in one ``measure.py
--jobs`` process, ``run.py --one-process``), the repeats taking turns
between the roles and their min / median / max and ratios of the medians
(`run`), the growth of the scaling groups (`growth`), the machine's
description, and the terminal's lines (`print_line`, `print_growth`).

For the comparisons with eformer (``eformer_*.py``): a peer's code run in
an interpreter of its own (`run_elsewhere`).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import itertools
import json
import os
import pathlib
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
# One measurement in a fresh process: ``measure.py CASE METHOD PARAMS``.
MEASURE = HERE / 'measure.py'


def _status_mib(field: str) -> float | None:
  try:
    with open('/proc/self/status') as f:
      for line in f:
        if line.startswith(field + ':'):
          return int(line.split()[1]) / 1024
  except OSError:
    pass
  return None


def reset_peak() -> float:
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
    return rss_mib()
  current = _status_mib('VmRSS')
  return rss_mib() if current is None else current


def rss_mib() -> float:
  """Peak resident MiB since the last `reset_peak()` (or process start)."""
  peak = _status_mib('VmHWM')
  if peak is not None:
    return peak
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_jax(devices: int = 8):
  import jax

  jax.config.update('jax_num_cpu_devices', devices)
  return jax


def release_free_memory() -> None:
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


@contextlib.contextmanager
def scratch(prefix: str):
  """A new folder (under $BENCH_DIR where set), removed after the block."""
  root = tempfile.mkdtemp(prefix=prefix, dir=os.environ.get('BENCH_DIR'))
  try:
    yield root
  finally:
    shutil.rmtree(root, ignore_errors=True)


def result(seconds: float, before: float, peak: float, **more) -> dict:
  """A measurement's result: its seconds, the RSS before it and its peak
  (MiB), and what else the case reports."""
  return {
    'seconds': seconds,
    'rss_before_mib': before,
    'rss_peak_mib': peak,
    **more,
  }


def slowest(outs: list[dict], *largest: str) -> dict:
  """The result of a step run in several processes (their results `outs`):
  the slowest one's seconds, the largest peak above its baseline, the
  largest of each field in `largest`, and every one's in `per_process`."""
  return result(
    max(o['seconds'] for o in outs),
    0.0,
    max(o['rss_peak_mib'] - o['rss_before_mib'] for o in outs),
    **{f: max(o[f] for o in outs) for f in largest},
    per_process=outs,
  )


def launch(method: str, params: dict, step: str = '_mp_step') -> list[dict]:
  """Runs `step` in `params['processes']` processes; their results."""
  import socket

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
        str(MEASURE),
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


def jax_of_process(devices: int, processes: int, process: int, port: int):
  """JAX with `devices` CPU devices, in process `process` of `processes`
  (a coordinator on 127.0.0.1:`port` when there are several)."""
  jax = cpu_jax()
  jax.config.update('jax_num_cpu_devices', devices)
  if processes > 1:
    jax.distributed.initialize(
      coordinator_address=f'127.0.0.1:{port}',
      coordinator_bind_address=f'127.0.0.1:{port}',
      num_processes=processes,
      process_id=process,
    )
  return jax


def case(case, params, methods, ratios=(), repeat=None, note=''):
  return {
    'case': case,
    'params': params,
    'methods': methods,
    'ratios': list(ratios),
    'repeat': repeat,
    'note': note,
  }


def _measure_env(repo):
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join(
    [str(repo)] + [p for p in [env.get('PYTHONPATH')] if p]
  )
  return env


def measure(case, method, params, repo, timeout):
  env = _measure_env(repo)
  try:
    proc = subprocess.run(
      [
        sys.executable,
        str(MEASURE),
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


def measure_in_one(jobs, repo, timeout):
  """Every ``(case, method, params)`` of `jobs` in one fresh process, in
  turn: their results, in order (``run.py --one-process``).

  What one process cannot give is each method's own peak: the device's
  peak bytes are the process's since its start (JAX cannot reset them), so
  none is claimed (`device_peak_bytes` is None, and where the device kept
  a count, `device_peak_unattributed` says so); the RSS window is each
  step's (`reset_peak`), but over the heap and caches the methods before
  it left.
  """
  env = _measure_env(repo)
  try:
    proc = subprocess.run(
      [sys.executable, str(MEASURE), '--jobs', json.dumps(jobs)],
      capture_output=True,
      text=True,
      timeout=timeout * max(1, len(jobs)),
      env=env,
      check=False,
    )
  except subprocess.TimeoutExpired:
    return [{'error': f'timed out after {timeout:.0f} s a job'}] * len(jobs)
  results = [
    json.loads(line.removeprefix('JOB '))
    for line in proc.stdout.splitlines()
    if line.startswith('JOB ')
  ]
  for r in results:
    if r.get('device_peak_bytes') is not None:
      # The process's peak, not the method's: none is claimed.
      r['device_peak_bytes'] = None
      r['device_peak_unattributed'] = True
  if len(results) < len(jobs):  # The process died: the rest did not run.
    tail = (proc.stderr.strip().splitlines() or ['(no output)'])[-1]
    error = {'error': f'exit {proc.returncode}: {tail[:300]}'}
    results += [error] * (len(jobs) - len(results))
  return results


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
    'device_peak_unattributed',
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


def machine():
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


def growth(results):
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


def print_growth(grown):
  for key, steps in grown.items():
    for s in steps:
      time_x = '-' if s['time_x'] is None else f'{s["time_x"]:.2f}x'
      print(
        f'{"growth":<13} {key:<62} {s["from"]:>6g} -> {s["to"]:<6g} '
        f'({s["size_x"]:.0f}x): time {time_x}',
        flush=True,
      )


def run(groups, repeat, repo, timeout, label, roles, one_process=False):
  """Measures each case of `groups`: each measurement in a fresh process,
  or, `one_process`, each case's every measurement in one
  (`measure_in_one`)."""
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
      if one_process:  # Not a benchmark of memory (`measure_in_one`).
        entry['measured']['one_process'] = True
      chosen = {
        role: method
        for role, method in spec['methods'].items()
        if not roles or role in roles
      }
      # Repeats take turns between the roles, so that a machine busier for
      # a while slows every role alike rather than one.
      runs = {role: [] for role in chosen}
      turns = [role for _ in range(n) for role in chosen]
      if one_process:
        measured = measure_in_one(
          [[spec['case'], chosen[r], spec['params']] for r in turns],
          repo,
          timeout,
        )
      else:
        measured = (
          measure(spec['case'], chosen[r], spec['params'], repo, timeout)
          for r in turns
        )
      for role, result in zip(turns, measured, strict=True):
        runs[role].append(result)
      for role, method in chosen.items():
        entry['methods'][role] = {'method': method} | _summary(runs[role])
        print_line(group, spec['params'], role, entry['methods'][role])
      entry['ratio'] = _ratios(entry)
      for name, value in entry['ratio'].items():
        print(f'{"":<13} {"":<48} {name:<22} {value:8.2f}x', flush=True)
      results.append(entry)
  grown = growth(results)
  print_growth(grown)
  return {
    'label': label,
    'date': _now(),
    'repeat': repeat,
    'command': _command(),
    'machine': machine(),
    'results': results,
    'growth': grown,
  }


def _now():
  return datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')


def _command():
  return ' '.join(['python', 'benchmarks/run.py', *sys.argv[1:]])


def print_line(group, params, role, summary):
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


def run_elsewhere(python: str, code: str, cases: list, timeout: float):
  """Runs `code` in the interpreter `python`, `cases` as JSON on its stdin:
  the JSON of its last line; exits with its stderr where it fails."""
  proc = subprocess.run(
    [python, '-c', code],
    input=json.dumps(cases),
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )
  if proc.returncode:
    sys.exit(f'eformer failed:\n{proc.stderr[-3000:]}')
  return json.loads(proc.stdout.strip().splitlines()[-1])
