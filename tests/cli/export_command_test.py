"""Tests of the `flax-dtensor` command line.

Commands run in this process through `cli_runner` (tests/support): the
entry point itself, with file descriptors 1 and 2 read back as a shell
reads them, and TensorFlow DTensor initialized once for the module, as the
bridge tests do. A test starts a process of its own only where that is what
it tests, and says so: what a command imports (help and metadata without
JAX or TensorFlow), and what TensorFlow prints when it starts and exits.

`user_model` below is the "user factory": the CLI loads it from this file
(`tests/cli/cli_test.py:user_model`) or as a module (`cli_test:user_model` with
`tests/cli/` on sys.path).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import os
import pathlib
import re
import shutil
import textwrap

import numpy as np
import pytest
import typer
from flax import nnx
from support import output_util

import flax_dtensor.dtensor as fdt_tf
from flax_dtensor.cli import _command, _loading, _parsing, _served
from flax_dtensor.cli import inspect as inspect_command
from flax_dtensor.demo import verify
from flax_dtensor.dtensor._format import _decode

THIS_FILE = pathlib.Path(__file__).resolve()
TESTS_DIR = THIS_FILE.parent
SUPPORT_DIR = THIS_FILE.parents[1] / 'support'
DEMO_TARGET = 'flax_dtensor.demo.model:make_model'
USER_TARGET = f'{THIS_FILE}:user_model'
LM_TARGET = f'{THIS_FILE}:user_lm'
TIMEOUT = 300
USER_RULES = textwrap.dedent("""\
  # A user's rules: 'hidden' prefers 'model', falls back to 'data'.
  logical_axis_rules:
    - ['features', 'data']
    - ['hidden', 'model']
    - ['hidden', 'data']
    - ['classes', null]
  """)


# The user's model
# ------------------------------------------------------------------------------


class UserMLP(nnx.Module):
  """A user's model: 'hidden' of size 6 does not divide 'model' (4)."""

  def __init__(self, *, features: int, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    self.hidden = nnx.Linear(
      features,
      6,
      kernel_init=nnx.with_partitioning(init, ('features', 'hidden')),
      bias_init=nnx.with_partitioning(nnx.initializers.zeros, ('hidden',)),
      rngs=rngs,
    )
    self.out = nnx.Linear(
      6,
      3,
      kernel_init=nnx.with_partitioning(init, ('hidden', 'classes')),
      use_bias=False,
      rngs=rngs,
    )

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


def user_model() -> UserMLP:
  """The factory the CLI calls: takes no arguments, returns the module."""
  return UserMLP(features=16, rngs=nnx.Rngs(1))


class UserHiddenOnly(nnx.Module):
  """`UserMLP`'s first layer only: a model the checkpoint holds more than."""

  def __init__(self, *, features: int, rngs: nnx.Rngs):
    self.hidden = UserMLP(features=features, rngs=rngs).hidden


def user_hidden_only() -> UserHiddenOnly:
  return UserHiddenOnly(features=16, rngs=nnx.Rngs(1))


def user_model_with_head() -> nnx.Module:
  """`user_model` and one layer more: no checkpoint of `user_model` fits."""
  model = user_model()
  model.head = nnx.Linear(3, 2, rngs=nnx.Rngs(2))
  return model


def huge_user_model() -> nnx.Module:
  """40 GB of float32 params: `plan` must not allocate them."""
  init = nnx.with_partitioning(nnx.initializers.zeros, ('features', 'hidden'))
  return nnx.Linear(100_000, 100_000, kernel_init=init, rngs=nnx.Rngs(0))


def not_a_module() -> int:
  return 3


def a_string() -> str:
  return 'str'


def a_tuple() -> tuple:
  return (user_model(), 'v1')


class UserLM(nnx.Module):
  """A user's LLM in another library's style: `(tokens, positions, cache,
  attention_mask) -> (logits, cache)`, served with the cache None."""

  def __init__(self, *, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    self.embed = nnx.Embed(
      64,
      16,
      embedding_init=nnx.with_partitioning(init, ('classes', 'features')),
      rngs=rngs,
    )
    self.qkv = nnx.Param(
      nnx.with_partitioning(init, (None, 'features', 'hidden', None))(
        rngs.params(), (3, 16, 4, 4)
      )
    )

  def __call__(self, tokens, positions, cache, attention_mask):
    import jax
    import jax.numpy as jnp

    x = self.embed(tokens) + self.embed(positions)
    q, k, v = jnp.einsum('btd,sdhk->sbthk', x, self.qkv[...])
    scores = jnp.einsum('bthk,bshk->bhts', q, k)
    scores = jnp.where(attention_mask[:, None], scores, -1e9)
    h = jnp.einsum('bhts,bshk->bthk', jax.nn.softmax(scores, axis=-1), v)
    return self.embed.attend(x + h.reshape(x.shape)), cache

  def tagged(self, tokens, positions, cache, attention_mask):
    return self(tokens, positions, cache, attention_mask)[0], 'v1'


def user_lm() -> UserLM:
  return UserLM(rngs=nnx.Rngs(2))


# Helpers
# ------------------------------------------------------------------------------


# The helpers of tests/support are imported in the functions below: the
# command line loads this file as a user's model file, without tests/support
# on its path.


def clean_env(**overrides: str | None) -> dict[str, str]:
  """`processes.clean_env`: the environment of a process a test starts."""
  from support import processes

  return processes.clean_env(**overrides)


def run_cli(*args: str, env: dict[str, str | None] | None = None):
  """Runs `flax-dtensor ARGS` in this process (`cli_runner.run`).

  Piped, the CLI prints at COLUMNS (80 when unset); unless `env` says
  otherwise, 200 columns keep one table row per line to parse.
  """
  from support import cli_runner

  return cli_runner.run(*args, env={'COLUMNS': '200', **(env or {})})


def run_cli_process(*args: str, env: dict[str, str] | None = None):
  """Runs `python -m flax_dtensor ARGS`; returns the CompletedProcess."""
  from support import processes

  if env is None:
    env = clean_env(COLUMNS='200')
  return processes.run_python(
    '-m', 'flax_dtensor', *args, env=env, timeout=TIMEOUT
  )


def ok(proc) -> str:
  assert proc.returncode == 0, (
    f'exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}'
  )
  return proc.stdout


def assert_fits(text: str, width: int, paths=()) -> None:
  from support import output_util

  output_util.assert_fits(text, width, paths)


def bad_input(proc, *fragments: str) -> str:
  """Asserts exit status 2, one `error:` line naming `fragments`.

  Only our own line is looked at: what other libraries print is not ours.
  """
  assert proc.returncode == 2, (
    f'exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}'
  )
  assert 'Traceback' not in proc.stderr, proc.stderr
  errors = [
    line for line in proc.stderr.splitlines() if line.startswith('error')
  ]
  assert len(errors) == 1, proc.stderr
  (line,) = errors
  assert line.startswith('error: '), line
  for fragment in fragments:
    assert fragment in line, (fragment, line)
  return line


def run_python(script: str, *args: str, timeout: float = TIMEOUT) -> str:
  from support import processes

  proc = processes.run_python('-c', script, *args, timeout=timeout)
  assert proc.returncode == 0, proc.stderr
  return proc.stdout


def make_checkpoint(
  target: str, tmp: pathlib.Path
) -> tuple[pathlib.Path, dict]:
  """An Orbax checkpoint of nnx.state(TARGET()) in `tmp`, and its values.

  The values (and, for the demo model, logits on fixed tokens) are also
  kept in an .npz file. The user model is built sharded on a (8,) mesh, so
  `export` restores it onto another layout.
  """
  import jax
  import orbax.checkpoint as ocp

  import flax_dtensor as fdt

  factory = _loading.load_target(target)
  if target.endswith('make_model'):
    model = factory()
  else:
    mesh = jax.make_mesh((8,), ('data',))
    with (
      jax.set_mesh(mesh),
      fdt.logical_axis_rules(
        [('features', 'data'), ('hidden', None), ('classes', None)]
      ),
    ):
      model = factory()
  state = nnx.state(model)
  path = tmp / 'orbax'
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, state)
    checkpointer.wait_until_finished()
  arrays = {
    '/'.join(map(str, k)): np.asarray(v.get_value())
    for k, v in nnx.to_flat_state(state)
  }
  if target.endswith('make_model'):
    tokens = (np.arange(2 * 128).reshape(2, 128) * 7 % 256).astype(np.int32)
    arrays['__tokens__'] = tokens
    arrays['__logits__'] = np.asarray(model(tokens))
  np.savez(
    tmp / 'expected.npz', **{k.replace('/', '|'): v for k, v in arrays.items()}
  )
  return path, arrays


def check_checkpoint(directory: pathlib.Path, expected: dict) -> dict:
  """A DTensor checkpoint read with TensorFlow, against `expected` values."""
  saved = {
    '/'.join(map(str, k)): v
    for k, v in fdt_tf.read_checkpoint(directory).items()
  }
  expected = {k: v for k, v in expected.items() if not k.startswith('__')}
  manifest = json.loads((directory / 'flax_dtensor.json').read_text())
  return {
    'missing': sorted(set(expected) - set(saved)),
    'extra': sorted(set(saved) - set(expected)),
    'max_abs_diff': max(
      float(np.max(np.abs(saved[k] - v)))
      for k, v in expected.items()
      if k in saved
    ),
    'layouts': {
      '/'.join(map(str, v['path'])): v['sharding']
      for v in manifest['variables']
    },
  }


# TF DTensor on the suite's 8 devices, before any other TF operation.
pytestmark = pytest.mark.usefixtures('dtensor')


@pytest.fixture(scope='module')
def user_checkpoint(tmp_path_factory):
  """An Orbax checkpoint of `user_model`, and its values."""
  return make_checkpoint(USER_TARGET, tmp_path_factory.mktemp('user'))


# Parsing (in process)
# ------------------------------------------------------------------------------


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


# plan
# ------------------------------------------------------------------------------


def test_plan_demo_table():
  piped = {'COLUMNS': None}
  out = ok(run_cli('plan', DEMO_TARGET, '--mesh', 'data=2,model=4', env=piped))
  assert 'Sharding plan: mesh data=2, model=4 (8 devices)' in out
  # The totals: bytes per device against the ideal.
  assert 'ideal 232.9 KiB (1.12x)' in out
  assert '260.0 KiB per device' in out
  lines = out.splitlines()
  starts = [line.split()[:1] for line in lines]
  assert starts.count(['head/kernel']) == 1
  # Piped without COLUMNS: 80 columns, the path on its own line.
  after = lines[starts.index(['head/kernel']) + 1]
  assert "('embed', 'vocab') -> P('data', 'model')" in after
  # One line for the reason, however many variables it affects.
  assert out.count("'embed' -> 'fsdp': the mesh has no axis 'fsdp'") == 1


@pytest.mark.parametrize('columns', ['80', '120', '200'])
def test_plan_respects_columns_and_keeps_paths_whole(columns):
  env = {'COLUMNS': columns}
  out = ok(run_cli('plan', DEMO_TARGET, '--expand', env=env))
  lines = out.splitlines()
  assert_fits(out, int(columns))
  starts = {line.split()[0] for line in lines if line.strip()}
  paths = json.loads(ok(run_cli('plan', DEMO_TARGET, '--json', env=env)))
  for variable in paths['variables']:
    assert variable['path'] in starts


def test_plan_summary():
  out = ok(run_cli('plan', DEMO_TARGET, '--summary'))
  assert 'Largest replicated (5 of 5)' in out
  assert 'final_norm/scale  float32[128]  512 B' in out
  assert 'layers/0/attn/key/kernel' not in out


def test_plan_show_draws_the_blocks():
  out = ok(
    run_cli(
      'plan',
      DEMO_TARGET,
      '--mesh',
      'data=2,model=4',
      '--show',
      'layers/0/attn/query/kernel',
    )
  )
  assert '8 blocks of 8 mesh positions' in out
  assert '[0:64, 0:1, :] -> 0' in out
  assert '[64:128, 3:4, :] -> 7' in out


def test_plan_show_unknown_path():
  bad_input(
    run_cli('plan', DEMO_TARGET, '--show', 'layers/0/nope'),
    '--show expected the path of a variable',
    "got 'layers/0/nope'",
    'Did you mean',
  )


# A Linear whose kernel is annotated and whose bias is not.
UNANNOTATED_BIAS = textwrap.dedent("""\
  from flax import nnx


  def make():
    init = nnx.with_partitioning(
      nnx.initializers.lecun_normal(), ('embed', 'mlp')
    )
    return nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0))
""")


def test_plan_prints_an_unannotated_bias_as_fdt_plan_does(tmp_path, auto_mesh):
  """One entry per dimension, P(None) for a 1-d variable, as JAX types it.

  The command plans the abstract model; `fdt.plan` here plans the model
  built and placed under the same rules: the same variable reads the same.
  """
  import importlib.util

  import jax

  import flax_dtensor as fdt

  (tmp_path / 'biased.py').write_text(UNANNOTATED_BIAS)
  rules_file = tmp_path / 'rules.yaml'
  rules_file.write_text(
    "logical_axis_rules:\n  - ['embed', 'data']\n  - ['mlp', 'model']\n"
  )
  out = ok(
    run_cli('plan', f'{tmp_path / "biased.py"}:make', '--rules', rules_file)
  )
  row = next(r for r in out.splitlines() if r.split()[:1] == ['bias'])
  assert row.split()[:4] == ['bias', 'float32[32]', '-', 'P(None)']
  as_json = json.loads(
    ok(
      run_cli(
        'plan',
        f'{tmp_path / "biased.py"}:make',
        '--rules',
        rules_file,
        '--json',
      )
    )
  )
  (bias,) = [e for e in as_json['variables'] if e['path'] == 'bias']
  assert bias['spec'] == [None]

  spec = importlib.util.spec_from_file_location(
    'biased', tmp_path / 'biased.py'
  )
  biased = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(biased)
  rules = fdt.LogicalRules.from_yaml(rules_file)
  with fdt.logical_axis_rules(rules), jax.set_mesh(auto_mesh):
    model = biased.make()
  assert repr(jax.typeof(model.bias[...]).sharding.spec) == 'P(None,)'
  for planned in (
    fdt.plan(model, mesh=auto_mesh, rules=rules),
    fdt.plan(biased.make, mesh=auto_mesh, rules=rules),
  ):
    lines = str(planned).splitlines()
    assert next(r for r in lines if r.split()[:1] == ['bias']).split()[:4] == [
      'bias',
      'float32[32]',
      '-',
      'P(None)',
    ]
    assert planned['bias'].to_dict()['spec'] == [None]


PATH_RULES_YAML = textwrap.dedent("""\
  # A model without logical axes (tests/support/unannotated_model.py), by paths.
  logical_axis_rules:
    - ['vocab', 'model']
    - ['embed', 'data']
    - ['heads', 'model']
    - ['head_dim', null]
    - ['mlp', 'model']
  path_rules:
    - ['embed/embedding$', ['vocab', 'embed']]
    - ['attn/(query|key|value)/kernel$', ['...', 'embed', 'heads', 'head_dim']]
    - ['attn/out/kernel$', ['...', 'heads', 'head_dim', 'embed']]
    - ['mlp/up/kernel$', ['...', 'embed', 'mlp']]
    - ['mlp/down/kernel$', ['...', 'mlp', 'embed']]
    - {pattern: 'head/kernel$', spec: ['data', 'model'], type: Param}
  """)


def test_plan_with_path_rules_shows_sources_and_diffs_them(tmp_path):
  from jax.sharding import AbstractMesh
  from jax.sharding import PartitionSpec as P
  from support import unannotated_model as um

  import flax_dtensor as fdt

  rules_file = tmp_path / 'rules.yaml'
  rules_file.write_text(PATH_RULES_YAML)
  target = f'{SUPPORT_DIR / "unannotated_model.py"}:make_model'
  out = ok(run_cli('plan', target, '--rules', rules_file))
  header = next(r for r in out.splitlines() if r.split()[:1] == ['path'])
  assert 'source' in header.split()
  head = next(r for r in out.splitlines() if r.split()[:1] == ['head/kernel'])
  assert head.split()[2:] == [
    '-',
    "P('data',",
    "'model')",
    'path',
    'rule',
    '#5',
    "'head/kernel$'",
    '8.0',
    'KiB',
  ]
  # A golden layout where another pattern placed head/kernel the same way.
  rules = fdt.LogicalRules.from_yaml(rules_file)
  golden_rules = rules.replace(
    path_rules=[
      *rules.path_rules[:5],
      fdt.PathRule('^head/kernel$', P('data', 'model')),
    ]
  )
  golden = tmp_path / 'golden.json'
  mesh = AbstractMesh((2, 4), ('data', 'model'))
  golden.write_text(
    fdt.plan(um.make_model, mesh=mesh, rules=golden_rules).to_json()
  )
  proc = run_cli('plan', target, '--rules', rules_file, '--diff', golden)
  assert proc.returncode == 1, proc.stderr
  assert proc.stdout.splitlines() == [
    '1 changed, 0 added, 0 removed; per device 69.8 KiB -> 69.8 KiB',
    'head/kernel',
    "  source path rule #5 '^head/kernel$' -> path rule #5 'head/kernel$'",
  ]


def test_plan_suggest_writes_rules_that_plan_and_check_read(tmp_path):
  target = f'{SUPPORT_DIR / "suggest_models.py"}:make_gemma'
  written = tmp_path / 'rules.yaml'
  out = ok(
    run_cli(
      'plan',
      target,
      '--mesh',
      'data=2,model=4',
      '--suggest',
      '--budget',
      '178KiB',
      '--min-bytes',
      '16KiB',
      '--write',
      written,
    )
  )
  lines = out.splitlines()
  assert lines[0].startswith('Suggested rules: recognised gemma ')
  # 178.5 KiB with the norms replicated: the largest of them are sharded.
  assert lines[2] == (
    '177.2 KiB per device fits the budget of 178.0 KiB (ideal 176.3 KiB).'
  )
  assert f'Wrote the rules to {str(written)!r}.' in lines
  # The plan follows, each variable's source saying why.
  assert "'(^|/)q_einsum/w$' (preset gemma rule #1: attention q" in out
  import flax_dtensor as fdt

  rules = fdt.LogicalRules.from_yaml(written)
  assert any('sharded further' in (r.note or '') for r in rules.path_rules)
  ok(
    run_cli(
      'plan', target, '--rules', written, '--check', '--min-bytes', '16KiB'
    )
  )
  proc = run_cli('plan', target, '--suggest', '--budget', '1KiB', '--json')
  assert proc.returncode == 1, proc.stderr  # Nothing fits: said by exit 1.
  assert json.loads(proc.stdout)['bytes_per_device'] > 1024
  bad_input(
    run_cli('plan', target, '--suggest', '--rules', written),
    '--suggest proposes the rules, and --rules',
  )
  bad_input(run_cli('plan', target, '--write', written), 'add --suggest')


def test_plan_suggest_traces_a_users_forward_on_input_shapes(tmp_path):
  target = f'{SUPPORT_DIR / "suggest_models.py"}:make_constrained_mlp'
  written = tmp_path / 'rules.yaml'
  stdout = ok(
    run_cli(
      'plan',
      target,
      '--suggest',
      '--input-shape',
      'x:8,96:float32',
      '--write',
      written,
    )
  )
  said = ' '.join(stdout.split())
  assert '(traced on float32[8,96])' in said
  assert "'act_batch' -> 'data', None; 'act_hidden' -> None" in said
  assert "['act_batch', 'data']" in written.read_text()
  # Without inputs, the report says the forward was not traced.
  stdout = ok(run_cli('plan', target, '--suggest'))
  assert 'The forward was not traced' in ' '.join(stdout.split())
  bad_input(
    run_cli('plan', target, '--input-shape', 'x:8,96:float32'),
    '--input-shape gives the inputs --suggest traces the forward on',
  )
  bad_input(
    run_cli('plan', target, '--suggest', '--input-shape', 'x:b,96:float32'),
    "--input-shape 'x:b,96:float32': tracing the forward for --suggest "
    'needs sizes',
  )
  bad_input(
    run_cli('plan', target, '--suggest', '--input-shape', 'x:8,95:float32'),
    'Tracing ConstrainedMlp.__call__ on the inputs given (float32[8,95]) '
    'failed',
  )


def test_plan_demo_json():
  result = json.loads(ok(run_cli('plan', DEMO_TARGET, '--json')))
  assert result['mesh'] == {'data': 2, 'model': 4}
  variables = {v['path']: v for v in result['variables']}
  assert len(variables) == 2 * 10 + 4
  head = variables['head/kernel']
  assert head['logical_axes'] == ['embed', 'vocab']
  assert head['spec'] == ['data', 'model']
  assert head['bytes'] == 128 * 256 * 4
  assert head['bytes_per_device'] == 128 * 256 * 4 // 8
  query = variables['layers/0/attn/query/kernel']
  assert query['spec'] == ['data', 'model', None]
  assert variables['final_norm/scale']['spec'] == [None]
  assert result['total_bytes'] == sum(v['bytes'] for v in variables.values())
  assert result['bytes_per_device'] == 266240
  assert result['ideal_bytes_per_device'] == result['total_bytes'] / 8


def test_plan_user_factory_with_rules(tmp_path):
  rules = tmp_path / 'rules.yaml'
  rules.write_text(USER_RULES)
  result = json.loads(
    ok(
      run_cli(
        'plan',
        USER_TARGET,
        '--mesh',
        'data=2,model=4',
        '--rules',
        rules,
        '--json',
      )
    )
  )
  variables = {v['path']: v for v in result['variables']}
  # 'features' took 'data', so 'hidden' (6, not divisible by 4) cannot fall
  # back to 'data' either: it stays unsharded, and the plan says why.
  kernel = variables['hidden/kernel']
  assert kernel['spec'] == ['data', None]
  assert any('not divisible by 4' in f for f in kernel['fallbacks'])
  assert any("'data' already shards dim 0" in f for f in kernel['fallbacks'])
  # The bias has no 'features': 'hidden' falls back to 'data' (6 % 2 == 0).
  assert variables['hidden/bias']['spec'] == ['data']
  assert variables['out/kernel']['spec'] == ['data', None]


def test_plan_user_factory_as_module(tmp_path, monkeypatch):
  rules = tmp_path / 'rules.yaml'
  rules.write_text(USER_RULES)
  monkeypatch.syspath_prepend(str(TESTS_DIR))
  result = json.loads(
    ok(
      run_cli(
        'plan',
        'cli_test:user_model',
        '--mesh',
        'data=8',
        '--rules',
        rules,
        '--json',
      )
    )
  )
  variables = {v['path']: v for v in result['variables']}
  assert variables['hidden/kernel']['spec'] == ['data', None]
  assert result['num_devices'] == 8


def test_plan_allocates_nothing(tmp_path):
  rules = tmp_path / 'rules.yaml'
  rules.write_text(USER_RULES)
  result = json.loads(
    ok(
      run_cli(
        'plan',
        f'{THIS_FILE}:huge_user_model',
        '--mesh',
        'data=2,model=4',
        '--rules',
        rules,
        '--json',
      )
    )
  )
  (kernel,) = [v for v in result['variables'] if v['path'] == 'kernel']
  assert kernel['bytes'] == 100_000 * 100_000 * 4  # 40 GB, never allocated.
  assert kernel['spec'] == ['data', 'model']
  assert kernel['bytes_per_device'] == kernel['bytes'] // 8


# Bad input: exit status 2, one line, no traceback
# ------------------------------------------------------------------------------


@pytest.mark.parametrize(
  'args, fragments',
  [
    (['--mesh', 'data2,model=4'], ['Malformed --mesh', 'NAME=SIZE']),
    (['--mesh', 'data=2;model=4'], ['Malformed --mesh']),
    (['--mesh', 'data=0'], ['sizes must be positive']),
    (
      ['--axis-types', 'manual'],
      ["Malformed --axis-types 'manual'", 'expected auto, explicit or'],
    ),
    (
      ['--axis-types', 'data=explicit,model=fast'],
      ["axis 'model' has type 'fast'", 'expected one of auto, explicit'],
    ),
    (
      ['--axis-types', 'data=explicit,data=auto'],
      ["axis 'data' is named twice"],
    ),
  ],
  ids=['no-equals', 'bad-separator', 'zero', 'type', 'axis-type', 'twice'],
)
def test_plan_malformed_mesh(args, fragments):
  bad_input(run_cli('plan', DEMO_TARGET, *args), *fragments)


@pytest.mark.parametrize(
  'target, fragments',
  [
    ('flax_dtensor.demo.model', ['not of the form package.module:factory']),
    ('no_such_module_xyz:make', ["no module named 'no_such_module_xyz'"]),
    (
      'flax_dtensor.demo.model:no_such_factory',
      ["has no attribute 'no_such_factory'"],
    ),
    ('/no/such/file.py:make', ["file '/no/such/file.py' does not exist"]),
    (
      f'{pathlib.Path(THIS_FILE).parents[2] / "README.md"}:make',
      ['README.md', 'is not a Python source file Python can import'],
    ),
    (f'{THIS_FILE}:not_a_module', ["'not_a_module' to return", 'got int: 3']),
    (f'{THIS_FILE}:a_string', ["'a_string' to return", "got str: 'str'"]),
    (f'{THIS_FILE}:a_tuple', ["'a_tuple' to return", 'got tuple: (UserMLP']),
    (f'{THIS_FILE}:USER_RULES', ['is a str, not a callable']),
  ],
  ids=[
    'no-colon',
    'no-module',
    'no-attribute',
    'no-file',
    'not-python',
    'returns-an-int',
    'returns-a-str',
    'returns-a-tuple',
    'not-callable',
  ],
)
def test_plan_bad_target(target, fragments):
  """Each in our words; a factory's result is named by its type before JAX
  traces it (not JAX's "returned a value of type <class 'str'>")."""
  line = bad_input(run_cli('plan', target), 'TARGET', *fragments)
  assert 'traced for jit' not in line and 'NoneType' not in line


@pytest.mark.parametrize(
  'text, fragments',
  [
    (
      'logical_axis_rules: [[unclosed',
      [
        "not valid YAML: line 1, column 31: expected ',' or ']'",
        'parsing a flow sequence started at line 1, column 22)',
      ],
    ),
    ('rules: []', ['no `logical_axis_rules` key']),
    ('logical_axis_rules: [[embed, 3]]', ['expected a mesh axis name']),
    ('logical_axis_rules: [[embed]]', ['expected a (logical_name, target)']),
  ],
  ids=['bad-yaml', 'no-key', 'bad-target', 'bad-pair'],
)
def test_plan_malformed_rules(tmp_path, text, fragments):
  rules = tmp_path / 'rules.yaml'
  rules.write_text(text)
  line = bad_input(
    run_cli('plan', DEMO_TARGET, '--rules', rules),
    f"Malformed rules file: '{rules}'",
    *fragments,
  )
  # Once, readably: no caret, no quoted line, one example of the format.
  assert '^' not in line and line.count(str(rules)) == 1, line
  assert line.count('e.g.') == 1, line


def test_plan_missing_rules_file(tmp_path):
  bad_input(
    run_cli('plan', DEMO_TARGET, '--rules', tmp_path / 'nope.yaml'),
    'does not exist',
  )


def test_plan_rules_missing_a_name(tmp_path):
  rules = tmp_path / 'rules.yaml'
  rules.write_text("logical_axis_rules: [['batch', 'data']]")
  message = bad_input(
    run_cli('plan', DEMO_TARGET, '--rules', rules),
    'not mentioned by any rule at ',  # The variable's path follows.
    'to the rules file (--rules)',
  )
  assert 'unknown="replicate"' not in message  # Python's fix, not ours.
  assert 'Error' not in message  # No class names (they are in --debug).


def test_plan_says_what_an_unknown_name_likely_meant(tmp_path):
  """The rules spell 'embed' 'embedd': the error says so, in the command
  line's words."""
  rules = tmp_path / 'rules.yaml'
  text = train_rules_text().replace("['embed',", "['embedd',")
  rules.write_text(text)
  bad_input(
    run_cli('plan', DEMO_TARGET, '--rules', rules),
    "['embed'] are not mentioned by any rule at ",
    "'embed': did you mean 'embedd'?",
    'to the rules file (--rules)',
  )


def train_rules_text() -> str:
  from flax_dtensor.demo import train

  return train.rules_text()


def test_debug_shows_traceback():
  proc = run_cli('plan', DEMO_TARGET, '--mesh', 'data2', '--debug')
  assert proc.returncode == 2
  assert 'Traceback' in proc.stderr
  assert 'error: Malformed --mesh' in proc.stderr


# A factory file that writes to the process's stderr the way native libraries
# do (straight to file descriptor 2), and the way Python libraries do.
NOISY_FACTORY = """
import os, sys, warnings
os.write(2, b'I0000 00:00:0.0  1 native.cc:1] noise at import\\n')
from flax import nnx

def noisy_model():
  os.write(2, b'native noise while building\\n')
  warnings.warn('a library warning')
  print('python noise', file=sys.stderr)
  return nnx.Linear(4, 4, rngs=nnx.Rngs(0))

def noisy_failure():
  os.write(2, b'native noise before failing\\n')
  raise RuntimeError('the factory broke')
"""


def test_stderr_holds_only_our_messages(tmp_path):
  path = tmp_path / 'noisy.py'
  path.write_text(NOISY_FACTORY)
  proc = run_cli('plan', f'{path}:noisy_model', '--mesh', 'data=8')
  assert 'Sharding plan' in ok(proc)
  assert proc.stderr == ''
  proc = run_cli('plan', f'{path}:noisy_failure', '--mesh', 'data=8')
  line = bad_input(proc, 'the factory broke')
  assert proc.stderr.splitlines() == [line]


def test_debug_shows_other_libraries_output(tmp_path):
  path = tmp_path / 'noisy.py'
  path.write_text(NOISY_FACTORY)
  proc = run_cli('plan', f'{path}:noisy_model', '--mesh', 'data=8', '--debug')
  ok(proc)
  for noise in (
    'noise at import',
    'native noise while building',
    'python noise',
  ):
    assert noise in proc.stderr


class _Writes(io.StringIO):
  """A stream that keeps each write apart."""

  def __init__(self):
    super().__init__()
    self.writes = []

  def write(self, text):
    self.writes.append(text)
    return super().write(text)


@pytest.mark.parametrize(
  'raised, line',
  [
    (
      fdt_tf.DiskFullError('Writing the export failed:\nthe disk is full.'),
      'error: Writing the export failed: the disk is full.',
    ),
    (KeyboardInterrupt(), 'interrupted'),
  ],
  ids=['error', 'interrupted'],
)
def test_the_error_line_is_one_write(raised, line):
  """Our last line goes out in one write, its newline with it: written in
  two, another library's thread (Orbax prints tracebacks as a write fails)
  could land between the text and its newline, in the middle of our
  line, as it once did."""
  from flax_dtensor import _interrupts, _output

  stream = _Writes()
  with _output.routed_to(stream), pytest.raises(typer.Exit) as exit_info:
    with _command.handle_errors(debug=True):
      raise raised
  _interrupts.acknowledge()
  assert stream.writes == [f'{line}\n']
  assert exit_info.value.exit_code == (2 if line.startswith('error') else 130)


# In this process, with typer's runner: what the user's code prints, eager
# sharding off, a mesh of axes of size 1
# ------------------------------------------------------------------------------

# A model module that prints when imported and when its factory is called,
# as MaxText prints when imported; `unplaced` is made while eager sharding is
# off for one variable.
PRINTING_FACTORY = """
from flax import nnx
print('hello from the model module')

def make():
  print('building the model')
  init = nnx.initializers.lecun_normal()
  return nnx.Linear(16, 32, kernel_init=nnx.with_partitioning(
      init, ('data', 'model')), rngs=nnx.Rngs(0))

def unplaced():
  init = nnx.with_partitioning(
      nnx.initializers.lecun_normal(), ('data', 'model'), eager_sharding=False)
  return nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0))
"""

# A model module that turns eager sharding off for everyone when imported,
# as MaxText and tunix do.
FLAG_OFF_FACTORY = """
import flax
from flax import nnx
flax.config.update('flax_always_shard_variable', False)

def make():
  init = nnx.initializers.lecun_normal()
  return nnx.Linear(16, 32, kernel_init=nnx.with_partitioning(
      init, ('data', 'model')), rngs=nnx.Rngs(0))
"""

MESH_AXIS_NAMES = ('--mesh', 'data=2,model=4', '--mesh-axis-names')


def invoke(*args, columns=200):
  """Runs the command line in this process (typer's runner).

  Returns the runner's result: `stdout` and `stderr` hold what was written
  to sys.stdout and sys.stderr; our own stream is file descriptor 2 (see
  `_command.handle_errors`), which `capfd` reads.
  """
  from typer.testing import CliRunner

  from flax_dtensor.cli import _app

  return CliRunner().invoke(
    _app.app,
    [str(a) for a in args],
    env={'COLUMNS': str(columns)},
    catch_exceptions=False,
  )


@pytest.fixture
def eager_flag_restored():
  """Flax's eager-sharding flag as it was, whatever a module set."""
  import flax

  before = flax.config.flax_always_shard_variable
  try:
    yield
  finally:
    flax.config.update('flax_always_shard_variable', before)


def test_plan_json_is_only_json_when_the_model_prints(tmp_path, capfd):
  path = tmp_path / 'printing.py'
  path.write_text(PRINTING_FACTORY)
  prints = ['hello from the model module', 'building the model']
  result = invoke('plan', f'{path}:make', *MESH_AXIS_NAMES, '--json')
  assert result.exit_code == 0, result.output
  plan = json.loads(result.stdout)
  assert [(v['path'], v['spec']) for v in plan['variables']] == [
    ('bias', [None]),  # One entry per dimension, as fdt.plan shows it.
    ('kernel', ['data', 'model']),
  ]
  err = capfd.readouterr().err
  assert [line for line in err.splitlines() if line in prints] == prints
  # With --check, the findings as JSON: the same.
  result = invoke('plan', f'{path}:make', *MESH_AXIS_NAMES, '--check', '--json')
  assert result.exit_code == 0, result.output
  assert json.loads(result.stdout) == {'findings': [], 'allowed': []}
  err = capfd.readouterr().err
  assert [line for line in err.splitlines() if line in prints] == prints
  # With --debug (nothing redirected), to sys.stderr.
  result = invoke('plan', f'{path}:make', *MESH_AXIS_NAMES, '--json', '--debug')
  assert result.exit_code == 0, result.output
  json.loads(result.stdout)
  assert [x for x in result.stderr.splitlines() if x in prints] == prints
  # Without --json, the model's prints stay on stdout, before the plan.
  result = invoke('plan', f'{path}:make', *MESH_AXIS_NAMES)
  assert result.exit_code == 0, result.output
  assert result.stdout.splitlines()[:3] == [
    *prints,
    'Sharding plan: mesh data=2, model=4 (8 devices)',
  ]


@pytest.mark.parametrize(
  'source, factory',
  [(FLAG_OFF_FACTORY, 'make'), (PRINTING_FACTORY, 'unplaced')],
  ids=['flag-off-at-import', 'eager-sharding-false'],
)
def test_plan_check_says_what_the_factory_creates_unplaced(
  tmp_path, eager_flag_restored, source, factory
):
  del eager_flag_restored
  path = tmp_path / 'model.py'
  path.write_text(source)
  args = ('plan', f'{path}:{factory}', *MESH_AXIS_NAMES, '--check')
  result = invoke(*args, '--json')
  assert result.exit_code == 1, result.output
  (finding,) = json.loads(result.stdout)['findings']
  assert (finding['code'], finding['subject']) == (
    'eager-sharding-off',
    'kernel',
  )
  assert finding['message'].startswith(
    "the rules say P('data', 'model'), but calling the factory (building the "
    'model eagerly) creates it unplaced: '
  )
  result = invoke(*args, '--allow', 'eager-sharding-off')
  assert result.exit_code == 0, result.output
  assert result.stdout.splitlines()[-1] == 'No findings.'


def test_plan_check_is_clean_when_eager_sharding_is_on(tmp_path):
  path = tmp_path / 'model.py'
  path.write_text(PRINTING_FACTORY)
  result = invoke('plan', f'{path}:make', *MESH_AXIS_NAMES, '--check')
  assert result.exit_code == 0, result.output
  assert result.stdout.splitlines()[-1] == 'No findings.'


def test_plan_shows_specs_without_the_mesh_axes_of_size_1(tmp_path):
  from support import many_axes

  rules = tmp_path / 'rules.yaml'
  rules.write_text(many_axes.RULES.to_yaml_text())
  args = (
    'plan',
    f'{SUPPORT_DIR / "many_axes.py"}:make_stacked',
    '--mesh',
    many_axes.MESH_FLAG,
    '--rules',
    rules,
  )
  result = invoke(*args)
  assert result.exit_code == 0, result.output
  text = result.stdout
  assert ' '.join(text.split()).startswith(
    'Sharding plan: mesh fsdp=2, tensor=4 (8 devices; size 1, not shown in '
    'specs: data, stage, fsdp_transpose,'
  )
  (row,) = [x for x in text.splitlines() if x.lstrip().startswith('wi ')]
  assert row.split()[-5:] == ["P('fsdp',", 'None,', "'tensor')", '768', 'B']
  for name in many_axes.UNIT:
    assert repr(name) not in text
  # The JSON keeps the spec as the rules resolve it.
  result = invoke(*args, '--json')
  assert result.exit_code == 0, result.output
  spec = {v['path']: v['spec'] for v in json.loads(result.stdout)['variables']}
  assert spec['wi'] == [
    ['fsdp', 'sequence', 'context', 'expert'],
    'stage',
    ['tensor', 'tensor_transpose', 'tensor_sequence'],
  ]


def test_export_missing_checkpoint(tmp_path):
  bad_input(
    run_cli(
      'export',
      DEMO_TARGET,
      '--checkpoint',
      tmp_path / 'missing',
      '--out',
      tmp_path / 'out',
    ),
    'Checkpoint',
    'does not exist',
  )


def test_export_not_a_checkpoint(tmp_path):
  (tmp_path / 'empty').mkdir()
  bad_input(
    run_cli(
      'export',
      DEMO_TARGET,
      '--checkpoint',
      tmp_path / 'empty',
      '--out',
      tmp_path / 'out',
    ),
    'holds no Orbax checkpoint',
  )


def test_export_corrupt_checkpoint(tmp_path):
  corrupt = tmp_path / 'corrupt'
  corrupt.mkdir()
  (corrupt / '_CHECKPOINT_METADATA').write_text('{not json')
  (corrupt / '_METADATA').write_text('\x00garbage')
  bad_input(
    run_cli(
      'export',
      DEMO_TARGET,
      '--checkpoint',
      corrupt,
      '--out',
      tmp_path / 'out',
    ),
    'Cannot restore the Orbax checkpoint',
  )
  assert not (tmp_path / 'out' / 'checkpoint').exists()


def test_export_mesh_does_not_match_devices(tmp_path):
  checkpoint = tmp_path / 'ckpt'
  (checkpoint).mkdir()
  (checkpoint / '_METADATA').write_text('{}')
  bad_input(
    run_cli(
      'export',
      DEMO_TARGET,
      '--checkpoint',
      checkpoint,
      '--mesh',
      'data=4,model=4',
      '--cpu-devices',
      '8',
      '--out',
      tmp_path / 'out',
    ),
    '--mesh data=4,model=4 needs 16 devices, but JAX has 8 (cpu)',
    '--cpu-devices 16',
  )


def test_demo_mesh_does_not_match_cpu_devices(tmp_path):
  bad_input(
    run_cli(
      'demo',
      '--mesh',
      'data=4,model=4',
      '--cpu-devices',
      '8',
      '--out',
      tmp_path / 'demo',
    ),
    'needs 16 devices, but JAX has 8',
  )
  assert not (tmp_path / 'demo').exists()


def test_export_saved_model_needs_input_shape(tmp_path):
  checkpoint = tmp_path / 'ckpt'
  checkpoint.mkdir()
  (checkpoint / '_METADATA').write_text('{}')
  bad_input(
    run_cli(
      'export',
      DEMO_TARGET,
      '--checkpoint',
      checkpoint,
      '--out',
      tmp_path / 'out',
      '--saved-model',
    ),
    '--saved-model needs',
  )


@pytest.mark.parametrize(
  'path, fragments',
  [('missing', ['is not a directory']), ('empty', ['holds no TF checkpoint'])],
  ids=['missing', 'empty'],
)
def test_inspect_bad_directory(tmp_path, path, fragments):
  (tmp_path / 'empty').mkdir()
  bad_input(run_cli('inspect', tmp_path / path), *fragments)


# export and inspect, for real
# ------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def demo_export(tmp_path_factory):
  """Exports an Orbax checkpoint of the demo model with a SavedModel."""
  tmp = tmp_path_factory.mktemp('demo_export')
  orbax, expected = make_checkpoint(DEMO_TARGET, tmp)
  out = tmp / 'out'
  proc = run_cli(
    'export',
    DEMO_TARGET,
    '--checkpoint',
    orbax,
    '--mesh',
    'data=2,model=4',
    '--out',
    out,
    '--saved-model',
    '--input-shape',
    'tokens:1,128:int32',
  )
  return tmp, out, expected, proc


def test_export_demo_checkpoint_values(demo_export):
  _, out, expected, proc = demo_export
  stdout = ok(proc)
  # TensorFlow runs: none of its output reaches stderr.
  assert proc.stderr == ''
  assert 'Restored' in stdout and 'onto mesh data=2,model=4' in stdout
  report = check_checkpoint(out / 'checkpoint', expected)
  assert report['missing'] == [] and report['extra'] == []
  assert report['max_abs_diff'] == 0.0  # Bit-exact.
  layouts = report['layouts']
  assert layouts['head/kernel']['spec'] == [['data'], ['model']]


def test_export_demo_saved_model_logits(demo_export):
  _, out, expected, proc = demo_export
  ok(proc)
  logits, report = verify.verify_saved_model(
    out / 'saved_model', expected['__tokens__']
  )
  assert not report['jax_imported']
  assert logits.shape == (2, 128, 256)
  np.testing.assert_allclose(
    logits, expected['__logits__'], rtol=1e-4, atol=1e-4
  )


@pytest.mark.parametrize(
  'args, fragments',
  [
    (
      ['--input-shape', 'tokens:128:int32'],  # The batch dim forgotten.
      # Echoed as given: the size written, not the batch symbol.
      ['--input-shape tokens:128:int32', 'does not fit TransformerLM.__call__'],
    ),
    (
      ['--input-shape', 'tokens:1,128:int32', '--method', 'nope'],
      ["--method 'nope'", 'has no such method'],
    ),
  ],
  ids=['no-batch-dim', 'no-method'],
)
def test_export_bad_served_inputs_write_nothing(demo_export, args, fragments):
  tmp, _, _, _ = demo_export
  out = tmp / 'bad_inputs'
  proc = run_cli(
    'export',
    DEMO_TARGET,
    '--checkpoint',
    tmp / 'orbax',
    '--out',
    out,
    '--saved-model',
    *args,
  )
  bad_input(proc, *fragments)
  assert not out.exists()


def test_an_input_of_the_wrong_width_is_named_as_save_saved_model_does():
  """The check before an export, in `save_saved_model`'s words
  (tests/bridge/serving): the input, the shape it needs, the one given."""
  abstract = nnx.eval_shape(lambda: nnx.Linear(64, 8, rngs=nnx.Rngs(0)))
  specs = [_served.parse_input_shape('x:1,48:float32', static_batch=False)]
  with pytest.raises(_command.BadInputError) as raised:
    _served.check_served_inputs(abstract, '__call__', specs)
  assert str(raised.value) == (
    '--input-shape x:1,48:float32 does not fit Linear.__call__: calling it '
    'on inputs of these shapes fails with TypeError: dot_general requires '
    'contracting dimensions to have the same shape, got (48,) and (64,). '
    'Dimension 1 of x is 48 where the forward needs 64: expected '
    'x:1,64:float32, got x:1,48:float32. Pass one --input-shape per '
    'positional input, in order, with the batch dimension first (e.g. '
    'x:1,128:int32).'
  )


EXPLICIT_NET = """
import jax
from flax import nnx
from jax.sharding import PartitionSpec as P


class ExplicitNet(nnx.Module):
  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    self.up = nnx.Linear(
      16, 32, kernel_init=nnx.with_partitioning(init, ('embed', 'mlp')),
      rngs=rngs,
    )
    self.down = nnx.Linear(
      32, 8, kernel_init=nnx.with_partitioning(init, ('mlp', 'embed')),
      rngs=rngs,
    )

  def __call__(self, x):
    h = jax.nn.relu(self.up(x, out_sharding=P(None, 'model')))
    return self.down(h, out_sharding=P())  # Contracts over sharded 'mlp'.


def make():
  return ExplicitNet(nnx.Rngs(0))
"""


def test_export_on_explicit_axes_serves_a_forward_written_for_them(tmp_path):
  """--axis-types explicit: a forward with out_sharding= exports with a
  polymorphic batch and serves every batch size with JAX's values; on the
  default Auto axes the refusal names the option."""
  import warnings

  import orbax.checkpoint as ocp

  (tmp_path / 'explicit_net.py').write_text(EXPLICIT_NET)
  (tmp_path / 'rules.yaml').write_text(
    'logical_axis_rules:\n  - [embed, null]\n  - [mlp, model]\n'
  )
  target = f'{tmp_path / "explicit_net.py"}:make'
  namespace: dict = {}
  exec(compile(EXPLICIT_NET, 'explicit_net.py', 'exec'), namespace)
  with nnx.use_eager_sharding(False):
    model = namespace['make']()
  with warnings.catch_warnings(), ocp.StandardCheckpointer() as checkpointer:
    warnings.simplefilter('ignore')  # Orbax's own deprecations.
    checkpointer.save(tmp_path / 'orbax', nnx.state(model))
    checkpointer.wait_until_finished()
  common = (
    *('--checkpoint', tmp_path / 'orbax', '--rules', tmp_path / 'rules.yaml'),
    *('--saved-model', '--input-shape', 'x:1,16:float32'),
  )
  bad_input(
    run_cli('export', target, '--out', tmp_path / 'auto', *common),
    'ExplicitNet.__call__ is written for Explicit mesh axes',
    'Pass --axis-types explicit',
  )
  assert not (tmp_path / 'auto').exists()
  bad_input(
    run_cli('plan', target, '--axis-types', 'dta=explicit'),
    "'dta' is not an axis of --mesh (its axes: data, model)",
  )
  out = tmp_path / 'explicit'
  ok(
    run_cli('export', target, '--out', out, '--axis-types', 'explicit', *common)
  )
  _serves_rows_as_jax_runs_them(out / 'saved_model', model)


def _serves_rows_as_jax_runs_them(path, model):
  """The SavedModel at `path` serves 1, 3 and 8 rows as `model` computes
  them on one device (a mesh of its axes, each of size 1)."""
  import jax
  import tensorflow as tf

  served = tf.saved_model.load(str(path))
  mesh = jax.make_mesh((1, 1), ('data', 'model'), devices=jax.devices()[:1])
  for rows in (1, 3, 8):
    x = np.random.default_rng(rows).standard_normal((rows, 16), np.float32)
    (got,) = served.serve(tf.constant(x)).values()
    with jax.set_mesh(mesh):
      want = model(jax.numpy.asarray(x))
    np.testing.assert_allclose(
      got.numpy(), np.asarray(want), rtol=1e-5, atol=1e-5
    )


BATCH_SHARDED_NET = EXPLICIT_NET.replace(
  '  def __call__(self, x):\n',
  "  def __call__(self, x):\n    x = jax.sharding.reshard(x, P('data', None))\n",
)


def test_export_traces_its_inputs_where_save_saved_model_does(tmp_path):
  """A forward that splits its batch over an Explicit axis (as bonsai's
  models do): the command line's check of --input-shape traces it on the
  serving mesh, as `save_saved_model` does, and the export serves every
  batch size (it blamed the right input shape: 'does not evenly divide
  the dimension size b')."""
  import orbax.checkpoint as ocp

  assert 'reshard(x' in BATCH_SHARDED_NET
  (tmp_path / 'batch_net.py').write_text(BATCH_SHARDED_NET)
  (tmp_path / 'rules.yaml').write_text(
    'logical_axis_rules:\n  - [embed, null]\n  - [mlp, model]\n'
  )
  namespace: dict = {}
  exec(compile(BATCH_SHARDED_NET, 'batch_net.py', 'exec'), namespace)
  with nnx.use_eager_sharding(False):
    model = namespace['make']()
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / 'orbax', nnx.state(model))
    checkpointer.wait_until_finished()
  out = tmp_path / 'out'
  ok(
    run_cli(
      'export',
      f'{tmp_path / "batch_net.py"}:make',
      *('--checkpoint', tmp_path / 'orbax', '--out', out),
      *('--rules', tmp_path / 'rules.yaml', '--axis-types', 'explicit'),
      *('--saved-model', '--input-shape', 'x:1,16:float32'),
    )
  )
  _serves_rows_as_jax_runs_them(out / 'saved_model', model)


