"""The models and states the benchmarks build, shared by their groups.

Each builder imports JAX and Flax when called, so that importing this
module costs only NumPy (a case's process starts its backend itself).
"""

from __future__ import annotations

import numpy as np

# The un-annotated stack's path rules: the annotated stack's placement.
PATH_RULES = [
  (r'up/kernel$', ('embed', 'mlp')),
  (r'down/kernel$', ('mlp', 'embed')),
]


def mlp_stack(
  layers: int, width: int, annotated: bool = True, vmap: bool = False
):
  """`layers` x (Linear(width -> 4 width) + Linear(4 width -> width)).

  Annotated with logical axes, or, with `annotated=False`, as plain
  ``nnx.Linear`` layers with no sharding metadata (placed by `PATH_RULES`).
  With `vmap`, the blocks are stacked by ``nnx.vmap`` (one array per kind
  of weight, a leading layer dimension): `fdt.init` builds it traced.
  """
  from flax import nnx

  init = nnx.initializers.lecun_normal()

  def kernel_init(axes):
    return nnx.with_partitioning(init, axes) if annotated else init

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(
        width, 4 * width, kernel_init=kernel_init(('embed', 'mlp')), rngs=rngs
      )
      self.down = nnx.Linear(
        4 * width, width, kernel_init=kernel_init(('mlp', 'embed')), rngs=rngs
      )

  class Stack(nnx.Module):
    def __init__(self, rngs):
      self.blocks = nnx.List([Block(rngs) for _ in range(layers)])

  class VmapStack(nnx.Module):
    def __init__(self, rngs):
      @nnx.split_rngs(splits=layers)
      @nnx.vmap(
        in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None}
      )
      def make(rngs):
        return Block(rngs)

      self.blocks = make(rngs)

  return VmapStack if vmap else Stack


