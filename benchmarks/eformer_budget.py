"""Per-device bytes of `fdt.suggest_rules` against eformer's, same trees.

eformer proposes specs itself: ``auto_partition_spec`` (each array's
largest dimensions on the largest mesh axes that divide them) and
``optimize_sharding_for_memory`` (the same for every array of at least
``max_memory_per_device`` bytes, the others replicated). This script builds
three decoders at their published sizes, abstractly (nothing allocated):
Mistral-7B with Hugging Face names, Gemma-2B with Gemma's einsum names and
GPT-2 small with GPT-2's, each as a flat tree of its parameters and Adam's
two moments. It runs eformer on that tree in its own interpreter (it pulls
in ray and tensorstore, so it stays out of this project's environments; see
`eformer_semantics.py`), and `suggest_rules` on the same tree with the
same budgets, on a 2x4 mesh, and prints a Markdown table of the MiB one
device holds. Usage::

  python -m venv /tmp/eformer-venv
  /tmp/eformer-venv/bin/pip install "jax==0.10.2" eformer
  python benchmarks/eformer_budget.py \\
      --eformer-python /tmp/eformer-venv/bin/python
"""

from __future__ import annotations

import argparse
import math
import os

import harness

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

EFORMER = r"""
import json, os, sys
os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
import jax, numpy as np
from eformer.escale import auto_partition_spec, optimize_sharding_for_memory

mesh = jax.make_mesh((2, 4), ('data', 'model'))
def text(s):
  return [list(e) if isinstance(e, tuple) else e for e in s]
out = []
for case in json.load(sys.stdin):
  tree = {k: np.broadcast_to(np.zeros((), v[1]), tuple(v[0]))
          for k, v in case['leaves'].items()}
  auto = {k: text(auto_partition_spec(x, mesh=mesh)) for k, x in tree.items()}
  fitted = {}
  for budget in case['budgets']:
    specs = optimize_sharding_for_memory(tree, mesh=mesh,
                                         max_memory_per_device=budget)
    fitted[str(budget)] = {k: text(s) for k, s in specs.items()}
  out.append({'auto': auto, 'fitted': fitted})
print(json.dumps(out))
"""

SIZES = {'data': 2, 'model': 4}


def _mistral_7b() -> dict[str, tuple[int, ...]]:
  vocab, d, mlp, layers, kv = 32000, 4096, 14336, 32, 1024
  out = {
    'model/embed_tokens/embedding': (vocab, d),
    'model/norm/scale': (d,),
    'lm_head/kernel': (d, vocab),
  }
  for i in range(layers):
    p = f'model/layers/{i}'
    out |= {
      f'{p}/input_layernorm/scale': (d,),
      f'{p}/post_attention_layernorm/scale': (d,),
      f'{p}/self_attn/q_proj/kernel': (d, d),
      f'{p}/self_attn/k_proj/kernel': (d, kv),
      f'{p}/self_attn/v_proj/kernel': (d, kv),
      f'{p}/self_attn/o_proj/kernel': (d, d),
      f'{p}/mlp/gate_proj/kernel': (d, mlp),
      f'{p}/mlp/up_proj/kernel': (d, mlp),
      f'{p}/mlp/down_proj/kernel': (mlp, d),
    }
  return out


def _gemma_2b() -> dict[str, tuple[int, ...]]:
  vocab, d, mlp, layers, heads, hd = 256128, 2048, 16384, 18, 8, 256
  out = {
    'embedder/input_embedding': (vocab, d),
    'final_norm/scale': (d,),
  }
  for i in range(layers):
    p = f'layers/{i}'
    out |= {
      f'{p}/pre_attention_norm/scale': (d,),
      f'{p}/pre_ffw_norm/scale': (d,),
      f'{p}/attn/q_einsum/w': (heads, d, hd),
      f'{p}/attn/kv_einsum/w': (2, 1, d, hd),
      f'{p}/attn/attn_vec_einsum/w': (heads, hd, d),
      f'{p}/mlp/gating_einsum': (2, d, mlp),
      f'{p}/mlp/linear': (mlp, d),
    }
  return out


