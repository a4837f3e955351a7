"""Writing checkpoints: NNX variables as a TF checkpoint of DTensor variables.

`save_checkpoint` writes, atomically (`_atomic`), each distinct shard once
with TF's plain SaveV2 on the host (`_host_write`: no DTensor op, no
collective), with the object graph ``tf.train.Checkpoint`` needs; in a
multi-process run each process writes a bundle of its own and process 0
merges them (`merge`). The manifest (`_format._encode`) comes last, with a
CRC-32C of every shard and of every file chunk (a data file's hashed from
the bytes handed to TF, while it writes them). A blocking save
hands TF the JAX buffers themselves; a background save (`blocking=False`)
copies them to host memory first and writes on a thread of its own.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Unpack, overload

import jax
from flax import nnx
from flax.nnx import filterlib

from flax_dtensor import _output
from flax_dtensor.dtensor import _processes, _tf, _tf_errors
from flax_dtensor.dtensor._conversion import (
  _convert,
  _names,
  _selection,
  _single_mesh,
)
from flax_dtensor.dtensor._format import (
  _checksums,
  _decode,
  _encode,
  _model,
  _paths,
)
from flax_dtensor.dtensor._layout import _layouts
from flax_dtensor.dtensor._storage import (
  _atomic,
  _background,
  _host_write,
  _temporaries,
)

# The checkpoint prefix inside a `save_checkpoint` directory.
PREFIX = 'ckpt'
# Scratch directory for the per-mesh partial checkpoints (removed after use).
_SCRATCH = '.parts'
_PART = 'flax_dtensor.part-{}.json'
WRITE_FIX = (
  'Check the disk space, the permissions and the path (on several hosts: a '
  'filesystem every process sees).'
)


def _object_graph(entries: Sequence[_selection.Entry], scratch: str) -> Any:
  """The checkpoint's object graph, as a TF string tensor.

  `tf.train.Checkpoint` records how the variables hang off the root (the
  `_CHECKPOINTABLE_OBJECT_GRAPH` key), which its `read` needs. The graph of a
  module of placeholder scalars with the same structure and names is the
  same, so it is taken from one, written under `scratch` (then removed).
  The last few are kept by their paths: saving one model again costs
  nothing.
  """
  paths = tuple(e.path for e in entries)
  graph = _graphs.get(paths)
  if graph is None:
    tf = _tf.tf()
    skeleton = _convert.make_module(
      (e.path, tf.Variable(False, name=_names.variable_name(e.path)))
      for e in entries
    )
    os.makedirs(scratch, exist_ok=True)
    written = tf.train.Checkpoint(skeleton).write(
      os.path.join(scratch, 'skeleton')
    )
    graph = tf.train.load_checkpoint(written).get_tensor(
      _names.OBJECT_GRAPH_KEY
    )
    shutil.rmtree(scratch, ignore_errors=True)
    with _graphs_lock:
      _graphs[paths] = graph
      while len(_graphs) > _GRAPHS_KEPT:
        del _graphs[next(iter(_graphs))]
  return _tf.tf().constant(graph)


_GRAPHS_KEPT = 4
_graphs: dict[tuple[Any, ...], bytes] = {}
_graphs_lock = threading.Lock()


def _write_object_graph(
  entries: Sequence[_selection.Entry], directory: str
) -> str:
  """Writes the object graph as a bundle of its own; the prefix written."""
  tf = _tf.tf()
  prefix = os.path.join(directory, 'object_graph')
  graph = _object_graph(entries, os.path.join(directory, 'skeleton'))
  with tf.device('/CPU:0'):
    tf.raw_ops.SaveV2(
      prefix=prefix,
      tensor_names=[_names.OBJECT_GRAPH_KEY],
      shape_and_slices=[''],
      tensors=[graph],
    )
  return prefix


def merge(
  entries: Sequence[_selection.Entry],
  prefixes: Sequence[str],
  directory: str,
  streams: Sequence[_checksums.StreamSum | None] = (),
) -> dict[str, _checksums.StreamSum]:
  """Merges TF bundles into `directory/ckpt.*` (process 0, alone).

  Adds the object graph and the ``checkpoint`` state file; removes the
  bundles and the scratch directory. TF renames each bundle's data file
  (one each) to the checkpoint's data file of its place among `prefixes`,
  the object graph's last: returns {that name: its stream}, of the
  `streams` given per bundle.
  """
  tf = _tf.tf()
  scratch = os.path.join(directory, _SCRATCH)
  os.makedirs(scratch, exist_ok=True)
  tf.raw_ops.MergeV2Checkpoints(
    checkpoint_prefixes=[*prefixes, _write_object_graph(entries, scratch)],
    destination_prefix=os.path.join(directory, PREFIX),
    delete_old_dirs=True,
  )
  shutil.rmtree(scratch, ignore_errors=True)
  _write_state_file(directory)
  count = len(prefixes) + 1
  return {
    f'{PREFIX}.data-{k:05d}-of-{count:05d}': stream
    for k, stream in enumerate(streams)
    if stream is not None
  }


def _write_state_file(directory: str) -> None:
  # `tf.train.load_checkpoint(directory)` and `latest_checkpoint` need
  # it; relative, since the directory is renamed after writing.
  with open(os.path.join(directory, 'checkpoint'), 'w') as f:
    f.write(
      f'model_checkpoint_path: "{PREFIX}"\n'
      f'all_model_checkpoint_paths: "{PREFIX}"\n'
    )


def records(
  entries: Sequence[_selection.Entry],
  shardings: Sequence[jax.sharding.Sharding],
  layouts: Sequence[Any],
  shards: Sequence[Sequence[tuple[Any, int]]],
) -> tuple[_model.Record, ...]:
  """The manifest's variable records (each array's sharding and layout).

  `shards` lists, per variable, every distinct shard's (slice, checksum).
  """
  out = []
  for e, sharding, layout, s in zip(
    entries, shardings, layouts, shards, strict=True
  ):
    record = _encode.sharding_record(sharding, layout, len(e.shape))
    out.append(
      _model.Record(
        path=e.path,
        key=e.key,
        type=type(e.variable).__name__,
        dtype=e.dtype.name,
        stored_dtype=e.stored_dtype.name,
        shape=tuple(e.shape),
        key_impl=e.key_impl,
        sharding=record,
        shards=_encode.shard_grid(record, tuple(e.shape), s),
      )
    )
  return tuple(out)


def gather_shards(
  mine: _host_write.Written, directory: str
) -> _host_write.Written | None:
  """Every process's shard checksums and TF bundles, on process 0.

  `mine` is what this process wrote. Each process writes it to a part file
  in the (shared) export directory; process 0 reads them all after a
  barrier and returns them merged, its bundles in process order (None on
  the others).
  """
  if jax.process_count() == 1:
    return mine
  path = os.path.join(directory, _PART.format(jax.process_index()))
  with open(path, 'w') as f:
    json.dump(
      {
        'shards': [
          [[list(map(list, i)), c] for i, c in v] for v in mine.shards
        ],
        'bundles': [os.path.relpath(b, directory) for b in mine.bundles],
        'streams': [None if s is None else s.to_json() for s in mine.streams],
      },
      f,
    )
  _processes.sync('manifest-parts')
  if jax.process_index() != 0:
    return None
  merged: list[dict[Any, int]] = [{} for _ in mine.shards]
  written, streams = [], []
  for p in range(jax.process_count()):
    part = os.path.join(directory, _PART.format(p))
    with open(part) as f:
      raw = json.load(f)
    for i, shards in enumerate(raw['shards']):
      for index, crc in shards:
        merged[i][tuple(tuple(d) for d in index)] = crc
    written += [os.path.join(directory, b) for b in raw['bundles']]
    streams += [
      None if s is None else _checksums.StreamSum.from_json(s)
      for s in raw['streams']
    ]
    os.remove(part)
  return _host_write.Written(
    [sorted(m.items()) for m in merged], written, streams
  )


def write_manifest(
  root: str,
  kind: str,
  prefix: str,
  recs: tuple[_model.Record, ...],
  pool: concurrent.futures.Executor,
  signatures: Mapping[str, _model.Signature] | None = None,
  written: Mapping[str, _checksums.StreamSum] | None = None,
) -> None:
  """Hashes every file under `root` and writes the manifest (process 0).

  The files in `written` (by name) were hashed as they were written: only
  what TF added past those bytes is read (`_checksums.file_sums`).
  """
  names = [
    n
    for n in _encode.files_under(root)
    if os.path.basename(n) != _temporaries.MARKER
  ]
  manifest = _model.Manifest(
    kind=kind,
    version=_model.VERSION,
    root=root,
    prefix=prefix,
    files=_checksums.file_sums(root, names, pool, written),
    records=recs,
    signatures=signatures or {},
  )
  _encode.write(manifest)


class _SaveKeywords(_convert.ExportKeywords, total=False):
  """The keywords the overloads of `save_checkpoint` share (`**options`)."""

  overwrite: bool


@overload
def save_checkpoint(
  module_or_state: Any,
  directory: str | os.PathLike[str],
  *,
  single_mesh: Literal[False] = False,
  blocking: Literal[True] = True,
  **options: Unpack[_SaveKeywords],
) -> str: ...


@overload
def save_checkpoint(
  module_or_state: Any,
  directory: str | os.PathLike[str],
  *,
  single_mesh: Literal[True],
  blocking: Literal[True] = True,
  **options: Unpack[_SaveKeywords],
) -> tuple[str, _single_mesh.SingleMeshReport]: ...


@overload
def save_checkpoint(
  module_or_state: Any,
  directory: str | os.PathLike[str],
  *,
  single_mesh: bool = False,
  blocking: Literal[False],
  **options: Unpack[_SaveKeywords],
) -> _background.SaveHandle: ...


def save_checkpoint(
  module_or_state: Any,
  directory: str | os.PathLike[str],
  *,
  include: filterlib.Filter = ...,
  exclude: filterlib.Filter = nnx.RngState,
  overwrite: bool = False,
  progress: bool | None = None,
  single_mesh: bool = False,
  blocking: bool = True,
) -> str | tuple[str, _single_mesh.SingleMeshReport] | _background.SaveHandle:
  """Writes NNX variables as a TF checkpoint of DTensor variables.

  Each distinct shard is written once, by one process holding it, with
  TF's plain SaveV2 on the host reading the JAX buffers themselves: nothing
  is gathered, nothing is copied but the dtypes stored widened, and no
  DTensor op or collective runs. The result is an ordinary
  `tf.train.Checkpoint`:
  plain single-process TensorFlow reads it with
  `tf.train.load_checkpoint(directory)`, without DTensor, under the keys of
  `checkpoint_key` (float16, float8, uint16 and uint32 stored widened). Next
  to it, `flax_dtensor.json` records every variable's exact path, dtype,
  shape, layout and a CRC-32C of each shard, and of every file, so
  that `restore_checkpoint` and `read_checkpoint` can check what they read.
  By default every variable but RNG state is saved.

  The directory appears atomically, complete or not at all, even if the
  process is killed or the disk is full: a later save or restore at the
  same path finishes or undoes an interrupted overwrite and removes what a
  dead writer left. `overwrite=True` replaces only an export of this
  package (or an empty directory). A place this process cannot write is
  refused before anything is written.

  With `single_mesh=True` every variable is written from the one DTensor
  mesh mirroring the JAX mesh, as `to_tf_module(..., single_mesh=True)`
  lays them out (JAX first moves what that mesh cannot express), so that
  TF programs restoring it with `tf.train.Checkpoint(...).read` into
  variables on one mesh find one layout. The manifest records the layouts
  written; `restore_checkpoint` places by the target, as always.

  With `blocking=False` this returns a `SaveHandle` once the state is
  copied to host memory: each process copies the saved shards it writes
  (each distinct shard is written by one process holding it), and the
  caller may then overwrite or donate its arrays; the checkpoint holds the
  values of the call. Writing, checking, flushing, the barriers between
  processes and process 0's final rename run on a thread of their own,
  without device collectives (TF's plain SaveV2 on the host; process 0
  merges the processes' files), and write the same checkpoint a blocking
  save writes; `handle.wait()` raises what a blocking save would. A path
  that cannot be written, an existing directory without `overwrite` and an
  empty selection are still refused at the call. A save or restore of a
  path waits for this process's pending save to the same path, and the
  interpreter waits for pending saves at exit.

  In a multi-process run every process must call this with the same
  arguments (docs/export_multi_process.md has the recipe). If another
  process dies or hangs, this (or, with `blocking=False`, `wait()`) raises
  within `FLAX_DTENSOR_PEER_TIMEOUT` seconds (60 by default) of its last
  heartbeat, naming it.

  Args:
    module_or_state: An NNX module, graph node (`nnx.Optimizer`) or
      `nnx.State` holding concrete, sharded `jax.Array`s.
    directory: The checkpoint directory to create: a local path (or a
      locally mounted network filesystem), created with any missing
      parents.
    include: NNX filter of the variables to save (default: every variable;
      e.g. `nnx.Param` for the parameters only, `nnx.OptState` for an
      `nnx.Optimizer`'s state).
    exclude: NNX filter of variables to leave out (default: RNG state).
    overwrite: Replace `directory` if it is an export of this package.
    progress: Say on stderr what is written, and how long it took (one TF
      op writes every shard, so there is no bar to advance); None says it
      from 16 variables when stderr is a terminal.
    single_mesh: Write every variable from one DTensor mesh (see above).
    blocking: Return once the checkpoint is complete on disk (the default);
      if false, once the state is copied, with a `SaveHandle`.

  Returns:
    The absolute path of the checkpoint directory; with `single_mesh=True`,
    the pair `(path, report)`, where the `SingleMeshReport` lists each
    variable JAX moved and why. With `blocking=False`, a `SaveHandle`
    whose `result()` is that value.

  Raises:
    DTensorInitializationError: If `flax_dtensor.dtensor.initialize()` was
      not called.
    NotAModelError: If `module_or_state` is not an NNX module or state.
    ExportError: If `directory` is a URL, exists and `overwrite` is false,
      is not an export of this package (or one this user may not delete),
      a missing parent cannot be created, no variable is
      selected, a variable cannot be exported (e.g. uint64), or writing
      fails (the message names the cause and the fix). Each error below is
      an ExportError too; with `blocking=False`, errors found while writing
      are raised by the handle's `wait()` and `result()`.
    DiskFullError: If the disk is full or a quota or file-size limit is
      reached (the message gives the bytes needed and free); the previous
      checkpoint is unchanged.
    SaveInProgressError: If another process is saving to `directory`.
    PeerError: If another process of the run stopped or failed.

  Example:
    >>> path = save_checkpoint(model, '/tmp/ckpt')  # doctest: +SKIP
    >>> tf.train.load_checkpoint(path).get_tensor(  # doctest: +SKIP
    ...   checkpoint_key('linear/kernel'))
  """
  directory = _paths.local(directory, 'checkpoint directory')
  entries = _selection.select(
    module_or_state, include, exclude, what='module_or_state'
  )
  _background.wait_for(directory)
  show = _convert.show_progress(progress, len(entries))
  nbytes = sum(e.nbytes for e in entries)
  what = f'the save to {directory!r}'
  aftermath = (
    f'{directory!r} holds the previous checkpoint or the new one, whole.'
  )
  if not blocking:
    return _save_in_background(
      entries,
      directory,
      _processes.begin(what, aftermath),
      overwrite=overwrite,
      single_mesh=single_mesh,
      show=show,
    )
  with (
    _tf_errors.space_checked(directory, nbytes),
    _processes.session(what, aftermath),
    _tf_errors.translated('Writing the checkpoint', directory, WRITE_FIX),
  ):
    values, report = _arrays_to_save(entries, single_mesh)
    shardings = [v.sharding for v in values]
    layouts = [_layouts.layout_for(v.sharding, v.ndim) for v in values]
    with (
      _atomic.atomic_directory(
        directory, overwrite=overwrite, is_export=_decode.is_export
      ) as tmp,
      concurrent.futures.ThreadPoolExecutor(_checksums.THREADS) as pool,
    ):
      # TF reads the JAX buffers themselves: `values` stay alive meanwhile.
      pieces = _host_write.hand_over(entries, values)
      _write_merged(
        entries, pieces, shardings, layouts, tmp, directory, show, pool
      )
  return (directory, report) if single_mesh else directory


def _arrays_to_save(
  entries: Sequence[_selection.Entry], single_mesh: bool
) -> tuple[list[jax.Array], _single_mesh.SingleMeshReport | None]:
  """The arrays to write (moved onto one mesh if asked), and the report."""
  values = [_selection.to_jax_array(e) for e in entries]
  if not single_mesh:
    return values, None
  return _single_mesh.onto_one_mesh(entries, values)


def _save_in_background(
  entries: list[_selection.Entry],
  directory: str,
  session: _processes.Session | None,
  *,
  overwrite: bool,
  single_mesh: bool,
  show: bool,
) -> _background.SaveHandle:
  """`save_checkpoint(..., blocking=False)`: the copy here, the rest later.

  On the caller's thread: the arrays, the temporary directory (so that a
  path that cannot be written is refused at the call), this process's
  shards copied to host memory (`_host_write`) and the layouts for the
  manifest. On the save's own thread, which continues `session`: every
  process writes and hashes its shards, process 0 merges them, writes the
  manifest and moves the result into place (`_write_merged`).
  """
  stack = contextlib.ExitStack()
  with _processes.joined(session, last=False):
    with _tf_errors.translated('Copying the state', directory, WRITE_FIX):
      values, report = _arrays_to_save(entries, single_mesh)
    # Before the copy: the processes meet here once, then each copies at
    # its own pace.
    tmp = stack.enter_context(
      _atomic.atomic_directory(
        directory, overwrite=overwrite, is_export=_decode.is_export
      )
    )
    try:
      with _tf_errors.translated('Copying the state', directory, WRITE_FIX):
        pieces = _host_write.snapshot(entries, values)
        shardings = [v.sharding for v in values]
        layouts = [_layouts.layout_for(v.sharding, v.ndim) for v in values]
        del values  # The caller's arrays: not kept alive by the save.
    except BaseException as e:
      stack.__exit__(type(e), e, e.__traceback__)  # Removes the temporary.
      raise
  # The copies go to the writing thread, which drops them once written.
  copies = [pieces]
  del pieces

  def work(pool: concurrent.futures.Executor) -> Any:
    with (
      _processes.joined(session),
      _tf_errors.space_checked(directory, sum(e.nbytes for e in entries)),
      _tf_errors.translated('Writing the checkpoint', directory, WRITE_FIX),
      stack,
    ):
      # No process writes before every one has copied its shards: on a
      # host that runs several, the writes of the first to finish would
      # take the cores the copies of the others (their callers) wait on.
      _processes.sync('copied')
      _write_merged(
        entries, copies.pop(), shardings, layouts, tmp, directory, show, pool
      )
    return (directory, report) if single_mesh else directory

  try:
    return _background.start(directory, work, pools=(_checksums.THREADS,))
  except BaseException as e:
    if session is not None:  # Tells the others, and leaves.
      session.fail(e)
      session.leave()
    stack.__exit__(type(e), e, e.__traceback__)  # Removes the temporary.
    raise


def _write_merged(
  entries: Sequence[_selection.Entry],
  pieces: list[_host_write.Piece],
  shardings: Sequence[jax.sharding.Sharding],
  layouts: Sequence[Any],
  tmp: str,
  directory: str,
  show: bool,
  pool: concurrent.futures.Executor,
) -> None:
  """Writes the checkpoint and its manifest into the temporary `tmp`.

  One process writes its shards straight into the checkpoint, with the
  object graph, or, from twice `_host_write.PART_BYTES`, as several TF
  bundles at once that it merges; then it hashes the files for the
  manifest while the disk flushes them. Several processes write their
  bundles (flushed before they meet), and process 0 merges every bundle
  into the checkpoint and writes the manifest. `pool` hashes while TF
  writes; `pieces` are dropped once written.
  """
  nbytes = sum(e.nbytes for e in entries)
  _output.announce(
    show, f'writing {len(entries)} variables ({nbytes / 2**20:.1f} MiB)'
  )
  start = time.perf_counter()

  def manifest(
    done: _host_write.Written, streams: Mapping[str, _checksums.StreamSum]
  ) -> None:
    """The manifest of the written shards, last (process 0)."""
    records_ = records(entries, shardings, layouts, done.shards)
    write_manifest(
      tmp, _model.CHECKPOINT_FORMAT, PREFIX, records_, pool, written=streams
    )

  # `pool` has `_checksums.THREADS` threads (both callers start it so).
  count = _host_write.parts(pieces, _checksums.THREADS)
  scratch = os.path.join(tmp, _SCRATCH)
  if jax.process_count() == 1:
    if count == 1:  # One bundle: the checkpoint itself, with the graph.
      graph = _object_graph(entries, scratch)
      done = _host_write.write(
        entries,
        pieces,
        os.path.join(tmp, PREFIX),
        pool,
        {_names.OBJECT_GRAPH_KEY: graph},
      )
      pieces.clear()
      _write_state_file(tmp)
      streams = {
        os.path.relpath(_host_write.data_file(b), tmp): s
        for b, s in zip(done.bundles, done.streams, strict=True)
        if s is not None
      }
    else:  # Several at once, merged (renamed: no byte copied).
      os.makedirs(scratch, exist_ok=True)
      done = _host_write.write_parts(
        entries, pieces, os.path.join(scratch, 'part'), pool, count
      )
      pieces.clear()
      streams = merge(entries, done.bundles, tmp, done.streams)
    # The disk flushes what TF wrote while the manifest is made (only TF's
    # index and the object graph are read back, from the page cache); the
    # directory's final flush then finds little to do. On one of `pool`'s
    # threads: a background save at the interpreter's exit may start no
    # thread (Python 3.12).
    flushed = pool.submit(_temporaries.flush_files, tmp)
    try:
      manifest(done, streams)
    finally:
      concurrent.futures.wait([flushed])  # Done with `tmp`, whatever happened.
    flushed.result()
  else:
    os.makedirs(scratch, exist_ok=True)
    prefix = os.path.join(scratch, f'process{jax.process_index()}')
    done = _host_write.write_parts(entries, pieces, prefix, pool, count)
    pieces.clear()  # On disk: host copies go.
    _host_write.flush(done.bundles)
    gathered = gather_shards(done, tmp)
    if gathered is not None:
      streams = merge(entries, gathered.bundles, tmp, gathered.streams)
      manifest(gathered, streams)
  _output.announce(
    show, f'wrote {directory} in {time.perf_counter() - start:.1f}s'
  )
