"""The manifest's model, ``flax_dtensor.json``: what an export records.

Every variable (its exact NNX path, checkpoint key, NNX type, dtype,
stored dtype, shape, layout, and a checksum of each saved shard's bytes:
the shards are the blocks of a grid its layout implies, `blocks_of` and
`_grid`, so a shard costs 4 bytes) and every file of the export (size and
a checksum per `CHUNK_BYTES` chunk; CRC-32C, CRC-32 before version 5), as
frozen dataclasses, with the format's names and versions. Writing them is
`_encode`'s, reading them `_decode`'s, checking an export against them
`_verify`'s; this module imports neither JAX nor TensorFlow.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from flax_dtensor.dtensor._conversion import _names
from flax_dtensor.dtensor._format import _grid
from flax_dtensor.dtensor._layout import _index

FILE = 'flax_dtensor.json'
CHECKPOINT_FORMAT = 'flax_dtensor.checkpoint'
SAVED_MODEL_FORMAT = 'flax_dtensor.saved_model'
# 3: exact paths, per-shard and per-file checksums, each shard a record.
# 4: the shards implied by each variable's layout (the blocks of a grid),
# their checksums one base64 string of 4 bytes a shard.
# 5: CRC-32C instead of CRC-32 (hashed in hardware; a checkpoint's data
# files are hashed as they are written, not read back).
VERSION = 5
# The versions read, each with the name of its checksum: the key of the
# per-file and per-shard checksums, and the manifest's `checksum`. Version 2
# (no checksums) was never released, and is refused.
READABLE = {3: 'crc32', 4: 'crc32', 5: 'crc32c'}
# How each checksum is named in messages.
CHECKSUM_NAMES = {'crc32': 'CRC-32', 'crc32c': 'CRC-32C'}
CHUNK_BYTES = 64 * 2**20
# Where a SavedModel keeps the manifest.
SAVED_MODEL_ASSETS = 'assets'

# A global slice of an array: (start, stop) per dimension.
Index = _index.Index


@dataclasses.dataclass(frozen=True)
class FileSum:
  """A file's size and the checksum of each `CHUNK_BYTES` chunk."""

  size: int
  chunks: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class MeshAxes:
  """A mesh's axis names and sizes, as the manifest records them."""

  names: tuple[str, ...]
  sizes: tuple[int, ...]

  def text(self) -> str:
    """'data=2,model=4'."""
    return ','.join(
      f'{n}={s}' for n, s in zip(self.names, self.sizes, strict=True)
    )

  def to_json(self) -> dict[str, Any]:
    return {'axis_names': list(self.names), 'axis_sizes': list(self.sizes)}


@dataclasses.dataclass(frozen=True)
class ShardingRecord:
  """How a variable was laid out when saved (`_encode.sharding_record`).

  Attributes:
    kind: 'named' (a `NamedSharding`) or 'single_device'.
    spec: The JAX mesh axes of each dimension (``(('data', 'model'), ())``
      for ``P(('data', 'model'), None)``).
    mesh: The JAX mesh.
    dtensor_specs: The DTensor layout's sharding spec of each dimension
      (a fused axis 'data+model' for the spec above).
    dtensor_mesh: The DTensor mesh.
  """

  kind: str
  spec: tuple[tuple[str, ...], ...]
  mesh: MeshAxes
  dtensor_specs: tuple[str, ...]
  dtensor_mesh: MeshAxes

  def to_json(self) -> dict[str, Any]:
    """The record as the manifest stores it."""
    return {
      'kind': self.kind,
      'spec': [list(d) for d in self.spec],
      'mesh': self.mesh.to_json(),
      'dtensor_layout': {
        'sharding_specs': list(self.dtensor_specs),
        'mesh': self.dtensor_mesh.to_json(),
      },
    }


