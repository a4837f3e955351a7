"""Logical-axis rules: the rule set and its thread-local context.

`LogicalRules` is an ordered, immutable set of ``(logical_name, target)``
pairs. The context (`logical_axis_rules`) keeps the rules in Flax's own
thread-local holder, the single source of truth; `rules_in_effect` says which
rules apply here and so whose semantics. Resolution lives in `_resolution`.
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import functools
import os
import pathlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar

import jax
import yaml
from flax.core import spmd as core_spmd

from flax_dtensor import _errors
from flax_dtensor._rules import _meshes, _path_rules

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


class _FirstMade:
  """What runs once, when the first `LogicalRules` of the process is made.

  The hook routes module construction through itself only from then on
  (`when_first_made`): nothing else needs it, so a process that never makes
  rules of ours builds its modules at Flax's cost.
  """

  def __init__(self) -> None:
    self.waiting: list[Callable[[], None]] = []
    self.made = False
    self.lock = threading.Lock()

  def call(self) -> None:
    # Under the lock: rules made at the same time in another thread are
    # returned only once every callback ran (none of them makes rules).
    with self.lock:
      for callback in self.waiting:
        callback()
      self.waiting = []
      self.made = True


_first_made = _FirstMade()


def when_first_made(callback: Callable[[], None]) -> None:
  """Calls `callback` when the first `LogicalRules` is made (now if made)."""
  with _first_made.lock:
    if not _first_made.made:
      _first_made.waiting.append(callback)
      return
  callback()


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
    if _first_made.waiting:
      _first_made.call()
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
    source = os.fspath(path)
    try:
      text = pathlib.Path(source).read_text()
    except OSError as e:
      hint = (
        ' It looks like YAML text: use `LogicalRules.from_yaml_text`.'
        if '\n' in source or ':' in source
        else ''
      )
      raise _errors.LogicalRulesError(
        f'Cannot read rules file {source!r}: {e.strerror}. Expected the '
        f'path of a YAML file.{hint}'
      ) from e
    return cls._from_document(text, repr(source), unknown, strict)

  def to_yaml_text(self) -> str:
    """The rules as a YAML document that `from_yaml_text` reads back.

    Logical rules under ``logical_axis_rules``, path rules under
    ``path_rules`` (one flow-style dict per rule, with its note), and the
    thresholds and `missing_mesh_axes` when not the default; `unknown` and
    `strict` are options of the reader, not of the file. Every string is single-quoted, so a regular expression reads
    as it is written.

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
    lines = ['logical_axis_rules:' + ('' if self else ' []')]
    lines += [
      f'  - [{_yaml_scalar(name)}, {_yaml_scalar(target)}]'
      for name, target in self
    ]
    if self.path_rules:
      lines.append('path_rules:')
      for rule in self.path_rules:
        fields = ', '.join(
          f'{key}: {_yaml_scalar(value)}'
          for key, value in rule.to_yaml_dict().items()
        )
        lines.append(f'  - {{{fields}}}')
    for key in ('min_size', 'min_bytes'):
      if getattr(self, key):
        lines.append(f'{key}: {getattr(self, key)}')
    if self.missing_mesh_axes != _OPTIONS['missing_mesh_axes'].default:
      lines.append(f'missing_mesh_axes: {_yaml_scalar(self.missing_mesh_axes)}')
    return '\n'.join(lines) + '\n'

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
    try:
      document = yaml.safe_load(text)
    except yaml.YAMLError as e:
      raise _errors.LogicalRulesError(
        f'{source} is not valid YAML: {_yaml_problem(e)}. Expected '
        "MaxText's format, e.g. logical_axis_rules: [['batch', 'data'], "
        "['embed', 'fsdp']]."
      ) from e
    options: dict[str, Any] = {}
    if isinstance(document, Mapping):
      if 'missing_mesh_axes' in document:
        options['missing_mesh_axes'] = document['missing_mesh_axes']
      if 'logical_axis_rules' not in document and 'path_rules' not in document:
        raise _errors.LogicalRulesError(
          f'{source} has no `logical_axis_rules` key (keys: '
          f"{sorted(map(str, document))}). Expected MaxText's format, e.g. "
          "logical_axis_rules: [['batch', 'data'], ['embed', 'fsdp']], "
          'or a `path_rules` list.'
        )
      if 'path_rules' in document:
        path_rules = document['path_rules']
        if not isinstance(path_rules, list):
          raise _errors.LogicalRulesError(
            f'{source}: `path_rules` must be a list of path rules; got '
            f'{type(path_rules).__name__} {path_rules!r:.100}. '
            f'{_path_rules.PATH_RULES_FIX_MSG}'
          )
        options['path_rules'] = path_rules
        for key in ('min_size', 'min_bytes'):
          if key in document:
            options[key] = document[key]
      document = document.get('logical_axis_rules', [])
    # A list of pairs, or a mapping of each name to its one target: the
    # same two spellings `LogicalRules` takes in Python.
    if not isinstance(document, list | Mapping):
      raise _errors.LogicalRulesError(
        f'{source}: expected a list of [logical_name, target] pairs (or a '
        f'mapping of logical names to targets); got '
        f'{type(document).__name__} {document!r:.100}. {RULES_FIX_MSG}'
      )
    try:
      return cls(document, unknown=unknown, strict=strict, **options)
    except (_errors.LogicalRulesError, _errors.RuleTargetTypeError) as e:
      raise type(e)(f'{source}: {e}') from e


