"""The served signatures: ``--input-shape`` and ``--signature`` entries.

`parse_input_shape` reads an input (`InputSpec`), `parse_signature` a
``--signature KEY=METHOD:INPUT+...`` (`Signature`); `check_served_inputs`
asks the SavedModel export (`flax_dtensor.dtensor._serving`) whether the
method takes them, before any write, and says its answer in the flags'
words; `traced_inputs` gives ``plan --suggest`` its inputs. JAX and
TensorFlow are imported inside the functions.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from flax_dtensor.cli import _options
from flax_dtensor.cli._command import BadInputError


@dataclasses.dataclass(frozen=True)
class InputSpec:
  """One ``--input-shape`` entry: ``NAME:DIMS:DTYPE``, or ``NAME:none``.

  Attributes:
    name: The name of the input in the served signature.
    dims: Each dimension: a size, a name (dimensions of one name are one
      size), or None (a size of its own). None for an argument passed as
      None.
    dtype: The dtype's name; None for an argument passed as None.
    given: The entry as the user wrote it (messages echo it so), or None.
  """

  name: str
  dims: tuple[int | str | None, ...] | None
  dtype: str | None
  given: str | None = dataclasses.field(default=None, compare=False)

  @property
  def shape(self) -> tuple[int | None, ...] | None:
    """The TF shape: None for each polymorphic dimension."""
    if self.dims is None:
      return None
    return tuple(d if isinstance(d, int) else None for d in self.dims)

  def tensor_spec(self) -> Any:
    """The `tf.TensorSpec` of the input, or None (imports TensorFlow)."""
    from flax_dtensor.dtensor import _tf

    if self.dims is None:
      return None
    tf = _tf.tf()
    return tf.TensorSpec(self.shape, tf.dtypes.as_dtype(self.dtype), self.name)

  def polymorphic_shape(self, index: int) -> str | None:
    """jax2tf's polymorphic shape of the input (`index`: its position)."""
    from flax_dtensor.dtensor._serving import _inputs

    if self.dims is None:
      return None
    return _inputs.shape_text(_inputs.symbolic_dims(self.dims, index))

  def text(self, dims: Sequence[int | str | None] | None = None) -> str:
    """The entry as the user wrote it; with `dims` instead of its own if
    given (a suggestion)."""
    if dims is None and self.given is not None:
      return self.given
    dims = self.dims if dims is None else dims
    if dims is None:
      return f'{self.name}:none'
    written = ','.join('?' if d is None else str(d) for d in dims)
    return f'{self.name}:{written}:{self.dtype}'


_DTYPES = (
  'bool',
  'int8',
  'int16',
  'int32',
  'int64',
  'uint8',
  'uint32',
  'float16',
  'bfloat16',
  'float32',
  'float64',
)
_DIM_NAME = re.compile(r'^[A-Za-z_][A-Za-z0-9_]*$')
INPUT_SHAPE_FIX = (
  'Pass --input-shape NAME:DIMS:DTYPE, e.g. x:1,128:int32, or NAME:none for '
  'an argument passed as None (one per positional parameter of the '
  'method, in order).'
)


def parse_input_shape(
  text: str,
  *,
  static_batch: bool,
  what: str | None = None,
  fix: str = INPUT_SHAPE_FIX,
) -> InputSpec:
  """Parses ``'x:1,128:int32'``, ``'mask:b,t,t:bool'`` or ``'cache:none'``.

  A dimension is a size, a name (a polymorphic dimension; those of one name
  are one size, across inputs too), or ``?`` (``None``): a polymorphic
  dimension of its own. Unless `static_batch`, a leading size is the batch
  ``b`` (the size only serves as an example). ``NAME:none`` passes None.
  `what` names the entry in messages (default: ``--input-shape TEXT``),
  and `fix` says how to write it.

  Raises:
    BadInputError: If the text is malformed.
  """
  what = f'--input-shape {text!r}' if what is None else what
  parts = text.split(':')
  if len(parts) == 2 and parts[0] and parts[1].lower() == 'none':
    return InputSpec(parts[0], None, None, given=text)
  if len(parts) != 3 or not parts[0] or not parts[1]:
    raise BadInputError(f'Malformed {what}. {fix}')
  name, dims_text, dtype = parts
  if dtype not in _DTYPES:
    raise BadInputError(
      f'Malformed {what}: unknown dtype {dtype!r}; expected one of '
      f'{", ".join(_DTYPES)}. {fix}'
    )
  dims: list[int | str | None] = []
  for d in dims_text.split(','):
    d = d.strip()
    if d in ('?', 'None', 'none'):
      dims.append(None)
    elif d.isdigit() and int(d) > 0:
      dims.append(int(d))
    elif _DIM_NAME.match(d):
      dims.append(d)
    else:
      raise BadInputError(
        f'Malformed {what}: dimension {d!r} is not a positive integer, a '
        'name (a polymorphic dimension: b, t, ...; those of one name are '
        f'one size) or ? (one of its own). {fix}'
      )
  if not static_batch and isinstance(dims[0], int):
    dims[0] = 'b'  # The batch symbol, `_inputs.BATCH`.
  return InputSpec(name, tuple(dims), dtype, given=text)


