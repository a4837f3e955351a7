"""SavedModels: a module's forward pass, served by plain TensorFlow.

`save_saved_model` exports a module's method through
``jax.experimental.jax2tf`` (native serialization, StableHLO) with the
module's variables as DTensor variables read by the served function, plus
the manifest (`_manifest`) in ``assets/``. One save op writes the
variables, so they are first brought onto one mesh (`_onto_one_mesh`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
from flax import nnx
from flax.nnx import filterlib

from flax_dtensor import _errors, _output, _specs
from flax_dtensor.dtensor import (
  _atomic,
  _checkpoint,
  _convert,
  _manifest,
  _paths,
  _selection,
  _tf,
  _tf_errors,
)

if TYPE_CHECKING:
  import tensorflow as tf

# The variables' checkpoint prefix inside a SavedModel.
PREFIX = 'variables/variables'
MULTI_PROCESS_MSG = (
  'save_saved_model runs in a single process: expected '
  'jax.process_count() == 1, got {count}. Every process would write the '
  'same SavedModel, and the variables are not yet gathered onto one '
  "process's devices. Save a checkpoint with save_checkpoint (in every "
  'process), then in a single process restore it with restore_checkpoint '
  "onto that process's devices and call save_saved_model there."
)


def _simple_spec(sharding: jax.sharding.Sharding) -> bool:
  """Whether the DTensor mesh of `sharding` is its JAX mesh, unfused."""
  return isinstance(sharding, jax.sharding.NamedSharding) and all(
    entry is None or isinstance(entry, str) or len(entry) == 1
    for entry in sharding.spec
  )


def _spec_on(
  mesh: jax.sharding.Mesh, sharding: jax.sharding.Sharding, shape: Sequence[int]
) -> jax.sharding.PartitionSpec:
  """A spec on `mesh` keeping what it can of `sharding` (one axis per dim)."""
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return jax.sharding.PartitionSpec()
  used: set[str] = set()
  out = []
  for entry, size in zip(sharding.spec, shape, strict=False):
    pick = None
    for name in _specs.axes_of(entry):
      if (
        name in mesh.shape and name not in used and size % mesh.shape[name] == 0
      ):
        pick = name
        break
    if pick is not None:
      used.add(pick)
    out.append(pick)
  return jax.sharding.PartitionSpec(*out)


def _onto_one_mesh(entries: Sequence[_selection.Entry]) -> list[jax.Array]:
  """The entries' arrays, resharded (only where needed) onto one mesh.

  A SavedModel's variables are saved by one save op, which DTensor runs on
  one mesh. Arrays already laid out on the mesh holding most bytes (without
  fused axes) are used as they are; the others (a dimension sharded over
  several mesh axes, another mesh, a single device) are copied onto it,
  keeping one mesh axis per dimension where the names and sizes allow.
  """
  values = [_selection.to_jax_array(e) for e in entries]
  by_mesh: dict[jax.sharding.Mesh, int] = {}
  for v in values:
    if isinstance(v.sharding, jax.sharding.NamedSharding):
      by_mesh[v.sharding.mesh] = by_mesh.get(v.sharding.mesh, 0) + v.nbytes
  if not by_mesh:
    devices = {d for v in values for d in v.sharding.device_set}
    if len(devices) == 1:
      return values
    target = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return [jax.device_put(v, target) for v in values]
  mesh = max(by_mesh, key=by_mesh.__getitem__)
  out = []
  for v in values:
    if not (_simple_spec(v.sharding) and v.sharding.mesh == mesh):
      spec = _spec_on(mesh, v.sharding, v.shape)
      v = jax.device_put(v, jax.sharding.NamedSharding(mesh, spec))
    out.append(v)
  return out


def _tensor_spec(spec: Any, index: int) -> tf.TensorSpec:
  tf = _tf.tf()
  if isinstance(spec, tf.TensorSpec):
    return tf.TensorSpec(spec.shape, spec.dtype, spec.name or f'input_{index}')
  if isinstance(spec, jax.ShapeDtypeStruct):
    return tf.TensorSpec(spec.shape, spec.dtype, f'input_{index}')
  raise _errors.ExportError(
    'Expected each entry of `input_signature` to be a tf.TensorSpec or '
    f'jax.ShapeDtypeStruct (None for a polymorphic dimension), got '
    f'{type(spec).__name__} at index {index}: {spec!r}.'
  )


def _polymorphic_shape(spec: tf.TensorSpec, index: int) -> str | None:
  """'(b, 16)' for a [None, 16] spec: a shared leading batch dimension 'b'."""
  shape = spec.shape
  if shape.rank is None:
    return None
  dims = []
  for j, d in enumerate(shape.as_list()):
    if d is None:
      dims.append('b' if j == 0 else f'd{index}_{j}')
    else:
      dims.append(str(d))
  if all(d.isdigit() for d in dims):
    return None
  return '(' + ', '.join(dims) + (',)' if len(dims) == 1 else ')')


def _signature_outputs(out: Any) -> Any:
  """Makes a jax2tf result acceptable as a SavedModel signature output."""
  tf = _tf.tf()
  if isinstance(out, tf.Tensor):
    return out
  if isinstance(out, Mapping) and all(
    isinstance(k, str) and isinstance(v, tf.Tensor) for k, v in out.items()
  ):
    return dict(out)
  leaves = tf.nest.flatten(out)
  return {f'output_{i}': t for i, t in enumerate(leaves)}


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
  keeping one mesh axis per dimension where names and sizes allow. The model
  itself is not changed; the copies cost memory during the export.

  The exported function runs on the platforms of `platforms` (default: the
  current JAX backend). The written directory appears atomically.

  Single process only: in a multi-process run (`jax.process_count() > 1`)
  it raises. Restore the checkpoint in one process (`restore_checkpoint`
  onto that process's devices) and export the SavedModel there.

  Args:
    module: The NNX module to serve (concrete arrays).
    directory: The SavedModel directory to create. Its parent must exist.
    input_signature: One `tf.TensorSpec` or `jax.ShapeDtypeStruct` per
      positional argument of the method; `None` dimensions are polymorphic
      (a leading `None` is the batch dimension 'b', shared by all inputs).
    method: Name of the module's method to serve.
    include: NNX filter of the variables to export as TF variables (default
      all but `exclude`).
    exclude: NNX filter of variables baked in as constants instead (default
      RNG state).
    polymorphic_shapes: jax2tf polymorphic shapes, one per input, overriding
      those derived from `input_signature` (e.g. `['(b, ...)']`).
    platforms: `native_serialization_platforms` for jax2tf, e.g.
      `('cpu', 'cuda')`.
    overwrite: Replace `directory` if it exists.
    progress: Show a progress bar; None shows one from
      `PROGRESS_MIN_VARIABLES` variables when stderr is a terminal.

  Returns:
    The absolute path of the SavedModel directory.

  Raises:
    DTensorInitializationError: If `flax_dtensor.dtensor.initialize()` was
      not called.
    ExportError: If it runs in several processes, `method` is not a method
      of `module`, `input_signature` has an entry of the wrong type or the
      wrong length of `polymorphic_shapes`, `directory` exists and
      `overwrite` is false, its parent is not writable, a variable cannot
      be exported, or the disk is full (the bytes needed and free).

  Example:
    >>> save_saved_model(  # doctest: +SKIP
    ...   model, '/tmp/sm',
    ...   input_signature=[tf.TensorSpec([None, 16], tf.float32)])
    >>> loaded = tf.saved_model.load('/tmp/sm')  # doctest: +SKIP
    >>> loaded.signatures['serving_default'](input_0=x)  # doctest: +SKIP
  """
  if jax.process_count() > 1:
    raise _errors.ExportError(
      MULTI_PROCESS_MSG.format(count=jax.process_count())
    )
  tf = _tf.tf()
  from jax.experimental import jax2tf

  directory = _paths.local(directory, 'SavedModel directory')
  if not callable(getattr(module, method, None)):
    raise _errors.ExportError(
      f'Expected `method` to name a method of the module, got {method!r}, '
      f'which {type(module).__name__} has no callable attribute of.'
    )
  specs = [_tensor_spec(s, i) for i, s in enumerate(input_signature)]
  if polymorphic_shapes is None:
    polymorphic_shapes = [_polymorphic_shape(s, i) for i, s in enumerate(specs)]
  elif len(polymorphic_shapes) != len(specs):
    raise _errors.ExportError(
      f'Expected one polymorphic shape per input ({len(specs)}), got '
      f'{len(polymorphic_shapes)}: {polymorphic_shapes!r}.'
    )
  selected = nnx.All(include, nnx.Not(exclude))
  graphdef, exported, rest = nnx.split(module, selected, ...)
  entries = _selection.select(exported, ..., nnx.Nothing, what='module')
  show = _convert.show_progress(progress, len(entries))
  values = _onto_one_mesh(entries)
  dvars = _convert.dvariables(
    entries,
    widen=True,
    show=show,
    desc='flax_dtensor: to DTensor',
    values=values,
  )
  with concurrent.futures.ThreadPoolExecutor(_manifest.THREADS) as pool:
    shards = [f.result() for f in _manifest.shard_checksums(values, pool)]
  recs = _checkpoint.records(entries, values, dvars, shards)
  del values
  tf_module = _convert.make_module(
    (e.path, v) for e, v in zip(entries, dvars, strict=True)
  )

  def forward(params: list[jax.Array], *inputs: jax.Array) -> Any:
    flat = []
    for e, p in zip(entries, params, strict=True):
      if e.widened_in_jax:
        p = p.astype(e.dtype)
      if e.key_impl is not None:
        p = jax.random.wrap_key_data(p, impl=e.key_impl)
      flat.append((e.path, e.variable.copy(p)))
    model = nnx.merge(graphdef, nnx.from_flat_state(flat), rest)
    return getattr(model, method)(*inputs)

  forward_tf = jax2tf.convert(
    forward,
    polymorphic_shapes=[None, *polymorphic_shapes],
    with_gradient=False,
    native_serialization_platforms=(
      tuple(platforms) if platforms is not None else None
    ),
  )

  def serve(*inputs: tf.Tensor) -> Any:
    # Widened variables go back to their dtype in TF, or inside the JAX
    # function (`forward`) for dtypes TF may lack.
    params = [
      tf.cast(v, e.dtype)
      if e.stored_dtype != e.dtype and not e.widened_in_jax
      else v
      for e, v in zip(entries, dvars, strict=True)
    ]
    return _signature_outputs(forward_tf(params, *inputs))

  serve_fn = tf.function(serve, input_signature=specs, autograph=False)
  tf_module.serve = serve_fn
  version = _calling_convention_version()
  with (
    _tf_errors.space_checked(directory, sum(e.nbytes for e in entries)),
    _tf_errors.translated(
      'Writing the SavedModel', directory, _checkpoint.WRITE_FIX
    ),
    _atomic.atomic_directory(directory, overwrite=overwrite) as tmp,
    _jax_export_version(version),
    concurrent.futures.ThreadPoolExecutor(_manifest.THREADS) as pool,
  ):
    _output.announce(show, f'tracing and writing a SavedModel to {directory}')
    _write_saved_model(tf_module, tmp, serve_fn.get_concrete_function())
    _checkpoint.write_manifest(
      tmp, _manifest.SAVED_MODEL_FORMAT, PREFIX, recs, pool
    )
  return directory


