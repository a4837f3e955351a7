"""Writing the manifest: each variable's record, and the JSON document.

`sharding_record` records a variable's layout as data, `shard_grid` its
saved shards as the grid that layout implies (a writer's invariant),
`files_under` lists an export's files, and `to_json` and `write` put the
manifest (`_model.Manifest`) on disk, flushed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from flax_dtensor._rules import _partition_specs
from flax_dtensor.dtensor._format import _grid, _model

if TYPE_CHECKING:
  import jax


def _axes(names: Iterable[Any], sizes: Iterable[Any]) -> _model.MeshAxes:
  return _model.MeshAxes(
    tuple(str(n) for n in names), tuple(int(s) for s in sizes)
  )


def sharding_record(
  sharding: jax.sharding.Sharding, layout: Any, ndim: int
) -> _model.ShardingRecord:
  """A variable's layout as data: the JAX spec and mesh, the DTensor layout.

  `spec` lists the JAX mesh axes of each dimension (`[['data', 'model'],
  []]` for `P(('data', 'model'), None)`); `dtensor_layout` is the layout it
  was written with (a fused DTensor axis 'data+model' of size 8 there).
  """
  import jax

  if isinstance(sharding, jax.sharding.NamedSharding):
    entries = (*sharding.spec, *([None] * (ndim - len(sharding.spec))))
    kind = 'named'
    spec = tuple(tuple(_partition_specs.axes_of(entry)) for entry in entries)
    mesh = _axes(sharding.mesh.axis_names, sharding.mesh.axis_sizes)
  else:
    kind = 'single_device'
    spec = tuple(() for _ in range(ndim))
    mesh = _axes([], [])
  return _model.ShardingRecord(
    kind=kind,
    spec=spec,
    mesh=mesh,
    dtensor_specs=tuple(str(s) for s in layout.sharding_specs),
    dtensor_mesh=_axes(layout.mesh.dim_names, layout.mesh.shape()),
  )


def shard_grid(
  sharding: _model.ShardingRecord,
  shape: Sequence[int],
  shards: Sequence[tuple[_model.Index, int]],
) -> _grid.ShardGrid:
  """The grid of a variable's saved shards, from their (slice, CRC-32)s.

  For the writers: every distinct shard of the array, each once, as the
  layout implies (an internal invariant, checked even under `python -O`).
  """
  try:
    grid = _grid.from_shards(tuple(shape), shards)
    implied = _model.blocks_of(sharding, shape)
  except ValueError as e:
    raise AssertionError(
      f'flax_dtensor internal error: the shards written of an array of shape '
      f'{tuple(shape)} {e}. Please report this with its sharding.'
    ) from e
  if grid.blocks != implied:
    raise AssertionError(
      f'flax_dtensor internal error: the shards written of an array of shape '
      f'{tuple(shape)} are {grid.blocks} blocks, its layout implies '
      f'{implied}. Please report this with its sharding.'
    )
  return grid


def files_under(root: str) -> list[str]:
  """Every file below `root`, relative, except the manifest itself."""
  out = []
  for directory, _, names in os.walk(root):
    for name in names:
      rel = os.path.relpath(os.path.join(directory, name), root)
      if os.path.basename(rel) != _model.FILE:
        out.append(rel)
  return sorted(out)


def to_json(manifest: _model.Manifest) -> dict[str, Any]:
  return {
    'format': manifest.kind,
    'version': _model.VERSION,
    'checkpoint_prefix': manifest.prefix,
    'checksum': _model.READABLE[_model.VERSION],
    'chunk_bytes': _model.CHUNK_BYTES,
    'files': {
      name: {'bytes': s.size, _model.READABLE[_model.VERSION]: list(s.chunks)}
      for name, s in sorted(manifest.files.items())
    },
    'variables': [
      {
        'path': list(r.path),
        'key': r.key,
        'type': r.type,
        'dtype': r.dtype,
        'stored_dtype': r.stored_dtype,
        'shape': list(r.shape),
        'key_impl': r.key_impl,
        'sharding': (
          r.sharding.to_json()
          if isinstance(r.sharding, _model.ShardingRecord)
          else r.sharding
        ),
        'shards': {
          'blocks': list(r.shards.blocks),
          _model.READABLE[_model.VERSION]: r.shards.to_text(),
        },
      }
      for r in manifest.records
    ],
  } | (
    {
      'signatures': {
        name: {
          side: {
            k: {
              'shape': None if t.shape is None else list(t.shape),
              'dtype': t.dtype,
            }
            for k, t in sorted(getattr(sig, side).items())
          }
          for side in ('inputs', 'outputs')
        }
        for name, sig in sorted(manifest.signatures.items())
      }
    }
    if manifest.signatures
    else {}
  )


def write(manifest: _model.Manifest) -> None:
  """Writes the manifest into its root, flushed to disk."""
  path = manifest.where
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w') as f:
    json.dump(to_json(manifest), f, indent=1)
    f.write('\n')
    f.flush()
    os.fsync(f.fileno())