def test_export_refuses_to_overwrite(demo_export):
  tmp, out, _, proc = demo_export
  ok(proc)
  bad_input(
    run_cli(
      'export',
      DEMO_TARGET,
      '--checkpoint',
      tmp / 'orbax',
      '--out',
      out,
    ),
    'already exists',
    '--overwrite',
  )


def test_inspect_demo_export(demo_export):
  _, out, _, proc = demo_export
  ok(proc)
  proc = run_cli('inspect', out)
  stdout = ok(proc)
  assert proc.stderr == ''
  assert 'DTensor checkpoint' in stdout
  assert '24 variables' in stdout
  lines = [line for line in stdout.splitlines() if 'head/kernel' in line]
  # The checkpoint's row, and the SavedModel's (from its assets).
  assert len(lines) == 2, lines
  for line in lines:
    assert '(128, 256)' in line and 'float32' in line, line
    assert "P('data', 'model')" in line, line
    assert 'data,model' in line and '@' not in line, line
  # The meshes, once above each table.
  assert (
    stdout.count('JAX mesh data=2,model=4; DTensor mesh data=2,model=4') == 2
  )
  # The SavedModel: its signature and its variables.
  assert 'serving_default' in stdout
  assert 'tokens: [None, 128] int32' in stdout
  assert 'From assets/flax_dtensor.json' in ' '.join(stdout.split())


