"""The public API is a contract: check it against a checked-in list."""

import os
import subprocess
import sys

import flax_dtensor as fdt

EXPECTED = (
  'DTensorError',
  'DTensorInitializationError',
  'ExportError',
  'FlaxCompatibilityError',
  'FlaxDTensorError',
  'LogicalRules',
  'LogicalRulesError',
  'MeshAxisTypeError',
  'MeshError',
  'NotAModelError',
  'PlanEntry',
  'RuleTargetTypeError',
  'ShardingPlan',
  'ShardingResolutionError',
  'UnknownLogicalAxisError',
  'get_logical_axis_rules',
  'init',
  'logical_axis_rules',
  'logical_to_mesh_axes',
  'plan',
  'propagate',
  'set_logical_axis_rules',
  'shard_module',
  'shard_value',
  'with_logical_constraint',
)


def test_all_matches_the_contract():
  assert tuple(sorted(fdt.__all__)) == tuple(sorted(EXPECTED))
  for name in fdt.__all__:
    obj = getattr(fdt, name)
    assert obj.__doc__, f'{name} has no docstring'


def test_errors_subclass_valueerror_or_typeerror():
  for name in fdt.__all__:
    obj = getattr(fdt, name)
    if isinstance(obj, type) and issubclass(obj, Exception):
      assert issubclass(obj, fdt.FlaxDTensorError)
      if obj is not fdt.FlaxDTensorError:
        assert issubclass(obj, (ValueError, TypeError)), name


def test_import_does_not_import_tensorflow():
  code = (
    'import sys, flax_dtensor, flax_dtensor.dtensor\n'
    'import flax_dtensor.cli\n'
    "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'tensorflow')\n"
    'assert not bad, bad\n'
    "print('ok')\n"
  )
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  out = subprocess.run(
    [sys.executable, '-c', code],
    capture_output=True,
    text=True,
    timeout=120,
    env=env,
    check=False,
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == 'ok'
