"""NNX variables -> TF DTensor variables, and the tf.Module that holds them.

`to_tf_module` makes one ``DVariable`` per selected variable, laid out like
its JAX array (the components alias the JAX shards), in nested dicts under
the module's attribute ``state``, keyed by `_names.component`. This is what
checkpoints and SavedModels are written from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import (
  TYPE_CHECKING,
  Any,
  Literal,
  TypedDict,
  TypeVar,
  Unpack,
  overload,
)

import jax
from flax import nnx
from flax.nnx import filterlib

from flax_dtensor import _errors, _output
from flax_dtensor._placement import _variables
from flax_dtensor.dtensor import _tf
from flax_dtensor.dtensor._conversion import _names, _selection, _single_mesh
from flax_dtensor.dtensor._layout import _arrays

if TYPE_CHECKING:
  import tensorflow as tf

A = TypeVar('A')

# Show a progress bar (when our stream is a terminal) from this many
# variables.
PROGRESS_MIN_VARIABLES = 16


def show_progress(progress: bool | None, count: int) -> bool:
  """Whether to draw a progress bar: asked for, or many variables on a tty."""
  if jax.process_index() != 0:
    return False
  if progress is None:
    return count >= PROGRESS_MIN_VARIABLES and _output.stream().isatty()
  return bool(progress)


def progress(
  items: Iterable[A], *, show: bool, total: int, desc: str
) -> Iterator[A]:
  with _output.progress(
    show=show, total=total, description=desc, unit='var'
  ) as advance:
    for item in items:
      yield item
      advance()


def to_dtensor(
  entry: _selection.Entry, *, widen: bool, value: jax.Array | None = None
) -> tf.Tensor:
  """The variable's value as a DTensor (zero-copy unless widened).

  With `widen`, a dtype of `_dtypes.STORED_DTYPES` is widened exactly: in
  JAX (same sharding) before TF sees it when JAX holds the stored dtype,
  else by TF.
  """
  tf = _tf.tf()
  if value is None:
    value = _selection.to_jax_array(entry)
  widened = widen and entry.stored_dtype != entry.dtype
  if widened and entry.widened_in_jax:
    value = value.astype(entry.stored_dtype)
  try:
    t = _arrays.array_to_dtensor(value)
  except _errors.DTensorError as e:
    raise _errors.ExportError(
      f'Cannot export the NNX variable {entry.name!r} to TF DTensor: {e}'
    ) from e
  if widened and not entry.widened_in_jax:
    t = tf.cast(t, entry.stored_dtype)
  return t


def nest(pairs: Iterable[tuple[Sequence[Any], A]]) -> dict[str, Any]:
  """Nested dicts {component name: ...} from (path, leaf) pairs."""
  tree: dict[str, Any] = {}
  for path, leaf in pairs:
    node = tree
    names = _names.components(path)
    for name in names[:-1]:
      node = node.setdefault(name, {})
    node[names[-1]] = leaf
  return tree


def make_module(variables: Iterable[tuple[Sequence[Any], Any]]) -> tf.Module:
  """A tf.Module holding `variables` at their paths under ``state``."""
  tf = _tf.tf()
  module = tf.Module(name='nnx')
  setattr(module, _names.STATE_ATTRIBUTE, nest(variables))
  return module


def dvariables(
  entries: Sequence[_selection.Entry],
  *,
  widen: bool,
  show: bool,
  desc: str,
  values: Sequence[jax.Array | None] | None = None,
  trainable: Callable[[_selection.Entry], bool] | None = None,
) -> list[Any]:
  """One DVariable per entry, laid out like its JAX array.

  Each is trainable where `trainable` says so (default: the `nnx.Param`s).
  """
  if trainable is None:
    trainable = _is_param
  if values is None:
    values = [None] * len(entries)
  out = []
  for entry, value in progress(
    zip(entries, values, strict=True), show=show, total=len(entries), desc=desc
  ):
    out.append(
      _dvariable(
        to_dtensor(entry, widen=widen, value=value),
        name=_names.variable_name(entry.path),
        trainable=trainable(entry),
      )
    )
  return out


def _is_param(entry: _selection.Entry) -> bool:
  return isinstance(entry.variable, nnx.Param)


def _dvariable(value: tf.Tensor, *, name: str, trainable: bool) -> Any:
  """A DVariable named `name`, created at the cost of an unnamed one.

  TF's DTensor device compiles an op once per distinct set of attributes,
  and a variable's name is an attribute of its ``VarHandleOp``
  (``debug_name``): created with their names, 32 variables took 0.31 s, one
  compile each; created unnamed, 0.04 s. The name TF reports (``.name``, and
  a SavedModel's variable names, which TF takes from it) is the handle
  name, set here after creation.
  """
  dtensor = _tf.dtensor()
  variable = dtensor.DVariable(value, trainable=trainable)
  if isinstance(getattr(variable, '_handle_name', None), str):
    variable._handle_name = f'{name}:0'
    return variable
  return dtensor.DVariable(value, name=name, trainable=trainable)


class ExportKeywords(TypedDict, total=False):
  """The keywords of an export that its typed overloads share.

  For type checkers only: each overload names what tells its result apart
  (`single_mesh`, a save's `blocking`) and takes these as `**options`; the
  implementation's own signature, with the defaults, is what runs.
  """

  include: filterlib.Filter
  exclude: filterlib.Filter
  progress: bool | None


@overload
def to_tf_module(
  module_or_state: Any,
  *,
  single_mesh: Literal[False] = False,
  **options: Unpack[ExportKeywords],
) -> tf.Module: ...


@overload
def to_tf_module(
  module_or_state: Any,
  *,
  single_mesh: Literal[True],
  **options: Unpack[ExportKeywords],
) -> tuple[tf.Module, _single_mesh.SingleMeshReport]: ...


def to_tf_module(
  module_or_state: Any,
  *,
  include: filterlib.Filter = ...,
  exclude: filterlib.Filter = nnx.RngState,
  progress: bool | None = None,
  single_mesh: bool = False,
) -> tf.Module | tuple[tf.Module, _single_mesh.SingleMeshReport]:
  """Returns a `tf.Module` of DTensor variables mirroring NNX variables.

  Each selected NNX variable becomes one `tf.experimental.dtensor.DVariable`
  with the same shape, dtype and values, and the DTensor layout of its JAX
  sharding (`flax_dtensor.dtensor.layout_for`). Its components alias the JAX
  shards (no copy, no gather, no collective): TF copies a buffer before
  writing to it, so the NNX module never changes. `nnx.Param`s are
  trainable.

  The variables sit in nested dicts under the module's attribute `state`,
  keyed by path (see `checkpoint_key` for how keys are named), so
  `tf.train.Checkpoint(tf_module)` and `tf.saved_model.save` track them
  under readable names. Use `save_checkpoint` to write a checkpoint: TF
  cannot read back sharded float16, uint16, uint32 or float8 variables,
  which it stores widened. Dtypes TF has no usable tensor dtype for (int2,
  uint2, float4_e2m1fn, float8_e3m4, float8_e4m3, float8_e8m0fnu) are
  refused.

  By default the layouts are lossless: a dimension sharded over several
  mesh axes (`P(('data', 'model'))`), or an array on one device, gets a
  DTensor mesh of its own. TF's own `tf.train.Checkpoint(...).write` and
  TF ops mixing variables need one mesh: with `single_mesh=True`, every
  variable lives on the one DTensor mesh mirroring the JAX mesh (the one
  holding the most bytes). JAX first moves what that mesh cannot express
  as it is: a dimension over several mesh axes keeps the largest of them
  (the first on a tie; each device then holds the smallest slice one axis
  allows) and is replicated over the others; an array on one device or on
  another mesh is laid out on this one. The moved arrays are copies (the
  model is not changed); the others stay zero-copy.

  Args:
    module_or_state: An NNX module, another NNX graph node (`nnx.Optimizer`),
      or an `nnx.State`, holding concrete `jax.Array`s.
    include: NNX filter of the variables to export: every variable by
      default; `nnx.Param`, `(nnx.Param, nnx.BatchStat)`, `nnx.OptState`.
    exclude: NNX filter of variables to leave out even if included. The
      default leaves out RNG state; `exclude=nnx.Nothing` exports RNG keys
      as `jax.random.key_data`.
    progress: Show a progress bar: None shows one from
      `PROGRESS_MIN_VARIABLES` variables when stderr is a terminal.
    single_mesh: Put every variable on one DTensor mesh (see above).

  Returns:
    A `tf.Module` with `tf_module.state[...]` nested dicts of DVariables;
    `tf_module.variables` lists them all, and `flat_variables` maps NNX
    paths to them. With `single_mesh=True`, the pair `(tf_module,
    report)`: the `SingleMeshReport` lists each variable JAX moved, where
    it was, where it is, and why.

  Raises:
    DTensorInitializationError: If `flax_dtensor.dtensor.initialize()` was
      not called.
    NotAModelError: If `module_or_state` is not an NNX module or state.
    ExportError: If no variable is selected, a selected variable holds no
      array or an abstract one, has a dtype TF lacks, or its sharding has no
      DTensor layout.

  Example:
    >>> import flax_dtensor.dtensor as fdt_tf  # doctest: +SKIP
    >>> tf_module = fdt_tf.to_tf_module(model)  # doctest: +SKIP
    >>> fdt_tf.flat_variables(tf_module)[('linear', 'kernel')]  # doctest: +SKIP
    >>> tf_module, report = fdt_tf.to_tf_module(  # doctest: +SKIP
    ...   model, single_mesh=True)
    >>> tf.train.Checkpoint(tf_module).write('/tmp/tf_ckpt')  # doctest: +SKIP
  """
  entries = _selection.select(
    module_or_state, include, exclude, what='module_or_state', widen=False
  )
  show = show_progress(progress, len(entries))
  values, report = None, None
  if single_mesh:
    values, report = _single_mesh.onto_one_mesh(
      entries, [_selection.to_jax_array(e) for e in entries]
    )
  dvars = dvariables(
    entries,
    widen=False,
    show=show,
    desc='flax_dtensor: to DTensor',
    values=values,
  )
  module = make_module((e.path, v) for e, v in zip(entries, dvars, strict=True))
  return (module, report) if single_mesh else module


def flat_variables(tf_module: Any) -> dict[_names.Path, Any]:
  """Returns `{nnx path: tf.Variable}` for a module from `to_tf_module`.

  Also works on the object `tf.saved_model.load` returns for a SavedModel
  written by `save_saved_model`.

  Args:
    tf_module: The result of `to_tf_module`, or a loaded SavedModel.

  Returns:
    The variables keyed by NNX path (a tuple of keys, exactly as saved), in
    natural path order; a '/'-joined str also looks a path up.

  Raises:
    ExportError: If `tf_module` has no `state` attribute of nested variables.
  """
  tf = _tf.tf()
  root = getattr(tf_module, _names.STATE_ATTRIBUTE, None)
  if root is None:
    raise _errors.ExportError(
      f'Expected a tf.Module from to_tf_module (with a '
      f'`{_names.STATE_ATTRIBUTE}` attribute), got '
      f'{type(tf_module).__name__}.'
    )
  out: dict[_names.Path, Any] = {}

  def walk(node: Any, prefix: tuple[Any, ...]) -> None:
    if isinstance(node, tf.Variable):
      out[prefix] = node
      return
    for name in node.keys():
      walk(node[name], (*prefix, _names.key_of(name)))

  walk(root, ())
  return _names.PathDict(
    sorted(
      out.items(),
      key=lambda kv: _variables.natural_key(_names.path_text(kv[0])),
    )
  )
