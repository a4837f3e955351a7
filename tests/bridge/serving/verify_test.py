"""Tests of `verify_saved_model`: a written SavedModel served by plain TF in
a fresh process, compared with JAX signature by signature and output by
output.
"""

import math
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from support.tagger import VOCAB, Tagger

import flax_dtensor as fdt

tf = pytest.importorskip('tensorflow')
fdt_tf = pytest.importorskip('flax_dtensor.dtensor')

RULES = [('vocab', None), ('embed', None), ('mlp', 'model')]


def _signatures():
  """Three signatures, one with a TF lookup table before JAX and a TF
  argmax and softmax after it."""
  table = tf.lookup.StaticHashTable(
    tf.lookup.KeyValueTensorInitializer(
      tf.constant(VOCAB), tf.range(len(VOCAB), dtype=tf.int64)
    ),
    default_value=0,
  )

  def preprocess(words):
    return tf.cast(table.lookup(words), tf.int32)

  def postprocess(logits):
    return {
      'best': tf.argmax(logits, -1, output_type=tf.int32),
      'scores': tf.nn.softmax(logits),
    }

  S = fdt_tf.ServingSignature
  return {
    'serving_default': S([tf.TensorSpec([None, 16], tf.float32, 'x')]),
    'embed': S([tf.TensorSpec([None], tf.int32, 'ids')], method='embed'),
    'top': S(
      [tf.TensorSpec([None], tf.string, 'words')],
      method='logits',
      preprocess=preprocess,
      postprocess=postprocess,
      resources=[table],
    ),
  }


def _inputs():
  x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
  return {
    'serving_default': x,  # The array alone: one input.
    'embed': {'ids': np.array([1, 5, 0, 2], np.int32)},  # By name.
    'top': [np.array(['cat', 'mat', 'dog'])],  # In order (str, as bytes).
  }


@pytest.fixture(scope='module')
def exported(tmp_path_factory):
  """The mesh, the model, its signatures and its SavedModel, written once."""
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    model = Tagger(nnx.Rngs(0))
  signatures = _signatures()
  with jax.set_mesh(mesh):
    path = fdt_tf.save_saved_model(
      model, tmp_path_factory.mktemp('verify') / 'sm', signatures=signatures
    )
  return mesh, model, signatures, path


@pytest.fixture(scope='module')
def report(exported):
  mesh, model, signatures, path = exported
  with jax.set_mesh(mesh):
    return fdt_tf.verify_saved_model(
      model, path, _inputs(), signatures=signatures, calls=3
    )


def test_every_output_of_every_signature_is_within_tolerance(report, exported):
  path = exported[3]
  assert report.ok, report
  assert report.directory == path
  assert [s.key for s in report.signatures] == [
    'serving_default',
    'embed',
    'top',
  ]
  names = {s.key: [o.name for o in s.outputs] for s in report.signatures}
  assert names == {
    'serving_default': ['output_0'],
    'embed': ['embedding'],
    'top': ['best', 'scores'],
  }
  assert report.differing() == {}
  assert report.calls == 3
  assert not report.jax_imported
  assert report.tensorflow == tf.__version__
  # A gather copies values: equal bit for bit; the logits within float32's.
  assert report.signature('embed').max_abs_diff == 0.0
  assert 0.0 <= report.max_abs_diff < 1e-5
  best = report.signature('top').outputs[0]
  assert (best.dtype, best.shape, best.rtol, best.atol) == ('int32', (3,), 0, 0)
  assert best.mismatches == 0 and best.max_abs_diff == 0.0
  scores = report.signature('top').outputs[1]
  assert (scores.rtol, scores.atol) == (1e-5, 1e-6)  # float32's default.
  assert 0.0 < scores.max_abs_reference <= 1.0  # Probabilities.
  for s in report.signatures:
    for seconds in (s.jax_seconds, s.tf_seconds, s.jax_first_seconds):
      assert math.isfinite(seconds) and seconds > 0
  assert report.tf_load_seconds > 0


def test_the_report_is_a_table(report):
  text = report.render(200)
  assert 'every output within tolerance' in text
  for word in ('serving_default', 'embed', 'top', 'output_0', 'scores'):
    assert word in text
  assert 'the median of 3 calls' in text
  rows = [line for line in text.splitlines() if line.endswith(' ok')]
  assert len(rows) == 4, text  # One per output.
  assert 'embed            embedding  float32[4,16]' in text
  assert 'Tolerance (rtol/atol): float32 1e-05/1e-06, int32 equal.' in text
  # One latency row per signature: the key, then four numbers.
  latency = [line.split() for line in text.splitlines()[-3:]]
  assert [row[0] for row in latency] == ['serving_default', 'embed', 'top']
  assert all(len(row) == 5 for row in latency), text
  narrow = report.render(60)
  assert max(len(line) for line in narrow.splitlines()) <= 60
  with pytest.raises(KeyError, match='nope'):
    report.signature('nope')
  assert str(report) == report.render()


