"""A SavedModel exported again with new weights, without a new trace.

A training loop that exports every N steps exports the same model with
other values. What a SavedModel holds besides the variables (the traced
and converted forward in ``saved_model.pb``, the assets, the variables'
object graph) depends on the model's structure, its variables' shapes,
dtypes and shardings, the constants baked in and the signatures, not on
the variables' values. So the first export is remembered (`remember`) by a
`key` of all that (and of what the trace reads from its context: the mesh
and rules set, JAX's configuration), and an export with the same key (`lookup`) is written
(`write`) as those files plus the new variables, which the host writer
(`_host_write`) puts in the bundle under the same keys as TF did, with
the same object graph; TF's fingerprint is computed again, and the
manifest hashes the new files. Nothing is traced, converted or saved by
TF, so TF's saver is not retraced either. The last `KEPT` exports are
remembered, in memory, up to `MAX_BYTES` each (larger ones are exported
in full every time).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import os
import threading
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from flax_dtensor._rules import _context as _context_rules
from flax_dtensor._rules import _meshes
from flax_dtensor.dtensor import _tf
from flax_dtensor.dtensor._conversion import _names, _selection
from flax_dtensor.dtensor._format import _checksums, _model
from flax_dtensor.dtensor._serving import _serialization
from flax_dtensor.dtensor._storage import _host_write

KEPT = 4
MAX_BYTES = 256 * 2**20
_FINGERPRINT = 'fingerprint.pb'
_VARIABLES = 'variables'


@dataclasses.dataclass(frozen=True)
class Written:
  """What an export wrote besides its variables and manifest.

  Attributes:
    files: (path relative to the SavedModel, bytes) of each file.
    object_graph: The variables' checkpoint object graph (serialized).
    layouts: Each variable's DTensor layout, as the manifest records it.
    signatures: The signatures, as the manifest records them.
    keep: The objects the key names by identity (kept alive with it).
  """

  files: tuple[tuple[str, bytes], ...]
  object_graph: bytes
  layouts: tuple[Any, ...]
  signatures: Mapping[str, _model.Signature]
  keep: tuple[Any, ...]


_cache: collections.OrderedDict[Hashable, Written] = collections.OrderedDict()
_lock = threading.Lock()


def _sharding_key(value: jax.Array) -> Hashable | None:
  sharding = value.sharding
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return ('device', next(iter(sharding.device_set)).id)
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return None
  mesh = sharding.mesh
  return (
    tuple(sharding.spec),
    tuple(mesh.shape.items()),
    tuple(d.id for d in mesh.devices.flat),
    tuple(str(t) for t in getattr(mesh, 'axis_types', ())),
  )


def _digest(tree: Any) -> str | None:
  """A hash of the constants baked into the forward, or None if too big."""
  h = hashlib.sha256()
  total = 0
  leaves, treedef = jax.tree.flatten(tree)
  h.update(repr(treedef).encode())
  for leaf in leaves:
    if isinstance(leaf, jax.Array | np.ndarray | np.generic):
      if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        return None
      if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        h.update(str(jax.random.key_impl(leaf)).encode())
        leaf = jax.random.key_data(leaf)
      data = np.asarray(jax.device_get(leaf))
      total += data.nbytes
      if total > MAX_BYTES:
        return None
      h.update(f'{data.dtype}{data.shape}'.encode())
      h.update(np.ascontiguousarray(data).tobytes())
    else:
      h.update(repr(leaf).encode())
  return h.hexdigest()


def _context() -> Hashable:
  """What the trace reads besides its arguments: the mesh and rules in
  context, JAX's configuration, and the StableHLO TF reads."""
  abstract, concrete = _meshes.context_meshes()
  return (
    repr(abstract),
    None if concrete is None else tuple(d.id for d in concrete.devices.flat),
    repr(_context_rules.get_logical_axis_rules()),
    repr(sorted(jax.config.values.items())),
    _serialization.target_for_tf(),
    _serialization.calling_convention(),
  )


def clear() -> None:
  """Forgets every export: the next of each is traced anew."""
  with _lock:
    _cache.clear()


