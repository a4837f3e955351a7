"""Three small decoders nobody annotated, in three naming conventions.

Written here, not imported from the libraries whose names they use:

- `Llama`: Hugging Face-style names (``model/embed_tokens``,
  ``self_attn/q_proj``, ``mlp/gate_proj``, ``lm_head``), grouped key/value
  heads, and Qwen's q/k/v biases with ``qkv_bias=True``;
- `Gemma`: Gemma's einsum names (``embedder/input_embedding``,
  ``attn/q_einsum/w``, ``attn/kv_einsum/w``, ``mlp/gating_einsum``);
- `Gpt2`: GPT-2's (``transformer/wte``, ``h/0/attn/c_attn``,
  ``mlp/c_fc``).

No variable carries sharding metadata, so path rules place every one of
them. Each has a forward pass, so that a sharded build can be run.

Two more are annotated (``nnx.with_partitioning``) with logical names of
their own, for proposals that start from what a model says:

- `AnnotatedMlp`: names no preset knows (``features``, ``hidden``);
- `AnnotatedDecoder`: a decoder's names (``vocab``, ``embed``,
  ``q_heads``, ``kv_heads``, ``head_dim``, ``mlp``, ``norm``), with 2
  key/value heads, which a model axis of 4 does not divide;
- `ConstrainedMlp`: `AnnotatedMlp`'s names, and a forward that constrains
  its activations with names no variable has (``act_batch``,
  ``act_hidden``) beside one they share (``features``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

VOCAB = 512
EMBED = 128
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32
MLP = 256
LAYERS = 2


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...]) -> jax.Array:
  return jax.random.normal(rngs.params(), shape, jnp.float32) * 0.05


def _linear(n_in, n_out, rngs, *, bias=False):
  return nnx.Linear(n_in, n_out, use_bias=bias, rngs=rngs)


# Hugging Face style
# ------------------------------------------------------------------------------


class LlamaAttention(nnx.Module):
  def __init__(self, rngs, qkv_bias):
    self.q_proj = _linear(EMBED, HEADS * HEAD_DIM, rngs, bias=qkv_bias)
    self.k_proj = _linear(EMBED, KV_HEADS * HEAD_DIM, rngs, bias=qkv_bias)
    self.v_proj = _linear(EMBED, KV_HEADS * HEAD_DIM, rngs, bias=qkv_bias)
    self.o_proj = _linear(HEADS * HEAD_DIM, EMBED, rngs)

  def __call__(self, x):
    b, t, _ = x.shape
    q = self.q_proj(x).reshape(b, t, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    k = self.k_proj(x).reshape(b, t, KV_HEADS, HEAD_DIM)
    v = self.v_proj(x).reshape(b, t, KV_HEADS, HEAD_DIM)
    logits = jnp.einsum('btkgh,bskh->bkgts', q, k) * HEAD_DIM**-0.5
    mask = jnp.tril(jnp.ones((t, t), bool))
    probs = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
    out = jnp.einsum('bkgts,bskh->btkgh', probs, v).reshape(b, t, -1)
    return self.o_proj(out)


class LlamaMlp(nnx.Module):
  def __init__(self, rngs):
    self.gate_proj = _linear(EMBED, MLP, rngs)
    self.up_proj = _linear(EMBED, MLP, rngs)
    self.down_proj = _linear(MLP, EMBED, rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nnx.Module):
  def __init__(self, rngs, qkv_bias):
    self.input_layernorm = nnx.RMSNorm(EMBED, rngs=rngs)
    self.self_attn = LlamaAttention(rngs, qkv_bias)
    self.post_attention_layernorm = nnx.RMSNorm(EMBED, rngs=rngs)
    self.mlp = LlamaMlp(rngs)

  def __call__(self, x):
    x = x + self.self_attn(self.input_layernorm(x))
    return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nnx.Module):
  def __init__(self, rngs, qkv_bias):
    self.embed_tokens = nnx.Embed(VOCAB, EMBED, rngs=rngs)
    self.layers = nnx.List([LlamaLayer(rngs, qkv_bias) for _ in range(LAYERS)])
    self.norm = nnx.RMSNorm(EMBED, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed_tokens(tokens)
    for layer in self.layers:
      x = layer(x)
    return self.norm(x)


class Llama(nnx.Module):
  """``LlamaForCausalLM``'s layout (``Qwen2`` with ``qkv_bias=True``)."""

  def __init__(self, rngs: nnx.Rngs, qkv_bias: bool = False):
    self.model = LlamaModel(rngs, qkv_bias)
    self.lm_head = _linear(EMBED, VOCAB, rngs)

  def __call__(self, tokens):
    return self.lm_head(self.model(tokens))


# Gemma style
# ------------------------------------------------------------------------------


class Einsum(nnx.Module):
  def __init__(self, spec, shape, rngs):
    self.spec = spec
    self.w = nnx.Param(_normal(rngs, shape))

  def __call__(self, x):
    return jnp.einsum(self.spec, x, self.w[...])


