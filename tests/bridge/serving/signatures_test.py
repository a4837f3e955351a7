"""Tests of several signatures, TF pre- and post-processing, `trainable=`
and TF's reusable-SavedModel attributes, served by plain TF without JAX.
"""

import json
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import processes, warm
from support.tagger import VOCAB, Tagger

import flax_dtensor as fdt

tf = pytest.importorskip('tensorflow')
fdt_tf = pytest.importorskip('flax_dtensor.dtensor')

RULES = [('embed', 'data'), ('mlp', 'model')]

# One JAX-free process serves every SavedModel of a test: each signature on
# its inputs, the gradients of a loss over `trainable_variables`, and a few
# SGD steps, reported as JSON with the values in .npy files.
_SCRIPT = processes.NO_JAX + textwrap.dedent(
  """
  import json, os, sys
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  import numpy as np
  import tensorflow as tf

  job = json.load(open(sys.argv[1]))
  report = {}
  for name, model in job['models'].items():
    loaded = tf.saved_model.load(model['path'])
    entry = {
      'signatures': sorted(loaded.signatures),
      'variables': sorted(v.name for v in loaded.variables),
      'trainable': sorted(v.name for v in loaded.trainable_variables),
      'regularization_losses': len(loaded.regularization_losses),
    }
    for key, inputs in model['inputs'].items():
      args = {k: tf.constant(np.load(v)) for k, v in inputs.items()}
      out = loaded.signatures[key](**args)
      for k, t in out.items():
        v = t.numpy()
        if v.dtype == object:  # Strings: saved as bytes, not pickled.
          v = v.astype(bytes)
        np.save(os.path.join(job['out'], f'{name}_{key}_{k}.npy'), v)
    if model.get('call'):
      x = tf.constant(np.load(model['call']))
      np.save(os.path.join(job['out'], f'{name}_call.npy'),
              loaded(x)['output_0'].numpy())
    if model.get('grad'):
      x = tf.constant(np.load(model['grad']))
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(loaded(x)['output_0'] ** 2)
      grads = tape.gradient(loss, loaded.trainable_variables)
      for v, g in zip(loaded.trainable_variables, grads):
        file = f'{name}_grad_{v.name}'.replace('/', '|') + '.npy'
        np.save(os.path.join(job['out'], file), g.numpy())
      losses = []
      for _ in range(3):
        with tf.GradientTape() as tape:
          loss = tf.reduce_mean(loaded(x)['output_0'] ** 2)
        grads = tape.gradient(loss, loaded.trainable_variables)
        for v, g in zip(loaded.trainable_variables, grads):
          v.assign_sub(0.1 * g)
        losses.append(float(loss))
      entry['losses'] = losses
    report[name] = entry
  print(json.dumps(report))
  """
)


