"""NNX state <-> TF DTensor variables, TF checkpoints and SavedModels.

`to_tf_module` turns the variables of an NNX module (or state) into
`tf.experimental.dtensor.DVariable`s laid out exactly like the JAX arrays (the
components alias the JAX shards; nothing is gathered). `save_checkpoint`
writes them as a `tf.train.Checkpoint` that plain, single-process TensorFlow
reads; `restore_checkpoint` reads one back into a module or abstract state,
each array sharded as the target says. `save_saved_model` exports a module's
forward pass (via `jax2tf`) as a SavedModel for TF serving.

Names. Each selected NNX variable is one TF variable named by its NNX path
joined with '/' (`layers/0/attn/query/kernel`). The `tf.Module` holds them in
nested dicts under its attribute `state`
(`tf_module.state['layers']['0']['attn']['query']['kernel']`), so the key of
that variable in a checkpoint, as `tf.train.load_checkpoint(d)` lists it, is::

  state/layers/0/attn/query/kernel/.ATTRIBUTES/VARIABLE_VALUE

`checkpoint_key` and `nnx_path` convert between the two (TF escapes a '.' in
a path component as '..' and a '/' as '.S'); `read_checkpoint` returns a
checkpoint as `{nnx path: numpy array}`.

Selection. `include` and `exclude` are NNX filters (`nnx.Param`,
`(nnx.Param, nnx.BatchStat)`, `...` for everything, `nnx.OptState` for an
`nnx.Optimizer`'s state including its `step`). A variable is exported if it
matches `include` and not `exclude`. `include` defaults to `...` (every
variable: parameters, batch statistics and any other state, so that a
restored model is the saved one). `exclude` defaults to `nnx.RngState`
(`nnx.RngKey` and `nnx.RngCount`, e.g. the `nnx.Rngs` a `nnx.Dropout` holds):
RNG keys are typed PRNG-key arrays, which TF cannot hold; they are per-run
state that is usually re-seeded rather than served or resumed; and their raw
form depends on the PRNG implementation. Pass `exclude=nnx.Nothing` to export
them anyway: a key is stored as `jax.random.key_data` (uint32, one trailing
dimension more) and restored with `jax.random.wrap_key_data`.

Checkpoint dtypes. TensorFlow cannot read back a sharded (sliced) checkpoint
tensor of dtype float16, uint16, uint32 or float8 ("Dtype half not
supported", both in `tf.train.load_checkpoint` and in DTensor's own restore);
it has no dtype at all for some ml_dtypes (float8_e3m4, float8_e8m0fnu, ...),
and its checkpoint writer crashes the process on int2, uint2 and
float4_e2m1fn. `save_checkpoint` and `save_saved_model` therefore store those
dtypes widened, exactly, for every layout (`STORED_DTYPES`: float16 and every
float8/float4 -> float32, uint16 -> int32, uint32 -> int64, int2 -> int8,
uint2 -> uint8), and `restore_checkpoint`, `read_checkpoint` and the
SavedModel's serving function convert back. Every other dtype a JAX array can
have that TF cannot store (uint64) is refused before anything is written.
`to_tf_module` itself keeps every dtype TF has, and refuses the others. A NaN
stays a NaN of the same sign, but the payload bits of a float16, float8_e5m2,
float8_e4m3 or float8_e3m4 NaN may change through float32.

`restore_checkpoint` never changes a value: the dtype a variable was saved
with (recorded in `flax_dtensor.json`; for a checkpoint without that file,
the dtype it holds) must be the target's.

Checkpoint directory. `save_checkpoint(..., d)` writes `d/ckpt.index`,
`d/ckpt.data-*`, a `d/checkpoint` state file (so `tf.train.load_checkpoint(d)`
and `tf.train.latest_checkpoint(d)` work) and `d/flax_dtensor.json`: for each
variable its checkpoint key, NNX type, dtype, stored dtype, shape, and
sharding as data (the JAX PartitionSpec as a list of mesh axes per
dimension, the JAX mesh axis names and sizes, and the DTensor layout it was
written with: one sharding spec per dimension and the DTensor mesh, whose
axes may fuse JAX axes, e.g. 'data+model' of size 8). A SavedModel carries
the same file as `assets/flax_dtensor.json`. Writes are atomic: see
`flax_dtensor.dtensor._atomic`.

Several meshes. TF DTensor saves and restores the tensors of one DTensor
mesh at a time (a save op mixing meshes fails in DTensor's mesh
propagation), and an array with a dimension sharded over several mesh axes
(`P(('data', 'model'))`, on a fused DTensor axis) or on a single device has a
DTensor mesh of its own. So `save_checkpoint` writes one partial checkpoint
per DTensor mesh (`tf.experimental.dtensor.sharded_save`), then process 0
merges them with `MergeV2Checkpoints` (which renames data files and writes
one index) together with the object graph `tf.train.Checkpoint` records, so
`tf.train.Checkpoint(to_tf_module(model)).read(...)` also works (for
variables on one mesh). `restore_checkpoint` reads one mesh at a time
(`tf.experimental.dtensor.name_based_restore`). A SavedModel is written by a
single save op: `save_saved_model` copies arrays that are not on the mesh
holding most bytes onto it (see there).

Multi-host recipe. Every process runs the same program and calls the export
functions together (they run TF collectives and barriers):

1. Pick one free port for JAX and one per process for DTensor, e.g. for two
   processes on one machine: JAX 127.0.0.1:9000, DTensor 127.0.0.1:9001 and
   127.0.0.1:9002 (on several hosts, each host's own address).
2. In process `i`, before importing TensorFlow, set
   `DTENSOR_JOBS=127.0.0.1:9001,127.0.0.1:9002` (the same list, in process
   order, everywhere), `DTENSOR_CLIENT_ID=i` and `DTENSOR_JOB_NAME=worker`.
3. `jax.distributed.initialize(coordinator_address='127.0.0.1:9000',
   num_processes=2, process_id=i)`, then `flax_dtensor.dtensor.initialize()`
   before any other TF operation.
4. Build the model under `jax.set_mesh(mesh)` with a mesh over
   `jax.devices()` (all processes' devices), e.g.
   `jax.make_mesh((2, 4), ('data', 'model'))`, so that every array spans
   all processes (an array on one process's devices only is refused, by
   every process alike). Train, then call
   `save_checkpoint(model, '/shared/ckpt')` in every process with the same
   directory. Each process writes its own shards; process 0 merges the
   per-mesh parts and the index.
5. Read it anywhere with `tf.train.load_checkpoint('/shared/ckpt')`, or
   restore with `restore_checkpoint` (again in every process, with an
   abstract target from `nnx.eval_shape` under `jax.set_mesh(mesh)`).

`save_saved_model` runs in a single process only (it raises `ExportError`
when `jax.process_count() > 1`): restore the checkpoint in one process, on
that process's devices, and export the SavedModel there.

The directory must be on a filesystem every process sees (NFS, or one
machine's disk). Process 0 creates the temporary directory, writes the state
and metadata files and renames the result into place; the others wait at
barriers, and errors about the arguments or the target directory are raised
on every process. If one process fails mid-write for another reason, the
others block until JAX's barrier timeout, and the target directory is never
created. `tests/multiprocess_export_test.py` runs this recipe with two
processes on 127.0.0.1.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import filterlib

from flax_dtensor import _errors, _meshes, _output, _rules, _variables
from flax_dtensor.dtensor import _atomic, _mesh, _tf

if TYPE_CHECKING:
  import tensorflow as tf

A = TypeVar('A')

# The tf.Module attribute holding the nested dicts of variables.
STATE_ATTRIBUTE = 'state'
# The checkpoint prefix inside a `save_checkpoint` directory.
CHECKPOINT_PREFIX = 'ckpt'
METADATA_FILE = 'flax_dtensor.json'
METADATA_FORMAT = 'flax_dtensor.checkpoint'
SAVED_MODEL_METADATA_FORMAT = 'flax_dtensor.saved_model'
# 2: `sharding` is structured data (version 1 had a display string).
METADATA_VERSION = 2
# Where a SavedModel keeps flax_dtensor.json, and its variables' prefix.
SAVED_MODEL_ASSETS = 'assets'
SAVED_MODEL_PREFIX = 'variables/variables'
_ATTRIBUTES_SUFFIX = '/.ATTRIBUTES/VARIABLE_VALUE'
_OBJECT_GRAPH_KEY = '_CHECKPOINTABLE_OBJECT_GRAPH'
# Scratch directory for the per-mesh partial checkpoints (removed after use).
_SCRATCH_DIR = '.parts'
# Show a progress bar (when stderr is a terminal) from this many variables.
PROGRESS_MIN_VARIABLES = 16


def _dtypes(names: Iterable[str]) -> list[np.dtype]:
  """The dtypes of `names` this JAX / ml_dtypes has (others are skipped)."""
  out = []
  for name in names:
    try:
      out.append(np.dtype(jnp.dtype(name)))
    except TypeError:  # pragma: no cover - an older ml_dtypes.
      pass
  return out


# Dtypes a TF checkpoint holds and reads back as they are (checked on
# tensorflow-cpu 2.21 for sliced DTensor saves and plain reads).
_KEPT_DTYPES = frozenset(
  _dtypes(
    [
      'bool',
      'int4',
      'int8',
      'int16',
      'int32',
      'int64',
      'uint4',
      'uint8',
      'bfloat16',
      'float32',
      'float64',
      'complex64',
      'complex128',
    ]
  )
)
_NARROW_FLOATS = [
  'float8_e4m3fn',
  'float8_e5m2',
  'float8_e4m3fnuz',
  'float8_e4m3b11fnuz',
  'float8_e5m2fnuz',
  'float8_e3m4',
  'float8_e4m3',
  'float8_e8m0fnu',
  'float4_e2m1fn',
]
# Dtypes TF cannot read back from a sliced checkpoint tensor (or store at
# all), and the readable dtype each is stored as. Every value converts
# exactly (NaN payloads aside, see the module docstring).
STORED_DTYPES: Mapping[np.dtype, np.dtype] = {
  np.dtype(np.float16): np.dtype(np.float32),
  np.dtype(np.uint16): np.dtype(np.int32),
  np.dtype(np.uint32): np.dtype(np.int64),
  **{d: np.dtype(np.float32) for d in _dtypes(_NARROW_FLOATS)},
  **{d: np.dtype(np.int8) for d in _dtypes(['int2'])},
  **{d: np.dtype(np.uint8) for d in _dtypes(['uint2'])},
}
# Dtypes TF has no usable tensor dtype for (none, or one its checkpoint
# writer crashes the process on): `to_tf_module` refuses them.
_NOT_IN_TF = frozenset(
  _dtypes(
    [
      'int2',
      'uint2',
      'float4_e2m1fn',
      'float8_e3m4',
      'float8_e4m3',
      'float8_e8m0fnu',
    ]
  )
)
_NAME_UNSAFE = re.compile(r'[^A-Za-z0-9_.\-/]')

_MULTI_PROCESS_SAVED_MODEL_MSG = (
  'save_saved_model runs in a single process: expected '
  'jax.process_count() == 1, got {count}. Every process would write the '
  'same SavedModel, and the variables are not yet gathered onto one '
  "process's devices. Save a checkpoint with save_checkpoint (in every "
  'process), then in a single process restore it with restore_checkpoint '
  "onto that process's devices and call save_saved_model there."
)
_TF_POISONED_MSG = (
  'TF DTensor cancels every later TensorFlow operation of this process '
  'after such an error: restart the process once the cause is fixed.'
)
_NO_VARIABLES_MSG = (
  'No NNX variable of {what} matched `include={include!r}` minus '
  '`exclude={exclude!r}`: expected at least one. Check the filters, e.g. '
  '`include=nnx.Param` for a model, `include=nnx.OptState` for an '
  'nnx.Optimizer, `include=...` for everything.'
)


# ---------------------------------------------------------------------------
# Names.
# ---------------------------------------------------------------------------


def _path_parts(path: str | Sequence[Any]) -> list[str]:
  if isinstance(path, str):
    return path.split('/')
  return [str(p) for p in path]


def _escape(part: str) -> str:
  # As TF's trackable_utils.escape_local_name.
  return part.replace('.', '..').replace('/', '.S')


def _unescape(part: str) -> str:
  out, i = [], 0
  while i < len(part):
    if part[i] == '.' and i + 1 < len(part):
      out.append('.' if part[i + 1] == '.' else '/')
      i += 2
    else:
      out.append(part[i])
      i += 1
  return ''.join(out)


def checkpoint_key(path: str | Sequence[Any]) -> str:
  """Returns the TF checkpoint key of the variable at an NNX path.

  Args:
    path: An NNX path, as a tuple of keys (`('layers', 0, 'kernel')`) or
      joined with '/' (`'layers/0/kernel'`).

  Returns:
    The key under which `tf.train.load_checkpoint` lists the variable in a
    checkpoint written by `save_checkpoint` (and in a SavedModel's
    `variables/variables`).

  Example:
    >>> checkpoint_key(('layers', 0, 'kernel'))
    'state/layers/0/kernel/.ATTRIBUTES/VARIABLE_VALUE'
  """
  parts = [_escape(p) for p in _path_parts(path)]
  return '/'.join([STATE_ATTRIBUTE, *parts]) + _ATTRIBUTES_SUFFIX


def nnx_path(key: str) -> str | None:
  """Returns the NNX path ('/'-joined) of a checkpoint key, or None.

  The inverse of `checkpoint_key` (exact for paths without '/' inside a key).

  Args:
    key: A checkpoint key, as `tf.train.load_checkpoint(d)` lists them
      (`get_variable_to_shape_map()`).

  Returns:
    The NNX path joined with '/', or None if `key` is not the value of a
    variable exported by flax_dtensor (e.g. `_CHECKPOINTABLE_OBJECT_GRAPH`).

  Example:
    >>> nnx_path('state/layers/0/kernel/.ATTRIBUTES/VARIABLE_VALUE')
    'layers/0/kernel'
  """
  head = STATE_ATTRIBUTE + '/'
  if not (key.startswith(head) and key.endswith(_ATTRIBUTES_SUFFIX)):
    return None
  body = key[len(head) : -len(_ATTRIBUTES_SUFFIX)]
  return '/'.join(_unescape(p) for p in body.split('/'))


def _variable_name(name: str) -> str:
  """A TF-acceptable variable name showing the NNX path."""
  safe = _NAME_UNSAFE.sub('_', name)
  return safe if safe[:1].isalnum() or safe[:1] == '.' else 'v' + safe


# ---------------------------------------------------------------------------
# Selection.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Entry:
  """One selected NNX variable.

  Attributes:
    path: The NNX path (tuple of keys).
    name: `path` joined with '/'.
    variable: The NNX variable.
    shape: The exported shape (with the key-data dimension for RNG keys).
    dtype: The exported dtype (uint32 for RNG keys).
    key_impl: The PRNG implementation name for a typed key array, else None.
  """

  path: tuple[Any, ...]
  name: str
  variable: nnx.Variable
  shape: tuple[int, ...]
  dtype: np.dtype
  key_impl: str | None

  @property
  def stored_dtype(self) -> np.dtype:
    return _stored_dtype(self.dtype)

  @property
  def widened_in_jax(self) -> bool:
    """Whether it is widened, and converted in JAX (else in TF, if at all).

    JAX converts when it holds the stored dtype natively: every ml_dtype
    (which TF may lack) goes through float32, int8 or uint8. uint32 is
    widened to int64 by TF unless JAX runs with 64-bit types.
    """
    stored = self.stored_dtype
    return stored != self.dtype and (
      np.dtype(jax.dtypes.canonicalize_dtype(stored)) == stored
    )

  @property
  def key(self) -> str:
    return checkpoint_key(self.path)


def _stored_dtype(dtype: np.dtype) -> np.dtype:
  return STORED_DTYPES.get(dtype, dtype)


def _state_of(node: Any, what: str) -> nnx.State:
  if isinstance(node, nnx.State):
    return node
  try:
    return nnx.state(node)
  except Exception as e:
    raise _errors.ExportError(
      f'Expected {what} to be an NNX module, graph node (e.g. nnx.Optimizer) '
      f'or nnx.State, got {type(node).__name__}: {node!r:.200}.'
    ) from e


def _is_key_dtype(dtype: Any) -> bool:
  return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _storable_names() -> str:
  names = sorted(d.name for d in (*_KEPT_DTYPES, *STORED_DTYPES))
  return ', '.join(names)


def _select(
  node: Any, include: Any, exclude: Any, *, what: str, widen: bool = True
) -> list[_Entry]:
  """The variables of `node` matching `include` and not `exclude`.

  `widen=False` (to_tf_module) also refuses dtypes TF has no tensor for.
  """
  state = _state_of(node, what)
  selected = filterlib.to_predicate(nnx.All(include, nnx.Not(exclude)))
  entries = []
  for path, variable in nnx.to_flat_state(state):
    if not selected(path, variable):
      continue
    name = '/'.join(str(p) for p in path)
    if not isinstance(variable, nnx.Variable):
      raise _errors.ExportError(
        f'Expected the leaves of {what} to be NNX variables, got '
        f'{type(variable).__name__} at {name!r}. Pass the module itself or '
        '`nnx.state(module)`, not a pure dict.'
      )
    value = variable.get_value()
    shape, dtype = getattr(value, 'shape', None), getattr(value, 'dtype', None)
    if shape is None or dtype is None:
      raise _errors.ExportError(
        f'Expected the NNX variable {name!r} ({type(variable).__name__}) to '
        f'hold an array, got {type(value).__name__}: {value!r:.100}. Leave '
        'it out with `exclude=`.'
      )
    key_impl = None
    if _is_key_dtype(dtype):
      key_impl = str(jax.random.key_impl(value))
      data = jax.eval_shape(jax.random.key_data, value)
      shape, dtype = data.shape, data.dtype
    dtype = np.dtype(dtype)
    if dtype not in _KEPT_DTYPES and dtype not in STORED_DTYPES:
      raise _errors.ExportError(
        f'The NNX variable {name!r} has dtype {dtype}, which TF cannot '
        'store in a sharded checkpoint: expected one of '
        f'{_storable_names()}. Cast it (e.g. uint64 to int64), or leave it '
        'out with `exclude=`.'
      )
    if not widen and dtype in _NOT_IN_TF:
      raise _errors.ExportError(
        f'The NNX variable {name!r} has dtype {dtype}, for which TensorFlow '
        'has no usable tensor dtype: expected a dtype TF holds. Cast it, '
        'leave it out with `exclude=`, or use save_checkpoint / '
        f'save_saved_model, which store it widened to '
        f'{_stored_dtype(dtype)}.'
      )
    entries.append(
      _Entry(tuple(path), name, variable, tuple(shape), dtype, key_impl)
    )
  if not entries:
    raise _errors.ExportError(
      _NO_VARIABLES_MSG.format(what=what, include=include, exclude=exclude)
    )
  return entries


# ---------------------------------------------------------------------------
# Progress.
# ---------------------------------------------------------------------------


def _show_progress(progress: bool | None, count: int) -> bool:
  if jax.process_index() != 0:
    return False
  if progress is None:
    return count >= PROGRESS_MIN_VARIABLES and _output.stream().isatty()
  return bool(progress)


def _progress(
  items: Iterable[A], *, show: bool, total: int, desc: str
) -> Iterator[A]:
  with _output.progress(
    show=show, total=total, description=desc, unit='var'
  ) as advance:
    for item in items:
      yield item
      advance()


# ---------------------------------------------------------------------------
# NNX -> DVariables.
# ---------------------------------------------------------------------------


def _to_jax_array(entry: _Entry) -> jax.Array:
  value = entry.variable.get_value()
  if isinstance(value, jax.ShapeDtypeStruct):
    raise _errors.ExportError(
      f'Expected a concrete array in the NNX variable {entry.name!r}, got an '
      f'abstract {value!r} (e.g. from nnx.eval_shape). Export a module with '
      'real values, or fill it first with restore_checkpoint.'
    )
  if entry.key_impl is not None:
    value = jax.random.key_data(value)
  if not isinstance(value, jax.Array):
    if jax.process_count() > 1:
      raise _errors.ExportError(
        f'Expected a jax.Array in the NNX variable {entry.name!r}, got '
        f'{type(value).__name__}. In a multi-process run place it first, '
        'e.g. jax.device_put(x, NamedSharding(mesh, P())).'
      )
    value = jnp.asarray(value)
  if jax.process_count() > 1:
    _check_spans_processes(entry.name, value.sharding)
  return value


def _check_spans_processes(name: str, sharding: jax.sharding.Sharding) -> None:
  """Multi-process: every process must hold part of each array.

  DTensor's multi-client save and restore are collective over a mesh's
  processes; an array on some processes only (e.g. created outside any mesh
  context, on one local device) would leave the others waiting.
  """
  processes = {d.process_index for d in sharding.device_set}
  if len(processes) != jax.process_count():
    raise _errors.ExportError(
      f'The NNX variable {name!r} lives on the devices of processes '
      f'{sorted(processes)} only ({sharding}): expected, in a multi-process '
      'run, an array on a mesh over all processes. Create it under '
      'jax.set_mesh(mesh), or place it with jax.device_put(x, '
      'NamedSharding(mesh, P())).'
    )


def _to_dtensor(
  entry: _Entry, *, widen: bool, value: jax.Array | None = None
) -> tf.Tensor:
  """The variable's value as a DTensor (zero-copy unless widened).

  With `widen`, a dtype of `STORED_DTYPES` is widened exactly: in JAX (same
  sharding) before TF sees it when JAX holds the stored dtype, else by TF.
  """
  tf = _tf.tf()
  if value is None:
    value = _to_jax_array(entry)
  widened = widen and entry.stored_dtype != entry.dtype
  if widened and entry.widened_in_jax:
    value = value.astype(entry.stored_dtype)
  try:
    t = _mesh.array_to_dtensor(value)
  except _errors.DTensorError as e:
    raise _errors.ExportError(
      f'Cannot export the NNX variable {entry.name!r} to TF DTensor: {e}'
    ) from e
  if widened and not entry.widened_in_jax:
    t = tf.cast(t, entry.stored_dtype)
  return t


def _nest(pairs: Iterable[tuple[Sequence[Any], A]]) -> dict[str, Any]:
  """Nested dicts {str(key): ...} from (path, leaf) pairs."""
  tree: dict[str, Any] = {}
  for path, leaf in pairs:
    node = tree
    for part in path[:-1]:
      node = node.setdefault(str(part), {})
    node[str(path[-1])] = leaf
  return tree


def _make_module(variables: Iterable[tuple[Sequence[Any], Any]]) -> tf.Module:
  tf = _tf.tf()
  module = tf.Module(name='nnx')
  setattr(module, STATE_ATTRIBUTE, _nest(variables))
  return module


def _dvariables(
  entries: Sequence[_Entry],
  *,
  widen: bool,
  show: bool,
  desc: str,
  values: Sequence[jax.Array | None] | None = None,
) -> list[Any]:
  dtensor = _tf.dtensor()
  if values is None:
    values = [None] * len(entries)
  out = []
  for entry, value in _progress(
    zip(entries, values, strict=True), show=show, total=len(entries), desc=desc
  ):
    out.append(
      dtensor.DVariable(
        _to_dtensor(entry, widen=widen, value=value),
        name=_variable_name(entry.name),
        trainable=isinstance(entry.variable, nnx.Param),
      )
    )
  return out


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
    for name in _rules.target_axes(entry):
      if (
        name in mesh.shape and name not in used and size % mesh.shape[name] == 0
      ):
        pick = name
        break
    if pick is not None:
      used.add(pick)
    out.append(pick)
  return jax.sharding.PartitionSpec(*out)


def _onto_one_mesh(entries: Sequence[_Entry]) -> list[jax.Array]:
  """The entries' arrays, resharded (only where needed) onto one mesh.

  A SavedModel's variables are saved by one save op, which DTensor runs on
  one mesh. Arrays already laid out on the mesh holding most bytes (without
  fused axes) are used as they are; the others (a dimension sharded over
  several mesh axes, another mesh, a single device) are copied onto it,
  keeping one mesh axis per dimension where the names and sizes allow.
  """
  values = [_to_jax_array(e) for e in entries]
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


def to_tf_module(
  module_or_state: Any,
  *,
  include: filterlib.Filter = ...,
  exclude: filterlib.Filter = nnx.RngState,
  progress: bool | None = None,
) -> tf.Module:
  """Returns a `tf.Module` of DTensor variables mirroring NNX variables.

  Each selected NNX variable becomes one `tf.experimental.dtensor.DVariable`
  with the same shape, dtype and values, and the DTensor layout of its JAX
  sharding (`flax_dtensor.dtensor.layout_for`). Its components alias the JAX
  shards (no copy, no gather, no collective): TF copies a buffer before
  writing to it, so the NNX module never changes. The variable's TF name is
  its NNX path joined with '/'; `nnx.Param`s are trainable.

  The variables sit in nested dicts under the module's attribute `state`,
  keyed by path (integers as strings), so `tf.train.Checkpoint(tf_module)`
  and `tf.saved_model.save` track them under readable names (see
  `checkpoint_key`). Use `save_checkpoint` to write a checkpoint: TF cannot
  read back sharded float16, uint16, uint32 or float8 variables, which it
  stores widened. Dtypes TF has no usable tensor dtype for (int2, uint2,
  float4_e2m1fn, float8_e3m4, float8_e4m3, float8_e8m0fnu) are refused.

  Args:
    module_or_state: An NNX module, another NNX graph node (`nnx.Optimizer`),
      or an `nnx.State`, holding concrete `jax.Array`s.
    include: NNX filter of the variables to export: every variable by
      default; `nnx.Param`, `(nnx.Param, nnx.BatchStat)`, `nnx.OptState`.
    exclude: NNX filter of variables to leave out even if included. The
      default leaves out RNG state (see the module docstring);
      `exclude=nnx.Nothing` exports RNG keys as `jax.random.key_data`.
    progress: Show a progress bar: None shows one from
      `PROGRESS_MIN_VARIABLES` variables when stderr is a terminal.

  Returns:
    A `tf.Module` with `tf_module.state[...]` nested dicts of DVariables;
    `tf_module.variables` lists them all.

  Raises:
    DTensorInitializationError: If `flax_dtensor.dtensor.initialize()` was
      not called.
    ExportError: If no variable is selected, a selected variable holds no
      array or an abstract one, has a dtype TF lacks, or its sharding has no
      DTensor layout.

  Example:
    >>> import flax_dtensor.dtensor as fdt_tf  # doctest: +SKIP
    >>> tf_module = fdt_tf.to_tf_module(model)  # doctest: +SKIP
    >>> tf_module.state['linear']['kernel'].name  # doctest: +SKIP
    'linear/kernel:0'
  """
  entries = _select(
    module_or_state, include, exclude, what='module_or_state', widen=False
  )
  show = _show_progress(progress, len(entries))
  dvars = _dvariables(
    entries, widen=False, show=show, desc='flax_dtensor: to DTensor'
  )
  return _make_module((e.path, v) for e, v in zip(entries, dvars, strict=True))


def flat_variables(tf_module: Any) -> dict[str, Any]:
  """Returns `{nnx path: tf.Variable}` for a module from `to_tf_module`.

  Also works on the object `tf.saved_model.load` returns for a SavedModel
  written by `save_saved_model`.

  Args:
    tf_module: The result of `to_tf_module`, or a loaded SavedModel.

  Returns:
    The variables keyed by NNX path joined with '/', in path order.

  Raises:
    ExportError: If `tf_module` has no `state` attribute of nested variables.
  """
  tf = _tf.tf()
  root = getattr(tf_module, STATE_ATTRIBUTE, None)
  if root is None:
    raise _errors.ExportError(
      f'Expected a tf.Module from to_tf_module (with a `{STATE_ATTRIBUTE}` '
      f'attribute), got {type(tf_module).__name__}.'
    )
  out: dict[str, Any] = {}

  def walk(node: Any, prefix: tuple[str, ...]) -> None:
    if isinstance(node, tf.Variable):
      out['/'.join(prefix)] = node
      return
    for k in sorted(node.keys()):
      walk(node[k], (*prefix, k))

  walk(root, ())
  return out


# ---------------------------------------------------------------------------
# Checkpoints.
# ---------------------------------------------------------------------------


def _axes_record(names: Iterable[Any], sizes: Iterable[Any]) -> dict[str, Any]:
  return {'axis_names': [str(n) for n in names], 'axis_sizes': list(sizes)}


def _sharding_record(
  sharding: jax.sharding.Sharding, layout: Any, ndim: int
) -> dict[str, Any]:
  """A variable's layout as data, for flax_dtensor.json.

  `spec` lists the JAX mesh axes of each dimension (`[['data', 'model'],
  []]` for `P(('data', 'model'), None)`); `dtensor_layout` is the DTensor
  layout the variable was written with: its sharding spec per dimension and
  its DTensor mesh (a fused axis 'data+model' of size 8 for that example).
  """
  if isinstance(sharding, jax.sharding.NamedSharding):
    entries = (*sharding.spec, *([None] * (ndim - len(sharding.spec))))
    kind = 'named'
    spec = [list(_rules.target_axes(entry)) for entry in entries]
    mesh = _axes_record(sharding.mesh.axis_names, sharding.mesh.axis_sizes)
  else:
    kind = 'single_device'
    spec = [[] for _ in range(ndim)]
    mesh = _axes_record([], [])
  return {
    'kind': kind,
    'spec': spec,
    'mesh': mesh,
    'dtensor_layout': {
      'sharding_specs': list(layout.sharding_specs),
      'mesh': _axes_record(
        layout.mesh.dim_names, (int(s) for s in layout.mesh.shape())
      ),
    },
  }


def _metadata(
  entries: Sequence[_Entry],
  values: Sequence[jax.Array],
  tensors: Sequence[Any],
  *,
  saved_model: bool = False,
) -> dict[str, Any]:
  """flax_dtensor.json: what each variable is, and how it was written.

  Args:
    entries: The exported variables.
    values: Their JAX arrays, as exported (RNG keys as key data).
    tensors: Their DTensors or DVariables, as written.
    saved_model: Describe a SavedModel rather than a checkpoint directory.
  """
  dtensor = _tf.dtensor()
  return {
    'format': SAVED_MODEL_METADATA_FORMAT if saved_model else METADATA_FORMAT,
    'version': METADATA_VERSION,
    'checkpoint_prefix': (
      SAVED_MODEL_PREFIX if saved_model else CHECKPOINT_PREFIX
    ),
    'variables': {
      e.name: {
        'key': e.key,
        'type': type(e.variable).__name__,
        'dtype': e.dtype.name,
        'stored_dtype': e.stored_dtype.name,
        'shape': list(e.shape),
        'key_impl': e.key_impl,
        'sharding': _sharding_record(
          v.sharding, dtensor.fetch_layout(t), len(e.shape)
        ),
      }
      for e, v, t in zip(entries, values, tensors, strict=True)
    },
  }


def _dump_metadata(metadata: dict[str, Any], path: str) -> None:
  with open(path, 'w') as f:
    json.dump(metadata, f, indent=1)
    f.write('\n')


def _metadata_dtype(name: str, path: str, variable: str) -> np.dtype:
  try:
    return np.dtype(jnp.dtype(name))
  except TypeError as e:
    raise _errors.ExportError(
      f'{path!r} records the dtype {name!r} for {variable!r}, which this '
      'JAX does not know: expected a JAX dtype name. Upgrade jax / '
      'ml_dtypes, or re-export the checkpoint.'
    ) from e


def _read_metadata(prefix: str) -> dict[str, dict[str, Any]] | None:
  """The variables recorded by flax_dtensor for the checkpoint at `prefix`.

  Looks for `flax_dtensor.json` next to the checkpoint (a `save_checkpoint`
  directory) or in the `assets` of the SavedModel whose variables `prefix`
  is; the file must name `prefix` as its checkpoint.

  Returns:
    `{nnx path: record}`, or None if no such file describes `prefix`.

  Raises:
    ExportError: If the file is not valid flax_dtensor metadata.
  """
  here = os.path.dirname(os.path.abspath(prefix))
  parent = os.path.dirname(here)
  candidates = (
    (here, os.path.join(here, METADATA_FILE)),
    (parent, os.path.join(parent, SAVED_MODEL_ASSETS, METADATA_FILE)),
  )
  for root, path in candidates:
    if not os.path.isfile(path):
      continue
    try:
      with open(path) as f:
        meta = json.load(f)
      own = os.path.join(root, meta.get('checkpoint_prefix', CHECKPOINT_PREFIX))
      variables = meta['variables']
      for name, record in variables.items():
        if not isinstance(record, dict) or not isinstance(record['dtype'], str):
          raise TypeError(f'bad record for {name!r}: {record!r:.100}')
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
      raise _errors.ExportError(
        f'{path!r} is not valid flax_dtensor metadata: expected the JSON '
        f'file save_checkpoint writes, got an error reading it ({e}). '
        'Delete it to read the checkpoint by the dtypes it holds, or '
        're-export the checkpoint.'
      ) from e
    if os.path.normpath(own) == os.path.normpath(os.path.abspath(prefix)):
      return variables
  return None


def _by_mesh(tensors: Sequence[tf.Tensor]) -> list[tuple[Any, list[int]]]:
  """Groups DTensors by DTensor mesh: [(mesh, indices)], in first-seen order.

  TF DTensor saves and restores the tensors of one mesh at a time (a save
  op mixing meshes fails in DTensor's mesh propagation). A fused mesh axis
  (`P(('data', 'model'))`) or a single-device array has a mesh of its own.
  """
  dtensor = _tf.dtensor()
  groups: dict[str, tuple[Any, list[int]]] = {}
  for i, t in enumerate(tensors):
    mesh = dtensor.fetch_layout(t).mesh
    groups.setdefault(mesh.to_string(), (mesh, []))[1].append(i)
  return list(groups.values())


def _write_object_graph(entries: Sequence[_Entry], directory: str) -> str:
  """Writes the checkpoint's object graph; returns the prefix written.

  `tf.train.Checkpoint` records how the variables hang off the root (the
  `_CHECKPOINTABLE_OBJECT_GRAPH` key), which its `read` needs. The graph of a
  module of placeholder scalars with the same structure and names is the
  same, so it is taken from one.
  """
  tf = _tf.tf()
  skeleton = _make_module(
    (e.path, tf.Variable(False, name=_variable_name(e.name))) for e in entries
  )
  scratch = tf.train.Checkpoint(skeleton).write(
    os.path.join(directory, 'skeleton')
  )
  graph = tf.train.load_checkpoint(scratch).get_tensor(_OBJECT_GRAPH_KEY)
  prefix = os.path.join(directory, 'object_graph')
  tf.raw_ops.SaveV2(
    prefix=prefix,
    tensor_names=[_OBJECT_GRAPH_KEY],
    shape_and_slices=[''],
    tensors=[tf.constant(graph)],
  )
  return prefix


def _write_checkpoint(
  entries: Sequence[_Entry], tensors: Sequence[tf.Tensor], directory: str
) -> None:
  """Writes `directory/ckpt.*` (all processes, collectively).

  One DTensor sharded save per DTensor mesh into a scratch prefix (every
  process writes its own shards), then process 0 adds the object graph and
  merges all prefixes into one checkpoint with MergeV2Checkpoints, which only
  renames data files and writes the index.
  """
  tf = _tf.tf()
  dtensor = _tf.dtensor()
  scratch = os.path.join(directory, _SCRATCH_DIR)
  prefixes = []
  for i, (mesh, indices) in enumerate(_by_mesh(tensors)):
    prefix = os.path.join(scratch, f'mesh{i}')
    try:
      dtensor.sharded_save(
        mesh,
        prefix,
        [entries[j].key for j in indices],
        [''] * len(indices),
        [tensors[j] for j in indices],
      )
    except tf.errors.OpError as e:
      raise _errors.ExportError(
        'TensorFlow failed to write the NNX variables '
        f'{_names(entries[j] for j in indices)} (one DTensor mesh) to '
        f'{prefix!r}: expected a writable directory, got {_tf_error(e)}. '
        'Check the disk and the path (on several hosts: a filesystem every '
        'process sees). ' + _TF_POISONED_MSG
      ) from e
    prefixes.append(prefix)
  if jax.process_index() == 0:
    prefixes.append(_write_object_graph(entries, scratch))
    tf.raw_ops.MergeV2Checkpoints(
      checkpoint_prefixes=prefixes,
      destination_prefix=os.path.join(directory, CHECKPOINT_PREFIX),
      delete_old_dirs=True,
    )
    shutil.rmtree(scratch, ignore_errors=True)


def _names(entries: Iterable[_Entry], limit: int = 4) -> str:
  names = [e.name for e in entries]
  shown = ', '.join(repr(n) for n in names[:limit])
  return shown + (
    f' and {len(names) - limit} more' if len(names) > limit else ''
  )


def _tf_error(e: Exception) -> str:
  """'Type: message' of a TF error, on one line.

  DTensor runs its ops asynchronously: the op that fails may report only a
  `CancelledError`, while the cause waits in TF's executors; it is fetched
  from there.
  """
  tf = _tf.tf()
  if isinstance(e, tf.errors.CancelledError):
    try:
      from tensorflow.python.eager import context

      context.context().sync_executors()
    except tf.errors.OpError as cause:
      e = cause
    except Exception:  # pragma: no cover - TF moved it.
      pass
  text = ' '.join(str(getattr(e, 'message', None) or e).split())
  return f'{type(e).__name__}: {text[:500]}'


def _write_metadata(metadata: dict[str, Any], directory: str) -> None:
  """Writes the state file and flax_dtensor.json (process 0 only)."""
  if jax.process_index() != 0:
    return
  # Relative paths: the directory is renamed after writing.
  with open(os.path.join(directory, 'checkpoint'), 'w') as f:
    f.write(
      f'model_checkpoint_path: "{CHECKPOINT_PREFIX}"\n'
      f'all_model_checkpoint_paths: "{CHECKPOINT_PREFIX}"\n'
    )
  _dump_metadata(metadata, os.path.join(directory, METADATA_FILE))


def save_checkpoint(
  module_or_state: Any,
  directory: str | os.PathLike[str],
  *,
  include: filterlib.Filter = ...,
  exclude: filterlib.Filter = nnx.RngState,
  overwrite: bool = False,
  progress: bool | None = None,
) -> str:
  """Writes NNX variables as a TF checkpoint of DTensor variables.

  Each process writes only its own shards, straight from the JAX buffers
  (nothing is gathered). The result is an ordinary `tf.train.Checkpoint`:
  plain single-process TensorFlow reads it with
  `tf.train.load_checkpoint(directory)`, without DTensor, under the keys of
  `checkpoint_key` (float16, float8, uint16 and uint32 stored widened, see
  the module docstring). The directory appears atomically, complete or not
  at all. By default every variable but RNG state is saved, so that
  `restore_checkpoint` gives back the same model (batch statistics
  included).

  In a multi-process run every process must call this with the same
  arguments (see the module docstring for the recipe).

  Args:
    module_or_state: An NNX module, graph node (`nnx.Optimizer`) or
      `nnx.State` holding concrete, sharded `jax.Array`s.
    directory: The checkpoint directory to create. Its parent must exist.
    include: NNX filter of the variables to save (default: every variable;
      e.g. `nnx.Param` for the parameters only, `nnx.OptState` for an
      `nnx.Optimizer`'s state).
    exclude: NNX filter of variables to leave out (default: RNG state).
    overwrite: Replace `directory` if it exists.
    progress: Show a progress bar; None shows one from
      `PROGRESS_MIN_VARIABLES` variables when stderr is a terminal.

  Returns:
    The absolute path of the checkpoint directory.

  Raises:
    DTensorInitializationError: If `flax_dtensor.dtensor.initialize()` was
      not called.
    ExportError: If `directory` exists and `overwrite` is false, its parent
      does not exist, no variable is selected, a variable cannot be exported
      (e.g. a uint64 dtype), or TensorFlow fails to write.

  Example:
    >>> path = save_checkpoint(model, '/tmp/ckpt')  # doctest: +SKIP
    >>> tf.train.load_checkpoint(path).get_tensor(  # doctest: +SKIP
    ...   checkpoint_key('linear/kernel'))
  """
  directory = os.path.abspath(os.fspath(directory))
  entries = _select(module_or_state, include, exclude, what='module_or_state')
  show = _show_progress(progress, len(entries))
  values, tensors = [], []
  for e in _progress(
    entries, show=show, total=len(entries), desc='flax_dtensor: to DTensor'
  ):
    values.append(_to_jax_array(e))
    tensors.append(_to_dtensor(e, widen=True, value=values[-1]))
  metadata = _metadata(entries, values, tensors)
  del values
  with _atomic.atomic_directory(directory, overwrite=overwrite) as tmp:
    nbytes = sum(
      int(np.prod(e.shape)) * e.stored_dtype.itemsize for e in entries
    )
    _output.announce(
      show, f'writing {len(entries)} variables ({nbytes / 1e6:.1f} MB)'
    )
    start = time.perf_counter()
    _write_checkpoint(entries, tensors, tmp)
    _write_metadata(metadata, tmp)
    _output.announce(
      show, f'wrote {directory} in {time.perf_counter() - start:.1f}s'
    )
  return directory


def _checkpoint_prefix(directory: str | os.PathLike[str]) -> str:
  tf = _tf.tf()
  path = os.fspath(directory)
  if os.path.isdir(path):
    prefix = tf.train.latest_checkpoint(path)
    if prefix is None and os.path.exists(
      os.path.join(path, CHECKPOINT_PREFIX + '.index')
    ):
      prefix = os.path.join(path, CHECKPOINT_PREFIX)
    if prefix is not None:
      return prefix
  elif os.path.exists(path + '.index'):
    return path
  raise _errors.ExportError(
    f'Expected a checkpoint directory written by save_checkpoint (or a TF '
    f'checkpoint prefix), got {path!r}, which holds no TF checkpoint.'
  )


def read_checkpoint(directory: str | os.PathLike[str]) -> dict[str, Any]:
  """Reads a checkpoint into host memory as `{nnx path: numpy array}`.

  Plain TensorFlow suffices (DTensor need not be initialized). Widened
  dtypes are converted back to the saved ones (from `flax_dtensor.json`), so
  a float8 or bfloat16 array comes back as an `ml_dtypes` numpy array; RNG
  keys come back as key data (uint32). Every array is read whole on this
  host: for big models use `restore_checkpoint`.

  Args:
    directory: A directory written by `save_checkpoint`, or a TF checkpoint
      prefix (e.g. a SavedModel's `variables/variables`).

  Returns:
    A dict from NNX path ('/'-joined) to numpy array, in path order.

  Raises:
    ExportError: If `directory` holds no TF checkpoint, or its
      `flax_dtensor.json` is not valid.

  Example:
    >>> arrays = read_checkpoint('/tmp/ckpt')  # doctest: +SKIP
    >>> arrays['linear/kernel'].shape  # doctest: +SKIP
    (16, 32)
  """
  tf = _tf.tf()
  prefix = _checkpoint_prefix(directory)
  records = _read_metadata(prefix) or {}
  reader = tf.train.load_checkpoint(prefix)
  out = {}
  for key in sorted(reader.get_variable_to_shape_map()):
    path = nnx_path(key)
    if path is None:
      continue
    value = np.asarray(reader.get_tensor(key))
    if path in records:
      dtype = _metadata_dtype(records[path]['dtype'], prefix, path)
      if value.dtype != dtype:
        value = value.astype(dtype)
    out[path] = value
  return dict(sorted(out.items()))


def _placement_mesh(
  entry: _Entry, mesh: jax.sharding.Mesh | None
) -> jax.sharding.Mesh | None:
  """The concrete mesh to place a variable resolved by the rules on."""
  placement = _meshes.mesh_for(entry.variable, mesh=mesh)
  return placement if isinstance(placement, jax.sharding.Mesh) else None


def _concrete_sharding(
  entry: _Entry,
  mesh: jax.sharding.Mesh | None,
  rules: _rules.LogicalRules | _rules.FlaxRules,
) -> jax.sharding.Sharding:
  """The concrete JAX sharding the restored array of `entry` must have.

  An annotated variable (logical axes in its `out_sharding` metadata) is
  resolved by the rules in effect when there are rules and a concrete mesh;
  any other variable, and every variable when no rules are in effect, keeps
  its value's own sharding.
  """
  sharding = None
  no_rules = isinstance(rules, _rules.FlaxRules) and not rules.pairs
  placement = _placement_mesh(entry, mesh)
  if no_rules and not entry.variable.get_metadata('sharding_rules', None):
    placement = None
  if placement is not None:
    resolution = _variables.spec_of_variable(
      entry.variable, rules=rules, mesh=placement, path=entry.name
    )
    if resolution is not None:
      sharding = jax.sharding.NamedSharding(placement, resolution.spec)
  if sharding is None:
    sharding = _own_sharding(entry, mesh)
  if entry.key_impl is not None and isinstance(
    sharding, jax.sharding.NamedSharding
  ):
    # The key-data dimension is not sharded.
    spec = tuple(sharding.spec) + (None,) * (
      len(entry.shape) - len(sharding.spec)
    )
    sharding = jax.sharding.NamedSharding(
      sharding.mesh, jax.sharding.PartitionSpec(*spec)
    )
  return sharding


def _own_sharding(
  entry: _Entry, mesh: jax.sharding.Mesh | None
) -> jax.sharding.Sharding:
  """The target value's own sharding, made concrete."""
  value = entry.variable.get_value()
  sharding = getattr(value, 'sharding', None)
  if mesh is None:
    current = jax.sharding.get_mesh()
    mesh = None if current.empty else current
  if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(
    sharding.mesh, jax.sharding.AbstractMesh
  ):
    if mesh is None:
      raise _errors.ExportError(
        f'The target variable {entry.name!r} has a sharding on an abstract '
        f'mesh ({sharding.spec} on {sharding.mesh}): expected a concrete '
        'mesh to place it on. Call restore_checkpoint under '
        'jax.set_mesh(mesh), or pass `mesh=`.'
      )
    if mesh.abstract_mesh != sharding.mesh:
      raise _errors.ExportError(
        f'The target variable {entry.name!r} is sharded over the abstract '
        f'mesh {sharding.mesh}, but the mesh given is {mesh.abstract_mesh}: '
        'expected the same axis names and sizes.'
      )
    sharding = jax.sharding.NamedSharding(mesh, sharding.spec)
  if sharding is None:
    if mesh is not None:
      sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    elif jax.process_count() == 1:
      sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    else:
      raise _errors.ExportError(
        f'The target variable {entry.name!r} has no sharding: expected one '
        'in a multi-process run. Build the target under jax.set_mesh(mesh), '
        'or pass `mesh=`.'
      )
  return sharding


def _check_against(
  entries: Sequence[_Entry],
  reader: Any,
  records: Mapping[str, Mapping[str, Any]] | None,
  prefix: str,
) -> list[np.dtype]:
  """Each entry's dtype in the checkpoint; ExportError if it does not fit.

  A restore never changes a value: the dtype a variable was saved with must
  be the target's. `records` (from flax_dtensor.json) give the saved dtype,
  and the checkpoint must then hold its stored (maybe widened) dtype;
  without a record, the checkpoint must hold the target's dtype itself.
  """
  shapes = reader.get_variable_to_shape_map()
  dtypes = reader.get_variable_to_dtype_map()
  out = []
  for e in entries:
    if e.key not in shapes:
      held = sorted(p for p in map(nnx_path, shapes) if p is not None)
      shown = ', '.join(held[:8]) + (', ...' if len(held) > 8 else '')
      raise _errors.ExportError(
        f'The checkpoint {prefix!r} has no variable {e.name!r} (key '
        f'{e.key!r}), which the target needs. It holds {len(held)} '
        f'variables: {shown}. Restore with a narrower `include=`/`exclude=` '
        '(e.g. `include=nnx.Param` for a checkpoint of the parameters '
        'only), or a checkpoint saved from the same model.'
      )
    shape = tuple(shapes[e.key])
    if shape != e.shape:
      raise _errors.ExportError(
        f'Shape mismatch for {e.name!r}: the target expects {e.shape}, the '
        f'checkpoint {prefix!r} holds {shape}. Build the target with the '
        'shapes that were saved (the same model configuration), or leave '
        'this variable out with `include=`/`exclude=`.'
      )
    stored = np.dtype(dtypes[e.key].as_numpy_dtype)
    record = (records or {}).get(e.name)
    if record is not None:
      saved = _metadata_dtype(record['dtype'], prefix, e.name)
      expected_stored = _stored_dtype(saved)
      where = f'saved as {saved}, stored as {stored}'
    else:
      saved = expected_stored = stored
      where = f'holds {stored}, and no {METADATA_FILE} says otherwise'
    if saved != e.dtype:
      raise _errors.ExportError(
        f'Dtype mismatch for {e.name!r}: the target expects {e.dtype}, the '
        f'checkpoint {prefix!r} has {saved} ({where}). A restore never '
        'converts (that could round or wrap values): build the target with '
        f'dtype {saved} (e.g. `param_dtype=`), restore and then cast, or '
        'leave this variable out with `include=`/`exclude=`.'
      )
    if stored != expected_stored:
      raise _errors.ExportError(
        f'The checkpoint {prefix!r} holds {e.name!r} as {stored}, but its '
        f'{METADATA_FILE} says {saved}, expected stored as '
        f'{expected_stored}: the metadata belongs to another checkpoint. '
        f'Delete the {METADATA_FILE} next to it, or re-export the checkpoint.'
      )
    out.append(stored)
  return out


def _astype(array: jax.Array, dtype: np.dtype) -> jax.Array:
  """`array.astype(dtype)`, keeping exactly `array.sharding`.

  On an Explicit mesh JAX returns an equivalent sharding spelled otherwise
  (`P(None, None)` for `P()`); the shards are put back under the original.
  """
  out = array.astype(dtype)
  if out.sharding == array.sharding:
    return out
  return jax.make_array_from_single_device_arrays(
    out.shape, array.sharding, [s.data for s in out.addressable_shards]
  )


def _restore_group(
  mesh: Any,
  prefix: str,
  entries: Sequence[_Entry],
  layouts: Sequence[Any],
  stored: Sequence[np.dtype],
  shardings: Sequence[jax.sharding.Sharding],
  out: list[Any],
  indices: Sequence[int],
) -> None:
  """Restores the entries laid out on one DTensor mesh into `out[indices]`."""
  tf = _tf.tf()
  dtensor = _tf.dtensor()
  try:
    # Placeholders give DTensor the shape, dtype and layout to read into.
    placeholders = collections.OrderedDict(
      (
        e.key,
        dtensor.call_with_layout(tf.zeros, layout, shape=e.shape, dtype=dtype),
      )
      for e, layout, dtype in zip(entries, layouts, stored, strict=True)
    )
    # Each process reads only the slices its devices hold.
    restored = dtensor.name_based_restore(mesh, prefix, placeholders)
  except tf.errors.OpError as e:
    raise _errors.ExportError(
      f'TensorFlow failed to read the NNX variables {_names(entries)} (one '
      f'DTensor mesh) from the checkpoint {prefix!r}: expected an intact '
      f'checkpoint, got {_tf_error(e)}. Check that every data file of the '
      'checkpoint is complete and readable, or re-export it. '
      + _TF_POISONED_MSG
    ) from e
  del placeholders
  for e, dtype, sharding, i in zip(
    entries, stored, shardings, indices, strict=True
  ):
    t = restored.pop(e.key)
    # After _check_against, `dtype` is e.dtype or its widened form.
    narrow_in_jax = dtype != e.dtype and e.widened_in_jax
    if dtype != e.dtype and not narrow_in_jax:
      t = tf.cast(t, e.dtype)
    array = _mesh.dtensor_to_array(t, sharding=sharding)
    if narrow_in_jax:
      array = _astype(array, e.dtype)
    if e.key_impl is not None:
      array = jax.random.wrap_key_data(array, impl=e.key_impl)
    out[i] = array


def restore_checkpoint(
  directory: str | os.PathLike[str],
  target: A,
  *,
  include: filterlib.Filter = ...,
  exclude: filterlib.Filter = nnx.RngState,
  mesh: jax.sharding.Mesh | None = None,
  rules: _rules.RulesLike | None = None,
  progress: bool | None = None,
) -> A:
  """Restores NNX variables from a checkpoint, sharded as the target says.

  Reads through DTensor: each variable is restored into a DTensor variable
  laid out like the target's sharding, so every process reads only the
  slices its devices hold (no host gathers the full model, the saved layout
  does not matter), then handed to JAX. Values are bit-exact to what was
  saved, and never converted: each variable must have the dtype it was
  saved with (widened dtypes, see the module docstring, are narrowed back
  exactly).

  The target's shardings: a variable annotated with logical axes (its
  `out_sharding` metadata, e.g. from `nnx.with_partitioning`) is resolved by
  the rules (`rules`, or the current `fdt.logical_axis_rules` /
  `nnx.logical_axis_rules`) on `mesh` (or the current mesh), whatever its
  value's own sharding; so a target built unsharded
  (`nnx.use_eager_sharding(False)`) is still restored sharded. Without
  rules, or for a variable without logical axes: a concrete array's own
  sharding; for an abstract target (`nnx.eval_shape` under
  `jax.set_mesh(mesh)`), the abstract sharding placed on `mesh` (or the
  current mesh). A value without a sharding is replicated over `mesh` (or,
  without a mesh, put on the first local device).

  In a multi-process run every process must call this together.

  Args:
    directory: A directory written by `save_checkpoint`, or a TF checkpoint
      prefix with the same keys.
    target: An NNX module (concrete, or abstract from `nnx.eval_shape`), which
      is updated in place and returned; or an `nnx.State`, for which a new
      `nnx.State` of the restored variables is returned.
    include: NNX filter of the variables to restore (default: every
      variable; each must be in the checkpoint).
    exclude: NNX filter of variables to leave alone (default: RNG state).
    mesh: The concrete mesh for abstract shardings and for variables
      resolved by the rules; default the current mesh (`jax.set_mesh`).
    rules: Logical-axis rules for annotated variables; default the current
      rules, if any.
    progress: Show a progress bar; None shows one from
      `PROGRESS_MIN_VARIABLES` variables when stderr is a terminal.

  Returns:
    `target` itself (a module, filled in), or a new `nnx.State`.

  Raises:
    DTensorInitializationError: If `flax_dtensor.dtensor.initialize()` was
      not called.
    ExportError: If `directory` holds no checkpoint, the checkpoint lacks a
      selected variable or holds it with another shape or saved dtype, no
      variable is selected, an abstract sharding has no concrete mesh, or
      TensorFlow fails to read the checkpoint.
    UnknownLogicalAxisError: If the rules do not mention a logical axis of
      an annotated variable (see `flax_dtensor.LogicalRules`).
    ShardingResolutionError: If an annotated variable's logical axes cannot
      be resolved by the rules.

  Example:
    >>> with jax.set_mesh(mesh):  # doctest: +SKIP
    ...   abstract = nnx.eval_shape(lambda: Model(rngs=nnx.Rngs(0)))
    ...   model = restore_checkpoint('/tmp/ckpt', abstract)
  """
  tf = _tf.tf()
  directory = os.fspath(directory)
  prefix = _checkpoint_prefix(directory)
  rules_ = _rules.rules_in_effect(rules)
  entries = _select(target, include, exclude, what='target')
  stored = _check_against(
    entries, tf.train.load_checkpoint(prefix), _read_metadata(prefix), prefix
  )
  show = _show_progress(progress, len(entries))
  shardings, layouts = [], []
  for e in entries:
    sharding = _concrete_sharding(e, mesh, rules_)
    if jax.process_count() > 1:
      _check_spans_processes(e.name, sharding)
    try:
      layouts.append(_mesh.layout_for(sharding, len(e.shape)))
    except _errors.DTensorError as err:
      raise _errors.ExportError(
        f'Cannot restore {e.name!r} with the sharding {sharding}: {err}'
      ) from err
    shardings.append(sharding)
  groups: dict[str, tuple[Any, list[int]]] = {}
  for i, layout in enumerate(layouts):
    key = layout.mesh.to_string()
    groups.setdefault(key, (layout.mesh, []))[1].append(i)
  _output.announce(show, f'reading {len(entries)} variables from {prefix}')
  arrays: list[Any] = [None] * len(entries)
  with _output.progress(
    show=show,
    total=len(entries),
    description='flax_dtensor: restoring',
    unit='var',
  ) as advance:
    for group_mesh, indices in groups.values():
      _restore_group(
        group_mesh,
        prefix,
        [entries[i] for i in indices],
        [layouts[i] for i in indices],
        [stored[i] for i in indices],
        [shardings[i] for i in indices],
        arrays,
        indices,
      )
      advance(len(indices))
  flat = [
    (e.path, e.variable.copy(a)) for e, a in zip(entries, arrays, strict=True)
  ]
  state = nnx.from_flat_state(flat)
  if isinstance(target, nnx.State):
    return state  # type: ignore[return-value]
  nnx.update(target, state)
  return target


# ---------------------------------------------------------------------------
# SavedModel.
# ---------------------------------------------------------------------------


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
      `overwrite` is false, or a variable cannot be exported.

  Example:
    >>> save_saved_model(  # doctest: +SKIP
    ...   model, '/tmp/sm',
    ...   input_signature=[tf.TensorSpec([None, 16], tf.float32)])
    >>> loaded = tf.saved_model.load('/tmp/sm')  # doctest: +SKIP
    >>> loaded.signatures['serving_default'](input_0=x)  # doctest: +SKIP
  """
  if jax.process_count() > 1:
    raise _errors.ExportError(
      _MULTI_PROCESS_SAVED_MODEL_MSG.format(count=jax.process_count())
    )
  tf = _tf.tf()
  from jax.experimental import jax2tf

  directory = os.path.abspath(os.fspath(directory))
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
  entries = _select(exported, ..., nnx.Nothing, what='module')
  show = _show_progress(progress, len(entries))
  values = _onto_one_mesh(entries)
  dvars = _dvariables(
    entries,
    widen=True,
    show=show,
    desc='flax_dtensor: to DTensor',
    values=values,
  )
  metadata = _metadata(entries, values, dvars, saved_model=True)
  del values
  tf_module = _make_module(
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
    _atomic.atomic_directory(directory, overwrite=overwrite) as tmp,
    _jax_export_version(version),
  ):
    _output.announce(show, f'tracing and writing a SavedModel to {directory}')
    _write_saved_model(tf_module, tmp, serve_fn.get_concrete_function())
    assets = os.path.join(tmp, SAVED_MODEL_ASSETS)
    os.makedirs(assets, exist_ok=True)
    _dump_metadata(metadata, os.path.join(assets, METADATA_FILE))
  return directory


def _tf_max_calling_convention() -> int | None:
  """The newest jax2tf calling convention this TF's XlaCallModule runs."""
  _tf.tf()
  try:
    from tensorflow.compiler.tf2xla.python import xla
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
