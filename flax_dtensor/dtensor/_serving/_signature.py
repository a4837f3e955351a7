"""A served method's signature: what goes in, and what comes out.

`input_signature` gives each positional parameter of the method a TF input
(a `tf.TensorSpec` or `jax.ShapeDtypeStruct`) or None: the argument is then
None, and no input of the signature (`inputs`). Each input has a jax2tf
polymorphic shape: a TF spec's leading None is the batch 'b', any other None
a size of its own (`symbol`). The method's result is served as named arrays
(`named_outputs`). When the inputs do not fit, one check decides (here and
in `_saved_model`), and says it in the caller's words (`Wording`): those of
`input_signature`, or the command line's ``--input-shape`` flags.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from flax_dtensor import _errors, _text
from flax_dtensor.dtensor import _tf

if TYPE_CHECKING:
  import tensorflow as tf

# The symbol of a leading None dimension: the batch, one size for all inputs.
BATCH = 'b'
# Joins the keys of nested dicts in the name of a served output.
SEPARATOR = '/'
# What a served result may hold, besides None (left out).
_ARRAYS = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)
# The names of the suggested shapes: one length for every polymorphic
# dimension after the batch, or one per position.
_ONE_LENGTH = 't'
_AT_POSITION = 'd{}'
# An input's dimensions: a size, a name, or None (polymorphic, not named).
Dims = tuple[int | str | None, ...]


def symbol(index: int, position: int) -> str:
  """The symbol of a polymorphic dimension the caller did not name.

  'b' for the leading dimension (the batch, one size for every input), else
  ``d{index}_{position}`` (`index` of the entry in `input_signature`): a
  size of its own, which JAX cannot know to equal any other.
  """
  return BATCH if position == 0 else f'd{index}_{position}'


def symbolic_dims(dims: Sequence[int | str | None], index: int) -> Dims:
  """`dims` with each None (polymorphic, not named) as its `symbol`."""
  return tuple(symbol(index, j) if d is None else d for j, d in enumerate(dims))


def own_symbols(arguments: Sequence[Sequence[Any] | None]) -> set[str]:
  """The symbols of their own (not 'b') that `symbolic_dims` gives.

  Each argument is its dimensions (None: polymorphic, not named), or None.
  """
  return {
    symbol(index, j)
    for index, dims in enumerate(arguments)
    for j, d in enumerate(dims or ())
    if d is None and j > 0
  }


def shape_text(dims: Sequence[int | str]) -> str | None:
  """jax2tf's text of a shape, e.g. '(b, 16)'; None when it is static."""
  if all(isinstance(d, int | np.integer) for d in dims):
    return None
  return '(' + ', '.join(map(str, dims)) + (',)' if len(dims) == 1 else ')')


def _is_dim(d: Any) -> bool:
  return d is None or isinstance(d, int | np.integer)


def tensor_spec(spec: Any, index: int) -> tuple[tf.TensorSpec, str | None]:
  """An input's TF spec, and its jax2tf polymorphic shape (None: static).

  A `tf.TensorSpec`'s None dimensions are polymorphic (`polymorphic_shape`
  names them). A `jax.ShapeDtypeStruct` may carry symbolic dimensions
  (``jax.export.symbolic_shape('b, 64')``), which keep their names; on the
  JAX releases that accept None in its shape, a None is as in a TF spec.
  """
  tf = _tf.tf()
  if isinstance(spec, tf.TensorSpec):
    spec = tf.TensorSpec(spec.shape, spec.dtype, spec.name or f'input_{index}')
    return spec, polymorphic_shape(spec, index)
  if isinstance(spec, jax.ShapeDtypeStruct):
    dims = tuple(spec.shape)
    if all(_is_dim(d) for d in dims):
      tf_spec = tf.TensorSpec(dims, spec.dtype, f'input_{index}')
      return tf_spec, polymorphic_shape(tf_spec, index)
    tf_spec = tf.TensorSpec(
      [int(d) if isinstance(d, int | np.integer) else None for d in dims],
      spec.dtype,
      f'input_{index}',
    )
    text = ', '.join(str(d) for d in dims)
    return tf_spec, f'({text}{"," if len(dims) == 1 else ""})'
  raise _errors.ExportError(
    'Expected each entry of `input_signature` to be a tf.TensorSpec, a '
    f'jax.ShapeDtypeStruct or None, got {type(spec).__name__} at index '
    f'{index}: {spec!r}. For a polymorphic batch, write '
    'tf.TensorSpec([None, 64], tf.float32) or jax.ShapeDtypeStruct('
    "jax.export.symbolic_shape('b, 64'), jnp.float32); None passes None to "
    'the method.'
  )