class GemmaAttention(nnx.Module):
  def __init__(self, rngs):
    self.q_einsum = Einsum('BTD,NDH->BTNH', (HEADS, EMBED, HEAD_DIM), rngs)
    self.kv_einsum = Einsum(
      'BSD,CKDH->CBSKH', (2, KV_HEADS, EMBED, HEAD_DIM), rngs
    )
    self.attn_vec_einsum = Einsum(
      'BTNH,NHD->BTD', (HEADS, HEAD_DIM, EMBED), rngs
    )

  def __call__(self, x):
    b, t, _ = x.shape
    q = self.q_einsum(x).reshape(b, t, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    k, v = self.kv_einsum(x)
    logits = jnp.einsum('BTKGH,BSKH->BKGTS', q, k) * HEAD_DIM**-0.5
    mask = jnp.tril(jnp.ones((t, t), bool))
    probs = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
    out = jnp.einsum('BKGTS,BSKH->BTKGH', probs, v).reshape(b, t, HEADS, -1)
    return self.attn_vec_einsum(out)


class GemmaMlp(nnx.Module):
  def __init__(self, rngs):
    self.gating_einsum = nnx.Param(_normal(rngs, (2, EMBED, MLP)))
    self.linear = nnx.Param(_normal(rngs, (MLP, EMBED)))

  def __call__(self, x):
    gate, up = jnp.einsum('BTD,CDF->CBTF', x, self.gating_einsum[...])
    return jnp.dot(jax.nn.gelu(gate) * up, self.linear[...])


class RMSNorm(nnx.Module):
  def __init__(self):
    self.scale = nnx.Param(jnp.zeros((EMBED,)))

  def __call__(self, x):
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + 1e-6) * (1 + self.scale[...])


class GemmaBlock(nnx.Module):
  def __init__(self, rngs):
    self.pre_attention_norm = RMSNorm()
    self.attn = GemmaAttention(rngs)
    self.pre_ffw_norm = RMSNorm()
    self.mlp = GemmaMlp(rngs)

  def __call__(self, x):
    x = x + self.attn(self.pre_attention_norm(x))
    return x + self.mlp(self.pre_ffw_norm(x))


class Embedder(nnx.Module):
  def __init__(self, rngs):
    self.input_embedding = nnx.Param(_normal(rngs, (VOCAB, EMBED)))


class Gemma(nnx.Module):
  """Gemma's einsum layout, the head tied to the embedding."""

  def __init__(self, rngs: nnx.Rngs):
    self.embedder = Embedder(rngs)
    self.layers = nnx.List([GemmaBlock(rngs) for _ in range(LAYERS)])
    self.final_norm = RMSNorm()

  def __call__(self, tokens):
    table = self.embedder.input_embedding[...]
    x = table[tokens] * jnp.sqrt(EMBED).astype(jnp.float32)
    for layer in self.layers:
      x = layer(x)
    return jnp.dot(self.final_norm(x), table.T)


# GPT-2 style
# ------------------------------------------------------------------------------


class Gpt2Attention(nnx.Module):
  def __init__(self, rngs):
    self.c_attn = _linear(EMBED, 3 * EMBED, rngs, bias=True)
    self.c_proj = _linear(EMBED, EMBED, rngs, bias=True)

  def __call__(self, x):
    b, t, _ = x.shape
    q, k, v = jnp.split(self.c_attn(x), 3, axis=-1)
    q, k, v = (y.reshape(b, t, HEADS, -1) for y in (q, k, v))
    logits = jnp.einsum('btnh,bsnh->bnts', q, k) * q.shape[-1] ** -0.5
    mask = jnp.tril(jnp.ones((t, t), bool))
    probs = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
    return self.c_proj(
      jnp.einsum('bnts,bsnh->btnh', probs, v).reshape(b, t, -1)
    )


class Gpt2Mlp(nnx.Module):
  def __init__(self, rngs):
    self.c_fc = _linear(EMBED, 4 * EMBED, rngs, bias=True)
    self.c_proj = _linear(4 * EMBED, EMBED, rngs, bias=True)

  def __call__(self, x):
    return self.c_proj(jax.nn.gelu(self.c_fc(x)))


class Gpt2Block(nnx.Module):
  def __init__(self, rngs):
    self.ln_1 = nnx.LayerNorm(EMBED, rngs=rngs)
    self.attn = Gpt2Attention(rngs)
    self.ln_2 = nnx.LayerNorm(EMBED, rngs=rngs)
    self.mlp = Gpt2Mlp(rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln_1(x))
    return x + self.mlp(self.ln_2(x))


class Gpt2Transformer(nnx.Module):
  def __init__(self, rngs, vocab):
    self.wte = nnx.Embed(vocab, EMBED, rngs=rngs)
    self.wpe = nnx.Embed(64, EMBED, rngs=rngs)
    self.h = nnx.List([Gpt2Block(rngs) for _ in range(LAYERS)])
    self.ln_f = nnx.LayerNorm(EMBED, rngs=rngs)


