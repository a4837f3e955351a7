"""The command line says back what the user meant: typos in the rules, the
rules in effect, the optimizer planned, an export's mismatches.

The commands run in this process (typer's CliRunner): stdout is the
runner's, and our own messages (the ``error:`` line, notes) are read from
file descriptor 2 with ``capfd``.
"""

from __future__ import annotations

import json
import pathlib
import textwrap

import pytest
from typer.testing import CliRunner

from flax_dtensor.cli import _app
from flax_dtensor.demo import train

DEMO = 'flax_dtensor.demo.model:make_model'
DEMO_RULES = pathlib.Path(train.__file__).parent / 'rules.yaml'
TYPO_RULES = textwrap.dedent("""\
  logical_axis_rules:
    - ['batch', 'data']
    - ['length', null]
    - ['vocab', 'model']
    - ['heads', 'model']
    - ['mlp', 'model']
    - ['kv', null]
    - ['embed', 'dta']
    - ['embed', null]
    - ['norm', null]
  """)
TYPO_TEXT = (
  "('embed', 'dta') names mesh axis 'dta', which the mesh lacks (did you "
  "mean 'data'?)"
)


@pytest.fixture
def cli(capfd, monkeypatch):
  """Runs ``flax-dtensor ARGS``: (exit status, stdout, our stderr)."""
  monkeypatch.setenv('COLUMNS', '200')

  def run(*args):
    capfd.readouterr()
    result = CliRunner().invoke(_app.app, [str(a) for a in args])
    _, err = capfd.readouterr()
    return result.exit_code, result.stdout, err

  return run


@pytest.fixture
def typo_rules(tmp_path):
  path = tmp_path / 'rules.yaml'
  path.write_text(TYPO_RULES)
  return path


def test_plan_heads_with_a_typo_and_check_finds_it(cli, typo_rules):
  code, out, err = cli('plan', DEMO, '--rules', typo_rules)
  assert code == 0, err
  lines = out.splitlines()
  assert lines[0] == 'Sharding plan: mesh data=2, model=4 (8 devices)'
  assert lines[1] == f'Likely typo: {TYPO_TEXT}'
  # The typo replicated every 'embed': 2x the default rules' 260.0 KiB.
  assert lines[2].startswith('516.5 KiB per device of 1.8 MiB')
  assert 'Fallbacks: 1 likely typo, 17 variables' in out
  assert err == ''
  code, out, _ = cli('plan', DEMO, '--rules', typo_rules, '--check', '--json')
  assert code == 1
  findings = json.loads(out)['findings']
  (typo,) = [f for f in findings if f['code'] == 'mesh-axis-typo']
  assert typo['subject'] == "('embed', 'dta')"
  assert "Did you mean 'data'?" in typo['message']


def test_missing_mesh_axes_error_exits_2_with_one_line(cli, typo_rules):
  code, out, err = cli(
    'plan', DEMO, '--rules', typo_rules, '--missing-mesh-axes', 'error'
  )
  assert code == 2
  assert out == ''
  assert err == (
    "error: The rules name mesh axes the mesh lacks (mesh axes ['data', "
    "'model']), and they say missing_mesh_axes='error': "
    f'{TYPO_TEXT}. Fix the names, remove those rules, or let such rules '
    "fall back (missing_mesh_axes='fallback', the default).\n"
  )
  # The demo's rules: their 'fsdp' fallback is an error too, when asked.
  code, _, err = cli('plan', DEMO, '--missing-mesh-axes', 'error')
  assert code == 2
  assert "('embed', 'fsdp') names mesh axis 'fsdp'" in err
  assert 'did you mean' not in err
  # ... and not on a mesh that has every axis they name.
  code, out, _ = cli(
    'plan',
    DEMO,
    '--mesh',
    'fsdp=2,data=2,model=2',
    '--missing-mesh-axes',
    'error',
    '--summary',
  )
  assert code == 0
  code, _, err = cli('plan', DEMO, '--missing-mesh-axes', 'raise')
  assert code == 2
  assert err == (
    "error: --missing-mesh-axes expected one of fallback, error; got 'raise'. "
    'Pass --missing-mesh-axes error to make a rule naming a mesh axis the '
    'mesh lacks an error.\n'
  )


