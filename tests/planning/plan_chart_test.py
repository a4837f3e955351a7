"""Plans that read at a glance, and the pictures of their memory.

A model of 484 variables (`big_model`: 24 identical blocks, 37 GiB on 128
abstract devices) collapses to one row per kind of variable; the SVG
charts are read back with xml.etree and checked against the plan's own
figures (`ShardingPlan.bytes_by_device`, `bytes_per_device_by_category`).
"""

import html
import re
import xml.etree.ElementTree as ET

import optax
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P
from support import big_model

import flax_dtensor as fdt
from flax_dtensor import _text
from flax_dtensor._planning import _plan, _plan_chart, _plan_view
from flax_dtensor.demo import model as demo_model
from flax_dtensor.demo import train as demo_train

SVG = '{http://www.w3.org/2000/svg}'
MESH = AbstractMesh((2, 4), ('data', 'model'))


@pytest.fixture(scope='module')
def big_plan():
  return fdt.plan(
    big_model.make_model, mesh=big_model.MESH, rules=big_model.RULES
  )


@pytest.fixture(scope='module')
def demo_with_adamw():
  return fdt.plan(
    demo_model.make_model,
    mesh=MESH,
    rules=demo_train.default_rules(),
    optimizer=optax.adamw(1e-3),
  )


# Reading at a glance
# ------------------------------------------------------------------------------


def test_the_big_model_is_what_the_issue_describes(big_plan):
  assert len(big_plan.entries) == 484
  assert big_plan.num_devices == 128
  assert round(big_plan.total_bytes / 2**30, 1) == 37.0


@pytest.mark.parametrize('width', [80, 120])
def test_484_variables_collapse_to_a_page(big_plan, width):
  text = big_plan.render(width)
  lines = text.splitlines()
  assert len(lines) <= 80
  assert max(map(len, lines)) <= width
  assert 'layers/{0..23}/attn/q/kernel \u00d724' in text
  rows = _plan_view.rows(big_plan.entries)
  assert len(rows) == 24  # 20 kinds of layer variable, 4 others.
  assert sum(len(r.entries) for r in rows) == 484
  q = next(r for r in rows if r.path == 'layers/{0..23}/attn/q/kernel')
  assert [e.path for e in q.entries] == [
    f'layers/{i}/attn/q/kernel' for i in range(24)
  ]


def test_expand_lists_every_variable(big_plan):
  text = big_plan.render(200, expand=True)
  starts = {line.split()[0] for line in text.splitlines() if line.strip()}
  assert {e.path for e in big_plan.entries} <= starts
  assert '\u00d7' not in text
  assert str(big_plan.table(expand=True)) == big_plan.render(expand=True)


def test_variables_that_differ_are_not_collapsed():
  alike = dict(
    kind='Param',
    shape=(4,),
    dtype='float32',
    logical_axes=('embed',),
    bytes=16,
    bytes_per_device=8,
    fallbacks=(),
    category='params',
    mesh_axes={'data': 2},
  )
  entries = [
    _plan.PlanEntry(path=f'layers/{i}/b', spec=P('data'), **alike)
    for i in (0, 1, 2, 4, 5, 6)
  ]
  entries.insert(3, _plan.PlanEntry(path='layers/3/b', spec=P(None), **alike))
  rows = _plan_view.rows(entries)
  assert [(r.path, len(r.entries)) for r in rows] == [
    ('layers/{0..2,4..6}/b', 6),
    ('layers/3/b', 1),
  ]
  assert rows[0].label == 'layers/{0..2,4..6}/b \u00d76'


def test_paths_collapse_only_into_full_grids():
  found = _text.collapse_paths(
    [('a/0/b/0', None), ('a/1/b/1', None), ('a/0/b/1', None), ('c', None)]
  )
  # (0,0), (1,1), (0,1) is no grid: split by the first index.
  assert found == [('a/0/b/{0,1}', [0, 2]), ('a/1/b/1', [1]), ('c', [3])]
  grid = _text.collapse_paths(
    [(f'x/{i}/y/{j}', None) for i in range(3) for j in range(2)]
  )
  assert grid == [('x/{0..2}/y/{0,1}', list(range(6)))]
  assert _text.int_ranges([5, 0, 1, 2, 3, 7, 9, 8]) == '0..3,5,7..9'


@pytest.mark.parametrize('width', range(24, 80, 7))
def test_specs_break_only_after_a_comma(width):
  spec = "P(('fsdp', 'data'), 'model', None)"
  lines = _text.fill(
    ['  8.0 KiB', 'float32[128,4,32]', "('embed', 'heads', 'kv') ->", spec],
    width,
    hanging=4,
  )
  assert max(map(len, lines)) <= width
  joined = ' '.join(line.strip() for line in lines)
  assert spec in joined or spec.replace(', ', ',  ') not in joined
  # Every line break falls between segments or after a comma.
  for a in lines[:-1]:
    assert a.endswith((',', 'KiB', ']', '->')), lines


