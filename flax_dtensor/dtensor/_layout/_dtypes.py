"""Dtypes: which a TF checkpoint keeps, and which it stores widened.

TensorFlow cannot read back a sharded (sliced) checkpoint tensor of dtype
float16, uint16, uint32 or float8, has no dtype for some ml_dtypes, and its
checkpoint writer crashes on int2, uint2 and float4_e2m1fn. Those are stored
widened, exactly (`STORED_DTYPES`), and narrowed back when read. uint64 is
refused. Checked on tensorflow-cpu 2.21.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flax_dtensor import _errors


def _dtypes(names: Iterable[str]) -> list[np.dtype]:
  """The dtypes of `names` this JAX / ml_dtypes has (others are skipped)."""
  out = []
  for name in names:
    try:
      out.append(np.dtype(jnp.dtype(name)))
    except TypeError:  # pragma: no cover - an older ml_dtypes.
      pass
  return out


# Dtypes a TF checkpoint holds and reads back as they are.
KEPT = frozenset(
  _dtypes(
    [
      'bool',
      'int4',
      'int8',
      'int16',
      'int32',
      'int64',
      'uint4',
      'uint8',
      'bfloat16',
      'float32',
      'float64',
      'complex64',
      'complex128',
    ]
  )
)
_NARROW_FLOATS = [
  'float8_e4m3fn',
  'float8_e5m2',
  'float8_e4m3fnuz',
  'float8_e4m3b11fnuz',
  'float8_e5m2fnuz',
  'float8_e3m4',
  'float8_e4m3',
  'float8_e8m0fnu',
  'float4_e2m1fn',
]
# The readable dtype each of the others is stored as. Every value converts
# exactly (a NaN stays a NaN of the same sign; its payload bits may change).
STORED_DTYPES: Mapping[np.dtype, np.dtype] = {
  np.dtype(np.float16): np.dtype(np.float32),
  np.dtype(np.uint16): np.dtype(np.int32),
  np.dtype(np.uint32): np.dtype(np.int64),
  **{d: np.dtype(np.float32) for d in _dtypes(_NARROW_FLOATS)},
  **{d: np.dtype(np.int8) for d in _dtypes(['int2'])},
  **{d: np.dtype(np.uint8) for d in _dtypes(['uint2'])},
}
# Dtypes TF has no usable tensor dtype for: `to_tf_module` refuses them.
NOT_IN_TF = frozenset(
  _dtypes(
    [
      'int2',
      'uint2',
      'float4_e2m1fn',
      'float8_e3m4',
      'float8_e4m3',
      'float8_e8m0fnu',
    ]
  )
)


def stored(dtype: np.dtype) -> np.dtype:
  """The dtype a checkpoint stores `dtype` as."""
  return STORED_DTYPES.get(dtype, dtype)


def widened_in_jax(dtype: np.dtype) -> bool:
  """Whether `dtype` is widened, and converted in JAX (else by TF).

  JAX converts when it holds the stored dtype natively: every ml_dtype
  (which TF may lack) goes through float32, int8 or uint8. uint32 is
  widened to int64 by TF unless JAX runs with 64-bit types.
  """
  wide = stored(dtype)
  return wide != dtype and (
    np.dtype(jax.dtypes.canonicalize_dtype(wide)) == wide
  )


def is_storable(dtype: np.dtype) -> bool:
  return dtype in KEPT or dtype in STORED_DTYPES


def storable_names() -> str:
  return ', '.join(sorted(d.name for d in (*KEPT, *STORED_DTYPES)))


def is_key(dtype: object) -> bool:
  """Whether `dtype` is a typed PRNG key dtype."""
  return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def key_impl(value: Any) -> str:
  """The name of a typed key array's PRNG implementation ('threefry2x32').

  The array may be abstract (a `jax.ShapeDtypeStruct`, e.g. an `nnx.Rngs`
  key of a model from `nnx.eval_shape`), which `jax.random.key_impl`
  refuses; JAX has no public accessor for an abstract key's
  implementation, which its dtype holds. JAX takes the name as `impl=`.
  """
  if isinstance(value, jax.ShapeDtypeStruct):
    return str(value.dtype._impl.name)
  return str(jax.random.key_impl(value))


def from_name(name: str, where: str) -> np.dtype:
  """The dtype named `name` in a manifest; ExportError if unknown."""
  try:
    return np.dtype(jnp.dtype(name))
  except TypeError as e:
    raise _errors.ExportError(
      f'{where} records the dtype {name!r}, which this JAX does not know: '
      'expected a JAX dtype name. Upgrade jax / ml_dtypes, or re-export the '
      'checkpoint.'
    ) from e