@pytest.fixture(scope='module')
def other_model(exported):
  mesh = exported[0]
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    return Tagger(nnx.Rngs(1))


def test_another_models_values_are_reported_by_key_and_output(
  exported, other_model
):
  mesh, _, signatures, path = exported
  with jax.set_mesh(mesh):
    wrong = fdt_tf.verify_saved_model(
      other_model, path, _inputs(), signatures=signatures, calls=1
    )
  assert not wrong.ok
  differing = wrong.differing()
  assert differing['serving_default'] == ('output_0',)
  assert differing['embed'] == ('embedding',)
  assert 'scores' in differing['top']
  embedding = wrong.signature('embed').outputs[0]
  assert embedding.mismatches > 0 and embedding.max_abs_diff > 1e-2
  text = wrong.render(200)
  assert 'outputs beyond tolerance' in text and 'differ' in text


def test_check_raises_naming_every_differing_signature_and_output(
  exported, other_model
):
  mesh, _, signatures, path = exported
  embed = {'embed': signatures['embed']}
  with (
    jax.set_mesh(mesh),
    pytest.raises(
      fdt.ExportError,
      match=r"(?s)beyond the tolerance: 'embed' \('embedding'\).*largest "
      r'difference is .*exported from this module',
    ),
  ):
    fdt_tf.verify_saved_model(
      other_model,
      path,
      {'embed': _inputs()['embed']},
      signatures=embed,
      calls=1,
      check=True,
    )


def _bad(exported, inputs=None, **kwargs):
  mesh, model, signatures, path = exported
  kwargs.setdefault('signatures', signatures)
  with jax.set_mesh(mesh):
    fdt_tf.verify_saved_model(
      model, kwargs.pop('path', path), inputs or _inputs(), **kwargs
    )


def _x(shape, dtype=np.float32):
  return np.zeros(shape, dtype)


@pytest.mark.parametrize(
  'change, match',
  [
    (
      {'inputs': {'nope': _x((2, 16))}, 'signatures': 'nope'},
      r"has \['embed', 'serving_default', 'top'\]; got \['nope'\], which it "
      r'lacks',
    ),
    (
      {'inputs': {'serving_default': _x((2, 16))}},
      r"without \['embed', 'top'\]",
    ),
    (
      {'inputs': {**_inputs(), 'extra': _x((2, 16))}},
      r"with \['extra'\], of no signature",
    ),
    (
      {'inputs': {**_inputs(), 'serving_default': _x((3, 8))}},
      r"input 'x' of `inputs\['serving_default'\]` to be a float32 array of "
      r'shape \[None, 16\].*got float32\[3, 8\]',
    ),
    (
      {'inputs': {**_inputs(), 'serving_default': _x((3, 16), np.float64)}},
      r'got float64\[3, 16\].*x\.astype\(np\.float32\)',
    ),
    (
      {'inputs': {**_inputs(), 'embed': [_x(3, np.int32)] * 2}},
      r"one array per input of the signature, \['ids'\] \(1\), got 2",
    ),
    (
      {'inputs': {**_inputs(), 'embed': {'id': _x(3, np.int32)}}},
      r"inputs \['ids'\] by name, got \['id'\]",
    ),
    ({'inputs': [_x((2, 16))]}, r'`inputs` to be a dict of signature keys'),
    ({'signatures': None}, r'or `signatures`.*got neither'),
    ({'calls': 0}, r'`calls` to be a positive int, got 0'),
    ({'rtol': -1.0}, r'`rtol` to be a non-negative number, got -1\.0'),
    ({'timeout': 0}, r'`timeout` to be a positive number of seconds, got 0'),
  ],
  ids=[
    'key-not-saved',
    'key-without-inputs',
    'inputs-of-no-key',
    'wrong-shape',
    'wrong-dtype',
    'wrong-count',
    'wrong-name',
    'not-a-dict',
    'no-signatures',
    'calls',
    'rtol',
    'timeout',
  ],
)
def test_bad_arguments_are_refused_before_serving(exported, change, match):
  change = dict(change)
  if change.get('signatures') == 'nope':
    change['signatures'] = {'nope': _signatures()['serving_default']}
  inputs = change.pop('inputs', None)
  with pytest.raises(fdt.ExportError, match=match):
    _bad(exported, inputs, **change)


def test_signatures_other_than_those_saved_are_refused(exported):
  other = fdt_tf.ServingSignature([tf.TensorSpec([None, 16], tf.float32, 'y')])
  with pytest.raises(
    fdt.ExportError,
    match=r"signature 'serving_default' to take the inputs the SavedModel .* "
    r"was saved with, \['x'\]; got \['y'\]",
  ):
    _bad(
      exported,
      {'serving_default': _x((2, 16))},
      signatures={'serving_default': other},
    )


