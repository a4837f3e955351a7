"""`flax-dtensor export` for TF Serving: several signatures (--signature),
trainable variables (--trainable) and the version layout (--version), served
by plain TensorFlow; and each refusal. How the CLI tests run:
tests/cli/conftest.py.
"""

from __future__ import annotations

import json
import os
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx
from support import processes, warm
from support.cli_helpers import bad_input, ok, run_cli
from support.cli_models import USER_RULES

from flax_dtensor.cli import _command, _parsing, _served

# TF DTensor on the suite's 8 devices, before any other TF operation.
pytestmark = pytest.mark.usefixtures('dtensor')

# The user's model file: a forward, an embedding, and a method of two
# inputs; `scale` is a BatchStat, which --trainable leaves untrainable.
TAGGER = """
import jax.numpy as jnp
from flax import nnx


class Tagger(nnx.Module):
  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    self.table = nnx.Param(
      nnx.with_partitioning(init, ('classes', 'features'))(
        rngs.params(), (32, 16)))
    self.head = nnx.Linear(
      16, 6, kernel_init=nnx.with_partitioning(init, ('features', 'hidden')),
      rngs=rngs)
    self.scale = nnx.BatchStat(jnp.arange(1.0, 7.0))

  def __call__(self, x):
    return self.head(x) * self.scale[...][None]

  def embed(self, ids):
    return {'embedding': self.table[...][ids]}

  def score(self, x, mask):
    return jnp.where(mask, x, 0.0).sum(-1, keepdims=True) + self(x)


def make():
  return Tagger(nnx.Rngs(0))
"""

SIGNATURES = (
  *('--signature', 'embed=embed:ids:1,8:int32'),
  *('--signature', 'score=score:x:1,16:float32+mask:1,16:bool'),
)

# One JAX-free TF process: each signature on its inputs (.npy files), the
# loaded object's variables and trainable variables, as JSON.
_SERVE = processes.NO_JAX + textwrap.dedent(
  """
  import json, os, sys
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  import numpy as np
  import tensorflow as tf

  job = json.load(open(sys.argv[1]))
  loaded = tf.saved_model.load(job['path'])
  report = {
    'signatures': sorted(loaded.signatures),
    'variables': sorted(v.name for v in loaded.variables),
    'trainable': sorted(v.name for v in loaded.trainable_variables),
  }
  for key, inputs in job['inputs'].items():
    args = {k: tf.constant(np.load(v)) for k, v in inputs.items()}
    for k, t in loaded.signatures[key](**args).items():
      np.save(os.path.join(job['out'], f'{key}.{k}.npy'), t.numpy())
  print(json.dumps(report))
  """
)


@pytest.fixture(scope='module')
def tagger(tmp_path_factory):
  """The user's file, rules and an Orbax checkpoint of its model, the
  model itself, and an export with three signatures, --version 3 and
  --trainable."""
  import orbax.checkpoint as ocp

  tmp = tmp_path_factory.mktemp('tagger')
  (tmp / 'tagger.py').write_text(TAGGER)
  (tmp / 'rules.yaml').write_text(USER_RULES)
  namespace: dict = {}
  exec(compile(TAGGER, 'tagger.py', 'exec'), namespace)
  with nnx.use_eager_sharding(False):
    model = namespace['make']()
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp / 'orbax', nnx.state(model))
    checkpointer.wait_until_finished()
  proc = _export(
    tmp,
    tmp / 'out',
    *('--input-shape', 'x:1,16:float32', *SIGNATURES),
    *('--version', '3', '--trainable', '--verify'),
  )
  return tmp, model, proc


def _export(tmp, out, *args):
  return run_cli(
    'export',
    f'{tmp / "tagger.py"}:make',
    *('--checkpoint', tmp / 'orbax', '--rules', tmp / 'rules.yaml'),
    *('--out', out, '--saved-model'),
    *args,
  )