def _tf_max_calling_convention() -> int | None:
  """The newest jax2tf calling convention this TF's XlaCallModule runs."""
  try:
    xla = _tf.internal('tensorflow.compiler.tf2xla.python.xla')
  except ImportError:  # pragma: no cover - TF moved it.
    return None
  return int(xla.call_module_maximum_supported_version())


def _calling_convention_version() -> int:
  """The calling convention to export with: JAX's, or older if TF needs it.

  JAX emits `jax_export_calling_convention_version` (10 in jax 0.10, which
  TF 2.21 runs). If the installed TF only runs older versions, export with
  the newest one both support; if there is none, fail here rather than in
  the serving process.
  """
  current = int(jax.config.jax_export_calling_convention_version)
  tf_max = _tf_max_calling_convention()
  if tf_max is None or current <= tf_max:
    return current
  if tf_max >= jax.export.minimum_supported_calling_convention_version:
    return tf_max
  raise _errors.ExportError(
    f'JAX exports StableHLO with calling convention version {current} (at '
    f'least {jax.export.minimum_supported_calling_convention_version}), but '
    f'the installed TensorFlow runs versions up to {tf_max} only: expected '
    'a common version. Install a newer TensorFlow (pip install '
    '"flax-dtensor[tf]").'
  )


@contextlib.contextmanager
def _jax_export_version(version: int) -> Iterator[None]:
  """Exports with calling convention `version` in this thread only.

  Neither `jax.export.export` nor `jax2tf.convert` takes the version as an
  argument in jax 0.10: `_export_lowered` reads the option
  `jax_export_calling_convention_version`. `jax.config.update` would change
  it for every thread while the export runs; the option's own context
  manager (a thread-local value, restored on exit) changes it for this one
  only. JAX exposes it only as `jax._src.config.<option>`, as its own
  export tests use it.
  """
  if version == int(jax.config.jax_export_calling_convention_version):
    yield
    return
  from jax._src import config as jax_config

  with jax_config.jax_export_calling_convention_version(version):
    yield


def _write_saved_model(
  tf_module: tf.Module, directory: str, serving: Callable[..., Any]
) -> None:
  tf = _tf.tf()
  tf.saved_model.save(
    tf_module, directory, signatures={'serving_default': serving}
  )
