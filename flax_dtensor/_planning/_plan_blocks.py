"""Which device holds which block of a variable, for any number of
dimensions: `device_blocks` counts them, `blocks_text` draws them (a grid
where at most two dimensions are split).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

import rich.box
import rich.table
import rich.text

from flax_dtensor import _text
from flax_dtensor._planning import _plan, _plan_view
from flax_dtensor._rules import _partition_specs


def device_blocks(
  shape: Sequence[int],
  spec: Any,
  mesh_axes: dict[str, int] | None,
) -> dict[tuple[tuple[int, int], ...], list[int]]:
  """{block (start, stop) per dimension: mesh positions holding it}.

  A mesh position is a device's index in the mesh's devices, read in row
  order (``mesh.devices.flat``). A dimension split over several mesh axes
  is split major to minor in the order the spec names them, as in JAX.
  """
  axes = dict(mesh_axes or {})
  names = list(axes)
  size = math.prod(axes.values()) if axes else 1
  entries = _partition_specs.canonical(spec, len(shape))
  blocks: dict[tuple[tuple[int, int], ...], list[int]] = {}
  for position in range(size):
    coords: dict[str, int] = {}
    rest = position
    for name in reversed(names):
      coords[name] = rest % axes[name]
      rest //= axes[name]
    block = []
    for dim, dim_axes in zip(shape, entries, strict=True):
      n, k = 1, 0
      for name in dim_axes:
        k = k * axes[name] + coords[name]
        n *= axes[name]
      step = -(-dim // n) if n else dim
      block.append((min(k * step, dim), min((k + 1) * step, dim)))
    blocks.setdefault(tuple(block), []).append(position)
  return blocks


def _range_text(block: Sequence[tuple[int, int]], shape: Sequence[int]) -> str:
  return (
    '['
    + ', '.join(
      ':' if (a, b) == (0, n) else f'{a}:{b}'
      for (a, b), n in zip(block, shape, strict=True)
    )
    + ']'
  )


def _devices_text(positions: Sequence[int]) -> str:
  return ','.join(map(str, positions))


def blocks_text(
  entry: _plan.PlanEntry,
  mesh_axes: dict[str, int] | None,
  width: int | None = None,
) -> str:
  """Which mesh position holds which block of `entry`, as text.

  A grid when at most two dimensions are split (rows: the first split
  dimension's blocks; columns: the second's), then one line per block.
  """
  width = _text.terminal_width() if width is None else width
  blocks = device_blocks(entry.shape, entry.spec, mesh_axes)
  split = [
    d for d in range(len(entry.shape)) if len({b[d] for b in blocks}) > 1
  ]
  buffer = io.StringIO()
  console = _text.console(buffer, width)
  console.print(
    rich.text.Text(
      f'{entry.path}  {_plan_view.shape_text(entry)}  {_plan_view.spec_text(entry)}',
      overflow='fold',
    )
  )
  console.print(
    f'{_text.count(len(blocks), "block")} of '
    f'{_text.count(sum(map(len, blocks.values())), "mesh position")} '
    f'({mesh_text_axes(mesh_axes)}); each block held by the positions listed'
  )
  if 1 <= len(split) <= 2:
    rows_dim = split[0]
    cols_dim = split[1] if len(split) == 2 else None
    row_keys = sorted({b[rows_dim] for b in blocks})
    col_keys = (
      sorted({b[cols_dim] for b in blocks}) if cols_dim is not None else [None]
    )
    grid = rich.table.Table(
      box=rich.box.SQUARE, show_header=cols_dim is not None
    )
    grid.add_column(f'dim {rows_dim}', no_wrap=True)
    for c in col_keys:
      grid.add_column(
        f'dim {cols_dim} {c[0]}:{c[1]}' if c is not None else 'devices',
        justify='center',
      )
    for r in row_keys:
      cells = []
      for c in col_keys:
        held = sorted(
          p
          for b, ps in blocks.items()
          for p in ps
          if b[rows_dim] == r and (cols_dim is None or b[cols_dim] == c)
        )
        cells.append(_devices_text(held))
      grid.add_row(f'{r[0]}:{r[1]}', *cells)
    console.print(grid)
  for block, positions in sorted(blocks.items()):
    console.print(
      f'  {_range_text(block, entry.shape)} -> {_devices_text(positions)}'
    )
  return '\n'.join(line.rstrip() for line in buffer.getvalue().splitlines())


def mesh_text_axes(mesh_axes: dict[str, int] | None) -> str:
  if not mesh_axes:
    return 'no mesh'
  return ', '.join(f'{k}={v}' for k, v in mesh_axes.items())