SIGNATURE_FIX = (
  'Pass --signature KEY=METHOD:INPUT, each INPUT as --input-shape takes it '
  '(NAME:DIMS:DTYPE or NAME:none), several joined by +, e.g. '
  '--signature embed=embed:ids:1,8:int32 or '
  'scores=score:x:1,16:float32+mask:1,16:bool.'
)


@dataclasses.dataclass(frozen=True)
class Signature:
  """One signature of the SavedModel: its key, method and inputs.

  Attributes:
    key: The signature key clients call, e.g. 'serving_default'.
    method: The name of the module's method it serves.
    specs: One input per positional parameter of the method, in order.
    given: The ``--signature`` text as written, or None for the one of
      ``--input-shape`` and ``--method``.
  """

  key: str
  method: str
  specs: tuple[InputSpec, ...]
  given: str | None = dataclasses.field(default=None, compare=False)

  def serving_signature(self) -> Any:
    """The library's `ServingSignature` (imports TensorFlow)."""
    from flax_dtensor.dtensor._serving import _signatures

    return _signatures.ServingSignature(
      [s.tensor_spec() for s in self.specs],
      method=self.method,
      polymorphic_shapes=[
        s.polymorphic_shape(i) for i, s in enumerate(self.specs)
      ],
    )


def parse_signature(text: str, *, static_batch: bool) -> Signature:
  """Parses ``--signature KEY=METHOD:INPUT[+INPUT...]``.

  Each INPUT is an ``--input-shape`` entry (`parse_input_shape`): e.g.
  ``'embed=embed:ids:1,8:int32'`` serves ``model.embed(ids)`` as the
  signature 'embed', and ``'scores=score:x:1,16:float32+mask:1,16:bool'``
  ``model.score(x, mask)``.

  Raises:
    BadInputError: If the text is malformed: no KEY or METHOD, a key
      serving clients cannot call, or a malformed input.
  """
  # Imports neither JAX nor TensorFlow.
  from flax_dtensor.dtensor._serving import _signatures

  key, eq, rest = text.partition('=')
  method, colon, inputs = rest.partition(':')
  key, method = key.strip(), method.strip()
  if not eq or not key or not colon or not method or not inputs.strip():
    raise BadInputError(
      f'Malformed --signature {text!r}: expected KEY=METHOD:INPUT. '
      f'{SIGNATURE_FIX}'
    )
  if not _signatures._KEY.fullmatch(key):
    raise BadInputError(
      f'Malformed --signature {text!r}: the key {key!r} is not a plain name '
      '(letters, digits, _ . -; not starting with a digit), which serving '
      f"clients call it by. Name it e.g. 'embed'. {SIGNATURE_FIX}"
    )
  specs = tuple(
    parse_input_shape(
      entry.strip(),
      static_batch=static_batch,
      what=f'--signature {text!r}: its input {entry.strip()!r} is malformed',
      fix=SIGNATURE_FIX,
    )
    for entry in inputs.split('+')
  )
  return Signature(key, method, specs, given=text)


