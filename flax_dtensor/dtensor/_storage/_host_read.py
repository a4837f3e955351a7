"""Reading checkpoint slices on the host and placing them onto devices.

Each process asks TF's checkpoint reader (RestoreV2 on the host CPU) for
the regions its own devices need: each region whole saved shards (the
blocks of the variable's grid that its devices' slices meet, merged into
as few boxes as hold nothing more), so that every byte read is checked
against the manifest's shard CRCs, and TF finds each region with one
lookup of its index, whatever the number of shards. One TF op reads a
batch of variables; TF reads and checks the next batches in worker
threads while JAX places this one, zero-copy where a device's slice is a
contiguous part of a region.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from flax_dtensor import _errors
from flax_dtensor.dtensor import _tf, _tf_errors
from flax_dtensor.dtensor._conversion import _selection, _target
from flax_dtensor.dtensor._format import _grid, _model, _verify
from flax_dtensor.dtensor._layout import _arrays, _index, _layouts, _pieces

AHEAD = 2
"""Batches TF reads ahead of the one JAX is placing (host copies alive)."""

BATCH_BYTES = 64 * 2**20
"""A batch: consecutive variables read by one TF op, up to these bytes."""


def slice_spec(shape: Sequence[int], index: _model.Index) -> str:
  """TF's ``shape_and_slices`` for one slice: '8 16 0,4:-' ('' if whole)."""
  if all((a, b) == (0, n) for (a, b), n in zip(index, shape, strict=True)):
    return ''
  dims = [
    '-' if (a, b) == (0, n) else f'{a},{b - a}'
    for (a, b), n in zip(index, shape, strict=True)
  ]
  return ' '.join(map(str, shape)) + ' ' + ':'.join(dims)


def _meet(a: _model.Index, b: _model.Index) -> bool:
  return all(
    a0 < b1 and b0 < a1 for (a0, a1), (b0, b1) in zip(a, b, strict=True)
  )


def _bound(boxes: Sequence[_model.Index]) -> _model.Index:
  return tuple(
    (min(lo for lo, _ in dims), max(hi for _, hi in dims))
    for dims in zip(*boxes, strict=True)
  )


def regions(
  shape: tuple[int, ...],
  needed: set[_model.Index],
  whole: bool,
  record: _model.Record | None,
) -> list[_model.Index]:
  """The regions to ask TF for: each slice in `needed` lies in one of them.

  With a manifest, each needed slice widened to the saved shards it meets
  (`ShardGrid.hull`): whole saved shards, so every byte read is checked
  (the manifest has a CRC of each saved shard). Boxes that overlap are
  merged; and all of them into one, when their bounding box holds nothing
  more and each needed slice is a contiguous part of it (JAX then places
  it without a copy, as it would the slice read alone): TF finds a region
  with one lookup of its index, however many shards it holds. Without a
  manifest, the whole variable when this process holds all of it (TF
  reads an entry in one pass), else the slices it holds.
  """
  if record is None:
    return [tuple((0, n) for n in shape)] if whole else sorted(needed)
  boxes = {record.shards.hull(n) for n in needed}
  merged = True
  while merged and len(boxes) > 1:
    merged = False
    for a, b in itertools.combinations(sorted(boxes), 2):
      if _meet(a, b):
        boxes -= {a, b}
        boxes.add(_bound([a, b]))
        merged = True
        break
  bound = _bound(list(boxes))
  if sum(_grid.volume(b) for b in boxes) == _grid.volume(bound) and all(
    _contiguous(n, bound) for n in needed
  ):
    return [bound]
  return sorted(boxes)


def _contiguous(index: _model.Index, region: _model.Index) -> bool:
  """Whether the slice `index` of a C-order block `region` is contiguous.

  It is when, before the last dimension where it is narrower than the
  region, it is one element wide.
  """
  partial = [
    d for d, (i, r) in enumerate(zip(index, region, strict=True)) if i != r
  ]
  return not partial or all(b - a == 1 for a, b in index[: partial[-1]])


def _cut(
  read: dict[_model.Index, np.ndarray], index: _model.Index
) -> np.ndarray:
  """The slice `index` of a variable: a view of the region holding it."""
  for held, data in read.items():
    if _index.contains(held, index):
      return data[_index.local(index, held)]
  # `regions` gives every needed slice a region: an internal invariant,
  # checked even under `python -O`.
  raise AssertionError(
    f'flax_dtensor internal error: no region read holds the slice {index}; '
    f'read {sorted(read)}.'
  )


@dataclasses.dataclass(frozen=True)
class _Plan:
  """What to read of one variable, and for which slices."""

  entry: _selection.Entry
  kind: tuple[np.dtype, np.dtype]  # (stored, saved)
  record: _model.Record | None
  needed: set[_model.Index]
  regions: list[_model.Index]

  @property
  def nbytes(self) -> int:
    return sum(_grid.volume(r) for r in self.regions) * self.kind[0].itemsize


