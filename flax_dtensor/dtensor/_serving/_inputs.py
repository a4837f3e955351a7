"""A served method's inputs: the signature's specs, checked against it.

`input_signature` gives each positional parameter of the method a TF input
(a `tf.TensorSpec` or `jax.ShapeDtypeStruct`) or None: the argument is then
None, and no input of the signature (`inputs`). Each input has a jax2tf
polymorphic shape: a TF spec's leading None is the batch 'b', any other None
a size of its own (`symbol`). The messages about the inputs say them in the
caller's words (`Wording`): those of `input_signature`, or the command
line's ``--input-shape`` flags; `_input_checks` says, in those words, why a
trace on them failed.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from flax_dtensor import _errors, _text
from flax_dtensor.dtensor import _tf

if TYPE_CHECKING:
  import tensorflow as tf

# The symbol of a leading None dimension: the batch, one size for all inputs.
BATCH = 'b'
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
