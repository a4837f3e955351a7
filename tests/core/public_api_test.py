"""The public API is a contract: check it against a checked-in list."""

import importlib
import io
import pathlib
import tokenize

import pytest
from support import processes

import flax_dtensor as fdt
from flax_dtensor import _lazy

EXPECTED = (
  'CheckReport',
  'DTensorError',
  'DTensorInitializationError',
  'EagerShardingOffWarning',
  'ExportError',
  'FlaxCompatibilityError',
  'Finding',
  'FactoryError',
  'FlaxDTensorError',
  'LayoutFileError',
  'LikelyTypoWarning',
  'LogicalRules',
  'LogicalRulesError',
  'MemoryReport',
  'MeshAxisTypeError',
  'MeshError',
  'MissingMeshAxisError',
  'NotAModelError',
  'PathRule',
  'PlanDiff',
  'PlanEntry',
  'RuleTargetTypeError',
  'RulesSuggestion',
  'ShardingPlan',
  'ShardingResolutionError',
  'UnknownLogicalAxisError',
  'check',
  'clear_init_cache',
  'gather_tree',
  'get_logical_axis_rules',
  'init',
  'logical_axis_rules',
  'logical_to_mesh_axes',
  'memory_report',
  'plan',
  'propagate',
  'set_logical_axis_rules',
  'shard_module',
  'shard_tree',
  'shard_value',
  'suggest_rules',
  'with_logical_constraint',
)


# flax_dtensor.dtensor, the TensorFlow bridge.
EXPECTED_DTENSOR = (
  'CheckpointManager',
  'CheckpointManagerError',
  'CheckpointStepWarning',
  'DamagedExportError',
  'DiskFullError',
  'ExportNotFoundError',
  'MalformedExportError',
  'PeerError',
  'RelaidVariable',
  'SaveHandle',
  'SaveInProgressError',
  'ServedShapeWarning',
  'ServingSignature',
  'SingleMeshReport',
  'VerificationReport',
  'array_to_dtensor',
  'checkpoint_key',
  'dtensor_to_array',
  'flat_variables',
  'from_tf_module',
  'initialize',
  'is_initialized',
  'layout_for',
  'mesh_to_dtensor',
  'nnx_path',
  'read_checkpoint',
  'restore_checkpoint',
  'restore_from_tf',
  'save_checkpoint',
  'save_saved_model',
  'shutdown',
  'to_tf_module',
  'verify_saved_model',
)


def test_all_matches_the_contract():
  import flax_dtensor.dtensor as fdt_tf

  for module, expected in [(fdt, EXPECTED), (fdt_tf, EXPECTED_DTENSOR)]:
    assert tuple(sorted(module.__all__)) == tuple(sorted(expected))
    for name in module.__all__:
      obj = getattr(module, name)
      assert obj.__doc__, f'{name} has no docstring'


def _namespaces():
  import flax_dtensor.dtensor as fdt_tf

  return (fdt, fdt_tf)


def _lines_naming(path, name):
  """The logical lines of a file that spell `name` (a name or a string)."""
  if not path.exists():
    return set()
  rows, row = set(), 1
  tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
  for token in tokens:
    if token.type in (tokenize.NEWLINE, tokenize.NL):
      row = token.end[0] + 1
    elif token.string == name or (
      token.type == tokenize.STRING and token.string.strip('\'"') == name
    ):
      rows.add(row)
  return rows


def test_each_public_name_is_written_once_in_its_namespace():
  """A namespace's files (``__init__.py`` and its stub) spell each public
  name in one statement: the stub's import, which type checkers read and
  the lazy namespace parses."""
  for module in _namespaces():
    init = pathlib.Path(module.__file__)
    stub = init.with_suffix('.pyi')
    for name in module.__all__:
      assert not _lines_naming(init, name), (init, name)
      assert len(_lines_naming(stub, name)) == 1, (stub, name)


def test_the_stub_gives_all_dir_and_getattr():
  for module in _namespaces():
    stub = pathlib.Path(module.__file__).with_suffix('.pyi').read_text()
    table = _lazy.public_names(stub, module.__name__)
    assert len(table) > 20, table
    assert module.__all__ == tuple(sorted(table))
    version = ['__version__'] if module is fdt else []
    assert dir(module) == sorted([*table, *version])
    for name, where in table.items():
      defining = importlib.import_module(f'{module.__name__}.{where}')
      assert getattr(module, name) is getattr(defining, name), name
    with pytest.raises(AttributeError, match=r"has no attribute 'shard_tre'"):
      module.shard_tre  # noqa: B018


def test_a_name_added_to_the_stub_is_public(tmp_path):
  """One line of a stub is all a new public name needs."""
  (tmp_path / '__init__.pyi').write_text(
    '# A stub.\n'
    'from flax_dtensor._placement._trees import (\n'
    '  gather_tree as gather_tree,\n'
    ')\n'
    'from flax_dtensor._placement._trees import shard_tree as shard_tree\n'
    '__version__: str\n'
  )
  namespace = {'__version__': '9'}
  all_, getattr_, dir_ = _lazy.namespace(
    'flax_dtensor', str(tmp_path / '__init__.py'), namespace
  )
  assert all_ == ('gather_tree', 'shard_tree')
  assert dir_() == ['__version__', 'gather_tree', 'shard_tree']
  assert getattr_('shard_tree') is fdt.shard_tree
  assert namespace['shard_tree'] is fdt.shard_tree
  with pytest.raises(AttributeError, match=r"'flax_dtensor' has no .*'plan'"):
    getattr_('plan')


