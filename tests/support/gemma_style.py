"""A small Gemma-style decoder, written the way another library writes it.

Not flax_dtensor's style, on purpose, and not imported from that library:
the seams where real LLM code differs from ours.

- A `ShardingConfig` dataclass whose tuples name *mesh axes* directly
  (``('fsdp', 'tp')``), set with ``nnx.Param(value, sharding=...)`` after
  the value is computed (Flax's deprecated spelling of ``out_sharding``).
- Einsum layers (``q_einsum``, ``kv_einsum``, ``attn_vec_einsum``,
  ``gating_einsum``), attention alternating local (sliding window) and
  global layers, grouped key/value heads and rotary positions.
- A forward ``__call__(tokens, positions, cache, attention_mask) ->
  (logits, cache)``; with ``cache=None`` it returns ``(logits, None)``.
- Importing it turns Flax's eager sharding off for everyone
  (``flax.config.update('flax_always_shard_variable', False)``), as that
  library's model modules do.
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp
from flax import nnx

flax.config.update('flax_always_shard_variable', False)

LOCAL, GLOBAL = 'local', 'global'


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
  """Mesh axes per weight, as that library names them."""

  emb_vd: tuple = ('tp', 'fsdp')
  q_weight_ndh: tuple = ('tp', 'fsdp', None)
  kv_weight_cndh: tuple = (None, 'tp', 'fsdp', None)
  o_weight_nhd: tuple = ('tp', None, 'fsdp')
  ffw_weight_df: tuple = ('fsdp', 'tp')
  ffw_weight_fd: tuple = ('tp', 'fsdp')
  rms_norm_weight: tuple = ('tp',)

  @classmethod
  def get_default_sharding(cls) -> ShardingConfig:
    return cls()


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  num_layers: int = 4
  num_embed: int = 256
  embed_dim: int = 64
  hidden_dim: int = 128
  num_heads: int = 8
  num_kv_heads: int = 4
  head_dim: int = 8
  sliding_window_size: int = 4
  attention_types: tuple = (LOCAL, GLOBAL)
  shd_config: ShardingConfig = ShardingConfig()

  @classmethod
  def tiny(cls) -> ModelConfig:
    return cls()


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...]) -> jax.Array:
  return jax.random.normal(rngs.params(), shape, jnp.float32) * 0.05


class Einsum(nnx.Module):
  """A weight and the einsum that applies it."""

  def __init__(self, einsum_str, shape, *, rngs, sharding):
    self.einsum_str = einsum_str
    self.w = nnx.Param(_normal(rngs, shape), sharding=sharding)

  def __call__(self, x):
    return jnp.einsum(self.einsum_str, x, self.w[...])


class Embedder(nnx.Module):
  def __init__(self, vocab_size, embed_dim, *, rngs, shd_config):
    self.input_embedding = nnx.Param(
      _normal(rngs, (vocab_size, embed_dim)), sharding=shd_config.emb_vd
    )

  def encode(self, tokens):
    x = self.input_embedding[...][tokens]
    return x * jnp.sqrt(x.shape[-1]).astype(x.dtype)

  def decode(self, x):
    return jnp.dot(x, self.input_embedding[...].T)


class RMSNorm(nnx.Module):
  def __init__(self, dim, *, rngs, sharding):
    del rngs
    self.scale = nnx.Param(jnp.zeros((dim,)), sharding=sharding)

  def __call__(self, x):
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    scale = (1 + self.scale[...]).reshape((1,) * (x.ndim - 1) + (-1,))
    return x * jax.lax.rsqrt(var + 1e-6) * scale


def apply_rope(x, positions, max_wavelength=10_000):
  """Rotary positions over the last axis of (B, T, N, H)."""
  half = x.shape[-1] // 2
  freq = 2 * jnp.arange(half) / x.shape[-1]
  timescale = max_wavelength**freq
  angle = positions[..., None] / timescale[None, None, :]
  sin, cos = jnp.sin(angle)[:, :, None], jnp.cos(angle)[:, :, None]
  first, second = x[..., :half], x[..., half:]
  return jnp.concatenate(
    [first * cos - second * sin, second * cos + first * sin], axis=-1
  ).astype(x.dtype)


class Attention(nnx.Module):
  def __init__(self, config: ModelConfig, attn_type: str, *, rngs):
    shd = config.shd_config
    self.attn_type = attn_type
    self.sliding_window_size = config.sliding_window_size
    self.num_kv_heads = config.num_kv_heads
    self.q_einsum = Einsum(
      'BTD,NDH->BTNH',
      (config.num_heads, config.embed_dim, config.head_dim),
      rngs=rngs,
      sharding=shd.q_weight_ndh,
    )
    self.kv_einsum = Einsum(
      'BSD,CKDH->CBSKH',
      (2, config.num_kv_heads, config.embed_dim, config.head_dim),
      rngs=rngs,
      sharding=shd.kv_weight_cndh,
    )
    self.attn_vec_einsum = Einsum(
      'BTNH,NHD->BTD',
      (config.num_heads, config.head_dim, config.embed_dim),
      rngs=rngs,
      sharding=shd.o_weight_nhd,
    )

  def __call__(self, x, segment_pos, cache, attn_mask):
    q = apply_rope(self.q_einsum(x), segment_pos)
    k, v = self.kv_einsum(x)
    k = apply_rope(k, segment_pos)
    if cache is not None:
      end = cache['end_index'][0]
      k = jax.lax.dynamic_update_slice_in_dim(cache['k'], k, end, axis=1)
      v = jax.lax.dynamic_update_slice_in_dim(cache['v'], v, end, axis=1)
      new_cache = {
        'k': k,
        'v': v,
        'end_index': cache['end_index'] + x.shape[1],
      }
    else:
      new_cache = None
    groups = q.shape[2] // self.num_kv_heads
    q = q.reshape(*q.shape[:2], self.num_kv_heads, groups, q.shape[-1])
    logits = jnp.einsum('BTKGH,BSKH->BTKGS', q, k) * q.shape[-1] ** -0.5
    mask = attn_mask
    if self.attn_type == LOCAL:
      t = segment_pos[:, :, None]
      s = jnp.arange(k.shape[1])[None, None, :]
      mask = mask & (t - s < self.sliding_window_size)
    logits = jnp.where(mask[:, :, None, None, :], logits, -1e9)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum('BTKGS,BSKH->BTKGH', probs, v)
    out = out.reshape(*out.shape[:2], -1, out.shape[-1])
    return new_cache, self.attn_vec_einsum(out)


class FeedForward(nnx.Module):
  def __init__(self, config: ModelConfig, *, rngs):
    shd = config.shd_config
    self.gating_einsum = nnx.Param(
      _normal(rngs, (2, config.embed_dim, config.hidden_dim)),
      sharding=(None, *shd.ffw_weight_df),
    )
    self.linear = nnx.Param(
      _normal(rngs, (config.hidden_dim, config.embed_dim)),
      sharding=shd.ffw_weight_fd,
    )

  def __call__(self, x):
    gate, up = jnp.einsum('BTD,CDF->CBTF', x, self.gating_einsum[...])
    return jnp.dot(jax.nn.gelu(gate) * up, self.linear[...])


class Block(nnx.Module):
  def __init__(self, config: ModelConfig, attn_type: str, *, rngs):
    shd = config.shd_config
    self.pre_attention_norm = RMSNorm(
      config.embed_dim, rngs=rngs, sharding=shd.rms_norm_weight
    )
    self.attn = Attention(config, attn_type, rngs=rngs)
    self.pre_ffw_norm = RMSNorm(
      config.embed_dim, rngs=rngs, sharding=shd.rms_norm_weight
    )
    self.mlp = FeedForward(config, rngs=rngs)

  def __call__(self, x, segment_pos, cache, attn_mask):
    cache, attn = self.attn(
      self.pre_attention_norm(x), segment_pos, cache, attn_mask
    )
    x = x + attn
    return cache, x + self.mlp(self.pre_ffw_norm(x))


class Transformer(nnx.Module):
  """``__call__(tokens, positions, cache, attention_mask) -> (logits,
  cache)``: ``cache`` is None or {'layer_i': {'k', 'v', 'end_index'}}."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.embedder = Embedder(
      config.num_embed,
      config.embed_dim,
      rngs=rngs,
      shd_config=config.shd_config,
    )
    types = config.attention_types
    self.layers = nnx.List(
      [
        Block(config, types[i % len(types)], rngs=rngs)
        for i in range(config.num_layers)
      ]
    )
    self.final_norm = RMSNorm(
      config.embed_dim, rngs=rngs, sharding=config.shd_config.rms_norm_weight
    )

  def __call__(self, last_tokens, positions, cache, attention_mask):
    x = self.embedder.encode(last_tokens)
    new_cache = None if cache is None else {}
    for i, layer in enumerate(self.layers):
      name = f'layer_{i}'
      layer_cache, x = layer(
        x,
        positions,
        None if cache is None else cache[name],
        attention_mask,
      )
      if cache is not None:
        new_cache[name] = layer_cache
    logits = self.embedder.decode(self.final_norm(x))
    return logits, new_cache

  def init_cache(self, batch_size: int, cache_size: int) -> dict:
    shape = (
      batch_size,
      cache_size,
      self.config.num_kv_heads,
      self.config.head_dim,
    )
    return {
      f'layer_{i}': {
        'k': jnp.zeros(shape),
        'v': jnp.zeros(shape),
        'end_index': jnp.zeros((batch_size,), jnp.int32),
      }
      for i in range(self.config.num_layers)
    }


def causal_mask(length: int, batch: int = 1) -> jax.Array:
  """(batch, length, length): each position sees itself and the past."""
  return jnp.broadcast_to(
    jnp.tril(jnp.ones((length, length), bool)), (batch, length, length)
  )


def make_model(seed: int = 0) -> Transformer:
  """A factory for the command line: ``tests/support/gemma_style.py:make_model``."""
  return Transformer(ModelConfig.tiny(), rngs=nnx.Rngs(seed))
