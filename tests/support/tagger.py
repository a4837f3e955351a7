"""A small model with several methods to serve: logits of features, an
embedding of token ids, and logits of token ids (tests/bridge/serving)."""

from __future__ import annotations

from flax import nnx

VOCAB = ['<unk>', 'the', 'cat', 'sat', 'on', 'mat']


def _init(names):
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


class Tagger(nnx.Module):
  """Features or token ids to logits, with an embedding method of its own."""

  def __init__(self, rngs):
    self.table = nnx.Embed(
      len(VOCAB), 16, embedding_init=_init(('vocab', 'embed')), rngs=rngs
    )
    self.head = nnx.Linear(
      16, len(VOCAB), kernel_init=_init(('embed', 'mlp')), rngs=rngs
    )

  def __call__(self, x):
    return self.head(x)

  def embed(self, ids):
    return {'embedding': self.table.embedding[...][ids]}

  def logits(self, ids):
    return self.head(self.table.embedding[...][ids])
