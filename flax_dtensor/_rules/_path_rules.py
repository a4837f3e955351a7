"""Path rules: sharding targets for variables by their path.

A `PathRule` pairs a regular expression, searched in a variable's
'/'-joined path (the plan's path format), with a target: logical axes
(resolved by the logical rules), a ``PartitionSpec`` of mesh axes (fitted to
the mesh and shape), or None (replicated). `first_match` finds the rule for
a path (the first that matches wins), `exemption` says when a variable is
too small for path rules, and `entries_for` lays a target over a shape.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from flax_dtensor import _errors
from flax_dtensor._rules import _partition_specs

PATH_RULES_FIX_MSG = (
  'Each path rule is a (pattern, target) pair, a dict with `pattern` and '
  '`logical` or `spec` (and optionally `type`, `override` and `note`), or a '
  '`fdt.PathRule`; the target is logical axes (a tuple such as '
  "('embed', 'mlp')), a PartitionSpec of mesh axes (P('data', 'model')) or "
  'None (replicate), optionally led by ... for stacked layers, e.g. '
  "[('embedding$', ('vocab', 'embed')), ('attn/.*/kernel', "
  "P(..., 'data', 'model'))]."
)

ELLIPSIS_TEXT = '...'
_type = type  # `PathRule` has a field named `type`.

LOGICAL = 'logical axes'
MESH = 'mesh axes'
REPLICATE = 'replicate'


def _where(index: int | None) -> str:
  return 'a path rule' if index is None else f'path rule #{index}'


def _is_ellipsis(entry: Any) -> bool:
  return entry is Ellipsis or entry == ELLIPSIS_TEXT


def _normalize_target(target: Any, where: str) -> tuple[str, tuple, bool]:
  """(kind, entries without a leading ..., whether led by ...)."""
  if target is None:
    return REPLICATE, (), False
  if isinstance(target, str | bytes):
    raise _errors.RuleTargetTypeError(
      f'{where}: expected logical axes as a tuple (one entry per dimension), '
      f'a PartitionSpec or None; got the str {target!r}. Write '
      f'({target!r},) for a 1-D variable. {PATH_RULES_FIX_MSG}'
    )
  is_spec = isinstance(target, PartitionSpec)
  if not is_spec and not isinstance(target, collections.abc.Sequence):
    raise _errors.RuleTargetTypeError(
      f'{where}: expected logical axes (a tuple), a PartitionSpec or None; '
      f'got {type(target).__name__} {target!r}. {PATH_RULES_FIX_MSG}'
    )
  entries = list(target)
  leading = bool(entries) and _is_ellipsis(entries[0])
  if leading:
    entries = entries[1:]
  if any(_is_ellipsis(e) for e in entries):
    raise _errors.LogicalRulesError(
      f'{where}: ... may only lead the target (it stands for the leading '
      f'dimensions of stacked layers); got {target!r}. {PATH_RULES_FIX_MSG}'
    )
  if is_spec:
    normalized = []
    for e in entries:
      if e is None or isinstance(e, str):
        normalized.append(e)
      elif (
        isinstance(e, tuple | list) and e and all(isinstance(a, str) for a in e)
      ):
        normalized.append(tuple(e) if len(e) > 1 else e[0])
      else:
        raise _errors.RuleTargetTypeError(
          f'{where}: expected each entry of the PartitionSpec {target!r} to '
          f'be a mesh axis name, a tuple of them or None; got {e!r}. '
          f'{PATH_RULES_FIX_MSG}'
        )
    used = [m for e in normalized for m in _partition_specs.axes_of(e)]
    repeated = sorted({m for m in used if used.count(m) > 1})
    if repeated:
      raise _errors.LogicalRulesError(
        f'{where}: the PartitionSpec {target!r} names mesh axes {repeated} '
        'more than once; a mesh axis can shard one dimension only.'
      )
    if not leading and not any(normalized):
      return REPLICATE, (), False
    return MESH, tuple(normalized), leading
  for e in entries:
    if not (e is None or (isinstance(e, str) and e)):
      raise _errors.RuleTargetTypeError(
        f'{where}: expected each logical axis of {target!r} to be a '
        f'non-empty str or None; got {e!r}. To name mesh axes, use a '
        f'PartitionSpec. {PATH_RULES_FIX_MSG}'
      )
  names = [e for e in entries if e is not None]
  repeated = sorted({n for n in names if names.count(n) > 1})
  if repeated:
    raise _errors.LogicalRulesError(
      f'{where}: the logical axes {target!r} name {repeated} more than once; '
      "give each dimension its own logical name, e.g. ('embed', 'embed_out')."
    )
  if not leading and not entries:
    return REPLICATE, (), False
  return LOGICAL, tuple(entries), leading


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class PathRule:
  """A sharding target for the variables whose path matches a pattern.

  The pattern is a regular expression, searched (``re.search``, as eformer's
  ``match_partition_rules`` does) in the variable's path joined with '/'
  (``layers/0/attn/q/kernel``, the plan's path format). In a rule set, the
  first rule that matches a variable wins.

  Args:
    pattern: The regular expression.
    target: What the matched variables get, one entry per dimension:
      logical axes (a tuple such as ``('embed', 'mlp')``), resolved by the
      logical rules with all their fallbacks; a ``PartitionSpec`` of mesh
      axes, fitted to the mesh and shape (an axis the mesh lacks, or that
      does not divide its dimension, replicates that dimension, and the plan
      records why); or None, to replicate. A leading ``...`` (``(...,
      'embed', 'mlp')``) leaves any leading dimensions replicated, so that
      one rule serves layers stacked by ``nnx.scan`` or ``nnx.vmap``.
    type: Only variables of this ``nnx.Variable`` type match (``nnx.Param``,
      ``nnx.BatchStat``, ...), or of a subclass; None for any type.
    override: Whether the rule also applies to variables annotated with
      logical axes. By default annotations win.
    note: Why the rule is there, in a few words, or None. The plan's
      `source` column shows it after the rule (`fdt.suggest_rules` says
      which preset or proposal wrote each rule this way).

  Raises:
    LogicalRulesError: If the pattern is not a valid regular expression, or
      the target repeats a name or misplaces ``...``.
    RuleTargetTypeError: If the target is of a wrong type.

  Example:
    >>> import flax_dtensor as fdt
    >>> from flax import nnx
    >>> rule = fdt.PathRule(r'attn/(q|k|v)/kernel$', (..., 'embed', 'heads'),
    ...                     type=nnx.Param)
    >>> rule.matches('layers/3/attn/q/kernel', nnx.Param)
    True
  """

  pattern: str
  target: tuple[Any, ...] | PartitionSpec | None
  type: type[nnx.Variable] | None
  override: bool
  note: str | None
  kind: str = dataclasses.field(repr=False, compare=False)
  entries: tuple[Any, ...] = dataclasses.field(repr=False, compare=False)
  leading: bool = dataclasses.field(repr=False, compare=False)
  regex: re.Pattern[str] = dataclasses.field(repr=False, compare=False)

  def __init__(
    self,
    pattern: str,
    target: Any,
    *,
    type: type[nnx.Variable] | None = None,
    override: bool = False,
    note: str | None = None,
  ) -> None:
    self._init(pattern, target, type, override, None, note)

  def _init(
    self,
    pattern: str,
    target: Any,
    type: type[nnx.Variable] | None,
    override: bool,
    index: int | None,
    note: str | None = None,
  ) -> None:
    where = _where(index)
    if not isinstance(pattern, str) or not pattern:
      raise _errors.LogicalRulesError(
        f'{where}: the pattern must be a non-empty str (a regular '
        f'expression); got {pattern!r}. {PATH_RULES_FIX_MSG}'
      )
    try:
      regex = re.compile(pattern)
    except re.error as e:
      raise _errors.LogicalRulesError(
        f'{where}: {pattern!r} is not a valid regular expression ({e}). '
        'Fix the pattern; escape special characters such as . with a '
        r"backslash (r'ln\.scale')."
      ) from e
    kind, entries, leading = _normalize_target(target, f'{where} {pattern!r}')
    if type is not None and not (
      isinstance(type, _type) and issubclass(type, nnx.Variable)
    ):
      raise _errors.LogicalRulesError(
        f'{where} {pattern!r}: `type` must be an nnx.Variable subclass '
        f'(e.g. nnx.Param) or None; got {type!r}.'
      )
    if not isinstance(override, bool):
      raise _errors.LogicalRulesError(
        f'{where} {pattern!r}: `override` must be a bool; got {override!r}.'
      )
    if note is not None and not (isinstance(note, str) and note.strip()):
      raise _errors.LogicalRulesError(
        f'{where} {pattern!r}: `note` must be a non-empty str (why the rule '
        f'is there) or None; got {note!r}.'
      )
    if kind == REPLICATE:
      canonical: Any = None
    elif kind == MESH:
      canonical = PartitionSpec(*((Ellipsis,) if leading else ()), *entries)
    else:
      canonical = ((Ellipsis,) if leading else ()) + entries
    for name, value in (
      ('pattern', pattern),
      ('target', canonical),
      ('type', type),
      ('override', override),
      ('note', None if note is None else ' '.join(note.split())),
      ('kind', kind),
      ('entries', entries),
      ('leading', leading),
      ('regex', regex),
    ):
      object.__setattr__(self, name, value)

  def __repr__(self) -> str:
    if self.kind == REPLICATE:
      target = 'None'
    else:
      target = _text(self, self.leading)
    options = ''
    if self.type is not None:
      options += f', type=nnx.{self.type.__name__}'
    if self.override:
      options += ', override=True'
    if self.note is not None:
      options += f', note={self.note!r}'
    return f'PathRule({self.pattern!r}, {target}{options})'

  def __reduce__(self):
    return (
      _rebuild,
      (self.pattern, self.target, self.type, self.override, self.note),
    )

  def matches(self, path: str, variable_type: type | None = None) -> bool:
    """Whether the rule matches a variable of this type at this path.

    A rule with a `type` never matches a plain array (`variable_type`
    None).
    """
    if self.type is not None and not (
      variable_type is not None and issubclass(variable_type, self.type)
    ):
      return False
    return self.regex.search(path) is not None

  def describe(self, index: int) -> str:
    """'path rule #2 'attn/.*/kernel'', as the plan's `source` shows it,
    followed by the rule's note in parentheses if it has one."""
    text = f'path rule #{index} {self.pattern!r}'
    return text if self.note is None else f'{text} ({self.note})'

  def to_yaml_dict(self) -> dict[str, Any]:
    """The rule as ``from_yaml`` reads it (a dict of plain values)."""
    out: dict[str, Any] = {'pattern': self.pattern}
    entries = [ELLIPSIS_TEXT] if self.leading else []
    if self.kind == MESH:
      entries += [list(e) if isinstance(e, tuple) else e for e in self.entries]
      out['spec'] = entries
    else:
      out['logical'] = entries + list(self.entries)
    if self.type is not None:
      out['type'] = self.type.__name__
    if self.override:
      out['override'] = True
    if self.note is not None:
      out['note'] = self.note
    return out


def _rebuild(pattern, target, type_, override, note=None) -> PathRule:
  return PathRule(pattern, target, type=type_, override=override, note=note)


def _variable_type(name: Any, where: str) -> type[nnx.Variable]:
  """``nnx.Param`` for 'Param' or 'nnx.Param' (YAML's spelling)."""
  if isinstance(name, _type):
    return name
  text = str(name).removeprefix('nnx.').removeprefix('flax.nnx.')
  found = getattr(nnx, text, None)
  if not (isinstance(found, _type) and issubclass(found, nnx.Variable)):
    known = sorted(
      n
      for n in dir(nnx)
      if isinstance(getattr(nnx, n), _type)
      and issubclass(getattr(nnx, n), nnx.Variable)
    )
    raise _errors.LogicalRulesError(
      f'{where}: `type` {name!r} names no nnx.Variable type; expected one '
      f'of {known}.'
    )
  return found


_DICT_KEYS = {
  'pattern',
  'logical',
  'spec',
  'target',
  'type',
  'override',
  'note',
}


def _from_mapping(item: Mapping[str, Any], index: int) -> PathRule:
  where = _where(index)
  extra = sorted(set(map(str, item)) - _DICT_KEYS)
  if extra or 'pattern' not in item:
    raise _errors.LogicalRulesError(
      f'{where} {dict(item)!r}: expected the keys `pattern` and one of '
      f'`logical` / `spec` (optionally `type`, `override`, `note`); '
      + (f'got unknown keys {extra}. ' if extra else 'got no `pattern`. ')
      + PATH_RULES_FIX_MSG
    )
  targets = [k for k in ('logical', 'spec', 'target') if k in item]
  if len(targets) != 1:
    raise _errors.LogicalRulesError(
      f'{where} {dict(item)!r}: expected exactly one of `logical` (logical '
      f'axes) and `spec` (mesh axes); got {targets or "neither"}. '
      f'{PATH_RULES_FIX_MSG}'
    )
  target = item[targets[0]]
  if targets[0] == 'spec':
    if target is not None and not isinstance(target, list | tuple):
      raise _errors.RuleTargetTypeError(
        f'{where}: `spec` must be a list of mesh axes (one entry per '
        f'dimension); got {target!r}. {PATH_RULES_FIX_MSG}'
      )
    target = PartitionSpec(
      *(
        Ellipsis
        if _is_ellipsis(e)
        else tuple(e)
        if isinstance(e, list) and len(e) > 1
        else (e[0] if isinstance(e, list) and len(e) == 1 else e)
        for e in (target or ())
      )
    )
  elif isinstance(target, list):
    target = tuple(target)
  type_ = item.get('type')
  return _make(
    item['pattern'],
    target,
    None if type_ is None else _variable_type(type_, where),
    item.get('override', False),
    index,
    item.get('note'),
  )


def _make(
  pattern: Any,
  target: Any,
  type_: Any,
  override: Any,
  index: int,
  note: Any = None,
) -> PathRule:
  """A `PathRule`, its errors naming its position in the rule set."""
  rule = PathRule.__new__(PathRule)
  rule._init(pattern, target, type_, override, index, note)
  return rule


def normalize(path_rules: Any) -> tuple[PathRule, ...]:
  """Path rules as a tuple of `PathRule`, from any form `LogicalRules` takes.

  Raises:
    LogicalRulesError: If an item is malformed.
    RuleTargetTypeError: If a target is of a wrong type.
  """
  if path_rules is None:
    return ()
  if isinstance(path_rules, str | bytes | Mapping) or not isinstance(
    path_rules, collections.abc.Iterable
  ):
    raise _errors.LogicalRulesError(
      f'`path_rules` must be a sequence of path rules; got '
      f'{type(path_rules).__name__} {path_rules!r:.100}. {PATH_RULES_FIX_MSG}'
    )
  out = []
  for i, item in enumerate(path_rules):
    if isinstance(item, PathRule):
      out.append(item)
    elif isinstance(item, Mapping):
      out.append(_from_mapping(item, i))
    elif (
      isinstance(item, collections.abc.Sequence)
      and not isinstance(item, str | bytes)
      and len(item) == 2
    ):
      target = item[1]
      if isinstance(target, list):
        target = tuple(target)
      out.append(_make(item[0], target, None, False, i))
    else:
      raise _errors.LogicalRulesError(
        f'path rule #{i} {item!r}: expected a (pattern, target) pair. '
        f'{PATH_RULES_FIX_MSG}'
      )
  return tuple(out)


def first_match(
  path_rules: Sequence[PathRule], path: str, variable_type: type | None
) -> tuple[int, PathRule] | None:
  """(index, rule) of the first rule matching, or None."""
  for i, rule in enumerate(path_rules):
    if rule.matches(path, variable_type):
      return i, rule
  return None


def itemsize(dtype: Any) -> int:
  """Bytes per element (a typed PRNG key counts its key data)."""
  import jax

  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))
    return math.prod(data.shape) * data.dtype.itemsize
  return np.dtype(dtype).itemsize


