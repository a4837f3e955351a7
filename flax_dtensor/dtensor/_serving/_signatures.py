"""A SavedModel's signatures: which method each key serves, and how.

`ServingSignature` is one signature: the method it runs, its inputs (and
their polymorphic shapes), and the TF functions run before and after the
JAX forward, with the TF objects they use. `resolved` turns the arguments of
`save_saved_model` (one method, or a map of keys) into one signature per
key, checked before anything is traced.
"""

from __future__ import annotations

import dataclasses
import keyword
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flax_dtensor import _errors

# The key TF serving clients call by default.
DEFAULT_KEY = 'serving_default'
# What a signature key may be: TF's `signature_def` map takes any string, but
# clients (saved_model_cli, TF Serving's REST API) need a plain name.
_KEY = re.compile(r'[A-Za-z_][A-Za-z0-9_.\-]*')


@dataclasses.dataclass(frozen=True)
class ServingSignature:
  """One signature of a SavedModel: a method of the module, served.

  The signature's inputs are `input_signature`'s. Without `preprocess`,
  they are the method's positional arguments, as `save_saved_model`'s own
  `input_signature` gives them. With it, the served function first runs
  ``preprocess(*inputs)`` in TensorFlow (strings to token ids through a
  `tf.lookup` table, an image decoded and resized), and its result, a tensor
  or a tuple of tensors (None for an argument passed as None), is the
  method's positional arguments: their shapes and dtypes are the ones
  `preprocess` returns for `input_signature` (a None dimension is
  polymorphic, named as in `save_saved_model`), and `polymorphic_shapes`,
  if given, names the method's inputs. `postprocess` runs in TensorFlow on
  the method's result (the same pytree, of TF tensors) and returns what the
  signature serves, named as a method's result is (a dict by its keys,
  anything else 'output_0', ...).

  The TF objects `preprocess` and `postprocess` use (a `tf.lookup` table, a
  `tf.Variable`, a `tf.Module`) go in `resources`, so that the SavedModel
  saves them; a vocabulary file a table reads is copied into its
  ``assets/``. The model's variables are saved once, whatever the number
  of signatures, and every signature reads them.

  Attributes:
    input_signature: One entry per input of the signature: a
      `tf.TensorSpec` (or `jax.ShapeDtypeStruct`), or None to pass None
      (without `preprocess` only), as `save_saved_model`'s
      `input_signature`.
    method: The name of the module's method to serve.
    polymorphic_shapes: The method's inputs' jax2tf polymorphic shapes, as
      `save_saved_model`'s `polymorphic_shapes`.
    preprocess: A TF function of the signature's inputs that returns the
      method's positional arguments, or None.
    postprocess: A TF function of the method's result that returns the
      served outputs, or None.
    resources: The TF objects `preprocess` and `postprocess` use.

  Example:
    >>> ServingSignature(  # doctest: +SKIP
    ...   [tf.TensorSpec([None], tf.string, name='text')],
    ...   preprocess=lambda text: table.lookup(text),
    ...   resources=[table])
  """

  input_signature: Sequence[Any]
  method: str = '__call__'
  polymorphic_shapes: Sequence[str | None] | None = None
  preprocess: Callable[..., Any] | None = None
  postprocess: Callable[..., Any] | None = None
  resources: Sequence[Any] = ()


def resolved(
  input_signature: Sequence[Any] | None,
  method: str,
  polymorphic_shapes: Sequence[str | None] | None,
  signatures: Mapping[str, ServingSignature] | None,
) -> dict[str, ServingSignature]:
  """One signature per key: `signatures`, or `method` as 'serving_default'.

  Raises:
    ExportError: If both or neither of `input_signature` and `signatures`
      are given, `signatures` is not a non-empty map of plain names to
      `ServingSignature`s, or a signature's fields have the wrong types.
  """
  if signatures is None:
    if input_signature is None:
      raise _errors.ExportError(
        'Expected `input_signature` (the inputs of the one method served, '
        "as 'serving_default') or `signatures` (a map of keys to "
        'ServingSignature), got neither. Pass e.g. '
        'input_signature=[tf.TensorSpec([None, 64], tf.float32)].'
      )
    return {
      DEFAULT_KEY: ServingSignature(
        input_signature, method=method, polymorphic_shapes=polymorphic_shapes
      )
    }
  if input_signature is not None or polymorphic_shapes is not None:
    raise _errors.ExportError(
      'Expected either `input_signature` (with `method` and '
      '`polymorphic_shapes`) or `signatures`, got both. Give each '
      'signature its own inputs: signatures={"serving_default": '
      'ServingSignature(input_signature, method=...), ...}.'
    )
  if method != '__call__':
    raise _errors.ExportError(
      f'Expected `method` to be left out with `signatures`, got {method!r}: '
      'each signature names its own method. Write '
      f'ServingSignature(..., method={method!r}).'
    )
  if not isinstance(signatures, Mapping) or not signatures:
    raise _errors.ExportError(
      'Expected `signatures` to be a non-empty dict of signature keys to '
      f'ServingSignature, got {signatures!r:.100}. Write e.g. '
      "signatures={'serving_default': ServingSignature([tf.TensorSpec("
      '[None, 64], tf.float32)])}.'
    )
  for key, signature in signatures.items():
    if not isinstance(key, str) or not _KEY.fullmatch(key):
      raise _errors.ExportError(
        f'Expected each key of `signatures` to be a plain name (letters, '
        f'digits, _ . -; not starting with a digit), got {key!r}. Serving '
        "clients call a signature by its key: name it e.g. 'embed'."
      )
    if not isinstance(signature, ServingSignature):
      raise _errors.ExportError(
        f'Expected `signatures[{key!r}]` to be a ServingSignature, got '
        f'{type(signature).__name__}: {signature!r:.100}. Write '
        f'signatures={{{key!r}: ServingSignature(input_signature, '
        "method='...')}."
      )
    _check(key, signature)
  return dict(signatures)


def _check(key: str, signature: ServingSignature) -> None:
  where = f'`signatures[{key!r}]`'
  if not isinstance(signature.method, str) or not signature.method:
    raise _errors.ExportError(
      f'Expected the method of {where} to be a method name (a str), got '
      f'{signature.method!r}.'
    )
  for name in ('preprocess', 'postprocess'):
    function = getattr(signature, name)
    if function is not None and not callable(function):
      raise _errors.ExportError(
        f'Expected the {name} of {where} to be a TF function (a callable), '
        f'got {type(function).__name__}: {function!r:.80}.'
      )
  resources = signature.resources
  if isinstance(resources, str | bytes | Mapping) or not isinstance(
    resources, Sequence
  ):
    raise _errors.ExportError(
      f'Expected the resources of {where} to be a list of TF objects (tables, '
      f'variables, tf.Modules), got {resources!r:.100}.'
    )


def attribute_name(key: str) -> str | None:
  """The attribute a signature's function is also saved under, if any.

  TF's conventions read a loaded object's ``__call__`` (the default
  signature) and Keras's `TFSMLayer` its ``serve``; other keys that are
  Python names (not keywords, not one of the object's own attributes) are
  attributes too, so that ``loaded.embed(x)`` calls them.
  """
  if key == DEFAULT_KEY:
    return None
  if not key.isidentifier() or keyword.iskeyword(key) or key in RESERVED:
    return None
  return key


# The loaded object's own attributes, which no signature may take.
RESERVED = frozenset(
  {
    'state',
    'variables',
    'trainable_variables',
    'regularization_losses',
    'serve',
    'resources',
    'signatures',
    'graph_debug_info',
    'tensorflow_version',
    'tensorflow_git_version',
  }
)