def _plan(
  entry: _selection.Entry,
  kind: tuple[np.dtype, np.dtype],
  sharding: jax.sharding.Sharding,
  manifest: _model.Manifest | None,
) -> _Plan:
  shape = tuple(entry.shape)
  needed = {
    _layouts.normalize_index(index, shape)
    for index in sharding.addressable_devices_indices_map(shape).values()
  }
  full = tuple((0, n) for n in shape)
  whole = sharding.is_fully_addressable or needed == {full}
  record = manifest.by_key.get(entry.key) if manifest is not None else None
  return _Plan(
    entry, kind, record, needed, regions(shape, needed, whole, record)
  )


def _read(
  prefix: str,
  plans: Sequence[_Plan],
  manifest: _model.Manifest | None,
) -> list[dict[_model.Index, np.ndarray]]:
  """The slices this process's devices hold, of each variable, read by TF.

  One TF op (RestoreV2 on the host) reads every region of the batch; the
  values go back to the saved dtype (widened on save; exact both ways) and
  every byte is checked against the manifest (`_verify.verify_read`)
  before the slices the devices hold are cut from them. So no host reads
  the full model when a variable is sharded over processes, though a
  process may read more of a variable than it holds when the layout
  differs from the saved one. Thread-safe: one TF op per call.
  """
  tf = _tf.tf()
  names, specs, dtypes = [], [], []
  for p in plans:
    shape = tuple(p.entry.shape)
    for region in p.regions:
      names.append(p.entry.key)
      specs.append(slice_spec(shape, region))
      dtypes.append(tf.as_dtype(p.kind[0]))
  try:
    with tf.device('/CPU:0'):
      tensors = tf.raw_ops.RestoreV2(
        prefix=prefix,
        tensor_names=names,
        shape_and_slices=specs,
        dtypes=dtypes,
      )
  except tf.errors.OpError as e:
    which = ', '.join(repr(p.entry.name) for p in plans)
    raise _errors.DamagedExportError(
      f'TensorFlow failed to read the NNX variable{"s" * (len(plans) > 1)} '
      f'{which} from the checkpoint {prefix!r}: {_tf_errors.describe(e)}. '
      'Check that every data file of the checkpoint is complete and readable '
      '(or that no other process rewrote it during the read), or re-export '
      'it. Nothing was restored: the target is unchanged.'
    ) from e
  out = []
  tensors = iter(tensors)
  for p in plans:
    stored, saved = p.kind
    read = {}
    for region in p.regions:
      value = _arrays.tensor_numpy(next(tensors))
      read[region] = value.astype(saved) if stored != saved else value
    if p.record is not None:
      _verify.verify_read(manifest, p.record, read)
    out.append({index: _cut(read, index) for index in p.needed})
  return out


def _batches(plans: Sequence[_Plan]) -> list[list[int]]:
  """Consecutive variables, in batches of about `BATCH_BYTES` to read."""
  out: list[list[int]] = []
  size = BATCH_BYTES
  for i, p in enumerate(plans):
    if size >= BATCH_BYTES:
      out.append([])
      size = 0
    out[-1].append(i)
    size += p.nbytes
  return out


def read_placed(
  prefix: str,
  entries: Sequence[_selection.Entry],
  kinds: Sequence[tuple[np.dtype, np.dtype]],
  shardings: Sequence[jax.sharding.Sharding],
  manifest: _model.Manifest | None,
  advance: Callable[[int], Any],
) -> list[jax.Array]:
  """Every entry read from `prefix` and placed as its sharding says.

  Args:
    prefix: The TF checkpoint prefix.
    entries: The variables to read, with their checkpoint keys.
    kinds: Per entry, (dtype stored in the checkpoint, dtype saved from).
    shardings: Per entry, where the array goes.
    manifest: The checked manifest, whose shard CRCs are verified; None for
      a plain TF checkpoint.
    advance: Called with the number of variables placed (progress).
  """
  plans = [
    _plan(e, k, s, manifest)
    for e, k, s in zip(entries, kinds, shardings, strict=True)
  ]
  batches = _batches(plans)
  arrays: list[jax.Array] = []
  # TF reads and the CRCs are checked for the next batches in worker
  # threads while JAX places this one here (JAX's configuration, such as
  # 64-bit types, is this thread's). Both release the GIL; at most AHEAD
  # batches of host copies exist at once.
  with concurrent.futures.ThreadPoolExecutor(AHEAD) as pool:

    def submit(b: int) -> concurrent.futures.Future:
      return pool.submit(
        _read, prefix, [plans[i] for i in batches[b]], manifest
      )

    reads = {b: submit(b) for b in range(min(AHEAD, len(batches)))}
    for b, batch in enumerate(batches):
      pieces = reads.pop(b).result()
      if b + AHEAD < len(batches):
        reads[b + AHEAD] = submit(b + AHEAD)
      for i, piece in zip(batch, pieces, strict=True):
        e = entries[i]
        array = _pieces.place(piece, tuple(e.shape), shardings[i])
        arrays.append(_target.as_target(array, e, kinds[i][1]))
      del pieces
      advance(len(batch))
  return arrays