def _serve(tmp_path, models):
  job = tmp_path / 'job.json'
  job.write_text(json.dumps({'models': models, 'out': str(tmp_path)}))
  script = tmp_path / 'serve.py'
  script.write_text(_SCRIPT)
  out = warm.tf_only().run(script, job)
  assert out.returncode == 0, out.stderr[-4000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def _init(names):
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


def _np(x):
  return np.asarray(jax.device_get(x))


@pytest.fixture(scope='module')
def tagger(tmp_path_factory):
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  # The head's outputs over 'model' (a gather from a sharded table needs
  # an `out_sharding` on Explicit axes, the user's own choice).
  rules = [('vocab', None), ('embed', None), ('mlp', 'model')]
  with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
    model = Tagger(nnx.Rngs(0))
  return mesh, model


def test_several_signatures_share_one_set_of_variables(tagger, tmp_path):
  mesh, model = tagger
  S = fdt_tf.ServingSignature
  with jax.set_mesh(mesh):
    path = fdt_tf.save_saved_model(
      model,
      tmp_path / 'sm',
      signatures={
        'serving_default': S([tf.TensorSpec([None, 16], tf.float32, 'x')]),
        'embed': S([tf.TensorSpec([None], tf.int32, 'ids')], method='embed'),
        'embed_too': S(
          [tf.TensorSpec([None], tf.int32, 'ids')], method='embed'
        ),
      },
    )
  rng = np.random.default_rng(0)
  x = rng.standard_normal((3, 16)).astype(np.float32)
  ids = np.array([1, 5, 0, 2], np.int32)
  np.save(tmp_path / 'x.npy', x)
  np.save(tmp_path / 'ids.npy', ids)
  report = _serve(
    tmp_path,
    {
      'm': {
        'path': path,
        'inputs': {
          'serving_default': {'x': str(tmp_path / 'x.npy')},
          'embed': {'ids': str(tmp_path / 'ids.npy')},
          'embed_too': {'ids': str(tmp_path / 'ids.npy')},
        },
        'call': str(tmp_path / 'x.npy'),
      }
    },
  )['m']
  assert report['signatures'] == ['embed', 'embed_too', 'serving_default']
  # Saved once: three variables, whatever the number of signatures.
  assert len(report['variables']) == 3
  assert report['trainable'] == []  # Serve-only by default.
  assert report['regularization_losses'] == 0
  with jax.set_mesh(mesh):
    want_logits = _np(model(x))
    want_embed = _np(model.embed(ids)['embedding'])
  np.testing.assert_allclose(
    np.load(tmp_path / 'm_serving_default_output_0.npy'),
    want_logits,
    rtol=1e-5,
    atol=1e-6,
  )
  np.testing.assert_allclose(
    np.load(tmp_path / 'm_call.npy'), want_logits, rtol=1e-5, atol=1e-6
  )
  for key in ('embed', 'embed_too'):
    # A gather: copied values, equal bit for bit.
    np.testing.assert_array_equal(
      np.load(tmp_path / f'm_{key}_embedding.npy'), want_embed
    )


def test_strings_in_top_k_strings_out(tagger, tmp_path):
  """A vocabulary file, a lookup table, the JAX model, top-k back to words:
  what the table uses is saved with the model, and serves without JAX."""
  mesh, model = tagger
  vocab_file = tmp_path / 'vocab.txt'
  vocab_file.write_text('\n'.join(VOCAB) + '\n')
  ids_table = tf.lookup.StaticHashTable(
    tf.lookup.TextFileInitializer(
      str(vocab_file),
      tf.string,
      tf.lookup.TextFileIndex.WHOLE_LINE,
      tf.int64,
      tf.lookup.TextFileIndex.LINE_NUMBER,
    ),
    default_value=0,
  )
  words = tf.constant(VOCAB)

  def preprocess(text):
    return tf.cast(ids_table.lookup(text), tf.int32)

  def postprocess(logits):
    top = tf.math.top_k(logits, k=2)
    return {'words': tf.gather(words, top.indices), 'scores': top.values}

  with jax.set_mesh(mesh):
    path = fdt_tf.save_saved_model(
      model,
      tmp_path / 'sm',
      signatures={
        'serving_default': fdt_tf.ServingSignature(
          [tf.TensorSpec([None], tf.string, 'text')],
          method='logits',
          preprocess=preprocess,
          postprocess=postprocess,
          resources=[ids_table, words],
        ),
      },
    )
  vocab_file.unlink()  # The SavedModel has its own copy, in assets/.
  np.save(tmp_path / 'text.npy', np.array([b'cat', b'mat', b'dog']))
  _serve(
    tmp_path,
    {
      'm': {
        'path': path,
        'inputs': {'serving_default': {'text': str(tmp_path / 'text.npy')}},
      }
    },
  )
  ids = np.array([VOCAB.index('cat'), VOCAB.index('mat'), 0], np.int32)
  with jax.set_mesh(mesh):
    logits = _np(model.logits(ids))
  order = np.argsort(-logits, axis=-1)[:, :2]
  served_words = np.load(tmp_path / 'm_serving_default_words.npy')
  assert [[w.decode() for w in row] for row in served_words] == [
    [VOCAB[i] for i in row] for row in order
  ]
  np.testing.assert_allclose(
    np.load(tmp_path / 'm_serving_default_scores.npy'),
    np.take_along_axis(logits, order, axis=-1),
    rtol=1e-5,
    atol=1e-6,
  )


@pytest.mark.parametrize('axis_type', ['explicit', 'auto'])
def test_tf_gradients_equal_jax_gradients(axis_type, tmp_path):
  types = {
    'explicit': (jax.sharding.AxisType.Explicit,) * 2,
    'auto': (jax.sharding.AxisType.Auto,) * 2,
  }[axis_type]
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=types)
  # The kernel's output features over 'model' (its input features over
  # 'data' would make JAX's own backward pass ambiguous on Explicit axes).
  with jax.set_mesh(mesh), fdt.logical_axis_rules([('embed', None), *RULES]):
    layer = nnx.Linear(
      8, 16, kernel_init=_init(('embed', 'mlp')), rngs=nnx.Rngs(0)
    )
    path = fdt_tf.save_saved_model(
      layer,
      tmp_path / 'sm',
      trainable=nnx.Param,
      input_signature=[tf.TensorSpec([None, 8], tf.float32, 'x')],
    )
  x = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
  np.save(tmp_path / 'x.npy', x)
  report = _serve(
    tmp_path,
    {'m': {'path': path, 'inputs': {}, 'grad': str(tmp_path / 'x.npy')}},
  )['m']
  assert report['trainable'] == ['bias:0', 'kernel:0']
  assert report['losses'][-1] < report['losses'][0]
  with jax.set_mesh(mesh):
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(layer)
  for name in ('kernel', 'bias'):
    np.testing.assert_allclose(
      np.load(tmp_path / f'm_grad_{name}:0.npy'),
      _np(getattr(grads, name)[...]),
      rtol=1e-5,
      atol=1e-5,
    )


