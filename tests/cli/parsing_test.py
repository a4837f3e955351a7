"""The command line's parsers of its flags and texts: meshes, input shapes,
budgets, and the sharding texts `inspect` prints. How the CLI tests run: tests/cli/conftest.py.
"""

from __future__ import annotations

import pytest
from support.cli_helpers import DEMO_TARGET, bad_input, run_cli

import flax_dtensor.dtensor as fdt_tf
from flax_dtensor.cli import _command, _parsing, _served
from flax_dtensor.cli import inspect as inspect_command
from flax_dtensor.dtensor._format import _decode

# TF DTensor on the suite's 8 devices, before any other TF operation.
pytestmark = pytest.mark.usefixtures('dtensor')


def test_parse_mesh():
  assert _parsing.parse_mesh('data=2,model=4') == (('data', 2), ('model', 4))
  assert _parsing.parse_mesh(' x=8 ') == (('x', 8),)


@pytest.mark.parametrize(
  'text, match',
  [
    ('data2,model=4', "expected NAME=SIZE, got 'data2'"),
    ('data=2,,model=4', "got ''"),
    ('data=0', "axis 'data' has size '0'; sizes must be positive integers"),
    ('data=-1', "axis 'data' has size '-1'; sizes must be positive integers"),
    ('data=two', "size 'two'; sizes must be positive integers"),
    ('data=2,data=4', "axis name\\(s\\) \\['data'\\] repeat"),
  ],
  ids=['no-equals', 'empty-item', 'zero', 'negative', 'not-a-number', 'repeat'],
)
def test_parse_mesh_errors(text, match):
  with pytest.raises(_command.BadInputError, match=match):
    _parsing.parse_mesh(text)


@pytest.mark.parametrize(
  'flags', [['--suggest'], ['--check']], ids=['suggest', 'check']
)
@pytest.mark.parametrize('budget', ['0', '-5KiB', 'lots', '0.5', '12XB'])
def test_a_bad_budget_has_one_wording(flags, budget):
  """Zero, negative, fractional and unreadable sizes alike, in the command
  line's words (not the Python API's "`budget` must be an int")."""
  line = bad_input(run_cli('plan', DEMO_TARGET, *flags, '--budget', budget))
  assert line == (
    f'error: Malformed --budget {budget!r}: expected a size of at least 1 '
    'byte in bytes, or with an IEC unit (KiB, MiB, GiB, TiB), e.g. 16GiB.'
  )


def test_parse_input_shape():
  spec = _served.parse_input_shape('x:1,128:int32', static_batch=False)
  assert spec == _served.InputSpec('x', ('b', 128), 'int32')
  assert spec.shape == (None, 128)
  assert spec.polymorphic_shape(0) == '(b, 128)'
  # Echoed as given, the example batch size too (its symbol is b).
  assert spec.text() == 'x:1,128:int32'
  assert spec.text(spec.dims) == 'x:b,128:int32'
  spec = _served.parse_input_shape('x:1,128:int32', static_batch=True)
  assert spec.shape == (1, 128)
  assert spec.polymorphic_shape(0) is None
  spec = _served.parse_input_shape('y:b,?,3:float32', static_batch=True)
  assert spec.shape == (None, None, 3)
  # ? is a size of its own: the symbol save_saved_model gives a None.
  assert spec.polymorphic_shape(2) == '(b, d2_1, 3)'
  assert spec.text() == 'y:b,?,3:float32'
  # Names: one size wherever they appear.
  spec = _served.parse_input_shape('mask:1,t,t:bool', static_batch=False)
  assert spec == _served.InputSpec('mask', ('b', 't', 't'), 'bool')
  assert spec.polymorphic_shape(3) == '(b, t, t)'
  # An argument passed as None.
  spec = _served.parse_input_shape('cache:none', static_batch=False)
  assert spec == _served.InputSpec('cache', None, None)
  assert spec.tensor_spec() is None and spec.polymorphic_shape(2) is None
  assert spec.text() == 'cache:none'


