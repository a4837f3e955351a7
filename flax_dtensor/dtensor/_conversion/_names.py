"""Names: NNX paths <-> TF names and checkpoint keys, injectively.

A variable at the NNX path ``('layers', 0, 'kernel')`` lives in the
``tf.Module`` at ``module.state['layers']['0']['kernel']`` and in a
checkpoint under ``state/layers/0/kernel/.ATTRIBUTES/VARIABLE_VALUE``. Each
path component becomes one name: an int as its digits; a str as itself,
unless it looks like an int, is empty or starts with ``~``, when a ``~`` is
put in front. TF then escapes ``.`` and ``/`` inside names (``..``, ``.S``).
So ``('x', 'a/b')``, ``('x', 'a', 'b')``, ``(0,)`` and ``('0',)`` all get
different keys, and `nnx_path` gives back exactly the path saved.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from flax_dtensor import _errors

# The tf.Module attribute holding the nested dicts of variables.
STATE_ATTRIBUTE = 'state'
ATTRIBUTES_SUFFIX = '/.ATTRIBUTES/VARIABLE_VALUE'
OBJECT_GRAPH_KEY = '_CHECKPOINTABLE_OBJECT_GRAPH'

Path = tuple[int | str, ...]

_INT = re.compile(r'-?\d+')
_MARK = '~'
_NAME_UNSAFE = re.compile(r'[^A-Za-z0-9_.\-/]')


def component(key: Any) -> str:
  """The name of one path component (see the module docstring)."""
  if isinstance(key, bool) or not isinstance(key, int | str):
    raise _errors.ExportError(
      f'Expected NNX path keys of type str or int, got {type(key).__name__} '
      f'{key!r}. Name the attribute or dict entry with a str.'
    )
  if isinstance(key, int):
    return str(key)
  if not key or _INT.fullmatch(key) or key.startswith(_MARK):
    return _MARK + key
  return key


def key_of(name: str) -> int | str:
  """The path component a `component` name stands for."""
  if name.startswith(_MARK):
    return name[1:]
  if _INT.fullmatch(name):
    return int(name)
  return name


def components(path: Sequence[Any]) -> list[str]:
  return [component(k) for k in path]


def parse_path(path: str | Sequence[Any]) -> Path:
  """A path as a tuple; a '/'-joined str is split, digit parts made ints.

  The str form is how `flax_dtensor` prints paths ('layers/0/kernel'); it
  cannot say whether '0' was an int or a str, nor hold a '/' inside a key.
  Pass a tuple for those.
  """
  if isinstance(path, str):
    return tuple(int(p) if _INT.fullmatch(p) else p for p in path.split('/'))
  return tuple(path)


def escape(part: str) -> str:
  """A local name as TF writes it in a checkpoint key (as TF's
  ``trackable_utils.escape_local_name``)."""
  return part.replace('.', '..').replace('/', '.S')


def _unescape(part: str) -> str:
  out, i = [], 0
  while i < len(part):
    if part[i] == '.' and i + 1 < len(part):
      out.append('.' if part[i + 1] == '.' else '/')
      i += 2
    else:
      out.append(part[i])
      i += 1
  return ''.join(out)


def checkpoint_key(path: str | Sequence[Any]) -> str:
  """Returns the TF checkpoint key of the variable at an NNX path.

  Args:
    path: An NNX path, as a tuple of keys (`('layers', 0, 'kernel')`), or
      joined with '/' (`'layers/0/kernel'`; digit parts are list indices).

  Returns:
    The key under which `tf.train.load_checkpoint` lists the variable in a
    checkpoint written by `save_checkpoint` (and in a SavedModel's
    `variables/variables`).

  Raises:
    ExportError: If a path key is neither a str nor an int.

  Example:
    >>> checkpoint_key(('layers', 0, 'kernel'))
    'state/layers/0/kernel/.ATTRIBUTES/VARIABLE_VALUE'
    >>> checkpoint_key(('layers', '0', 'a/b.c'))
    'state/layers/~0/a.Sb..c/.ATTRIBUTES/VARIABLE_VALUE'
  """
  parts = [escape(p) for p in components(parse_path(path))]
  return '/'.join([STATE_ATTRIBUTE, *parts]) + ATTRIBUTES_SUFFIX


def nnx_path(key: str) -> Path | None:
  """Returns the NNX path of a checkpoint key, or None.

  The inverse of `checkpoint_key`: the exact path saved, with int and str
  keys as they were.

  Args:
    key: A checkpoint key, as `tf.train.load_checkpoint(d)` lists them
      (`get_variable_to_shape_map()`).

  Returns:
    The NNX path as a tuple, or None if `key` is not the value of a variable
    exported by flax_dtensor (e.g. `_CHECKPOINTABLE_OBJECT_GRAPH`).

  Example:
    >>> nnx_path('state/layers/0/kernel/.ATTRIBUTES/VARIABLE_VALUE')
    ('layers', 0, 'kernel')
  """
  head = STATE_ATTRIBUTE + '/'
  if not (key.startswith(head) and key.endswith(ATTRIBUTES_SUFFIX)):
    return None
  body = key[len(head) : -len(ATTRIBUTES_SUFFIX)]
  return tuple(key_of(_unescape(p)) for p in body.split('/'))


def path_text(path: Sequence[Any]) -> str:
  """'layers/0/kernel': how messages and tables show a path."""
  return '/'.join(str(k) for k in path)


def variable_name(path: Sequence[Any]) -> str:
  """A TF-acceptable variable name showing the NNX path (display only)."""
  safe = _NAME_UNSAFE.sub('_', path_text(path))
  return safe if safe[:1].isalnum() or safe[:1] == '.' else 'v' + safe


class PathDict(dict):
  """A dict keyed by exact NNX paths (tuples of keys).

  Its keys are the paths exactly as saved. For convenience, a '/'-joined
  str also looks a variable up (`parse_path` reads digit parts as list
  indices): ``d['layers/0/kernel'] is d[('layers', 0, 'kernel')]``.
  """

  def __getitem__(self, key: Any) -> Any:
    return super().__getitem__(_lookup(key))

  def __contains__(self, key: object) -> bool:
    return super().__contains__(_lookup(key))

  def get(self, key: Any, default: Any = None) -> Any:
    return super().get(_lookup(key), default)


def _lookup(key: Any) -> Any:
  return parse_path(key) if isinstance(key, str) else key