def many_variables(n: int):
  """A model with `n` annotated variables (n / 2 bias-free Linear layers)."""
  from flax import nnx

  init = nnx.with_partitioning(
    nnx.initializers.lecun_normal(), ('embed', 'mlp')
  )

  class Many(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.List(
        [
          nnx.Linear(64, 64, use_bias=False, kernel_init=init, rngs=rngs)
          for _ in range(n)
        ]
      )

  return lambda: Many(nnx.Rngs(0))


LAYOUTS = {
  'mixed': (
    ('data', 'model'),
    ('model', 'data'),
    (None, 'model'),
    ('data', None),
    (None, None),
  ),
  # One dimension over both mesh axes: DTensor has no such layout on the
  # (2, 4) mesh; flax_dtensor fuses the axes, orbax-export reshards.
  'product': ((('data', 'model'), None),),
  # Every array split over all 8 devices (FSDP and tensor parallelism).
  'sharded': (('data', 'model'), ('model', 'data'), (('data', 'model'), None)),
}


def sharded_arrays(jax, count: int, mib: float, layouts: str = 'mixed', fill=0):
  """`count` float32 arrays of `mib` MiB each, in the given layouts, on
  a (2, n / 2) mesh of the n devices.

  Their values are random normal (seeded by `fill` and the array's
  position), as trained weights are: a constant array would let a writer
  that compresses (orbax-checkpoint's zstd, on by default) write almost
  nothing.
  """
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  devices = jax.device_count()
  mesh = jax.make_mesh(
    (2, devices // 2),
    ('data', 'model'),
    axis_types=(jax.sharding.AxisType.Auto,) * 2,
  )
  rows = 256
  cols = int(mib * 2**20 / 4 / rows)
  cols -= cols % 8
  specs = LAYOUTS[layouts]
  out = []
  for i in range(count):
    spec = P(*specs[i % len(specs)])
    rng = np.random.default_rng(i + fill)
    value = rng.standard_normal((rows, cols), dtype=np.float32)
    out.append((jax.device_put(value, NamedSharding(mesh, spec)), spec))
  jax.block_until_ready([a for a, _ in out])
  return mesh, out


EXPORT_WIDTH = 4096  # Each layer's kernel: 64 MiB of float32.


def explicit_stack(jax, nnx, layers: int):
  """A stack of square layers with a forward written for Explicit axes.

  Kernels alternate ('embed', 'mlp') and ('mlp', 'embed'); each call says
  where its result goes (`out_sharding=`): the second contracts over the
  sharded 'mlp'.
  """
  from jax.sharding import PartitionSpec as P

  ones = nnx.initializers.ones

  class Stack(nnx.Module):
    def __init__(self, rngs):
      self.count = layers
      for i in range(layers):
        names = ('embed', 'mlp') if i % 2 == 0 else ('mlp', 'embed')
        layer = nnx.Linear(
          EXPORT_WIDTH,
          EXPORT_WIDTH,
          use_bias=False,
          kernel_init=nnx.with_partitioning(ones, names),
          rngs=rngs,
        )
        setattr(self, f'layer{i}', layer)

    def __call__(self, x):
      for i in range(self.count):
        spec = P(None, 'model') if i % 2 == 0 else P()
        x = getattr(self, f'layer{i}')(x, out_sharding=spec)
      return x

  return Stack


# Each block's logical axes, as a Llama port annotates them.
GPU_RULES = [
  ('embed', 'data'),
  ('heads', 'model'),
  ('mlp', 'model'),
  ('vocab', 'model'),
  ('batch', 'data'),
]


def decoder(layers: int, dim: int, ffn: int, vocab: int, heads: int):
  """A Llama-like decoder in bfloat16, annotated with logical axes: a
  factory ``make(rngs)`` and a loss ``loss(model, tokens)``. Its forward
  pins the activations' sharding with `fdt.with_logical_constraint` when
  `constrained` (a no-op without rules)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  import flax_dtensor as fdt

  dtype = jnp.bfloat16

  def ann(init, names):
    return nnx.with_partitioning(init, names)

  def linear(i, o, names, rngs):
    return nnx.Linear(
      i,
      o,
      use_bias=False,
      dtype=dtype,
      param_dtype=dtype,
      kernel_init=ann(nnx.initializers.lecun_normal(), names),
      rngs=rngs,
    )

  def norm(rngs):
    return nnx.RMSNorm(
      dim,
      dtype=dtype,
      param_dtype=dtype,
      scale_init=ann(nnx.initializers.ones, ('embed',)),
      rngs=rngs,
    )

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.attn_norm = norm(rngs)
      self.q = linear(dim, dim, ('embed', 'heads'), rngs)
      self.k = linear(dim, dim, ('embed', 'heads'), rngs)
      self.v = linear(dim, dim, ('embed', 'heads'), rngs)
      self.o = linear(dim, dim, ('heads', 'embed'), rngs)
      self.mlp_norm = norm(rngs)
      self.gate = linear(dim, ffn, ('embed', 'mlp'), rngs)
      self.up = linear(dim, ffn, ('embed', 'mlp'), rngs)
      self.down = linear(ffn, dim, ('mlp', 'embed'), rngs)

    def __call__(self, x, constrained):
      def pin(y, names):
        return fdt.with_logical_constraint(y, names) if constrained else y

      b, t, _ = x.shape
      h = self.attn_norm(x)
      q, k, v = (
        f(h).reshape(b, t, heads, dim // heads)
        for f in (self.q, self.k, self.v)
      )
      att = jnp.einsum('bthd,bshd->bhts', q, k) / jnp.sqrt(dim // heads)
      att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
      att = jax.nn.softmax(att.astype(jnp.float32), axis=-1).astype(dtype)
      y = jnp.einsum('bhts,bshd->bthd', att, v).reshape(b, t, dim)
      x = pin(x + self.o(y), ('batch', None, 'embed'))
      h = self.mlp_norm(x)
      h = pin(jax.nn.silu(self.gate(h)) * self.up(h), ('batch', None, 'mlp'))
      return pin(x + self.down(h), ('batch', None, 'embed'))

  class Decoder(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(
        vocab,
        dim,
        dtype=dtype,
        param_dtype=dtype,
        embedding_init=ann(nnx.initializers.normal(0.02), ('vocab', 'embed')),
        rngs=rngs,
      )
      self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
      self.norm = norm(rngs)
      self.head = linear(dim, vocab, ('embed', 'vocab'), rngs)

    def __call__(self, tokens, constrained=False):
      x = self.embed(tokens)
      for block in self.blocks:
        x = block(x, constrained)
      return self.head(self.norm(x)).astype(jnp.float32)

  def loss(model, tokens, constrained):
    logits = model(tokens[:, :-1], constrained)
    labels = jax.nn.one_hot(tokens[:, 1:], vocab)
    return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), axis=-1))

  return Decoder, loss