def polymorphic_shape(spec: tf.TensorSpec, index: int) -> str | None:
  """'(b, 16)' for a [None, 16] spec: each None dimension by `symbol`."""
  shape = spec.shape
  if shape.rank is None:
    return None
  return shape_text(symbolic_dims(shape.as_list(), index))


# The method's parameters
# ------------------------------------------------------------------------------


class _Default:
  def __repr__(self) -> str:
    return '...'


@dataclasses.dataclass(frozen=True)
class Parameters:
  """How many positional arguments a method takes, as the caller sees it.

  Attributes:
    method: The method and its parameters, e.g. ``'LM.__call__(tokens,
      cache=...)'``.
    required: The number of positional parameters without a default.
    most: The number of positional parameters, None with ``*args``.
    keyword_only: The keyword-only parameters without a default.
  """

  method: str
  required: int
  most: int | None
  keyword_only: tuple[str, ...]

  def fits(self, count: int) -> bool:
    """Whether `count` positional arguments, and no other, make a call."""
    return (
      not self.keyword_only
      and self.required <= count
      and (self.most is None or count <= self.most)
    )

  def takes(self) -> str:
    """'takes 4 positional arguments' and the like."""
    if self.keyword_only:
      names = ', '.join(f'`{n}`' for n in self.keyword_only)
      return (
        f'needs the keyword-only argument(s) {names}, which a signature '
        'cannot give'
      )
    if self.most is None:
      return f'takes at least {_count(self.required)}'
    if self.most == self.required:
      return f'takes {_count(self.required)}'
    return f'takes from {self.required} to {_count(self.most)}'


def _count(n: int) -> str:
  return _text.count(n, 'positional argument')


def parameters(module: Any, method: str) -> Parameters | None:
  """The parameters of ``module.<method>`` (None where Python hides them)."""
  function = getattr(module, method)
  try:
    signature = inspect.signature(function)
  except (TypeError, ValueError):  # A builtin, or a callable without one.
    return None
  kind = inspect.Parameter
  params = list(signature.parameters.values())
  positional = [
    p
    for p in params
    if p.kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD)
  ]
  shown = signature.replace(
    parameters=[
      p.replace(
        annotation=p.empty,
        default=p.empty if p.default is p.empty else _Default(),
      )
      for p in params
    ],
    return_annotation=signature.empty,
  )
  return Parameters(
    method=f'{type(module).__name__}.{method}{shown}',
    required=sum(p.default is p.empty for p in positional),
    most=(
      None
      if any(p.kind == kind.VAR_POSITIONAL for p in params)
      else len(positional)
    ),
    keyword_only=tuple(
      p.name
      for p in params
      if p.kind == kind.KEYWORD_ONLY and p.default is p.empty
    ),
  )


# The inputs
# ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Wording:
  """How the caller writes the served inputs, for the messages about them.

  `save_saved_model` words them as its `input_signature` (the default of
  `inputs`), the command line as its ``--input-shape`` flags: each check
  decides once, and says it so.

  Attributes:
    name: What the inputs are passed as, e.g. '`input_signature`'.
    listing: Every entry, as the caller wrote it.
    write: Argument `index` written the caller's way, with dimensions
      `dims` (sizes and symbols).
    show: Argument `index` as written, with ``change = (position, size)``
      if given (`unfit_message`).
    suggest: Every argument's dimensions (None for None), as the caller
      would pass them.
    own_symbols: What the listed symbols of their own are, given their
      listing (a sentence).
    arity_fix: How to give one entry per positional parameter.
    alike_fix: How to name equal dimensions alike (before 'e.g.').
    unfit_fix: How to give inputs of the shapes the method takes.
    auto_fix: How to trace on Explicit mesh axes.
  """

  name: str
  listing: str
  write: Callable[[int, Sequence[Any]], str]
  show: Callable[[int, tuple[int, int] | None], str]
  suggest: Callable[[Sequence[Dims | None]], str]
  own_symbols: Callable[[str], str]
  arity_fix: str
  alike_fix: str
  unfit_fix: str
  auto_fix: str