def test_the_rules_file_can_ask_for_errors(cli, tmp_path):
  path = tmp_path / 'strict_axes.yaml'
  path.write_text(TYPO_RULES + 'missing_mesh_axes: error\n')
  code, _, err = cli('plan', DEMO, '--rules', path)
  assert code == 2
  assert TYPO_TEXT in err
  code, out, _ = cli(
    'plan', DEMO, '--rules', path, '--missing-mesh-axes', 'fallback'
  )
  assert code == 0
  assert f'Likely typo: {TYPO_TEXT}' in out


def test_plan_says_when_the_demo_rules_apply(cli, tmp_path):
  code, out, err = cli('plan', DEMO, '--summary')
  assert code == 0
  assert err == ''
  lines = out.splitlines()
  assert lines[0] == (
    "note: no --rules given, so the demo's rules apply "
    '(flax_dtensor/demo/rules.yaml).'
  )
  assert lines[1] == 'Sharding plan: mesh data=2, model=4 (8 devices)'
  assert 'Likely typo' not in out
  model = tmp_path / 'my_model.py'
  model.write_text(
    textwrap.dedent("""\
      from flax import nnx

      def make():
        init = nnx.with_partitioning(
            nnx.initializers.ones, ('embed', 'mlp'))
        return nnx.Linear(64, 128, kernel_init=init, rngs=nnx.Rngs(0))
      """)
  )
  target = f'{model}:make'
  code, out, err = cli('plan', target, '--json')
  assert code == 0
  assert json.loads(out)['variables'][1]['spec'] == ['data', 'model']
  # With --json, the note goes to stderr: stdout stays JSON.
  assert err.startswith("note: no --rules given, so the demo's rules apply")
  assert f"For {target}'s own rules pass --rules RULES.yaml" in ' '.join(
    err.split()
  )
  code, out, err = cli('plan', target, '--rules', DEMO_RULES, '--json')
  assert code == 0
  assert 'note:' not in err


def test_plan_with_an_optimizer(cli):
  code, out, err = cli('plan', DEMO, '--optimizer', 'adamw', '--json')
  assert code == 0, err
  plan = json.loads(out)
  by_path = {v['path']: v for v in plan['variables']}
  kernel = by_path['layers/0/mlp/up/kernel']
  for moment in ('mu', 'nu'):
    state = by_path[f'optimizer/opt_state/0/{moment}/layers/0/mlp/up/kernel']
    assert state['spec'] == kernel['spec']
    assert state['bytes_per_device'] == kernel['bytes_per_device']
  params = sum(
    v['bytes_per_device']
    for v in plan['variables']
    if v['category'] == 'params'
  )
  optimizer = sum(
    v['bytes_per_device']
    for v in plan['variables']
    if v['category'] == 'optimizer'
  )
  # adamw: mu and nu like the params, and a step count per moment set.
  assert optimizer > 2 * params - 64
  assert optimizer <= 2 * params + 64
  code, out, err = cli('plan', DEMO, '--optimizer', 'adamww')
  assert code == 2
  assert err.startswith(
    "error: --optimizer 'adamww': optax has no such name. Pass --optimizer "
  )
  code, out, err = cli('plan', DEMO, '--optimizer', 'GradientTransformation')
  assert code == 2
  assert "--optimizer 'GradientTransformation'" in err


# export: a checkpoint that does not fit the model, in our words
# ------------------------------------------------------------------------------

NET = textwrap.dedent("""\
  from flax import nnx


  class Net(nnx.Module):
    def __init__(self, hidden=8, head=False):
      rngs = nnx.Rngs(0)
      self.up = nnx.Linear(4, hidden, rngs=rngs)
      self.down = nnx.Linear(hidden, 4, rngs=rngs)
      if head:
        self.head = nnx.Linear(4, 2, rngs=rngs)


  def make():
    return Net()


  def make_with_head():
    return Net(head=True)


  class Stack(nnx.Module):
    def __init__(self):
      rngs = nnx.Rngs(0)
      self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(10)])


  def make_stack():
    return Stack()
  """)
