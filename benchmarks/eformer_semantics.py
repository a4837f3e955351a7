"""Path rules against eformer's ``match_partition_rules``, on generated cases.

eformer (0.0.101) installs beside jax 0.10.2, but pulls in ray, tensorstore,
google-cloud-storage and their dependencies, so it stays out of this
project's environments: it runs in a virtual environment of its own, given
as ``--eformer-python``. This script generates cases (flat trees of
abstract arrays at '/'-joined paths, ordered rules of patterns and
``PartitionSpec`` s, a size threshold), runs eformer on them in that
interpreter, and compares, wherever both define the result:

- which rule applies: the first whose pattern ``re.search``-es the path;
- the threshold: smaller arrays, and scalars, stay replicated;
- the spec fitted to the mesh and the shape: ``fdt.plan``'s spec against
  eformer's ``get_corrected_named_sharding`` of its matched spec.

Both define the result when a rule matches every path (eformer raises
otherwise; the cases end with a catch-all) and a matched spec has the
array's rank (eformer cuts a longer spec and pads a shorter one with
trailing ``None``; flax_dtensor refuses both, and leads with ``...`` to
pad instead). Usage::

  python -m venv /tmp/eformer-venv
  /tmp/eformer-venv/bin/pip install eformer
  python benchmarks/eformer_semantics.py \\
      --eformer-python /tmp/eformer-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import harness

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

PATHS = (
  'embed/embedding',
  'layers/0/attn/query/kernel',
  'layers/1/attn/query/kernel',
  'layers/0/attn/out/kernel',
  'layers/0/mlp/up/kernel',
  'layers/0/mlp/up/bias',
  'layers/1/mlp/down/kernel',
  'layers/0/norm/scale',
  'final_norm/scale',
  'head/kernel',
)
PATTERNS = (
  r'kernel$',
  r'attn/.*/kernel',
  r'^layers/0/',
  r'embedding',
  r'mlp/(up|down)/kernel$',
  r'scale',
  r'query',
  r'^head',
  r'bias$',
  r'nothing',
)
ENTRIES = (None, 'data', 'model', 'fsdp', ('data', 'model'), ('model', 'data'))
SIZES = (1, 2, 4, 8, 16, 32, 3, 6)

EFORMER = r"""
import json, os, sys
os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
import jax, numpy as np
from jax.sharding import PartitionSpec as P
from eformer.escale import get_corrected_named_sharding, match_partition_rules

def spec(entries):
  return P(*[tuple(e) if isinstance(e, list) else e for e in entries])

def text(s):
  return [list(e) if isinstance(e, tuple) else e for e in s]

mesh = jax.make_mesh((2, 4), ('data', 'model'))
out = []
for case in json.load(sys.stdin):
  rules = [(p, spec(s)) for p, s in case['rules']]
  tree = {k: jax.ShapeDtypeStruct(tuple(v), np.float32)
          for k, v in case['leaves'].items()}
  matched = match_partition_rules(rules, tree, min_size=case['min_size'])
  with mesh:
    fitted = {k: text(get_corrected_named_sharding(tree[k].shape, s).spec)
              for k, s in matched.items()}
  out.append({'matched': {k: text(s) for k, s in matched.items()},
              'fitted': fitted})
print(json.dumps(out))
"""


def _case(rng: random.Random) -> dict:
  leaves = {}
  for path in rng.sample(PATHS, rng.randint(1, len(PATHS))):
    rank = rng.randint(0, 3)
    leaves[path] = [rng.choice(SIZES) for _ in range(rank)]
  rules = []
  for _ in range(rng.randint(0, 5)):
    rank = rng.randint(1, 3)
    entries, used = [], set()
    for _ in range(rank):
      entry = rng.choice(ENTRIES)
      axes = {entry} if isinstance(entry, str) else set(entry or ())
      if axes & used:
        entry = None
      used |= axes
      entries.append(list(entry) if isinstance(entry, tuple) else entry)
    rules.append([rng.choice(PATTERNS), entries])
  rules.append(['.*', []])  # eformer raises where nothing matches.
  return {
    'leaves': leaves,
    'rules': rules,
    'min_size': rng.choice((0, 0, 8, 64)),
  }


def _ours(case: dict) -> dict[str, list | None]:
  """{path: flax_dtensor's fitted spec, or None where it refuses the rank}."""
  import jax
  import numpy as np
  from jax.sharding import AbstractMesh
  from jax.sharding import PartitionSpec as P

  import flax_dtensor as fdt
  from flax_dtensor._rules import _spec

  def spec(entries):
    return P(*[tuple(e) if isinstance(e, list) else e for e in entries])

  rules = fdt.LogicalRules(
    [],
    path_rules=[(p, spec(s)) for p, s in case['rules']],
    min_size=case['min_size'],
  )
  mesh = AbstractMesh((2, 4), ('data', 'model'))
  out: dict[str, list | None] = {}
  for path, shape in case['leaves'].items():
    value = jax.ShapeDtypeStruct(tuple(shape), np.float32)
    try:
      resolution = _spec.spec_of_array(value, path=path, rules=rules, mesh=mesh)
    except fdt.ShardingResolutionError:
      out[path] = None
      continue
    entries = [] if resolution is None else list(resolution.spec)
    out[path] = _canonical(
      [list(x) if isinstance(x, tuple) else x for x in entries], len(shape)
    )
  return out


def _canonical(entries: list, rank: int) -> list:
  return list(entries) + [None] * (rank - len(entries))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--eformer-python', required=True)
  parser.add_argument('--cases', type=int, default=2000)
  parser.add_argument('--seed', type=int, default=0)
  args = parser.parse_args()
  rng = random.Random(args.seed)
  cases = [_case(rng) for _ in range(args.cases)]
  theirs = harness.run_elsewhere(args.eformer_python, EFORMER, cases, 1800)
  counts = {
    'compared': 0,
    'agree': 0,
    'of which sharded': 0,
    'of which fitted to the mesh or shape': 0,
    'of which below the threshold': 0,
    'rank differs (we refuse)': 0,
  }
  disagreements = []
  for case, eformer in zip(cases, theirs, strict=True):
    ours = _ours(case)
    for path, shape in case['leaves'].items():
      mine = ours[path]
      if mine is None:
        counts['rank differs (we refuse)'] += 1
        continue
      counts['compared'] += 1
      want = _canonical(eformer['fitted'][path], len(shape))
      matched = _canonical(eformer['matched'][path], len(shape))
      if mine == want:
        counts['agree'] += 1
        counts['of which sharded'] += any(want)
        counts['of which fitted to the mesh or shape'] += matched != want
        size = 1
        for n in shape:
          size *= n
        counts['of which below the threshold'] += bool(
          shape and size < case['min_size']
        )
      else:
        disagreements.append(
          {'case': case, 'path': path, 'ours': mine, 'eformer': want}
        )
  print(json.dumps(counts | {'disagree': len(disagreements)}, indent=1))
  for d in disagreements[:5]:
    print(json.dumps(d))
  sys.exit(1 if disagreements else 0)


if __name__ == '__main__':
  main()