def key(
  graphdef: Any,
  entries: Sequence[_selection.Entry],
  values: Sequence[jax.Array],
  rest: Any,
  signatures: Mapping[str, Any],
  trainable: Any,
  platforms: Sequence[str] | None,
) -> tuple[Hashable, tuple[Any, ...]] | None:
  """The key of what an export writes besides the variables' values, and
  the objects it names by identity; None where that cannot be told.

  `signatures` maps each key to its `_signatures.ServingSignature`.
  """
  shardings = tuple(_sharding_key(v) for v in values)
  if any(s is None for s in shardings):
    return None
  digest = _digest(rest)
  if digest is None:
    return None
  try:
    structure: Hashable = (hash(graphdef), graphdef)
  except TypeError:  # Static attributes that are dicts or lists.
    structure = repr(graphdef)
  keep: list[Any] = [graphdef]
  served = []
  for name, s in signatures.items():
    functions = (s.preprocess, s.postprocess, *s.resources)
    keep.extend(functions)
    served.append(
      (
        name,
        s.method,
        repr(list(s.input_signature)),
        None if s.polymorphic_shapes is None else tuple(s.polymorphic_shapes),
        tuple(id(f) for f in functions),
      )
    )
  try:
    hash(trainable)
    filter_key: Hashable = trainable
  except TypeError:
    filter_key = repr(trainable)
  keep.append(trainable)
  return (
    structure,
    tuple((e.path, tuple(e.shape), str(e.dtype), e.key_impl) for e in entries),
    shardings,
    digest,
    tuple(served),
    filter_key,
    None if platforms is None else tuple(platforms),
    _context(),
  ), tuple(keep)


def lookup(k: Hashable) -> Written | None:
  with _lock:
    found = _cache.get(k)
    if found is not None:
      _cache.move_to_end(k)
    return found


def remember(
  k: Hashable,
  keep: tuple[Any, ...],
  directory: str,
  manifest: str,
  layouts: Sequence[Any],
  signatures: Mapping[str, _model.Signature],
) -> None:
  """Keeps what the export in `directory` wrote besides its variables, its
  fingerprint and its manifest (at `manifest`, relative)."""
  files, total = [], 0
  for root, _, names in os.walk(directory):
    for name in sorted(names):
      path = os.path.join(root, name)
      rel = os.path.relpath(path, directory)
      if rel == _FINGERPRINT or rel == manifest:
        continue
      if rel.split(os.sep)[0] == _VARIABLES:
        continue
      total += os.path.getsize(path)
      if total > MAX_BYTES:
        return
      with open(path, 'rb') as f:
        files.append((rel, f.read()))
  tf = _tf.tf()
  graph = tf.train.load_checkpoint(
    os.path.join(directory, _VARIABLES, _VARIABLES)
  ).get_tensor(_names.OBJECT_GRAPH_KEY)
  written = Written(tuple(files), graph, tuple(layouts), signatures, keep)
  with _lock:
    _cache[k] = written
    while len(_cache) > KEPT:
      _cache.popitem(last=False)


def write(
  written: Written,
  directory: str,
  prefix: str,
  entries: Sequence[_selection.Entry],
  values: Sequence[jax.Array],
  pool: concurrent.futures.Executor,
) -> tuple[
  list[list[tuple[_model.Index, int]]], dict[str, _checksums.StreamSum]
]:
  """Writes a remembered export with `values` into `directory`: the
  checksum of each variable's shards, and the variables' data file hashed
  as it was written (by its name under `directory`), for the manifest."""
  for rel, data in written.files:
    path = os.path.join(directory, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'wb') as f:
      f.write(data)
  tf = _tf.tf()
  target = os.path.join(directory, prefix)
  os.makedirs(os.path.dirname(target), exist_ok=True)
  done = _host_write.write(
    entries,
    _host_write.hand_over(entries, values),
    target,
    pool,
    {_names.OBJECT_GRAPH_KEY: tf.constant(written.object_graph)},
  )
  _host_write.flush([target])
  fingerprinting = _tf.internal(
    'tensorflow.python.saved_model.fingerprinting_utils'
  )
  fingerprinting.write_fingerprint(directory)
  streams = {
    os.path.relpath(_host_write.data_file(b), directory): s
    for b, s in zip(done.bundles, done.streams, strict=True)
    if s is not None
  }
  return done.shards, streams
