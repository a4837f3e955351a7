"""A plan's memory as pictures: plain SVG, and one self-contained page.

`device_bytes` counts what each mesh position holds, by category;
`memory_svg` draws it as stacked bars (parameters, optimizer state, other
variables) with the budget as a line, as wide as its container; `mesh_svg`
draws the mesh as a grid coloured by load, with a legend; `page` puts both above the plan's table in one HTML file
with no script and nothing fetched. The numbers the pictures are drawn
from are written on their elements (``data-bytes``), for tests and tools.
"""

from __future__ import annotations

import html
import math

from flax_dtensor import _text
from flax_dtensor._planning import _plan, _plan_blocks, _plan_html, _plan_view

CATEGORIES = ('params', 'optimizer', 'other')
COLOURS = {'params': '#4878a8', 'optimizer': '#e0904a', 'other': '#9a9a9a'}
LABELS = {
  'params': 'parameters',
  'optimizer': 'optimizer state',
  'other': 'other variables',
}

# The bar chart's frame, in SVG units (it scales to its container).
WIDTH = 640
HEIGHT = 260
LEFT, RIGHT, TOP, BOTTOM = 72, 12, 30, 34
PLOT_W = WIDTH - LEFT - RIGHT
PLOT_H = HEIGHT - TOP - BOTTOM


def _entry_bytes(e: _plan.PlanEntry, positions: int) -> list[int]:
  """The bytes of `e` at each of `positions` mesh positions.

  A device holds its block of the variable: where the variable is placed
  (`PlanEntry.placed`), else where the rules put it. Blocks that end short
  (a dimension that does not divide evenly) count what they hold; a
  placement on axes the plan's mesh lacks counts the plan's figure.
  """
  if positions == 1 or not e.mesh_axes:
    return [e.bytes_per_device] * positions
  spec = e.placed if e.placed is not None else e.spec
  elements = math.prod(e.shape)
  itemsize = e.bytes // elements if elements else 0
  try:
    blocks = _plan_blocks.device_blocks(e.shape, spec, e.mesh_axes)
  except KeyError:
    return [e.bytes_per_device] * positions
  out = [0] * positions
  for block, held in blocks.items():
    size = math.prod(b - a for a, b in block) * itemsize
    for p in held:
      out[p] = size
  return out


def device_bytes(plan: _plan.ShardingPlan) -> dict[str, list[int]]:
  """{category: bytes at each mesh position}, for params, optimizer, other.

  Position i is ``mesh.devices.flat[i]``. Where every dimension divides
  evenly each position holds the plan's figure
  (`ShardingPlan.bytes_per_device_by_category`).
  """
  n = plan.num_devices
  out = {c: [0] * n for c in CATEGORIES}
  # Variables alike but for their index hold alike: count one, times n.
  for row in _plan_view.rows(plan.entries):
    per = _entry_bytes(row.entry, n)
    column = out.setdefault(row.entry.category, [0] * n)
    for i, b in enumerate(per):
      column[i] += b * len(row.entries)
  return out


