"""PartitionSpecs: the mesh axes of an entry, a canonical form, and text.

The one place specs are taken apart and printed: `axes_of` gives the mesh
axes an entry names, `canonical` compares specs of different spellings
(``P('data')`` and ``P('data', None)``), `same_placement` compares what
they place on a mesh (its axes of size 1 split nothing), `without_unit_axes`
is a spec as the plan shows it, `format_entry` / `format_spec` print them as
JAX does, and `from_axes` builds a spec from per-dimension axes (the form
the manifest stores). Importing it imports no JAX (the command line's
``inspect`` prints the manifest's specs with it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
  from jax.sharding import PartitionSpec


def axes_of(entry: Any) -> tuple[str, ...]:
  """The mesh axes one spec entry (or rule target) names, in order."""
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  if isinstance(entry, tuple | list):
    return tuple(entry)
  from jax.sharding import PartitionSpec

  if entry is PartitionSpec.UNCONSTRAINED:
    return ()
  return tuple(entry)


def full_length(spec: PartitionSpec, ndim: int) -> PartitionSpec:
  """`spec` with one entry per dimension, as JAX types an array's sharding.

  ``P()`` of a 1-d array is ``P(None)``, the same placement spelled as
  `jax.typeof` spells it; a scalar's stays ``P()``.
  """
  from jax.sharding import PartitionSpec

  if len(spec) >= ndim:
    return spec
  return PartitionSpec(*spec, *(None,) * (ndim - len(spec)))


def canonical(spec: PartitionSpec, ndim: int) -> tuple[tuple[str, ...], ...]:
  """One tuple of mesh axes per dimension: equal for equal placements."""
  entries = tuple(spec) + (None,) * (ndim - len(spec))
  return tuple(axes_of(e) for e in entries)


def placement(
  spec: PartitionSpec, ndim: int, sizes: Mapping[str, int] | None = None
) -> tuple[tuple[str, ...], ...]:
  """The mesh axes that split each dimension: equal for equal placements.

  An axis of size 1 in `sizes` splits nothing, so it is left out:
  ``P(('fsdp', 'context'), 'stage')`` and ``P('fsdp')`` put the same block
  on the same devices when ``context`` and ``stage`` have size 1. Axes
  `sizes` does not name are kept (they are no axes of that mesh); without
  `sizes`, every axis named is kept.
  """
  return tuple(
    tuple(a for a in axes if sizes is None or sizes.get(a) != 1)
    for axes in canonical(spec, ndim)
  )


def same_placement(
  a: PartitionSpec,
  b: PartitionSpec,
  ndim: int,
  sizes: Mapping[str, int] | None = None,
) -> bool:
  """Whether `a` and `b` put the same blocks of an `ndim`-dimensional
  array on the same devices of a mesh of axis `sizes` (see `placement`).
  """
  return placement(a, ndim, sizes) == placement(b, ndim, sizes)


def without_unit_axes(
  spec: PartitionSpec, sizes: Mapping[str, int] | None
) -> PartitionSpec:
  """`spec` without the mesh axes of size 1 in `sizes`: as the plan shows it.

  ``P(('fsdp', 'context', 'expert'), 'stage', 'tensor')`` is shown as
  ``P('fsdp', None, 'tensor')`` when only ``fsdp`` and ``tensor`` are
  larger than 1. The spec keeps its length; `spec` itself when nothing is
  left out, and on a mesh whose axes all have size 1 (one device), where
  they are all there is, and what JAX's types name (``f32[32@data]``).
  """
  from jax.sharding import PartitionSpec

  unit = {a for a, n in (sizes or {}).items() if n == 1}
  if unit == set(sizes or {}):
    return spec
  if not unit.intersection(a for e in spec for a in axes_of(e)):
    return spec
  entries = []
  for entry in spec:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
      entries.append(entry)
      continue
    kept = tuple(a for a in axes_of(entry) if a not in unit)
    entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  return PartitionSpec(*entries)


def format_entry(entry: Any) -> str:
  """ "None", "'data'" or "('data', 'model')"."""
  axes = axes_of(entry)
  if not axes:
    return 'None'
  if len(axes) == 1:
    return repr(axes[0])
  return '(' + ', '.join(map(repr, axes)) + ')'


def format_spec(spec: PartitionSpec | Sequence[Any]) -> str:
  """ "P('data', None)", as JAX prints a PartitionSpec.

  Also takes the per-dimension mesh axes the manifest stores
  (``[['data'], []]``), printed as the spec `from_axes` would give.
  """
  return 'P(' + ', '.join(format_entry(e) for e in spec) + ')'


def from_axes(dims: Sequence[Sequence[str]]) -> PartitionSpec:
  """The spec of per-dimension mesh axes (``[['data'], []]``)."""
  from jax.sharding import PartitionSpec

  return PartitionSpec(
    *(None if not a else a[0] if len(a) == 1 else tuple(a) for a in dims)
  )
