"""A MaxText-style mesh: 12 named axes, only `fsdp` (2) and `tensor` (4)
larger than 1, rules that map a name to tuples of several of them, and a
model whose layers are stacked on a `layers` dimension.

Arrays placed by a spec without the axes of size 1
(``P('fsdp', None, 'tensor')`` for ``P(('fsdp', 'sequence', 'context',
'expert'), 'stage', ('tensor', 'tensor_transpose', 'tensor_sequence'))``)
sit exactly where the rules say: the plan must not call them misplaced.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_dtensor as fdt
from support import maxtext_style

AXES = maxtext_style.MESH_AXES  # MaxText's 12 mesh axes, in its order.
SIZES = {a: {'fsdp': 2, 'tensor': 4}.get(a, 1) for a in AXES}
UNIT = tuple(a for a in AXES if SIZES[a] == 1)

RULES = fdt.LogicalRules(
  [
    ('embed', ('fsdp', 'sequence', 'context', 'expert')),
    ('layers', 'stage'),
    ('mlp', ('tensor', 'tensor_transpose', 'tensor_sequence')),
    ('heads', ('tensor', 'tensor_transpose')),
    ('kv', None),
    ('vocab', ('tensor', 'autoregressive')),
  ]
)


def mesh() -> jax.sharding.Mesh:
  return jax.make_mesh(
    tuple(SIZES.values()), AXES, axis_types=(AxisType.Auto,) * len(AXES)
  )


def abstract_mesh() -> jax.sharding.AbstractMesh:
  return jax.sharding.AbstractMesh(
    tuple(SIZES.values()), AXES, axis_types=(AxisType.Auto,) * len(AXES)
  )


def without_unit_axes(spec: P) -> P:
  """The spec with the axes of size 1 taken out (written here afresh, not
  with the package's function, to test it)."""
  out = []
  for entry in spec:
    axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
    kept = [a for a in axes if SIZES[a] > 1]
    out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  return P(*out)


class Stacked(nnx.Module):
  """Layers stacked on dimension `layers` (3), as a scanned model keeps
  them: 10 parameters, every one sharded."""

  def __init__(self, rngs: nnx.Rngs, *, eager: bool | None = None):
    init = nnx.initializers.normal(0.02)
    extra = {} if eager is None else {'eager_sharding': eager}

    def param(shape, names):
      return nnx.Param(init(rngs.params(), shape), out_sharding=names, **extra)

    self.embedding = param((32, 16), ('vocab', 'embed'))
    self.wi = param((16, 3, 32), ('embed', 'layers', 'mlp'))
    self.wo = param((32, 3, 16), ('mlp', 'layers', 'embed'))
    self.query = param((16, 3, 4, 8), ('embed', 'layers', 'heads', 'kv'))
    self.key = param((16, 3, 4, 8), ('embed', 'layers', 'heads', 'kv'))
    self.value = param((16, 3, 4, 8), ('embed', 'layers', 'heads', 'kv'))
    self.out = param((4, 3, 8, 16), ('heads', 'layers', 'kv', 'embed'))
    self.pre_norm = param((16, 3), ('embed', 'layers'))
    self.final_norm = param((16,), ('embed',))
    self.logits = param((16, 32), ('embed', 'vocab'))


PARAMS = (
  'embedding',
  'final_norm',
  'key',
  'logits',
  'out',
  'pre_norm',
  'query',
  'value',
  'wi',
  'wo',
)
"""The parameters' paths, in the plan's order."""


def place(variable: nnx.Variable, mesh_: jax.sharding.Mesh, spec: P) -> None:
  variable.set_value(
    jax.device_put(variable.get_value(), NamedSharding(mesh_, spec))
  )


def make_stacked() -> Stacked:
  """The factory the command line calls."""
  return Stacked(nnx.Rngs(0))


MESH_FLAG = ','.join(f'{a}={n}' for a, n in SIZES.items())
"""The mesh as `--mesh` takes it."""