def _signature_wording(
  input_signature: Sequence[Any], specs: Sequence[Any], slots: Sequence[Any]
) -> Wording:
  """The words of `save_saved_model`: its `input_signature`."""
  names = ['None' if s is None else specs[s].name for s in slots]

  def show(index: int, change: tuple[int, int] | None) -> str:
    s = slots[index]
    shape = None if s is None else specs[s].shape
    dims = [] if shape is None or shape.rank is None else shape.as_list()
    if change is not None:
      dims[change[0]] = change[1]
    return f'{names[index]} {dims}'

  return Wording(
    name='`input_signature`',
    listing='[' + ', '.join(_describe(e) for e in input_signature) + ']',
    write=lambda index, dims: f'{names[index]} {shape_text(dims)}',
    show=show,
    suggest=lambda arguments: (
      'polymorphic_shapes='
      + repr([None if dims is None else shape_text(dims) for dims in arguments])
    ),
    own_symbols=lambda listing: (
      "In `input_signature`, a leading None is the batch 'b', shared by "
      'every input, and any other None is a size of its own, which JAX '
      f'cannot know to equal another: {listing}.'
    ),
    arity_fix=(
      'Give one entry per positional parameter, in order: a tf.TensorSpec '
      '(or jax.ShapeDtypeStruct) for an array, None for an argument passed '
      'as None (e.g. an empty cache); give keyword-only parameters a '
      'default.'
    ),
    alike_fix=(
      'Give the dimensions that are always equal one name with '
      '`polymorphic_shapes=` (one per entry of `input_signature`)'
    ),
    unfit_fix=(
      'Give one entry per positional parameter, in order, each of the shape '
      'the method takes (the batch dimension first).'
    ),
    auto_fix=(
      'Place the model on a mesh of Explicit axes, as `jax.make_mesh` gives '
      'by default (or with `axis_types=` Explicit for the axes it names), '
      'and export it there.'
    ),
  )


@dataclasses.dataclass(frozen=True)
class Inputs:
  """A served method's arguments: TF inputs, and the ones passed as None.

  Attributes:
    specs: The TF spec of each input of the signature, in order.
    polymorphic: The jax2tf polymorphic shape of each input.
    slots: For each positional argument of the method, the index of its
      input in `specs`, or None for an argument passed as None.
    wording: How the caller wrote them, for messages.
    written: Each argument's dimensions as the caller wrote them (a size,
      a name, or None: a symbol of its own), None for an argument passed
      as None; None when the caller named every dimension itself
      (`polymorphic_shapes`).
    multiples: (symbol, multiple) of each symbol the export made a
      multiple of a number (`narrowed`), for JAX to split it over devices.
  """

  specs: tuple[Any, ...]
  polymorphic: tuple[str | None, ...]
  slots: tuple[int | None, ...]
  wording: Wording
  written: tuple[Dims | None, ...] | None
  multiples: tuple[tuple[str, int], ...] = ()

  def arguments(self, arrays: Sequence[Any]) -> list[Any]:
    """The method's positional arguments, given its inputs' values."""
    return [None if s is None else arrays[s] for s in self.slots]

  def dims(self) -> list[list[int | None] | None]:
    """Each argument's TF dimensions (None: polymorphic), or None."""
    return [
      None
      if s is None or self.specs[s].shape.rank is None
      else self.specs[s].shape.as_list()
      for s in self.slots
    ]


def _describe(entry: Any) -> str:
  """A short text of an entry of `input_signature`."""
  shape = getattr(entry, 'shape', None)
  dtype = getattr(entry, 'dtype', None)
  if entry is None or shape is None or dtype is None:
    return repr(entry)
  dims = 'None' if getattr(shape, 'rank', 0) is None else list(shape)
  name = getattr(dtype, 'name', str(dtype))
  return f'{type(entry).__name__}({dims}, {name})'


