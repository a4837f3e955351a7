"""Every Python block of the docs runs as written, page by page.

A page's blocks run in order in one fresh process on 8 virtual CPU devices,
in an empty directory, as a reader pasting them one after another would run
them. Where a page's text names something a block takes as given (the
reader's own model, a trained optimizer), `GIVEN` supplies it before that
block; the names are the ones the page uses. A block that sets its own
devices (`jax.config.update('jax_num_cpu_devices', ...)`) stands alone: it
runs in a fresh process of its own, with no devices from the environment,
as on a reader's laptop, followed by its check in `ALONE_CHECKS`. YAML
blocks are parsed as rules. The README's blocks are run by readme_test.py,
the notebooks by the docs build.
"""

import pathlib
import re

import pytest
import script_util

import flax_dtensor as fdt

DOCS = pathlib.Path(__file__).resolve().parents[1] / 'docs'
BLOCK = re.compile(r'^```(python|yaml)\n(.*?)^```', re.S | re.M)
# A block that sets its own device count runs alone.
ALONE = re.compile(r"^jax\.config\.update\('jax_num_cpu_devices'", re.M)

_DEMO = """
import jax, optax
from flax import nnx
import flax_dtensor as fdt
from flax_dtensor.demo.model import make_model
from flax_dtensor.demo.train import default_rules
rules = default_rules()
"""

# {(page, block index): code run before that block}
GIVEN = {
  ('export_guide.md', 0): _DEMO,
  ('export_guide.md', 1): (
    'with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):\n'
    '  optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)\n'
    '  abstract_optimizer = nnx.eval_shape(\n'
    '      lambda: nnx.Optimizer(make_model(), optax.adamw(1e-3),\n'
    '                            wrt=nnx.Param))\n'
  ),
}

# {(page, n): code run after the n-th block of the page that stands alone,
# checking what it did}
ALONE_CHECKS = {
  ('export_guide.md', 0): (
    'import numpy as np\n'
    'want = np.asarray(layer.kernel[...]) * 2\n'
    'np.testing.assert_array_equal(np.asarray(back.kernel[...]), want)\n'
    'np.testing.assert_array_equal(\n'
    '    np.asarray(back.bias[...]), np.asarray(layer.bias[...]))\n'
    "assert back.kernel[...].sharding.spec == jax.P('model', 'data')\n"
    'print("CHECKED")\n'
  ),
  ('export_guide.md', 1): (
    'import numpy as np\n'
    'e = np.asarray(embed.embedding[...])\n'
    'k = np.asarray(head.kernel[...])\n'
    'dt = tf.experimental.dtensor\n'
    'full = dt.Layout.replicated(dt.fetch_layout(scores).mesh, 2)\n'
    'got = dt.unpack(dt.relayout(scores, full))[0].numpy()\n'
    'np.testing.assert_allclose(got, e @ k, rtol=1e-4, atol=1e-4)\n'
    "assert [r.path for r in report.relaid] == ['embed/embedding', "
    "'head/kernel']\n"
    "assert report.relaid[0].spec == jax.P('model')\n"
    "reader = tf.train.load_checkpoint('tf_ckpt/ckpt')\n"
    'table = reader.get_tensor(\n'
    "    'state/embed/embedding/.ATTRIBUTES/VARIABLE_VALUE')\n"
    'np.testing.assert_array_equal(table, e)\n'
    'print("CHECKED")\n'
  ),
  ('export_guide.md', 2): (
    'import numpy as np\n'
    "loaded = tf.saved_model.load('saved_model')\n"
    'x = np.ones((3, 16), np.float32)\n'
    "out = loaded.signatures['serving_default'](x=tf.constant(x))\n"
    'got = list(out.values())[0].numpy()\n'
    'want = np.asarray(model(jax.numpy.asarray(x)))\n'
    'np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)\n'
    'print("CHECKED")\n'
  ),
}

