"""NNX variables: the one walker and the one path format.

`iter_variables` walks a module, graph node or ``nnx.State``; `path_str`
joins a path with '/' (`keypath_str` a JAX key path, the same way);
`resolved` gives each variable its spec (`_rules._spec.spec_of_variable`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from flax_dtensor import _errors
from flax_dtensor._rules import _context, _logical, _meshes, _resolution, _spec

Path = tuple[Any, ...]

_NOT_A_NODE_MSG = (
  'Expected an NNX module, another NNX graph node (e.g. nnx.Optimizer) or '
  'an nnx.State; got {type} {value}.'
)


def iter_variables(node: Any) -> list[tuple[Path, nnx.Variable]]:
  """Returns ``(path, variable)`` for every variable, in path order.

  Args:
    node: An NNX module, graph node or ``nnx.State``. A variable shared by
      several attributes appears once, at its first path.

  Raises:
    NotAModelError: If `node` is none of these.
  """
  if isinstance(node, nnx.State):
    state = node
  elif isinstance(node, nnx.Variable):
    return [((), node)]
  else:
    # None is a pytree (of nothing) to JAX; to the caller it is no model.
    if node is None or not nnx.graph.is_node(node):
      raise _errors.NotAModelError(_not_a_node(node))
    try:
      state = nnx.state(node)
    except Exception as e:
      raise _errors.NotAModelError(_not_a_node(node)) from e
  out = []
  for path, leaf in nnx.to_flat_state(state):
    if not isinstance(leaf, nnx.Variable):
      raise _errors.NotAModelError(
        f'Expected NNX variables as the leaves, got {type(leaf).__name__} at '
        f'{path_str(path)}. Pass the module itself or `nnx.state(module)`, '
        'not a pure dict of arrays.'
      )
    out.append((tuple(path), leaf))
  return out


def iter_variables_in(tree: Any) -> list[tuple[str, nnx.Variable]]:
  """``(path, variable)`` for every variable among a pytree's leaves.

  For trees `iter_variables` does not walk: what Flax's tree functions
  (``nnx.get_named_sharding``) return, whose variables hold other values.
  """
  leaves = jax.tree_util.tree_flatten_with_path(
    tree, is_leaf=lambda x: isinstance(x, nnx.Variable)
  )[0]
  return [
    (keypath_str(keypath), leaf)
    for keypath, leaf in leaves
    if isinstance(leaf, nnx.Variable)
  ]


def _not_a_node(node: Any) -> str:
  message = _NOT_A_NODE_MSG.format(type=type(node).__name__, value=_short(node))
  if callable(node) and not nnx.graph.is_node(node):
    message += (
      ' It is callable: to use a factory, build the model first (e.g. '
      '`nnx.eval_shape(factory)` for an abstract one), or pass the '
      'factory to `fdt.plan`, which builds it abstractly.'
    )
  return message


def _short(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 120 else text[:117] + '...'


def path_str(path: Sequence[Any]) -> str:
  """'layers/0/kernel' for a path of keys."""
  return '/'.join(str(k) for k in path)


def keypath_str(keypath: Sequence[Any]) -> str:
  """'layers/0/kernel' for a JAX key path, as `path_str` for NNX paths.

  A dict key, a sequence index, an attribute name or a flattened index is
  one part (as eformer's ``tree_path_to_string`` joins them), so a state,
  a module and a nested dict of the same structure give the same paths.
  """
  parts = []
  for key in keypath:
    if isinstance(key, jax.tree_util.DictKey | jax.tree_util.FlattenedIndexKey):
      parts.append(str(key.key))
    elif isinstance(key, jax.tree_util.SequenceKey):
      parts.append(str(key.idx))
    elif isinstance(key, jax.tree_util.GetAttrKey):
      parts.append(str(key.name))
    else:
      parts.append(str(key))
  return '/'.join(parts)


_NATURAL = re.compile(r'(\d+)')


def natural_key(path: str) -> tuple[Any, ...]:
  """A sort key putting 'layers/2' before 'layers/10'."""
  return tuple(
    (0, int(part), '') if part.isdigit() else (1, 0, part)
    for part in _NATURAL.split(path)
    if part
  )


def resolved(
  node: Any,
  *,
  rules: _logical.LogicalRules | _context.FlaxRules,
  mesh: _meshes.MeshLike | None,
) -> list[tuple[str, nnx.Variable, _resolution.Resolution | None]]:
  """``(path text, variable, _spec.spec_of_variable(...))`` for every variable."""
  out = []
  for path, variable in iter_variables(node):
    where = path_str(path)
    out.append(
      (
        where,
        variable,
        _spec.spec_of_variable(variable, rules=rules, mesh=mesh, path=where),
      )
    )
  return out


def listing(names: Sequence[str], limit: int = 8) -> str:
  """'a, b, c and 5 more': the first `limit` names and a count of the rest,
  for messages."""
  rest = len(names) - limit
  if rest <= 0:
    return ', '.join(names)
  return f'{", ".join(names[:limit])} and {rest} more'