def exemption(
  shape: Sequence[int] | None,
  dtype: Any,
  *,
  min_size: int,
  min_bytes: int,
) -> str | None:
  """Why path rules leave a variable of this shape alone, or None.

  Scalars are never sharded, and neither is anything smaller than the
  thresholds (eformer's ``MIN_SHARDING_SIZE``, per rule set).
  """
  if shape is None:
    return None
  if len(shape) == 0:
    return 'a scalar'
  size = math.prod(shape)
  if size < min_size:
    return f'{size} elements, below min_size={min_size}'
  if min_bytes and dtype is not None:
    nbytes = size * itemsize(dtype)
    if nbytes < min_bytes:
      return f'{nbytes} bytes, below min_bytes={min_bytes}'
  return None


def entries_for(
  rule: PathRule,
  index: int,
  shape: Sequence[int] | None,
  path: str,
) -> tuple[Any, ...]:
  """The rule's target laid over `shape`: one entry per dimension.

  Raises:
    ShardingResolutionError: If the target's rank does not fit the shape.
  """
  if rule.kind == REPLICATE:
    return (None,) * (len(shape) if shape is not None else 0)
  if shape is None:
    return rule.entries
  rank, k = len(shape), len(rule.entries)
  if rule.leading and k <= rank:
    return (None,) * (rank - k) + rule.entries
  if not rule.leading and k == rank:
    return rule.entries
  example = _example(rule, rank)
  lead = '' if rule.leading else f', or lead it with ... ({_text(rule, True)})'
  raise _errors.ShardingResolutionError(
    f'{rule.describe(index)} matches {path!r}, of shape {tuple(shape)} (rank '
    f'{rank}), but its target {_text(rule, rule.leading)} has {k} '
    f'{"entry" if k == 1 else "entries"}'
    + (' after ...' if rule.leading else '')
    + f'. Expected {"at most " if rule.leading else ""}one entry per '
    f'dimension: write a target of rank {rank} (e.g. {example}){lead}, or '
    f'narrow the pattern so that it does not match {path!r}.'
  )


def _text(rule: PathRule, leading: bool) -> str:
  entries = (('...',) if leading else ()) + tuple(
    _partition_specs.format_entry(e) if rule.kind == MESH else repr(e)
    for e in rule.entries
  )
  inner = ', '.join(entries)
  if rule.kind == MESH:
    return f'P({inner})'
  return f'({inner}{"," if len(entries) == 1 else ""})'


def _example(rule: PathRule, rank: int) -> str:
  entries = list(rule.entries)[:rank]
  entries += [None] * (rank - len(entries))
  inner = ', '.join(
    _partition_specs.format_entry(e) if rule.kind == MESH else repr(e)
    for e in entries
  )
  if rule.kind == MESH:
    return f'P({inner})'
  return f'({inner}{"," if rank == 1 else ""})'
