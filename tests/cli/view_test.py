"""The command line's views at a glance: plan, --show, --html, --help,
inspect.

The commands run in this process (typer's CliRunner): stdout is the
result's, our own stderr (the ``error:`` lines) is read with capfd.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest
from support import big_model, output_util
from typer.testing import CliRunner

from flax_dtensor import _text
from flax_dtensor.cli import _app
from flax_dtensor.cli import inspect as inspect_cli

DEMO = 'flax_dtensor.demo.model:make_model'
BIG = 'support.big_model:make_model'
SVG = '{http://www.w3.org/2000/svg}'


@pytest.fixture
def cli(capfd, monkeypatch):
  """Runs ``flax-dtensor ARGS`` at `columns`: (status, stdout, stderr)."""

  def run(*args, columns=80):
    monkeypatch.setenv('COLUMNS', str(columns))
    capfd.readouterr()
    result = CliRunner().invoke(_app.app, [str(a) for a in args])
    _, err = capfd.readouterr()
    return result.exit_code, result.stdout, err

  return run


@pytest.fixture(scope='module')
def big_rules(tmp_path_factory):
  path = tmp_path_factory.mktemp('big') / 'rules.yaml'
  path.write_text(big_model.RULES_YAML)
  return path


def _big(cli, big_rules, *args, columns=80):
  return cli(
    'plan',
    BIG,
    '--mesh',
    big_model.MESH_FLAG,
    '--rules',
    big_rules,
    *args,
    columns=columns,
  )


@pytest.mark.parametrize('columns', [80, 120])
def test_the_484_variable_plan_fits_a_page(cli, big_rules, columns):
  code, out, err = _big(cli, big_rules, columns=columns)
  assert code == 0, err
  lines = out.splitlines()
  assert len(lines) <= 80
  assert max(map(len, lines)) <= columns
  assert lines[0] == 'Sharding plan: mesh data=8, model=16 (128 devices)'
  assert '484 variables' in lines[1]
  assert any(
    line.split()[:2] == ['layers/{0..23}/mlp/down/kernel', '\u00d724']
    for line in lines
  )


def test_expand_lists_each_of_the_484(cli, big_rules):
  code, out, _ = _big(cli, big_rules, '--expand', columns=200)
  assert code == 0
  starts = [line.split()[0] for line in out.splitlines() if line.strip()]
  for i in (0, 7, 23):
    assert f'layers/{i}/attn/q/kernel' in starts
  assert '\u00d7' not in out


def test_show_of_a_misspelled_path_names_the_closest(cli, big_rules):
  code, out, err = _big(cli, big_rules, '--show', 'layers/3/atn/q/kernel')
  assert code == 2
  assert out == ''
  assert err.count('\n') == 1 and len(err) < 400
  assert err.startswith(
    f'error: --show expected the path of a variable of {BIG}; got '
    "'layers/3/atn/q/kernel', which is none of its 484. Did you mean "
    "'layers/3/attn/q/kernel'"
  )
  assert f'`flax-dtensor plan {BIG}` lists them.' in err
  code, _, err = cli('plan', DEMO, '--show', 'zzz')
  assert code == 2 and 'No path is spelled like it.' in err


def test_html_writes_one_page_with_the_charts(cli, big_rules, tmp_path):
  page = tmp_path / 'plan.html'
  code, out, err = _big(
    cli, big_rules, '--html', page, '--budget', '512MiB', '--optimizer', 'adamw'
  )
  assert code == 0, err
  assert f"Wrote the plan as HTML to '{page}'" in output_util.unwrapped(err)
  output_util.assert_fits(err, 80, [f"'{page}'"])
  assert out.startswith('Sharding plan: mesh data=8, model=16')
  text = page.read_text()
  assert '<script' not in text and text.startswith('<!DOCTYPE html>')
  svgs = re.findall(r'<svg.*?</svg>', text, flags=re.S)
  assert len(svgs) == 2
  chart, grid = (ET.fromstring(s) for s in svgs)
  top = float(chart.get('data-top-bytes'))
  plot = chart.find(f'{SVG}rect[@class="plot"]')
  y0, h = float(plot.get('y')), float(plot.get('height'))
  budget = chart.find(f'{SVG}line[@class="budget"]')
  assert int(budget.get('data-bytes')) == 512 * 2**20
  assert float(budget.get('y1')) == pytest.approx(
    y0 + h * (1 - 512 * 2**20 / top), abs=0.01
  )
  bars = chart.findall(f'{SVG}rect[@class="bar"]')
  assert {b.get('data-category') for b in bars} == {'params', 'optimizer'}
  assert len(grid.findall(f'{SVG}rect[@class="device"]')) == 128
  params = {
    int(b.get('data-bytes')) for b in bars if b.get('data-category') == 'params'
  }
  assert params == {big_model.PARAMS_PER_DEVICE}


def test_html_to_an_unwritable_place_is_bad_input(cli, tmp_path):
  code, _, err = cli('plan', DEMO, '--html', tmp_path / 'no' / 'plan.html')
  assert code == 2
  assert err.startswith(f"error: --html '{tmp_path / 'no' / 'plan.html'}'")
  assert 'cannot write the page' in err


def test_check_findings_hang_under_their_text(cli):
  code, out, _ = cli('plan', DEMO, '--check', '--budget', '64KiB', columns=60)
  assert code == 1
  lines = out.splitlines()
  assert max(map(len, lines)) <= 60
  lines = lines[next(i for i, x in enumerate(lines) if 'findings:' in x) :]
  for line in lines[1:]:
    assert line.startswith('  [') or line.startswith('      '), line
  assert any(line.startswith('      ') for line in lines)


@pytest.mark.parametrize('command', [None, 'plan', 'export', 'inspect', 'demo'])
def test_help_fits_80_columns(cli, command):
  code, out, _ = cli(*([command] if command else []), '--help')
  assert code == 0
  for line in out.splitlines():
    assert len(line) <= 80, line
    assert '\u2026' not in line, line
    if not line.startswith('Usage:'):  # Click's own [ARGS]...
      assert not line.endswith('...'), line
  if command is None:
    assert '  plan     Show where every variable of a model would go.' in out


# inspect: the meshes once, 100 columns
# ------------------------------------------------------------------------------

MESH = 'data=2,model=4'
ROWS = [
  (
    'embed/embedding',
    'Param',
    '(256, 128)',
    'float32',
    f"P('model', 'data') @ {MESH}",
    f'model,data @ {MESH}',
  ),
  (
    'layers/0/attn/query/kernel',
    'Param',
    '(128, 4, 32)',
    'float32',
    f"P('data', 'model', None) @ {MESH}",
    f'data,model,unsharded @ {MESH}',
  ),
  (
    'fused',
    'Param',
    '(16, 4)',
    'float32',
    f"P(('data', 'model'), None) @ {MESH}",
    'data+model,unsharded @ data+model=8',
  ),
]


def test_inspect_names_the_mesh_once():
  rows, line = inspect_cli.mesh_once(ROWS)
  assert line == (
    f'JAX mesh {MESH}; DTensor mesh {MESH} (others in their rows)'
  )
  assert [r[4:] for r in rows] == [
    ("P('model', 'data')", 'model,data'),
    ("P('data', 'model', None)", 'data,model,unsharded'),
    ("P(('data', 'model'), None)", 'data+model,unsharded @ data+model=8'),
  ]
  assert inspect_cli.mesh_once(ROWS[:2])[1] == (
    f'JAX mesh {MESH}; DTensor mesh {MESH}'
  )


def test_inspect_table_fits_100_columns():
  import io

  items = inspect_cli._variables(ROWS[:2], 100)
  buffer = io.StringIO()
  console = _text.console(buffer, 100)
  for item in items:
    console.print(item)
  lines = [line.rstrip() for line in buffer.getvalue().splitlines()]
  assert lines[0].startswith('JAX mesh data=2,model=4')
  assert lines[1] == 'Every variable is a Param.'
  assert max(map(len, lines)) <= 100
  row = next(line for line in lines if line.startswith('layers/0/attn'))
  assert row.split('  ')[0] == 'layers/0/attn/query/kernel'
  assert "P('data', 'model', None)" in row and '@' not in row
  assert sum(line.count(f'@ {MESH}') for line in lines) == 0
