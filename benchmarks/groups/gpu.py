"""One accelerator: a Llama-like decoder built, planned and trained on the
local devices (group `gpu`). Needs no TensorFlow: nothing here imports it.
"""

from __future__ import annotations

import sys
import time

import harness
import models
import numpy as np


def _device_peak() -> int | None:
  """The accelerator's peak bytes in use (None where it keeps no count,
  e.g. CPU)."""
  import jax

  stats = jax.local_devices()[0].memory_stats()
  return None if not stats else stats.get('peak_bytes_in_use')


def gpu(
  method: str,
  layers: int,
  dim: int,
  ffn: int,
  vocab: int,
  heads: int,
  batch: int = 1,
  seq: int = 128,
  steps: int = 5,
  cpu_devices: int = 8,
) -> dict:
  """One measurement on the first accelerator (or the CPU, `--quick`):
  the decoder built, planned or trained, on ``jax.make_mesh``'s default
  mesh (Explicit axes) over every local device. A method ending in
  ``_again`` is timed on its second call of the same configuration.
  `cpu_devices`: the CPU's device count, where there is no accelerator.

  `memory_stats` gives the peak device memory; a peak from before the
  step is not reset (JAX cannot), so each measurement is its own process
  and builds nothing before it.
  """
  import jax
  from flax import nnx

  import flax_dtensor as fdt

  # No TensorFlow here: the group runs where it is not installed.
  jax.config.update('jax_num_cpu_devices', cpu_devices)
  tf_before = 'tensorflow' in sys.modules
  Decoder, loss = models.decoder(layers, dim, ffn, vocab, heads)
  mesh = jax.make_mesh((len(jax.devices()), 1), ('data', 'model'))
  rules = models.GPU_RULES
  flax_rules = tuple(rules)
  jax.block_until_ready(jax.numpy.zeros(8) + 1)  # Start the backend.

  @nnx.jit
  def jitted_factory():
    """Flax's documented idiom, defined once: built under jit, the state
    constrained to its partition specs."""
    model = Decoder(nnx.Rngs(0))
    state = nnx.state(model)
    nnx.update(
      model,
      jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)),
    )
    return model

  again = method.endswith('_again')
  base = method.removesuffix('_again')

  def build():
    if base == 'fdt_init':
      return fdt.init(Decoder, nnx.Rngs(0), mesh=mesh, rules=rules)
    if base == 'flax_jit_factory':
      with jax.set_mesh(mesh), nnx.logical_axis_rules(flax_rules):
        return jitted_factory()
    if base == 'fdt_eager':
      with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
        return Decoder(nnx.Rngs(0))
    if base == 'flax_eager':
      with jax.set_mesh(mesh), nnx.logical_axis_rules(flax_rules):
        return Decoder(nnx.Rngs(0))
    if base == 'fdt_plan':
      return fdt.plan(lambda: Decoder(nnx.Rngs(0)), mesh=mesh, rules=rules)
    if base == 'flax_eval_shape':
      with jax.set_mesh(mesh), nnx.logical_axis_rules(flax_rules):
        return nnx.eval_shape(lambda: Decoder(nnx.Rngs(0)))
    raise ValueError(method)

  def ready(x):
    if isinstance(x, nnx.Module):
      jax.block_until_ready(nnx.state(x))
    return x

  result: dict = {}
  if base in ('step_constrained', 'step_plain'):
    import optax

    # The step on Auto axes: the decoder's forward is written for them (an
    # FSDP rule's contracting dimensions would need out_sharding= on
    # Explicit ones), and there the constraint is with_sharding_constraint.
    mesh = jax.make_mesh(
      mesh.axis_sizes,
      mesh.axis_names,
      axis_types=(jax.sharding.AxisType.Auto,) * 2,
    )
    with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
      model = fdt.init(Decoder, nnx.Rngs(0), mesh=mesh, rules=rules)
      optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
      constrained = base == 'step_constrained'

      @nnx.jit
      def step(model, optimizer, tokens):
        value, grads = nnx.value_and_grad(loss)(model, tokens, constrained)
        optimizer.update(model, grads)
        return value

      tokens = jax.random.randint(
        jax.random.key(1), (batch * len(jax.devices()), seq + 1), 0, vocab
      )
      tokens = jax.device_put(tokens, jax.NamedSharding(mesh, jax.P('data')))
      jax.block_until_ready(step(model, optimizer, tokens))  # Compiled.
      before = harness.reset_peak()
      times = []
      for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(step(model, optimizer, tokens))
        times.append(time.perf_counter() - start)
      seconds = float(np.median(times))
  else:
    if again:  # The first call of this configuration, untimed.
      ready(build())
    before = harness.reset_peak()
    start = time.perf_counter()
    model = ready(build())
    seconds = time.perf_counter() - start
    if isinstance(model, nnx.Module):
      params = nnx.state(model, nnx.Param)
      result['param_bytes'] = sum(
        x.size * x.dtype.itemsize for x in jax.tree.leaves(params)
      )
  result.update(
    seconds=seconds,
    rss_before_mib=before,
    rss_peak_mib=harness.rss_mib(),
    device_peak_bytes=_device_peak(),
    device=jax.devices()[0].device_kind,
    tensorflow_imported=tf_before or 'tensorflow' in sys.modules,
  )
  return result


# pinning activations against the same step without; each with the peak
# device memory (`memory_stats`) ÷ the parameter bytes.
_GPU_BUILD = {
  'ours': 'fdt_init',
  'peer': 'flax_jit_factory',
  'ours_again': 'fdt_init_again',
  'peer_again': 'flax_jit_factory_again',
  'ours_eager': 'fdt_eager',
  'peer_eager': 'flax_eager',
  'ours_plan': 'fdt_plan',
  'peer_plan': 'flax_eval_shape',
  'ours_step': 'step_constrained',
  'peer_step': 'step_plain',
}
_GPU_RATIOS = [
  ('ours', 'peer'),
  ('ours_again', 'peer_again'),
  ('ours_eager', 'peer_eager'),
  ('ours_plan', 'peer_plan'),
  ('ours_step', 'peer_step'),
]


def _gpu(layers, dim, ffn, vocab, heads, methods=None, **more):
  methods = _GPU_BUILD if methods is None else methods
  return harness.case(
    'gpu',
    {
      'layers': layers,
      'dim': dim,
      'ffn': ffn,
      'vocab': vocab,
      'heads': heads,
      **more,
    },
    methods,
    [r for r in _GPU_RATIOS if r[0] in methods and r[1] in methods],
    note=f'Llama-like decoder, {layers} blocks, bfloat16, on '
    'jax.make_mesh((devices, 1)) (Explicit axes); peak device memory ÷ '
    'param_bytes',
  )


CASES = {'gpu': gpu}


def full():
  return {
    'gpu': [
      _gpu(16, 2048, 5632, 32000, 16),
      _gpu(
        32,
        2048,
        5632,
        32000,
        16,
        {
          k: _GPU_BUILD[k] for k in ('ours', 'peer', 'ours_again', 'peer_again')
        },
      ),
    ],
  }


def quick():
  # On one CPU device, as on the one GPU (and without 8 devices' SPMD
  # compiles, which the suite runs it for).
  return {'gpu': [_gpu(2, 64, 128, 256, 4, cpu_devices=1)]}