NET_RULES = "logical_axis_rules: [['embed', null]]\n"


@pytest.fixture(scope='module')
def net_checkpoints(tmp_path_factory):
  """A model file, and Orbax checkpoints of three variants of its model."""
  import orbax.checkpoint as ocp
  from flax import nnx

  tmp = tmp_path_factory.mktemp('net')
  (tmp / 'net.py').write_text(NET)
  (tmp / 'rules.yaml').write_text(NET_RULES)
  namespace = {}
  exec(NET, namespace)
  net = namespace['Net']
  with ocp.StandardCheckpointer() as checkpointer:
    for name, model in (
      ('wider', net(hidden=16)),
      ('with_head', net(head=True)),
      ('plain', net()),
    ):
      checkpointer.save((tmp / name).absolute(), nnx.state(model))
    checkpointer.wait_until_finished()
  return tmp


@pytest.mark.parametrize(
  'factory, checkpoint, message',
  [
    (
      'make',
      'wider',
      "error: Shape mismatch for 3 variables: 'down/kernel': the target "
      "expects (8, 4), the Orbax checkpoint '{ckpt}' holds (16, 4); "
      "'up/bias': the target expects (8,), it holds (16,); 'up/kernel': the "
      'target expects (4, 8), it holds (4, 16). Pass a TARGET that builds '
      'the model that was saved (the same configuration).\n',
    ),
    (
      'make',
      'with_head',
      "error: The Orbax checkpoint '{ckpt}' holds 2 variable(s) the target "
      'does not have: head/bias, head/kernel. Expected an Orbax checkpoint '
      'of this model: pass a TARGET that builds the model that was saved '
      '(the same configuration).\n',
    ),
    (
      'make_with_head',
      'plain',
      "error: The Orbax checkpoint '{ckpt}' lacks 2 variables the target "
      'needs: head/bias, head/kernel. It holds 4 variables: down/bias, '
      'down/kernel, up/bias, up/kernel. Expected an Orbax checkpoint saved '
      'from this model. Pass a TARGET that builds the model that was saved '
      '(the same configuration).\n',
    ),
    (
      'make_stack',
      'with_head',
      "error: The Orbax checkpoint '{ckpt}' holds 6 variable(s) the target "
      'does not have: down/bias, down/kernel, head/bias, head/kernel, '
      "up/bias, up/kernel; and it lacks 20 of the target's variables: "
      'layers/0/bias, layers/0/kernel, layers/1/bias, layers/1/kernel, '
      'layers/2/bias, layers/2/kernel, layers/3/bias, layers/3/kernel and '
      '12 more. Expected an Orbax checkpoint of this model: pass a TARGET '
      'that builds the model that was saved (the same configuration).\n',
    ),
  ],
  ids=['shape', 'extra-variable', 'missing-variables', 'another-model'],
)
def test_export_names_the_variable_that_does_not_fit(
  cli, net_checkpoints, monkeypatch, factory, checkpoint, message
):
  import os

  # export sets XLA_FLAGS for the processes it starts: kept to this test.
  monkeypatch.setenv('XLA_FLAGS', os.environ.get('XLA_FLAGS', ''))
  tmp = net_checkpoints
  code, out, err = cli(
    'export',
    f'{tmp / "net.py"}:{factory}',
    '--checkpoint',
    tmp / checkpoint,
    '--rules',
    tmp / 'rules.yaml',
    '--out',
    tmp / f'out_{factory}_{checkpoint}',
  )
  assert code == 2
  assert out == ''
  assert err == message.format(ckpt=tmp / checkpoint)
  for internal in ('strict=False', 'ArrayRestoreArgs', 'unexpected failure'):
    assert internal not in err
  assert not (tmp / f'out_{factory}_{checkpoint}' / 'checkpoint').exists()