def _yaml_scalar(value: Any) -> str:
  """`value` (a str, None, bool, int or a list/tuple of them) as YAML flow
  text, strings single-quoted."""
  if value is None:
    return 'null'
  if isinstance(value, bool):
    return 'true' if value else 'false'
  if isinstance(value, int):
    return str(value)
  if isinstance(value, str):
    return "'" + value.replace("'", "''") + "'"
  return '[' + ', '.join(_yaml_scalar(v) for v in value) + ']'


def _yaml_problem(error: yaml.YAMLError) -> str:
  """YAML's complaint on one line, with its line and column, once.

  PyYAML's own text spans several lines, quotes the offending line and marks
  the column with a caret; this keeps what and where, e.g. "line 2, column
  1: expected ',' or ']', but got '<stream end>' (while parsing a flow
  sequence started at line 1, column 22)".
  """
  problem = getattr(error, 'problem', None)
  mark = getattr(error, 'problem_mark', None)
  if not problem or mark is None:
    return ' '.join(str(error).split())
  text = f'line {mark.line + 1}, column {mark.column + 1}: {problem}'
  context = getattr(error, 'context', None)
  context_mark = getattr(error, 'context_mark', None)
  if context:
    text += f' ({context}'
    if context_mark is not None:
      text += (
        f' started at line {context_mark.line + 1}, column '
        f'{context_mark.column + 1}'
      )
    text += ')'
  return text


# Pickled, printed and documented as `flax_dtensor.LogicalRules`.
LogicalRules.__module__ = 'flax_dtensor'


RulesLike = LogicalRules | Sequence[tuple[str, Any]] | Mapping[str, Any]


# Context
# ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FlaxRules:
  """Rules set with Flax's own context (a plain tuple): Flax's semantics.

  Flax NNX applies such rules as a dict (the last rule for a name wins, and
  a name no rule mentions is used as a mesh axis name). flax_dtensor reads
  them the same way everywhere, so that what it reports and places agrees
  with what Flax creates.

  Attributes:
    pairs: The rules exactly as set, ``()`` when none are set.
  """

  pairs: tuple[Any, ...] = ()


