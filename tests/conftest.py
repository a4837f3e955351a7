"""Test configuration: 8 virtual CPU devices, set before any backend starts.

The tests are laid out as the package is: rules/, placement/, hook/ and
planning/ for the core's rooms, core/ for the package as a whole (its
layers, public names, supported versions), bridge/ (flax_dtensor.dtensor,
in its rooms: layout/, conversion/, format/, storage/, checkpoints/,
serving/, each with its multi-process and fault tests; the bridge as a
whole at the top), cli/, docs/ (the README, the pages, the docstrings and
notebooks run); support/ holds what is not a test (helpers,
case tables, and workers/, the scripts run in processes of their own), a
package that tests import as ``support`` (``pythonpath`` in pyproject.toml;
the processes they start get it on PYTHONPATH).
"""

import fnmatch
import os
import pathlib
import shutil
import sys
import tempfile

# Both knobs, before `jax` is imported anywhere: XLA_FLAGS for subprocesses
# that inherit the environment, the config option for this process.
_FLAG = '--xla_force_host_platform_device_count=8'
if _FLAG not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + ' ' + _FLAG
  ).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# Keep TensorFlow's C++ logging out of test output.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

# JAX's persistent compilation cache, in one fresh folder per run (the
# cache holds compiled code, so never a shared or a user's folder): the
# program one test compiled, another test, worker or started process reads
# back. The run's first process (pytest's, before pytest-xdist starts its
# workers, which inherit the environment) makes the folder and removes it
# at the end; a run given $FDT_TEST_RUN_DIR uses that one.
_RUN_DIR_OWNED = 'FDT_TEST_RUN_DIR' not in os.environ
if _RUN_DIR_OWNED:
  os.environ['FDT_TEST_RUN_DIR'] = tempfile.mkdtemp(prefix='fdt-tests-')
os.environ.update(
  {
    'JAX_COMPILATION_CACHE_DIR': os.path.join(
      os.environ['FDT_TEST_RUN_DIR'], 'xla-cache'
    ),
    'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
    'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES': '0',
  }
)

import jax  # noqa: E402
import pytest  # noqa: E402
from support import profiles  # noqa: E402

# Hypothesis: the suite's quick profile, or $HYPOTHESIS_PROFILE's
# (tests/support/profiles.py).
profiles.load()

jax.config.update('jax_num_cpu_devices', 8)
jax.config.update('jax_numpy_rank_promotion', 'raise')

NUM_DEVICES = 8

# What each test costs, for tools/suite_profile.py (`--suite-profile`).
pytest_plugins = ('support.suite_cost',)


def pytest_unconfigure(config):
  del config
  if _RUN_DIR_OWNED:
    shutil.rmtree(os.environ['FDT_TEST_RUN_DIR'], ignore_errors=True)


def pytest_configure(config):
  del config
  devices = jax.devices()
  if jax.default_backend() != 'cpu':
    raise pytest.UsageError(
      f'flax_dtensor tests run on the CPU backend; got '
      f'{jax.default_backend()!r}. Set JAX_PLATFORMS=cpu.'
    )
  if len(devices) < NUM_DEVICES:
    raise pytest.UsageError(
      f'Expected {NUM_DEVICES} virtual CPU devices, found {len(devices)}. '
      f'JAX started before tests/conftest.py could set '
      f'XLA_FLAGS={_FLAG!r}; run pytest from the repository root.'
    )


def _mesh(data, model):
  """A (2, 4) ('data', 'model') mesh of these axis types."""
  return jax.make_mesh((2, 4), ('data', 'model'), axis_types=(data, model))


@pytest.fixture
def explicit_mesh():
  """A (2, 4) ('data', 'model') mesh with Explicit axes."""
  return _mesh(jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Explicit)


@pytest.fixture
def auto_mesh():
  """A (2, 4) ('data', 'model') mesh with Auto axes."""
  return _mesh(jax.sharding.AxisType.Auto, jax.sharding.AxisType.Auto)


@pytest.fixture
def mixed_mesh():
  """A (2, 4) mesh: 'data' Explicit, 'model' Auto."""
  return _mesh(jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto)


@pytest.fixture(params=['explicit', 'auto', 'mixed'])
def any_mesh(request):
  """Each of the three (2, 4) meshes in turn."""
  return request.getfixturevalue(f'{request.param}_mesh')


@pytest.fixture(scope='session')
def warm_pool():
  """The session's `warm.Pool`: fresh processes without the imports' cost.

  Started at its first use (JAX, Flax and TensorFlow imported once), killed
  with every script still running at the session's end; the pool that
  multiprocess_util's workers are forked from, too (`warm.shared()`).
  """
  from support import warm

  pool = warm.shared()
  yield pool
  pool.close()


@pytest.fixture(scope='session')
def tf_pool():
  """The session's TensorFlow-only `warm.Pool` (`warm.tf_only()`): the
  serving and reading scripts that block JAX (`processes.NO_JAX`) run in
  its forks, TensorFlow imported once a worker."""
  from support import warm

  pool = warm.tf_only()
  yield pool
  pool.close()


# Slow tests: each needs a reason
# ------------------------------------------------------------------------------

# A test whose call takes longer than this outside the `multiprocess` marker
# says why in its docstring, on a line starting 'Slow:'; the terminal
# summary lists those that do not. Setup is not counted: a module's or the
# session's fixtures (TensorFlow's start, a shared export) are paid once,
# by whichever test comes first.
SLOW_SECONDS = 20.0
SLOW_MARK = 'Slow:'
_unexplained: list[tuple[str, float]] = []


