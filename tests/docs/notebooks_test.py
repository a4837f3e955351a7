"""The notebooks: jupytext pairs in sync, outputs stripped, 8 devices first.

Executing them is CI's job (the docs build, or `pytest --nbmake notebooks/`);
these checks are cheap and keep the pairs honest.
"""

import json
import pathlib

import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / 'notebooks'
PAIRS = sorted(NOTEBOOKS.glob('*.md'))


def test_there_are_notebooks():
  assert len(PAIRS) >= 2


@pytest.mark.parametrize('md', PAIRS, ids=lambda p: p.stem)
def test_pair_in_sync_and_stripped(md):
  jupytext = pytest.importorskip('jupytext')
  ipynb = md.with_suffix('.ipynb')
  assert ipynb.exists(), f'run: jupytext --to ipynb {md}'
  from_md = jupytext.read(md)
  notebook = json.loads(ipynb.read_text())
  sources = [
    (c['cell_type'], ''.join(c['source']).strip()) for c in notebook['cells']
  ]
  expected = [(c.cell_type, c.source.strip()) for c in from_md.cells]
  assert sources == expected, f'out of sync: jupytext --sync {md}'
  for cell in notebook['cells']:
    assert not cell.get('outputs'), f'{ipynb.name}: strip the outputs'
    assert cell.get('execution_count') is None


@pytest.mark.parametrize('md', PAIRS, ids=lambda p: p.stem)
def test_first_code_cell_forces_8_cpu_devices(md):
  text = md.read_text()
  first = text.split('```{code-cell} ipython3', 1)[1].split('```', 1)[0]
  assert '--xla_force_host_platform_device_count=8' in first
  assert "jax.config.update('jax_num_cpu_devices', 8)" in first
