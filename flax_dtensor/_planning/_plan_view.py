"""How a ShardingPlan looks in a terminal of any width, or piped.

Paths are never cut. Variables alike but for an integer path component
share a row (`rows`: ``layers/{0..23}/attn/kernel ×24``) unless expanded.
A table is used when every path fits whole beside the other columns; below
that width each row takes two lines, its path on the first, the second
broken only between its parts. Fallbacks are grouped by reason under the
table, with the variables each one affects. Sizes, counts and paths are
written by `_text`; the same rows in Jupyter are `_plan_html`'s, which
device holds which block `_plan_blocks`'.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import re
from collections.abc import Iterable, Sequence
from typing import Any

import rich.box
import rich.console
import rich.markup
import rich.padding
import rich.table
import rich.text

from flax_dtensor import _text
from flax_dtensor._planning import _plan
from flax_dtensor._rules import _missing_axes, _partition_specs

LARGEST = 5
"""How many of the largest replicated variables the summary names."""

_FALLBACK = re.compile(r'^dim \d+ \((?P<name>.*?)\): (?P<why>.*)$')
TYPO_REASON = _missing_axes.TYPO_REASON


# What the views show
# ------------------------------------------------------------------------------


def mesh_text(plan: _plan.ShardingPlan) -> str:
  """'mesh data=2, model=4 (8 devices)'.

  Axes of size 1 are named apart, as left out of the specs shown, when
  some axis is larger: 'mesh fsdp=2, tensor=4 (8 devices; size 1, not
  shown in specs: data, stage)'.

  Variables on meshes of their own (`PlanEntry.mesh`) are counted:
  'mesh data=2, model=4 (8 devices), and 2 more meshes named by variables
  (a=2 (devices 0-1); c=4 (devices 4-7))'.
  """
  own = sorted({e.mesh for e in plan.entries if e.mesh is not None})
  if not own:
    return _plain_mesh_text(plan)
  listed = '; '.join(own)
  if plan.mesh_axes:
    more = '1 more mesh' if len(own) == 1 else f'{len(own)} more meshes'
    return f'{_plain_mesh_text(plan)}, and {more} named by variables ({listed})'
  if len(own) == 1:
    return f'mesh {own[0]} (named by the variables)'
  devices = _text.count(plan.num_devices, 'device')
  return f'{len(own)} meshes named by the variables ({listed}; {devices})'


def _plain_mesh_text(plan: _plan.ShardingPlan) -> str:
  if not plan.mesh_axes:
    return 'no mesh (1 device)'
  unit = [k for k, v in plan.mesh_axes.items() if v == 1]
  shown = {k: v for k, v in plan.mesh_axes.items() if v != 1}
  devices = _text.count(plan.num_devices, 'device')
  if unit and shown:
    devices += f'; size 1, not shown in specs: {", ".join(unit)}'
  elif unit:  # One device: the specs show them, as JAX's types do.
    shown = plan.mesh_axes
  axes = ', '.join(f'{k}={v}' for k, v in shown.items())
  return f'mesh {axes} ({devices})'


def totals_text(plan: _plan.ShardingPlan) -> str:
  ideal = plan.ideal_bytes_per_device
  ratio = plan.bytes_per_device / ideal if ideal else 1.0
  text = (
    f'{_text.human_bytes(plan.bytes_per_device)} per device of '
    f'{_text.human_bytes(plan.total_bytes)} in {len(plan.entries)} variables; '
    f'ideal {_text.human_bytes(ideal)} ({ratio:.2f}x)'
  )
  parts = {k: v for k, v in plan.bytes_per_device_by_category().items() if v}
  if len(parts) > 1:
    text += ' = ' + ' + '.join(
      f'{_text.human_bytes(v)} {k}' for k, v in parts.items()
    )
  return text


def shape_text(entry: _plan.PlanEntry) -> str:
  """'float32[64,128]'."""
  return f'{entry.dtype}[{",".join(map(str, entry.shape))}]'


def axes_text(entry: _plan.PlanEntry) -> str:
  if entry.logical_axes is None:
    return '-'
  return repr(tuple(entry.logical_axes))


def spec_text(entry: _plan.PlanEntry) -> str:
  """ "P('fsdp', None)", and where it is placed when that differs.

  Without the mesh axes of size 1 (`PlanEntry.display_spec`); the spec
  as resolved is `PlanEntry.spec`, and in the JSON.
  """
  text = _partition_specs.format_spec(entry.display_spec)
  if entry.misplaced:
    text += (
      f' (placed {_partition_specs.format_spec(entry.display_placed or ())})'
    )
  return text


def fallback_groups(
  entries: Iterable[_plan.PlanEntry],
) -> list[tuple[str, list[str]]]:
  """[(reason, paths it affects)], most variables first.

  A reason is the logical name, the skipped target and why, whichever
  dimension it was taken on: "'fsdp' -> 'fsdp': the mesh has no axis".
  """
  groups: dict[str, list[str]] = collections.defaultdict(list)
  for e in entries:
    for line in e.fallbacks:
      m = _FALLBACK.match(line)
      reason = f'{m["name"]} -> {m["why"]}' if m else line
      if e.path not in groups[reason]:
        groups[reason].append(e.path)
  return sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))


def largest_replicated(
  plan: _plan.ShardingPlan, n: int = LARGEST
) -> list[_plan.PlanEntry]:
  """The `n` largest variables every device holds whole (if any devices)."""
  if plan.num_devices <= 1:
    return []
  whole = [
    e for e in plan.entries if e.bytes_per_device == e.bytes and e.bytes > 0
  ]
  return sorted(whole, key=lambda e: (-e.bytes, e.path))[:n]


# Layers that repeat, as one row
# ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
  """One row of a view: a variable, or variables alike but for an index.

  Attributes:
    path: The path, or the pattern of the paths it stands for:
      ``layers/{0..23}/attn/query/kernel``.
    entries: The variables, in path order (one when not collapsed).
  """

  path: str
  entries: tuple[_plan.PlanEntry, ...]

  @property
  def entry(self) -> _plan.PlanEntry:
    return self.entries[0]

  @property
  def label(self) -> str:
    """'layers/{0..23}/attn/query/kernel ×24', or the path alone."""
    n = len(self.entries)
    return self.path if n == 1 else f'{self.path} \u00d7{n}'


def _alike(e: _plan.PlanEntry) -> tuple[Any, ...]:
  """What must be equal for two variables to share a row: all but the path."""
  return (
    e.kind,
    e.shape,
    e.dtype,
    e.logical_axes,
    e.spec,
    e.fallbacks,
    e.placed,
    e.category,
    e.source,
    e.misplaced_reason,
    e.creation,
    e.bytes_per_device,
    e.mesh,
  )


def rows(
  entries: Iterable[_plan.PlanEntry], *, expand: bool = False
) -> list[Row]:
  """The rows a view shows: variables identical but for an integer path
  component (same shape, dtype, spec, reasons) as one, unless `expand`."""
  entries = list(entries)
  if expand:
    return [Row(e.path, (e,)) for e in entries]
  found = _text.collapse_paths([(e.path, _alike(e)) for e in entries])
  return [Row(p, tuple(entries[i] for i in idx)) for p, idx in found]


def path_labels(paths: Sequence[str], *, expand: bool = False) -> list[str]:
  """`paths`, those alike but for an index as one: 'a/{0..3}/b ×4'."""
  if expand:
    return list(paths)
  found = _text.collapse_paths([(p, None) for p in paths])
  return [p if len(idx) == 1 else f'{p} \u00d7{len(idx)}' for p, idx in found]


# Terminal (rich)
# ------------------------------------------------------------------------------

_COLUMNS = (
  'path',
  'type',
  'shape',
  'logical axes',
  'spec',
  'mesh',
  'source',
  'per device',
)


def by_path_rules(entries: Iterable[_plan.PlanEntry]) -> bool:
  """Whether a path rule placed any of the entries, or matched one that an
  annotation kept (both are shown in the 'source' column)."""
  return any('path rule' in (e.source or '') for e in entries)


def columns_of(entries: Sequence[_plan.PlanEntry]) -> tuple[str, ...]:
  """The table's columns: 'type' only when the variables' types differ,
  'mesh' only when a variable names a mesh of its own, 'source' only when
  a path rule placed or matched a variable."""
  drop = set()
  if all(e.mesh is None for e in entries):
    drop.add('mesh')
  if len({e.kind for e in entries}) <= 1:
    drop.add('type')
  if not by_path_rules(entries):
    drop.add('source')
  return tuple(c for c in _COLUMNS if c not in drop)


def cells_of(row: Row, columns: Sequence[str]) -> list[str]:
  e = row.entry
  values = {
    'path': row.label,
    'type': e.kind,
    'shape': shape_text(e),
    'logical axes': axes_text(e),
    'spec': spec_text(e),
    'mesh': e.mesh or _PLAN_MESH,
    'source': e.source or '-',
    'per device': _text.human_bytes(e.bytes_per_device),
  }
  return [values[c] for c in columns]


def _table(rows_: Sequence[Row], columns: Sequence[str]) -> rich.table.Table:
  table = rich.table.Table(
    box=rich.box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 1)
  )
  for name in columns:
    table.add_column(
      name,
      no_wrap=True,
      justify='right' if name == 'per device' else 'left',
    )
  for row in rows_:
    table.add_row(*(rich.markup.escape(c) for c in cells_of(row, columns)))
  return table


_PLAN_MESH = "the plan's mesh"


def _stacked(
  rows_: Sequence[Row], columns: Sequence[str], width: int
) -> rich.console.Group:
  """Two lines per row: the whole path, then what it becomes.

  The second breaks only between its parts (a spec is never cut inside a
  name), each line after it indented to the shape's column.
  """
  items: list[Any] = []
  for row in rows_:
    e = row.entry
    items.append(rich.text.Text(row.label, style='bold', overflow='fold'))
    segments = [
      f'{_text.human_bytes(e.bytes_per_device):>9}',
      e.kind if 'type' in columns else '',
      shape_text(e),
      f'{axes_text(e)} ->',
      (' ', _partition_specs.format_spec(e.display_spec)),
      (
        ' ',
        f'(placed {_partition_specs.format_spec(e.display_placed or ())})'
        if e.misplaced
        else '',
      ),
      f'on {e.mesh or _PLAN_MESH}' if 'mesh' in columns else '',
      f'[{e.source or "-"}]' if 'source' in columns else '',
    ]
    for line in _text.fill(segments, max(width - 2, 20), hanging=11):
      items.append(
        rich.padding.Padding(
          rich.text.Text(line, no_wrap=True, overflow='fold'), (0, 0, 0, 2)
        )
      )
  return rich.console.Group(*items)


def fallbacks_text(groups: Sequence[tuple[str, list[str]]]) -> str:
  """'Fallbacks: 3 reasons, 17 variables'; where some reasons are likely
  typos, those the rules intend and the typos counted apart: 'Fallbacks: 1
  intended reason, 17 variables; 1 likely typo, 17 variables'."""

  def variables(chosen: Sequence[tuple[str, list[str]]]) -> str:
    paths = {p for _, paths in chosen for p in paths}
    return _text.count(len(paths), 'variable')

  typos = [g for g in groups if TYPO_REASON in g[0]]
  if not typos:
    return (
      f'Fallbacks: {_text.count(len(groups), "reason")}, {variables(groups)}'
    )
  intended = [g for g in groups if TYPO_REASON not in g[0]]
  text = 'Fallbacks: '
  if intended:
    text += (
      f'{_text.count(len(intended), "intended reason")}, '
      f'{variables(intended)}; '
    )
  return text + f'{_text.count(len(typos), "likely typo")}, {variables(typos)}'


