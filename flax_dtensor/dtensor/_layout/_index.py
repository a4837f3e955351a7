"""Global slices (`Index`): which block of an array a shard or piece is.

Plain tuples, without JAX, NumPy or TensorFlow, so that the manifest's
reader (`_format._decode`) reads and checks an export's slices without them
(`flax-dtensor inspect`).
"""

from __future__ import annotations

Index = tuple[tuple[int, int], ...]
"""A global slice: per dimension, (start, stop)."""


def contains(held: Index, index: Index) -> bool:
  """Whether the global slice `held` contains the global slice `index`."""
  return all(
    h0 <= i0 and i1 <= h1
    for (i0, i1), (h0, h1) in zip(index, held, strict=True)
  )


def local(index: Index, held: Index) -> tuple[slice, ...]:
  """`index` relative to the slice `held`."""
  return tuple(
    slice(a - h, b - h) for (a, b), (h, _) in zip(index, held, strict=True)
  )
