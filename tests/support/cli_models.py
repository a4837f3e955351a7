"""The user's model files the command line loads in the CLI tests.

The CLI loads this file by its path (`USER_TARGET`) or as the module
`support.cli_models`; it imports nothing of the tests.
"""

from __future__ import annotations

import pathlib
import textwrap

import jax
import jax.numpy as jnp
from flax import nnx

FILE = pathlib.Path(__file__).resolve()


USER_TARGET = f'{FILE}:user_model'


LM_TARGET = f'{FILE}:user_lm'


USER_RULES = textwrap.dedent("""\
  # A user's rules: 'hidden' prefers 'model', falls back to 'data'.
  logical_axis_rules:
    - ['features', 'data']
    - ['hidden', 'model']
    - ['hidden', 'data']
    - ['classes', null]
  """)


class UserMLP(nnx.Module):
  """A user's model: 'hidden' of size 6 does not divide 'model' (4)."""

  def __init__(self, *, features: int, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    self.hidden = nnx.Linear(
      features,
      6,
      kernel_init=nnx.with_partitioning(init, ('features', 'hidden')),
      bias_init=nnx.with_partitioning(nnx.initializers.zeros, ('hidden',)),
      rngs=rngs,
    )
    self.out = nnx.Linear(
      6,
      3,
      kernel_init=nnx.with_partitioning(init, ('hidden', 'classes')),
      use_bias=False,
      rngs=rngs,
    )

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


def user_model() -> UserMLP:
  """The factory the CLI calls: takes no arguments, returns the module."""
  return UserMLP(features=16, rngs=nnx.Rngs(1))


class UserHiddenOnly(nnx.Module):
  """`UserMLP`'s first layer only: a model the checkpoint holds more than."""

  def __init__(self, *, features: int, rngs: nnx.Rngs):
    self.hidden = UserMLP(features=features, rngs=rngs).hidden


def user_hidden_only() -> UserHiddenOnly:
  return UserHiddenOnly(features=16, rngs=nnx.Rngs(1))


def user_model_with_head() -> nnx.Module:
  """`user_model` and one layer more: no checkpoint of `user_model` fits."""
  model = user_model()
  model.head = nnx.Linear(3, 2, rngs=nnx.Rngs(2))
  return model


def huge_user_model() -> nnx.Module:
  """40 GB of float32 params: `plan` must not allocate them."""
  init = nnx.with_partitioning(nnx.initializers.zeros, ('features', 'hidden'))
  return nnx.Linear(100_000, 100_000, kernel_init=init, rngs=nnx.Rngs(0))


def not_a_module() -> int:
  return 3


def a_string() -> str:
  return 'str'


def a_tuple() -> tuple:
  return (user_model(), 'v1')


class UserLM(nnx.Module):
  """A user's LLM in another library's style: `(tokens, positions, cache,
  attention_mask) -> (logits, cache)`, served with the cache None."""

  def __init__(self, *, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    self.embed = nnx.Embed(
      64,
      16,
      embedding_init=nnx.with_partitioning(init, ('classes', 'features')),
      rngs=rngs,
    )
    self.qkv = nnx.Param(
      nnx.with_partitioning(init, (None, 'features', 'hidden', None))(
        rngs.params(), (3, 16, 4, 4)
      )
    )

  def __call__(self, tokens, positions, cache, attention_mask):

    x = self.embed(tokens) + self.embed(positions)
    q, k, v = jnp.einsum('btd,sdhk->sbthk', x, self.qkv[...])
    scores = jnp.einsum('bthk,bshk->bhts', q, k)
    scores = jnp.where(attention_mask[:, None], scores, -1e9)
    h = jnp.einsum('bhts,bshk->bthk', jax.nn.softmax(scores, axis=-1), v)
    return self.embed.attend(x + h.reshape(x.shape)), cache

  def tagged(self, tokens, positions, cache, attention_mask):
    return self(tokens, positions, cache, attention_mask)[0], 'v1'


def user_lm() -> UserLM:
  return UserLM(rngs=nnx.Rngs(2))