def inputs(
  module: Any,
  method: str,
  input_signature: Sequence[Any],
  polymorphic_shapes: Sequence[str | None] | None,
  *,
  wording: Wording | None = None,
  written: Sequence[Dims | None] | None = None,
) -> Inputs:
  """The served signature's inputs, checked against the method.

  `wording` says them in the caller's words (default: `input_signature`'s);
  `written` is each argument's dimensions as the caller wrote them (None:
  a symbol of its own), default those of `input_signature` when no
  `polymorphic_shapes` names them.

  Raises:
    ExportError: If `method` is not a method of `module`, `input_signature`
      is not a list of specs and None, or does not fit the method's
      positional parameters, or `polymorphic_shapes` does not fit it.
  """
  if not callable(getattr(module, method, None)):
    raise _errors.ExportError(
      f'Expected `method` to name a method of the module, got {method!r}, '
      f'which {type(module).__name__} has no callable attribute of.'
    )
  if isinstance(input_signature, str | bytes) or not isinstance(
    input_signature, Sequence
  ):
    raise _errors.ExportError(
      'Expected `input_signature` to be a list with one entry per '
      f'positional parameter of the method, got {input_signature!r}. Write '
      'e.g. input_signature=[tf.TensorSpec([None, 64], tf.float32)].'
    )
  specs, polymorphic, slots = [], [], []
  for index, entry in enumerate(input_signature):
    if entry is None:
      slots.append(None)
      continue
    spec, shape = tensor_spec(entry, index)
    slots.append(len(specs))
    specs.append(spec)
    polymorphic.append(shape)
  if wording is None:
    wording = _signature_wording(input_signature, specs, slots)
  found = parameters(module, method)
  if found is not None and not found.fits(len(slots)):
    entries = 'entry' if len(slots) == 1 else 'entries'
    raise _errors.ExportError(
      f'Expected {wording.name} to fit {found.method}, which '
      f'{found.takes()}; got {len(slots)} {entries}: {wording.listing}. '
      f'{wording.arity_fix}'
    )
  if written is None and polymorphic_shapes is None:
    written = [
      None
      if s is None or specs[s].shape.rank is None
      else tuple(specs[s].shape.as_list())
      for s in slots
    ]
  written = None if written is None else tuple(written)
  if polymorphic_shapes is None:
    return Inputs(
      tuple(specs), tuple(polymorphic), tuple(slots), wording, written
    )
  shapes = list(polymorphic_shapes)
  if len(shapes) == len(slots) and len(slots) != len(specs):
    given = [shapes[i] for i, s in enumerate(slots) if s is None]
    if any(s is not None for s in given):
      raise _errors.ExportError(
        'Expected None in `polymorphic_shapes` where `input_signature` has '
        f'None (at {[i for i, s in enumerate(slots) if s is None]}), got '
        f'{polymorphic_shapes!r}. An argument passed as None has no shape: '
        'write None there, or give the shapes of the arrays only.'
      )
    shapes = [shapes[i] for i, s in enumerate(slots) if s is not None]
  if len(shapes) != len(specs):
    also = (
      ''
      if len(slots) == len(specs)
      else f' (or one per entry of `input_signature`, {len(slots)}, with None '
      'where it has None)'
    )
    raise _errors.ExportError(
      f'Expected one polymorphic shape per input ({len(specs)}){also}, got '
      f'{len(polymorphic_shapes)}: {polymorphic_shapes!r}.'
    )
  return Inputs(tuple(specs), tuple(shapes), tuple(slots), wording, written)


# When tracing fails: symbols of their own
# ------------------------------------------------------------------------------


def _chain_text(error: BaseException | None) -> str:
  """The messages of `error` and of what it was raised from, a line each."""
  return '\n'.join(str(e) for e in itertools.islice(_errors.causes(error), 8))


def names_a_symbol(error: BaseException, symbols: Collection[str]) -> bool:
  """Whether `error` (or what it was raised from) names one of `symbols`."""
  text = _chain_text(error)
  return any(re.search(rf'(?<!\w){re.escape(s)}(?!\w)', text) for s in symbols)


def summary(error: BaseException) -> str:
  """The error's class and the first line of its message, cut short."""
  lines = str(error).strip().splitlines()
  first = lines[0].rstrip('.') if lines else 'no message'
  if len(first) > 300:
    first = first[:297] + '...'
  return f'{type(error).__name__}: {first}'