def test_export_and_inspect_user_factory(user_checkpoint, tmp_path):
  orbax, expected = user_checkpoint
  rules = tmp_path / 'rules.yaml'
  rules.write_text(USER_RULES)
  out = tmp_path / 'out'
  stdout = ok(
    run_cli(
      'export',
      USER_TARGET,
      '--checkpoint',
      orbax,
      '--mesh',
      'data=2,model=4',
      '--rules',
      rules,
      '--out',
      out,
      env={'COLUMNS': '80'},
    )
  )
  assert_fits(stdout, 80, [orbax, out / 'checkpoint'])
  report = check_checkpoint(out / 'checkpoint', expected)
  assert report['missing'] == [] and report['extra'] == []
  assert report['max_abs_diff'] == 0.0
  assert set(report['layouts']) == {
    'hidden/bias',
    'hidden/kernel',
    'out/kernel',
  }
  stdout = ok(run_cli('inspect', out / 'checkpoint'))
  assert '3 variables' in stdout
  (line,) = [x for x in stdout.splitlines() if 'hidden/kernel' in x]
  assert '(16, 6)' in line and 'float32' in line
  assert "P('data', None)" in line and 'data,unsharded' in line
  assert 'JAX mesh data=2,model=4; DTensor mesh data=2,model=4' in stdout


