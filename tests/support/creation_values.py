"""A build's values against an unsharded build's: within the stated bound.

flax_dtensor computes a parameter's initializer in its shards (eager
creation and `fdt.init`). Its values equal those of an unsharded build of
the same seed to within `MAX_ULP` units in the last place of the
parameter's dtype, not bit for bit (docs/concepts.md, "Values of a sharded
build"): XLA compiles the same initializer for the shard's shape, and on
some instruction sets (AVX-512 with jax 0.12) it vectorizes `erf_inv`
differently for another shape. Every test comparing a sharded creation with
an unsharded one does it here, so that none depends on one host's rounding.
Values that are placed, not computed (`shard_module`, restores), stay equal
bit for bit.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

MAX_ULP = 8
"""The bound docs/concepts.md states (measured: at most 4)."""


def ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """How many representable values of their float dtype lie from a to b."""
  a, b = np.asarray(a), np.asarray(b)
  assert a.dtype == b.dtype, (a.dtype, b.dtype)
  ints = np.dtype(f'i{a.dtype.itemsize}')
  low = np.iinfo(ints).min

  def ordered(x: np.ndarray) -> np.ndarray:
    bits = x.view(ints).astype(np.int64)
    return np.where(bits < 0, low - bits, bits)  # -0.0 and 0.0 meet.

  return np.abs(ordered(a) - ordered(b))


def _is_float(dtype: np.dtype) -> bool:
  return bool(jax.dtypes.issubdtype(dtype, np.floating))


def assert_close(actual: Any, expected: Any, *, err_msg: str = '') -> None:
  """`actual` holds `expected`'s values, within `MAX_ULP` for floats.

  A `jax.Array` is checked shard by shard against its slice of `expected`,
  so that a shard in the wrong place fails too. Other dtypes (integers,
  keys' data) must be equal.
  """
  expected = np.asarray(expected)
  pieces = (
    [(np.asarray(s.data), expected[s.index]) for s in actual.addressable_shards]
    if isinstance(actual, jax.Array)
    else [(np.asarray(actual), expected)]
  )
  for got, want in pieces:
    assert got.dtype == want.dtype, (err_msg, got.dtype, want.dtype)
    assert got.shape == want.shape, (err_msg, got.shape, want.shape)
    if not _is_float(got.dtype):
      np.testing.assert_array_equal(got, want, err_msg=err_msg)
    elif got.dtype in (np.float16, np.float32, np.float64):
      try:
        np.testing.assert_array_max_ulp(got, want, maxulp=MAX_ULP)
      except AssertionError as e:
        raise AssertionError(f'{err_msg}: {e}') from None
    else:  # bfloat16 and the other ml_dtypes floats.
      far = ulps(got, want)
      assert far.max(initial=0) <= MAX_ULP, (
        f'{err_msg}: {np.count_nonzero(far > MAX_ULP)} values more than '
        f'{MAX_ULP} ulps apart (at most {far.max()})'
      )
