"""A variable's saved shards: the blocks of a grid, and a checksum of each.

The distinct shards of a sharded JAX array cut each dimension into equal
blocks (JAX refuses uneven shardings), so a variable's saved shards are a
grid: its shape, the number of blocks along each dimension, and one
checksum (a 32-bit CRC) per block in row-major order, 4 bytes a shard.
Which blocks a region meets, and the region widened to whole blocks, are
arithmetic: a process finds its shards among millions without listing
them. Plain Python (`array`, no JAX or NumPy), so that the manifest reads
without them.
"""

from __future__ import annotations

import array
import base64
import binascii
import dataclasses
import itertools
import math
import sys
from collections.abc import Iterable, Iterator, Sequence

from flax_dtensor.dtensor._layout import _index

Index = _index.Index

# An unsigned 32-bit array's type code.
U32 = 'I' if array.array('I').itemsize == 4 else 'L'


class NotAGrid(ValueError):
  """Shards that are not the blocks of a grid covering their array.

  Attributes:
    uncovered: A region no shard covers, if that is what is wrong.
  """

  def __init__(self, problem: str, uncovered: Index | None = None) -> None:
    super().__init__(problem)
    self.uncovered = uncovered


def text(index: Index) -> str:
  """'0:4, 8:16': a global slice as the messages show it."""
  return ', '.join(f'{a}:{b}' for a, b in index)


def volume(index: Index) -> int:
  return math.prod(b - a for a, b in index)


