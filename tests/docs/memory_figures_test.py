"""The memory page's figures are what docs/memory_figures.py writes now."""

import importlib.util
import pathlib

DOCS = pathlib.Path(__file__).resolve().parents[2] / 'docs'


def test_the_committed_figures_are_current():
  spec = importlib.util.spec_from_file_location(
    'memory_figures', DOCS / 'memory_figures.py'
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  figures = module.figures()
  assert set(figures) == {
    'plan_demo_memory.svg',
    'plan_demo_mesh.svg',
    'plan_demo.html',
  }
  for name, text in figures.items():
    committed = (DOCS / '_static' / name).read_text(encoding='utf-8')
    assert text == committed, (
      f'docs/_static/{name} is stale: run python docs/memory_figures.py'
    )
  # What the page shows: the demo's 780.0 KiB against a 1 MiB budget.
  assert 'budget 1.0 MiB per device: fits' in figures['plan_demo.html']
  assert figures['plan_demo_mesh.svg'].count('class="device"') == 8