class Gpt2(nnx.Module):
  """``GPT2LMHeadModel``'s layout, the head tied to ``wte``. GPT-2's own
  vocabulary (50257) divides by no mesh axis: `vocab` gives that too."""

  def __init__(self, rngs: nnx.Rngs, vocab: int = VOCAB):
    self.transformer = Gpt2Transformer(rngs, vocab)

  def __call__(self, tokens):
    t = self.transformer
    x = t.wte(tokens) + t.wpe(jnp.arange(tokens.shape[-1]))
    for block in t.h:
      x = block(x)
    return t.wte.attend(t.ln_f(x))


# Annotated with logical names
# ------------------------------------------------------------------------------


def _named(names):
  return nnx.with_partitioning(nnx.initializers.normal(0.05), names)


class AnnotatedMlp(nnx.Module):
  """Three layers of 96 -> 384 -> 96, every weight named."""

  def __init__(self, rngs: nnx.Rngs):
    def layer(n_in, n_out, names):
      return nnx.Linear(
        n_in,
        n_out,
        kernel_init=_named(names),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros, names[1:]),
        rngs=rngs,
      )

    self.layers = nnx.List(
      [
        nnx.List(
          [
            layer(96, 384, ('features', 'hidden')),
            layer(384, 96, ('hidden', 'features')),
          ]
        )
        for _ in range(3)
      ]
    )

  def __call__(self, x):
    for up, down in self.layers:
      x = down(jax.nn.relu(up(x)))
    return x


class AnnotatedDecoder(nnx.Module):
  """Embedding, attention and MLP weights of a decoder, named."""

  def __init__(self, rngs: nnx.Rngs):
    def param(shape, names):
      return nnx.Param(_named(names)(rngs.params(), shape))

    self.embedding = param((VOCAB, EMBED), ('vocab', 'embed'))
    self.layers = nnx.List()
    for _ in range(LAYERS):
      layer = nnx.Dict()
      layer['q'] = param(
        (EMBED, HEADS, HEAD_DIM), ('embed', 'q_heads', 'head_dim')
      )
      layer['kv'] = param(
        (2, EMBED, KV_HEADS, HEAD_DIM),
        (None, 'embed', 'kv_heads', 'head_dim'),
      )
      layer['o'] = param(
        (HEADS, HEAD_DIM, EMBED), ('q_heads', 'head_dim', 'embed')
      )
      layer['up'] = param((EMBED, MLP), ('embed', 'mlp'))
      layer['down'] = param((MLP, EMBED), ('mlp', 'embed'))
      layer['norm'] = nnx.Param(
        nnx.with_partitioning(nnx.initializers.ones, ('norm',))(
          rngs.params(), (EMBED,)
        )
      )
      self.layers.append(layer)


class ConstrainedMlp(nnx.Module):
  """Two layers of 96 -> 384 -> 96, weights named as `AnnotatedMlp`'s; the
  forward constrains each activation (``fdt.with_logical_constraint``)."""

  def __init__(self, rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.05)
    self.layers = nnx.List(
      [
        nnx.Linear(
          96,
          384,
          kernel_init=nnx.with_partitioning(init, ('features', 'hidden')),
          rngs=rngs,
        ),
        nnx.Linear(
          384,
          96,
          kernel_init=nnx.with_partitioning(init, ('hidden', 'features')),
          rngs=rngs,
        ),
      ]
    )

  def __call__(self, x):
    import flax_dtensor as fdt

    up, down = self.layers
    x = fdt.with_logical_constraint(x, ('act_batch', 'features'))
    h = fdt.with_logical_constraint(
      jax.nn.relu(up(x)), ('act_batch', 'act_hidden')
    )
    return fdt.with_logical_constraint(down(h), ('act_batch', 'features'))


def make_constrained_mlp() -> ConstrainedMlp:
  return ConstrainedMlp(nnx.Rngs(0))


def make_annotated_mlp() -> AnnotatedMlp:
  return AnnotatedMlp(nnx.Rngs(0))


def make_annotated_decoder() -> AnnotatedDecoder:
  return AnnotatedDecoder(nnx.Rngs(0))


def make_llama() -> Llama:
  """Factories for the command line (``suggest_models.py:make_llama``)."""
  return Llama(nnx.Rngs(0))


def make_qwen() -> Llama:
  return Llama(nnx.Rngs(0), qkv_bias=True)


def make_gemma() -> Gemma:
  return Gemma(nnx.Rngs(0))


def make_gpt2() -> Gpt2:
  return Gpt2(nnx.Rngs(0))


def tokens(batch: int = 2, length: int = 8) -> jax.Array:
  return jnp.arange(batch * length, dtype=jnp.int32).reshape(batch, length) % (
    VOCAB - 1
  )
