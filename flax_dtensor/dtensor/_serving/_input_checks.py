"""Why a trace on the served inputs failed, said in the caller's words.

When tracing the served method fails, one check here decides what the
inputs have to do with it, for `save_saved_model` and the command line's
check alike (`_tracing`), and says it in the caller's words
(`_inputs.Wording`): symbols of their own that the forward needs equal
(`shapes_error`), a forward written for Explicit mesh axes on Auto ones
(`auto_axes_error`), an input of a size the forward cannot take
(`unfit_error`), and a polymorphic dimension split over an Explicit axis
(`narrowing`, `narrowed`, `divisibility_error`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from flax_dtensor import _errors
from flax_dtensor.dtensor._serving import _inputs, _signature

# The names of the suggested shapes: one length for every polymorphic
# dimension after the batch, or one per position.
_ONE_LENGTH = 't'
_AT_POSITION = 'd{}'


# When tracing fails: symbols of their own
# ------------------------------------------------------------------------------


def _chain_text(error: BaseException | None) -> str:
  """The messages of `error` and of what it was raised from, a line each."""
  return '\n'.join(str(e) for e in itertools.islice(_errors.causes(error), 8))


def names_a_symbol(error: BaseException, symbols: Collection[str]) -> bool:
  """Whether `error` (or what it was raised from) names one of `symbols`."""
  text = _chain_text(error)
  return any(re.search(rf'(?<!\w){re.escape(s)}(?!\w)', text) for s in symbols)


def suggested_dims(arguments: Sequence[_inputs.Dims | None]) -> list[list[Any]]:
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
        (_inputs.BATCH if j == 0 else rename(j)) if d is None else d
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
  inputs_: _inputs.Inputs, error: BaseException, where: str
) -> _errors.ExportError | None:
  """Our error for a failed trace that meets symbols of their own.

  None when no input has a polymorphic dimension after the leading one that
  the caller did not name, or the error does not name one: then it is not
  about them.
  """
  arguments = inputs_.written
  own = set() if arguments is None else _inputs.own_symbols(arguments)
  if not own or not names_a_symbol(error, own):
    return None
  wording = inputs_.wording
  listing = ', '.join(
    wording.write(index, _inputs.symbolic_dims(dims, index))
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
    f'dimensions meet ({_signature.summary(error)}). '
    f'{wording.own_symbols(listing)} '
    f'{wording.alike_fix}, e.g. {", or ".join(which)}.'
  )


# JAX's refusal of a forward written for Explicit mesh axes (it says where
# results go) on Auto ones.
_ON_AUTO_AXES = re.compile(r'of type:? (AxisType\.)?Auto')


def auto_axes_error(
  inputs_: _inputs.Inputs, error: BaseException, where: str
) -> _errors.ExportError | None:
  """Our error for a forward written for Explicit mesh axes, traced on Auto
  ones; None when JAX's error is not that refusal."""
  if not _ON_AUTO_AXES.search(_chain_text(error)):
    return None
  return _errors.ExportError(
    f'{where} is written for Explicit mesh axes (it says where results go, '
    "with out_sharding= or jax.sharding.reshard), but the mesh's axes are "
    f'Auto: JAX refuses it ({_signature.summary(error)}). '
    f'{inputs_.wording.auto_fix}'
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
    f'fails with {_signature.summary(error)}.'
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
  inputs_: _inputs.Inputs,
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


def narrowed(
  inputs_: _inputs.Inputs, narrowing_: Narrowing
) -> _inputs.Inputs | None:
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
  inputs_: _inputs.Inputs, where: str, refused: str | None = None
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
  inputs_: _inputs.Inputs, error: BaseException, where: str
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
    f'({_signature.summary(error)}). The inputs: {listing}. Give '
    f'`polymorphic_shapes=` that make it a multiple of {times} (e.g. a '
    f"symbol written '{times}*b'), a static size there, or constrain that "
    'dimension on Auto axes (`with_sharding_constraint`), which need no '
    'such proof.'
  )
