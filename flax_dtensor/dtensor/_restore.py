"""Reading checkpoints back: into host memory, or sharded into NNX models.

Before TensorFlow reads anything, the files are checked against the
manifest (sizes and CRCs) and TF's index against its records (keys, shapes,
dtypes); after reading, every byte read, by the saved shards' CRCs. So a
damaged or foreign checkpoint is refused in our own words, and never breaks
TF for the checkpoints that follow. A checkpoint without a manifest (written
by plain TF) is read as it is, with no dtype conversion unless asked for.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import zlib
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from flax import nnx
from flax.nnx import filterlib

from flax_dtensor import _errors, _meshes, _output, _rules, _variables
from flax_dtensor.dtensor import (
  _atomic,
  _checkpoint,
  _convert,
  _dtypes,
  _host_read,
  _manifest,
  _names,
  _paths,
  _peers,
  _selection,
  _tf,
  _tf_errors,
)

A = TypeVar('A')

_READ_FIX = (
  'Check that the path is a checkpoint written by save_checkpoint (or a TF '
  'checkpoint prefix) and readable.'
)


# Finding and checking a checkpoint
# ------------------------------------------------------------------------------


def _no_checkpoint(path: str) -> _errors.ExportError:
  return _errors.ExportError(
    f'Expected a checkpoint directory written by save_checkpoint, a '
    f'SavedModel directory, or a TF checkpoint prefix; got {path!r}, which '
    'holds no TF checkpoint. Pass the directory save_checkpoint returned.'
  )


def locate(path: str) -> tuple[str, _manifest.Manifest | None]:
  """(TF checkpoint prefix, its manifest or None) for a path.

  Raises:
    ExportError: If `path` holds no checkpoint, or its manifest is invalid
      or describes another checkpoint.
  """
  manifest = _manifest.read(path)
  if manifest is not None:
    prefix = os.path.join(manifest.root, manifest.prefix)
    if os.path.isdir(path) and manifest.root != os.path.abspath(path):
      manifest = None  # A manifest of an enclosing export: not this one.
    elif not os.path.isdir(path) and os.path.abspath(path) != prefix:
      manifest = None
    else:
      return prefix, manifest
  if os.path.isdir(path):
    for prefix in (
      os.path.join(path, _checkpoint.PREFIX),
      os.path.join(path, 'variables', 'variables'),
    ):
      if os.path.exists(prefix + '.index'):
        return prefix, None
    tf = _tf.tf()
    with _tf_errors.translated(
      'Reading the checkpoint state of', path, _READ_FIX
    ):
      prefix = tf.train.latest_checkpoint(path)
    if prefix is not None and os.path.exists(prefix + '.index'):
      return prefix, None
  elif os.path.exists(path + '.index'):
    return path, None
  raise _no_checkpoint(path)


def _reader(prefix: str, manifest: _manifest.Manifest | None) -> Any:
  """TF's checkpoint reader, once the files and index check out."""
  tf = _tf.tf()
  if manifest is not None:
    with concurrent.futures.ThreadPoolExecutor(_manifest.THREADS) as pool:
      _manifest.verify_files(manifest, pool)
  with _tf_errors.translated(
    'Reading the index of the checkpoint',
    prefix,
    'The checkpoint is damaged or not a TF checkpoint: restore it from an '
    'intact copy, or re-export it.',
  ):
    reader = tf.train.load_checkpoint(prefix)
    shapes = reader.get_variable_to_shape_map()
    dtypes = reader.get_variable_to_dtype_map()
  if manifest is not None:
    _manifest.verify_index(manifest, shapes, dtypes)
  return reader, shapes, dtypes


# read_checkpoint
# ------------------------------------------------------------------------------