# {page: code run after its blocks, checking what they did}
CHECKS = {
  'concepts.md': (
    "assert layer.kernel[...].sharding.spec == jax.P('data', 'model')\n"
    "assert fdt.LogicalRules(rules).candidates('embed') == ('fsdp', 'data')\n"
    'print("CHECKED")\n'
  ),
  'export_guide.md': (
    'import numpy as np\n'
    'for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):\n'
    '  r = nnx.to_flat_state(nnx.state(restored, nnx.Param))\n'
    '  got = dict(r)[path]\n'
    '  np.testing.assert_array_equal(np.asarray(got[...]),\n'
    '                                np.asarray(v[...]))\n'
    '  assert got[...].sharding.spec == v[...].sharding.spec, path\n'
    "mu = restored_opt.opt_state[0].mu['layers'][0]['mlp']['up']['kernel']\n"
    "assert mu[...].sharding.spec == jax.P('data', 'model'), mu[...].sharding\n"
    'print("CHECKED")\n'
  ),
  'getting_started.md': (
    'import numpy as np\n'
    "reader = tf.train.load_checkpoint('ckpt')\n"
    'loaded = tf.saved_model.load("sm")\n'
    'x = np.ones((2, 512), np.float32)\n'
    'with jax.set_mesh(mesh):\n'
    '  want = np.asarray(model(jax.numpy.asarray(x)))\n'
    'got = list(loaded.signatures.values())[0](tf.constant(x))\n'
    'got = np.asarray(list(got.values())[0])\n'
    'np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)\n'
    "assert model.up.kernel[...].sharding.spec == jax.P(None, 'model')\n"
    'print("CHECKED")\n'
  ),
  'golden_layouts.md': (
    "assert changes.moved == ('embed/embedding', 'head/kernel'), changes\n"
    'assert changes.added == changes.removed == ()\n'
    'test_layout_is_golden()\n'
    'print("CHECKED")\n'
  ),
  'path_rules.md': (
    "assert model.layers[0].up.kernel[...].sharding.spec == jax.P('data', "
    "'model')\n"
    "assert eager.layers[1].down.kernel[...].sharding.spec == jax.P('model', "
    "'data')\n"
    'for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(eager)):\n'
    '  assert np.array_equal(np.asarray(a), np.asarray(b))\n'
    "assert placed['embed']['embedding'].sharding.spec == jax.P('model', "
    "'data')\n"
    "assert not any(placed['layers'][0]['up']['bias'].sharding.spec)\n"
    'print("CHECKED")\n'
  ),
  'linting.md': (
    "assert report.codes() == ('unknown-mesh-axis', 'shadowed-rule'), report\n"
    'assert "Did you mean \'model\'?" in str(report)\n'
    'print("CHECKED")\n'
  ),
  'memory.md': (
    'assert report.estimated_arguments == report.xla["arguments"], report\n'
    'by = plan.bytes_per_device_by_category()\n'
    "assert by['optimizer'] >= 2 * by['params'] > 0, by\n"
    'print("CHECKED")\n'
  ),
  'cli.md': (
    'import json\n'
    "meta = json.load(open('state/_CHECKPOINT_METADATA'))\n"
    "assert 'init_timestamp_nsecs' in meta, meta\n"
    'print("CHECKED")\n'
  ),
}


def _blocks(page: str) -> list[tuple[str, str]]:
  return BLOCK.findall((DOCS / page).read_text())


def _python(page: str, *, alone: bool) -> list[str]:
  """The page's Python blocks that stand alone, or those that do not."""
  return [
    code
    for kind, code in _blocks(page)
    if kind == 'python' and bool(ALONE.search(code)) == alone
  ]


PAGES = sorted(
  p.name for p in DOCS.glob('*.md') if _python(p.name, alone=False)
)
STANDALONE = [
  (p.name, n)
  for p in sorted(DOCS.glob('*.md'))
  for n in range(len(_python(p.name, alone=True)))
]


def test_the_pages_with_code_are_found():
  assert {
    'concepts.md',
    'export_guide.md',
    'getting_started.md',
    'cli.md',
  } <= set(PAGES)
  assert set(CHECKS) == set(PAGES), 'every page with code checks its result'
  assert set(ALONE_CHECKS) == set(STANDALONE), 'every block alone checks too'


@pytest.mark.parametrize('page', PAGES)
def test_page_runs_as_written(tmp_path, page):
  parts = []
  python = _python(page, alone=False)
  for i, code in enumerate(python):
    parts.append(GIVEN.get((page, i), ''))
    parts.append(code)
  parts.append(CHECKS[page])
  script = tmp_path / 'page.py'
  script.write_text('\n'.join(parts))
  run = script_util.run_script(script, tmp_path, timeout=600)
  assert run.returncode == 0, f'{page}:\n{run.stderr[-4000:]}'
  assert run.stdout.rstrip().endswith('CHECKED')


@pytest.mark.parametrize('page, n', STANDALONE)
def test_block_runs_alone(tmp_path, page, n):
  code = _python(page, alone=True)[n]
  script = tmp_path / 'block.py'
  script.write_text(code + '\n' + ALONE_CHECKS[page, n])
  run = script_util.run_script(
    script, tmp_path, timeout=600, devices_from_env=False
  )
  assert run.returncode == 0, f'{page} block {n}:\n{run.stderr[-4000:]}'
  assert run.stdout.rstrip().endswith('CHECKED')


@pytest.mark.parametrize('page', sorted(p.name for p in DOCS.glob('*.md')))
def test_yaml_rules_blocks_parse(page):
  for kind, code in _blocks(page):
    if kind == 'yaml' and 'logical_axis_rules' in code:
      rules = fdt.LogicalRules.from_yaml_text(code)
      assert len(rules) + len(rules.path_rules) == code.count('\n  - ')
