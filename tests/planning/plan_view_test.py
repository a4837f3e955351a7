"""How a ShardingPlan looks: widths, grouping, notebooks, block maps.

The text views are snapshot-tested at 80, 120 and 200 columns against
files in tests/planning/snapshots/ (regenerate with ``UPDATE_SNAPSHOTS=1``), and
checked for what must hold at any width: every path whole on one line, no
line wider than asked, each fallback reason once.
"""

import html
import os
import pathlib
import re

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P
from support import many_axes

import flax_dtensor as fdt
from flax_dtensor._planning import _plan_blocks, _plan_view
from flax_dtensor.demo import model as demo_model
from flax_dtensor.demo import train as demo_train

SNAPSHOTS = pathlib.Path(__file__).parent / 'snapshots'
MESH = AbstractMesh((2, 4), ('data', 'model'))


@pytest.fixture(scope='module')
def demo_plan():
  """The demo's 24 variables on a mesh without its 'fsdp' axis."""
  return fdt.plan(
    demo_model.make_model, mesh=MESH, rules=demo_train.default_rules()
  )


def _check_snapshot(name: str, text: str) -> None:
  path = SNAPSHOTS / name
  if os.environ.get('UPDATE_SNAPSHOTS'):
    path.parent.mkdir(exist_ok=True)
    path.write_text(text + '\n')
  assert text + '\n' == path.read_text(), f'{name} changed'


@pytest.mark.parametrize('width', [80, 120, 200])
def test_full_view_snapshot(demo_plan, width):
  _check_snapshot(f'plan_{width}.txt', demo_plan.render(width))


@pytest.mark.parametrize('width', [80, 120, 200])
def test_summary_snapshot(demo_plan, width):
  _check_snapshot(
    f'plan_summary_{width}.txt', demo_plan.render(width, summary=True)
  )


@pytest.mark.parametrize('width', [60, 80, 100, 120, 160, 200])
def test_every_path_is_whole_and_no_line_is_wider(demo_plan, width):
  text = demo_plan.render(width, expand=True)
  lines = text.splitlines()
  assert max(len(line) for line in lines) <= width
  starts = {line.split()[0] for line in lines if line.strip()}
  for entry in demo_plan.entries:
    assert entry.path in starts, f'{entry.path} cut at {width} columns'
  # Collapsed: each pattern whole at the start of a line.
  lines = demo_plan.render(width).splitlines()
  assert max(len(line) for line in lines) <= width
  starts = {line.split()[0] for line in lines if line.strip()}
  for row in _plan_view.rows(demo_plan.entries):
    assert row.path in starts, f'{row.path} cut at {width} columns'


def test_the_table_is_used_when_it_fits_and_lines_otherwise(demo_plan):
  wide = demo_plan.render(200).splitlines()
  narrow = demo_plan.render(80).splitlines()
  # A table: one row per variable, its spec on the path's line.
  row = next(line for line in wide if line.split()[:1] == ['head/kernel'])
  assert "('embed', 'vocab')" in row and "P('data', 'model')" in row
  assert '32.0 KiB' in next(
    line for line in wide if line.split()[:1] == ['position/embedding']
  )
  # Two lines per variable: the path alone, then what it becomes.
  i = narrow.index('head/kernel')
  assert "P('data', 'model')" in narrow[i + 1]
  assert '16.0 KiB' in narrow[i + 1]
  # 24 variables: at most 3 lines each, with the fallbacks.
  assert len(narrow) < 3 * len(demo_plan.entries) + 12


def test_fallbacks_are_grouped_by_reason(demo_plan):
  reason = "'embed' -> 'fsdp': the mesh has no axis 'fsdp'"
  affected = [
    e.path for e in demo_plan.entries if any('fsdp' in f for f in e.fallbacks)
  ]
  assert len(affected) == 17
  for width in (80, 200):
    text = ' '.join(demo_plan.render(width, expand=True).split())
    assert text.count(reason) == 1
    assert '(17 variables)' in text
    listed = text[text.index(reason) :]
    for path in affected:
      assert path in listed
  groups = _plan_view.fallback_groups(demo_plan.entries)
  assert [(r.split(' (axes')[0], len(p)) for r, p in groups] == [(reason, 17)]


def test_summary_names_the_largest_replicated_and_counts(demo_plan):
  text = demo_plan.render(120, summary=True)
  assert '260.0 KiB per device of 1.8 MiB in 24 variables' in text
  assert 'ideal 232.9 KiB (1.12x)' in text
  assert 'Largest replicated (5 of 5)' in text
  assert 'final_norm/scale  float32[128]  512 B' in text
  # Counts per reason, not the paths.
  assert '(17 variables)' in text
  assert 'layers/0/attn/key/kernel' not in text


