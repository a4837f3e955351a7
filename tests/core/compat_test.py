"""The supported JAX and Flax releases: the pins, the check, its refusal."""

import textwrap
import tomllib

import flax
import jax
import pytest
from support import processes

import flax_dtensor as fdt
from flax_dtensor import _compat

ROOT = processes.REPO_ROOT


def test_the_pins_are_the_supported_ranges():
  project = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
  pins = {d.split('>=')[0]: d for d in project['dependencies'] if '>=' in d}
  for name, (low, high) in _compat.SUPPORTED.items():
    assert pins[name] == f'{name}>={low},<{high}'


def test_the_installed_releases_are_supported():
  assert _compat.is_supported('jax', jax.__version__)
  assert _compat.is_supported('flax', flax.__version__)


@pytest.mark.parametrize(
  'name, version, supported',
  [
    ('jax', '0.10.2', True),
    ('jax', '0.11.0', True),
    ('jax', '0.12.0.1', True),
    ('jax', '0.12.99', True),
    ('jax', '0.10.1', False),
    ('jax', '0.10.2rc1', False),
    ('jax', '0.13.0', False),
    ('jax', '0.13.0.dev20261120', False),
    ('jax', '1.0', False),
    ('flax', '0.12.8', True),
    ('flax', '0.12.12', True),
    ('flax', '0.12.7', False),
    ('flax', '0.13.0rc1', False),
    ('flax', 'main', False),
  ],
)
def test_releases_inside_and_outside_the_range(name, version, supported):
  assert _compat.is_supported(name, version) is supported


def test_a_release_outside_the_range_is_refused_in_our_words(monkeypatch):
  monkeypatch.delenv(_compat.SKIP_ENV, raising=False)
  with pytest.raises(
    fdt.FlaxCompatibilityError,
    match=r'flax_dtensor supports jax>=0\.10\.2,<0\.13, flax>=0\.12\.8,<0\.13, '
    r'but found flax 0\.13\.0\. .*pip install "flax>=0\.12\.8,<0\.13"\).*'
    r'FLAX_DTENSOR_SKIP_VERSION_CHECK=1',
  ):
    _compat.check_versions({'jax': '0.12.0.1', 'flax': '0.13.0'})
  monkeypatch.setenv(_compat.SKIP_ENV, '1')
  _compat.check_versions({'jax': '0.12.0.1', 'flax': '0.13.0'})


def test_the_first_public_name_refuses_an_unsupported_flax():
  """In a fresh process: nothing is wrapped, our error is raised."""
  code = textwrap.dedent(
    """
    import flax
    flax.__version__ = '0.13.0'
    import flax_dtensor as fdt
    from flax.core import spmd
    try:
      fdt.LogicalRules
    except fdt.FlaxCompatibilityError as e:
      print(type(e).__name__, '|', e)
    print('wrapped', hasattr(spmd.shard_value, '__flax_dtensor_hook__'))
    """
  )
  env = processes.clean_env(**{_compat.SKIP_ENV: None})
  proc = processes.run_python('-c', code, env=env, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  first, second = proc.stdout.strip().splitlines()
  assert first.startswith('FlaxCompatibilityError | flax_dtensor supports')
  assert 'but found flax 0.13.0' in first
  assert second == 'wrapped False'