def signatures(
  input_shape: Sequence[str],
  method: str,
  signature: Sequence[str],
  *,
  static_batch: bool,
) -> list[Signature]:
  """The served signatures: ``--input-shape`` (and ``--method``) as
  'serving_default', then each ``--signature``.

  Raises:
    BadInputError: If an entry is malformed, a key repeats (or
      'serving_default' is given both ways), or ``--method`` is given
      without ``--input-shape``.
  """
  from flax_dtensor.dtensor._serving import _signatures

  default = _signatures.DEFAULT_KEY
  out = []
  if input_shape:
    specs = tuple(
      parse_input_shape(s, static_batch=static_batch) for s in input_shape
    )
    out.append(Signature(default, method, specs))
  elif method != '__call__' and signature:
    raise BadInputError(
      f'--method {method!r} applies to the inputs of --input-shape (the '
      "'serving_default' signature), and none was given. Pass --input-shape "
      f'too, or name the method in --signature KEY={method}:INPUT.'
    )
  seen: dict[str, str] = {}
  for text in signature:
    parsed = parse_signature(text, static_batch=static_batch)
    if parsed.key == default and input_shape:
      raise BadInputError(
        f"--signature {text!r}: 'serving_default' is the signature of "
        '--input-shape and --method. Drop --input-shape (and --method), or '
        'give this signature another key.'
      )
    if parsed.key in seen:
      raise BadInputError(
        f'--signature {text!r}: the key {parsed.key!r} was given before, by '
        f'--signature {seen[parsed.key]!r}. Give each signature its own key.'
      )
    seen[parsed.key] = text
    out.append(parsed)
  return out


def check_signature(abstract: Any, signature: Signature) -> None:
  """`check_served_inputs` of one signature, in the words of its flag.

  Raises:
    BadInputError: As `check_served_inputs`.
  """
  if signature.given is not None and not callable(
    getattr(abstract, signature.method, None)
  ):
    raise BadInputError(
      f'--signature {signature.given!r}: the model '
      f'({type(abstract).__name__}) has no method {signature.method!r}. '
      'Pass --signature KEY=METHOD:INPUT naming a method that takes the '
      'inputs.'
    )
  check_served_inputs(
    abstract, signature.method, signature.specs, signature=signature
  )


def check_served_inputs(
  abstract: Any,
  method: str,
  specs: Sequence[InputSpec],
  *,
  signature: Signature | None = None,
) -> None:
  """Traces `method` of the abstract model on the inputs, before any write.

  The inputs have the polymorphic shapes the SavedModel will have, and the
  arguments given as ``NAME:none`` are None. Nothing is computed. The
  SavedModel export decides (`_tracing.check_served`), as
  `save_saved_model` would; its message says the inputs as flags.

  Raises:
    BadInputError: If the model has no such method, the inputs do not fit
      its positional parameters, JAX cannot read their dimensions, or it
      fails on inputs of these shapes and dtypes (e.g. a forgotten batch
      dimension, ``?`` dimensions that must be equal, or a forward written
      for Explicit mesh axes on Auto ones), or its result holds something
      other than arrays and None; the message shows the shapes given and
      the error.
  """
  import jax

  from flax_dtensor import _errors
  from flax_dtensor.dtensor._serving import _inputs, _signature, _tracing

  if not callable(getattr(abstract, method, None)):
    raise BadInputError(
      f'--method {method!r}: the model ({type(abstract).__name__}) has no '
      'such method. Pass --method NAME of a method that takes the inputs.'
    )
  try:
    inputs = _inputs.inputs(
      abstract,
      method,
      [s.tensor_spec() for s in specs],
      [s.polymorphic_shape(i) for i, s in enumerate(specs)],
      wording=_wording(specs, signature),
      written=[s.dims for s in specs],
    )
  except _errors.ExportError as e:
    raise BadInputError(str(e)) from e
  scope = jax.export.SymbolicScope()
  examples = []
  for index, s in enumerate(specs):
    if s.dims is None:
      continue
    text = s.polymorphic_shape(index)
    try:
      shape = (
        s.dims if text is None else jax.export.symbolic_shape(text, scope=scope)
      )
    except ValueError as e:  # A name JAX reads otherwise, e.g. max.
      raise BadInputError(
        f'Malformed {_entry(s, signature)}: JAX cannot read its dimensions '
        f'{text} ({_signature.summary(e)}). Name polymorphic dimensions with '
        'other names, e.g. b, t.'
      ) from e
    examples.append(jax.ShapeDtypeStruct(shape, jax.numpy.dtype(s.dtype)))
  try:
    _tracing.check_served(abstract, method, inputs, examples)
  except _errors.ExportError as e:
    raise BadInputError(str(e)) from e