def test_str_follows_columns(demo_plan, monkeypatch):
  monkeypatch.setenv('COLUMNS', '80')
  assert str(demo_plan) == demo_plan.render(80)
  assert max(map(len, str(demo_plan).splitlines())) <= 80
  monkeypatch.setenv('COLUMNS', '200')
  assert str(demo_plan) == demo_plan.render(200)
  assert repr(demo_plan) == str(demo_plan)
  assert str(demo_plan.summary()) == demo_plan.render(200, summary=True)


def test_rich_console_uses_its_width(demo_plan):
  import io

  import rich.console

  for width in (80, 200):
    buffer = io.StringIO()
    console = rich.console.Console(
      file=buffer, width=width, color_system=None, force_terminal=False
    )
    console.print(demo_plan)
    lines = [line.rstrip() for line in buffer.getvalue().splitlines()]
    assert '\n'.join(lines) == demo_plan.render(width)


def test_html_view_wraps_and_holds_every_path(demo_plan):
  page = demo_plan._repr_html_()
  assert page.startswith('<div') and page.endswith('</div>')
  # Paths may break only after a slash; every one is there, whole.
  text = html.unescape(page.replace('<wbr>', ''))
  for row in _plan_view.rows(demo_plan.entries):
    assert f'>{row.label}<' in text
  assert 'white-space:nowrap' not in page
  assert page.count('<tr>') == 1 + 14  # 24 variables, 2 layers alike.
  expanded = html.unescape(
    demo_plan.table(expand=True)._repr_html_().replace('<wbr>', '')
  )
  for entry in demo_plan.entries:
    assert f'>{entry.path}<' in expanded
  assert expanded.count('<tr>') == 1 + len(demo_plan.entries)
  assert html.escape("'embed' -> 'fsdp'") in page
  summary = demo_plan.summary()._repr_html_()
  assert '<table' not in summary
  assert 'Largest replicated' in summary


def test_a_plan_of_mixed_variable_types_shows_the_type():
  with nnx.use_eager_sharding(False):
    model = nnx.eval_shape(
      lambda: nnx.BatchNorm(
        4,
        scale_init=nnx.with_partitioning(nnx.initializers.ones, ('embed',)),
        rngs=nnx.Rngs(0),
      )
    )
  plan = fdt.plan(model, mesh=MESH, rules=[('embed', 'data')])
  text = plan.render(200)
  assert 'type' in text.splitlines()[3]
  assert 'BatchStat' in text and 'Param' in text


# Which device holds which block
# ------------------------------------------------------------------------------

CASES = [
  ((16,), P('data')),
  ((16,), P(('data', 'model'))),
  ((16,), P(('model', 'data'))),
  ((8, 12), P('model', 'data')),
  ((8, 12), P(None, 'model')),
  ((4, 6, 8), P('data', None, 'model')),
  ((4, 16, 8), P(None, ('model', 'data'), None)),
  ((2, 4, 8, 3), P('data', 'model', None, None)),
  ((3,), P()),
]