def rules_in_effect(
  rules: RulesLike | FlaxRules | None = None,
) -> LogicalRules | FlaxRules:
  """The rules that apply here, and by that, whose semantics.

  The one decision, applied by every API of the package: rules passed to a
  flax_dtensor function (`rules=`), or set with `logical_axis_rules` /
  `set_logical_axis_rules`, are `LogicalRules` and get flax_dtensor's
  semantics (priority, fallbacks, mesh and shape checks). Rules set with
  Flax's own ``nnx.logical_axis_rules`` or
  ``flax.core.spmd.set_logical_axis_rules`` (plain tuples), and no rules at
  all, keep Flax's semantics.

  Args:
    rules: Rules passed explicitly, or None for the context's.
  """
  if isinstance(rules, FlaxRules):
    return rules
  if rules is not None:
    return LogicalRules(rules)
  context = core_spmd.get_logical_axis_rules()
  if isinstance(context, LogicalRules):
    return context
  return FlaxRules(tuple(context) if context else ())


def get_logical_axis_rules() -> LogicalRules | tuple[Any, ...] | None:
  """Returns the logical-axis rules in effect in this thread, or None.

  A `LogicalRules` when they were set by flax_dtensor (its semantics
  apply); the plain tuple when they were set with Flax's own
  ``nnx.logical_axis_rules`` (Flax's semantics apply, see the concepts
  page); None when no rules are set.

  Example:
    >>> import flax_dtensor as fdt
    >>> with fdt.logical_axis_rules([('embed', 'data')]):
    ...   fdt.get_logical_axis_rules()
    LogicalRules([('embed', 'data')])
    >>> fdt.get_logical_axis_rules() is None
    True
  """
  rules = core_spmd.get_logical_axis_rules()
  if isinstance(rules, LogicalRules):
    return rules
  return tuple(rules) if rules else None


def set_logical_axis_rules(rules: RulesLike | None) -> None:
  """Sets the logical-axis rules of this thread until changed again.

  Prefer the `logical_axis_rules` context manager, which restores the outer
  rules on exit. ``None`` clears the rules.

  Args:
    rules: The rules, or None.

  Raises:
    LogicalRulesError: If the rules are malformed.
    RuleTargetTypeError: If a target is not a str, a sequence of str or None.
  """
  if rules is None:
    core_spmd.set_logical_axis_rules(())
    return
  core_spmd.set_logical_axis_rules(LogicalRules(rules))


@contextlib.contextmanager
def logical_axis_rules(rules: RulesLike) -> Iterator[LogicalRules]:
  """Sets the logical-axis rules of the current thread within a block.

  The rules are thread-local: other threads never see them (use `propagate`
  to hand them to a worker). Nesting replaces the outer rules and restores
  them on exit, also when the block raises. While the block is active, NNX
  variables annotated with logical axes (``nnx.with_partitioning``) are
  placed at creation by these rules, those the path rules cover when the
  outermost ``nnx.Module`` constructor returns, and Flax's
  ``nnx.get_partition_spec`` reports the same placement.

  Args:
    rules: A `LogicalRules`, or anything its constructor accepts.

  Like Flax's, the context is per thread, not per asyncio task: blocks of
  tasks that interleave in one thread (an ``await`` inside the block) would
  see each other's rules. That is detected: on exit, the block checks that
  the rules in effect are still its own, and raises otherwise.

  Yields:
    The rules as `LogicalRules`.

  Raises:
    LogicalRulesError: If the rules are malformed, or, on exit, the rules in
      effect are not the block's own (another block was interleaved with it,
      or rules were set inside it and not restored).
    RuleTargetTypeError: If a target is not a str, a sequence of str or None.

  Example:
    >>> import flax_dtensor as fdt
    >>> with fdt.logical_axis_rules([('batch', 'data'), ('mlp', 'model')]):
    ...   fdt.logical_to_mesh_axes(('batch', 'mlp'))
    P('data', 'model')
  """
  rules = LogicalRules(rules)
  block = _Block(rules, core_spmd.get_logical_axis_rules())
  _blocks.stack.append(block)
  core_spmd.set_logical_axis_rules(rules)
  try:
    yield rules
  except BaseException:
    _leave(block)
    raise
  interleaved = _leave(block)
  if interleaved is not None:
    raise _errors.LogicalRulesError(
      'A `logical_axis_rules` block ended while other rules were in effect '
      f'({interleaved!r}, expected its own {rules!r}): another block was '
      'interleaved with it in this thread (e.g. asyncio tasks awaiting '
      'inside their blocks), or rules were set inside it and not '
      'restored. Enter the rules in code that does not await, give each '
      'task its own thread (`fdt.propagate`), or restore what you set.'
    )