def suggested_dims(arguments: Sequence[Dims | None]) -> list[list[Any]]:
  """Examples of dimensions named alike, for arguments whose None
  dimensions (polymorphic, without a name) are each of their own.

  Each argument is its dimensions (an int, a name kept as it is, None) or
  None (an argument passed as None). The first example gives every None
  after the leading batch one name (one length, such as a sequence's), the
  second one name per position; only the first when those dimensions are
  at one position.
  """

  def named(rename: Any) -> list[Any]:
    return [
      None
      if dims is None
      else tuple(
        (BATCH if j == 0 else rename(j)) if d is None else d
        for j, d in enumerate(dims)
      )
      for dims in arguments
    ]

  positions = {
    j
    for dims in arguments
    for j, d in enumerate(dims or ())
    if d is None and j > 0
  }
  one_length = named(lambda j: _ONE_LENGTH)
  if len(positions) <= 1:
    return [one_length]
  return [one_length, named(_AT_POSITION.format)]


def shapes_error(
  inputs_: Inputs, error: BaseException, where: str
) -> _errors.ExportError | None:
  """Our error for a failed trace that meets symbols of their own.

  None when no input has a polymorphic dimension after the leading one that
  the caller did not name, or the error does not name one: then it is not
  about them.
  """
  arguments = inputs_.written
  own = set() if arguments is None else own_symbols(arguments)
  if not own or not names_a_symbol(error, own):
    return None
  wording = inputs_.wording
  listing = ', '.join(
    wording.write(index, symbolic_dims(dims, index))
    for index, dims in enumerate(arguments)
    if dims is not None and None in dims[1:]
  )
  examples = [wording.suggest(example) for example in suggested_dims(arguments)]
  which = [
    f'{examples[0]} if all are one length (e.g. a sequence length)',
    *(f'{e} if those at the same position are' for e in examples[1:]),
  ]
  return _errors.ExportError(
    f'Tracing {where} for the SavedModel failed where its polymorphic '
    f'dimensions meet ({summary(error)}). {wording.own_symbols(listing)} '
    f'{wording.alike_fix}, e.g. {", or ".join(which)}.'
  )


# JAX's refusal of a forward written for Explicit mesh axes (it says where
# results go) on Auto ones.
_ON_AUTO_AXES = re.compile(r'of type:? (AxisType\.)?Auto')


def auto_axes_error(
  inputs_: Inputs, error: BaseException, where: str
) -> _errors.ExportError | None:
  """Our error for a forward written for Explicit mesh axes, traced on Auto
  ones; None when JAX's error is not that refusal."""
  if not _ON_AUTO_AXES.search(_chain_text(error)):
    return None
  return _errors.ExportError(
    f'{where} is written for Explicit mesh axes (it says where results go, '
    "with out_sharding= or jax.sharding.reshard), but the mesh's axes are "
    f'Auto: JAX refuses it ({summary(error)}). {inputs_.wording.auto_fix}'
  )


# When tracing fails: an input of a size the forward cannot take
# ------------------------------------------------------------------------------

# JAX's refusals of two sizes that must be equal: dimensions a matmul
# contracts (`dot_general`: `@`, `jnp.dot`, `nnx.Linear`), and one label of
# `einsum`.
_UNEQUAL_SIZES = (
  re.compile(
    r'contracting dimensions to have the same shape, got '
    r'\((?P<a>[\d, ]+)\) and \((?P<b>[\d, ]+)\)'
  ),
  re.compile(
    r"Size of label '\w+' for operand \d+ \((?P<a>\d+)\) does not match "
    r'previous terms \((?P<b>\d+)\)'
  ),
)


@dataclasses.dataclass(frozen=True)
class Misfit:
  """The one input dimension whose size the forward refused.

  Attributes:
    argument: The positional argument's index.
    position: The dimension's position in it.
    given: Its size.
    expected: The size the forward needs there.
  """

  argument: int
  position: int
  given: int
  expected: int


def _sizes(text: str) -> tuple[int, ...]:
  return tuple(int(n) for n in text.replace(' ', '').split(',') if n)


def misfit(
  arguments: Sequence[Sequence[Any] | None], error: BaseException
) -> Misfit | None:
  """The input dimension of a size the forward cannot take, if JAX's
  `error` says which sizes it met and one input dimension alone has one of
  them (each argument: its dimensions, or None for None).

  JAX does not say which of the two sizes is the model's: the input's is
  the one an input has and the other does not.
  """
  text = _chain_text(error)
  pairs = [
    (a, b)
    for pattern in _UNEQUAL_SIZES
    for found in pattern.finditer(text)
    for a, b in zip(_sizes(found['a']), _sizes(found['b']), strict=False)
    if a != b
  ]
  hits = {
    Misfit(i, j, given, expected)
    for a, b in pairs
    for given, expected in ((a, b), (b, a))
    for i, dims in enumerate(arguments)
    for j, d in enumerate(dims or ())
    if isinstance(d, int | np.integer) and d == given
  }
  return hits.pop() if len(hits) == 1 else None