def _entry(spec: InputSpec, signature: Signature | None) -> str:
  """How messages name the input `spec`: as an ``--input-shape`` entry, or
  an input of a ``--signature``."""
  if signature is None or signature.given is None:
    return f'--input-shape {spec.text()}'
  return f'input {spec.text()} of --signature {signature.given!r}'


def _wording(specs: Sequence[InputSpec], signature: Signature | None) -> Any:
  """The `_inputs.Wording` of ``--input-shape`` flags: `specs`; or of the
  inputs of a ``--signature``."""
  from flax_dtensor.dtensor._serving import _inputs

  if signature is not None and signature.given is not None:
    return _signature_wording(specs, signature)

  def show(index: int, change: tuple[int, int] | None) -> str:
    # As the user wrote it, with the size at one position changed.
    name, dims, *dtype = specs[index].text().split(':')
    written = dims.split(',')
    if change is not None:
      written[change[0]] = str(change[1])
    return ':'.join([name, ','.join(written), *dtype])

  return _inputs.Wording(
    name='--input-shape',
    listing=', '.join(s.text() for s in specs),
    write=lambda index, dims: specs[index].text(dims),
    show=show,
    suggest=lambda arguments: ' '.join(
      f'--input-shape {s.text(dims)}'
      for s, dims in zip(specs, arguments, strict=True)
    ),
    own_symbols=lambda listing: (
      f'Each ? dimension is a size of its own (to JAX: {listing}), which '
      'JAX cannot know to equal another.'
    ),
    arity_fix=(
      'Pass one --input-shape per positional parameter, in order, and '
      'NAME:none for an argument passed as None (e.g. --input-shape '
      'cache:none).'
    ),
    alike_fix='Name the dimensions that are always equal alike',
    unfit_fix=(
      'Pass one --input-shape per positional input, in order, with the '
      'batch dimension first (e.g. x:1,128:int32).'
    ),
    auto_fix=(
      'Pass --axis-types explicit (every axis, as jax.make_mesh gives), or '
      'NAME=explicit for the axes it names.'
    ),
  )


def _signature_wording(specs: Sequence[InputSpec], signature: Signature) -> Any:
  """The `_inputs.Wording` of the inputs of one ``--signature``."""
  head = f'{signature.key}={signature.method}:'
  plain = _wording(specs, None)
  return dataclasses.replace(
    plain,
    name=f'--signature {signature.given!r}',
    suggest=lambda arguments: (
      '--signature '
      + head
      + '+'.join(s.text(dims) for s, dims in zip(specs, arguments, strict=True))
    ),
    arity_fix=(
      'Give the --signature one INPUT per positional parameter, in order, '
      'joined by +, and NAME:none for an argument passed as None (e.g. '
      f'{head}ids:1,8:int32+cache:none).'
    ),
    unfit_fix=(
      'Give the --signature one INPUT per positional input, in order, with '
      f'the batch dimension first (e.g. {head}ids:1,8:int32).'
    ),
  )


def traced_inputs(texts: Sequence[str], target: str) -> list[Any] | None:
  """The abstract inputs ``plan --suggest`` traces the forward on: each
  ``--input-shape`` (sizes only), or for the demo model its own; None for
  another TARGET without any.

  Raises:
    BadInputError: If an entry is malformed or has a dimension that is not
      a size.
  """
  if not texts:
    if target != _options.DEMO_TARGET:
      return None
    from flax_dtensor.demo import model

    return model.example_inputs()
  import jax

  out = []
  for text in texts:
    spec = parse_input_shape(text, static_batch=True)
    if spec.dims is None:
      out.append(None)
      continue
    if not all(isinstance(d, int) for d in spec.dims):
      raise BadInputError(
        f'--input-shape {text!r}: tracing the forward for --suggest needs '
        'sizes, not named or ? dimensions. Pass sizes, e.g. '
        'tokens:16,128:int32.'
      )
    out.append(jax.ShapeDtypeStruct(spec.dims, jax.numpy.dtype(spec.dtype)))
  return out
