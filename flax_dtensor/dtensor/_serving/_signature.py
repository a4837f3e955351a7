"""A served method's outputs: its result as named arrays.

The method's result is served as named arrays (`named_outputs`), the other
half of the signature whose inputs `_inputs` reads; `summary` is the one
line of an error that the serving messages quote.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from flax_dtensor import _errors

# Joins the keys of nested dicts in the name of a served output.
SEPARATOR = '/'
# What a served result may hold, besides None (left out).
ARRAYS = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


def summary(error: BaseException) -> str:
  """The error's class and the first line of its message, cut short."""
  lines = str(error).strip().splitlines()
  first = lines[0].rstrip('.') if lines else 'no message'
  if len(first) > 300:
    first = first[:297] + '...'
  return f'{type(error).__name__}: {first}'


# The outputs
# ------------------------------------------------------------------------------


def _key_text(key: Any) -> str:
  for attribute in ('key', 'idx', 'name'):
    if hasattr(key, attribute):
      return str(getattr(key, attribute))
  return str(key)


def named_outputs(
  result: Any, where: str, *, arrays: tuple[type, ...] = ARRAYS
) -> dict[str, Any]:
  """The arrays of a method's result, by the name each is served under.

  None is left out. A dict with str keys names each array by its keys
  (those of nested dicts, and positions in nested lists and tuples) joined
  by `SEPARATOR`: ``{'logits': x, 'cache': {'k': k}}`` gives 'logits' and
  'cache/k'. Any other result names its arrays ``output_0``,
  ``output_1``, ... in the order of ``jax.tree.leaves``; an array alone is
  ``output_0``. The arrays are of the types of `arrays` (TF's tensors, for
  what a TF postprocessing function returns).

  Raises:
    ExportError: If the result holds something other than arrays and None,
      no array, or two arrays of one name.
  """
  try:
    leaves, _ = jax.tree_util.tree_flatten_with_path(result)
  except (TypeError, ValueError) as e:  # E.g. dict keys that do not sort.
    raise _errors.ExportError(
      f'Expected the result of {where} to be a pytree of arrays and None, '
      f'got one JAX cannot flatten ({summary(e)}). Return arrays in tuples, '
      'lists and dicts with str keys.'
    ) from e
  by_keys = isinstance(result, Mapping) and all(
    isinstance(k, str) for k in result
  )
  named: dict[str, Any] = {}
  paths: dict[str, Any] = {}
  for i, (path, leaf) in enumerate(leaves):
    where_in = 'result' + jax.tree_util.keystr(path)
    if not isinstance(leaf, arrays):
      text = repr(leaf)
      text = text if len(text) <= 80 else text[:77] + '...'
      raise _errors.ExportError(
        f'Expected the result of {where} to hold only arrays and None, got '
        f'{type(leaf).__name__} at {where_in}: {text}. Return arrays, in '
        'tuples, lists and dicts (None is left out of the served outputs); '
        'compute anything else outside the served method.'
      )
    name = SEPARATOR.join(map(_key_text, path)) if by_keys else f'output_{i}'
    if name in named:
      raise _errors.ExportError(
        f'Expected each array of the result of {where} to have a name of '
        f'its own, got {name!r} twice: at {paths[name]} and {where_in} '
        f'(the keys of nested dicts are joined by {SEPARATOR!r}). Rename '
        'one of the keys.'
      )
    named[name] = leaf
    paths[name] = where_in
  if not named:
    raise _errors.ExportError(
      f'Expected the result of {where} to hold at least one array, got '
      f'{result!r}: a served signature needs an output. Return the arrays '
      'to serve.'
    )
  return named
