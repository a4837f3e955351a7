"""A small decoder-only Transformer language model with logical axes.

Every parameter is annotated with Flax's own metadata
(``nnx.with_partitioning``) using the logical axis names ``'vocab'``,
``'embed'``, ``'heads'``, ``'kv'``, ``'mlp'``, ``'length'`` and ``'norm'``;
activations are constrained with `flax_dtensor.with_logical_constraint` using
``'batch'``, ``'length'``, ``'embed'``, ``'heads'``, ``'kv'``, ``'mlp'`` and
``'vocab'``. Which mesh axis each name lands on is decided by the rules (see
``rules.yaml`` beside this file), not by the model.

The model runs unchanged on one device: without rules or a mesh the
constraints are no-ops.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

import flax_dtensor as fdt


@dataclasses.dataclass(frozen=True)
class Config:
  """The size of the demo model.

  Attributes:
    vocab_size: Number of token ids (256 for bytes).
    max_length: The longest sequence the position table covers.
    embed: Width of the residual stream.
    heads: Number of attention heads.
    head_dim: Width of each head.
    mlp: Hidden width of the feed-forward blocks.
    layers: Number of Transformer blocks.
  """

  vocab_size: int = 256
  max_length: int = 128
  embed: int = 128
  heads: int = 4
  head_dim: int = 32
  mlp: int = 512
  layers: int = 2


def _init(initializer: nnx.Initializer, axes: tuple[str, ...]):
  return nnx.with_partitioning(initializer, axes)


def _dense_init(*, in_axis: int | tuple[int, ...] = -2):
  return nnx.initializers.variance_scaling(
    1.0, 'fan_in', 'truncated_normal', in_axis=in_axis, out_axis=-1
  )


class Attention(nnx.Module):
  """Causal multi-head self-attention."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    e, h, k = config.embed, config.heads, config.head_dim
    qkv_init = _init(_dense_init(in_axis=0), ('embed', 'heads', 'kv'))
    self.query = nnx.LinearGeneral(
      e, (h, k), use_bias=False, kernel_init=qkv_init, rngs=rngs
    )
    self.key = nnx.LinearGeneral(
      e, (h, k), use_bias=False, kernel_init=qkv_init, rngs=rngs
    )
    self.value = nnx.LinearGeneral(
      e, (h, k), use_bias=False, kernel_init=qkv_init, rngs=rngs
    )
    self.out = nnx.LinearGeneral(
      (h, k),
      e,
      axis=(-2, -1),
      use_bias=False,
      kernel_init=_init(_dense_init(in_axis=(0, 1)), ('heads', 'kv', 'embed')),
      rngs=rngs,
    )
    self.head_dim = k

  def __call__(self, x: jax.Array) -> jax.Array:
    heads = ('batch', 'length', 'heads', 'kv')
    q = fdt.with_logical_constraint(self.query(x), heads)
    k = fdt.with_logical_constraint(self.key(x), heads)
    v = fdt.with_logical_constraint(self.value(x), heads)
    length = x.shape[1]
    scores = jnp.einsum('blhk,bmhk->bhlm', q, k) / jnp.sqrt(
      jnp.asarray(self.head_dim, x.dtype)
    )
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    scores = jnp.where(causal[None, None], scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    y = jnp.einsum('bhlm,bmhk->blhk', weights, v)
    y = fdt.with_logical_constraint(y, heads)
    return self.out(y)


class MLP(nnx.Module):
  """The feed-forward block: up-projection, GELU, down-projection."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.up = nnx.Linear(
      config.embed,
      config.mlp,
      kernel_init=_init(_dense_init(), ('embed', 'mlp')),
      bias_init=_init(nnx.initializers.zeros, ('mlp',)),
      rngs=rngs,
    )
    self.down = nnx.Linear(
      config.mlp,
      config.embed,
      kernel_init=_init(_dense_init(), ('mlp', 'embed')),
      bias_init=_init(nnx.initializers.zeros, ('embed',)),
      rngs=rngs,
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    h = jax.nn.gelu(self.up(x))
    h = fdt.with_logical_constraint(h, ('batch', 'length', 'mlp'))
    return self.down(h)


def _norm(config: Config, rngs: nnx.Rngs) -> nnx.RMSNorm:
  return nnx.RMSNorm(
    config.embed,
    scale_init=_init(nnx.initializers.ones, ('norm',)),
    rngs=rngs,
  )


class Block(nnx.Module):
  """A pre-norm Transformer block."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.attn_norm = _norm(config, rngs)
    self.attn = Attention(config, rngs=rngs)
    self.mlp_norm = _norm(config, rngs)
    self.mlp = MLP(config, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    residual = ('batch', 'length', 'embed')
    x = x + self.attn(self.attn_norm(x))
    x = fdt.with_logical_constraint(x, residual)
    x = x + self.mlp(self.mlp_norm(x))
    return fdt.with_logical_constraint(x, residual)


class TransformerLM(nnx.Module):
  """A decoder-only Transformer language model.

  Call it on int32 token ids of shape ``(batch, length)`` with
  ``length <= config.max_length``; it returns float32 logits of shape
  ``(batch, length, vocab_size)``, position ``t`` predicting token ``t + 1``.
  """

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.config = config
    self.embed = nnx.Embed(
      config.vocab_size,
      config.embed,
      embedding_init=_init(nnx.initializers.normal(1.0), ('vocab', 'embed')),
      rngs=rngs,
    )
    self.position = nnx.Embed(
      config.max_length,
      config.embed,
      embedding_init=_init(nnx.initializers.normal(0.02), ('length', 'embed')),
      rngs=rngs,
    )
    self.layers = nnx.List(
      [Block(config, rngs=rngs) for _ in range(config.layers)]
    )
    self.final_norm = _norm(config, rngs)
    self.head = nnx.Linear(
      config.embed,
      config.vocab_size,
      use_bias=False,
      kernel_init=_init(_dense_init(), ('embed', 'vocab')),
      rngs=rngs,
    )

  def __call__(self, tokens: jax.Array) -> jax.Array:
    length = tokens.shape[1]
    x = self.embed(tokens) + self.position.embedding[...][None, :length]
    x = fdt.with_logical_constraint(x, ('batch', 'length', 'embed'))
    for layer in self.layers:
      x = layer(x)
    logits = self.head(self.final_norm(x))
    return fdt.with_logical_constraint(logits, ('batch', 'length', 'vocab'))


BATCH_SIZE = 16
"""Sequences per step in the demo's training (``flax-dtensor demo``)."""


def example_inputs(
  batch_size: int = BATCH_SIZE, config: Config | None = None
) -> list[jax.ShapeDtypeStruct]:
  """The forward's inputs, abstractly: int32 tokens ``(batch, length)``.

  What ``flax-dtensor plan --suggest`` traces the demo model's forward on
  (the logical names of its activations, such as ``'batch'``).

  Example:
    >>> from flax_dtensor.demo import model
    >>> model.example_inputs()
    [ShapeDtypeStruct(shape=(16, 128), dtype=int32)]
  """
  length = (config or Config()).max_length
  return [jax.ShapeDtypeStruct((batch_size, length), jnp.int32)]


def make_model(
  config: Config | None = None, *, seed: int = 0, **overrides: int
) -> TransformerLM:
  """Builds the demo language model; the CLI's default ``TARGET``.

  ``flax-dtensor plan flax_dtensor.demo.model:make_model`` calls it with no
  arguments. Under ``jax.set_mesh`` and `flax_dtensor.logical_axis_rules`,
  its parameters are sharded as they are created; under ``nnx.eval_shape``
  nothing is allocated. Without a mesh it is built on one device, keeping
  its annotations (`flax_dtensor.shard_module` places it later).

  Args:
    config: The model size. Defaults to `Config()`.
    seed: The seed of the parameter initializers.
    **overrides: Fields of `Config` to change, e.g. ``layers=4``.

  Returns:
    The model.

  Example:
    >>> from flax_dtensor.demo import model
    >>> lm = model.make_model(layers=1)
    >>> lm(jax.numpy.zeros((2, 16), jax.numpy.int32)).shape
    (2, 16, 256)
  """
  config = dataclasses.replace(config or Config(), **overrides)
  if jax.sharding.get_abstract_mesh().empty:
    # No mesh: build unsharded (Flax's eager sharding would need one); the
    # annotations stay, so `fdt.shard_module` can place the params later.
    with nnx.use_eager_sharding(False):
      return TransformerLM(config, rngs=nnx.Rngs(seed))
  return TransformerLM(config, rngs=nnx.Rngs(seed))