def test_export_takes_a_step_of_a_checkpoint_managers_run(tmp_path):
  """A run saved by `CheckpointManager` (steps 1 to 3, each its own values)
  exports its latest whole step, or the one `--step` names, onto the
  command line's mesh; `--step` is refused where it cannot apply."""
  import jax

  import flax_dtensor as fdt

  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  rules = fdt.LogicalRules.from_yaml_text(USER_RULES)
  model = fdt.init(user_model, mesh=mesh, rules=rules)
  run = tmp_path / 'run'
  manager = fdt_tf.CheckpointManager(run)
  values = {}
  for step in (1, 2, 3):
    kernel = model.hidden.kernel
    kernel.set_value(kernel.get_value() + 1.0)
    manager.save(step, model)
    values[step] = np.asarray(kernel.get_value())
  manager.close()
  rules_file = tmp_path / 'rules.yaml'
  rules_file.write_text(USER_RULES)
  args = ['export', USER_TARGET, '--checkpoint', run, '--rules', rules_file]
  for step in (None, 2):
    out = tmp_path / f'out-{step}'
    more = [] if step is None else ['--step', str(step)]
    stdout = ok(run_cli(*args, *more, '--out', out))
    assert str(run / str(step or 3)) in stdout  # What was restored.
    saved = fdt_tf.read_checkpoint(out / 'checkpoint')
    np.testing.assert_array_equal(saved['hidden/kernel'], values[step or 3])
  bad_input(
    run_cli(*args, '--step', '7', '--out', tmp_path / 'x'),
    '--step 7:',
    'holds no whole step 7; its latest steps are 1, 2, 3',
  )
  orbax = tmp_path / 'orbax'
  bad_input(
    run_cli(
      *args[:3], str(orbax), *args[4:], '--step', '1', '--out', tmp_path / 'x'
    ),
    '--step applies to a CheckpointManager directory',
  )
  empty = tmp_path / 'empty'
  empty.mkdir()
  (empty / 'flax_dtensor_steps.json').write_text('{"steps": {}}')
  bad_input(
    run_cli(*args[:3], str(empty), *args[4:], '--out', tmp_path / 'x'),
    'holds no whole step yet: nothing to export',
  )


