"""ShardingPlan: what goes where, and why, for every variable of a model.

The plan's data model (`PlanEntry`, `ShardingPlan`, the views' handles
`PlanView` and `BlockMap`) and its JSON form, written (`to_dict`) and read
back (`plan_from_dict`, a golden layout). `_plan_build` builds it from a
model; the views render it, reached by late imports.
"""

from __future__ import annotations

import dataclasses
import difflib
import html
import json
import math
from collections.abc import Iterator
from typing import Any

import rich.console
from jax.sharding import PartitionSpec

# The public namespace names the diff (`flax_dtensor.PlanDiff`) for type
# checkers without importing it: the views (`_plan_view`, `_plan_html`,
# `_plan_blocks`, `_plan_chart`) and the diff (`_plan_diff`) import this
# model, and its methods reach them by a late import.
import flax_dtensor
from flax_dtensor import _errors
from flax_dtensor._rules import _partition_specs


def shard_shape(
  shape: tuple[int, ...], spec: PartitionSpec, sizes: dict[str, int] | None
) -> tuple[int, ...]:
  if sizes is None:
    return shape
  out = []
  padded = tuple(spec) + (None,) * (len(shape) - len(spec))
  for dim, entry in zip(shape, padded, strict=True):
    if entry is PartitionSpec.UNCONSTRAINED:
      out.append(dim)
      continue
    n = math.prod(sizes[m] for m in _partition_specs.axes_of(entry))
    out.append(-(-dim // n))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class PlanEntry:
  """The plan for one variable.

  Attributes:
    path: The variable's path, joined with '/' (``layers/0/attn/kernel``).
    kind: The variable type (``Param``, ``OptState``, ...).
    shape: The global shape.
    dtype: The dtype's name.
    logical_axes: The logical axes it is annotated with, or None.
    spec: The resolved PartitionSpec of mesh axes.
    bytes: The global size in bytes.
    bytes_per_device: The size of one device's shard in bytes.
    fallbacks: One line per skipped candidate: dimension, logical name,
      the skipped target and why.
    placed: Where the array actually is (its NamedSharding's spec), for
      arrays that carry a sharding; None otherwise. It places the array
      otherwise than `spec` (see `misplaced`) when the model was placed
      under other rules, or not at all.
    category: ``'params'`` (``nnx.Param``), ``'optimizer'``
      (``nnx.OptState``: mu, nu, the step count) or ``'other'`` (batch
      statistics, RNG state, the arrays of a plain pytree, ...).
    source: What decided `spec`: ``'annotation'`` (the variable's logical
      axes), ``"path rule #k 'pattern'"`` (the k-th path rule, counting
      from 0), or ``'none (...)'`` with the reason nothing did (replicated,
      left where it is, too small for path rules). None in layouts written
      before the plan had sources.
    misplaced_reason: For a `misplaced` entry, why the array is not where
      the rules say (e.g. it was created while Flax's eager sharding was
      off), and how to place it; None otherwise.
    creation: How flax_dtensor created a variable a path rule covers:
      ``'in its shards'`` (built under a jit that computes only its
      shards), or ``'moved when ...'`` with the reason; None
      when it does not know (not created under path rules, or changed
      since).
    mesh: The mesh the variable goes on when it is not the plan's, in
      words (``'a=2, b=2 (devices 0-3)'``): its ``mesh`` metadata (or its
      concrete ``out_sharding``) names one of its own, which wins, as in
      Flax. None for a variable on the plan's mesh.
    mesh_axes: The axes and sizes of the mesh the variable goes on (the
      plan's, as `ShardingPlan.mesh_axes`, unless `mesh` names its own),
      or None: what `misplaced`, the bytes per device and the shown specs
      read the axes of size 1 from.
  """

  path: str
  kind: str
  shape: tuple[int, ...]
  dtype: str
  logical_axes: tuple[str | None, ...] | None
  spec: PartitionSpec
  bytes: int
  bytes_per_device: int
  fallbacks: tuple[str, ...]
  placed: PartitionSpec | None = None
  category: str = 'other'
  source: str | None = None
  misplaced_reason: str | None = None
  creation: str | None = None
  mesh: str | None = None
  mesh_axes: dict[str, int] | None = dataclasses.field(
    default=None, compare=False, repr=False
  )

  @property
  def misplaced(self) -> bool:
    """Whether the array is placed other than the rules say.

    Placements are compared, not spellings: which devices hold which block.
    Mesh axes of size 1 split nothing, so ``P('fsdp', None, 'tensor')`` is
    where ``P(('fsdp', 'context'), 'stage', 'tensor')`` says when
    ``context`` and ``stage`` have size 1.
    """
    return self.placed is not None and not _partition_specs.same_placement(
      self.placed, self.spec, len(self.shape), self.mesh_axes
    )

  @property
  def display_spec(self) -> PartitionSpec:
    """`spec` as the plan prints it: without the mesh axes of size 1 that
    its headline names (whole on a mesh of the variable's own, `mesh`)."""
    return self._shown(self.spec)

  @property
  def display_placed(self) -> PartitionSpec | None:
    """`placed` as the plan prints it, as `display_spec`."""
    if self.placed is None:
      return None
    return self._shown(self.placed)

  def _shown(self, spec: PartitionSpec) -> PartitionSpec:
    if self.mesh is not None:  # The headline names the plan's mesh only.
      return spec
    return _partition_specs.without_unit_axes(spec, self.mesh_axes)

  def to_dict(self) -> dict[str, Any]:
    own = (
      {}
      if self.mesh is None
      else {'mesh': self.mesh, 'mesh_axes': dict(self.mesh_axes or {})}
    )
    return {
      **own,
      'path': self.path,
      'kind': self.kind,
      'shape': list(self.shape),
      'dtype': self.dtype,
      'logical_axes': (
        list(self.logical_axes) if self.logical_axes is not None else None
      ),
      'spec': [
        list(e) if isinstance(e, tuple) else e for e in tuple(self.spec)
      ],
      'bytes': self.bytes,
      'bytes_per_device': self.bytes_per_device,
      'fallbacks': list(self.fallbacks),
      'placed': (
        None
        if self.placed is None
        else [list(e) if isinstance(e, tuple) else e for e in self.placed]
      ),
      'category': self.category,
      'source': self.source,
      'misplaced_reason': self.misplaced_reason,
      'creation': self.creation,
    }


@dataclasses.dataclass(frozen=True, repr=False)
class ShardingPlan:
  """Where every variable of a model goes, and why.

  Print it (a table at the terminal's width, paths never cut, repeated
  layers as one row), show it in a notebook (HTML, with a chart of the
  bytes per device), or use `to_dict` / `to_json` for data; `summary()`
  for the compact view, `table(expand=True)` for one row per variable,
  `show(path)` for where one variable's blocks are, `to_html()` for a page.

  Attributes:
    entries: One `PlanEntry` per variable, in path order.
    mesh_axes: The mesh's axis names and sizes, or None without a mesh.
    num_devices: The number of devices in the mesh (1 without a mesh).
    likely_typos: One line per rule naming a mesh axis the mesh lacks,
      spelled like one it has (``"('embed', 'dta') names mesh axis 'dta',
      which the mesh lacks: did you mean 'data'?"``), and per logical name
      of an annotation that no rule mentions, spelled like one they do
      (replicated under ``unknown='replicate'``), shown as the plan's
      headline. Rules naming other missing axes are intended fallbacks.
  """

  entries: tuple[PlanEntry, ...]
  mesh_axes: dict[str, int] | None
  num_devices: int
  likely_typos: tuple[str, ...] = ()

  @property
  def total_bytes(self) -> int:
    """The bytes of all variables together (one copy)."""
    return sum(e.bytes for e in self.entries)

  @property
  def bytes_per_device(self) -> int:
    """The bytes one device holds (replicated variables count fully)."""
    return sum(e.bytes_per_device for e in self.entries)

  def bytes_per_device_by_category(self) -> dict[str, int]:
    """{'params': ..., 'optimizer': ..., 'other': ...}: what one device holds.

    Plan the model with its optimizer (``plan(model, optimizer=...)``) to
    count the optimizer state; with the batch, this is what a compiled
    training step takes as arguments (see `memory_report`).
    """
    out = dict.fromkeys(('params', 'optimizer', 'other'), 0)
    for e in self.entries:
      out[e.category] = out.get(e.category, 0) + e.bytes_per_device
    return out

  @property
  def ideal_bytes_per_device(self) -> float:
    """The total bytes divided by the device count (perfect sharding)."""
    return self.total_bytes / self.num_devices

  def to_dict(self) -> dict[str, Any]:
    return {
      'mesh': self.mesh_axes,
      'num_devices': self.num_devices,
      'variables': [e.to_dict() for e in self.entries],
      'total_bytes': self.total_bytes,
      'bytes_per_device': self.bytes_per_device,
      'ideal_bytes_per_device': self.ideal_bytes_per_device,
      'likely_typos': list(self.likely_typos),
    }

  def to_json(self, **kwargs: Any) -> str:
    """The plan as JSON (`from_json` reads it back): a golden layout."""
    return json.dumps(self.to_dict(), **kwargs)

  @classmethod
  def from_json(cls, text: str) -> ShardingPlan:
    """The plan `to_json` wrote (``flax-dtensor plan --json``).

    Raises:
      LayoutFileError: If `text` is not JSON, or not a plan.
    """
    return plan_from_json(text)

  def diff(self, golden: ShardingPlan) -> flax_dtensor.PlanDiff:
    """What changed from `golden` to this plan, variable by variable.

    What moved (a different spec), what changed size per device (shape,
    dtype or sharding), which fallbacks changed, and which variables were
    added or removed. The result is false when nothing changed.

    Example:
      >>> import jax, flax_dtensor as fdt
      >>> from flax import nnx
      >>> init = nnx.with_partitioning(nnx.initializers.ones, ('embed', 'mlp'))
      >>> mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
      >>> make = lambda: nnx.Linear(8, 16, kernel_init=init, rngs=nnx.Rngs(0))
      >>> golden = fdt.plan(make, mesh=mesh,
      ...                   rules=[('embed', 'data'), ('mlp', 'model')])
      >>> now = fdt.plan(make, mesh=mesh,
      ...                rules=[('embed', None), ('mlp', 'model')])
      >>> d = now.diff(golden)
      >>> d.moved
      ('kernel',)
      >>> print(d)
      1 changed, 0 added, 0 removed; per device 128 B -> 192 B
      kernel
        spec P('data', 'model') -> P(None, 'model')
        per device 64 B -> 128 B
      >>> bool(now.diff(now))
      False
    """
    from flax_dtensor._planning import _plan_diff

    return _plan_diff.diff(self, golden)

  def bytes_by_device(self) -> dict[str, list[int]]:
    """{'params': [...], 'optimizer': [...], 'other': [...]}: what each
    device holds, by mesh position (``mesh.devices.flat``).

    Where every sharded dimension divides evenly, each device holds
    `bytes_per_device_by_category`; a block that ends short counts what it
    holds. This is what the chart of `to_html` draws.
    """
    from flax_dtensor._planning import _plan_chart

    return _plan_chart.device_bytes(self)

  def closest_paths(self, path: str, n: int = 3) -> list[str]:
    """The `n` paths of the plan spelled most like `path` (difflib)."""
    paths = [e.path for e in self.entries]
    return difflib.get_close_matches(path, paths, n=n, cutoff=0.6)

  def __getitem__(self, path: str) -> PlanEntry:
    for e in self.entries:
      if e.path == path:
        return e
    close = self.closest_paths(path)
    hint = (
      f'did you mean {", ".join(map(repr, close))}?'
      if close
      else 'no path is spelled like it'
    )
    raise KeyError(
      f"No variable at {path!r} among the plan's {len(self.entries)}; "
      f'{hint} (`plan.entries` lists them).'
    )

  def render(
    self,
    width: int | None = None,
    *,
    summary: bool = False,
    expand: bool = False,
  ) -> str:
    """The plan as plain text, `width` columns wide.

    Args:
      width: Columns; defaults to the terminal's width, or ``COLUMNS``, or
        80 when piped. Paths are never cut: below the width a table needs,
        each variable takes two lines.
      summary: Only the totals, the largest replicated variables and the
        fallbacks grouped by reason (see `summary`).
      expand: One row per variable. By default, variables that differ only
        in an integer path component, with the same shape, dtype, spec
        and reasons, share a row: ``layers/{0..23}/attn/kernel ×24``.
    """
    from flax_dtensor._planning import _plan_view

    return _plan_view.render_text(self, width, summary=summary, expand=expand)

  def summary(self) -> PlanView:
    """The compact view: totals per device against the ideal, the largest
    replicated variables, and each fallback reason with its variable count.

    Print it, or show it in a notebook.
    """
    return PlanView(self, summary=True)

  def table(self, *, expand: bool = False) -> PlanView:
    """The full view; with `expand`, one row per variable (repeated layers
    not collapsed). Print it, or show it in a notebook."""
    return PlanView(self, summary=False, expand=expand)

  def to_html(self, *, budget: int | None = None, expand: bool = False) -> str:
    """One self-contained HTML page (no script, nothing fetched).

    The bytes each device holds as a chart (parameters, optimizer state
    and other variables stacked; the ideal and `budget` as lines), the
    mesh as a grid coloured by load, and the plan's table (repeated
    layers collapsed unless `expand`). ``flax-dtensor plan --html FILE``
    writes it.
    """
    from flax_dtensor._planning import _plan_chart

    return _plan_chart.page(self, budget=budget, expand=expand)

  def show(self, path: str) -> BlockMap:
    """Which device holds which block of the variable at `path`.

    Works for any number of dimensions. Devices are their positions in the
    mesh (``mesh.devices.flat``). Print it, or show it in a notebook.

    Raises:
      KeyError: If no variable has this path; the message names the
        closest paths.
    """
    return BlockMap(self[path], self.mesh_axes)

  def __rich_console__(
    self, console: rich.console.Console, options: rich.console.ConsoleOptions
  ) -> Iterator[Any]:
    from flax_dtensor._planning import _plan_view

    yield from _plan_view.renderables(self, options.max_width)

  def __str__(self) -> str:
    return self.render()

  __repr__ = __str__

  def _repr_html_(self) -> str:
    from flax_dtensor._planning import _plan_chart

    return _plan_chart.notebook_html(self)


class PlanView:
  """A view of a plan (the summary, or the table expanded or not) for
  terminals, text and notebooks."""

  def __init__(
    self, plan_: ShardingPlan, *, summary: bool, expand: bool = False
  ) -> None:
    self.plan = plan_
    self.is_summary = summary
    self.expand = expand

  def render(self, width: int | None = None) -> str:
    from flax_dtensor._planning import _plan_view

    return _plan_view.render_text(
      self.plan, width, summary=self.is_summary, expand=self.expand
    )

  def __rich_console__(
    self, console: rich.console.Console, options: rich.console.ConsoleOptions
  ) -> Iterator[Any]:
    from flax_dtensor._planning import _plan_view

    yield from _plan_view.renderables(
      self.plan,
      options.max_width,
      summary=self.is_summary,
      expand=self.expand,
    )

  def __str__(self) -> str:
    return self.render()

  __repr__ = __str__

  def _repr_html_(self) -> str:
    from flax_dtensor._planning import _plan_chart, _plan_html

    if self.is_summary:
      return _plan_html.render_html(self.plan, summary=True)
    return _plan_chart.notebook_html(self.plan, expand=self.expand)


class BlockMap:
  """Which mesh position holds which block of one variable (`plan.show`).

  Attributes:
    entry: The variable's `PlanEntry`.
    blocks: {block, as (start, stop) per dimension: the mesh positions
      holding it}.
  """

  def __init__(
    self, entry: PlanEntry, mesh_axes: dict[str, int] | None
  ) -> None:
    from flax_dtensor._planning import _plan_blocks

    self.entry = entry
    self.mesh_axes = mesh_axes
    self.blocks = _plan_blocks.device_blocks(entry.shape, entry.spec, mesh_axes)

  def render(self, width: int | None = None) -> str:
    from flax_dtensor._planning import _plan_blocks

    return _plan_blocks.blocks_text(self.entry, self.mesh_axes, width)

  def __str__(self) -> str:
    return self.render()

  __repr__ = __str__

  def _repr_html_(self) -> str:
    return f'<pre>{html.escape(self.render(100))}</pre>'


# Reading a plan back (golden layouts)
# ------------------------------------------------------------------------------

_FIX = (
  'Write it with `flax-dtensor plan TARGET --json > FILE` or '
  '`fdt.plan(...).to_json()`.'
)


def _spec_from_entries(entries: Any, where: str) -> PartitionSpec:
  if not isinstance(entries, list):
    raise _errors.LayoutFileError(
      f'{where}: expected a spec as a list (one entry per dimension: null, '
      f'a mesh axis name or a list of them); got {entries!r}. {_FIX}'
    )
  return PartitionSpec(
    *(tuple(e) if isinstance(e, list) else e for e in entries)
  )


def plan_from_dict(data: Any, source: str = 'the layout') -> ShardingPlan:
  """The plan `ShardingPlan.to_dict` wrote.

  Raises:
    LayoutFileError: If `data` is not such a dict; the message names the
      first bad field.
  """
  fix = _FIX
  if not isinstance(data, dict) or not isinstance(data.get('variables'), list):
    raise _errors.LayoutFileError(
      f'{source} is not a plan: expected a JSON object with a "variables" '
      f'list; got {type(data).__name__}. {fix}'
    )
  mesh = data.get('mesh')
  mesh_axes = dict(mesh) if mesh else None
  entries = []
  for i, v in enumerate(data['variables']):
    where = f'{source}, variable {i}'
    try:
      entries.append(
        PlanEntry(
          path=str(v['path']),
          kind=str(v['kind']),
          shape=tuple(int(d) for d in v['shape']),
          dtype=str(v['dtype']),
          logical_axes=(
            None if v['logical_axes'] is None else tuple(v['logical_axes'])
          ),
          spec=_spec_from_entries(v['spec'], f'{where} ({v["path"]!r})'),
          bytes=int(v['bytes']),
          bytes_per_device=int(v['bytes_per_device']),
          fallbacks=tuple(v['fallbacks']),
          placed=(
            None
            if v.get('placed') is None
            else _spec_from_entries(v['placed'], where)
          ),
          category=str(v.get('category', 'other')),
          source=None if v.get('source') is None else str(v['source']),
          misplaced_reason=(
            None
            if v.get('misplaced_reason') is None
            else str(v['misplaced_reason'])
          ),
          creation=None if v.get('creation') is None else str(v['creation']),
          mesh=None if v.get('mesh') is None else str(v['mesh']),
          mesh_axes=(
            dict(v['mesh_axes']) if v.get('mesh') is not None else mesh_axes
          ),
        )
      )
    except (KeyError, TypeError, ValueError) as e:
      if isinstance(e, _errors.LayoutFileError):
        raise
      raise _errors.LayoutFileError(
        f'{where} is malformed ({type(e).__name__}: {e}). {fix}'
      ) from e
  return ShardingPlan(
    entries=tuple(entries),
    mesh_axes=mesh_axes,
    num_devices=int(data.get('num_devices', 1)),
    likely_typos=tuple(str(t) for t in data.get('likely_typos') or ()),
  )


def plan_from_json(text: str, source: str = 'the layout') -> ShardingPlan:
  """The plan `ShardingPlan.to_json` wrote.

  Raises:
    LayoutFileError: If `text` is not JSON, or not a plan.
  """
  try:
    data = json.loads(text)
  except json.JSONDecodeError as e:
    raise _errors.LayoutFileError(f'{source} is not JSON ({e}). {_FIX}') from e
  return plan_from_dict(data, source)
