"""Reading checkpoints back: into host memory, or sharded into NNX models.

Before TensorFlow reads anything, the files are checked against the
manifest (where they are, sizes, and the CRCs of all but the data files)
and TF's index against its records (keys, shapes, dtypes); after reading,
every byte read, by the saved shards' CRCs, so each byte is read once. So a
damaged or foreign checkpoint is refused in our own words, and never breaks
TF for the checkpoints that follow. A checkpoint without a manifest (written
by plain TF) is read as it is, with no dtype conversion unless asked for.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import jax
import numpy as np

from flax_dtensor import _errors, _output
from flax_dtensor._placement import _sources, _variables
from flax_dtensor.dtensor import _processes, _tf, _tf_errors
from flax_dtensor.dtensor._checkpoints import _checkpoint
from flax_dtensor.dtensor._conversion import (
  _convert,
  _names,
  _selection,
  _target,
)
from flax_dtensor.dtensor._format import (
  _checksums,
  _decode,
  _model,
  _paths,
  _verify,
)
from flax_dtensor.dtensor._layout import _dtypes
from flax_dtensor.dtensor._storage import _background, _host_read, _recovery

A = TypeVar('A')

_READ_FIX = (
  'Check that the path is a checkpoint written by save_checkpoint (or a TF '
  'checkpoint prefix) and readable.'
)


# Finding and checking a checkpoint
# ------------------------------------------------------------------------------


def _no_checkpoint(path: str) -> _errors.ExportError:
  return _errors.ExportNotFoundError(
    f'Expected a checkpoint directory written by save_checkpoint, a '
    f'SavedModel directory, or a TF checkpoint prefix; got {path!r}, which '
    'holds no TF checkpoint. Pass the directory save_checkpoint returned.'
  )


def locate(path: str) -> tuple[str, _model.Manifest | None]:
  """(TF checkpoint prefix, its manifest or None) for a path.

  A checkpoint is read without its manifest only if one opened directory
  holds its index and no manifest (`_plain_at_once`): an export being
  replaced (renamed away and back) has no manifest for an instant, and must
  not be read then as a plain TF checkpoint, unchecked.

  Raises:
    ExportNotFoundError: If `path` holds no checkpoint.
    MalformedExportError: If its manifest is invalid, or its checkpoint
      state file names a prefix outside it.
    DamagedExportError: If the index its state file names is missing.
    SaveInProgressError: If its manifest keeps coming and going (another
      process replaces it).
  """
  for _ in range(_LOCATE_TRIES):
    prefix, manifest = _locate_once(path)
    if manifest is not None or _plain_at_once(path, prefix):
      return prefix, manifest
  raise _errors.SaveInProgressError(
    f'The checkpoint at {path!r} kept changing while it was located: its '
    f'manifest came and went {_LOCATE_TRIES} times. Expected the export '
    'to stay in place while it is read; another process may be replacing '
    'it. Retry once that write is done.'
  )


_LOCATE_TRIES = 3


def _plain_at_once(path: str, prefix: str) -> bool:
  """Whether `path` holds `prefix`'s index and no manifest at one instant.

  A directory is opened and both are looked up in that one directory, so
  an export renamed away and back between two lookups cannot pass for a
  plain TF checkpoint. (A prefix, or a system without `dir_fd`, is looked
  up twice by name.)
  """
  if not (os.path.isdir(path) and os.stat in os.supports_dir_fd):
    return _decode.locate(path) is None and os.path.exists(prefix + '.index')
  try:
    fd = os.open(path, os.O_RDONLY | getattr(os, 'O_DIRECTORY', 0))
  except OSError:
    return False  # Gone again: look once more.

  def there(name: str) -> bool:
    try:
      os.stat(name, dir_fd=fd)
    except OSError:
      return False
    return True

  try:
    return there(os.path.relpath(prefix, path) + '.index') and not (
      there(_model.FILE)
      or there(os.path.join(_model.SAVED_MODEL_ASSETS, _model.FILE))
    )
  finally:
    os.close(fd)


def _locate_once(path: str) -> tuple[str, _model.Manifest | None]:
  manifest = _decode.read(path)
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
      # Not `latest_checkpoint`, which logs an error of its own when the
      # prefix has no files: the check below refuses that in our words.
      state = tf.train.get_checkpoint_state(path)
    prefix = state.model_checkpoint_path if state is not None else None
    if prefix:
      _check_state_prefix(path, prefix)
      if os.path.exists(prefix + '.index'):
        return prefix, None
      raise _errors.DamagedExportError(
        f'Expected a TF checkpoint in {path!r}: its checkpoint state file '
        f'names the prefix {os.path.relpath(prefix, path)!r}, but '
        f'{os.path.basename(prefix)}.index is not there. The checkpoint is '
        'incomplete: restore it from an intact copy, or re-export it.'
      )
  elif os.path.exists(path + '.index'):
    return path, None
  raise _no_checkpoint(path)


def _check_state_prefix(directory: str, prefix: str) -> None:
  """Refuses a `checkpoint` state file naming a prefix outside `directory`."""
  escape = _paths.escape_problem(directory, os.path.relpath(prefix, directory))
  if escape is not None:
    raise _errors.MalformedExportError(
      f'The checkpoint state file of {directory!r} names the prefix '
      f'{prefix!r}, and {escape}. A checkpoint directory is read only '
      'inside itself: if you trust that checkpoint, pass its prefix itself.'
    )


def _identity(prefix: str) -> tuple[tuple[str, int, int, int, int], ...]:
  """Which files hold the checkpoint at `prefix` now (inode, size, mtime)."""
  directory, base = os.path.split(prefix)
  out = []
  with contextlib.suppress(OSError):
    for name in sorted(os.listdir(directory or '.')):
      if name == base + '.index' or name.startswith(base + '.data-'):
        with contextlib.suppress(OSError):
          st = os.stat(os.path.join(directory, name))
          out.append((name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
  return tuple(out)


@contextlib.contextmanager
def _damage_named(manifest: _model.Manifest | None) -> Iterator[None]:
  """A read TF fails names the damaged files and bytes, when it can.

  The data files are checked as they are read, so when TF fails there (its
  checksum, a short read), the whole check of every file follows, and its
  findings replace TF's words. (A shard our own CRC refused is named
  already.)
  """
  try:
    yield
  except _errors.ExportError as e:
    if manifest is None or not isinstance(e.__cause__, _tf.tf().errors.OpError):
      raise
    with concurrent.futures.ThreadPoolExecutor(_checksums.THREADS) as pool:
      problems = _verify.problems_of(manifest, pool)
    if not problems:
      raise
    raise _verify.damaged(manifest, problems, read=True) from e


def _plain_identity(
  prefix: str, manifest: _model.Manifest | None
) -> tuple[Any, ...] | None:
  """`_identity` of a plain TF checkpoint; None with a manifest.

  A checkpoint with a manifest needs no such check: every byte read is
  checked against its CRCs.
  """
  return _identity(prefix) if manifest is None else None


def _check_unchanged(prefix: str, before: tuple[Any, ...] | None) -> None:
  """Refuses a plain TF checkpoint whose files changed while it was read."""
  if before is not None and _identity(prefix) != before:
    raise _errors.SaveInProgressError(
      f'The checkpoint {prefix!r} changed while it was read (its files are '
      'not the ones it had when the read began), so what was read may mix '
      'two versions. Nothing was restored: the target is unchanged. '
      'Expected the checkpoint to stay in place while it is read; retry '
      'once the process replacing it is done.'
    )


def _reader(prefix: str, manifest: _model.Manifest | None) -> Any:
  """TF's checkpoint reader, once the files and index check out.

  Every file but the data files is checked whole (where it is, its size,
  its CRCs) before TF opens any; the data files' sizes too, and their bytes
  as they are read (TF's CRC-32C of each entry, the manifest's checksum of
  each saved shard), so no byte is read twice.
  """
  tf = _tf.tf()
  if manifest is not None:
    with concurrent.futures.ThreadPoolExecutor(_checksums.THREADS) as pool:
      _verify.verify_files(manifest, pool, data=False)
  with _tf_errors.translated(
    'Reading the index of the checkpoint',
    prefix,
    'The checkpoint is damaged or not a TF checkpoint: restore it from an '
    'intact copy, or re-export it.',
    tf_kind=_errors.DamagedExportError,
  ):
    reader = tf.train.load_checkpoint(prefix)
    shapes = reader.get_variable_to_shape_map()
    dtypes = reader.get_variable_to_dtype_map()
  if manifest is not None:
    _verify.verify_index(manifest, shapes, dtypes)
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
    ExportNotFoundError: If `directory` holds no TF checkpoint.
    DamagedExportError: If it is damaged: a file changed, truncated or
      missing, or bytes read back differ from their recorded CRC-32.
    MalformedExportError: If its manifest is invalid, names a file outside
      the export, or disagrees with TF's index.
    SaveInProgressError: If another save to it is in progress, or it
      changed during the read.
    PeerError: If another process of the run stopped or failed.
    ExportError: If TensorFlow fails to read it otherwise.

  Example:
    >>> arrays = read_checkpoint('/tmp/ckpt')  # doctest: +SKIP
    >>> arrays[('linear', 'kernel')].shape  # doctest: +SKIP
    (16, 32)
  """
  path = _paths.local(directory, 'checkpoint directory')
  _background.wait_for(path)  # A save of this process to it finishes first.
  with _processes.session(f'the read of {path!r}', 'Nothing was returned.'):
    _recovery.recover_for_reading(path, is_export=_decode.is_export)
  prefix, manifest = locate(path)
  before = _plain_identity(prefix, manifest)
  with _tf.cpp_noise_dropped():  # A damaged file's failed op logs first.
    out = _read_whole(prefix, manifest)
  _check_unchanged(prefix, before)
  return _names.PathDict(
    sorted(
      out.items(),
      key=lambda kv: _variables.natural_key(_names.path_text(kv[0])),
    )
  )