def read_checkpoint(
  directory: str | os.PathLike[str],
) -> dict[_names.Path, np.ndarray]:
  """Reads a checkpoint into host memory as `{nnx path: numpy array}`.

  Plain TensorFlow suffices (DTensor need not be initialized). With the
  checkpoint's manifest (`flax_dtensor.json`), the files are checked before
  TF reads them and every byte read after, and widened dtypes are
  narrowed back exactly (a float8 or bfloat16 array comes back as an
  `ml_dtypes` numpy array). Without one (a checkpoint written by plain TF),
  each array is returned as stored: nothing is ever cast. RNG keys come
  back as key data (uint32). Every array is read whole on this host: for big
  models use `restore_checkpoint`.

  Args:
    directory: A directory written by `save_checkpoint` or
      `save_saved_model`, or a TF checkpoint prefix.

  Returns:
    A dict from NNX path (a tuple of keys, exactly as saved) to numpy array,
    in natural path order; a '/'-joined str also looks a path up
    (`arrays['layers/0/kernel']`).

  Raises:
    ExportError: If `directory` holds no TF checkpoint, is damaged (a file
      changed, truncated or missing; the index disagreeing with the
      manifest), or its manifest is invalid.

  Example:
    >>> arrays = read_checkpoint('/tmp/ckpt')  # doctest: +SKIP
    >>> arrays[('linear', 'kernel')].shape  # doctest: +SKIP
    (16, 32)
  """
  path = _paths.local(directory, 'checkpoint directory')
  with _peers.session(f'the read of {path!r}', 'Nothing was returned.'):
    _atomic.recover_for_reading(path)
  prefix, manifest = locate(path)
  reader, shapes, _ = _reader(prefix, manifest)
  records = manifest.by_key if manifest is not None else {}
  out = {}
  with _tf_errors.translated('Reading the checkpoint', prefix, _READ_FIX):
    for key in shapes:
      nnx_path = _names.nnx_path(key)
      if nnx_path is None:
        continue
      value = np.asarray(reader.get_tensor(key))
      record = records.get(key)
      if record is not None:
        saved = _dtypes.from_name(record.dtype, manifest.where)
        if value.dtype != saved:
          value = value.astype(saved)
        _manifest.verify_read(
          manifest, record, {tuple((0, n) for n in value.shape): value}
        )
      out[nnx_path] = value
  return _names.PathDict(
    sorted(
      out.items(),
      key=lambda kv: _variables.natural_key(_names.path_text(kv[0])),
    )
  )


# restore_checkpoint
# ------------------------------------------------------------------------------


def _own_sharding(
  entry: _selection.Entry, mesh: jax.sharding.Mesh | None
) -> jax.sharding.Sharding:
  """The target value's own sharding, made concrete."""
  value = _variables.value_of(entry.variable)
  sharding = getattr(value, 'sharding', None)
  if mesh is None:
    current = _meshes.mesh_for()
    mesh = current if isinstance(current, jax.sharding.Mesh) else None
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


def target_sharding(
  entry: _selection.Entry,
  mesh: jax.sharding.Mesh | None,
  rules: _rules.LogicalRules | _rules.FlaxRules,
) -> jax.sharding.Sharding:
  """The concrete sharding the restored array of `entry` must have.

  An annotated variable is resolved by the rules in effect on the mesh
  that applies (`_meshes.mesh_for`); any other variable, and every variable
  when no rules are in effect at all, keeps its value's own sharding.
  """
  sharding = None
  no_rules = isinstance(rules, _rules.FlaxRules) and not rules.pairs
  placement = _meshes.mesh_for(entry.variable, mesh=mesh)
  if not isinstance(placement, jax.sharding.Mesh) or (
    no_rules and not entry.variable.get_metadata('sharding_rules', None)
  ):
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


def _check_against(
  entries: Sequence[_selection.Entry],
  shapes: Any,
  dtypes: Any,
  manifest: _manifest.Manifest | None,
  prefix: str,
  convert_dtypes: bool,
) -> list[tuple[np.dtype, np.dtype]]:
  """Per entry, (stored dtype, saved dtype); ExportError if it does not fit.

  A restore never changes a value unless asked to: the dtype a variable was
  saved with (the manifest's; without one, the dtype the checkpoint holds)
  must be the target's, or `convert_dtypes` must be set.
  """
  records = manifest.by_key if manifest is not None else {}
  out = []
  for e in entries:
    if e.key not in shapes:
      held = sorted(
        _names.path_text(p) for p in map(_names.nnx_path, shapes) if p
      )
      shown = _variables.listing(held)
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
    record = records.get(e.key)
    if record is not None:
      saved = _dtypes.from_name(record.dtype, manifest.where)
      where = f'saved as {saved}, stored as {stored}'
    else:
      saved = stored
      where = f'holds {stored}, and it has no manifest saying otherwise'
    if saved != e.dtype and not convert_dtypes:
      raise _errors.ExportError(
        f'Dtype mismatch for {e.name!r}: the target expects {e.dtype}, the '
        f'checkpoint {prefix!r} has {saved} ({where}). A restore does not '
        'convert unless asked (that could round or wrap values): build the '
        f'target with dtype {saved} (e.g. `param_dtype=`), pass '
        '`convert_dtypes=True`, or leave this variable out with '
        '`include=`/`exclude=`.'
      )
    out.append((stored, saved))
  return out