@dataclasses.dataclass(frozen=True)
class Record:
  """One variable of the manifest."""

  path: _names.Path
  key: str
  type: str
  dtype: str
  stored_dtype: str
  shape: tuple[int, ...]
  key_impl: str | None
  # A display string in the records of early flax_dtensor versions.
  sharding: ShardingRecord | str | None
  # The saved shards: iterates as (global slice, checksum of its bytes).
  shards: _grid.ShardGrid


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """A serving input or output: its shape (None: any size) and dtype."""

  shape: tuple[int | None, ...] | None  # None: unknown rank.
  dtype: str

  def text(self) -> str:
    """'[None, 128] int32', as ``tf.TensorSpec`` shows shape and dtype."""
    shape = '<unknown>' if self.shape is None else list(self.shape)
    return f'{shape} {self.dtype}'


@dataclasses.dataclass(frozen=True)
class Signature:
  """A SavedModel signature: named inputs and outputs."""

  inputs: Mapping[str, TensorSpec]
  outputs: Mapping[str, TensorSpec]


@dataclasses.dataclass(frozen=True)
class Manifest:
  """A parsed manifest.

  Attributes:
    kind: CHECKPOINT_FORMAT or SAVED_MODEL_FORMAT.
    version: The format version read.
    root: The export directory the manifest describes.
    prefix: The TF checkpoint prefix, relative to `root`.
    files: Relative path -> FileSum.
    records: One per variable, in saved order.
    signatures: A SavedModel's serving signatures, as TensorFlow reads them
      from ``saved_model.pb``: name -> ``{'inputs': {name: TensorSpec},
      'outputs': {...}}`` (empty for a checkpoint, or a SavedModel written
      before they were recorded).
  """

  kind: str
  version: int
  root: str
  prefix: str
  files: Mapping[str, FileSum]
  records: tuple[Record, ...]
  signatures: Mapping[str, Signature] = dataclasses.field(default_factory=dict)

  @property
  def checksum(self) -> str:
    """The name of its checksum ('crc32c'; 'crc32' before version 5)."""
    return READABLE[self.version]

  @property
  def checksum_name(self) -> str:
    """Its checksum as messages name it ('CRC-32C')."""
    return CHECKSUM_NAMES[self.checksum]

  @property
  def by_key(self) -> dict[str, Record]:
    return {r.key: r for r in self.records}

  @property
  def where(self) -> str:
    return os.path.join(self.root, self.location)

  @property
  def location(self) -> str:
    if self.kind == SAVED_MODEL_FORMAT:
      return os.path.join(SAVED_MODEL_ASSETS, FILE)
    return FILE


def blocks_of(
  sharding: ShardingRecord, shape: Sequence[int]
) -> tuple[int, ...]:
  """The grid of saved shards a recorded layout implies, per dimension.

  A dimension sharded over mesh axes is cut into as many equal blocks as
  the product of their sizes (one block if it is empty); others are whole.

  Raises:
    ValueError: Saying why the layout implies no grid over `shape`.
  """
  if sharding.kind == 'single_device':
    return (1,) * len(shape)
  if len(sharding.spec) != len(shape):
    raise ValueError(
      f'its layout has {len(sharding.spec)} dimensions, its shape {len(shape)}'
    )
  sizes = dict(zip(sharding.mesh.names, sharding.mesh.sizes, strict=True))
  used = [axis for axes in sharding.spec for axis in axes]
  if len(set(used)) != len(used) or not set(used) <= set(sizes):
    raise ValueError(
      f'its layout shards over mesh axes {used}, which are not distinct '
      f'axes of its mesh {sharding.mesh.text()}'
    )
  out = []
  for axes, n in zip(sharding.spec, shape, strict=True):
    count = 1
    for axis in axes:
      count *= sizes[axis]
    if n % count:
      raise ValueError(
        f'its layout cuts a dimension of {n} into {count} blocks, unevenly'
      )
    out.append(count if n else 1)
  return tuple(out)
