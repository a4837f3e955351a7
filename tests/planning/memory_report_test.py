"""Memory per device: the plan's static estimate, to the byte, against XLA."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_dtensor as fdt
from flax_dtensor.demo.model import make_model
from flax_dtensor.demo.train import default_rules

RULES = [('embed', None), ('mlp', 'model'), ('norm', None)]


class Layer(nnx.Module):
  """Runs on Explicit meshes too: no contraction over a sharded axis."""

  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    self.up = nnx.Linear(
      16,
      64,
      kernel_init=nnx.with_partitioning(init, ('embed', 'mlp')),
      bias_init=nnx.with_partitioning(nnx.initializers.zeros, ('mlp',)),
      rngs=rngs,
    )
    self.scale = nnx.Param(jnp.ones(16), out_sharding=('norm',))
    self.calls = nnx.BatchStat(jnp.zeros((), jnp.int32))

  def __call__(self, x):
    return nnx.relu(self.up(x * self.scale[...][None, :]))


def train_step(model, optimizer, batch):
  def loss_fn(m):
    return jnp.mean(m(batch) ** 2)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  model.calls[...] += 1
  return loss


@pytest.mark.parametrize('axis_type', [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize(
  'tx', [optax.adamw(1e-3), optax.sgd(0.1, momentum=0.9)], ids=['adamw', 'sgd']
)
def test_estimate_equals_xla_arguments_to_the_byte(axis_type, tx):
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(axis_type,) * 2)
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    model = Layer(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    batch = jax.device_put(jnp.ones((32, 16)), NamedSharding(mesh, P('data')))
    report = fdt.memory_report(train_step, model, optimizer, batch)
  # Params: kernel 16 x 64 over 'model' (4), bias 64 over 'model', scale 16.
  params = (16 * 64 // 4 + 64 // 4 + 16) * 4
  assert report.estimate['params'] == params
  assert report.estimate['other'] == 4  # The int32 counter.
  assert report.estimate['batch'] == 32 * 16 * 4 // 2
  assert report.estimated_arguments == report.xla['arguments']
  assert report.xla['outputs'] > 0
  text = str(report)
  assert 'static estimate (arguments):' in text and 'compiled by XLA:' in text


def test_plan_with_an_optax_transformation_places_mu_like_params():
  mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
  plan = fdt.plan(
    make_model, mesh=mesh, rules=default_rules(), optimizer=optax.adamw(1e-3)
  )
  alone = fdt.plan(make_model, mesh=mesh, rules=default_rules())
  by = plan.bytes_per_device_by_category()
  assert by['params'] == alone.bytes_per_device == 266240
  # AdamW: mu and nu like the params, plus a few scalar counts.
  assert 2 * by['params'] <= by['optimizer'] < 2 * by['params'] + 64
  for e in alone.entries:
    for moment in ('mu', 'nu'):
      opt = plan[f'optimizer/opt_state/0/{moment}/{e.path}']
      assert opt.spec == e.spec, (moment, e.path)
      assert opt.bytes_per_device == e.bytes_per_device
      assert opt.category == 'optimizer'
  assert '= 260.0 KiB params + 520.0 KiB optimizer' in plan.render(200)


def test_plan_with_a_concrete_optimizer_counts_what_is_placed():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    model = Layer(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    plan = fdt.plan(model, optimizer=optimizer)
  placed = sum(
    x.addressable_shards[0].data.nbytes
    for x in jax.tree.leaves(nnx.state((model, optimizer)))
  )
  assert plan.bytes_per_device == placed
  assert plan['optimizer/opt_state/0/mu/up/kernel'].spec == P(None, 'model')


def test_errors():
  with pytest.raises(fdt.NotAModelError, match=r'expected the model as an nnx'):
    fdt.memory_report(train_step, 'model', None, None)
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    model = Layer(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(fdt.NotAModelError, match=r'batch as .*jax.Arrays'):
      fdt.memory_report(train_step, model, optimizer, [1.0])
  with pytest.raises(fdt.NotAModelError, match=r'needs a module .*got State'):
    fdt.plan(nnx.state(model), optimizer=optax.sgd(0.1))