def _check_extra(
  target: Any, shapes: Any, prefix: str, allow_extra: bool
) -> None:
  """Refuses a checkpoint holding variables the target does not have."""
  if allow_extra:
    return
  known = {tuple(p) for p, _ in _variables.iter_variables(target)}
  extra = sorted(
    _names.path_text(p)
    for p in map(_names.nnx_path, shapes)
    if p is not None and p not in known
  )
  if extra:
    raise _errors.ExportError(
      f'The checkpoint {prefix!r} holds {len(extra)} variable(s) the target '
      f'does not have: {_variables.listing(extra)}. Expected a checkpoint of this model: restore '
      'into the model that was saved, or pass `allow_extra=True` to restore '
      'the variables the target has and ignore the others.'
    )


def _fill_abstract(
  target: Any, restored: set[tuple[Any, ...]], rng_seed: int | None
) -> list[tuple[tuple[Any, ...], nnx.Variable]]:
  """Values for target variables that stay abstract; or an error naming them."""
  filled, missing = [], []
  for path, variable in _variables.iter_variables(target):
    value = _variables.value_of(variable)
    if tuple(path) in restored or not isinstance(value, jax.ShapeDtypeStruct):
      continue
    if rng_seed is not None and isinstance(variable, nnx.RngState):
      filled.append(
        (tuple(path), variable.copy(_rng_value(path, value, rng_seed)))
      )
    else:
      missing.append(_names.path_text(path))
  if missing:
    raise _errors.ExportError(
      f'The target is abstract, and {len(missing)} of its variables are not '
      f'restored from the checkpoint: {_variables.listing(missing)}. Expected every variable of '
      'an abstract target to get a value: restore them too (`include=`, '
      '`exclude=`), pass `rng_seed=` to seed RNG state, or restore into a '
      'concrete model, whose other variables keep their values.'
    )
  return filled


def _rng_value(path: Any, abstract: jax.ShapeDtypeStruct, seed: int) -> Any:
  sharding = getattr(abstract, 'sharding', None)
  if not isinstance(getattr(sharding, 'mesh', None), jax.sharding.Mesh):
    sharding = None
  if _dtypes.is_key(abstract.dtype):
    # JAX has no public accessor for an abstract key's implementation.
    impl = getattr(abstract.dtype, '_impl', None)
    key = jax.random.fold_in(
      jax.random.key(seed, impl=impl),
      zlib.crc32(_names.path_text(path).encode()) & 0x7FFFFFFF,
    )
    value = jax.random.split(key, abstract.shape) if abstract.shape else key
  else:
    value = np.zeros(abstract.shape, abstract.dtype)
  return jax.device_put(value, sharding) if sharding is not None else value


@contextlib.contextmanager
def _translated(path: str) -> Iterator[None]:
  with _tf_errors.translated('Restoring from', path, _READ_FIX):
    yield