_S = fdt_tf.ServingSignature
_IDS = [tf.TensorSpec([None], tf.int32, 'ids')]


@pytest.mark.parametrize(
  'kwargs, match',
  [
    ({}, 'got neither'),
    (
      {'input_signature': [None], 'signatures': {}},
      'got both',
    ),
    ({'signatures': {}}, 'non-empty dict'),
    ({'signatures': {'9x': None}}, 'plain name'),
    ({'signatures': {'k': 'embed'}}, 'to be a ServingSignature'),
    (
      {'signatures': {'k': _S(_IDS, method='embed')}, 'method': 'embed'},
      r'Expected `method` to be left out with `signatures`',
    ),
    (
      {'signatures': {'k': _S(_IDS, method=3)}},
      r"Expected the method of `signatures\['k'\]` to be a method name",
    ),
    (
      {'signatures': {'k': _S(_IDS, preprocess=lambda t: t.no_such)}},
      r"The preprocess of `signatures\['k'\]` failed on its "
      r'input_signature .*AttributeError',
    ),
    (
      {
        'signatures': {
          'k': _S(
            _IDS,
            preprocess=lambda t: tf.strings.split(tf.strings.as_string(t)),
          )
        }
      },
      r"Expected the preprocess of `signatures\['k'\]` to return the "
      r"method's positional arguments, tensors \(or None\), got "
      r'RaggedTensor at position 0.*\.to_tensor\(\)',
    ),
    (
      {'signatures': {'k': _S([None], preprocess=lambda: None)}},
      r"Expected a spec for each input of `signatures\['k'\]`, got None "
      r'at position 0',
    ),
  ],
)
def test_signature_arguments_are_checked(tagger, tmp_path, kwargs, match):
  _, model = tagger
  with pytest.raises(fdt.ExportError, match=match):
    fdt_tf.save_saved_model(model, tmp_path / 'sm', **kwargs)


def test_an_untracked_table_is_named(tagger, tmp_path):
  mesh, model = tagger
  table = tf.lookup.StaticHashTable(
    tf.lookup.KeyValueTensorInitializer(tf.constant(['a']), tf.constant([1])), 0
  )
  with jax.set_mesh(mesh), pytest.raises(fdt.ExportError, match='resources='):
    fdt_tf.save_saved_model(
      model,
      tmp_path / 'sm',
      signatures={
        'serving_default': fdt_tf.ServingSignature(
          [tf.TensorSpec([None], tf.string, 'text')],
          method='embed',
          preprocess=lambda t: table.lookup(t),
        ),
      },
    )