def _read_whole(
  prefix: str, manifest: _model.Manifest | None
) -> dict[_names.Path, np.ndarray]:
  """Every variable of the checkpoint at `prefix`, whole, on the host."""
  reader, shapes, _ = _reader(prefix, manifest)
  records = manifest.by_key if manifest is not None else {}
  out = {}
  with (
    _damage_named(manifest),
    _tf_errors.translated('Reading the checkpoint', prefix, _READ_FIX),
  ):
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
        _verify.verify_read(
          manifest, record, {tuple((0, n) for n in value.shape): value}
        )
      out[nnx_path] = value
  return out


# restore_checkpoint
# ------------------------------------------------------------------------------


def _held(
  shapes: Any, dtypes: Any, manifest: _model.Manifest | None
) -> dict[_names.Path, _sources.Held]:
  """What the checkpoint holds, by NNX path (its other keys left out).

  The dtype a variable was saved with is the manifest's; without one, the
  dtype the checkpoint holds.
  """
  records = manifest.by_key if manifest is not None else {}
  out = {}
  for key, shape in shapes.items():
    path = _names.nnx_path(key)
    if path is None:
      continue
    stored = np.dtype(dtypes[key].as_numpy_dtype)
    record = records.get(key)
    if record is not None:
      saved = _dtypes.from_name(record.dtype, manifest.where)
      note = f'saved as {saved}, stored as {stored}'
    else:
      saved = stored
      note = f'holds {stored}, and it has no manifest saying otherwise'
    out[path] = _sources.Held(tuple(shape), stored, saved, note)
  return out


