"""PartitionSpecs: the mesh axes of an entry, a canonical form, and text.

The one place specs are taken apart and printed: `axes_of` gives the mesh
axes an entry names, `canonical` compares specs of different spellings
(``P('data')`` and ``P('data', None)``), `format_entry` / `format_spec` print
them as JAX does, and `from_axes` builds a spec from per-dimension axes (the
form the manifest stores). Importing it imports no JAX (the command line's
``inspect`` prints the manifest's specs with it).
"""

from __future__ import annotations

from collections.abc import Sequence
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


def canonical(spec: PartitionSpec, ndim: int) -> tuple[tuple[str, ...], ...]:
  """One tuple of mesh axes per dimension: equal for equal placements."""
  entries = tuple(spec) + (None,) * (ndim - len(spec))
  return tuple(axes_of(e) for e in entries)


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
