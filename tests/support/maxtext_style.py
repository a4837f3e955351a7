"""A MaxText-style world: its mesh, its rules, its decoder, its import.

Written the way MaxText (0.2.5, `maxtext/layers/`, `configs/base.yml`)
writes these, small, and not imported from MaxText (it needs Python 3.12
and prints when imported):

- `make_mesh()`: the 12 mesh axes of MaxText's ``mesh_axes``, in its
  order, all of size 1 but 'data' (2) and 'tensor' (4) on the 8 devices.
- `RULES`: logical names mapped to tuples of several mesh axes, as
  ``logical_axis_rules`` in base.yml does ('mlp' over 'tensor',
  'tensor_sequence' and 'autoregressive', ...). base.yml's 'mlp' starts
  with 'fsdp_transpose', which its 'embed' names too: Flax's own rules
  (each name alone) refuse an ('embed', 'mlp') kernel then; ours give the
  axis to the first dimension, as Linen does. Left out here, so that every
  kind of rules runs on this mesh.
- `Decoder`: `nnx.scan`-stacked layers (created by `nnx.vmap` with the
  'layers' axis in their metadata), each of which constrains its
  activations on the decoder's own mesh (``NamedSharding(self.mesh, ...)``
  in `jax.lax.with_sharding_constraint`, or `jax.sharding.reshard` on an
  Explicit mesh, as MaxText's ``maybe_shard_with_logical``), and a kept
  `nnx.Rngs` with a dropout.
- `imported()`: what importing MaxText does to Flax,
  ``flax.config.update('flax_always_shard_variable', False)``, scoped: the
  old value comes back on exit, so other tests do not inherit it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import flax
import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# MaxText's `mesh_axes` (base.yml), in its order.
MESH_AXES = (
  'data',
  'stage',
  'fsdp',
  'fsdp_transpose',
  'sequence',
  'context',
  'context_autoregressive',
  'tensor',
  'tensor_transpose',
  'tensor_sequence',
  'expert',
  'autoregressive',
)
# Only these are more than 1 wide (8 devices).
SIZES = {'data': 2, 'tensor': 4}

# As base.yml's `logical_axis_rules` writes them: a name to several axes.
RULES = (
  ('activation_batch', ('data', 'fsdp', 'fsdp_transpose', 'expert')),
  ('activation_embed', ('tensor', 'tensor_transpose')),
  ('activation_mlp', ('tensor', 'tensor_transpose', 'tensor_sequence')),
  ('embed', ('fsdp', 'fsdp_transpose', 'sequence', 'context', 'expert')),
  ('mlp', ('tensor', 'tensor_sequence', 'autoregressive')),
  ('layers', 'stage'),
)

EMBED, MLP, LAYERS = 16, 32, 2


def make_mesh(
  axis_type: jax.sharding.AxisType = jax.sharding.AxisType.Auto,
) -> jax.sharding.Mesh:
  """MaxText's mesh on 8 devices: 12 axes, 'data' 2 and 'tensor' 4."""
  shape = tuple(SIZES.get(name, 1) for name in MESH_AXES)
  return jax.make_mesh(
    shape, MESH_AXES, axis_types=(axis_type,) * len(MESH_AXES)
  )


@contextlib.contextmanager
def imported() -> Iterator[None]:
  """Flax's config as importing MaxText leaves it, restored on exit."""
  old = flax.config.flax_always_shard_variable
  flax.config.update('flax_always_shard_variable', False)
  try:
    yield
  finally:
    flax.config.update('flax_always_shard_variable', old)


def shard_activation(x, mesh, names):
  """MaxText's `maybe_shard_with_logical`: constrains `x` on `mesh`.

  `names` are logical; the spec is resolved by `RULES`. On an all-Explicit
  mesh, `reshard`; else `with_sharding_constraint` on the mesh's Auto
  axes.
  """
  rules = dict(RULES)
  explicit = {
    n
    for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
    if t == jax.sharding.AxisType.Explicit
  }
  resolved = []
  for name in names:
    target = rules.get(name) if name else None
    axes = (target,) if isinstance(target, str) else tuple(target or ())
    if len(explicit) != len(mesh.axis_names):
      axes = tuple(a for a in axes if a not in explicit)
    resolved.append(axes or None)
  sharding = NamedSharding(mesh, P(*resolved))
  if len(explicit) == len(mesh.axis_names):
    return jax.sharding.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


def _part(names):
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


class DecoderLayer(nnx.Module):
  """An MLP block that constrains its activations on its mesh."""

  def __init__(self, mesh, *, rngs: nnx.Rngs):
    self.mesh = mesh
    self.wi = nnx.Param(_part(('embed', 'mlp'))(rngs.params(), (EMBED, MLP)))
    self.wo = nnx.Param(_part(('mlp', 'embed'))(rngs.params(), (MLP, EMBED)))

  def __call__(self, x):
    h = shard_activation(
      jax.nn.gelu(x @ self.wi[...]), self.mesh, ('activation_batch', None)
    )
    y = shard_activation(
      h @ self.wo[...], self.mesh, ('activation_batch', 'activation_embed')
    )
    return x + y


class Decoder(nnx.Module):
  """Scan-stacked decoder layers, a kept `nnx.Rngs`, a dropout."""

  def __init__(self, mesh, *, rngs: nnx.Rngs):
    self.mesh = mesh

    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(
      in_axes=(0,),
      out_axes=0,
      transform_metadata={nnx.PARTITION_NAME: 'layers'},
    )
    def layers(rngs):
      return DecoderLayer(mesh, rngs=rngs)

    self.layers = layers(rngs)
    self.norm = nnx.Param(
      nnx.with_partitioning(nnx.initializers.ones_init(), ('embed',))(
        rngs.params(), (EMBED,)
      )
    )
    self.dropout = nnx.Dropout(0.1, rngs=rngs)
    self.rngs = rngs

  def __call__(self, x):
    @nnx.scan(
      in_axes=(nnx.Carry, 0),
      out_axes=nnx.Carry,
      transform_metadata={nnx.PARTITION_NAME: 'layers'},
    )
    def run(h, layer):
      return layer(h)

    h = run(x, self.layers)
    return self.dropout(h * self.norm[...][None])