@contextlib.contextmanager
def _translated(path: str) -> Iterator[None]:
  with _tf_errors.translated('Restoring from', path, _READ_FIX):
    yield


@_target.takes_restore_options
def restore_checkpoint(
  directory: str | os.PathLike[str],
  target: A,
  options: _target.RestoreOptions,
) -> A:
  """Restores NNX variables from a checkpoint, sharded as the target says.

  Each process reads with TensorFlow's own checkpoint reader (plain TF ops
  on the host; DTensor need not be initialized) the saved shards that meet
  the slices its devices hold under the target's sharding, whatever the
  saved layout, and cuts its slices from them; so no host gathers a model
  sharded over processes (onto another layout, a process may read more of
  a variable than it holds). JAX places one variable while TF reads the
  next. Before TensorFlow reads anything, the files are checked against the
  manifest (the data files by size); after, every byte read, before it is
  placed (so a file damaged
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
  rules, a variable annotated with the mesh's own axes is placed by them
  (as Flax places it); any other variable keeps its value's own sharding
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
    ExportNotFoundError: If `directory` holds no checkpoint.
    DamagedExportError: If it is damaged (a file changed, truncated or
      missing; bytes read back differ from their CRC-32).
    MalformedExportError: If its manifest is invalid, names a file outside
      the export, or disagrees with TF's index.
    SaveInProgressError: If another save to it is in progress, or its
      files change during the restore.
    PeerError: If another process of the run stopped or failed.
    ExportError: If the checkpoint lacks a selected variable, holds one the
      target lacks, holds it with another shape or dtype, an abstract
      target would keep abstract variables, an abstract sharding has no
      concrete mesh, or TensorFlow fails to read. Each of the above is an
      ExportError too. The target is then unchanged.
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
  entries = options.entries(target)
  with _processes.session(
    f'the restore from {path!r}', 'The target was not changed.'
  ):
    arrays = _read_all(path, target, entries, options)
    # Every process has its part, or none changes its target.
    _processes.sync('restored')
  return _target.fill(target, entries, arrays, options.rng_seed)


# A damaged file fails a TF op, which logs to stderr before our error.
@_tf.cpp_noise_dropped()
def _read_all(
  path: str,
  target: Any,
  entries: Sequence[_selection.Entry],
  options: _target.RestoreOptions,
) -> list[jax.Array]:
  """The restore's reading: checks, then every entry read and placed."""
  _background.wait_for(path)  # A save of this process to it finishes first.
  _recovery.recover_for_reading(path, is_export=_decode.is_export)
  prefix, manifest = locate(path)
  before = _plain_identity(prefix, manifest)
  _, shapes, dtypes = _reader(prefix, manifest)
  held = _held(shapes, dtypes, manifest)
  source = _sources.Source(
    f'The checkpoint {prefix!r}', 'a checkpoint', 'saved', keys=True
  )
  extra = _sources.check_extra(target, held, source, options.allow_extra)
  kinds = [
    (h.stored, h.saved)
    for h in _sources.check_held(
      entries, held, source, options.convert_dtypes, extra=extra
    )
  ]
  show = _convert.show_progress(options.progress, len(entries))
  shardings = _target.target_shardings(
    entries, options.mesh, options.rules_in_effect()
  )
  _output.announce(show, f'reading {len(entries)} variables from {prefix}')
  with (
    _damage_named(manifest),
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
  _check_unchanged(prefix, before)
  return arrays