@pytest.mark.parametrize(
  'line, match',
  [
    (
      'from flax_dtensor._trees import shard_tree as shard',
      r"re-export each name as itself .* line 1: 'from flax_dtensor\._trees "
      r"import shard_tree as shard'",
    ),
    (
      'from flax_dtensor._trees import shard_tree',
      r're-export each name as itself',
    ),
    (
      'from ._trees import shard_tree as shard_tree',
      r"import from flax_dtensor\.\*, got line 1: 'from \._trees import",
    ),
    (
      'from jax import jit as jit',
      r"import from flax_dtensor\.\*, got line 1: 'from jax import jit",
    ),
  ],
  ids=['renamed', 'private', 'relative', 'foreign'],
)
def test_a_stub_the_namespace_cannot_hand_out_is_refused(line, match):
  with pytest.raises(ImportError, match=match):
    _lazy.public_names(line + '\n', 'flax_dtensor')


def test_errors_subclass_valueerror_or_typeerror():
  for name in fdt.__all__:
    obj = getattr(fdt, name)
    if isinstance(obj, type) and issubclass(obj, Warning):
      assert issubclass(obj, UserWarning), name
    elif isinstance(obj, type) and issubclass(obj, Exception):
      assert issubclass(obj, fdt.FlaxDTensorError)
      if obj is not fdt.FlaxDTensorError:
        assert issubclass(obj, (ValueError, TypeError)), name


def test_the_bridge_errors_are_export_errors():
  """The bridge's own error classes are kinds of ExportError, so that
  ``except ExportError`` still catches each."""
  import flax_dtensor.dtensor as fdt_tf

  classes = [
    getattr(fdt_tf, name)
    for name in fdt_tf.__all__
    if isinstance(getattr(fdt_tf, name), type)
    and issubclass(getattr(fdt_tf, name), Exception)
  ]
  errors = [c for c in classes if not issubclass(c, Warning)]
  assert len(errors) == 7, errors
  for error in errors:
    assert issubclass(error, fdt.ExportError), error
    assert error.__name__.endswith('Error'), error
  warned = [c for c in classes if issubclass(c, Warning)]
  assert warned == [fdt_tf.CheckpointStepWarning, fdt_tf.ServedShapeWarning]
  assert all(issubclass(w, UserWarning) for w in warned)


def _run(code, **env):
  return processes.run_python(
    '-c', code, env=processes.clean_env(**env), timeout=120
  )


def _imports_none_of(*packages):
  """Code asserting that no module of `packages` has been imported."""
  return (
    f'bad = sorted(m for m in sys.modules if m.split(".")[0] in {packages})\n'
    'assert not bad, bad\n'
  )


def _assert_runs_through(code):
  """Runs `code` in a fresh Python, which must reach its end."""
  proc = _run(code + "print('ok')\n")
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == 'ok'


def test_import_pulls_in_only_what_the_core_needs():
  """No TensorFlow, no command-line libraries, no JAX backend at import.

  `import flax_dtensor` imports nothing at all (a lazy namespace); the
  first public name imports JAX and Flax, never TensorFlow.
  """
  code = (
    'import sys, flax_dtensor, flax_dtensor.dtensor\n'
    "assert 'jax' not in sys.modules and 'flax' not in sys.modules\n"
    'flax_dtensor.LogicalRules, flax_dtensor.dtensor.save_checkpoint\n'
    + _imports_none_of('tensorflow', 'typer', 'orbax', 'matplotlib', 'keras')
    + "assert 'flax_dtensor.cli' not in sys.modules\n"
    '# The backend has not started: the device count can still be set.\n'
    'import jax\n'
    "jax.config.update('jax_num_cpu_devices', 3)\n"
    'assert jax.device_count() == 3, jax.devices()\n'
  )
  _assert_runs_through(code)


def test_the_command_line_imports_neither_jax_nor_tensorflow():
  """Each command imports JAX, Flax and TF when it runs, not before."""
  code = 'import sys, flax_dtensor.cli._app\n' + _imports_none_of(
    'tensorflow', 'jax', 'flax', 'numpy', 'orbax', 'optax'
  )
  _assert_runs_through(code)


def test_the_command_line_without_its_extra_says_what_to_install():
  code = (
    'import sys\n'
    "sys.modules['typer'] = None  # As if the cli extra were not installed.\n"
    'from flax_dtensor import cli\n'
    "cli.main(['--help'])\n"
  )
  proc = _run(code)
  assert proc.returncode == 1
  assert proc.stderr.startswith(
    'error: the flax-dtensor command needs its extra: pip install '
    '"flax-dtensor[cli]"'
  )
