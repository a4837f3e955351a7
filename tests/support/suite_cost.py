"""What each test costs: a pytest plugin that records it, one line a test.

For every test it records the seconds of its setup (the module's and the
session's fixtures are paid by the first test that needs them), its call
and its teardown; how many fresh processes it started (`subprocess.Popen`,
seen through Python's audit hook, `python` and other programs alike); how
many scripts it ran in the warm pool's forks (`warm.FORK_EVENT`); how
many compilations its own process asked for (JAX's
`/jax/core/compile/backend_compile_duration` event, which wraps the
persistent cache's look-up; those of the processes it started are theirs)
and how many of them the persistent cache served; and whether TensorFlow
was first imported in its worker by it (or by its file's import, at collection).

The figures travel on the reports' `user_properties`, so pytest-xdist's
workers send them to the main process, which writes them as JSON lines to
`--suite-profile PATH` (or $FDT_SUITE_PROFILE). `tools/suite_profile.py`
turns that file into a per-file table (`tests/README.md`, Profiling).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
import time

import pytest

# A warm pool's script is no `subprocess.Popen`: warm.py says so itself.
FORK_EVENT = 'flax_dtensor.tests.warm_fork'
_PROPERTY = 'suite_cost'

_counts = {'processes': 0, 'forks': 0, 'compiles': 0, 'cache_hits': 0}
_listening = False


def _audit(event: str, args) -> None:
  del args
  if event == 'subprocess.Popen':
    _counts['processes'] += 1
  elif event == FORK_EVENT:
    _counts['forks'] += 1


def _listen() -> None:
  """Counts compilations once JAX is imported (conftest.py imports it)."""
  global _listening
  if _listening:
    return
  _listening = True
  sys.addaudithook(_audit)
  from jax import monitoring

  def on_duration(event: str, duration: float, **kwargs) -> None:
    del duration, kwargs
    if event == '/jax/core/compile/backend_compile_duration':
      _counts['compiles'] += 1

  def on_event(event: str, **kwargs) -> None:
    del kwargs
    if event == '/jax/compilation_cache/cache_hits':
      _counts['cache_hits'] += 1

  monitoring.register_event_duration_secs_listener(on_duration)
  monitoring.register_event_listener(on_event)


def pytest_addoption(parser):
  parser.addoption(
    '--suite-profile',
    default=os.environ.get('FDT_SUITE_PROFILE') or None,
    metavar='PATH',
    help='write what each test cost (seconds, processes, compilations, '
    'TensorFlow imports) to PATH as JSON lines; tools/suite_profile.py '
    'turns it into a table ($FDT_SUITE_PROFILE)',
  )


def pytest_configure(config):
  _listen()
  config._suite_cost_rows = []


# Test files whose import (at collection) imported TensorFlow first in this
# process: their first test reports it.
_tf_at_collection: set[str] = set()


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
  had = 'tensorflow' in sys.modules
  yield
  if not had and 'tensorflow' in sys.modules and hasattr(collector, 'path'):
    _tf_at_collection.add(str(collector.path))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
  del nextitem
  item._suite_cost_start = (
    dict(_counts),
    'tensorflow' in sys.modules,
  )
  yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  if call.when != 'teardown':
    return
  before, had_tf = getattr(item, '_suite_cost_start', (dict(_counts), True))
  cost = {name: _counts[name] - before[name] for name in _counts}
  cost['tf_import'] = int(not had_tf and 'tensorflow' in sys.modules)
  if str(item.path) in _tf_at_collection:  # Its file's import did.
    _tf_at_collection.discard(str(item.path))
    cost['tf_import'] = 1
  outcome.get_result().user_properties.append((_PROPERTY, cost))


def pytest_runtest_logreport(report):
  config = _CONFIG.get('config')
  if (
    config is None
    or hasattr(config, 'workerinput')
    or not config.getoption('suite_profile')
  ):
    return
  rows = config._suite_cost_rows
  node = getattr(report, 'node', None)
  worker = getattr(getattr(node, 'gateway', None), 'id', None) or 'main'
  if report.when == 'setup':
    rows.append(
      {
        'nodeid': report.nodeid,
        'file': report.nodeid.split('::', 1)[0],
        'worker': worker,
        'setup': report.duration,
        'call': 0.0,
        'teardown': 0.0,
        'outcome': report.outcome,
      }
    )
    return
  row = next((r for r in reversed(rows) if r['nodeid'] == report.nodeid), None)
  if row is None:
    return
  row[report.when] = report.duration
  if report.outcome != 'passed':
    row['outcome'] = report.outcome
  for name, value in report.user_properties:
    if name == _PROPERTY:
      row.update(value)


_CONFIG: dict[str, pytest.Config] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
  _CONFIG['config'] = session.config
  session.config._suite_cost_t0 = time.time()


def pytest_sessionfinish(session):
  config = session.config
  path = config.getoption('suite_profile')
  # Only the main process writes (xdist's workers have `workerinput`).
  if not path or hasattr(config, 'workerinput'):
    return
  wall = time.time() - config._suite_cost_t0
  with open(path, 'w', encoding='utf-8') as f:
    header = {
      'wall_seconds': wall,
      'argv': sys.argv[1:],
      'python': platform.python_version(),
      'jax': _version('jax'),
      'flax': _version('flax'),
      'load_average': os.getloadavg(),
    }
    f.write(json.dumps(header) + '\n')
    for row in config._suite_cost_rows:
      f.write(json.dumps(row) + '\n')


def _version(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None
