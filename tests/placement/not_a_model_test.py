"""Every entry point refuses what is no model, in our words, naming it.

`None`, a number or a string handed where a module, state or factory
belongs is a `NotAModelError` (a TypeError) that says what arrived, never
an empty plan, a clean check or another library's error. The export's
entry points are checked in tests/bridge/checkpoints/reliability_test.py.
"""

import jax
import pytest

import flax_dtensor as fdt

NOT_MODELS = [None, 42, 'model']
_NOT_A_NODE = (
  r'Expected an NNX module, another NNX graph node \(e\.g\. nnx\.Optimizer\) '
  r'or an nnx\.State; got {type}'
)


@pytest.fixture(scope='module')
def mesh():
  return jax.make_mesh((1,), ('data',))


@pytest.mark.parametrize('value', NOT_MODELS, ids=repr)
@pytest.mark.parametrize(
  'entry',
  [
    lambda x, mesh: fdt.plan(x, mesh=mesh),
    lambda x, mesh: fdt.check(x, mesh=mesh),
    lambda x, mesh: fdt.shard_module(x, mesh=mesh),
  ],
  ids=['plan', 'check', 'shard_module'],
)
def test_module_entry_points_refuse_what_is_no_model(entry, value, mesh):
  match = _NOT_A_NODE.format(type=type(value).__name__)
  with pytest.raises(fdt.NotAModelError, match=match):
    entry(value, mesh)


@pytest.mark.parametrize('value', NOT_MODELS, ids=repr)
def test_init_refuses_what_is_no_factory(value, mesh):
  match = (
    rf'Expected `fdt.init` to be given a factory \(a callable that builds '
    rf'the model\), got {type(value).__name__}: {value!r}\. Pass e\.g\. '
  )
  with pytest.raises(fdt.NotAModelError, match=match):
    fdt.init(value, mesh=mesh)
  assert issubclass(fdt.NotAModelError, TypeError)
