"""How a ShardingPlan looks in Jupyter: an HTML fragment that wraps to the
notebook's width, its paths breakable only after their slashes (the rows
and texts of `_plan_view`).
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from flax_dtensor import _text
from flax_dtensor._planning import _plan, _plan_view

_CSS = (
  'border-collapse:collapse;font-family:monospace;font-size:12px;'
  'table-layout:auto;max-width:100%'
)


def _path_html(path: str) -> str:
  """The path, breakable only after its slashes."""
  return '/<wbr>'.join(html.escape(p) for p in path.split('/'))


def table_html(rows_: Sequence[_plan_view.Row], columns: Sequence[str]) -> str:
  """The rows as an HTML table that wraps to its container's width."""
  head = ''.join(
    f'<th style="text-align:left;padding:2px 6px">{h}</th>' for h in columns
  )
  body = []
  for row in rows_:
    cells = [_path_html(row.label)] + [
      html.escape(c).replace(' ', '&nbsp;')
      if n == 'per device'
      else (html.escape(c))
      for n, c in zip(
        columns[1:], _plan_view.cells_of(row, columns)[1:], strict=True
      )
    ]
    body.append(
      '<tr>'
      + ''.join(
        f'<td style="text-align:{"right" if n == "per device" else "left"};'
        f'padding:2px 6px;vertical-align:top">{c}</td>'
        for n, c in zip(columns, cells, strict=True)
      )
      + '</tr>'
    )
  return (
    f'<table style="{_CSS}"><thead><tr>{head}</tr></thead>'
    f'<tbody>{"".join(body)}</tbody></table>'
  )


def render_html(
  plan: _plan.ShardingPlan,
  *,
  summary: bool = False,
  expand: bool = False,
  chart: str = '',
  header: bool = True,
) -> str:
  """The plan as an HTML fragment that wraps to the notebook's width.

  `chart` (an SVG, `_plan_chart`) goes below the totals; without `header`,
  neither they nor the mesh are shown (a page that says them already).
  """
  parts = ['<div style="max-width:100%">']
  if header:
    parts.append(
      f'<b>Sharding plan: {html.escape(_plan_view.mesh_text(plan))}</b><br>'
      + ''.join(
        f'<b style="color:#b00">{html.escape(line)}</b><br>'
        for line in _plan_view.typo_headlines(plan)
      )
      + html.escape(_plan_view.totals_text(plan))
    )
  if chart:
    parts.append(f'<div style="max-width:100%">{chart}</div>')
  if not summary and plan.entries:
    parts.append(
      table_html(
        _plan_view.rows(plan.entries, expand=expand),
        _plan_view.columns_of(plan.entries),
      )
    )
  if summary:
    largest = _plan_view.largest_replicated(plan)
    if largest:
      items = ''.join(
        f'<li><code>{_path_html(e.path)}</code> {html.escape(_plan_view.shape_text(e))} '
        f'{_text.human_bytes(e.bytes)}</li>'
        for e in largest
      )
      parts.append(f'<b>Largest replicated</b><ul>{items}</ul>')
  groups = _plan_view.fallback_groups(plan.entries)
  if groups:
    items = ''.join(
      f'<li>{html.escape(reason)} ({len(paths)})'
      + (
        ''
        if summary
        else '<br><small>'
        + ', '.join(
          f'<code>{_path_html(p)}</code>'
          for p in _plan_view.path_labels(paths, expand=expand)
        )
        + '</small>'
      )
      + '</li>'
      for reason, paths in groups
    )
    parts.append(f'<b>Fallbacks</b><ul>{items}</ul>')
  return ''.join(parts) + '</div>'