def _scale_top(largest: float) -> float:
  """The chart's top: four round steps (in B, KiB, MiB, ...) that reach
  past `largest` by 5% at least."""
  if largest <= 0:
    return 4.0
  step = largest * 1.05 / 4
  unit = 1024 ** max(int(math.log(step, 1024)), 0)
  x = step / unit
  magnitude = 10 ** math.floor(math.log10(x))
  for m in (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
    if m * magnitude >= x:
      return float(4 * m * magnitude * unit)
  raise AssertionError('unreachable')


def _num(x: float) -> str:
  return f'{x:.2f}'.rstrip('0').rstrip('.')


def memory_svg(plan: _plan.ShardingPlan, *, budget: int | None = None) -> str:
  """Bytes per device as stacked bars, one per mesh position.

  Parameters at the bottom, then the optimizer state, then other
  variables; the budget as a red line, the ideal (total bytes / devices)
  as a dashed one. Each bar's rect carries ``data-device``,
  ``data-category`` and ``data-bytes``; the root, ``data-top-bytes`` (the
  value at the plot's top edge).
  """
  loads = device_bytes(plan)
  n = plan.num_devices
  totals = [sum(loads[c][i] for c in loads) for i in range(n)]
  top = _scale_top(max([*totals, budget or 0, 1]))
  slot = PLOT_W / n
  gap = min(slot * 0.2, 4) if n <= 64 else 0
  bar = slot - gap

  def y(value: float) -> float:
    return TOP + PLOT_H * (1 - value / top)

  parts = [
    f'<svg xmlns="http://www.w3.org/2000/svg" class="fdt-memory" '
    f'viewBox="0 0 {WIDTH} {HEIGHT}" width="100%" '
    f'style="width:100%;height:auto" font-family="sans-serif" '
    f'font-size="11" data-top-bytes="{_num(top)}" role="img">',
    f'<title>Bytes per device: {html.escape(_plan_view.totals_text(plan))}'
    '</title>',
    f'<rect class="plot" x="{LEFT}" y="{TOP}" width="{PLOT_W}" '
    f'height="{PLOT_H}" fill="#fafafa" stroke="#ccc"/>',
  ]
  for k in range(5):
    value = top * k / 4
    parts.append(
      f'<line x1="{LEFT - 4}" x2="{LEFT + PLOT_W}" y1="{_num(y(value))}" '
      f'y2="{_num(y(value))}" stroke="#e4e4e4"/>'
      f'<text x="{LEFT - 6}" y="{_num(y(value) + 4)}" text-anchor="end">'
      f'{_text.human_bytes(value)}</text>'
    )
  for i in range(n):
    base = 0
    x = LEFT + i * slot + gap / 2
    for c in loads:
      value = loads[c][i]
      if not value:
        continue
      parts.append(
        f'<rect class="bar" data-device="{i}" data-category="{c}" '
        f'data-bytes="{value}" x="{_num(x)}" y="{_num(y(base + value))}" '
        f'width="{_num(bar)}" height="{_num(PLOT_H * value / top)}" '
        f'fill="{COLOURS.get(c, "#9a9a9a")}"><title>device {i}: '
        f'{_text.human_bytes(value)} {LABELS.get(c, c)}</title></rect>'
      )
      base += value
  ideal = plan.ideal_bytes_per_device
  parts.append(
    f'<line class="ideal" data-bytes="{_num(ideal)}" x1="{LEFT}" '
    f'x2="{LEFT + PLOT_W}" y1="{_num(y(ideal))}" y2="{_num(y(ideal))}" '
    'stroke="#333" stroke-dasharray="4 3"><title>ideal: '
    f'{_text.human_bytes(ideal)}</title></line>'
  )
  if budget is not None:
    parts.append(
      f'<line class="budget" data-bytes="{budget}" x1="{LEFT}" '
      f'x2="{LEFT + PLOT_W}" y1="{_num(y(budget))}" y2="{_num(y(budget))}" '
      'stroke="#c00" stroke-width="2"><title>budget: '
      f'{_text.human_bytes(budget)}</title></line>'
    )
  parts.append(
    f'<text x="{LEFT + PLOT_W / 2}" y="{HEIGHT - 8}" text-anchor="middle">'
    f'{_text.count(n, "device")} (mesh positions 0 to {n - 1})</text>'
  )
  legend = [
    (COLOURS[c], LABELS[c], 'rect') for c in CATEGORIES if any(loads.get(c, ()))
  ]
  legend.append(('#333', 'ideal', 'dash'))
  if budget is not None:
    legend.append(('#c00', f'budget {_text.human_bytes(budget)}', 'line'))
  x = LEFT
  for colour, label, kind in legend:
    if kind == 'rect':
      mark = f'<rect x="{x}" y="10" width="10" height="10" fill="{colour}"/>'
    else:
      dash = ' stroke-dasharray="4 3"' if kind == 'dash' else ''
      mark = (
        f'<line x1="{x}" x2="{x + 10}" y1="15" y2="15" stroke="{colour}" '
        f'stroke-width="2"{dash}/>'
      )
    parts.append(f'{mark}<text x="{x + 14}" y="19">{label}</text>')
    x += 24 + 6.5 * len(label)
  parts.append('</svg>')
  return ''.join(parts)


def grid_shape(mesh_axes: dict[str, int] | None) -> tuple[int, int]:
  """(rows, columns) of the mesh's picture: the last axis across, the
  others down (a 1-axis mesh is one row)."""
  sizes = [v for v in (mesh_axes or {}).values()]
  if not sizes:
    return 1, 1
  return math.prod(sizes[:-1]), sizes[-1]


def _shade(fraction: float) -> str:
  """White-blue for a light load to deep blue for the heaviest."""
  f = min(max(fraction, 0.0), 1.0)
  start, end = (232, 240, 250), (36, 82, 140)
  rgb = (round(a + (b - a) * f) for a, b in zip(start, end, strict=True))
  return '#' + ''.join(f'{v:02x}' for v in rgb)


def mesh_svg(plan: _plan.ShardingPlan, *, budget: int | None = None) -> str:
  """The mesh as a grid, one cell per device, coloured by its load.

  Rows run over all axes but the last, columns over the last; position i
  is ``mesh.devices.flat[i]``. The colour is the load against the budget
  (or the heaviest load without one); a device above the budget is
  outlined in red; a legend below the grid says both (a swatch per
  `LEGEND_STEPS`, the bytes at either end). Each cell carries
  ``data-device`` and ``data-bytes``.
  """
  loads = device_bytes(plan)
  n = plan.num_devices
  totals = [sum(loads[c][i] for c in loads) for i in range(n)]
  rows_, cols = grid_shape(plan.mesh_axes)
  cell = max(min(48, (WIDTH - 20) / max(cols, 1)), 4)
  # Wide enough for the legend's line below the grid.
  width = max(cols * cell + 20, 330 if budget else 240)
  height = rows_ * cell + 50
  scale = budget if budget else max(totals)
  labelled = cell >= 36
  axes = list((plan.mesh_axes or {}).items())
  across = f'{axes[-1][0]}={axes[-1][1]}' if axes else 'one device'
  down = ', '.join(f'{k}={v}' for k, v in axes[:-1]) or '-'
  parts = [
    f'<svg xmlns="http://www.w3.org/2000/svg" class="fdt-mesh" '
    f'viewBox="0 0 {_num(width)} {_num(height)}" width="{_num(width)}" '
    f'height="{_num(height)}" style="max-width:100%;height:auto" '
    f'font-family="sans-serif" font-size="10" data-rows="{rows_}" '
    f'data-columns="{cols}" role="img">',
    f'<text x="10" y="14">across: {html.escape(across)}; down: '
    f'{html.escape(down)}</text>',
  ]
  for i, total in enumerate(totals):
    r, c = divmod(i, cols)
    x, y = 10 + c * cell, 24 + r * cell
    over = budget is not None and total > budget
    stroke = '#c00" stroke-width="2' if over else '#fff'
    parts.append(
      f'<rect class="device" data-device="{i}" data-bytes="{total}" '
      f'x="{_num(x)}" y="{_num(y)}" width="{_num(cell)}" '
      f'height="{_num(cell)}" fill="{_shade(total / scale if scale else 0)}"'
      f' stroke="{stroke}"><title>device {i}: {_text.human_bytes(total)}'
      f'{" (over the budget)" if over else ""}</title></rect>'
    )
    if labelled:
      ink = '#fff' if scale and total / scale > 0.55 else '#000'
      parts.append(
        f'<text x="{_num(x + cell / 2)}" y="{_num(y + cell / 2 + 4)}" '
        f'text-anchor="middle" fill="{ink}">{i}</text>'
      )
  parts += _mesh_legend(height - 20, scale, budget)
  parts.append('</svg>')
  return ''.join(parts)


LEGEND_STEPS = (0.0, 0.25, 0.5, 0.75, 1.0)
"""The loads the mesh's legend shows a swatch of, as fractions of its
scale (the budget, or the heaviest device)."""


def _mesh_legend(y: float, scale: float, budget: int | None) -> list[str]:
  """What the mesh's colours mean: a swatch per `LEGEND_STEPS` from no load
  to the scale, their bytes at both ends, and the red outline of a device
  above the budget."""
  size = 12
  what = 'the budget' if budget else 'the heaviest device'
  parts = [f'<g class="legend"><text x="10" y="{_num(y + 10)}">load:</text>']
  x = 44.0
  parts.append(
    f'<text x="{_num(x)}" y="{_num(y + 10)}" text-anchor="start">0</text>'
  )
  x += 12
  for fraction in LEGEND_STEPS:
    parts.append(
      f'<rect class="swatch" data-fraction="{fraction}" '
      f'data-bytes="{round(scale * fraction)}" x="{_num(x)}" y="{_num(y)}" '
      f'width="{size}" height="{size}" fill="{_shade(fraction)}" '
      'stroke="#999" stroke-width="0.5"/>'
    )
    x += size + 2
  parts.append(
    f'<text x="{_num(x + 4)}" y="{_num(y + 10)}">'
    f'{html.escape(_text.human_bytes(scale))} ({what})</text>'
  )
  if budget:
    x += 150
    parts.append(
      f'<rect class="over" x="{_num(x)}" y="{_num(y)}" width="{size}" '
      f'height="{size}" fill="#fff" stroke="#c00" stroke-width="2"/>'
      f'<text x="{_num(x + size + 6)}" y="{_num(y + 10)}">over the budget'
      '</text>'
    )
  parts.append('</g>')
  return parts


_PAGE_CSS = """
body{font-family:sans-serif;margin:1.5em;max-width:72em;color:#222}
h1{font-size:1.3em}h2{font-size:1.1em;margin-top:1.4em}
.fdt-head{font-family:monospace;font-size:13px;overflow-wrap:anywhere}
figure{margin:0.6em 0}
"""


def page(
  plan: _plan.ShardingPlan,
  *,
  budget: int | None = None,
  expand: bool = False,
  title: str = 'Sharding plan',
) -> str:
  """One self-contained HTML page: the bytes per device, the mesh coloured
  by load and the plan's table (collapsed unless `expand`). No script,
  nothing fetched."""
  head = [
    f'Sharding plan: {_plan_view.mesh_text(plan)}',
    *_plan_view.typo_headlines(plan),
    _plan_view.totals_text(plan),
  ]
  if budget is not None:
    loads = device_bytes(plan)  # Once: not once a device.
    worst = max(
      sum(v[i] for v in loads.values()) for i in range(plan.num_devices)
    )
    verdict = 'fits' if worst <= budget else 'does not fit'
    head.append(
      f'budget {_text.human_bytes(budget)} per device: {verdict} '
      f'(the heaviest device holds {_text.human_bytes(worst)})'
    )
  table = _plan_html.render_html(plan, expand=expand, header=False)
  return (
    '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
    f'<title>{html.escape(title)}</title><style>{_PAGE_CSS}</style></head>'
    f'<body><h1>{html.escape(title)}</h1>'
    + ''.join(f'<div class="fdt-head">{html.escape(h)}</div>' for h in head)
    + '<h2>Bytes per device</h2><figure>'
    + memory_svg(plan, budget=budget)
    + '</figure><h2>The mesh, by load</h2><figure>'
    + mesh_svg(plan, budget=budget)
    + '</figure><h2>Variables</h2>'
    + table
    + '</body></html>\n'
  )


def notebook_html(
  plan: _plan.ShardingPlan, *, expand: bool = False, budget: int | None = None
) -> str:
  """The plan for a notebook: the header, the chart, the table."""
  return _plan_html.render_html(
    plan, expand=expand, chart=memory_svg(plan, budget=budget)
  )