def test_export_into_an_empty_current_directory(
  user_checkpoint, tmp_path, monkeypatch
):
  """`--out .` in an empty directory writes the run there (its parts moved
  in from a hidden folder inside it, the directory itself kept); once it
  holds a run, `--out .` is refused before any work."""
  orbax, expected = user_checkpoint
  here = tmp_path / 'here'
  here.mkdir()
  monkeypatch.chdir(here)
  rules = tmp_path / 'rules.yaml'
  rules.write_text(USER_RULES)
  args = ['export', USER_TARGET, '--checkpoint', orbax, '--rules', rules]
  args += ['--out', '.']
  ok(run_cli(*args))
  assert sorted(os.listdir(here)) == ['checkpoint']
  report = check_checkpoint(here / 'checkpoint', expected)
  assert report['max_abs_diff'] == 0.0 and report['missing'] == []
  assert pathlib.Path.cwd() == here
  line = bad_input(run_cli(*args, '--overwrite'), "--out '.' is the current")
  assert 'and is not empty' in line
  assert sorted(os.listdir(here)) == ['checkpoint']


def test_export_single_mesh(user_checkpoint, tmp_path):
  """--single-mesh: one DTensor mesh, what moved printed, values exact."""
  orbax, expected = user_checkpoint
  rules = tmp_path / 'rules.yaml'
  rules.write_text(
    textwrap.dedent("""\
      logical_axis_rules:
        - ['features', ['data', 'model']]
        - ['hidden', null]
        - ['classes', null]
      """)
  )
  out = tmp_path / 'out'
  stdout = ok(
    run_cli(
      'export',
      USER_TARGET,
      '--checkpoint',
      orbax,
      '--mesh',
      'data=2,model=4',
      '--rules',
      rules,
      '--out',
      out,
      '--single-mesh',
    )
  )
  assert (
    '3 variables on one DTensor mesh (data=2, model=4): 1 relaid by JAX'
    in stdout
  )
  (line,) = [x for x in stdout.splitlines() if x.startswith('  hidden/kernel')]
  assert line.split() == [
    'hidden/kernel',
    "P(('data',",
    "'model'),",
    'None)',
    "P('model')",
  ]
  assert "kept 'model', the largest, replicated over 'data'" in ' '.join(
    stdout.split()
  )
  report = check_checkpoint(out / 'checkpoint', expected)
  assert report['missing'] == [] and report['extra'] == []
  assert report['max_abs_diff'] == 0.0
  kernel = report['layouts']['hidden/kernel']
  assert kernel['spec'] == [['model'], []]
  assert kernel['dtensor_layout'] == {
    'sharding_specs': ['model', 'unsharded'],
    'mesh': {'axis_names': ['data', 'model'], 'axis_sizes': [2, 4]},
  }


def test_export_is_all_or_nothing(user_checkpoint, tmp_path):
  """A SavedModel that fails leaves no checkpoint behind, nor the --out."""
  orbax, _ = user_checkpoint
  rules = tmp_path / 'rules.yaml'
  rules.write_text(USER_RULES)
  out = tmp_path / 'out'
  args = [
    'export',
    USER_TARGET,
    '--checkpoint',
    orbax,
    '--rules',
    rules,
    '--out',
    out,
    '--saved-model',
  ]
  # A wrong feature size (8, the model takes 16): tracing the model fails,
  # after the checkpoint was written.
  failed = run_cli(*args, '--input-shape', 'x:1,8:float32')
  assert failed.returncode != 0
  assert not out.exists()
  assert sorted(os.listdir(tmp_path)) == ['rules.yaml']
  # The corrected command runs, as if the first had never happened.
  ok(run_cli(*args, '--input-shape', 'x:1,16:float32'))
  assert sorted(os.listdir(out)) == ['checkpoint', 'saved_model']


# export: a model beside other state; a damaged Orbax checkpoint
# ------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def user_steps(tmp_path_factory):
  """A CheckpointManager folder of a training state: `user_model` under
  model/, a copy of it under ema/, and its optimizer under optimizer/."""
  import jax
  import optax

  import flax_dtensor as fdt

  steps = tmp_path_factory.mktemp('user_steps') / 'steps'
  mesh = jax.make_mesh((8,), ('data',))
  with (
    jax.set_mesh(mesh),
    fdt.logical_axis_rules(
      [('features', 'data'), ('hidden', None), ('classes', None)]
    ),
  ):
    model = user_model()
    state = nnx.Dict(
      model=model,
      ema=user_model(),
      optimizer=nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param),
    )
  manager = fdt_tf.CheckpointManager(steps)
  manager.save(1, state)
  manager.wait()
  manager.close()
  return steps


def _export_steps(steps, out, *args, target=USER_TARGET):
  rules = out.parent / 'rules.yaml'
  rules.write_text(USER_RULES)
  return run_cli(
    'export',
    target,
    '--checkpoint',
    steps,
    '--rules',
    rules,
    '--out',
    out,
    *args,
  )


def test_export_part_of_a_manager_step(user_steps, tmp_path):
  """--part model exports the model's variables of a training state's
  step, as saved; the other groups are left out."""
  stdout = ok(_export_steps(user_steps, tmp_path / 'out', '--part', 'model'))
  assert 'restored model/' in stdout and 'note:' not in stdout
  saved = fdt_tf.read_checkpoint(user_steps / '1')
  expected = {
    '/'.join(map(str, k[1:])): v for k, v in saved.items() if k[0] == 'model'
  }
  report = check_checkpoint(tmp_path / 'out' / 'checkpoint', expected)
  assert report['missing'] == [] and report['extra'] == []
  assert report['max_abs_diff'] == 0.0


@pytest.mark.parametrize(
  'args, target, fragments',
  [
    (
      [],
      USER_TARGET,
      [
        'holds the variables of the model under 2 groups: ema/, model/.',
        'Pass --part NAME to choose one (e.g. --part ema)',
      ],
    ),
    (
      ['--part', 'nope'],
      USER_TARGET,
      [
        '--part nope:',
        'holds no variable under nope/',
        'Its groups: ema/ (3 variables), model/ (3), optimizer/ (1).',
      ],
    ),
    (
      ['--part', 'model'],
      f'{THIS_FILE}:user_hidden_only',
      [
        "The part model/ of the checkpoint '",
        'holds 1 variable(s) the target does not have: out/kernel',
      ],
    ),
    (
      ['--part', '/'],
      USER_TARGET,
      ["Malformed --part '/'", 'e.g. model'],
    ),
    (
      [],
      f'{THIS_FILE}:user_model_with_head',
      [
        "and it lacks 5 of the target's variables: head/bias, head/kernel, "
        'hidden/bias, hidden/kernel, out/kernel.',
        'pass a TARGET that builds the model that was saved (the same '
        'configuration), or pass --part NAME for the group holding the '
        'model (it may be ema/ (3 variables), model/ (3)).',
      ],
    ),
  ],
  ids=[
    'two-groups-match',
    'no-such-part',
    'extra-in-part',
    'empty-part',
    'no-group-fits',
  ],
)
def test_export_part_refused(user_steps, tmp_path, args, target, fragments):
  bad_input(
    _export_steps(user_steps, tmp_path / 'out', *args, target=target),
    *fragments,
  )
  assert not (tmp_path / 'out').exists()


def test_export_part_allow_extra(user_steps, tmp_path):
  """--allow-extra: the part's variables the model lacks are ignored."""
  stdout = ok(
    _export_steps(
      user_steps,
      tmp_path / 'out',
      '--part',
      'model',
      '--allow-extra',
      target=f'{THIS_FILE}:user_hidden_only',
    )
  )
  assert 'restored model/' in stdout
  saved = {
    '/'.join(map(str, k)): v
    for k, v in fdt_tf.read_checkpoint(tmp_path / 'out' / 'checkpoint').items()
  }
  assert sorted(saved) == ['hidden/bias', 'hidden/kernel']
  np.testing.assert_array_equal(
    saved['hidden/kernel'],
    fdt_tf.read_checkpoint(user_steps / '1')['model/hidden/kernel'],
  )


def test_export_the_model_of_an_orbax_training_state(tmp_path):
  """An Orbax checkpoint of nnx.state of a model and its optimizer: the
  model's part is found by its paths, read alone, and exported as saved."""
  import jax
  import optax
  import orbax.checkpoint as ocp

  import flax_dtensor as fdt

  mesh = jax.make_mesh((8,), ('data',))
  with (
    jax.set_mesh(mesh),
    fdt.logical_axis_rules(
      [('features', 'data'), ('hidden', None), ('classes', None)]
    ),
  ):
    model = user_model()
    state = nnx.Dict(
      model=model,
      optimizer=nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param),
    )
  orbax = tmp_path / 'orbax'
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(orbax, nnx.state(state))
    checkpointer.wait_until_finished()
  out = tmp_path / 'out'
  stdout = ok(_export_steps(orbax, out))
  assert (
    f"note: '{orbax}' holds model/ (3 variables), optimizer/ (8); exporting "
    'model/'
  ) in ' '.join(stdout.split())
  expected = {
    '/'.join(map(str, k)): np.asarray(v.get_value())
    for k, v in nnx.to_flat_state(nnx.state(model))
  }
  report = check_checkpoint(out / 'checkpoint', expected)
  assert report['missing'] == [] and report['extra'] == []
  assert report['max_abs_diff'] == 0.0


def _flip(path, offset, count=10):
  data = bytearray(path.read_bytes())
  offset = offset if offset >= 0 else len(data) + offset
  for i in range(offset, offset + count):
    data[i] ^= 0xFF
  path.write_bytes(bytes(data))


def _largest_data_file(orbax):
  return max(
    (orbax / 'ocdbt.process_0' / 'd').iterdir(), key=lambda p: p.stat().st_size
  )


UNVERIFIED = (
  "note: Orbax checkpoints carry no checksum of their arrays' bytes: "
  "TensorStore checked the OCDBT manifest's and tree nodes' CRC-32C and "
  "each chunk's framing as it read them, but damage inside the values "
  'cannot be detected. Steps of flax_dtensor.dtensor.CheckpointManager '
  'carry a CRC-32 of every byte.'
)


def test_export_says_orbax_values_are_unverified(demo_export, tmp_path):
  """10 bytes flipped inside a stored array (offset 2000 of the largest
  data file): Orbax's format has no checksum that covers them, so the
  export reads them as they are and says, before writing, that they could
  not be checked; the exported values are the damaged ones."""
  tmp, _, expected, _ = demo_export
  orbax = tmp_path / 'orbax'
  shutil.copytree(tmp / 'orbax', orbax)
  _flip(_largest_data_file(orbax), 2000)
  out = tmp_path / 'out'
  stdout = ok(
    run_cli('export', DEMO_TARGET, '--checkpoint', orbax, '--out', out)
  )
  assert UNVERIFIED in ' '.join(stdout.split())
  saved = {
    '/'.join(map(str, k)): v
    for k, v in fdt_tf.read_checkpoint(out / 'checkpoint').items()
  }
  assert sorted(saved) == sorted(k for k in expected if '__' not in k)
  wrong = sum(int((saved[k] != expected[k]).sum()) for k in saved)
  assert wrong > 0  # What the format cannot detect, exported as read.


