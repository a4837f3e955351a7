"""The docstring examples of the core modules run, on 8 virtual devices."""

import doctest
import importlib

import pytest

MODULES = (
  'flax_dtensor._rules',
  'flax_dtensor._sharding',
  'flax_dtensor._plan',
)


@pytest.mark.parametrize('name', MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  result = doctest.testmod(
    module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
  )
  assert result.attempted > 0, f'{name} has no examples'
  assert result.failed == 0
