"""A variable's saved shards as a grid: arithmetic checked against brute force.

`_grid.ShardGrid` finds the blocks a region meets, and the region widened
to whole blocks, without listing the blocks; `from_shards` turns version
3's shard records into a grid, or names what keeps them from being one (a
region none covers, a block recorded twice, cuts off the grid). Each is
checked here against a brute-force listing of every block, on random
shapes and grids. Beside them, the internal invariants of the read path
(a grid's own consistency, the writer's shards against the layout, pieces
that cover a slice, a region for every slice) hold under `python -O` too:
they are raised, not asserted.
"""

import array
import itertools
import math

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest
from support import profiles

from flax_dtensor.dtensor._format import _encode, _grid, _model
from flax_dtensor.dtensor._layout import _pieces
from flax_dtensor.dtensor._storage import _host_read


@st.composite
def grids(draw):
  """(shape, blocks, {block index: CRC}) of a random grid, up to 3-D."""
  ndim = draw(st.integers(0, 3))
  shape, blocks = [], []
  for _ in range(ndim):
    b = draw(st.integers(1, 5))
    size = draw(st.integers(0, 3))
    shape.append(b * size)
    blocks.append(b if size else 1)
  shape, blocks = tuple(shape), tuple(blocks)
  steps = [n // b for n, b in zip(shape, blocks, strict=True)]
  crcs = {}
  for coords in itertools.product(*(range(b) for b in blocks)):
    index = tuple(
      (c * s, (c + 1) * s) for c, s in zip(coords, steps, strict=True)
    )
    crcs[index] = draw(st.integers(0, 2**32 - 1))
  return shape, blocks, crcs


def _meets(a, b):
  return all(
    max(a0, b0) < min(a1, b1) or (a0 == a1 == b0 == b1)
    for (a0, a1), (b0, b1) in zip(a, b, strict=True)
  )


@hypothesis.settings(max_examples=profiles.examples(2000), deadline=None)
@hypothesis.given(grids(), st.data())
def test_a_grid_lists_its_blocks_and_finds_a_region_s(grid, data):
  shape, blocks, crcs = grid
  listed = list(crcs.items())
  shuffled = data.draw(st.permutations(listed))
  made = _grid.from_shards(shape, shuffled)
  # Row-major, whatever the order given.
  assert made.blocks == blocks
  assert list(made) == listed
  assert len(made) == math.prod(blocks)
  assert _grid.decode(made.to_text()) == made.crcs
  # A region: the blocks it meets, brute force, are the hull's.
  region = tuple(
    sorted(data.draw(st.tuples(st.integers(0, n), st.integers(0, n))))
    for n in shape
  )
  region = tuple(
    (a, b) if a < b or n == 0 else (a, a + 1) if a < n else (a - 1, a)
    for (a, b), n in zip(region, shape, strict=True)
  )
  meeting = {index: crc for index, crc in listed if _meets(index, region)}
  hull = made.hull(region)
  assert made.aligned(hull)
  assert all(
    h0 <= r0 and r1 <= h1
    for (h0, h1), (r0, r1) in zip(hull, region, strict=True)
  )
  assert dict(made.inside(hull)) == meeting
  assert sum(_grid.volume(i) for i in meeting) == _grid.volume(hull)


@hypothesis.settings(max_examples=profiles.examples(2000), deadline=None)
@hypothesis.given(grids(), st.data())
def test_records_that_are_not_a_grid_are_named(grid, data):
  shape, _, crcs = grid
  listed = list(crcs.items())
  hypothesis.assume(len(listed) > 1)
  how = data.draw(st.sampled_from(['removed', 'twice', 'off the grid']))
  k = data.draw(st.integers(0, len(listed) - 1))
  index, crc = listed[k]
  if how == 'removed':
    shards = listed[:k] + listed[k + 1 :]
  elif how == 'twice':
    shards = [*listed, (index, crc)]
  else:
    d = data.draw(
      st.sampled_from([d for d, (a, b) in enumerate(index) if b > a])
    )
    moved = list(index)
    moved[d] = (index[d][0], index[d][1] - 1)
    shards = [*listed[:k], (tuple(moved), crc), *listed[k + 1 :]]
  with pytest.raises(_grid.NotAGrid) as e:
    _grid.from_shards(shape, shards)
  if how == 'removed':
    assert e.value.uncovered is not None
    # The region named is one no record covers.
    assert not any(_meets(i, e.value.uncovered) for i, _ in shards)
  elif how == 'twice':
    assert str(e.value) == f'record the block [{_grid.text(index)}] twice'
  else:
    assert e.value.uncovered is not None or 'equal blocks' in str(e.value)


def test_records_out_of_the_shape_are_refused():
  with pytest.raises(_grid.NotAGrid, match=r'do not fit its shape \(8,\)'):
    _grid.from_shards((8,), [(((0, 9),), 0)])
  with pytest.raises(_grid.NotAGrid, match=r'do not fit its shape \(8,\)'):
    _grid.from_shards((8,), [(((0, 4), (0, 1)), 0)])


@pytest.mark.parametrize(
  'text, match',
  [
    ('not base64!', 'not base64'),
    ('AAA=', '2 bytes, not a whole number of 4-byte checksums'),
    ('ÿÿÿÿ', 'not base64'),
  ],
)
def test_checksums_that_are_not_base64_of_crcs_are_refused(text, match):
  with pytest.raises(ValueError, match=match):
    _grid.decode(text)


def test_a_grid_of_the_wrong_count_is_an_internal_error():
  with pytest.raises(AssertionError, match='flax_dtensor internal error'):
    _grid.ShardGrid((8, 4), (2, 2), array.array(_grid.U32, [0, 1, 2]))
  with pytest.raises(AssertionError, match='flax_dtensor internal error'):
    _grid.ShardGrid((8,), (3,), array.array(_grid.U32, [0, 1, 2]))


def test_shards_written_off_the_layout_are_an_internal_error():
  record = _model.ShardingRecord(
    'named',
    (('data',),),
    _model.MeshAxes(('data',), (4,)),
    ('data',),
    _model.MeshAxes(('data',), (4,)),
  )
  halves = [(((0, 4),), 1), (((4, 8),), 2)]
  with pytest.raises(
    AssertionError, match=r'are \(2,\) blocks, its layout implies \(4,\)'
  ):
    _encode.shard_grid(record, (8,), halves)
  with pytest.raises(AssertionError, match='flax_dtensor internal error'):
    _encode.shard_grid(record, (8,), halves[:1])


def test_pieces_that_leave_a_slice_uncovered_are_an_internal_error():
  pieces = {((0, 4),): np.zeros(4, np.float32)}
  np.testing.assert_array_equal(_pieces.slice_of(pieces, ((1, 3),)), 0)
  pieces[((6, 8),)] = np.ones(2, np.float32)
  with pytest.raises(
    AssertionError, match=r'internal error: the pieces .* cover 6 of the 8'
  ):
    _pieces.slice_of(pieces, ((0, 8),))


def test_a_slice_outside_every_region_read_is_an_internal_error():
  read = {((0, 4),): np.arange(4)}
  np.testing.assert_array_equal(_host_read._cut(read, ((1, 3),)), [1, 2])
  with pytest.raises(AssertionError, match='no region read holds the slice'):
    _host_read._cut(read, ((2, 6),))