def typo_headlines(plan: _plan.ShardingPlan) -> list[str]:
  """'Likely typo: ...' for each rule of `plan.likely_typos`."""
  return [f'Likely typo: {t}' for t in plan.likely_typos]


def _lines(lines: Iterable[str], style: str = '') -> list[Any]:
  return [rich.text.Text(line, style=style, no_wrap=True) for line in lines]


def _listed(labels: Sequence[str], width: int) -> list[Any]:
  """Paths after a reason: indented by 6, broken only between paths."""
  items = [f'{p},' for p in labels[:-1]] + list(labels[-1:])
  lines = _text.fill(items, max(width - 6, 20), hanging=0, sep=' ')
  return _lines((' ' * 6 + line for line in lines), style='dim')


def _fallbacks_and_notes(
  entries: Sequence[_plan.PlanEntry],
  width: int,
  *,
  list_paths: bool,
  expand: bool = False,
) -> list[Any]:
  """What the table's rows leave out, grouped by the reason: the
  fallbacks, the variables not where the rules say, and the path-ruled
  ones created, then moved (`_creation_order.MOVED`)."""
  groups = fallback_groups(entries)
  fallbacks: list[Any] = []
  if groups:
    fallbacks = [
      rich.text.Text(fallbacks_text(groups), style='bold'),
      *_reasons(groups, width, list_paths=list_paths, expand=expand),
    ]
  return [
    *fallbacks,
    *_by_reason(
      'Not where the rules say',
      (
        (e.misplaced_reason or 'placed elsewhere', e.path)
        for e in entries
        if e.misplaced
      ),
      width,
      list_paths=list_paths,
      expand=expand,
    ),
    *_by_reason(
      'Created, then moved',
      (
        (e.creation, e.path)
        for e in entries
        if e.creation and e.creation.startswith('moved when ')
      ),
      width,
      list_paths=list_paths,
      expand=expand,
    ),
  ]


