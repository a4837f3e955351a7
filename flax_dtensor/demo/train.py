"""Training the demo model: default rules, optimizer, loss and train step."""

from __future__ import annotations

import importlib.resources
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import flax_dtensor as fdt
from flax_dtensor.demo import model as model_lib

RULES_FILE = 'rules.yaml'


def rules_text() -> str:
  """Returns the text of the default rules (``rules.yaml``, MaxText format)."""
  files = importlib.resources.files('flax_dtensor.demo')
  return (files / RULES_FILE).read_text()


def default_rules() -> fdt.LogicalRules:
  """Returns the demo's default logical-axis rules.

  Example:
    >>> from flax_dtensor.demo import train
    >>> train.default_rules().candidates('embed')
    ('fsdp', 'data', None)
  """
  return fdt.LogicalRules.from_yaml_text(rules_text())


def load_rules(path: str | os.PathLike[str] | None) -> fdt.LogicalRules:
  """Returns the rules in the YAML file at `path`, or the default rules."""
  if path is None:
    return default_rules()
  return fdt.LogicalRules.from_yaml(os.fspath(path))


def make_optimizer(
  model: nnx.Module, *, learning_rate: float = 3e-3, steps: int = 1000
) -> nnx.Optimizer:
  """Returns AdamW with warmup and cosine decay, its state sharded like
  the params."""
  schedule = optax.warmup_cosine_decay_schedule(
    0.0,
    learning_rate,
    warmup_steps=max(1, min(20, steps // 10)),
    decay_steps=max(steps, 2),
    end_value=learning_rate / 10,
  )
  tx = optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01)
  )
  return nnx.Optimizer(model, tx, wrt=nnx.Param)


class TrainState(nnx.Module):
  """The model and its optimizer, saved and restored as one by step."""

  def __init__(self, model: nnx.Module, optimizer: nnx.Optimizer):
    self.model = model
    self.optimizer = optimizer


def loss_fn(model: model_lib.TransformerLM, batch: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy (nats per byte) of a batch of windows."""
  logits = model(batch[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, batch[:, 1:]
  ).mean()


@nnx.jit
def train_step(
  model: model_lib.TransformerLM, optimizer: nnx.Optimizer, batch: jax.Array
) -> jax.Array:
  """One optimizer step; returns the loss before the update."""
  loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
  optimizer.update(model, grads)
  return loss


@nnx.jit
def eval_loss(model: model_lib.TransformerLM, batch: jax.Array) -> jax.Array:
  """The loss of a batch, without updating anything."""
  return loss_fn(model, batch)


def shard_batch(batch: np.ndarray) -> jax.Array:
  """Places a batch of token windows by ``('batch', None)``.

  Uses the current mesh and rules; without them, returns a plain array.
  """
  batch = np.asarray(batch, np.int32)
  mesh = jax.sharding.get_mesh()
  if fdt.get_logical_axis_rules() is None or mesh.empty:
    return jnp.asarray(batch)
  spec = fdt.logical_to_mesh_axes(('batch', None), batch.shape, mesh=mesh)
  return jax.device_put(batch, jax.sharding.NamedSharding(mesh, spec))
