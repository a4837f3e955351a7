"""`flax-dtensor plan`: the table, its JSON, the views, `--suggest` and
`--check`, and its refusals. How the CLI tests run: tests/cli/conftest.py.
"""

from __future__ import annotations

import json
import pathlib
import textwrap

import pytest
from support import cli_models
from support.cli_helpers import (
  DEMO_TARGET,
  SUPPORT_DIR,
  assert_fits,
  bad_input,
  ok,
  run_cli,
)
from support.cli_models import USER_RULES, USER_TARGET

# TF DTensor on the suite's 8 devices, before any other TF operation.
pytestmark = pytest.mark.usefixtures('dtensor')


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


def _plan_with_user_rules(tmp_path, target, mesh):
  """The JSON plan of `target` on `mesh`, with USER_RULES as --rules."""
  rules = tmp_path / 'rules.yaml'
  rules.write_text(USER_RULES)
  return json.loads(
    ok(run_cli('plan', target, '--mesh', mesh, '--rules', rules, '--json'))
  )


def test_plan_user_factory_with_rules(tmp_path):
  result = _plan_with_user_rules(tmp_path, USER_TARGET, 'data=2,model=4')
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


def test_plan_user_factory_as_module(tmp_path):
  result = _plan_with_user_rules(
    tmp_path, 'support.cli_models:user_model', 'data=8'
  )
  variables = {v['path']: v for v in result['variables']}
  assert variables['hidden/kernel']['spec'] == ['data', None]
  assert result['num_devices'] == 8


def test_plan_allocates_nothing(tmp_path):
  result = _plan_with_user_rules(
    tmp_path, f'{cli_models.FILE}:huge_user_model', 'data=2,model=4'
  )
  (kernel,) = [v for v in result['variables'] if v['path'] == 'kernel']
  assert kernel['bytes'] == 100_000 * 100_000 * 4  # 40 GB, never allocated.
  assert kernel['spec'] == ['data', 'model']
  assert kernel['bytes_per_device'] == kernel['bytes'] // 8


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
      f'{pathlib.Path(cli_models.FILE).parents[2] / "README.md"}:make',
      ['README.md', 'is not a Python source file Python can import'],
    ),
    (
      f'{cli_models.FILE}:not_a_module',
      ["'not_a_module' to return", 'got int: 3'],
    ),
    (f'{cli_models.FILE}:a_string', ["'a_string' to return", "got str: 'str'"]),
    (
      f'{cli_models.FILE}:a_tuple',
      ["'a_tuple' to return", 'got tuple: (UserMLP'],
    ),
    (f'{cli_models.FILE}:USER_RULES', ['is a str, not a callable']),
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
