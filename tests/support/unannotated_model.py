"""A small decoder LM in plain Flax NNX, with no sharding metadata at all.

Written as a reference implementation would be (nobody here wrote it for
flax_dtensor): ``nnx.Embed``, ``nnx.RMSNorm``, ``nnx.MultiHeadAttention``
(its ``LinearGeneral`` kernels are rank 3) and ``nnx.Linear`` layers in an
``nnx.List``, or, in `StackedDecoderLM`, the same blocks stacked by
``nnx.vmap`` and run by ``nnx.scan``. `PATH_RULES` and `LOGICAL_RULES`
shard it entirely by paths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

VOCAB = 256
EMBED = 64
HEADS = 4
MLP = 256
LAYERS = 2

LOGICAL_RULES = [
  ('vocab', 'model'),
  ('embed', 'data'),
  ('heads', 'model'),
  ('head_dim', None),
  ('mlp', 'model'),
]

# Unanchored at the start, so stacked layers, nested models and the
# optimizer state's paths (opt_state/0/mu/...) match too.
PATH_RULES = [
  (r'embed/embedding$', ('vocab', 'embed')),
  (r'attn/(query|key|value)/kernel$', (..., 'embed', 'heads', 'head_dim')),
  (r'attn/out/kernel$', (..., 'heads', 'head_dim', 'embed')),
  (r'mlp/up/kernel$', (..., 'embed', 'mlp')),
  (r'mlp/down/kernel$', (..., 'mlp', 'embed')),
  (r'head/kernel$', ('embed', 'vocab')),
]


class Mlp(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.up = nnx.Linear(EMBED, MLP, rngs=rngs)
    self.down = nnx.Linear(MLP, EMBED, rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.gelu(self.up(x)))


class Block(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.attn_norm = nnx.RMSNorm(EMBED, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
      num_heads=HEADS,
      in_features=EMBED,
      decode=False,
      deterministic=True,
      rngs=rngs,
    )
    self.mlp_norm = nnx.RMSNorm(EMBED, rngs=rngs)
    self.mlp = Mlp(rngs)

  def __call__(self, x, mask):
    x = x + self.attn(self.attn_norm(x), mask=mask)
    return x + self.mlp(self.mlp_norm(x))


def _causal(tokens):
  return nnx.make_causal_mask(tokens)


class DecoderLM(nnx.Module):
  """Blocks in an ``nnx.List``."""

  def __init__(self, rngs: nnx.Rngs, layers: int = LAYERS):
    self.embed = nnx.Embed(VOCAB, EMBED, rngs=rngs)
    self.layers = nnx.List([Block(rngs) for _ in range(layers)])
    self.final_norm = nnx.RMSNorm(EMBED, rngs=rngs)
    self.head = nnx.Linear(EMBED, VOCAB, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    mask = _causal(tokens)
    for layer in self.layers:
      x = layer(x, mask)
    return self.head(self.final_norm(x))


class StackedDecoderLM(nnx.Module):
  """The same blocks, stacked by ``nnx.vmap`` (a leading layer dimension)."""

  def __init__(self, rngs: nnx.Rngs, layers: int = LAYERS):
    self.embed = nnx.Embed(VOCAB, EMBED, rngs=rngs)

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_blocks(rngs):
      return Block(rngs)

    self.blocks = make_blocks(rngs)
    self.final_norm = nnx.RMSNorm(EMBED, rngs=rngs)
    self.head = nnx.Linear(EMBED, VOCAB, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    mask = _causal(tokens)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(x, block):
      return block(x, mask)

    x = run(x, self.blocks)
    return self.head(self.final_norm(x))


def make_model(layers: int = LAYERS) -> DecoderLM:
  """The factory the command line takes (``unannotated_model:make_model``)."""
  return DecoderLM(nnx.Rngs(0), layers)


def make_stacked(layers: int = LAYERS) -> StackedDecoderLM:
  return StackedDecoderLM(nnx.Rngs(0), layers)


def make_small() -> DecoderLM:
  """One block: what tests that compile the model build."""
  return make_model(1)


def make_small_stacked() -> StackedDecoderLM:
  return make_stacked(1)


def tokens(batch: int = 8, length: int = 16) -> jax.Array:
  return jnp.arange(batch * length, dtype=jnp.int32).reshape(batch, length) % (
    VOCAB - 1
  )