def unfit_message(
  given: str,
  where: str,
  error: BaseException,
  arguments: Sequence[Sequence[Any] | None],
  names: Sequence[str],
  show: Callable[[int, tuple[int, int] | None], str],
  fix: str,
) -> str:
  """Why inputs of these shapes do not fit the method, and the fix.

  `given` is the inputs as the caller wrote them (``--input-shape ...`` or
  `input_signature`); `arguments` and `names` are each argument's
  dimensions (None for an argument passed as None) and name;
  `show(index, change)` writes argument `index` the caller's way, with
  ``change = (position, size)`` if given. When JAX's error says which
  sizes it refused (`misfit`), the message names the input, its shape and
  the one the forward needs. The command line and `save_saved_model` say
  it alike.
  """
  text = (
    f'{given} does not fit {where}: calling it on inputs of these shapes '
    f'fails with {summary(error)}.'
  )
  found = misfit(arguments, error)
  if found is not None:
    i, j = found.argument, found.position
    text += (
      f' Dimension {j} of {names[i]} is {found.given} where the forward '
      f'needs {found.expected}: expected {show(i, (j, found.expected))}, '
      f'got {show(i, None)}.'
    )
  return f'{text} {fix}'


def unfit_error(
  inputs_: Inputs,
  error: BaseException,
  where: str,
  *,
  any_error: bool = False,
) -> _errors.ExportError | None:
  """Our error for an input of a size the forward refuses (`misfit`);
  None when JAX's error is not about two sizes that must be equal, unless
  `any_error` (then JAX's error is said as it is).
  """
  if not any_error and not any(
    p.search(_chain_text(error)) for p in _UNEQUAL_SIZES
  ):
    return None
  wording = inputs_.wording
  return _errors.ExportError(
    unfit_message(
      f'{wording.name} {wording.listing}',
      where,
      error,
      inputs_.dims(),
      ['None' if s is None else inputs_.specs[s].name for s in inputs_.slots],
      wording.show,
      wording.unfit_fix,
    )
  )


# JAX's refusal to shard a symbolic dimension over an axis it may not divide
# (an Explicit axis: `reshard`, `out_sharding=` or an Explicit input
# sharding in the forward), with the dimension as JAX prints it.
_NOT_DIVIDED = re.compile(
  r'partitioned (\d+) times, but does not evenly divide the dimension size '
  r'(.+?)\. Got shape'
)
# A dimension JAX prints as one symbol times a constant: 'b', '4*b', 'b*4'.
_SCALED_SYMBOL = re.compile(r'(?:(\d+)\*)?([A-Za-z_]\w*)(?:\*(\d+))?')


@dataclasses.dataclass(frozen=True)
class Narrowing:
  """A polymorphic symbol JAX needs to be a multiple of a number.

  Attributes:
    symbol: The symbol, e.g. 'b'.
    factor: What it is multiplied by in the shapes, so that JAX knows the
      dimension divides: the served sizes are multiples of it.
    devices: The devices the dimension is split over, as JAX said.
  """

  symbol: str
  factor: int
  devices: int


def narrowing(error: BaseException) -> Narrowing | None:
  """The symbol to scale so that a dimension JAX shards divides, if any.

  JAX cannot split a dimension of unknown size over `n` devices (an
  Explicit axis) unless it knows the size is a multiple of `n`; a symbol
  ``b`` written as ``n*b`` says so. None when `error` is not that refusal,
  or the dimension is not one symbol times a constant (``b + 1``, ``b*t``).
  """
  found = _NOT_DIVIDED.search(str(error))
  if found is None:
    return None
  devices = int(found[1])
  scaled = _SCALED_SYMBOL.fullmatch(found[2].replace(' ', ''))
  if scaled is None or devices < 2:
    return None
  coefficient = int(scaled[1] or 1) * int(scaled[3] or 1)
  factor = devices // math.gcd(devices, coefficient)
  if factor < 2:
    return None
  return Narrowing(scaled[2], factor, devices)