@pytest.mark.parametrize(
  'text, match',
  [
    ('x:1,128', 'Malformed --input-shape'),
    ('x:1,128:int33', "unknown dtype 'int33'"),
    ('x:1,2x:int32', "dimension '2x'"),
    ('x:1,0:int32', "dimension '0' is not a positive integer, a name"),
    (':1:int32', 'Malformed --input-shape'),
    ('cache:nothing', 'or NAME:none for an argument passed as None'),
  ],
  ids=['no-dtype', 'bad-dtype', 'bad-dim', 'zero-dim', 'no-name', 'no-dims'],
)
def test_parse_input_shape_errors(text, match):
  with pytest.raises(_command.BadInputError, match=match):
    _served.parse_input_shape(text, static_batch=False)


def _record(spec, mesh, dtensor_specs, dtensor_mesh, kind='named'):
  def axes(pairs):
    return {
      'axis_names': [n for n, _ in pairs],
      'axis_sizes': [s for _, s in pairs],
    }

  raw = {
    'kind': kind,
    'spec': spec,
    'mesh': axes(mesh),
    'dtensor_layout': {
      'sharding_specs': dtensor_specs,
      'mesh': axes(dtensor_mesh),
    },
  }
  # As the manifest is read: checked once, into a ShardingRecord, which
  # writes back the JSON it came from.
  record = _decode.read_sharding(raw, 'flax_dtensor.json', ('w',))
  assert record.to_json() == raw
  return record


_GRID = [('data', 2), ('model', 4)]


@pytest.mark.parametrize(
  'record, expected',
  [
    (
      _record(
        [['model'], [], ['data']],
        _GRID,
        ['model', 'unsharded', 'data'],
        _GRID,
      ),
      (
        "P('model', None, 'data') @ data=2,model=4",
        'model,unsharded,data @ data=2,model=4',
      ),
    ),
    (
      _record([[], []], _GRID, ['unsharded', 'unsharded'], _GRID),
      (
        'P(None, None) @ data=2,model=4',
        'unsharded,unsharded @ data=2,model=4',
      ),
    ),
    (
      _record(
        [['data', 'model'], []],
        _GRID,
        ['data+model', 'unsharded'],
        [('data+model', 8)],
      ),
      (
        "P(('data', 'model'), None) @ data=2,model=4",
        'data+model,unsharded @ data+model=8',
      ),
    ),
    (
      _record([], [('x', 8)], [], [('x', 8)]),
      ('P() @ x=8', 'scalar @ x=8'),
    ),
    (
      _record(
        [[]], [], ['unsharded'], [('single_device', 1)], kind='single_device'
      ),
      ('one device', 'unsharded @ single_device=1'),
    ),
    (
      "P('data', None) on mesh {'data': 2, 'model': 4}",
      ("P('data', None) on mesh {'data': 2, 'model': 4}", '-'),
    ),
    (None, ('-', '-')),
  ],
  ids=['2d', 'replicated', 'fused', 'scalar', 'one-device', 'v1', 'none'],
)
def test_sharding_texts(record, expected):
  assert inspect_command.sharding_texts(record) == expected


@pytest.mark.parametrize(
  'record',
  [
    {'kind': 'named'},
    {'kind': 'named', 'spec': 3, 'mesh': {}},
    {
      'kind': 'named',
      'spec': [['data']],
      'mesh': {'axis_names': ['data'], 'axis_sizes': [2, 4]},
      'dtensor_layout': {
        'sharding_specs': ['data'],
        'mesh': {'axis_names': ['data'], 'axis_sizes': [2]},
      },
    },
  ],
  ids=['missing-keys', 'bad-spec', 'sizes-unlike-names'],
)
def test_a_malformed_sharding_record_is_refused_as_it_is_read(record):
  """Checked once, when the manifest is read (`inspect` then shows it
  as a bad input, as every other refusal of the manifest)."""
  with pytest.raises(
    fdt_tf.MalformedExportError,
    match=r"the sharding of \['w'\] is .*expected its kind, spec, mesh",
  ):
    _decode.read_sharding(record, 'flax_dtensor.json', ('w',))
