"""Planning: `fdt.plan(factory)` against Flax's ``nnx.eval_shape``
(group `plan`).
"""

from __future__ import annotations

import time

import harness
import models


def plan(method: str, variables: int) -> dict:
  jax = harness.cpu_jax()
  from flax import nnx

  import flax_dtensor as fdt

  mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
  rules = fdt.LogicalRules([('embed', 'data'), ('mlp', 'model')])
  factory = models.many_variables(variables)
  before = harness.reset_peak()
  start = time.perf_counter()
  if method == 'fdt_plan_factory':
    result = fdt.plan(factory, mesh=mesh, rules=rules)
    count = len(result.entries)
  elif method == 'flax_eval_shape':
    with (
      jax.sharding.use_abstract_mesh(mesh),
      nnx.logical_axis_rules(tuple(rules)),
    ):
      abstract = nnx.eval_shape(factory)
    count = len(jax.tree.leaves(nnx.state(abstract)))
  elif method == 'eval_shape_then_plan':
    with jax.sharding.use_abstract_mesh(mesh), fdt.logical_axis_rules(rules):
      abstract = nnx.eval_shape(factory)
      count = len(fdt.plan(abstract).entries)
  else:
    raise ValueError(method)
  seconds = time.perf_counter() - start
  return {
    'seconds': seconds,
    'rss_before_mib': before,
    'rss_peak_mib': harness.rss_mib(),
    'variables': count,
  }


CASES = {'plan': plan}


def full():
  return {
    'plan': [
      harness.case('plan', {'variables': n}, {'ours': 'fdt_plan_factory'})
      for n in (1000, 2500, 5000, 10000)
    ]
    + [
      harness.case('plan', {'variables': n}, {'peer': 'flax_eval_shape'})
      for n in (250, 500, 1000)
    ],
  }


def quick():
  return {
    'plan': [
      harness.case('plan', {'variables': 200}, {'ours': 'fdt_plan_factory'}),
      harness.case('plan', {'variables': 100}, {'peer': 'flax_eval_shape'}),
    ],
  }
