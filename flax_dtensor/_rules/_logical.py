"""Logical-axis rules: the rule set, its options and its pickled form.

`LogicalRules` is an ordered, immutable set of ``(logical_name, target)``
pairs with options (path rules, thresholds, what unknown names and missing
mesh axes do), each declared once in `_OPTIONS`. Its YAML forms are read
and written by `_yaml`, the thread-local context that sets rules is
`_context`, and resolution lives in `_resolution`.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from flax_dtensor import _errors
from flax_dtensor._rules import _first_made, _path_rules, _yaml

Target = str | tuple[str, ...] | None
LogicalAxes = Sequence[str | None]
Unknown = Literal['error', 'replicate']
MissingMeshAxes = Literal['fallback', 'error']

_UNKNOWN_CHOICES = ('error', 'replicate')
_MISSING_MESH_AXES_CHOICES = ('fallback', 'error')

RULES_FIX_MSG = (
  'Each rule is a pair (logical_name, target) where logical_name is a str '
  'and target is a mesh axis name, a list/tuple of mesh axis names, or None '
  "(replicate), e.g. [('batch', 'data'), ('embed', ('data', 'model')), "
  "('vocab', None)]."
)


def _normalize_target(target: Any, where: str) -> Target:
  """Returns a target as a str, a tuple of >= 2 str, or None."""
  if target is None or isinstance(target, str):
    return target
  if isinstance(target, collections.abc.Sequence) and not isinstance(
    target, bytes
  ):
    if not all(isinstance(t, str) for t in target):
      raise _errors.RuleTargetTypeError(
        f'{where}: expected a mesh axis name, a sequence of mesh axis names, '
        f'or None; got a sequence containing non-str items: {target!r}. '
        f'{RULES_FIX_MSG}'
      )
    if len(target) == 0:
      return None
    if len(target) == 1:
      return target[0]
    if len(set(target)) != len(target):
      raise _errors.LogicalRulesError(
        f'{where}: target {target!r} names a mesh axis more than once. '
        'A mesh axis can shard a dimension only once; remove the repeat.'
      )
    return tuple(target)
  raise _errors.RuleTargetTypeError(
    f'{where}: expected a mesh axis name, a sequence of mesh axis names, or '
    f'None; got {type(target).__name__} {target!r}. {RULES_FIX_MSG}'
  )


def _threshold(name: str) -> Callable[[Any], int]:
  def check(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
      raise _errors.LogicalRulesError(
        f'`{name}` must be an int >= 0 (a threshold below which path rules '
        f'leave a variable replicated); got {value!r}.'
      )
    return value

  return check


def _unknown(value: Any) -> Unknown:
  if value not in _UNKNOWN_CHOICES:
    raise _errors.LogicalRulesError(
      f'`unknown` must be one of {_UNKNOWN_CHOICES}; got {value!r}.'
    )
  return value


def _missing_mesh_axes(value: Any) -> MissingMeshAxes:
  if value not in _MISSING_MESH_AXES_CHOICES:
    raise _errors.LogicalRulesError(
      f'`missing_mesh_axes` must be one of {_MISSING_MESH_AXES_CHOICES} '
      "('fallback': a rule naming a mesh axis the mesh lacks is skipped, a "
      "likely typo warned; 'error': such a rule raises); got "
      f'{value!r}.'
    )
  return value


def _strict(value: Any) -> bool:
  if not isinstance(value, bool):
    raise _errors.LogicalRulesError(f'`strict` must be a bool; got {value!r}.')
  return value


@dataclasses.dataclass(frozen=True)
class _Option:
  """One option of `LogicalRules`: its default and how a value is checked."""

  default: Any
  check: Callable[[Any], Any]
  doc: str


# Every option of LogicalRules, once, in their pickled order.
_OPTIONS: dict[str, _Option] = {
  'unknown': _Option(
    'error', _unknown, 'What happens to a logical name no rule mentions.'
  ),
  'strict': _Option(
    False, _strict, 'Whether a dimension with no fitting candidate raises.'
  ),
  'path_rules': _Option(
    (),
    _path_rules.normalize,
    'The path rules, in priority order (the first match wins).',
  ),
  'min_size': _Option(
    0,
    _threshold('min_size'),
    'Path rules leave variables of fewer elements replicated.',
  ),
  'min_bytes': _Option(
    0,
    _threshold('min_bytes'),
    'Path rules leave variables of fewer bytes replicated.',
  ),
  'missing_mesh_axes': _Option(
    'fallback',
    _missing_mesh_axes,
    'What a rule naming a mesh axis the mesh lacks does: falls back '
    "('fallback'), or raises ('error').",
  ),
}


def _option(name: str) -> property:
  return property(lambda self: self._options[name], doc=_OPTIONS[name].doc)


class LogicalRules(tuple):
  """An immutable, ordered set of logical-to-mesh axis rules.

  A logical name may appear several times: the first entry is its preferred
  target and later entries are fallbacks, tried when an earlier candidate
  names a mesh axis the mesh lacks, does not divide the dimension, or uses a
  mesh axis already taken by another dimension of the same array.

  ``LogicalRules`` is a tuple of ``(name, target)`` pairs, so Flax Linen's
  ``nn.logical_to_mesh_axes`` and Flax's rules context accept it unchanged.

  Path rules (`path_rules`) shard variables that carry no logical axes, by
  their path: the models people already have (see the path rules page).

  Args:
    pairs: A sequence of ``(logical_name, target)`` pairs, a mapping from
      logical names to targets, or another ``LogicalRules``.
    unknown: What to do with a logical name that no rule mentions:
      ``'error'`` (the default) raises `UnknownLogicalAxisError`,
      ``'replicate'`` leaves that dimension unsharded (Linen's behaviour).
    strict: If true, a dimension whose every candidate was skipped raises
      `ShardingResolutionError` instead of staying unsharded.
    path_rules: Ordered `PathRule`s (or ``(pattern, target)`` pairs, or
      dicts as ``from_yaml`` reads them) for variables by their '/'-joined
      path: the first rule whose pattern matches wins. Annotated variables
      keep their annotation unless the rule says ``override=True``.
    min_size: Path rules leave variables of fewer elements replicated.
    min_bytes: Path rules leave variables of fewer bytes replicated.
      (Scalars are never sharded by path rules.)
    missing_mesh_axes: What a rule naming a mesh axis that the mesh lacks
      does (whichever dimension it would shard): ``'fallback'`` (the
      default) skips it, so the next rule for its name applies, and warns
      `LikelyTypoWarning` once when the axis is spelled like one of the
      mesh's (``'dta'`` for ``'data'``); ``'error'`` raises
      `MissingMeshAxisError` for any such rule, as soon as the rules meet
      the mesh. (Unlike `strict`, which is about dimensions, this is about
      the rules' mesh axes.)

  Raises:
    LogicalRulesError: If a pair is malformed or an option is invalid.
    RuleTargetTypeError: If a target is not a str, a sequence of str or None.

  Example:
    >>> import flax_dtensor as fdt
    >>> rules = fdt.LogicalRules([('embed', 'fsdp'), ('mlp', 'model'),
    ...                           ('mlp', 'data'), ('vocab', None)])
    >>> rules.candidates('mlp')
    ('model', 'data')
    >>> with_paths = rules.replace(path_rules=[('embed/embedding$',
    ...                                         ('vocab', 'embed'))])
    >>> with_paths.path_rules[0].target
    ('vocab', 'embed')
  """

  _options: dict[str, Any]

  def __new__(
    cls,
    pairs: Sequence[tuple[str, Any]] | Mapping[str, Any] = (),
    *,
    unknown: Unknown | None = None,
    strict: bool | None = None,
    path_rules: Sequence[Any] | None = None,
    min_size: int | None = None,
    min_bytes: int | None = None,
    missing_mesh_axes: MissingMeshAxes | None = None,
  ) -> LogicalRules:
    given = {
      'unknown': unknown,
      'strict': strict,
      'path_rules': path_rules,
      'min_size': min_size,
      'min_bytes': min_bytes,
      'missing_mesh_axes': missing_mesh_axes,
    }
    return cls._new(pairs, given)

  @classmethod
  def _new(cls, pairs: Any, given: Mapping[str, Any]) -> LogicalRules:
    """The rules of `pairs` with the options `given` (None: inherited from
    `pairs` if they are rules, else the default)."""
    if isinstance(pairs, LogicalRules):
      if cls is LogicalRules and all(
        value is None
        or (name != 'path_rules' and value == pairs._options[name])
        for name, value in given.items()
      ):
        return pairs  # Immutable: the same rules need no copy.
      inherited = pairs._options
    else:
      inherited = {name: o.default for name, o in _OPTIONS.items()}
    options = {
      name: option.check(
        inherited[name] if given.get(name) is None else given[name]
      )
      for name, option in _OPTIONS.items()
    }
    if isinstance(pairs, Mapping):
      items = list(pairs.items())
    elif isinstance(pairs, (str, bytes)) or not isinstance(
      pairs, collections.abc.Iterable
    ):
      raise _errors.LogicalRulesError(
        f'Expected a sequence of (logical_name, target) pairs or a dict; '
        f'got {type(pairs).__name__} {pairs!r}. {RULES_FIX_MSG}'
      )
    else:
      items = list(pairs)
    normalized = []
    for i, pair in enumerate(items):
      where = f'rule {i} {pair!r}'
      if (
        isinstance(pair, (str, bytes))
        or not isinstance(pair, collections.abc.Sequence)
        or len(pair) != 2
      ):
        raise _errors.LogicalRulesError(
          f'{where}: expected a (logical_name, target) pair. {RULES_FIX_MSG}'
        )
      name, target = pair
      if not isinstance(name, str) or not name:
        raise _errors.LogicalRulesError(
          f'{where}: the logical name must be a non-empty str; got '
          f'{name!r}. {RULES_FIX_MSG}'
        )
      normalized.append((name, _normalize_target(target, where)))
    self = super().__new__(cls, normalized)
    object.__setattr__(self, '_options', options)
    _first_made.made()
    return self

  def __setattr__(self, name: str, value: Any) -> None:
    raise AttributeError('LogicalRules is immutable; use `.replace(...)`.')

  def __delattr__(self, name: str) -> None:
    raise AttributeError('LogicalRules is immutable.')

  def __reduce__(self):
    # By the public name (see `__module__` below): unpickling goes through
    # the package's namespace, which installs the Flax hook before these
    # rules exist in the new process. The options follow in `_OPTIONS`'s
    # order, which pickles of earlier versions share.
    return (
      self._unpickled,
      (tuple(self), *(self._options[name] for name in _OPTIONS)),
    )

  @classmethod
  def _unpickled(cls, pairs: Any, *options: Any) -> LogicalRules:
    return cls._new(pairs, dict(zip(_OPTIONS, options, strict=False)))

  unknown = _option('unknown')
  strict = _option('strict')
  path_rules = _option('path_rules')
  min_size = _option('min_size')
  min_bytes = _option('min_bytes')
  missing_mesh_axes = _option('missing_mesh_axes')

  @property
  def names(self) -> tuple[str, ...]:
    """The logical names the rules mention, in first-mention order."""
    return tuple(dict.fromkeys(name for name, _ in self))

  def candidates(self, name: str) -> tuple[Target, ...]:
    """Returns the targets for `name`, in priority order."""
    return tuple(target for n, target in self if n == name)

  def replace(self, **options: Any) -> LogicalRules:
    """Returns a copy with some options changed.

    Args:
      **options: Any of `unknown`, `strict`, `path_rules`, `min_size`,
        `min_bytes` and `missing_mesh_axes` (see `LogicalRules`).

    Raises:
      LogicalRulesError: If an option is unknown or its value invalid.
    """
    wrong = sorted(set(options) - set(_OPTIONS))
    if wrong:
      raise _errors.LogicalRulesError(
        f'LogicalRules has no option {wrong}; expected some of '
        f'{list(_OPTIONS)}.'
      )
    return LogicalRules._new(self, options)

  @classmethod
  def for_mesh_axes(cls, mesh: Any, **options: Any) -> LogicalRules:
    """Rules for annotations that already name mesh axes: each axis is its
    own rule.

    Libraries such as tunix annotate parameters with mesh axis names
    (``nnx.Param(w, sharding=('fsdp', 'tp'))``). These rules keep each
    name as it is, with flax_dtensor's checks: an axis that does not divide
    a dimension, or is used twice in one array, leaves that dimension
    replicated and says why in the plan (Flax would fail inside JAX).

    Args:
      mesh: A mesh (concrete or abstract), or its axis names.
      **options: `LogicalRules` options (``unknown=``, ``path_rules=``, ...).

    Example:
      >>> import jax, flax_dtensor as fdt
      >>> mesh = jax.sharding.AbstractMesh((2, 4), ('fsdp', 'tp'))
      >>> fdt.LogicalRules.for_mesh_axes(mesh)
      LogicalRules([('fsdp', 'fsdp'), ('tp', 'tp')])
    """
    names = getattr(mesh, 'axis_names', mesh)
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
      raise _errors.LogicalRulesError(
        'Expected a mesh or a sequence of its axis names (str) for '
        f'`for_mesh_axes`, got {mesh!r}.'
      )
    return cls([(name, name) for name in names], **options)

  def prepend(self, pairs: Sequence[tuple[str, Any]]) -> LogicalRules:
    """Returns rules where `pairs` take priority over these rules."""
    if not pairs:
      return self
    return LogicalRules._new([*LogicalRules(pairs), *self], self._options)

  def __eq__(self, other: object) -> bool:
    if isinstance(other, LogicalRules):
      return tuple(self) == tuple(other) and self._options == other._options
    return tuple.__eq__(self, other)

  def __ne__(self, other: object) -> bool:
    return not self == other

  def __hash__(self) -> int:
    # Hash like the plain tuple of pairs, which compares equal to it.
    return tuple.__hash__(self)

  def __repr__(self) -> str:
    options = ''.join(
      f', {name}={value!r}'
      if name != 'path_rules'
      else f', path_rules={list(value)!r}'
      for name, value in self._options.items()
      if value != _OPTIONS[name].default
    )
    return f'LogicalRules({list(self)!r}{options})'

  @classmethod
  def from_yaml(
    cls,
    path: str | os.PathLike[str],
    *,
    unknown: Unknown | None = None,
    strict: bool | None = None,
  ) -> LogicalRules:
    """Reads a rules file in MaxText's format, with YAML's safe loader.

    The file holds a document with a ``logical_axis_rules`` key (MaxText's
    ``base.yml`` loads as it is) or a bare list of pairs::

      logical_axis_rules: [['batch', ['data', 'fsdp']],
                           ['embed', 'fsdp'],
                           ['vocab', []]]

    Beside it, a ``path_rules`` key holds path rules (see `PathRule`), each
    a ``[pattern, logical axes]`` pair or a dict with ``pattern`` and
    ``logical`` (logical axes) or ``spec`` (mesh axes), and optionally
    ``type`` (an ``nnx.Variable`` type's name) and ``override``; ``'...'``
    (quoted: bare ``...`` ends a YAML document) leads a target for stacked
    layers. ``min_size`` and ``min_bytes`` set the thresholds::

      path_rules:
        - ['embed/embedding$', ['vocab', 'embed']]
        - {pattern: 'attn/(q|k|v)/kernel$', spec: ['...', 'data', 'model']}
        - {pattern: 'norm', logical: null, type: Param}
      min_bytes: 65536

    With path rules, ``logical_axis_rules`` may be left out.
    ``missing_mesh_axes: error`` makes a rule naming a mesh axis the mesh
    lacks an error (see `LogicalRules`).

    Args:
      path: The path of the YAML file. (For YAML text, use
        `from_yaml_text`.)
      unknown: See `LogicalRules`.
      strict: See `LogicalRules`.

    Returns:
      The rules.

    Raises:
      LogicalRulesError: If the file cannot be read, is not valid YAML or
        holds no rules.
    """
    text, source = _yaml.read_file(path)
    return cls._from_document(text, source, unknown, strict)

  def to_yaml_text(self) -> str:
    """The rules as a YAML document that `from_yaml_text` reads back.

    Logical rules under ``logical_axis_rules``, path rules under
    ``path_rules`` (one flow-style dict per rule, with its note), and the
    thresholds and `missing_mesh_axes` when not the default; `unknown` and
    `strict` are options of the reader, not of the file. Every string is
    single-quoted, so a regular expression reads as it is written.

    Returns:
      The YAML text.

    Example:
      >>> import flax_dtensor as fdt
      >>> print(fdt.LogicalRules([('embed', 'data')], path_rules=[
      ...     ('up/kernel$', ('embed', None))]).to_yaml_text(), end='')
      logical_axis_rules:
        - ['embed', 'data']
      path_rules:
        - {pattern: 'up/kernel$', logical: ['embed', null]}
    """
    written = ('min_size', 'min_bytes', 'missing_mesh_axes')
    return _yaml.dump(
      self,
      self.path_rules,
      {
        name: self._options[name]
        for name in written
        if self._options[name] != _OPTIONS[name].default
      },
    )

  @classmethod
  def from_yaml_text(
    cls,
    text: str,
    *,
    unknown: Unknown | None = None,
    strict: bool | None = None,
  ) -> LogicalRules:
    """Parses rules in MaxText's format from YAML text (see `from_yaml`).

    Args:
      text: The YAML document.
      unknown: See `LogicalRules`.
      strict: See `LogicalRules`.

    Returns:
      The rules.

    Raises:
      LogicalRulesError: If the text is not valid YAML or holds no rules.

    Example:
      >>> import flax_dtensor as fdt
      >>> fdt.LogicalRules.from_yaml_text(
      ...     "logical_axis_rules: [['batch', 'data'], ['vocab', []]]")
      LogicalRules([('batch', 'data'), ('vocab', None)])
    """
    if not isinstance(text, str):
      raise _errors.LogicalRulesError(
        f'Expected YAML text (a str), got {type(text).__name__}. For a file, '
        'use `LogicalRules.from_yaml(path)`.'
      )
    return cls._from_document(text, 'The YAML text', unknown, strict)

  @classmethod
  def _from_document(
    cls,
    text: str,
    source: str,
    unknown: Unknown | None,
    strict: bool | None,
  ) -> LogicalRules:
    """The rules of a YAML document (`_yaml.parse`), named `source` in
    messages."""
    document, options = _yaml.parse(text, source)
    try:
      return cls(document, unknown=unknown, strict=strict, **options)
    except (_errors.LogicalRulesError, _errors.RuleTargetTypeError) as e:
      raise type(e)(f'{source}: {e}') from e


# Pickled, printed and documented as `flax_dtensor.LogicalRules`.
LogicalRules.__module__ = 'flax_dtensor'


RulesLike = LogicalRules | Sequence[tuple[str, Any]] | Mapping[str, Any]