def _by_reason(
  title: str,
  found: Iterable[tuple[str, str]],
  width: int,
  *,
  list_paths: bool,
  expand: bool = False,
) -> list[Any]:
  """'TITLE: N variables', then each reason with its count (and paths)."""
  groups: dict[str, list[str]] = {}
  for reason, path in found:
    groups.setdefault(reason, []).append(path)
  if not groups:
    return []
  total = sum(len(p) for p in groups.values())
  return [
    rich.text.Text(f'{title}: {_text.count(total, "variable")}', style='bold'),
    *_reasons(groups.items(), width, list_paths=list_paths, expand=expand),
  ]


def _reasons(
  groups: Iterable[tuple[str, list[str]]],
  width: int,
  *,
  list_paths: bool,
  expand: bool,
) -> list[Any]:
  """Each reason with its count of variables (and their paths)."""
  out: list[Any] = []
  for reason, paths in groups:
    n = _text.count(len(paths), 'variable')
    out.extend(_lines(_text.hanging_lines(f'{reason} ({n})', width)))
    if list_paths:
      out.extend(_listed(path_labels(paths, expand=expand), width))
  return out


def renderables(
  plan: _plan.ShardingPlan,
  width: int,
  *,
  summary: bool = False,
  expand: bool = False,
) -> list[Any]:
  """What the plan prints at `width` columns: the full view or the summary.

  Variables alike but for an integer path component share a row unless
  `expand` (`rows`).
  """
  out: list[Any] = [
    rich.text.Text(f'Sharding plan: {mesh_text(plan)}', style='bold'),
    *(
      rich.text.Text(part, style='bold red', no_wrap=True)
      for line in typo_headlines(plan)
      for part in _text.hanging_lines(line, width, indent=0, hanging=2)
    ),
    rich.text.Text(totals_text(plan)),
  ]
  if summary:
    largest = largest_replicated(plan)
    if largest:
      out.append(
        rich.text.Text(
          f'Largest replicated ({len(largest)} of '
          f'{len(largest_replicated(plan, len(plan.entries)))}):',
          style='bold',
        )
      )
      for e in largest:
        out.append(
          rich.padding.Padding(
            rich.text.Text(
              f'{e.path}  {shape_text(e)}  {_text.human_bytes(e.bytes)}',
              overflow='fold',
            ),
            (0, 0, 0, 2),
          )
        )
    out.extend(_fallbacks_and_notes(plan.entries, width, list_paths=False))
    return out
  if plan.entries:
    rows_ = rows(plan.entries, expand=expand)
    columns = columns_of(plan.entries)
    table = _table(rows_, columns)
    fits = _text.measure(table) <= width
    out.append(table if fits else _stacked(rows_, columns, width))
  out.extend(
    _fallbacks_and_notes(plan.entries, width, list_paths=True, expand=expand)
  )
  return out


def render_text(
  plan: _plan.ShardingPlan,
  width: int | None = None,
  *,
  summary: bool = False,
  expand: bool = False,
) -> str:
  """The plan as plain text at `width` columns (default: the terminal's)."""
  width = _text.terminal_width() if width is None else width
  buffer = io.StringIO()
  console = _text.console(buffer, width)
  for item in renderables(plan, width, summary=summary, expand=expand):
    console.print(item)
  return '\n'.join(line.rstrip() for line in buffer.getvalue().splitlines())