def test_every_signature_serves_jax_s_values(tagger, tmp_path):
  tmp, model, proc = tagger
  stdout = ok(proc)
  rng = np.random.default_rng(0)
  arrays = {
    'x': rng.standard_normal((3, 16), np.float32),
    'ids': rng.integers(0, 32, (2, 8)).astype(np.int32),
    'mask': rng.random((3, 16)) > 0.5,
  }
  for name, value in arrays.items():
    np.save(tmp_path / f'{name}.npy', value)
  files = {k: str(tmp_path / f'{k}.npy') for k in arrays}
  job = {
    'path': str(tmp / 'out' / 'saved_model' / '3'),
    'out': str(tmp_path),
    'inputs': {
      'serving_default': {'x': files['x']},
      'embed': {'ids': files['ids']},
      'score': {'x': files['x'], 'mask': files['mask']},
    },
  }
  (tmp_path / 'job.json').write_text(json.dumps(job))
  (tmp_path / 'serve.py').write_text(_SERVE)
  served = warm.tf_only().run(tmp_path / 'serve.py', tmp_path / 'job.json')
  assert served.returncode == 0, served.stderr[-4000:]
  report = json.loads(served.stdout.strip().splitlines()[-1])
  assert report['signatures'] == ['embed', 'score', 'serving_default']
  # --trainable: the Params (table, head's kernel and bias), not `scale`.
  assert len(report['variables']) == 4
  assert len(report['trainable']) == 3
  (untrainable,) = set(report['variables']) - set(report['trainable'])
  assert 'scale' in untrainable
  x, ids, mask = (jax.numpy.asarray(arrays[k]) for k in ('x', 'ids', 'mask'))
  expected = {
    'serving_default.output_0': model(x),
    'embed.embedding': model.embed(ids)['embedding'],
    'score.output_0': model.score(x, mask),
  }
  for name, want in expected.items():
    got = np.load(tmp_path / f'{name}.npy')
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-5)
  # The table says where the SavedModel went.
  (row,) = [
    line
    for line in stdout.splitlines()
    if 'saved_model' in line and 'served by TF' not in line
  ]
  assert str(tmp / 'out' / 'saved_model' / '3') in row


def test_verify_serves_every_signature_without_jax(tagger):
  """--verify: the written SavedModel against JAX, every signature, in a
  process without JAX, and the verdict."""
  tmp, _, proc = tagger
  stdout = ok(proc)
  version = tmp / 'out' / 'saved_model' / '3'
  (verdict,) = [line for line in stdout.splitlines() if 'served by TF' in line]
  assert 'without JAX' in verdict, stdout
  assert 'beyond tolerance' not in stdout, stdout
  table = stdout[stdout.index('served by TF') :]
  for key in ('serving_default', 'embed', 'score'):
    assert key in table, table
  assert str(version) in stdout.replace('\n', '')


def test_version_is_tf_serving_s_layout(tagger):
  tmp, _, proc = tagger
  ok(proc)
  out = tmp / 'out'
  assert sorted(os.listdir(out)) == ['checkpoint', 'saved_model']
  # OUT/saved_model is the model's base path: one version directory, and
  # the run's stamp, which TF Serving skips (not a number).
  assert sorted(os.listdir(out / 'saved_model')) == [
    '3',
    'flax_dtensor_run.json',
  ]
  version = out / 'saved_model' / '3'
  assert (version / 'saved_model.pb').is_file()
  assert (version / 'variables').is_dir()
  assert not [e for e in os.listdir(out.parent) if e.startswith('.')]
  # `inspect` finds the version under the output folder, and verifies it.
  shown = run_cli('inspect', out)
  ok(shown)
  assert str(version) in shown.stdout, shown.stdout
  assert 'next_words' in shown.stdout or 'serving_default' in shown.stdout
  verified = run_cli('inspect', out, '--verify')
  ok(verified)
  assert str(version) in verified.stdout, verified.stdout


@pytest.mark.parametrize(
  'args, fragments',
  [
    (
      [*SIGNATURES[:2], '--version', '0'],
      ["Malformed --version '0': expected a positive"],
    ),
    (
      [*SIGNATURES[:2], '--version', '-2'],
      ["Malformed --version '-2'", 'e.g. --version 1'],
    ),
    ([*SIGNATURES[:2], '--version', '1.5'], ["Malformed --version '1.5'"]),
    (
      [*SIGNATURES[:2], '--version', 'v1'],
      ["Malformed --version 'v1'", 'OUT/saved_model/<N>'],
    ),
    (
      ['--signature', 'embed'],
      ["Malformed --signature 'embed': expected KEY=METHOD:INPUT"],
    ),
    (
      ['--signature', 'embed=embed'],
      ["Malformed --signature 'embed=embed': expected KEY=METHOD:INPUT"],
    ),
    (
      ['--signature', '1st=embed:ids:1,8:int32'],
      ["the key '1st' is not a plain name"],
    ),
    (
      ['--signature', 'embed=embed:ids:1,8:int33'],
      [
        "Malformed --signature 'embed=embed:ids:1,8:int33': its input "
        "'ids:1,8:int33' is malformed: unknown dtype 'int33'",
        'several joined by +',
      ],
    ),
    (
      [
        '--signature',
        'e=embed:ids:1,8:int32',
        '--signature',
        'e=embed:i:1:int32',
      ],
      [
        "--signature 'e=embed:i:1:int32': the key 'e' was given before, by "
        "--signature 'e=embed:ids:1,8:int32'"
      ],
    ),
    (
      [
        *('--input-shape', 'x:1,16:float32'),
        *('--signature', 'serving_default=embed:ids:1,8:int32'),
      ],
      ["'serving_default' is the signature of --input-shape and --method"],
    ),
    (
      ['--method', 'embed', '--signature', 'e=embed:ids:1,8:int32'],
      ["--method 'embed' applies to the inputs of --input-shape"],
    ),
  ],
  ids=[
    'version-zero',
    'version-negative',
    'version-float',
    'version-text',
    'signature-no-method',
    'signature-no-inputs',
    'signature-bad-key',
    'signature-bad-dtype',
    'signature-key-twice',
    'serving-default-twice',
    'method-without-input-shape',
  ],
)
def test_malformed_flags_are_refused_before_any_work(
  tagger, tmp_path, args, fragments
):
  tmp, _, _ = tagger
  bad_input(_export(tmp, tmp_path / 'out', *args), *fragments)
  assert not (tmp_path / 'out').exists()


