"""Writes the memory page's figures: the demo's plan as SVG and as a page.

Usage (from the repository's root)::

  python docs/memory_figures.py

writes ``docs/_static/plan_demo_memory.svg`` (bytes per device),
``docs/_static/plan_demo_mesh.svg`` (the mesh by load) and
``docs/_static/plan_demo.html`` (the page ``flax-dtensor plan --html``
writes). They are committed; tests/docs/memory_figures_test.py checks that
this script still writes them byte for byte, so run it after changing how
the plan draws.
"""

from __future__ import annotations

import pathlib

STATIC = pathlib.Path(__file__).resolve().parent / '_static'
BUDGET = 2**20  # 1 MiB per device.


def figures() -> dict[str, str]:
  """{file name: text} of the figures, from the demo's plan with AdamW on
  an abstract 2 x 4 mesh."""
  import jax
  import optax

  import flax_dtensor as fdt
  from flax_dtensor._planning import _plan_chart
  from flax_dtensor.demo.model import make_model
  from flax_dtensor.demo.train import default_rules

  mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
  plan = fdt.plan(
    make_model, mesh=mesh, rules=default_rules(), optimizer=optax.adamw(1e-3)
  )
  return {
    'plan_demo_memory.svg': _plan_chart.memory_svg(plan, budget=BUDGET) + '\n',
    'plan_demo_mesh.svg': _plan_chart.mesh_svg(plan, budget=BUDGET) + '\n',
    'plan_demo.html': plan.to_html(budget=BUDGET),
  }


def main() -> None:
  for name, text in figures().items():
    (STATIC / name).write_text(text, encoding='utf-8')
    print(f'wrote docs/_static/{name}')


if __name__ == '__main__':
  main()
