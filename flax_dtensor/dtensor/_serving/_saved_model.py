"""SavedModels: a module's forward pass, served by plain TensorFlow.

`save_saved_model` exports a module's method through
``jax.experimental.jax2tf`` (native serialization, StableHLO) with the
module's variables as DTensor variables read by the served function, plus
the manifest (`_format._encode`) in ``assets/``. One save op writes the
variables, so they are first brought onto one mesh (`_single_mesh`). In a
multi-process run the model is gathered onto process 0, which writes it
alone (`_save_gathered`), under a size limit every process checks first.
The forward is traced where JAX runs it (`_tracing`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import nnx
from flax.nnx import filterlib
from jax.experimental import multihost_utils

from flax_dtensor import _errors, _output, _text
from flax_dtensor._placement import _variables
from flax_dtensor._rules import _spec
from flax_dtensor.dtensor import _processes, _tf, _tf_errors
from flax_dtensor.dtensor._checkpoints import _checkpoint
from flax_dtensor.dtensor._conversion import (
  _convert,
  _names,
  _selection,
  _single_mesh,
)
from flax_dtensor.dtensor._format import _checksums, _decode, _model, _paths
from flax_dtensor.dtensor._layout import _dtypes, _topology
from flax_dtensor.dtensor._serving import (
  _conventions,
  _input_checks,
  _inputs,
  _reexport,
  _serialization,
  _signature,
  _signatures,
  _tracing,
)
from flax_dtensor.dtensor._storage import _atomic

if TYPE_CHECKING:
  import tensorflow as tf

# The variables' checkpoint prefix inside a SavedModel.
PREFIX = 'variables/variables'
# The most bytes of variables gathered onto process 0 for a SavedModel in a
# multi-process run, unless `max_gather_bytes` says otherwise.
MAX_GATHER_BYTES = 4 * 2**30


def save_saved_model(
  module: Any,
  directory: str | os.PathLike[str],
  *,
  input_signature: Sequence[Any] | None = None,
  method: str = '__call__',
  signatures: Mapping[str, _signatures.ServingSignature] | None = None,
  trainable: filterlib.Filter = False,
  include: filterlib.Filter = ...,
  exclude: filterlib.Filter = nnx.RngState,
  polymorphic_shapes: Sequence[str | None] | None = None,
  platforms: Sequence[str] | None = None,
  overwrite: bool = False,
  progress: bool | None = None,
  max_gather_bytes: int = MAX_GATHER_BYTES,
) -> str:
  """Exports a module's forward pass as a TF SavedModel for serving.

  The SavedModel's variables are the module's variables, as DTensor
  variables exported by `to_tf_module` (not constants baked into the graph):
  its `serving_default` signature reads them and runs `module.<method>`,
  converted with `jax.experimental.jax2tf.convert` (native serialization,
  StableHLO) and a polymorphic batch dimension. It loads with
  `tf.saved_model.load` in a plain TF process: no JAX, no DTensor (TF loads
  the variables as ordinary single-device variables). Call the module in the
  mode you want to serve, e.g. `nnx.view(model, deterministic=True,
  use_running_average=True)`; variables left out by `include`/`exclude` are
  baked in as constants. Variables of the dtypes in `STORED_DTYPES`
  (float16, float8, uint16, uint32, ...) are stored widened and converted
  back inside the served function (see the module docstring). Next to the
  SavedModel's files, `assets/flax_dtensor.json` records each variable's
  NNX type, dtype and layout (as for `save_checkpoint`).

  Several methods, each under its own key (or one method under several),
  are served with `signatures=`: a dict of keys to `ServingSignature`,
  each with its own inputs, polymorphic shapes, and TF functions run before
  (`preprocess`) and after (`postprocess`) the JAX forward, with the TF
  objects they use (`resources`). The variables are saved once and every
  signature reads them.

  The loaded object follows TF's reusable-SavedModel convention:
  ``loaded.variables``, ``loaded.trainable_variables`` and
  ``loaded.regularization_losses`` (empty) are lists of its variables;
  ``loaded(...)`` (and ``loaded.serve(...)``, the endpoint Keras's
  `TFSMLayer` calls by default) runs the 'serving_default' signature (else
  the first); a signature whose key is a Python name is also an attribute
  (``loaded.embed(...)``). ``loaded.state`` holds the variables by NNX path
  (`flat_variables`, `from_tf_module`). With `trainable`, the variables it
  selects are trainable TF variables and TF differentiates every signature
  (jax2tf's ``with_gradient=True``): a `tf.GradientTape` over
  ``loaded.trainable_variables`` gives JAX's gradients, Keras's
  ``TFSMLayer(..., trainable=True)`` trains them. Without it (the
  default), no variable is trainable and the SavedModel holds no gradient.

  The method's result may be any pytree of arrays and None: its arrays are
  the signature's outputs, None is left out. A dict with str keys names
  each array by its keys, those of nested dicts (and positions in nested
  lists and tuples) joined by '/': ``{'logits': x, 'cache': {'k': k}}`` is
  served as 'logits' and 'cache/k'. Any other result names its arrays
  'output_0', 'output_1', ... in the order of ``jax.tree.leaves`` (None
  left out): ``(logits, None)`` gives 'output_0', as does an array alone.

  The exported function runs on the platforms of `platforms` (default: the
  current JAX backend). The written directory appears atomically.

  In a multi-process run (`jax.process_count() > 1`) every process calls
  this with the same arguments. The model is gathered onto process 0
  (each variable in turn, through a collective), which writes the
  SavedModel alone, exactly as one process would; the others wait, and
  every process returns or raises together. A served SavedModel loads
  whole into one TF process, so the model must fit one host: every process
  first checks, before anything is moved or written, that its variables
  take at most `max_gather_bytes`, and refuses otherwise. Process 0 needs
  about that much memory, and every device one variable at a time. Only
  process 0's filesystem is written to.

  Args:
    module: The NNX module to serve (concrete arrays).
    directory: The SavedModel directory to create, with any missing
      parents (TF Serving's `base/<version>`).
    input_signature: The inputs of the one method served as
      'serving_default' (give this or `signatures`). One entry per
      positional argument of the method: a
      `tf.TensorSpec` or `jax.ShapeDtypeStruct` for an input of the
      signature (named by the spec's name, else 'input_<index>'), or None
      to pass None (e.g. an empty cache; no input of the signature). A TF
      spec's `None` dimensions are polymorphic: a leading `None` is the
      batch dimension 'b', shared by every input; any other `None` is a
      size of its own, 'd<index>_<position>', which JAX cannot know to
      equal another (name equal ones alike with `polymorphic_shapes`). A
      `jax.ShapeDtypeStruct` may hold symbolic dimensions
      (``jax.export.symbolic_shape('b, 64')``), which keep their names.
    method: Name of the module's method to serve.
    signatures: Instead of `input_signature`, `method` and
      `polymorphic_shapes`: the signatures to serve, a dict of signature
      keys to `ServingSignature`.
    trainable: NNX filter of the exported variables TF may train
      (`nnx.Param`, True for every one, default False: serve only). TF
      then differentiates every signature with respect to them
      (``loaded.trainable_variables``), and re-saves the fine-tuned model
      with ``tf.saved_model.save(loaded, directory,
      signatures=loaded.signatures)`` (without `signatures`, TF keeps no
      signature to serve) and no options: the
      gradients are saved with it, so it trains again
      (``SaveOptions(experimental_custom_gradients=False)`` gives one that
      serves only), in any process but this one: here, TF resolves the
      loaded functions' second-order gradients to this export's own and
      cannot save them again (write a ``tf.train.Checkpoint`` instead).
      `restore_from_tf` reads any of them back into JAX.
    include: NNX filter of the variables to export as TF variables (default
      all but `exclude`).
    exclude: NNX filter of variables baked in as constants instead (default
      RNG state).
    polymorphic_shapes: jax2tf polymorphic shapes overriding those derived
      from `input_signature`: one per entry of `input_signature` (None
      where it has None), or one per input. Dimensions of one name are one
      size, e.g. ``['(b, t)', '(b, t)', None, '(b, t, t)']`` for tokens,
      positions, a None cache and a square attention mask.
    platforms: `native_serialization_platforms` for jax2tf, e.g.
      `('cpu', 'cuda')`.
    overwrite: Replace `directory` if it exists.
    progress: Show a progress bar; None shows one from
      `PROGRESS_MIN_VARIABLES` variables when stderr is a terminal.
    max_gather_bytes: In a multi-process run, the most bytes of variables
      (all of the module's, global sizes) gathered onto process 0; default
      4 GiB. Unused in a single process.

  Returns:
    The absolute path of the SavedModel directory.

  Raises:
    DTensorInitializationError: If `flax_dtensor.dtensor.initialize()` was
      not called.
    ExportError: If neither or both of `input_signature` and `signatures`
      are given, `signatures` is not a dict of plain names to
      `ServingSignature`, a preprocess fails on its inputs or returns
      something other than tensors, a preprocess or postprocess uses a TF
      resource its `resources` lacks, `method` is not a method of `module`,
      `input_signature` has an entry of the wrong type or does not fit the
      method's positional parameters (checked before tracing),
      `polymorphic_shapes` does not fit it, tracing fails where
      polymorphic dimensions of their own meet (with a
      `polymorphic_shapes` that names them alike), an input has a size
      the forward cannot take (JAX's refusal to contract two sizes: the
      message names the input and the shape it needs), the forward is
      written for Explicit mesh axes and the mesh's are Auto, the result
      holds something other than arrays and None, `directory` exists and
      `overwrite` is false, a missing parent cannot be created (a file in
      the way, an unwritable ancestor), a variable cannot be exported,
      `max_gather_bytes` is not a non-negative int, or, in a multi-process
      run, the variables take more than `max_gather_bytes`. Each error below
      is an ExportError too.
    DiskFullError: If the disk is full or a quota or file-size limit is
      reached (the message gives the bytes needed and free).
    SaveInProgressError: If another save to `directory` is in progress.
    PeerError: In a multi-process run, if another process stopped, or
      process 0 failed to write (on every process but 0; a full disk is a
      DiskFullError on every process).

  Example:
    >>> save_saved_model(  # doctest: +SKIP
    ...   model, '/tmp/sm',
    ...   input_signature=[tf.TensorSpec([None, 16], tf.float32)])
    >>> loaded = tf.saved_model.load('/tmp/sm')  # doctest: +SKIP
    >>> loaded.signatures['serving_default'](input_0=x)  # doctest: +SKIP
  """
  _topology.require_initialized()
  directory = _paths.local(directory, 'SavedModel directory')
  keyed = _signatures.resolved(
    input_signature, method, polymorphic_shapes, signatures
  )
  prepared = {
    key: _prepared(module, key, signature) for key, signature in keyed.items()
  }
  _check_limit(max_gather_bytes)
  selected = nnx.All(include, nnx.Not(exclude))
  _, exported, _ = nnx.split(module, selected, ...)
  entries = _selection.select(exported, ..., nnx.Nothing, what='module')
  show = _convert.show_progress(progress, len(entries))
  served = _Served(selected, prepared, trainable, platforms, show)
  with (
    _tf_errors.space_checked(directory, sum(e.nbytes for e in entries)),
    _tf_errors.translated(
      'Writing the SavedModel', directory, _checkpoint.WRITE_FIX
    ),
  ):
    if jax.process_count() > 1:
      _save_gathered(
        module,
        directory,
        entries,
        served,
        overwrite=overwrite,
        max_gather_bytes=max_gather_bytes,
      )
    else:
      with _atomic.atomic_directory(
        directory, overwrite=overwrite, is_export=_decode.is_export
      ) as tmp:
        _write(module, tmp, served)
  return directory


@dataclasses.dataclass(frozen=True)
class _Prepared:
  """One signature, checked: its method's inputs, and the TF functions
  around it (`tf.function`s, or None)."""

  key: str
  signature: _signatures.ServingSignature
  inputs: _inputs.Inputs  # The method's inputs.
  specs: tuple[Any, ...]  # The signature's own inputs.
  preprocess: Any
  postprocess: Any


def _prepared(
  module: Any, key: str, signature: _signatures.ServingSignature
) -> _Prepared:
  """`signature`, checked against the module before anything is traced.

  With a `preprocess`, the method's inputs are what it returns, traced in
  TF on the signature's inputs.
  """
  tf = _tf.tf()
  post = signature.postprocess
  post = None if post is None else tf.function(post)
  if signature.preprocess is None:
    inputs = _inputs.inputs(
      module,
      signature.method,
      signature.input_signature,
      signature.polymorphic_shapes,
    )
    return _Prepared(key, signature, inputs, inputs.specs, None, post)
  pre = tf.function(signature.preprocess)
  specs = _raw_specs(key, signature.input_signature)
  try:
    traced = pre.get_concrete_function(*specs)
  except Exception as e:
    raise _errors.ExportError(
      f'The preprocess of `signatures[{key!r}]` failed on its '
      f'input_signature {list(specs)}: {_signature.summary(e)}. Make it a '
      "TF function of the signature's inputs that returns the method's "
      'positional arguments (a tensor, or a tuple of tensors).'
    ) from e
  returned = traced.structured_outputs
  arguments = (
    list(returned) if isinstance(returned, list | tuple) else [returned]
  )
  model_specs = []
  for i, a in enumerate(arguments):
    if a is not None and not isinstance(a, tf.Tensor):
      raise _errors.ExportError(
        f'Expected the preprocess of `signatures[{key!r}]` to return the '
        "method's positional arguments, tensors (or None), got "
        f'{type(a).__name__} at position {i}: {a!r:.80}. Return a tensor, '
        'or a tuple of tensors; convert a RaggedTensor with .to_tensor().'
      )
    model_specs.append(
      None if a is None else tf.TensorSpec(a.shape, a.dtype, f'input_{i}')
    )
  inputs = _inputs.inputs(
    module, signature.method, model_specs, signature.polymorphic_shapes
  )
  return _Prepared(key, signature, inputs, specs, pre, post)


def _raw_specs(key: str, input_signature: Any) -> tuple[Any, ...]:
  """The TF specs of a preprocessed signature's inputs."""
  if isinstance(input_signature, str | bytes) or not isinstance(
    input_signature, Sequence
  ):
    input_signature = [input_signature]
  specs = []
  for index, entry in enumerate(input_signature):
    if entry is None:
      raise _errors.ExportError(
        f'Expected a spec for each input of `signatures[{key!r}]`, got None '
        f"at position {index}: with a preprocess, the signature's inputs "
        'are what clients send, and None is no input. Leave it out, and '
        'let the preprocess return None for that argument.'
      )
    specs.append(_inputs.tensor_spec(entry, index)[0])
  return tuple(specs)


@dataclasses.dataclass(frozen=True)
class _Served:
  """What to serve: the variables, the method and its signature."""

  selected: filterlib.Filter
  signatures: Mapping[str, _Prepared]
  trainable: filterlib.Filter
  platforms: Sequence[str] | None
  show: bool


def _write(module: Any, directory: str, served: _Served) -> None:
  """Writes the SavedModel of a module on this process's devices."""
  graphdef, exported, rest = nnx.split(module, served.selected, ...)
  entries = _selection.select(exported, ..., nnx.Nothing, what='module')
  values, _ = _single_mesh.onto_one_mesh(
    entries,
    [_selection.to_jax_array(e, across_processes=False) for e in entries],
  )
  again = _reexport.key(
    graphdef,
    entries,
    values,
    rest,
    {k: p.signature for k, p in served.signatures.items()},
    served.trainable,
    served.platforms,
  )
  written = _reexport.lookup(again[0]) if again is not None else None
  if written is not None:
    _output.announce(
      served.show, 'writing the variables of a SavedModel traced before'
    )
    with concurrent.futures.ThreadPoolExecutor(_checksums.THREADS) as pool:
      shards, streams = _reexport.write(
        written, directory, PREFIX, entries, values, pool
      )
      recs = _checkpoint.records(
        entries, [v.sharding for v in values], written.layouts, shards
      )
      _checkpoint.write_manifest(
        directory,
        _model.SAVED_MODEL_FORMAT,
        PREFIX,
        recs,
        pool,
        signatures=dict(written.signatures),
        written=streams,
      )
    return
  is_trainable = filterlib.to_predicate(served.trainable)
  dvars = _convert.dvariables(
    entries,
    widen=True,
    show=served.show,
    desc='flax_dtensor: to DTensor',
    values=values,
    trainable=lambda e: bool(is_trainable(e.path, e.variable)),
  )
  with concurrent.futures.ThreadPoolExecutor(_checksums.THREADS) as pool:
    shards = [f.result() for f in _checksums.shard_checksums(values, pool)]
  layouts = [_tf.dtensor().fetch_layout(d) for d in dvars]
  recs = _checkpoint.records(
    entries, [v.sharding for v in values], layouts, shards
  )
  mesh = _single_mesh.main_mesh(values)
  del values
  model = _Model(
    type(module).__name__,
    graphdef,
    _on_one_device(rest),
    entries,
    dvars,
    any(v.trainable for v in dvars),
  )
  with (
    _serialization.for_tensorflow(),
    concurrent.futures.ThreadPoolExecutor(_checksums.THREADS) as pool,
  ):
    _output.announce(served.show, 'tracing and writing a SavedModel')
    traced = {}
    for key, prepared in served.signatures.items():
      where = f'{type(module).__name__}.{prepared.signature.method}'
      found = _tracing.traced(
        _tracing.Forward(
          functools.partial(_serving, model, prepared, served.platforms),
          where,
          mesh,
          differentiable=model.with_gradient,
        ),
        prepared.inputs,
      )
      _serialization.check_readable(found.concrete, 'save_saved_model')
      if found.inputs.multiples:
        _output.warn(
          _input_checks.narrowed_warning(
            found.inputs, where, found.refused_serving_mesh
          ),
          _errors.ServedShapeWarning,
        )
      traced[key] = found
    root = _root(entries, dvars, served.signatures, traced)
    meshes = [t.mesh for t in traced.values() if t.mesh is not None]
    with _tracing.mesh_set(meshes[0] if meshes else None):
      # TF traces again while it saves.
      _write_saved_model(
        root, directory, {k: t.concrete for k, t in traced.items()}
      )
    _conventions.add_lists(directory, entries)
    signatures = written_signatures(directory)
    _checkpoint.write_manifest(
      directory,
      _model.SAVED_MODEL_FORMAT,
      PREFIX,
      recs,
      pool,
      signatures=signatures,
    )
  if again is not None:
    _reexport.remember(
      *again,
      directory,
      os.path.join(_model.SAVED_MODEL_ASSETS, _model.FILE),
      layouts,
      signatures,
    )


def _on_one_device(rest: Any) -> Any:
  """The constants baked into the forward, as NumPy arrays where they can
  be (typed RNG keys stay).

  A device array the trace captures leaves jax2tf's export of the gradient
  with no device assignment, which TF then fails to save; a NumPy array
  is embedded in the exported function as the device array would be.
  """

  def host(a: Any) -> Any:
    if not isinstance(a, jax.Array) or not a.is_fully_addressable:
      return a
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
      return a
    return np.asarray(a)

  return jax.tree.map(host, rest)


@dataclasses.dataclass(frozen=True)
class _Model:
  """The exported model, as each signature's forward rebuilds it."""

  name: str  # The module's class name, for messages.
  graphdef: Any
  rest: Any  # What is baked in as constants.
  entries: Sequence[_selection.Entry]
  dvars: Sequence[Any]  # The SavedModel's variables, one per entry.
  with_gradient: bool  # Whether TF differentiates the forward.


def _serving(
  model: _Model,
  prepared: _Prepared,
  platforms: Sequence[str] | None,
  inputs: _inputs.Inputs,
) -> Any:
  """The served `tf.function` of one signature for these inputs' polymorphic
  shapes: its preprocess, the method converted by jax2tf, its postprocess.
  """
  tf = _tf.tf()
  from jax.experimental import jax2tf

  method = prepared.signature.method
  where = f'{model.name}.{method}'

  # The abstract mesh of the first trace (the primal's). TF traces the
  # gradient again while it saves, through jax2tf's VJP, whose `jit` runs
  # under no mesh: a bare PartitionSpec in the forward (`out_sharding=P()`)
  # would find none.
  seen: list[Any] = []

  def forward(params: list[jax.Array], *arrays: jax.Array) -> Any:
    flat = []
    for e, p in zip(model.entries, params, strict=True):
      if e.widened_in_jax:
        p = p.astype(e.dtype)
      if e.key_impl is not None:
        p = jax.random.wrap_key_data(p, impl=e.key_impl)
      flat.append((e.path, e.variable.copy(p)))
    merged = nnx.merge(model.graphdef, nnx.from_flat_state(flat), model.rest)
    if not seen:
      seen.append(jax.sharding.get_abstract_mesh())
    with jax.sharding.use_abstract_mesh(seen[0]):
      result = getattr(merged, method)(*prepared.inputs.arguments(arrays))
    _signature.named_outputs(result, where)  # Refuses what cannot be served.
    return result

  forward_tf = jax2tf.convert(
    forward,
    polymorphic_shapes=[None, *inputs.polymorphic],
    with_gradient=model.with_gradient,
    native_serialization_platforms=(
      tuple(platforms) if platforms is not None else None
    ),
  )

  def serve(*tensors: tf.Tensor) -> Any:
    if prepared.preprocess is not None:
      returned = prepared.preprocess(*tensors)
      if not isinstance(returned, list | tuple):
        returned = [returned]
      tensors = tuple(t for t in returned if t is not None)
    # Widened variables go back to their dtype in TF, or inside the JAX
    # function (`forward`) for dtypes TF may lack.
    params = [
      tf.cast(v, e.dtype)
      if e.stored_dtype != e.dtype and not e.widened_in_jax
      else v
      for e, v in zip(model.entries, model.dvars, strict=True)
    ]
    result = forward_tf(params, *tensors)
    if prepared.postprocess is not None:
      result = prepared.postprocess(result)
    return _signature.named_outputs(
      result, where, arrays=(tf.Tensor, *_signature.ARRAYS)
    )

  specs = prepared.specs if prepared.preprocess is not None else inputs.specs
  return tf.function(serve, input_signature=list(specs), autograph=False)


def _root(
  entries: Sequence[_selection.Entry],
  dvars: Sequence[Any],
  signatures: Mapping[str, _Prepared],
  traced: Mapping[str, _tracing.Traced],
) -> Any:
  """The SavedModel's root object: the variables by NNX path under
  ``state`` (what `from_tf_module` and `restore_from_tf` read), the default
  signature as ``__call__`` (and as ``serve``, the endpoint Keras's
  `TFSMLayer` calls by default), other signatures under their keys, and
  what their TF functions use. TF's convention's lists are added once it
  is written (`_conventions`).
  """
  tf = _tf.tf()
  root = tf.__internal__.tracking.AutoTrackable()
  setattr(
    root,
    _names.STATE_ATTRIBUTE,
    _convert.nest((e.path, v) for e, v in zip(entries, dvars, strict=True)),
  )
  default = traced.get(_signatures.DEFAULT_KEY) or next(iter(traced.values()))
  root.__call__ = default.function
  root.serve = default.function
  for key, found in traced.items():
    name = _signatures.attribute_name(key)
    if name is not None:
      setattr(root, name, found.function)
  root.resources = [
    r for p in signatures.values() for r in p.signature.resources
  ]
  return root


# Several processes: gathered onto process 0
# ------------------------------------------------------------------------------


def _nbytes(value: Any) -> int:
  """Bytes of an array as gathered (a typed key's key data)."""
  if _dtypes.is_key(value.dtype):
    value = jax.eval_shape(jax.random.key_data, value)
  return math.prod(value.shape) * np.dtype(value.dtype).itemsize


def _arrays_of(module: Any) -> list[tuple[Any, nnx.Variable, Any]]:
  """Every variable of `module` with its value, in one fixed order."""
  return [
    (path, variable, _spec.value_of(variable))
    for path, variable in _variables.iter_variables(module)
  ]


def _check_limit(limit: Any) -> None:
  if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
    raise _errors.ExportError(
      'Expected `max_gather_bytes` to be a non-negative int (a number of '
      f'bytes), got {limit!r}. Pass e.g. `max_gather_bytes=16 * 2**30`.'
    )


def _check_gather_size(module: Any, limit: int) -> None:
  """Refuses, on every process alike, a model bigger than `limit`."""
  nbytes = sum(
    _nbytes(v) for _, _, v in _arrays_of(module) if isinstance(v, jax.Array)
  )
  if nbytes > limit:
    raise _errors.ExportError(
      f'save_saved_model in a run of {jax.process_count()} processes gathers '
      'the model onto process 0, which writes the SavedModel: expected at '
      f'most max_gather_bytes={limit} ({_text.human_bytes(limit)}) of '
      f'variables, got {nbytes} ({_text.human_bytes(nbytes)}). A '
      'served SavedModel loads whole into one TF process: pass a larger '
      '`max_gather_bytes=` if process 0 has the memory for it, or leave '
      'variables out with `include=`/`exclude=` (they are then baked in as '
      'constants, gathered too).'
    )


def _gathered(module: Any) -> Any:
  """On process 0, a copy of `module` on its first device; None elsewhere.

  Every variable sharded over the processes goes to process 0 through a
  collective (`process_allgather`), one variable at a time and in the same
  order on every process; a variable this process holds whole stays as it
  is here.
  """
  lead = jax.process_index() == 0
  device = jax.local_devices()[0]
  graphdef, _ = nnx.split(module)
  flat = []
  for path, variable, value in _arrays_of(module):
    if isinstance(value, jax.Array):
      key = _dtypes.is_key(value.dtype)
      data = jax.random.key_data(value) if key else value
      if not data.is_fully_addressable:
        data = multihost_utils.process_allgather(data, tiled=True)
      if lead:
        data = jax.device_put(data, device)
        value = (
          jax.random.wrap_key_data(data, impl=jax.random.key_impl(value))
          if key
          else data
        )
    if lead:
      flat.append((tuple(path), variable.copy(value)))
  return nnx.merge(graphdef, nnx.from_flat_state(flat)) if lead else None


def _save_gathered(
  module: Any,
  directory: str,
  entries: Sequence[_selection.Entry],
  served: _Served,
  *,
  overwrite: bool,
  max_gather_bytes: int,
) -> None:
  """The SavedModel of a model over several processes, written by process 0.

  Every check that can refuse runs on every process before anything moves
  (the same inputs give the same answer everywhere); what fails on process
  0 alone is shared (`_processes.agree`), so every process raises together.
  """
  for e in entries:
    _selection.to_jax_array(e)  # Concrete, and over every process.
  _check_gather_size(module, max_gather_bytes)
  with (
    _processes.session(
      f'the SavedModel export to {directory!r}',
      f'{directory!r} holds the previous export or the new one, whole.',
    ),
    _atomic.atomic_directory(
      directory, overwrite=overwrite, is_export=_decode.is_export
    ) as tmp,
  ):
    local = _gathered(module)
    error = None
    if local is not None:
      try:
        _write(local, tmp, served)
      except Exception as e:  # Re-raised below, on every process.
        error = e
    _processes.agree(error, 'Writing the SavedModel on process 0')


def written_signatures(directory: str) -> dict[str, _model.Signature]:
  """The signatures of the SavedModel in `directory`, as TF will read them.

  Read back from its ``saved_model.pb`` (names, shapes with None for a
  polymorphic dimension, dtypes), so that the manifest shows exactly what
  ``tf.saved_model.load(...).signatures`` gives, without TensorFlow.
  """
  tf = _tf.tf()
  saved_model_pb2 = _tf.internal('tensorflow.core.protobuf.saved_model_pb2')
  proto = saved_model_pb2.SavedModel()
  with open(os.path.join(directory, 'saved_model.pb'), 'rb') as f:
    proto.ParseFromString(f.read())

  def spec(info: Any) -> _model.TensorSpec:
    shape = info.tensor_shape
    dims = (
      None
      if shape.unknown_rank
      else tuple(None if d.size < 0 else int(d.size) for d in shape.dim)
    )
    return _model.TensorSpec(dims, tf.dtypes.as_dtype(info.dtype).name)

  if len(proto.meta_graphs) != 1:
    raise ValueError(
      f'saved_model.pb holds {len(proto.meta_graphs)} MetaGraphs, not one'
    )
  (graph,) = proto.meta_graphs
  return {
    name: _model.Signature(
      inputs={k: spec(v) for k, v in sorted(sig.inputs.items())},
      outputs={k: spec(v) for k, v in sorted(sig.outputs.items())},
    )
    for name, sig in graph.signature_def.items()
    if not name.startswith('__')  # TF's internal '__saved_model_init_op'.
  }


def _write_saved_model(
  root: Any, directory: str, signatures: Mapping[str, Any]
) -> None:
  tf = _tf.tf()
  logger = logging.getLogger('tensorflow')
  quiet = _OwnSaverRetraced()
  logger.addFilter(quiet)
  try:
    tf.saved_model.save(root, directory, signatures=dict(signatures))
  except AssertionError as e:
    if 'untracked' not in str(e):
      raise
    raise _errors.ExportError(
      'A preprocess or postprocess of the SavedModel uses a TF resource (a '
      'lookup table, a variable) that the export does not save '
      f'({_signature.summary(e)}). Expected every TF object they use in '
      "their ServingSignature's `resources=`: pass e.g. "
      'ServingSignature(..., resources=[table]).'
    ) from e
  finally:
    logger.removeFilter(quiet)


class _OwnSaverRetraced(logging.Filter):
  """Drops TF's warning that its saver's function was traced again: every
  `tf.saved_model.save` builds a new saver (``MultiDeviceSaver``), whose
  function TF counts as one, so a process's sixth export warned the user
  of a retracing that is TF's own, not theirs."""

  def filter(self, record: logging.LogRecord) -> bool:
    return 'tf_function_save' not in record.getMessage()