@pytest.mark.parametrize(
  'damage, fragments',
  [
    (
      lambda orbax: _flip(orbax / 'manifest.ocdbt', -1, 1),
      ['Error decoding manifest: CRC-32C checksum verification failed'],
    ),
    (
      lambda orbax: _flip(
        max((orbax / 'd').iterdir(), key=lambda p: p.stat().st_size), -1, 1
      ),
      ['Error decoding b-tree node: CRC-32C checksum verification failed'],
    ),
  ],
  ids=['manifest-crc', 'tree-node-crc'],
)
# Orbax's restore leaves coroutines behind when TensorStore fails; they
# complain when collected ("Event loop is closed"), which is not ours.
@pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')
def test_export_refuses_damage_orbax_detects(
  user_checkpoint, tmp_path, damage, fragments
):
  """What the format checks (CRC-32C of OCDBT's manifest and tree nodes)
  is checked before anything is written: exit 2, in our words."""
  orbax = tmp_path / 'orbax'
  shutil.copytree(user_checkpoint[0], orbax)
  damage(orbax)
  rules = tmp_path / 'rules.yaml'
  rules.write_text(USER_RULES)
  out = tmp_path / 'out'
  proc = run_cli(
    'export',
    USER_TARGET,
    '--checkpoint',
    orbax,
    '--rules',
    rules,
    '--out',
    out,
  )
  bad_input(
    proc,
    f'The Orbax checkpoint {str(orbax)!r} is damaged',
    *fragments,
    'Nothing was written. Export from an intact copy',
  )
  assert not out.exists()


# An LLM in another library's style: a None cache, polymorphic lengths
# ------------------------------------------------------------------------------

LM_SHAPES = (
  '--input-shape',
  'tokens:1,t:int32',
  '--input-shape',
  'positions:1,t:int32',
  '--input-shape',
  'cache:none',
  '--input-shape',
  'mask:1,t,t:bool',
)


@pytest.fixture(scope='module')
def lm_checkpoint(tmp_path_factory):
  """An Orbax checkpoint of the user's LLM, its rules, and its logits on
  batches of two sequence lengths (`{tokens,positions,mask,logits}_LEN`)."""
  import jax
  import orbax.checkpoint as ocp

  import flax_dtensor as fdt

  tmp = tmp_path_factory.mktemp('lm')
  mesh = jax.make_mesh(
    (8,), ('data',), axis_types=(jax.sharding.AxisType.Auto,)
  )
  with (
    jax.set_mesh(mesh),
    fdt.logical_axis_rules(
      [('features', 'data'), ('hidden', None), ('classes', None)]
    ),
  ):
    model = _loading.load_target(LM_TARGET)()
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp / 'orbax', nnx.state(model))
    checkpointer.wait_until_finished()
  rng = np.random.default_rng(0)
  arrays = {}
  for batch, length in ((2, 8), (3, 5)):
    tokens = rng.integers(0, 64, (batch, length)).astype(np.int32)
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), tokens.shape)
    mask = np.broadcast_to(
      np.tril(np.ones((length, length), bool)), (batch, length, length)
    )
    logits, cache = model(tokens, positions, None, mask)
    assert cache is None
    for k, v in (
      ('tokens', tokens),
      ('positions', positions),
      ('mask', mask),
      ('logits', logits),
    ):
      arrays[f'{k}_{length}'] = np.asarray(v)
  (tmp / 'rules.yaml').write_text(USER_RULES)
  return tmp, arrays


def _export_lm(tmp: pathlib.Path, out: pathlib.Path, *args: str):
  return run_cli(
    'export',
    LM_TARGET,
    '--checkpoint',
    tmp / 'orbax',
    '--rules',
    tmp / 'rules.yaml',
    '--out',
    out,
    '--saved-model',
    *args,
  )


def test_export_llm_style_saved_model(lm_checkpoint):
  """cache:none passes None; t is one length for every input."""
  import tensorflow as tf

  tmp, expected = lm_checkpoint
  proc = _export_lm(tmp, tmp / 'out', *LM_SHAPES)
  ok(proc)
  assert proc.stderr == ''
  served = tf.saved_model.load(str(tmp / 'out' / 'saved_model'))
  serve = served.signatures['serving_default']
  assert sorted(serve.structured_input_signature[1]) == [
    'mask',
    'positions',
    'tokens',
  ]
  for length in (8, 5):
    result = serve(
      **{
        k: tf.constant(expected[f'{k}_{length}'])
        for k in ('tokens', 'positions', 'mask')
      }
    )
    assert sorted(result) == ['output_0']
    np.testing.assert_allclose(
      result['output_0'].numpy(), expected[f'logits_{length}'], atol=1e-5
    )


@pytest.mark.parametrize(
  'args, fragments',
  [
    (
      [*LM_SHAPES[:4], *LM_SHAPES[6:]],  # No cache:none.
      [
        # Echoed as given, in save_saved_model's words.
        'Expected --input-shape to fit UserLM.__call__(tokens, positions, '
        'cache, attention_mask), which takes 4 positional arguments; got 3 '
        'entries: tokens:1,t:int32, positions:1,t:int32, mask:1,t,t:bool.',
        'NAME:none for an argument passed as None (e.g. --input-shape '
        'cache:none)',
      ],
    ),
    (
      [
        *('--input-shape', 'tokens:1,?:int32'),
        *('--input-shape', 'positions:1,?:int32'),
        *('--input-shape', 'cache:none'),
        *('--input-shape', 'mask:1,?,?:bool'),
      ],
      [
        'Tracing UserLM.__call__ for the SavedModel failed where its '
        'polymorphic dimensions meet',
        'Each ? dimension is a size of its own (to JAX: '
        'tokens:b,d0_1:int32, positions:b,d1_1:int32, mask:b,d3_1,d3_2:bool)',
        'e.g. --input-shape tokens:b,t:int32 --input-shape '
        'positions:b,t:int32 --input-shape cache:none --input-shape '
        'mask:b,t,t:bool if all are one length',
        '--input-shape mask:b,d1,d2:bool if those at the same position are',
      ],
    ),
    (
      [*LM_SHAPES, '--method', 'tagged'],
      [
        'Expected the result of UserLM.tagged to hold only arrays and None, '
        "got str at result[1]: 'v1'"
      ],
    ),
    (
      [*LM_SHAPES[:-1], 'mask:1,max,t:bool'],
      [
        'Malformed --input-shape mask:1,max,t:bool: JAX cannot read its '
        'dimensions (b, max, t)'
      ],
    ),
  ],
  ids=['no-cache', 'lengths-of-their-own', 'not-an-array', 'jax-name'],
)
def test_export_llm_style_bad_inputs(lm_checkpoint, args, fragments):
  tmp, _ = lm_checkpoint
  out = tmp / 'bad'
  bad_input(_export_lm(tmp, out, *args), *fragments)
  assert not out.exists()


def _lm_signature(*, cache=True, extra=False, lengths='t'):
  """The Python `input_signature` that LM_SHAPES-like flags give."""
  import tensorflow as tf

  own = lengths == '?'
  signature = [
    tf.TensorSpec([None, None], tf.int32, name='tokens'),
    tf.TensorSpec([None, None], tf.int32, name='positions'),
    *([None] if cache else []),
    tf.TensorSpec([None, None, None], tf.bool, name='mask'),
    *([None] if extra else []),
  ]
  polymorphic = None if own else ['(b, t)', '(b, t)', None, '(b, t, t)']
  return signature, polymorphic


# The same bad input, as flags and as `input_signature`: (the flags, the
# keywords of `save_saved_model`, the words both say).
SAID_ALIKE = {
  'arity': (
    [*LM_SHAPES[:4], *LM_SHAPES[6:]],
    dict(cache=False),
    r'to fit UserLM\.__call__\(tokens, positions, cache, attention_mask\), '
    r'which takes 4 positional arguments; got 3 entries: ',
  ),
  'slot': (
    [*LM_SHAPES, '--input-shape', 'extra:none'],
    dict(extra=True),
    r'to fit UserLM\.__call__\(tokens, positions, cache, attention_mask\), '
    r'which takes 4 positional arguments; got 5 entries: ',
  ),
  'own-symbol': (
    [
      *('--input-shape', 'tokens:1,?:int32'),
      *('--input-shape', 'positions:1,?:int32'),
      *('--input-shape', 'cache:none'),
      *('--input-shape', 'mask:1,?,?:bool'),
    ],
    dict(lengths='?'),
    r'^(error: )?Tracing UserLM\.__call__ for the SavedModel failed where '
    r'its polymorphic dimensions meet \(.+\)\. .*a size of its own.*which '
    r'JAX cannot know to equal another.* e\.g\. .* if all are one length '
    r'\(e\.g\. a sequence length\), or .* if those at the same position '
    r'are\.$',
  ),
}


@pytest.mark.parametrize('check', list(SAID_ALIKE), ids=list(SAID_ALIKE))
def test_served_inputs_are_refused_in_save_saved_model_s_words(
  lm_checkpoint, tmp_path, check
):
  """One check of the served inputs (dtensor._serving): `flax-dtensor
  export` and `fdt_tf.save_saved_model` refuse the same bad input with
  the same message, each naming the inputs its own way."""
  import jax

  import flax_dtensor as fdt

  flags, keywords, said = SAID_ALIKE[check]
  tmp, _ = lm_checkpoint
  line = bad_input(_export_lm(tmp, tmp_path / 'cli', *flags))
  assert re.search(said, line), line
  mesh = jax.make_mesh(
    (8,), ('data',), axis_types=(jax.sharding.AxisType.Auto,)
  )
  rules = [('features', 'data'), ('hidden', None), ('classes', None)]
  with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
    model = user_lm()
    signature, polymorphic = _lm_signature(**keywords)
    with pytest.raises(fdt.ExportError, match=said):
      fdt_tf.save_saved_model(
        model,
        tmp_path / 'python',
        input_signature=signature,
        polymorphic_shapes=polymorphic,
      )
  assert not (tmp_path / 'python').exists()
  assert not (tmp_path / 'cli').exists()


