"""Every docstring example of the package runs, on 8 virtual devices.

The modules are found, not listed: any module whose source holds an example
(``>>>``) is tested. The demo's are run by demo_test.py.
"""

import doctest
import importlib
import pathlib
import pkgutil

import pytest

import flax_dtensor

PACKAGE = pathlib.Path(flax_dtensor.__file__).parent


def _modules_with_examples():
  names = []
  for info in pkgutil.walk_packages([str(PACKAGE)], 'flax_dtensor.'):
    if info.name.startswith('flax_dtensor.demo'):
      continue
    spec = importlib.util.find_spec(info.name)
    source = pathlib.Path(spec.origin).read_text()
    if '>>> ' in source:
      names.append(info.name)
  return sorted(names)


MODULES = _modules_with_examples()


def test_the_core_modules_have_examples():
  assert {
    'flax_dtensor._rules._logical',
    'flax_dtensor._planning._plan',
    'flax_dtensor._placement._init',
  } <= set(MODULES)


@pytest.mark.parametrize('name', MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  result = doctest.testmod(
    module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
  )
  assert result.failed == 0
