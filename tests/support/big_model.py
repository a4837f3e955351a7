"""A model of 484 variables (37.0 GiB in float32), planned on 128 devices.

24 identical Transformer blocks of 20 variables each (four attention
projections, three MLP projections, all with biases, and three layer
norms), an embedding, a final norm and a head: the size of the model in
issue 37. Only ever built abstractly (`fdt.plan` of `make_model`) on
`MESH`, 8 x 16 abstract devices.

Target for the command line: ``big_model:make_model`` with ``--mesh
data=8,model=16 --rules`` `RULES_YAML`.
"""

from __future__ import annotations

import jax
from flax import nnx

LAYERS = 24
EMBED = 6144
MLP = 13824
VOCAB = 16384
MESH = jax.sharding.AbstractMesh((8, 16), ('data', 'model'))
MESH_FLAG = 'data=8,model=16'
RULES = [
  ('embed', 'data'),
  ('mlp', 'model'),
  ('heads', 'model'),
  ('vocab', 'model'),
]
RULES_YAML = """\
logical_axis_rules:
  - [embed, data]
  - [mlp, model]
  - [heads, model]
  - [vocab, model]
"""


def _dense(din, dout, axes, rngs):
  init = nnx.with_partitioning(nnx.initializers.lecun_normal(), axes)
  bias = nnx.with_partitioning(nnx.initializers.zeros_init(), axes[1:])
  return nnx.Linear(din, dout, kernel_init=init, bias_init=bias, rngs=rngs)


def _norm(rngs):
  return nnx.LayerNorm(
    EMBED,
    scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ('embed',)),
    bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ('embed',)),
    rngs=rngs,
  )


class Attention(nnx.Module):
  def __init__(self, rngs):
    self.q = _dense(EMBED, EMBED, ('embed', 'heads'), rngs)
    self.k = _dense(EMBED, EMBED, ('embed', 'heads'), rngs)
    self.v = _dense(EMBED, EMBED, ('embed', 'heads'), rngs)
    self.o = _dense(EMBED, EMBED, ('heads', 'embed'), rngs)


class Mlp(nnx.Module):
  def __init__(self, rngs):
    self.gate = _dense(EMBED, MLP, ('embed', 'mlp'), rngs)
    self.up = _dense(EMBED, MLP, ('embed', 'mlp'), rngs)
    self.down = _dense(MLP, EMBED, ('mlp', 'embed'), rngs)


class Block(nnx.Module):
  def __init__(self, rngs):
    self.attn_norm = _norm(rngs)
    self.attn = Attention(rngs)
    self.mlp_norm = _norm(rngs)
    self.mlp = Mlp(rngs)
    self.post_norm = _norm(rngs)


class Model(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(
      VOCAB,
      EMBED,
      embedding_init=nnx.with_partitioning(
        nnx.initializers.normal(), ('vocab', 'embed')
      ),
      rngs=rngs,
    )
    self.layers = nnx.List([Block(rngs) for _ in range(LAYERS)])
    self.final_norm = _norm(rngs)
    self.head = nnx.Linear(
      EMBED,
      VOCAB,
      use_bias=False,
      kernel_init=nnx.with_partitioning(
        nnx.initializers.lecun_normal(), ('embed', 'vocab')
      ),
      rngs=rngs,
    )


def make_model() -> Model:
  return Model(nnx.Rngs(0))


# What one device holds of the parameters under `RULES` on `MESH` (every
# dimension divides evenly): each variable's bytes over the devices that
# split it.
PARAMS_PER_DEVICE = (
  2 * VOCAB * EMBED * 4 // 128  # embed, head
  + 2 * EMBED * 4 // 8  # final_norm
  + LAYERS
  * (
    4 * EMBED * EMBED * 4 // 128  # q, k, v, o
    + 3 * EMBED * 4 // 16  # q, k, v biases (heads -> model)
    + EMBED * 4 // 8  # o bias (embed -> data)
    + 3 * EMBED * MLP * 4 // 128  # gate, up, down
    + 2 * MLP * 4 // 16  # gate, up biases
    + EMBED * 4 // 8  # down bias
    + 6 * EMBED * 4 // 8  # three norms
  )
)
