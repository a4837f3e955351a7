"""Which part of a checkpoint holds a model (`_parts`), by paths alone."""

import pytest
from flax import nnx

from flax_dtensor import _errors
from flax_dtensor._placement import _parts


def _model():
  return nnx.eval_shape(
    lambda: nnx.Dict(
      up=nnx.Linear(4, 8, rngs=nnx.Rngs(0)),
      down=nnx.Linear(8, 4, rngs=nnx.Rngs(0)),
    )
  )


MODEL = [('down', 'bias'), ('down', 'kernel'), ('up', 'bias'), ('up', 'kernel')]
OPTIMIZER = [('optimizer', 'step')] + [
  ('optimizer', 'opt_state', 0, 'mu', *p) for p in MODEL
]


def test_the_whole_checkpoint_when_it_holds_the_model():
  choice = _parts.choose(MODEL, _model(), None, 'The checkpoint')
  assert choice == _parts.Choice((), False, {'down': 2, 'up': 2})
  assert choice.prefix == ''


def test_the_one_group_whose_paths_are_the_models():
  held = [('model', *p) for p in MODEL] + OPTIMIZER
  choice = _parts.choose(held, _model(), None, 'The checkpoint')
  assert choice.part == ('model',) and choice.matched
  assert choice.groups == {'model': 4, 'optimizer': 5}
  assert choice.prefix == 'model/'
  assert _parts.listing(choice.groups) == 'model/ (4 variables), optimizer/ (5)'
  inner = _parts.inside(dict.fromkeys(held, 1), choice.part)
  assert sorted(inner) == MODEL


def test_a_named_part_and_a_deeper_one():
  held = [('state', 'model', *p) for p in MODEL] + OPTIMIZER
  assert _parts.parse('state/model/') == ('state', 'model')
  choice = _parts.choose(held, _model(), ('state', 'model'), 'The checkpoint')
  assert choice.part == ('state', 'model') and not choice.matched
  assert sorted(_parts.inside(dict.fromkeys(held), choice.part)) == MODEL


def test_groups_near_the_model_are_offered_when_none_fits():
  held = [('model', *p) for p in MODEL[:3]] + OPTIMIZER  # up/kernel lost
  choice = _parts.choose(held, _model(), None, 'The checkpoint')
  assert choice.part == () and not choice.matched
  assert choice.near == ('model',)
  assert choice.hint() == (
    ', or pass --part NAME for the group holding the model (it may be '
    'model/ (3 variables))'
  )
  # A model's own layers are no parts: nothing to offer.
  mine = _parts.choose(MODEL[:3], _model(), None, 'The checkpoint')
  assert mine.near == () and mine.hint() == ''


def test_several_groups_that_hold_the_model_are_refused():
  held = [(g, *p) for g in ('ema', 'model') for p in MODEL]
  with pytest.raises(
    _errors.ExportError,
    match=r'The checkpoint holds the variables of the model under 2 groups: '
    r'ema/, model/\. Pass --part NAME to choose one \(e\.g\. --part ema\)\.',
  ):
    _parts.choose(held, _model(), None, 'The checkpoint')


def test_a_named_part_that_holds_nothing_is_refused():
  held = [('model', *p) for p in MODEL] + OPTIMIZER
  with pytest.raises(
    _errors.ExportError,
    match=r'--part ema: The checkpoint holds no variable under ema/\. Its '
    r'groups: model/ \(4 variables\), optimizer/ \(5\)\. Pass --part one of '
    r'them, or no --part for the whole checkpoint\.',
  ):
    _parts.choose(held, _model(), ('ema',), 'The checkpoint')


@pytest.mark.parametrize('text', ['', '/', 'model//ema'])
def test_a_malformed_part_is_refused(text):
  with pytest.raises(_errors.ExportError, match=r'Malformed --part .*e\.g\.'):
    _parts.parse(text)