def _explains_its_cost(item) -> bool:
  if item.get_closest_marker('multiprocess') is not None:
    return True
  doc = getattr(getattr(item, 'function', None), '__doc__', None) or ''
  return any(line.strip().startswith(SLOW_MARK) for line in doc.splitlines())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  if (
    call.when == 'call'
    and call.duration > SLOW_SECONDS
    and not _explains_its_cost(item)
  ):
    # Said on the report, which pytest-xdist's workers send to the main
    # process: the summary is printed there.
    outcome.get_result().user_properties.append((SLOW_MARK, call.duration))


def pytest_runtest_logreport(report):
  for name, seconds in report.user_properties:
    if name == SLOW_MARK and report.when == 'call':
      _unexplained.append((report.nodeid, seconds))


# pytest-xdist (`-n auto`): at most 4 workers, each of which holds JAX,
# TensorFlow and 8 virtual devices (up to 6 GB at the suite's peak).
MAX_WORKERS = 4


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
  del config
  if os.environ.get('PYTEST_XDIST_AUTO_NUM_WORKERS'):
    return None  # pytest-xdist's own reading of it.
  return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """Under `--dist loadfile` (the suite's): whole files, dearest first."""
  if config.getoption('dist') != 'loadfile':
    return None
  from support import scheduling

  return scheduling.CostFirstScheduling(config, log)


def pytest_terminal_summary(terminalreporter):
  if not _unexplained:
    return
  terminalreporter.section(
    f'tests over {SLOW_SECONDS:.0f} s without a reason', sep='-', yellow=True
  )
  terminalreporter.line(
    f'Each needs the multiprocess marker, or a line starting {SLOW_MARK!r} '
    'in its docstring saying why it costs that (or make it cheaper):'
  )
  for nodeid, seconds in sorted(_unexplained, key=lambda x: -x[1]):
    terminalreporter.line(f'{seconds:7.1f} s  {nodeid}')


# What a test needs, by its path: markers for tiers
# ------------------------------------------------------------------------------

# Paths under tests/ (fnmatch patterns) whose tests need TensorFlow, in this
# process or in the processes they start; a test that uses the warm pool
# (which imports TensorFlow) is marked too. The quick tier,
# `pytest -m "not tf and not multiprocess"`, runs without TensorFlow: a test
# outside these paths that imports it fails (`_tensorflow_only_where_marked`),
# so the list stays true.
TF_PATHS = (
  'bridge/*',
  'cli/*',
  'core/architecture_test.py',
  'core/other_library_test.py',
  'core/public_api_test.py',
  'core/sharding_metadata_test.py',
  'docs/*',
)
# Files whose tests start several processes joined by `jax.distributed`.
MULTIPROCESS_PATHS = ('*/multiprocess_*_test.py',)
TESTS_DIR = pathlib.Path(__file__).resolve().parent


def _matches(item, patterns) -> bool:
  try:
    path = pathlib.Path(str(item.path)).resolve().relative_to(TESTS_DIR)
  except ValueError:
    return False
  return any(fnmatch.fnmatch(path.as_posix(), p) for p in patterns)


def _excludes(markexpr: str, marker: str) -> bool:
  """Whether `-m markexpr` deselects every test marked `marker`, whatever
  its other markers."""
  from _pytest.mark.expression import Expression

  expression = Expression.compile(markexpr)
  return not any(
    expression.evaluate(
      lambda name, /, others=others, **kw: name == marker or others
    )
    for others in (False, True)
  )


def pytest_ignore_collect(collection_path, config):
  """Under `-m "not tf ..."`, the files of TF_PATHS are not even imported:
  the quick tier runs without TensorFlow in the process."""
  markexpr = config.getoption('markexpr')
  if not markexpr or collection_path.suffix != '.py':
    return None
  try:
    path = collection_path.resolve().relative_to(TESTS_DIR).as_posix()
  except ValueError:
    return None
  if _excludes(markexpr, 'tf') and any(
    fnmatch.fnmatch(path, p) for p in TF_PATHS
  ):
    return True
  return None


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    if _matches(item, TF_PATHS) or 'warm_pool' in item.fixturenames:
      item.add_marker(pytest.mark.tf)
    if _matches(item, MULTIPROCESS_PATHS):
      item.add_marker(pytest.mark.multiprocess)


@pytest.fixture(autouse=True)
def _no_export_remembered():
  """Each test's first SavedModel export of a model is traced: what an
  earlier test exported is not reused (`_serving._reexport`)."""
  reexport = sys.modules.get('flax_dtensor.dtensor._serving._reexport')
  if reexport is not None:
    reexport.clear()


@pytest.fixture(autouse=True)
def _tensorflow_only_where_marked(request):
  """A test not marked `tf` that imports TensorFlow fails, naming TF_PATHS."""
  had = 'tensorflow' in sys.modules
  yield
  if (
    not had
    and 'tensorflow' in sys.modules
    and request.node.get_closest_marker('tf') is None
  ):
    pytest.fail(
      f'{request.node.nodeid} imported TensorFlow but is not marked `tf`: '
      'add its path to TF_PATHS in tests/conftest.py, or move it to a file '
      'of tests that need TensorFlow',
      pytrace=False,
    )


@pytest.fixture(scope='session')
def dtensor():
  """`flax_dtensor.dtensor`, DTensor set up on the 8 devices, once a session.

  DTensor must be set up before any other TensorFlow operation of the
  process; tests/bridge/conftest.py asks for it for every bridge test.
  """
  fdt_dt = pytest.importorskip('flax_dtensor.dtensor')
  fdt_dt.initialize()
  return fdt_dt