def test_the_demo_spec_is_never_cut_in_the_stacked_view():
  plan = fdt.plan(
    demo_model.make_model, mesh=MESH, rules=demo_train.default_rules()
  )
  lines = plan.render(60).splitlines()
  i = lines.index('layers/{0,1}/attn/key/kernel \u00d72')
  assert lines[i + 1 : i + 3] == [
    "    8.0 KiB  float32[128,4,32]  ('embed', 'heads', 'kv') ->",
    "             P('data', 'model', None)",
  ]


def test_fallback_reasons_and_findings_hang_under_their_text():
  plan = fdt.plan(
    demo_model.make_model, mesh=MESH, rules=demo_train.default_rules()
  )
  lines = plan.render(60).splitlines()
  at = next(i for i, line in enumerate(lines) if "'embed' -> 'fsdp'" in line)
  assert lines[at].startswith("  'embed' -> 'fsdp'")
  assert lines[at + 1].startswith('    ') and lines[at + 1][4] != ' '
  report = fdt.check(
    demo_model.make_model, demo_train.default_rules(), MESH, budget=2**16
  )
  text = report.render(60)
  assert max(map(len, text.splitlines())) <= 60
  for line in text.splitlines()[1:]:
    assert line.startswith('  [') or line.startswith('      '), line
  assert ' '.join(text.split()) == ' '.join(str(report).split())


# The pictures
# ------------------------------------------------------------------------------


def _svg(text):
  return ET.fromstring(text)


def test_bars_are_the_bytes_each_device_holds(demo_with_adamw):
  plan = demo_with_adamw
  by_category = plan.bytes_per_device_by_category()
  # mu and nu, and two int32 step counts.
  assert by_category['optimizer'] == 2 * by_category['params'] + 8
  loads = plan.bytes_by_device()
  for c in ('params', 'optimizer', 'other'):
    assert loads[c] == [by_category[c]] * 8  # Every dimension divides.
  budget = 700 * 1024
  root = _svg(_plan_chart.memory_svg(plan, budget=budget))
  top = float(root.get('data-top-bytes'))
  plot = root.find(f'{SVG}rect[@class="plot"]')
  y0, h = float(plot.get('y')), float(plot.get('height'))
  bars = root.findall(f'{SVG}rect[@class="bar"]')
  assert len(bars) == 8 * 2  # params and optimizer on each device.
  for bar in bars:
    device, category = int(bar.get('data-device')), bar.get('data-category')
    value = loads[category][device]
    assert int(bar.get('data-bytes')) == value
    assert float(bar.get('height')) == pytest.approx(h * value / top, abs=0.01)
  # Stacked: the optimizer's bar sits on the parameters'.
  for device in range(8):
    params, opt = (
      next(
        b
        for b in bars
        if b.get('data-device') == str(device) and b.get('data-category') == c
      )
      for c in ('params', 'optimizer')
    )
    assert float(params.get('y')) + float(params.get('height')) == (
      pytest.approx(y0 + h, abs=0.01)
    )
    assert float(opt.get('y')) + float(opt.get('height')) == pytest.approx(
      float(params.get('y')), abs=0.02
    )
  line = root.find(f'{SVG}line[@class="budget"]')
  assert float(line.get('y1')) == pytest.approx(
    y0 + h * (1 - budget / top), abs=0.01
  )
  ideal = root.find(f'{SVG}line[@class="ideal"]')
  assert float(ideal.get('data-bytes')) == pytest.approx(
    plan.ideal_bytes_per_device, abs=0.01
  )
  assert top >= max(budget, plan.bytes_per_device)


def test_the_mesh_grid_has_a_cell_per_device(big_plan):
  root = _svg(_plan_chart.mesh_svg(big_plan, budget=2**30))
  cells = root.findall(f'{SVG}rect[@class="device"]')
  assert [int(c.get('data-device')) for c in cells] == list(range(128))
  assert (root.get('data-rows'), root.get('data-columns')) == ('8', '16')
  per_device = big_plan.bytes_per_device
  assert {int(c.get('data-bytes')) for c in cells} == {per_device}
  # 8 rows of 16: cell i at row i // 16, column i % 16.
  xs = sorted({float(c.get('x')) for c in cells})
  ys = sorted({float(c.get('y')) for c in cells})
  assert len(xs) == 16 and len(ys) == 8
  assert (
    float(cells[17].get('x')) == xs[1] and float(cells[17].get('y')) == ys[1]
  )
  # Over a budget, a cell is outlined red.
  over = _svg(_plan_chart.mesh_svg(big_plan, budget=2**20))
  assert all(
    c.get('stroke') == '#c00'
    for c in over.findall(f'{SVG}rect[@class="device"]')
  )


def test_a_block_that_ends_short_counts_what_it_holds():
  entry = _plan.PlanEntry(
    path='w',
    kind='Param',
    shape=(5, 7),
    dtype='float32',
    logical_axes=None,
    spec=P('data', None),
    bytes=5 * 7 * 4,
    bytes_per_device=3 * 7 * 4,
    fallbacks=(),
    category='params',
    mesh_axes={'data': 2},
  )
  plan = _plan.ShardingPlan(
    entries=(entry,), mesh_axes={'data': 2}, num_devices=2
  )
  assert plan.bytes_by_device()['params'] == [3 * 7 * 4, 2 * 7 * 4]
  root = _svg(_plan_chart.mesh_svg(plan))
  fills = [c.get('fill') for c in root.findall(f'{SVG}rect[@class="device"]')]
  assert fills[0] == '#24528c' and fills[1] != fills[0]  # The heaviest.