def test_a_forward_for_explicit_axes_on_auto_ones_is_refused_alike(tmp_path):
  """The Auto-axes check of the served inputs: `flax-dtensor export` on
  the default Auto axes and `fdt_tf.save_saved_model` of the model on an
  Auto mesh say the same, each with its own fix."""
  import jax
  import orbax.checkpoint as ocp
  import tensorflow as tf

  import flax_dtensor as fdt

  said = (
    r'ExplicitNet\.__call__ is written for Explicit mesh axes \(it says '
    r'where results go, with out_sharding= or jax\.sharding\.reshard\), but '
    r"the mesh's axes are Auto: JAX refuses it \(.+\)\. "
  )
  (tmp_path / 'explicit_net.py').write_text(EXPLICIT_NET)
  (tmp_path / 'rules.yaml').write_text(
    'logical_axis_rules:\n  - [embed, null]\n  - [mlp, model]\n'
  )
  namespace: dict = {}
  exec(compile(EXPLICIT_NET, 'explicit_net.py', 'exec'), namespace)
  with nnx.use_eager_sharding(False):
    model = namespace['make']()
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / 'orbax', nnx.state(model))
    checkpointer.wait_until_finished()
  line = bad_input(
    run_cli(
      'export',
      f'{tmp_path / "explicit_net.py"}:make',
      *('--checkpoint', tmp_path / 'orbax', '--out', tmp_path / 'cli'),
      *('--rules', tmp_path / 'rules.yaml'),
      *('--saved-model', '--input-shape', 'x:1,16:float32'),
    ),
    'Pass --axis-types explicit',
  )
  assert re.search(said, line), line
  mesh = jax.make_mesh(
    (2, 4), ('data', 'model'), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  with (
    jax.set_mesh(mesh),
    fdt.logical_axis_rules([('embed', None), ('mlp', 'model')]),
  ):
    model = namespace['make']()
    with pytest.raises(
      fdt.ExportError, match=said + r'Place the model on a mesh of Explicit'
    ):
      fdt_tf.save_saved_model(
        model,
        tmp_path / 'python',
        input_signature=[tf.TensorSpec([None, 16], tf.float32, name='x')],
      )
  assert not (tmp_path / 'python').exists()


@pytest.fixture(scope='module')
def fused_export(tmp_path_factory):
  """A DTensor checkpoint with a fused axis, a single-device array and a
  float16 array (stored widened)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  out = tmp_path_factory.mktemp('fused')
  mesh = jax.make_mesh((2, 4), ('data', 'model'))

  def put(shape, sharding, dtype=jnp.float32):
    return nnx.Param(jax.device_put(jnp.ones(shape, dtype), sharding))

  state = nnx.Dict(
    fused=put((16, 4), NamedSharding(mesh, P(('data', 'model'), None))),
    single=put((3,), jax.devices()[2]),
    half=put((8, 4), NamedSharding(mesh, P('data', 'model')), jnp.float16),
  )
  fdt_tf.save_checkpoint(state, out / 'checkpoint')
  return out


def test_inspect_shows_fused_dtensor_axes(fused_export):
  wide = {'COLUMNS': '200'}  # One line per row, to parse.
  stdout = ok(run_cli('inspect', fused_export, env=wide))
  rows = {}
  for line in stdout.splitlines():
    cells = re.split(r'\s{2,}', line.strip())
    if cells and cells[0] in ('fused', 'single', 'half'):
      rows[cells[0]] = cells[1:]
  # The meshes most rows are on, once above the table.
  assert 'JAX mesh data=2,model=4 (others in their rows)' in stdout
  assert 'Every variable is a Param.' in stdout
  assert rows['fused'] == [
    '(16, 4)',
    'float32',
    "P(('data', 'model'), None)",
    # The real DTensor mesh: one axis fusing both JAX axes.
    'data+model,unsharded @ data+model=8',
  ]
  assert rows['single'][2:] == ['one device', 'unsharded @ single_device=1']
  assert rows['half'][1] == 'float16 (stored as float32)'
  assert rows['half'][3] == 'data,model @ data=2,model=4'
  assert '3 variables' in stdout


def test_inspect_at_80_columns_wraps_and_cuts_nothing(fused_export):
  narrow = {'COLUMNS': '80'}
  stdout = ok(run_cli('inspect', fused_export, env=narrow))
  assert_fits(stdout, 80, [str(fused_export / 'checkpoint')])
  # The table does not fit: each variable on a few whole lines.
  lines = stdout.splitlines()
  at = lines.index('fused')
  assert lines[at + 1 : at + 4] == [
    '  (16, 4)  float32',
    "  JAX      P(('data', 'model'), None)",
    '  DTensor  data+model,unsharded @ data+model=8',
  ]
  assert '  DTensor  data,model @ data=2,model=4' in lines
  assert '  (8, 4)  float16 (stored as float32)' in lines


def test_inspect_of_an_earlier_manifest_reads_signatures_with_tf(
  demo_export, tmp_path
):
  """A SavedModel whose manifest predates recorded signatures."""
  _, out, _, proc = demo_export
  ok(proc)
  shutil.copytree(out / 'saved_model', tmp_path / 'saved_model')
  manifest = tmp_path / 'saved_model' / 'assets' / 'flax_dtensor.json'
  data = json.loads(manifest.read_text())
  del data['signatures']
  manifest.write_text(json.dumps(data))
  stdout = ok(run_cli('inspect', tmp_path))
  assert 'tokens: [None, 128] int32' in stdout  # From TensorFlow.
  assert '24 variables' in stdout  # From the manifest.


def test_inspect_without_a_manifest_reads_with_tensorflow(
  fused_export, tmp_path
):
  """A checkpoint written by plain TF: names, shapes and stored dtypes.

  In a process of its own (`python -m flax_dtensor`): TensorFlow is first
  imported, runs and exits there, and nothing it prints reaches stderr.
  """
  shutil.copytree(fused_export / 'checkpoint', tmp_path / 'checkpoint')
  (tmp_path / 'checkpoint' / 'flax_dtensor.json').unlink()
  proc = run_cli_process('inspect', tmp_path)
  stdout = ok(proc)
  assert proc.stderr == ''
  rows = {}
  for line in stdout.splitlines():
    cells = re.split(r'\s{2,}', line.strip())
    if cells and cells[0] in ('fused', 'single', 'half'):
      rows[cells[0]] = cells[1:]
  assert rows['fused'] == ['-', '(16, 4)', 'float32', '-', '-']
  assert rows['half'] == ['-', '(8, 4)', 'float32', '-', '-']  # As stored.
  assert 'No flax_dtensor.json: no layouts; read with TensorFlow.' in stdout


def test_inspect_without_a_manifest_never_loads_the_saved_model(
  demo_export, tmp_path, monkeypatch
):
  """Signatures from saved_model.pb, variables from the checkpoint index.

  TensorFlow's SavedModel loader is a tripwire while `inspect` runs:
  loading would run the SavedModel's graphs.
  """
  import tensorflow as tf

  loads = []
  monkeypatch.setattr(
    tf.saved_model, 'load', lambda *a, **k: loads.append(a) or 1 / 0
  )
  _, out, _, proc = demo_export
  ok(proc)
  saved = tmp_path / 'saved_model'
  shutil.copytree(out / 'saved_model', saved)
  (saved / 'assets' / 'flax_dtensor.json').unlink()
  proc = run_cli('inspect', saved)
  text = ok(proc)
  assert loads == []
  assert 'tokens: [None, 128] int32' in text
  assert 'output_0: [None, 128, 256] float32' in text
  assert '24 variables. No assets/flax_dtensor.json: no layouts.' in text
  # Every variable the manifest listed, with its shape as TF stores it.
  manifest = json.loads(
    (out / 'saved_model' / 'assets' / 'flax_dtensor.json').read_text()
  )
  for record in manifest['variables']:
    name = '/'.join(map(str, record['path']))
    shape = str(tuple(record['shape']))
    assert any(name in line and shape in line for line in text.splitlines()), (
      name,
      shape,
    )

  # A saved_model.pb that is not one: our error, exit 2, still never loaded.
  (saved / 'saved_model.pb').write_bytes(b'\x0a\xff\xff not a protobuf')
  proc = run_cli('inspect', saved)
  assert proc.returncode == 2, proc.stderr
  assert loads == []
  assert re.search(
    r"TensorFlow cannot parse the SavedModel in '.*saved_model': .*\. "
    r'Expected saved_model\.pb with one MetaGraph\. Pass a directory '
    r'written by `save_saved_model`, `flax-dtensor export --saved-model`',
    ' '.join(proc.stderr.split()),
  ), proc.stderr
  # An empty one parses as a SavedModel of no MetaGraph: named as such.
  (saved / 'saved_model.pb').write_bytes(b'')
  proc = run_cli('inspect', saved)
  assert proc.returncode == 2, proc.stderr
  assert re.search(
    r"cannot parse the SavedModel in '.*saved_model': saved_model\.pb "
    r'holds 0 MetaGraphs, not one\. Expected',
    ' '.join(proc.stderr.split()),
  ), proc.stderr


@pytest.mark.parametrize(
  'text',
  [
    '{not json',
    '{"variables": [1]}',
    '{"variables": {"fused": 3}}',
    '{"format": "flax_dtensor.saved_model", "version": 3, "variables": [], '
    '"checkpoint_prefix": "x", "files": {}, "signatures": {"s": 5}}',
  ],
  ids=['json', 'list', 'record', 'signature'],
)
def test_inspect_malformed_metadata(fused_export, tmp_path, text):
  shutil.copytree(fused_export / 'checkpoint', tmp_path / 'checkpoint')
  (tmp_path / 'checkpoint' / 'flax_dtensor.json').write_text(text)
  bad_input(
    run_cli('inspect', tmp_path),
    'flax_dtensor.json',
    'is not a valid flax_dtensor manifest',
    'Re-export the checkpoint',
  )


# demo
# ------------------------------------------------------------------------------


def test_demo_trains_exports_and_verifies(tmp_path):
  """The demo end to end, as a user runs it, under the rules that `plan
  --suggest` proposes for it: the suggestion -> training round trip
  (`plan ... --suggest --budget 300KiB --write sug.yaml && demo --rules
  sug.yaml`). The forward's 'batch', traced on the demo's own inputs, has
  rules; without them the demo stopped at it.

  It saves its steps every 10; run again with `--resume` after its last
  step is lost (as a run killed after step 10 left it), it trains steps
  11 to 20 again into equal values, bit for bit.

  Slow: it trains 20 steps (and 10 again), exports a checkpoint and a
  SavedModel, and serves it in the TensorFlow-only process the demo itself
  starts (twice).
  """
  suggested = tmp_path / 'sug.yaml'
  said = ok(
    run_cli(
      'plan',
      DEMO_TARGET,
      '--suggest',
      '--budget',
      '300KiB',
      '--write',
      suggested,
    )
  )
  said = ' '.join(said.split())
  assert '(traced on int32[16,128])' in said
  assert "'batch' -> 'data', None" in said
  assert 'per device fits the budget of 300.0 KiB' in said
  assert _loading.load_rules(str(suggested)).candidates('batch') == (
    'data',
    None,
  )
  out = tmp_path / 'demo'
  narrow = {'COLUMNS': '80'}  # Piped, as in a CI log.
  stdout = ok(run_cli(*_demo_args(suggested, out), env=narrow))
  # Piped: plain progress lines, nothing animated; 80 columns, no line
  # ending in spaces, paths whole or broken after a '/'.
  assert_fits(stdout, 80, [out / 'saved_model', out / 'summary.json'])
  assert stdout.startswith(
    'flax-dtensor demo on 8 devices (cpu), mesh data=2,model=4\n'
    '20 steps of 16 sequences, seed 0\n'
  )
  steps = re.findall(r'^train step (\d+)/20  loss \d\.\d{3}  ', stdout, re.M)
  assert steps[0] == '1' and steps[-1] == '20', stdout
  # The writes and the verification (~12 s) each say so as they start.
  phases = [
    'write Orbax checkpoint…',
    'write DTensor checkpoint…',
    'write SavedModel…',
    'verify in TF-only subprocess…',
  ]
  lines = stdout.splitlines()
  trained = max(
    i for i, x in enumerate(lines) if x.startswith('train step 20/')
  )
  at = [lines.index(p) for p in phases]
  assert trained < at[0] and at == sorted(at), stdout
  summary = json.loads((out / 'summary.json').read_text())
  assert summary['steps'] == 20 and len(summary['losses']) == 20
  assert summary['loss_first'] > 5.0  # ~ln(256): uniform over bytes.
  assert summary['loss_last'] < summary['loss_first'] - 2.0
  assert summary['max_abs_logits_diff'] < 1e-3
  assert not summary['tf_subprocess']['jax_imported']
  for name in ('orbax', 'checkpoint', 'saved_model'):
    assert (out / name).is_dir()
    assert summary['bytes'][name] > 1_000_000
  for text in ('Sharding plan', 'Files written', 'Timings', 'Results'):
    assert text in stdout
  copied = (out / 'rules.yaml').read_text()
  assert copied.startswith(suggested.read_text())
  assert copied.startswith('# Rules proposed by flax_dtensor.suggest_rules')
  _exports_the_model_of_its_steps(out, suggested)
  _resumes_into_equal_values(out, suggested, summary)


def _demo_args(rules, out):
  """The demo test's run: 20 steps under `rules`, saving every 10."""
  return (
    'demo',
    '--rules',
    rules,
    '--steps',
    '20',
    '--save-every',
    '10',
    '--out',
    out,
  )


def _resumes_into_equal_values(out, rules, summary):
  """The demo's steps: 10 and 20, each a whole TF checkpoint; step 20
  damaged, `--resume` goes on from step 10, the step restored, and trains
  11 to 20 again into the same bits."""
  from flax_dtensor.dtensor._storage import _steps

  steps_dir = out.parent / 'demo-steps'
  assert summary['steps_dir'] == str(steps_dir)
  assert summary['saved_steps'] == [10, 20] and summary['resumed_from'] is None
  assert _steps.whole_steps(str(steps_dir)) == [10, 20]
  # TensorFlow's own state file names the latest whole step.
  state = (steps_dir / 'checkpoint').read_text()
  assert state.splitlines()[0] == 'model_checkpoint_path: "20/ckpt"'
  before = _checkpoint_bytes(steps_dir / '20')
  data = sorted((steps_dir / '20').glob('ckpt.data-*'))[0]
  damaged = bytearray(data.read_bytes())
  damaged[0] ^= 0xFF
  data.write_bytes(bytes(damaged))
  stdout = ok(run_cli(*_demo_args(rules, out), '--resume', '-q'))
  assert (
    f'resumed from step 10 of 20 ({steps_dir}); passed over the damaged '
    'step 20 (moved aside, as 20.damaged, by the next save)'
  ) in ' '.join(stdout.split())
  # Kept aside for a look, as it was.
  assert (steps_dir / '20.damaged' / data.name).read_bytes() == damaged
  again = json.loads((out / 'summary.json').read_text())
  assert again['resumed_from'] == 10 and again['saved_steps'] == [10, 20]
  assert again['losses'] == summary['losses'][10:]
  assert _checkpoint_bytes(steps_dir / '20') == before


def _exports_the_model_of_its_steps(out, rules):
  """`export --checkpoint` on the demo's own steps folder: its latest step
  holds the model under model/ beside optimizer/; export finds the model's
  part by its paths, says so, and writes the values of that step."""
  steps_dir = out.parent / 'demo-steps'
  exported = out.parent / 'exported'
  stdout = ok(
    run_cli(
      'export',
      DEMO_TARGET,
      '--checkpoint',
      steps_dir,
      '--rules',
      rules,
      '--out',
      exported,
    )
  )
  assert (
    f"note: '{steps_dir / '20'}' holds model/ (24 variables), optimizer/ "
    f"(51); exporting model/, which holds {DEMO_TARGET}'s variables "
    '(--part chooses another).'
  ) in ' '.join(stdout.split())
  step = fdt_tf.read_checkpoint(steps_dir / '20')
  expected = {
    '/'.join(map(str, k[1:])): v for k, v in step.items() if k[0] == 'model'
  }
  report = check_checkpoint(exported / 'checkpoint', expected)
  assert report['missing'] == [] and report['extra'] == []
  assert report['max_abs_diff'] == 0.0  # Bit-exact: step 20's model.


def _checkpoint_bytes(step_dir):
  """Each tensor of a step's TF checkpoint, by name, as bytes (read by
  plain TensorFlow, its manifest checked)."""
  return {
    name: np.asarray(value).tobytes()
    for name, value in fdt_tf.read_checkpoint(step_dir).items()
  }


@pytest.mark.parametrize(
  'make, args, fragments',
  [
    (
      lambda d: d.mkdir(),
      ['--resume'],
      ['--resume', 'holds no whole step to go on from'],
    ),
    (
      lambda d: d.write_text('x'),
      [],
      ['--steps-dir', 'is a file; expected a folder of training steps'],
    ),
  ],
  ids=['resume-with-no-step', 'steps-dir-a-file'],
)
def test_demo_refuses_steps_it_cannot_use(tmp_path, make, args, fragments):
  steps_dir = tmp_path / 'steps'
  make(steps_dir)
  proc = run_cli(
    'demo', '--out', tmp_path / 'out', '--steps-dir', steps_dir, *args
  )
  bad_input(proc, *fragments)
  assert not (tmp_path / 'out').exists()


@pytest.mark.parametrize(
  'args, fragments',
  [
    (['plan'], ["Missing argument 'TARGET'", "'flax-dtensor plan --help'"]),
    (['plan', DEMO_TARGET, '--bogus'], ['No such option: --bogus']),
    (['nope'], ["No such command 'nope'", "'flax-dtensor --help'"]),
    (
      ['inpsect'],
      [
        "No such command 'inpsect'. Did you mean 'inspect'? Run "
        "'flax-dtensor --help' for the usage."
      ],
    ),
  ],
  ids=[
    'missing-argument',
    'unknown-option',
    'unknown-command',
    'unknown-command-close-to-one',
  ],
)
def test_usage_errors_in_the_same_style(args, fragments):
  """Click's usage errors: one `error:` line and exit 2, no boxes."""
  proc = run_cli(*args)
  bad_input(proc, *fragments)
  assert '╭' not in proc.stderr and '│' not in proc.stderr


def test_no_arguments_shows_the_help():
  out = ok(run_cli())
  assert 'Usage: flax-dtensor' in out
  for command in ('demo', 'plan', 'export', 'inspect'):
    assert command in out


# Answering at once: no JAX, Flax or TensorFlow for help and metadata
# ------------------------------------------------------------------------------

# Runs the CLI's `main` in a fresh process for each argv (after `setup`);
# prints [[exit status, stdout] per argv, `report` evaluated at the end].
IN_PROCESS = """
import contextlib, io, json, os, sys
SETUP
from flax_dtensor.cli import _app
results = []
for argv in json.loads(sys.argv[1]):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    try:
      _app.main(argv)
    except SystemExit as e:
      results.append([e.code, out.getvalue()])
print(json.dumps([results, REPORT]))
"""

# JAX, Flax, NumPy and TensorFlow made unimportable: any import of them fails.
NO_HEAVY_LIBRARIES = """
for name in ('jax', 'flax', 'numpy', 'tensorflow', 'optax', 'orbax'):
  sys.modules[name] = None
"""


def _cli_in_process(*argvs, setup='', report='None'):
  """([(exit status, stdout)] per argv, the value of `report`)."""
  script = IN_PROCESS.replace('SETUP', setup).replace('REPORT', report)
  out = run_python(script, json.dumps(argvs))
  results, reported = json.loads(out.splitlines()[-1])
  return [tuple(r) for r in results], reported


def _without_heavy_libraries(*argvs):
  return _cli_in_process(*argvs, setup=NO_HEAVY_LIBRARIES)[0]


def test_help_and_version_need_no_jax_and_show_no_placeholders():
  commands = ['demo', 'plan', 'export', 'inspect']
  argvs = [['--help'], ['--version'], *([c, '--help'] for c in commands)]
  results = _without_heavy_libraries(*argvs)
  for argv, (code, text) in zip(argvs, results, strict=True):
    assert code == 0, (argv, text)
    assert_fits(text, 80)
    for placeholder in ('<bool>', '<str>', '<int>', '<path>', '{', '}'):
      assert placeholder not in text, (argv, placeholder, text)
  (_, version), (_, plan_help) = results[1], results[3]
  assert version.startswith('flax-dtensor 0.1.0\nPython 3.')
  for name in (
    'jax',
    'flax',
  ):  # The versions installed here, whatever they are.
    assert f'\n{name} {importlib.metadata.version(name)}\n' in version
  assert plan_help.startswith('Usage: flax-dtensor plan [OPTIONS] TARGET\n')
  assert '  --json ' in plan_help and '--mesh NAME=SIZE,...' in plan_help


def test_inspect_reads_the_manifest_without_jax_or_tensorflow(demo_export):
  _, out, _, proc = demo_export
  ok(proc)
  ((code, text),) = _without_heavy_libraries(['inspect', str(out)])
  assert code == 0, text
  assert '24 variables' in text and 'serving_default' in text
  # What TensorFlow itself reads from the SavedModel: the same signature.
  assert 'tokens: [None, 128] int32' in text
  assert 'output_0: [None, 128, 256] float32' in text


def _damaged_copies(out, tmp):
  """Copies of the demo export, each broken in one way; name -> directory."""
  copies = {}

  def copy(name):
    copies[name] = tmp / name
    shutil.copytree(out, copies[name], symlinks=True)
    return copies[name]

  copy('intact')
  ckpt = copy('flipped') / 'checkpoint'
  data = sorted(ckpt.glob('ckpt.data-*'))[0]
  raw = bytearray(data.read_bytes())
  raw[100] ^= 0xFF
  data.write_bytes(bytes(raw))
  ckpt = copy('unlisted') / 'checkpoint'
  (ckpt / 'ckpt.data-00000-of-00002').write_bytes(b'x')
  ckpt = copy('linked') / 'checkpoint'
  (ckpt / 'ckpt.index').unlink()
  (ckpt / 'ckpt.index').symlink_to(out / 'checkpoint' / 'ckpt.index')
  assets = copy('deep') / 'saved_model' / 'assets' / 'flax_dtensor.json'
  assets.write_text('[' * 100_000 + ']' * 100_000)
  ckpt = copy('downgraded') / 'checkpoint'
  meta = json.loads((ckpt / 'flax_dtensor.json').read_text())
  meta['version'] = 2
  (ckpt / 'flax_dtensor.json').write_text(json.dumps(meta))
  ckpt = copy('escaping') / 'checkpoint'
  meta = json.loads((ckpt / 'flax_dtensor.json').read_text())
  meta['checkpoint_prefix'] = '../../intact/checkpoint/ckpt'
  (ckpt / 'flax_dtensor.json').write_text(json.dumps(meta))
  (copy('unmanifested') / 'checkpoint' / 'flax_dtensor.json').unlink()
  return copies


def test_inspect_verify_exit_statuses_without_jax_or_tensorflow(
  demo_export, tmp_path
):
  """0 intact, 1 damaged (each problem listed), 2 malformed; no JAX, no TF."""
  _, out, _, proc = demo_export
  ok(proc)
  copies = _damaged_copies(out, tmp_path)
  argvs = [['inspect', '--verify', str(d)] for d in copies.values()]
  results, heavy = _cli_in_process(
    *argvs,
    report="[m for m in ('jax', 'tensorflow', 'numpy') if m in sys.modules]",
  )
  assert heavy == []
  got = dict(zip(copies, results, strict=True))
  code, text = got['intact']
  assert code == 0, text
  assert text.count('\nintact: ') == 2
  assert 'intact: 3 files, 1.8 MiB, checked against flax_dtensor.json' in text
  assert '12 files, 1.9 MiB, checked against assets/flax_dtensor.json' in text
  code, text = got['flipped']
  assert code == 1, text
  assert re.search(
    r'- ckpt\.data-00000-of-00001 bytes 0\.\.\d+ changed \(CRC-32 [0-9a-f]{8}, '
    r'recorded [0-9a-f]{8}\)',
    ' '.join(text.split()),
  ), text
  assert '\ndamaged: 1 problem\n' in text and '\nintact: ' in text
  code, text = got['unlisted']
  assert code == 1, text
  assert (
    '- ckpt.data-00000-of-00002 is on disk but not in the manifest'
    in ' '.join(text.split())
  )
  code, text = got['linked']
  assert code == 1, text
  assert re.search(
    r"- ckpt\.index is refused: it resolves to '.*/out/checkpoint/ckpt\.index', "
    r'outside the export \(a symbolic link\)',
    output_util.unwrapped(text),
  ), text
  for name in ('deep', 'downgraded', 'escaping', 'unmanifested'):
    code, text = got[name]
    assert code == 2, (name, text)
  # The messages, from the command line itself; without --verify too.
  bad_input(
    run_cli('inspect', copies['deep']),
    'is not a valid flax_dtensor manifest: it nests deeper than Python parses',
  )
  bad_input(
    run_cli('inspect', '--verify', copies['downgraded']),
    'its version is 2; this flax_dtensor reads version',
    'version 2, without checksums, is not read',
  )


# One table of exit statuses (docs/cli.md), for every command
# ------------------------------------------------------------------------------


def _status_of(exception):
  """The exit status and `error:` line `handle_errors` makes of it."""
  err = io.StringIO()
  with contextlib.redirect_stderr(err), pytest.raises(typer.Exit) as exit_:
    with _command.handle_errors(debug=True):  # Nothing redirected.
      raise exception
  lines = [x for x in err.getvalue().splitlines() if x.startswith('error: ')]
  return exit_.value.exit_code, lines[-1] if lines else ''


def test_exit_statuses_by_kind_of_failure():
  import flax_dtensor as fdt

  assert _status_of(_command.BadInputError('bad --mesh.')) == (
    2,
    'error: bad --mesh.',
  )
  code, line = _status_of(fdt.ExportError('The export is damaged.'))
  assert (code, line) == (2, 'error: The export is damaged.')
  code, line = _status_of(RuntimeError('an internal invariant broke'))
  assert code == 3
  assert line.startswith('error: unexpected failure: an internal invariant ')
  assert 'please report it with the output of the same command run with ' in (
    line
  )
  assert '`flax-dtensor --version`' in line
  assert 'RuntimeError' not in line  # The class is in --debug's traceback.
  assert _status_of(KeyboardInterrupt())[0] == 130


def test_demo_without_tensorflow_names_the_extra(warm_pool, tmp_path):
  """Where TensorFlow is not installed (a GPU machine's image): exit 2 and
  the extra to install, before any work; not a bug to report."""
  script = tmp_path / 'no_tf.py'
  script.write_text(
    'import sys\n'
    "sys.modules['tensorflow'] = None  # Not installed, to every import.\n"
    'from flax_dtensor.cli import main\n'
    "sys.argv = ['flax-dtensor', 'demo', '--steps', '1', '--out', sys.argv[1]]\n"
    'main()\n'
  )
  proc = warm_pool.run(script, str(tmp_path / 'out'))
  assert proc.returncode == 2, proc.stderr
  line = proc.stderr.splitlines()[-1]
  assert line.startswith(
    'error: flax_dtensor.dtensor needs TensorFlow, which could not be '
    'imported. Install it with: pip install "flax-dtensor[tf]"'
  ), line
  assert 'report' not in line, line
  assert not (tmp_path / 'out').exists()


def test_exit_statuses_of_every_command(demo_export, tmp_path):
  """0 ok, 1 findings or differences, 2 bad input: each command, for real."""
  _, out, _, proc = demo_export
  assert proc.returncode == 0  # export: ok.
  assert run_cli('inspect', out).returncode == 0
  assert run_cli('plan', DEMO_TARGET, '--summary').returncode == 0
  assert run_cli('plan', DEMO_TARGET, '--check').returncode == 1  # Findings.
  for args in (
    ['demo', '--mesh', 'data=-1'],
    ['demo', '--out', THIS_FILE / 'sub'],  # Under a file.
    ['plan', DEMO_TARGET, '--mesh', 'data=-1'],
    ['export', DEMO_TARGET, '--checkpoint', tmp_path, '--out', tmp_path],
    ['inspect', tmp_path],
    ['nope'],
  ):
    assert run_cli(*args).returncode == 2, args
