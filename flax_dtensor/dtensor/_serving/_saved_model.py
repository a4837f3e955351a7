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
import math
import os
from collections.abc import Callable, Sequence
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
from flax_dtensor.dtensor._conversion import _convert, _selection, _single_mesh
from flax_dtensor.dtensor._format import _checksums, _decode, _model, _paths
from flax_dtensor.dtensor._layout import _dtypes, _topology
from flax_dtensor.dtensor._serving import (
  _input_checks,
  _inputs,
  _serialization,
  _signature,
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
  input_signature: Sequence[Any],
  method: str = '__call__',
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

  TF writes a SavedModel's variables with one save op, which DTensor runs
  on one mesh: arrays that are not laid out on the JAX mesh holding most
  bytes with at most one mesh axis per dimension (a dimension sharded over
  several axes, another mesh, a single device) are first copied onto it,
  as `to_tf_module(..., single_mesh=True)` lays them out. The model itself
  is not changed; the copies cost memory during the export.

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
    directory: The SavedModel directory to create. Its parent must exist.
    input_signature: One entry per positional argument of the method: a
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
    ExportError: If `method` is not a method of `module`,
      `input_signature` has an entry of the wrong type or does not fit the
      method's positional parameters (checked before tracing),
      `polymorphic_shapes` does not fit it, tracing fails where
      polymorphic dimensions of their own meet (with a
      `polymorphic_shapes` that names them alike), an input has a size
      the forward cannot take (JAX's refusal to contract two sizes: the
      message names the input and the shape it needs), the forward is
      written for Explicit mesh axes and the mesh's are Auto, the result
      holds something other than arrays and None, `directory` exists and
      `overwrite` is false, its parent is not writable, a variable cannot be exported,
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
  inputs = _inputs.inputs(module, method, input_signature, polymorphic_shapes)
  _check_limit(max_gather_bytes)
  selected = nnx.All(include, nnx.Not(exclude))
  _, exported, _ = nnx.split(module, selected, ...)
  entries = _selection.select(exported, ..., nnx.Nothing, what='module')
  show = _convert.show_progress(progress, len(entries))
  served = _Served(selected, method, inputs, platforms, show)
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
class _Served:
  """What to serve: the variables, the method and its signature."""

  selected: filterlib.Filter
  method: str
  inputs: _inputs.Inputs
  platforms: Sequence[str] | None
  show: bool


def _write(module: Any, directory: str, served: _Served) -> None:
  """Writes the SavedModel of a module on this process's devices."""
  tf = _tf.tf()
  from jax.experimental import jax2tf

  graphdef, exported, rest = nnx.split(module, served.selected, ...)
  entries = _selection.select(exported, ..., nnx.Nothing, what='module')
  values, _ = _single_mesh.onto_one_mesh(
    entries,
    [_selection.to_jax_array(e, across_processes=False) for e in entries],
  )
  dvars = _convert.dvariables(
    entries,
    widen=True,
    show=served.show,
    desc='flax_dtensor: to DTensor',
    values=values,
  )
  with concurrent.futures.ThreadPoolExecutor(_checksums.THREADS) as pool:
    shards = [f.result() for f in _checksums.shard_checksums(values, pool)]
  recs = _checkpoint.records(
    entries,
    [v.sharding for v in values],
    [_tf.dtensor().fetch_layout(d) for d in dvars],
    shards,
  )
  mesh = _single_mesh.main_mesh(values)
  del values
  tf_module = _convert.make_module(
    (e.path, v) for e, v in zip(entries, dvars, strict=True)
  )

  where = f'{type(module).__name__}.{served.method}'

  def forward(params: list[jax.Array], *inputs: jax.Array) -> Any:
    flat = []
    for e, p in zip(entries, params, strict=True):
      if e.widened_in_jax:
        p = p.astype(e.dtype)
      if e.key_impl is not None:
        p = jax.random.wrap_key_data(p, impl=e.key_impl)
      flat.append((e.path, e.variable.copy(p)))
    model = nnx.merge(graphdef, nnx.from_flat_state(flat), rest)
    result = getattr(model, served.method)(*served.inputs.arguments(inputs))
    return _signature.named_outputs(result, where)

  def serving(inputs: _inputs.Inputs) -> Any:
    """The served `tf.function` for these inputs' polymorphic shapes."""
    forward_tf = jax2tf.convert(
      forward,
      polymorphic_shapes=[None, *inputs.polymorphic],
      with_gradient=False,
      native_serialization_platforms=(
        tuple(served.platforms) if served.platforms is not None else None
      ),
    )

    def serve(*tensors: tf.Tensor) -> Any:
      # Widened variables go back to their dtype in TF, or inside the JAX
      # function (`forward`) for dtypes TF may lack.
      params = [
        tf.cast(v, e.dtype)
        if e.stored_dtype != e.dtype and not e.widened_in_jax
        else v
        for e, v in zip(entries, dvars, strict=True)
      ]
      return forward_tf(params, *tensors)

    return tf.function(
      serve, input_signature=list(inputs.specs), autograph=False
    )

  with (
    _serialization.for_tensorflow(),
    concurrent.futures.ThreadPoolExecutor(_checksums.THREADS) as pool,
  ):
    _output.announce(served.show, 'tracing and writing a SavedModel')
    traced = _tracing.traced(
      _tracing.Forward(serving, where, mesh), served.inputs
    )
    _serialization.check_readable(traced.concrete, 'save_saved_model')
    if traced.inputs.multiples:
      _output.warn(
        _input_checks.narrowed_warning(
          traced.inputs, where, traced.refused_serving_mesh
        ),
        _errors.ServedShapeWarning,
      )
    tf_module.serve = traced.function
    with _tracing.mesh_set(traced.mesh):  # TF traces again while it saves.
      _write_saved_model(tf_module, directory, traced.concrete)
    _checkpoint.write_manifest(
      directory,
      _model.SAVED_MODEL_FORMAT,
      PREFIX,
      recs,
      pool,
      signatures=written_signatures(directory),
    )


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
  tf_module: tf.Module, directory: str, serving: Callable[..., Any]
) -> None:
  tf = _tf.tf()
  tf.saved_model.save(
    tf_module, directory, signatures={'serving_default': serving}
  )