def test_the_page_stands_alone(demo_with_adamw):
  page = demo_with_adamw.to_html(budget=2**20)
  assert page.startswith('<!DOCTYPE html>')
  assert '<script' not in page
  urls = re.findall(r'https?://[^"\s]+', page)
  assert set(urls) == {'http://www.w3.org/2000/svg'}  # A namespace only.
  assert page.count('<svg') == 2
  assert 'budget 1.0 MiB per device: fits' in page
  assert html.escape('layers/{0,1}/attn/key/kernel') in page.replace(
    '<wbr>', ''
  )
  expanded = demo_with_adamw.to_html(expand=True).replace('<wbr>', '')
  assert 'layers/1/attn/key/kernel' in expanded
  notebook = demo_with_adamw._repr_html_()
  assert notebook.startswith('<div') and notebook.count('<svg') == 1
  assert 'class="fdt-memory"' in notebook


def test_the_big_plan_in_a_notebook(big_plan):
  page = big_plan._repr_html_()
  assert page.startswith('<div') and page.endswith('</div>')
  assert page.count('<tr>') == 1 + 24  # The header and the collapsed rows.
  text = html.unescape(page.replace('<wbr>', ''))
  assert '>layers/{0..23}/attn/q/kernel \u00d724<' in text
  chart = ET.fromstring(re.search(r'<svg.*?</svg>', page, flags=re.S)[0])
  bars = chart.findall(f'{SVG}rect[@class="bar"]')
  assert len(bars) == 128  # Parameters only, one bar per device.
  assert {int(b.get('data-bytes')) for b in bars} == {
    big_model.PARAMS_PER_DEVICE
  }
  assert big_model.PARAMS_PER_DEVICE == big_plan.bytes_per_device


def test_the_mesh_grid_says_what_its_colours_mean(demo_with_adamw, big_plan):
  """A legend below the grid: a swatch per load from none to the scale (the
  heaviest device, or the budget), in the colours the cells take, the bytes
  at either end, and the red outline of a device over the budget."""
  root = _svg(_plan_chart.mesh_svg(demo_with_adamw))
  legend = root.find(f'{SVG}g[@class="legend"]')
  swatches = legend.findall(f'{SVG}rect[@class="swatch"]')
  assert [float(s.get('data-fraction')) for s in swatches] == list(
    _plan_chart.LEGEND_STEPS
  )
  cells = root.findall(f'{SVG}rect[@class="device"]')
  heaviest = max(int(c.get('data-bytes')) for c in cells)
  # Every device holds as much here: each cell is the full swatch's colour.
  assert {c.get('fill') for c in cells} == {swatches[-1].get('fill')}
  assert int(swatches[-1].get('data-bytes')) == heaviest
  assert int(swatches[0].get('data-bytes')) == 0
  text = ' '.join(t.text for t in legend.iter(f'{SVG}text'))
  assert text == (
    f'load: 0 {_text.human_bytes(heaviest)} (the heaviest device)'
  )
  assert legend.find(f'{SVG}rect[@class="over"]') is None
  # Against a budget: the swatches' scale is the budget, and the outline
  # of a device over it is explained.
  budget = 2**30
  root = _svg(_plan_chart.mesh_svg(big_plan, budget=budget))
  legend = root.find(f'{SVG}g[@class="legend"]')
  swatches = legend.findall(f'{SVG}rect[@class="swatch"]')
  assert int(swatches[-1].get('data-bytes')) == budget
  over = legend.find(f'{SVG}rect[@class="over"]')
  assert over.get('stroke') == '#c00'
  text = ' '.join(t.text for t in legend.iter(f'{SVG}text'))
  assert text == 'load: 0 1.0 GiB (the budget) over the budget'
  # The legend lies below the grid, inside the picture.
  bottom = max(
    float(c.get('y')) + float(c.get('height'))
    for c in root.findall(f'{SVG}rect[@class="device"]')
  )
  ys = [float(s.get('y')) for s in swatches]
  assert min(ys) > bottom
  assert max(ys) + 12 <= float(root.get('viewBox').split()[3])
  width = float(root.get('viewBox').split()[2])
  assert float(over.get('x')) + 100 <= width  # Its words fit too.


def test_the_chart_takes_the_width_of_its_page(demo_with_adamw):
  """At any page width (800 or 1,400 px) the bars span the container: the
  picture has no width of its own, only its proportions (viewBox)."""
  root = _svg(_plan_chart.memory_svg(demo_with_adamw))
  assert root.get('width') == '100%'
  assert 'width:100%' in root.get('style') and 'height:auto' in root.get(
    'style'
  )
  assert root.get('viewBox') == (
    f'0 0 {_plan_chart.WIDTH} {_plan_chart.HEIGHT}'
  )
  assert root.get('height') is None