@pytest.mark.parametrize(('shape', 'spec'), CASES)
def test_blocks_match_jax(shape, spec):
  """The picture's blocks are the ones JAX places, device by device."""
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  sharding = NamedSharding(mesh, spec)
  expected = {}
  for position, device in enumerate(mesh.devices.flat):
    index = sharding.devices_indices_map(shape)[device]
    block = tuple(
      (s.start or 0, n if s.stop is None else s.stop)
      for s, n in zip(index, shape, strict=True)
    )
    expected.setdefault(block, []).append(position)
  blocks = _plan_blocks.device_blocks(shape, spec, {'data': 2, 'model': 4})
  assert blocks == expected
  # The blocks tile the array: every element is held by as many positions.
  cover = np.zeros(shape, int)
  for block, positions in blocks.items():
    cover[tuple(slice(a, b) for a, b in block)] += len(positions)
  assert (cover == 8 // len(blocks)).all()


def test_uneven_blocks_end_short():
  """JAX pads the last block of a dimension that does not divide evenly."""
  blocks = _plan_blocks.device_blocks((5, 7), P('data', None), {'data': 2})
  assert blocks == {((0, 3), (0, 7)): [0], ((3, 5), (0, 7)): [1]}


def test_show_draws_a_grid_and_lists_every_block(demo_plan):
  text = demo_plan.show('layers/0/attn/query/kernel').render(80)
  assert text.splitlines()[0] == (
    "layers/0/attn/query/kernel  float32[128,4,32]  P('data', 'model', None)"
  )
  assert '8 blocks of 8 mesh positions' in text
  assert re.search(r'0:64\s+│\s+0\s+│\s+1\s+│\s+2\s+│\s+3\s+│', text)
  assert re.search(r'64:128\s+│\s+4\s+│\s+5\s+│\s+6\s+│\s+7\s+│', text)
  assert '[64:128, 3:4, :] -> 7' in text
  scale = demo_plan.show('final_norm/scale').render(80)
  assert '1 block of 8 mesh positions' in scale
  assert '[:] -> 0,1,2,3,4,5,6,7' in scale
  assert demo_plan.show('head/kernel')._repr_html_().startswith('<pre>')


def test_show_of_an_unknown_path_names_the_closest(demo_plan):
  with pytest.raises(
    KeyError,
    match=r"No variable at 'layers/0/atn/query/kernel' among the plan's 24; "
    r"did you mean 'layers/0/attn/query/kernel', 'layers/1/attn/query/"
    r"kernel', 'layers/0/attn/key/kernel'\?",
  ):
    demo_plan.show('layers/0/atn/query/kernel')
  with pytest.raises(KeyError, match=r"'nope'.*no path is spelled like it"):
    demo_plan.show('nope')


def test_specs_are_shown_without_the_mesh_axes_of_size_1():
  """A MaxText-style mesh: the table, the stacked lines, the HTML and the
  block map show P('fsdp', None, 'tensor'); the entry keeps the raw spec."""
  rules = many_axes.RULES
  plan = fdt.plan(
    lambda: many_axes.Stacked(nnx.Rngs(0)),
    mesh=many_axes.abstract_mesh(),
    rules=rules,
  )
  wi = plan['wi']
  assert wi.spec == P(
    ('fsdp', 'sequence', 'context', 'expert'),
    'stage',
    ('tensor', 'tensor_transpose', 'tensor_sequence'),
  )
  assert wi.display_spec == P('fsdp', None, 'tensor')
  assert wi.placed is wi.display_placed is None
  for text in (plan.render(200), plan.render(60), plan.show('wi').render(100)):
    assert "P('fsdp', None, 'tensor')" in ' '.join(text.split())
    assert "'stage'" not in text and "'context'" not in text
  assert (
    plan.show('wi')
    .render(100)
    .startswith("wi  float32[16,3,32]  P('fsdp', None, 'tensor')")
  )
  page = plan._repr_html_()
  assert html.escape("P('fsdp', None, 'tensor')") in page
  assert 'context_autoregressive' in page  # Named in the header only.
  assert html.escape("'context'") not in page


@pytest.mark.parametrize(
  'shape, names, header',
  [
    ((2, 4), ('data', 'model'), 'mesh data=2, model=4 (8 devices)'),
    (
      (1, 8, 1),
      ('data', 'model', 'stage'),
      'mesh model=8 (8 devices; size 1, not shown in specs: data, stage)',
    ),
    (
      (1, 1),
      ('data', 'model'),
      'mesh data=1, model=1 (1 device)',
    ),
  ],
  ids=['no-size-1', 'some-size-1', 'all-size-1'],
)
def test_the_header_names_the_axes_of_size_1_apart(shape, names, header):
  plan = fdt.plan(
    lambda: nnx.Linear(8, 8, rngs=nnx.Rngs(0)), mesh=AbstractMesh(shape, names)
  )
  assert _plan_view.mesh_text(plan) == header


def test_on_one_device_the_specs_show_the_axes_of_size_1():
  """Where every axis has size 1 they are all there is, and JAX's types name
  them (f32[16,64@data]): the spec is shown as resolved, as placed."""
  mesh = jax.make_mesh((1,), ('data',))
  rules = [('embed', None), ('mlp', 'model'), ('mlp', 'data')]
  init = nnx.with_partitioning(nnx.initializers.ones, ('embed', 'mlp'))
  with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
    model = nnx.Linear(16, 64, kernel_init=init, rngs=nnx.Rngs(0))
    plan = fdt.plan(model)
  kernel = plan['kernel']
  assert model.kernel[...].sharding.spec == kernel.spec == P(None, 'data')
  assert kernel.display_spec == P(None, 'data')
  assert _plan_view.spec_text(kernel) == "P(None, 'data')"
  assert "P(None, 'data')" in str(plan)
  assert _plan_view.mesh_text(plan) == 'mesh data=1 (1 device)'