@dataclasses.dataclass(frozen=True)
class ShardGrid:
  """The saved shards of one variable, and their checksums.

  Dimension `d` of `shape` is cut into `blocks[d]` equal blocks (one block
  where the dimension is empty). Iterating yields `(global slice, checksum)`
  per block in row-major order.

  Attributes:
    shape: The variable's shape.
    blocks: Per dimension, how many blocks it is cut into.
    crcs: One checksum per block, row-major (`array` of type `U32`).
  """

  shape: tuple[int, ...]
  blocks: tuple[int, ...]
  crcs: array.array

  def __post_init__(self) -> None:
    # An internal invariant (the readers check their input before making
    # one), checked even under `python -O`.
    if (
      len(self.blocks) != len(self.shape)
      or any(
        b < 1 or n % b or (n == 0 and b != 1)
        for n, b in zip(self.shape, self.blocks, strict=True)
      )
      or len(self.crcs) != math.prod(self.blocks)
    ):
      raise AssertionError(
        f'flax_dtensor internal error: a shard grid of {self.blocks} blocks '
        f'over the shape {self.shape} with {len(self.crcs)} checksums.'
      )

  @property
  def sizes(self) -> tuple[int, ...]:
    """Each block's size along each dimension."""
    return tuple(n // b for n, b in zip(self.shape, self.blocks, strict=True))

  def __len__(self) -> int:
    return len(self.crcs)

  def __iter__(self) -> Iterator[tuple[Index, int]]:
    return zip(self._indices(self._ranges(self.whole)), self.crcs, strict=True)

  @property
  def whole(self) -> Index:
    return tuple((0, n) for n in self.shape)

  def _ranges(self, region: Index) -> list[range]:
    """Per dimension, the block coordinates an aligned `region` spans."""
    return [
      range(a // s, b // s) if s else range(1)
      for (a, b), s in zip(region, self.sizes, strict=True)
    ]

  def _indices(self, ranges: Sequence[range]) -> Iterator[Index]:
    sizes = self.sizes
    for coords in itertools.product(*ranges):
      yield tuple(
        (c * s, (c + 1) * s) for c, s in zip(coords, sizes, strict=True)
      )

  def _ordinals(self, ranges: Sequence[range]) -> Iterator[int]:
    strides = [math.prod(self.blocks[d + 1 :]) for d in range(len(ranges))]
    for coords in itertools.product(*ranges):
      yield sum(c * s for c, s in zip(coords, strides, strict=True))

  def aligned(self, region: Index) -> bool:
    """Whether `region` is a box of whole blocks inside the array."""
    return len(region) == len(self.shape) and all(
      0 <= a <= b <= n and (a % s == 0 and b % s == 0 and a < b if s else True)
      for (a, b), n, s in zip(region, self.shape, self.sizes, strict=True)
    )

  def hull(self, region: Index) -> Index:
    """`region` widened to whole blocks: the union of the blocks it meets."""
    out = []
    for (a, b), n, s in zip(region, self.shape, self.sizes, strict=True):
      if not s:
        out.append((0, n))
      else:
        out.append((a // s * s, min(n, -(-max(b, a + 1) // s) * s)))
    return tuple(out)

  def inside(self, region: Index) -> Iterator[tuple[Index, int]]:
    """(slice, checksum) of every block inside an aligned `region`."""
    ranges = self._ranges(region)
    return zip(
      self._indices(ranges),
      (self.crcs[o] for o in self._ordinals(ranges)),
      strict=True,
    )

  def to_text(self) -> str:
    """The CRCs as the manifest stores them: base64 of little-endian uint32s."""
    crcs = self.crcs
    if sys.byteorder != 'little':
      crcs = array.array(U32, crcs)
      crcs.byteswap()
    return base64.b64encode(crcs.tobytes()).decode('ascii')


def decode(text: str) -> array.array:
  """The checksums of `ShardGrid.to_text`; ValueError if it is not that."""
  try:
    # Strict: only the alphabet, padding only at the end (checked in C).
    raw = binascii.a2b_base64(text, strict_mode=True)
  except (ValueError, binascii.Error) as e:
    raise ValueError(f'not base64 ({e})') from None
  if len(raw) % 4:
    raise ValueError(
      f'{len(raw)} bytes, not a whole number of 4-byte checksums'
    )
  crcs = array.array(U32)
  crcs.frombytes(raw)
  if sys.byteorder != 'little':
    crcs.byteswap()
  return crcs


def from_shards(
  shape: tuple[int, ...], shards: Iterable[tuple[Index, int]]
) -> ShardGrid:
  """The grid of shards given one by one (version 3 of the manifest).

  Raises:
    NotAGrid: If they are not exactly the equal blocks of a grid covering
      the array, each once: `uncovered` names a region none covers, where
      that is what is wrong.
  """
  shards = list(shards)
  for index, _ in shards:
    if len(index) != len(shape) or not all(
      0 <= a <= b <= n for (a, b), n in zip(index, shape, strict=True)
    ):
      raise NotAGrid(f'do not fit its shape {shape}')
  blocks = []
  for d, n in enumerate(shape):
    cuts = sorted({index[d] for index, _ in shards})
    if n == 0:
      if cuts not in ([], [(0, 0)]):
        raise NotAGrid(f'cut its empty dimension {d} into {cuts}')
      blocks.append(1)
      continue
    if not cuts or cuts[0][0] != 0:
      end = cuts[0][0] if cuts else n
      raise NotAGrid('do not cover', uncovered=_band(shape, d, (0, end)))
    size = cuts[0][1] - cuts[0][0]
    stop = 0
    for a, b in cuts:
      if a > stop:
        raise NotAGrid('do not cover', uncovered=_band(shape, d, (stop, a)))
      if a < stop or b - a != size or size == 0:
        raise NotAGrid(
          f'are not the equal blocks of a grid (dimension {d} is cut into '
          f'{_cut_text(cuts)})'
        )
      stop = b
    if stop != n:
      raise NotAGrid('do not cover', uncovered=_band(shape, d, (stop, n)))
    blocks.append(n // size)
  sizes = [n // b for n, b in zip(shape, blocks, strict=True)]
  at: dict[tuple[int, ...], int] = {}
  for index, crc in shards:
    coords = tuple(
      a // s if s else 0 for (a, _), s in zip(index, sizes, strict=True)
    )
    if coords in at:
      raise NotAGrid(f'record the block [{text(index)}] twice')
    at[coords] = crc
  if len(at) < math.prod(blocks):
    # The first block missing, found within len(at) + 1 steps.
    for coords in itertools.product(*(range(b) for b in blocks)):
      if coords not in at:
        raise NotAGrid(
          'do not cover',
          uncovered=tuple(
            (c * s, (c + 1) * s) if s else (0, 0)
            for c, s in zip(coords, sizes, strict=True)
          ),
        )
  crcs = array.array(U32, (at[c] for c in sorted(at)))
  return ShardGrid(tuple(shape), tuple(blocks), crcs)


def _band(shape: tuple[int, ...], d: int, cut: tuple[int, int]) -> Index:
  return tuple(cut if i == d else (0, n) for i, n in enumerate(shape))


def _cut_text(cuts: Sequence[tuple[int, int]]) -> str:
  shown = ', '.join(f'{a}:{b}' for a, b in cuts[:6])
  return shown + (f' and {len(cuts) - 6} more' if len(cuts) > 6 else '')