@pytest.mark.parametrize(
  'flag', [['--version', '2'], ['--trainable'], ['--verify'], SIGNATURES[:2]]
)
def test_saved_model_flags_need_saved_model(tagger, tmp_path, flag):
  tmp, _, _ = tagger
  proc = run_cli(
    'export',
    f'{tmp / "tagger.py"}:make',
    *('--checkpoint', tmp / 'orbax', '--out', tmp_path / 'out', *flag),
  )
  bad_input(proc, f'{flag[0]} only applies with --saved-model')


@pytest.mark.parametrize(
  'signature, fragments',
  [
    (
      'e=nope:ids:1,8:int32',
      [
        "--signature 'e=nope:ids:1,8:int32': the model (Tagger) has no "
        "method 'nope'"
      ],
    ),
    (
      'e=score:x:1,16:float32',
      [
        "Expected --signature 'e=score:x:1,16:float32' to fit Tagger.score",
        'Give the --signature one INPUT per positional parameter',
      ],
    ),
  ],
  ids=['no-such-method', 'too-few-inputs'],
)
def test_a_signature_the_model_cannot_serve_writes_nothing(
  tagger, tmp_path, signature, fragments
):
  tmp, _, _ = tagger
  proc = _export(tmp, tmp_path / 'out', '--signature', signature)
  bad_input(proc, *fragments)
  assert not (tmp_path / 'out').exists()


def test_parse_signature():
  parsed = _served.parse_signature(
    'score=score:x:1,16:float32+mask:1,16:bool', static_batch=False
  )
  assert (parsed.key, parsed.method) == ('score', 'score')
  assert parsed.specs == (
    _served.InputSpec('x', ('b', 16), 'float32'),
    _served.InputSpec('mask', ('b', 16), 'bool'),
  )
  parsed = _served.parse_signature(
    'lm=decode:tokens:1,8:int32+cache:none', static_batch=True
  )
  assert parsed.specs[0].dims == (1, 8) and parsed.specs[1].dims is None
  with pytest.raises(_command.BadInputError, match=r"dimension '0' is not"):
    _served.parse_signature('e=embed:ids:0:int32', static_batch=False)


@pytest.mark.parametrize('text', ['1', ' 7 ', '007', str(2**63 - 1)])
def test_parse_version(text):
  assert _parsing.parse_version(text) == int(text)


@pytest.mark.parametrize('text', ['0', '', '+1', '²', str(2**63), '1e3'])
def test_parse_version_refuses(text):
  with pytest.raises(_command.BadInputError, match=r'Malformed --version'):
    _parsing.parse_version(text)


def test_signatures_in_order_and_serving_default_from_a_signature():
  both = _served.signatures(
    ['x:1,16:float32'],
    '__call__',
    ['embed=embed:ids:1,8:int32'],
    static_batch=False,
  )
  assert [(s.key, s.method) for s in both] == [
    ('serving_default', '__call__'),
    ('embed', 'embed'),
  ]
  # Without --input-shape, a --signature may be the default one.
  (only,) = _served.signatures(
    [], '__call__', ['serving_default=embed:ids:1,8:int32'], static_batch=True
  )
  assert (only.key, only.method, only.specs[0].dims) == (
    'serving_default',
    'embed',
    (1, 8),
  )