def _gpt2_small() -> dict[str, tuple[int, ...]]:
  vocab, ctx, d, layers = 50257, 1024, 768, 12
  out = {
    'transformer/wte/embedding': (vocab, d),
    'transformer/wpe/embedding': (ctx, d),
    'transformer/ln_f/scale': (d,),
    'transformer/ln_f/bias': (d,),
  }
  for i in range(layers):
    p = f'transformer/h/{i}'
    out |= {
      f'{p}/ln_1/scale': (d,),
      f'{p}/ln_1/bias': (d,),
      f'{p}/ln_2/scale': (d,),
      f'{p}/ln_2/bias': (d,),
      f'{p}/attn/c_attn/kernel': (d, 3 * d),
      f'{p}/attn/c_attn/bias': (3 * d,),
      f'{p}/attn/c_proj/kernel': (d, d),
      f'{p}/attn/c_proj/bias': (d,),
      f'{p}/mlp/c_fc/kernel': (d, 4 * d),
      f'{p}/mlp/c_fc/bias': (4 * d,),
      f'{p}/mlp/c_proj/kernel': (4 * d, d),
      f'{p}/mlp/c_proj/bias': (d,),
    }
  return out


MODELS = {
  'Mistral-7B (HF names)': _mistral_7b,
  'Gemma-2B (einsum names)': _gemma_2b,
  'GPT-2 small (GPT-2 names)': _gpt2_small,
}


def _with_adam(params: dict[str, tuple[int, ...]]) -> dict[str, tuple]:
  """The parameters and Adam's two moments, float32, as flat leaves."""
  out = {}
  for prefix in ('', 'opt_state/mu/', 'opt_state/nu/'):
    out |= {prefix + k: (list(v), 'float32') for k, v in params.items()}
  return out


def _per_device(leaves: dict[str, tuple], specs: dict[str, list]) -> int:
  total = 0
  for path, (shape, _) in leaves.items():
    spec = specs[path] + [None] * (len(shape) - len(specs[path]))
    split = 1
    for dim, entry in zip(shape, spec, strict=True):
      axes = (
        [] if entry is None else [entry] if isinstance(entry, str) else entry
      )
      n = math.prod(SIZES[a] for a in axes)
      assert dim % n == 0, (path, shape, spec)
      split *= n
    total += math.prod(shape) * 4 // split
  return total


def _mib(n: float) -> str:
  return f'{n / 2**20:,.1f}'


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--eformer-python', required=True)
  args = parser.parse_args()

  import jax
  import numpy as np
  from jax.sharding import AbstractMesh

  import flax_dtensor as fdt

  mesh = AbstractMesh((2, 4), ('data', 'model'))
  cases, trees = [], {}
  for name, make in MODELS.items():
    leaves = _with_adam(make())
    total = sum(math.prod(s) * 4 for s, _ in leaves.values())
    ideal = total / 8
    budgets = [None, int(total / 4), int(ideal * 1.02), int(ideal * 0.9)]
    trees[name] = (leaves, total, budgets)
    cases.append({'leaves': leaves, 'budgets': [b for b in budgets if b]})
  theirs = harness.run_elsewhere(args.eformer_python, EFORMER, cases, 3600)
  print(
    '| tree (params + Adam), MiB | budget | eformer `auto_partition_spec` | '
    'eformer `optimize_sharding_for_memory` | ours `suggest_rules` | fits | '
    'ours - eformer auto |'
  )
  print('|---|---|---|---|---|---|---|')
  for (name, (leaves, total, budgets)), eformer in zip(
    trees.items(), theirs, strict=True
  ):
    tree = {
      k: jax.ShapeDtypeStruct(tuple(s), np.dtype(d))
      for k, (s, d) in leaves.items()
    }
    auto = _per_device(leaves, eformer['auto'])
    for budget in budgets:
      s = fdt.suggest_rules(tree, mesh, budget=budget)
      fitted = '-'
      if budget is not None:
        fitted = _mib(_per_device(leaves, eformer['fitted'][str(budget)]))
      fits = '-' if s.fits is None else 'yes' if s.fits else 'no'
      print(
        f'| {name}, {_mib(total)} | {"none" if budget is None else _mib(budget)}'
        f' | {_mib(auto)} | {fitted} | {_mib(s.bytes_per_device)} '
        f'({s.preset or "generic"}) | {fits} | '
        f'{s.bytes_per_device - auto:+,} B |'
      )


if __name__ == '__main__':
  main()