def restore_checkpoint(
  directory: str | os.PathLike[str],
  target: A,
  *,
  include: filterlib.Filter = ...,
  exclude: filterlib.Filter = nnx.RngState,
  mesh: jax.sharding.Mesh | None = None,
  rules: _rules.RulesLike | None = None,
  allow_extra: bool = False,
  convert_dtypes: bool = False,
  rng_seed: int | None = None,
  progress: bool | None = None,
) -> A:
  """Restores NNX variables from a checkpoint, sharded as the target says.

  Each process reads with TensorFlow's own checkpoint reader (plain TF ops
  on the host; DTensor need not be initialized) the saved shards that meet
  the slices its devices hold under the target's sharding, whatever the
  saved layout, and cuts its slices from them; so no host gathers a model
  sharded over processes (onto another layout, a process may read more of
  a variable than it holds). JAX places one variable while TF reads the
  next. Before TensorFlow reads anything, the files are checked against the
  manifest; after, every byte read, before it is placed (so a file damaged
  or replaced during the restore is refused too). The target is updated
  only once every variable is read and checked, in every process: a failure
  leaves it unchanged. Values are bit-exact to what was saved and never
  converted, unless `convert_dtypes` is set. (To export from the same
  process afterwards, call `initialize()` before this: TF DTensor starts
  only before TF's first operation.)

  The target's shardings: a variable annotated with logical axes is
  resolved by the rules in effect (`rules`, or the context's) on the mesh
  that applies (`mesh`, or the current one), whatever its value's own
  sharding; so a target built unsharded is still restored sharded. Without
  rules, or for a variable without logical axes: its value's own sharding
  (an abstract one is placed on `mesh`).

  A restore into another model never succeeds silently: a variable the
  target needs and the checkpoint lacks, or one the checkpoint holds and
  the target lacks (unless `allow_extra`), is an error. In an abstract
  target (`nnx.eval_shape`), every variable must get a value: restored, or
  for RNG state seeded by `rng_seed`.

  In a multi-process run every process must call this together.

  Args:
    directory: A directory written by `save_checkpoint`, or a TF checkpoint
      prefix with the same keys.
    target: An NNX module (concrete, or abstract from `nnx.eval_shape`),
      which is updated in place and returned; or an `nnx.State`, for which a
      new `nnx.State` of the restored variables is returned.
    include: NNX filter of the variables to restore (default: every
      variable; each must be in the checkpoint).
    exclude: NNX filter of variables to leave alone (default: RNG state).
    mesh: The concrete mesh for abstract shardings and for variables
      resolved by the rules; default the current mesh (`jax.set_mesh`).
    rules: Logical-axis rules for annotated variables; default the rules in
      effect.
    allow_extra: Ignore variables of the checkpoint the target lacks.
    convert_dtypes: Cast each variable to the target's dtype when they
      differ, as `jax.Array.astype` does (this can round, saturate or
      overflow values).
    rng_seed: Seed for RNG state left out of the restore in an abstract
      target (each key folds the seed with its path).
    progress: Show a progress bar; None shows one from 16 variables when
      stderr is a terminal.

  Returns:
    `target` itself (a module, filled in), or a new `nnx.State`.

  Raises:
    NotAModelError: If `target` is not an NNX module or state.
    ExportError: If `directory` holds no checkpoint or a damaged one (also
      when its files change during the restore), the checkpoint lacks a
      selected variable, holds one the target lacks, holds it with another
      shape or dtype, an abstract target would keep abstract variables, an
      abstract sharding has no concrete mesh, TensorFlow fails to read, or
      another process of the run stopped or failed. The target is then
      unchanged.
    UnknownLogicalAxisError: If the rules do not mention a logical axis of
      an annotated variable.
    ShardingResolutionError: If an annotated variable's logical axes cannot
      be resolved by the rules.

  Example:
    >>> with jax.set_mesh(mesh):  # doctest: +SKIP
    ...   abstract = nnx.eval_shape(lambda: Model(rngs=nnx.Rngs(0)))
    ...   model = restore_checkpoint('/tmp/ckpt', abstract)
  """
  path = _paths.local(directory, 'checkpoint directory')
  rules_ = _rules.rules_in_effect(rules)
  entries = _selection.select(target, include, exclude, what='target')
  with _peers.session(
    f'the restore from {path!r}', 'The target was not changed.'
  ):
    arrays = _read_all(
      path, target, entries, mesh, rules_, allow_extra, convert_dtypes, progress
    )
    # Every process has its part, or none changes its target.
    _peers.sync('restored')
  flat = [
    (e.path, e.variable.copy(a)) for e, a in zip(entries, arrays, strict=True)
  ]
  if isinstance(target, nnx.State):
    return nnx.from_flat_state(flat)  # type: ignore[return-value]
  flat += _fill_abstract(target, {e.path for e in entries}, rng_seed)
  nnx.update(target, nnx.from_flat_state(flat))
  return target


def _read_all(
  path: str,
  target: Any,
  entries: Sequence[_selection.Entry],
  mesh: jax.sharding.Mesh | None,
  rules: _rules.LogicalRules | _rules.FlaxRules,
  allow_extra: bool,
  convert_dtypes: bool,
  progress: bool | None,
) -> list[jax.Array]:
  """The restore's reading: checks, then every entry read and placed."""
  _atomic.recover_for_reading(path)
  prefix, manifest = locate(path)
  _, shapes, dtypes = _reader(prefix, manifest)
  _check_extra(target, shapes, prefix, allow_extra)
  kinds = _check_against(
    entries, shapes, dtypes, manifest, prefix, convert_dtypes
  )
  show = _convert.show_progress(progress, len(entries))
  shardings = []
  for e in entries:
    sharding = target_sharding(e, mesh, rules)
    if jax.process_count() > 1:
      _selection.check_spans_processes(e.name, sharding)
    shardings.append(sharding)
  _output.announce(show, f'reading {len(entries)} variables from {prefix}')
  with (
    _translated(prefix),
    _output.progress(
      show=show,
      total=len(entries),
      description='flax_dtensor: restoring',
      unit='var',
    ) as advance,
  ):
    arrays = _host_read.read_placed(
      prefix, entries, kinds, shardings, manifest, advance
    )
  return arrays