def narrowed(inputs_: Inputs, narrowing_: Narrowing) -> Inputs | None:
  """`inputs_` with the symbol of `narrowing_` a multiple of its factor.

  Every polymorphic shape naming the symbol has it multiplied (``(b, 16)``
  becomes ``(2*b, 16)``), so equal dimensions stay equal; None if no shape
  names it.
  """
  symbol = re.compile(rf'(?<![\w.]){re.escape(narrowing_.symbol)}(?!\w)')
  shapes = tuple(
    None if s is None else symbol.sub(f'{narrowing_.factor}*\\g<0>', s)
    for s in inputs_.polymorphic
  )
  if shapes == inputs_.polymorphic:
    return None
  multiples = dict(inputs_.multiples)
  multiples[narrowing_.symbol] = (
    multiples.get(narrowing_.symbol, 1) * narrowing_.factor
  )
  return dataclasses.replace(
    inputs_, polymorphic=shapes, multiples=tuple(sorted(multiples.items()))
  )


def narrowed_warning(
  inputs_: Inputs, where: str, refused: str | None = None
) -> str:
  """What a narrowed signature serves, why, and how to say so and be quiet.

  `refused`: why the forward did not trace on a serving mesh (one device),
  where every size would have served, if it was tried.
  """
  said = ', '.join(
    f"'{symbol}' is exported as a multiple of {multiple}"
    for symbol, multiple in inputs_.multiples
  )
  listing = ', '.join(
    f'{spec.name} {shape}'
    for spec, shape in zip(inputs_.specs, inputs_.polymorphic, strict=True)
    if shape is not None
  )
  why = (
    ''
    if refused is None
    else " It did not trace on one device with the mesh's axis names, "
    f'where every size serves ({refused}): it names the mesh itself; '
    'written with bare PartitionSpecs (`P(...)` under `jax.set_mesh`), it '
    'would.'
  )
  return (
    f'{where} splits a polymorphic dimension over an Explicit mesh axis, '
    f'which JAX does only for sizes it knows divide: {said} ({listing}), '
    'so the SavedModel serves those sizes only, the ones JAX runs; any '
    "other fails in TensorFlow with JAX's message ('Division had "
    f"remainder').{why} To serve every size, constrain that dimension on "
    'Auto axes (`with_sharding_constraint`) instead; to keep this and '
    'silence the warning, pass '
    f'`polymorphic_shapes={list(inputs_.polymorphic)!r}`.'
  )


def divisibility_error(
  inputs_: Inputs, error: BaseException, where: str
) -> _errors.ExportError | None:
  """Our error for a polymorphic dimension sharded over an Explicit axis
  that no multiple of a symbol makes divide (e.g. ``b + 1``).

  None when the error is not JAX's refusal to split it.
  """
  found = _NOT_DIVIDED.search(str(error))
  if found is None:
    return None
  times, size = int(found[1]), found[2]
  listing = ', '.join(
    f'{spec.name} {shape}'
    for spec, shape in zip(inputs_.specs, inputs_.polymorphic, strict=True)
    if shape is not None
  )
  return _errors.ExportError(
    f'Tracing {where} for the SavedModel failed: the forward splits a '
    f"dimension of size '{size}' over {times} devices (an Explicit mesh "
    f'axis), and JAX cannot know that every size of it divides by {times} '
    f'({summary(error)}). The inputs: {listing}. Give `polymorphic_shapes=` '
    f'that make it a multiple of {times} (e.g. a symbol written '
    f"'{times}*b'), a static size there, or constrain that dimension on "
    'Auto axes (`with_sharding_constraint`), which need no such proof.'
  )


# The outputs
# ------------------------------------------------------------------------------


def _key_text(key: Any) -> str:
  for attribute in ('key', 'idx', 'name'):
    if hasattr(key, attribute):
      return str(getattr(key, attribute))
  return str(key)


def named_outputs(result: Any, where: str) -> dict[str, Any]:
  """The arrays of a method's result, by the name each is served under.

  None is left out. A dict with str keys names each array by its keys
  (those of nested dicts, and positions in nested lists and tuples) joined
  by `SEPARATOR`: ``{'logits': x, 'cache': {'k': k}}`` gives 'logits' and
  'cache/k'. Any other result names its arrays ``output_0``,
  ``output_1``, ... in the order of ``jax.tree.leaves``; an array alone is
  ``output_0``.

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
    if not isinstance(leaf, _ARRAYS):
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