@dataclasses.dataclass
class _Block:
  rules: LogicalRules
  outer: Any
  said: set[str] = dataclasses.field(default_factory=set)


class _Blocks(threading.local):
  """This thread's active `logical_axis_rules` blocks, innermost last."""

  def __init__(self) -> None:
    self.stack: list[_Block] = []
    # For rules set by `set_logical_axis_rules` (no block): what was said.
    self.said: dict[int, tuple[Any, set[str]]] = {}


def first_time_in_context(what: str) -> bool:
  """True the first time `what` is asked about in the rules context in
  effect (the innermost `logical_axis_rules` block, or the rules set by
  `set_logical_axis_rules`), False after: for saying a thing once."""
  rules = core_spmd.get_logical_axis_rules()
  stack = _blocks.stack
  if stack and stack[-1].rules is rules:
    said = stack[-1].said
  else:
    kept = _blocks.said.get(id(rules))
    if kept is None or kept[0] is not rules:
      kept = _blocks.said[id(rules)] = (rules, set())
    said = kept[1]
  if what in said:
    return False
  said.add(what)
  return True


def forget_in_context(what: str) -> None:
  """Undoes `first_time_in_context(what)` in the rules context in effect."""
  rules = core_spmd.get_logical_axis_rules()
  stack = _blocks.stack
  if stack and stack[-1].rules is rules:
    stack[-1].said.discard(what)
  elif id(rules) in _blocks.said:
    _blocks.said[id(rules)][1].discard(what)


_blocks = _Blocks()


def _leave(block: _Block) -> Any:
  """Ends `block`; returns the rules found in effect if not its own.

  The innermost block restores the rules it found. A block ending while an
  inner one is still active (interleaved) leaves the inner one's rules in
  effect, and hands it its outer rules, so that every block restores what
  was there before all of them.
  """
  stack = _blocks.stack
  position = next(i for i, b in enumerate(stack) if b is block)
  current = core_spmd.get_logical_axis_rules()
  del stack[position]
  if position < len(stack):  # Inner blocks are still active.
    stack[position].outer = block.outer
    return current
  core_spmd.set_logical_axis_rules(block.outer)
  return None if current is block.rules else current


# Threads
# ------------------------------------------------------------------------------

C = TypeVar('C', bound=Callable[..., Any])


def propagate(fn: C) -> C:
  """Wraps `fn` so it runs with the caller's rules and mesh in any thread.

  Rules and ``jax.set_mesh`` meshes are thread-local: a new thread starts
  with none. ``propagate`` captures both when it is called and re-enters
  them around every call of the wrapper, so a worker thread sees exactly
  the caller's context (and nothing leaks back).

  Args:
    fn: The callable to run in another thread.

  Returns:
    A wrapper with the same signature.

  Example:
    >>> import concurrent.futures, flax_dtensor as fdt
    >>> with fdt.logical_axis_rules([('embed', 'data')]):
    ...   work = fdt.propagate(fdt.get_logical_axis_rules)
    >>> with concurrent.futures.ThreadPoolExecutor() as pool:
    ...   pool.submit(work).result()
    LogicalRules([('embed', 'data')])
  """
  rules = core_spmd.get_logical_axis_rules()
  abstract, concrete = _meshes.context_meshes()

  @functools.wraps(fn)
  def wrapper(*args: Any, **kwargs: Any) -> Any:
    with contextlib.ExitStack() as stack:
      if concrete is not None:
        stack.enter_context(jax.set_mesh(concrete))
      if abstract is not None and (
        concrete is None or concrete.abstract_mesh != abstract
      ):
        stack.enter_context(jax.sharding.use_abstract_mesh(abstract))
      stack.enter_context(core_spmd.logical_axis_rules(rules))
      return fn(*args, **kwargs)

  return wrapper  # type: ignore[return-value]
