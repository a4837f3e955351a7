"""One DTensor mesh for every variable: the relayouts, and their report.

A DTensor layout shards a tensor dimension over one mesh axis, so a JAX
dimension sharded over several axes lands on a DTensor mesh of its own
(`_layouts` fuses the axes). TF's own checkpoints, SavedModels and ops
that mix variables need one mesh. `onto_one_mesh` keeps every array that
mesh expresses as it is and has JAX move the others: a dimension over
several axes keeps the largest of them; an array on another mesh or on one
device is laid out on the main mesh. `SingleMeshReport` says what moved.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from flax_dtensor import _text
from flax_dtensor._rules import _meshes, _partition_specs
from flax_dtensor.dtensor._conversion import _selection
from flax_dtensor.dtensor._layout import _layouts, _pieces


@dataclasses.dataclass(frozen=True)
class RelaidVariable:
  """One variable JAX moved so that it lives on the one DTensor mesh.

  Attributes:
    path: The NNX path, joined with '/' (``layers/0/kernel``).
    original: Where it was: its PartitionSpec (``P(('data', 'model'),
      None)``), with the mesh when it was another one, or ``one device``.
    spec: Its PartitionSpec on the one mesh.
    reason: Why it moved, and which axis each changed dimension kept.
  """

  path: str
  original: str
  spec: PartitionSpec
  reason: str


@dataclasses.dataclass(frozen=True)
class SingleMeshReport:
  """What putting every variable on one DTensor mesh moved, and why.

  Returned by `to_tf_module(..., single_mesh=True)` and
  `save_checkpoint(..., single_mesh=True)`. `str()` of it is a table.

  Attributes:
    mesh: The axis sizes of the JAX mesh the DTensor mesh mirrors
      (``{'data': 2, 'model': 4}``); empty when every variable is on one
      device.
    variables: How many variables were exported.
    relaid: The variables JAX moved, in export order.
    moved_bytes: Their size in bytes, summed (global arrays).
  """

  mesh: dict[str, int]
  variables: int
  relaid: tuple[RelaidVariable, ...]
  moved_bytes: int

  def __str__(self) -> str:
    where = (
      'one DTensor mesh ('
      + ', '.join(f'{k}={v}' for k, v in self.mesh.items())
      + ')'
      if self.mesh
      else 'one device'
    )
    head = f'{self.variables} variables on {where}: '
    if not self.relaid:
      return head + 'none relaid.'
    lines = [
      head + f'{len(self.relaid)} relaid by JAX '
      f'({_text.human_bytes(self.moved_bytes)}).'
    ]
    rows = [('variable', 'was', 'now')] + [
      (r.path, r.original, _partition_specs.format_spec(r.spec))
      for r in self.relaid
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for i, row in enumerate(rows):
      lines.append(
        '  '
        + '  '.join(
          c.ljust(w) for c, w in zip(row, widths, strict=True)
        ).rstrip()
      )
      if i:
        lines.append(
          textwrap.fill(
            self.relaid[i - 1].reason,
            width=78,
            initial_indent='    ',
            subsequent_indent='    ',
          )
        )
    return '\n'.join(lines)


def _kept_axis(
  axes: Sequence[str], size: int, mesh: jax.sharding.Mesh, used: set[str]
) -> str | None:
  """The one mesh axis a dimension keeps of `axes`, or None (replicated).

  The largest axis of `mesh` among `axes` that no other dimension uses and
  that divides the dimension (the first of them on a tie): each device then
  holds the smallest slice one axis allows, and the fewest bytes move.
  """
  candidates = [
    a
    for a in axes
    if a in mesh.shape and a not in used and size % mesh.shape[a] == 0
  ]
  return max(candidates, key=lambda a: mesh.shape[a], default=None)


def spec_on(
  mesh: jax.sharding.Mesh,
  sharding: jax.sharding.Sharding,
  shape: Sequence[int],
) -> tuple[PartitionSpec, list[str]]:
  """The spec on `mesh` closest to `sharding`, one mesh axis per dimension.

  Returns it with one note per dimension it changes.
  """
  if isinstance(sharding, NamedSharding):
    dims = _partition_specs.canonical(sharding.spec, len(shape))
  else:
    dims = ((),) * len(shape)
  used: set[str] = set()
  entries, notes = [], []
  for dim, (axes, size) in enumerate(zip(dims, shape, strict=True)):
    kept = _kept_axis(axes, size, mesh, used)
    if kept is not None:
      used.add(kept)
    entries.append(kept)
    rest = [a for a in axes if a != kept]
    if len(axes) > 1 and kept is not None:
      notes.append(
        f'dim {dim} ({size}) was sharded over {"+".join(axes)}; a DTensor '
        f'layout shards a dimension over one mesh axis: kept {kept!r}, the '
        f'largest, replicated over {", ".join(map(repr, rest))}'
      )
    elif axes and kept is None:
      notes.append(
        f'dim {dim} ({size}) was sharded over {"+".join(axes)}, which this '
        'mesh cannot shard it over: replicated'
      )
  while entries and entries[-1] is None:
    entries.pop()
  return PartitionSpec(*entries), notes


def main_mesh(values: Sequence[jax.Array]) -> jax.sharding.Mesh | None:
  """The mesh holding the most bytes (the first of them on a tie)."""
  meshes: list[jax.sharding.Mesh] = []
  nbytes: list[int] = []
  for v in values:
    if not isinstance(v.sharding, NamedSharding):
      continue
    mesh = v.sharding.mesh
    i = next(
      (k for k, m in enumerate(meshes) if _meshes.same_devices(mesh, m)), None
    )
    if i is None:
      meshes.append(mesh)
      nbytes.append(0)
      i = len(meshes) - 1
    nbytes[i] += v.nbytes
  if not meshes:
    return None
  return meshes[int(np.argmax(nbytes))]


def _moved(value: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
  """`value` laid out as `sharding` says, with the fewest bytes copied.

  When this process holds all of it, each distinct slice the devices need
  is cut or assembled on the host from its shards (`_pieces.assemble`):
  a device whose shard is already its slice keeps its buffer, and on CPU
  the devices needing one slice share one buffer. Otherwise JAX moves it
  (a collective over the processes).
  """
  if not value.is_fully_addressable:
    return jax.device_put(value, sharding)
  shape = tuple(value.shape)
  pieces, own = {}, {}
  for shard in value.addressable_shards:
    index = _layouts.normalize_index(shard.index, shape)
    data = np.asarray(shard.data)
    pieces.setdefault(index, data)
    own[shard.device] = (index, data)
  return _pieces.assemble(pieces, shape, sharding, own=own)


def onto_one_mesh(
  entries: Sequence[_selection.Entry], values: Sequence[jax.Array]
) -> tuple[list[jax.Array], SingleMeshReport]:
  """The entries' arrays, moved by JAX only where needed, on one mesh.

  The mesh is the JAX mesh holding the most bytes. An array laid out on it
  with at most one mesh axis per dimension is used as it is, without a
  copy; the others are copied onto it (`spec_on`). When no array is on a
  mesh, they all go on this process's first device (a one-device mesh).

  Raises:
    ExportError: If a JAX array cannot be moved (e.g. a dimension does not
      divide the new layout).
  """
  mesh = main_mesh(values)
  out, relaid, moved = [], [], 0
  for e, v in zip(entries, values, strict=True):
    sharding = v.sharding
    if mesh is None:
      target: jax.sharding.Sharding = jax.sharding.SingleDeviceSharding(
        jax.local_devices()[0]
      )
      if sharding.device_set == target.device_set:
        out.append(v)
        continue
      original, spec, notes = 'several devices', PartitionSpec(), []
    else:
      spec, notes = spec_on(mesh, sharding, v.shape)
      same_mesh = isinstance(sharding, NamedSharding) and _meshes.same_devices(
        sharding.mesh, mesh
      )
      if same_mesh and not notes:
        out.append(v)
        continue
      if not isinstance(sharding, NamedSharding):
        original = 'one device'
        notes = ['on one device: laid out on the mesh', *notes]
      elif not same_mesh:
        original = (
          f'{_partition_specs.format_spec(sharding.spec)} on '
          f'{_meshes.describe(sharding.mesh)}'
        )
        notes = ['on another mesh: laid out on this one', *notes]
      else:
        original = _partition_specs.format_spec(sharding.spec)
      # On the array's own mesh when it is this one (its axis types kept).
      target = NamedSharding(sharding.mesh if same_mesh else mesh, spec)
    out.append(_moved(v, target))
    moved += v.nbytes
    relaid.append(RelaidVariable(e.name, original, spec, '; '.join(notes)))
  report = SingleMeshReport(
    mesh=_meshes.axis_sizes(mesh) if mesh is not None else {},
    variables=len(entries),
    relaid=tuple(relaid),
    moved_bytes=moved,
  )
  return out, report