def test_a_folder_without_a_saved_model_is_refused(exported, tmp_path):
  with pytest.raises(
    fdt_tf.ExportNotFoundError, match=r'found no saved_model\.pb there'
  ):
    _bad(exported, path=tmp_path)
  (tmp_path / 'saved_model.pb').write_bytes(b'\x00garbage')
  with pytest.raises(
    fdt_tf.DamagedExportError, match=r'saved_model\.pb that TensorFlow cannot'
  ):
    _bad(exported, path=tmp_path)


def test_a_timeout_stops_the_tensorflow_process(exported):
  with pytest.raises(
    fdt.ExportError,
    match=r'fresh TF process took longer than timeout=0\.01 s; it was '
    r'stopped\. Pass a larger `timeout=`',
  ):
    _bad(exported, timeout=0.01)


def test_a_saved_model_tensorflow_cannot_load_is_reported(exported, tmp_path):
  broken = tmp_path / 'sm'
  shutil.copytree(exported[3], broken)
  for index in broken.glob('variables/*.index'):
    index.unlink()
  with pytest.raises(
    fdt.ExportError,
    match=r'(?s)fresh TF process failed \(exit status 1\):.*loads it alone',
  ):
    _bad(exported, path=broken, calls=1)


def _one(want, got, **tolerance):
  from flax_dtensor.dtensor._serving import _verify

  (found,) = _verify._compare({'y': want}, {'y': got}, **tolerance)
  return found


def test_values_are_compared_as_their_dtype_needs():
  """No TF process: the comparison of one output, by kind of value."""
  nan = np.array([1.0, np.nan], np.float32)
  same = _one(nan, nan.copy(), rtol=None, atol=None)
  assert same.ok and same.max_abs_diff == 0.0  # NaN on both sides: equal.
  one_side = _one(nan, np.array([1.0, 2.0], np.float32), rtol=None, atol=None)
  assert not one_side.ok and one_side.mismatches == 1
  assert one_side.max_abs_diff == math.inf
  bf16 = jax.numpy.bfloat16
  close = _one(
    np.array([1.0, 2.0], bf16),
    np.array([1.0, 2.015], bf16),
    rtol=None,
    atol=None,
  )
  assert (close.dtype, close.rtol, close.atol, close.ok) == (
    'bfloat16',
    2e-2,
    1e-2,
    True,
  )
  tight = _one(
    np.array([1.0, 2.0], bf16),
    np.array([1.0, 2.015], bf16),
    rtol=0.0,
    atol=1e-3,
  )
  assert not tight.ok and tight.mismatches == 1
  ints = _one(np.array([1, 2]), np.array([1, 3]), rtol=1.0, atol=1.0)
  assert (ints.rtol, ints.atol, ints.mismatches) == (0.0, 0.0, 1)
  words = _one(
    np.array([b'a', b'b']), np.array([b'a', b'c']), rtol=None, atol=None
  )
  assert (words.dtype, words.mismatches, words.max_abs_diff) == (
    'string',
    1,
    math.inf,
  )
  shape = _one(np.zeros((2, 3)), np.zeros((3, 2)), rtol=None, atol=None)
  assert shape.problem == 'TF shape [3, 2]' and not shape.ok


def test_an_output_on_one_side_only_is_reported():
  from flax_dtensor.dtensor._serving import _verify

  found = _verify._compare(
    {'a': np.zeros(2), 'b': np.zeros(2)},
    {'a': np.zeros(2), 'c': np.zeros(2)},
    None,
    None,
  )
  assert [(o.name, o.ok, o.problem) for o in found] == [
    ('a', True, None),
    ('b', False, 'missing in TF'),
    ('c', False, 'missing in JAX'),
  ]


class _Contracting(nnx.Module):
  """Contracts a dimension sharded on both sides without `out_sharding`:
  it traces on one device (the export's serving mesh), but JAX refuses it
  on its own Explicit mesh."""

  def __init__(self, rngs):
    init = nnx.with_partitioning(nnx.initializers.ones, ('mlp', None))
    self.kernel = nnx.Param(init(rngs.params(), (16, 4)))

  def __call__(self, x):
    x = jax.sharding.reshard(x, jax.P(None, 'model'))
    return x @ self.kernel[...]


def test_a_forward_jax_refuses_on_its_mesh_is_named(tmp_path):
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  spec = [tf.TensorSpec([None, 16], tf.float32, name='x')]
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    model = _Contracting(nnx.Rngs(0))
    path = fdt_tf.save_saved_model(model, tmp_path / 'sm', input_signature=spec)
    with pytest.raises(
      fdt.ExportError,
      match=r'JAX failed to run _Contracting\.__call__ for signature '
      r"'serving_default', the reference .*ShardingTypeError.*call "
      r'verify_saved_model where the forward runs',
    ):
      fdt_tf.verify_saved_model(
        model, path, {'serving_default': _x((8, 16))}, input_signature=spec
      )
