"""Every code block of the docs runs as written, alone, where it is copied.

Each Python block runs in a fresh process, in an empty directory, without
the test suite's ``XLA_FLAGS``: on one CPU device unless the block sets its
own (see `script_util`). The process is a fork of the session's warm pool
(tests/support/warm.py), so the imports are paid once; a block that says
``# Fresh process: WHY`` gets a new ``python``. A block whose first line is ``# Continues: NAME``
runs after exactly the blocks it names; a block that another continues runs
first in that one's process, so every block runs at least once. Where a
block's result can be checked, `CHECKS` runs after it in the same process.
YAML blocks are parsed as rules. The README's blocks are run by
readme_test.py, the notebooks by the docs build.
"""

from __future__ import annotations

import pathlib

import pytest
from support import script_util

import flax_dtensor as fdt

DOCS = pathlib.Path(__file__).resolve().parents[2] / 'docs'
PAGES = sorted(DOCS.glob('*.md'))
BLOCKS = [b for page in PAGES for b in script_util.code_blocks(page)]
CHAINS = script_util.chains(BLOCKS)

# {block name: code run right after that block, checking what it did}.
CHECKS = {
  'concepts.md:embed-mlp': (
    "assert layer.kernel[...].sharding.spec == jax.P('data', 'model')\n"
  ),
  'concepts.md:fallback-rules': (
    'import flax_dtensor as fdt\n'
    "assert fdt.LogicalRules(rules).candidates('embed') == ('fsdp', 'data')\n"
  ),
  'export_guide.md:single-host': (
    'import numpy as np\n'
    'r = dict(nnx.to_flat_state(nnx.state(restored, nnx.Param)))\n'
    'for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):\n'
    '  np.testing.assert_array_equal(np.asarray(r[path][...]),\n'
    '                                np.asarray(v[...]))\n'
    '  assert r[path][...].sharding.spec == v[...].sharding.spec, path\n'
    'served = tf.saved_model.load("saved_model").signatures\n'
    "assert list(served) == ['serving_default'], served\n"
  ),
  'export_saved_models.md:explicit-axes': (
    # Served at 8 rows as JAX computes them on the mesh, and at 3 (which
    # JAX splits over 'data' on one device only) as the same rows: the
    # forward treats each row alone.
    'x = np.random.default_rng(0).standard_normal((8, 16)).astype("float32")\n'
    'with jax.set_mesh(mesh):\n'
    '  want = np.asarray(model(x))\n'
    'for rows in (8, 3, 1):\n'
    '  got = serve(x=tf.constant(x[:rows]))["output_0"].numpy()\n'
    '  np.testing.assert_allclose(got, want[:rows], rtol=1e-5, atol=1e-5)\n'
  ),
  'export_checkpoints.md:rng-state': (
    'import numpy as np\n'
    'for got in (seeded, resumed):\n'
    '  for path, v in nnx.to_flat_state(nnx.state(got)):\n'
    '    assert isinstance(v.get_value(), jax.Array), path\n'
    '  np.testing.assert_array_equal(\n'
    '    got.linear.kernel[...], model.linear.kernel[...])\n'
    "  assert got.linear.kernel[...].sharding.spec == jax.P('data', 'model')\n"
    'want, have = (\n'
    '  jax.random.key_data(m.dropout.rngs.key.get_value())\n'
    '  for m in (model, resumed))\n'
    'np.testing.assert_array_equal(have, want)\n'
    'assert int(seeded.dropout.rngs.count.get_value()) == 0\n'
    'again = jax.random.key_data(seeded.dropout.rngs.key.get_value())\n'
    'assert not np.array_equal(again, want)\n'
  ),
  'export_checkpoints.md:optimizer-state': (
    "mu = restored_opt.opt_state[0].mu['layers'][0]['mlp']['up']['kernel']\n"
    "assert mu[...].sharding.spec == jax.P('data', 'model'), mu[...].sharding\n"
  ),
  'export_checkpoints.md:failure-kinds': (
    'import numpy as np\n'
    "saved = fdt_dt.read_checkpoint('ckpt_loop')[('w',)]\n"
    'np.testing.assert_array_equal(saved, np.full((8, 16), 3.0))\n'
  ),
  'export_multi_process.md:multi-host': (
    'import os\n'
    "assert len(os.environ['DTENSOR_JOBS'].split(',')) == 2\n"
    'print("PROCESS", jax.process_index(), jax.device_count())\n'
  ),
  'export_way_back.md:way-back': (
    'import numpy as np\n'
    'want = np.asarray(layer.kernel[...]) * 2\n'
    'np.testing.assert_array_equal(np.asarray(back.kernel[...]), want)\n'
    'np.testing.assert_array_equal(\n'
    '    np.asarray(back.bias[...]), np.asarray(layer.bias[...]))\n'
    "assert back.kernel[...].sharding.spec == jax.P('model', 'data')\n"
  ),
  'export_way_back.md:single-mesh': (
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
  ),
  'export_multi_process.md:saved-model-processes': (
    'import numpy as np\n'
    "loaded = tf.saved_model.load('saved_model')\n"
    'x = np.ones((3, 16), np.float32)\n'
    "out = loaded.signatures['serving_default'](x=tf.constant(x))\n"
    'got = list(out.values())[0].numpy()\n'
    'want = np.asarray(model(jax.numpy.asarray(x)))\n'
    'np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)\n'
  ),
  'path_rules.md:unannotated-model': (
    'import numpy as np\n'
    "assert model.layers[0].up.kernel[...].sharding.spec == jax.P('data', "
    "'model')\n"
    "assert eager.layers[1].down.kernel[...].sharding.spec == jax.P('model', "
    "'data')\n"
    'for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(eager)):\n'
    '  assert np.array_equal(np.asarray(a), np.asarray(b))\n'
  ),
  'path_rules.md:shard-tree': (
    "assert placed['embed']['embedding'].sharding.spec == jax.P('model', "
    "'data')\n"
    "assert not any(placed['layers'][0]['up']['bias'].sharding.spec)\n"
  ),
  'path_rules.md:suggest-rules': (
    'import numpy as np\n'
    "assert suggestion.preset == 'hf_llama' and suggestion.fits\n"
    "assert model.lm_head.kernel[...].sharding.spec == jax.P(('fsdp', 'data'), "
    "'model')\n"
    "assert fdt.LogicalRules.from_yaml('rules.yaml') == suggestion.rules\n"
    'device = mesh.devices.flat[0]\n'
    'held = sum(s.data.nbytes for x in jax.tree.leaves(nnx.state(model))\n'
    '           for s in x.addressable_shards if s.device == device)\n'
    "assert held == suggestion.plan.bytes_per_device_by_category()['params']\n"
    'ref = make()\n'
    'for a, b in zip(jax.tree.leaves(nnx.state(model)),\n'
    '                jax.tree.leaves(nnx.state(ref))):\n'
    '  assert np.array_equal(np.asarray(a), np.asarray(b))\n'
  ),
  'getting_started.md:shard-your-own-model': (
    "assert model.up.kernel[...].sharding.spec == jax.P(None, 'model')\n"
  ),
  'getting_started.md:export': (
    'import numpy as np\n'
    "reader = tf.train.load_checkpoint('ckpt')\n"
    'assert reader.get_variable_to_shape_map()[fdt_dt.checkpoint_key(\n'
    "    'up/kernel')] == [512, 2048]\n"
    'loaded = tf.saved_model.load("sm")\n'
    'x = np.random.default_rng(0).standard_normal((4, 512)).astype("float32")\n'
    'with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):\n'
    '  want = np.asarray(model(jax.numpy.asarray(x)))\n'
    'for rows in (4, 3, 1):  # odd batches: each row as JAX computes it\n'
    '  got = list(loaded.signatures.values())[0](tf.constant(x[:rows]))\n'
    '  got = np.asarray(list(got.values())[0])\n'
    '  np.testing.assert_allclose(got, want[:rows], rtol=1e-5, atol=1e-5)\n'
  ),
  'golden_layouts.md:golden-in-python': (
    "assert changes.moved == ('embed/embedding', 'head/kernel'), changes\n"
    'assert changes.added == changes.removed == ()\n'
  ),
  'golden_layouts.md:golden-test': (
    # The golden file the test compares with, as the CLI writes it.
    'mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))\n'
    'pathlib.Path("layout.json").write_text(fdt.plan(\n'
    '    make_model, mesh=mesh, rules=default_rules()).to_json())\n'
    'test_layout_is_golden()\n'
  ),
  'linting.md:check': (
    "assert report.codes() == ('mesh-axis-typo', 'shadowed-rule'), report\n"
    'assert "Did you mean \'model\'?" in str(report)\n'
  ),
  'other_libraries.md:eager-sharding-off': (
    "assert fdt.check(make, rules, mesh).codes() == ('eager-sharding-off',)\n"
    'with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):\n'
    '  with warnings.catch_warnings():\n'
    "    warnings.simplefilter('ignore', fdt.EagerShardingOffWarning)\n"
    '    again = make()\n'
    'assert fdt.check(again, rules, mesh).codes() == (\n'
    "  'eager-sharding-off', 'replicated-large'\n"
    '), fdt.check(again, rules, mesh).codes()\n'
    'assert not fdt.check(unplaced, rules, mesh)  # Placed by shard_module.\n'
    'with nnx.use_eager_sharding(True):\n'
    '  assert not fdt.check(make, rules, mesh)\n'
  ),
  'memory.md:plan-with-optimizer': (
    'by = plan.bytes_per_device_by_category()\n'
    "assert by['optimizer'] >= 2 * by['params'] > 0, by\n"
  ),
  'memory.md:plan-html': (
    "page = pathlib.Path('plan.html').read_text()\n"
    "assert page.startswith('<!DOCTYPE html>') and '<script' not in page\n"
    "assert page.count('<svg') == 2 and 'fits' in page, page[:400]\n"
    "assert plan.bytes_by_device()['optimizer'] == [532488] * 8\n"
  ),
  'memory.md:compiled-step': (
    'assert report.estimated_arguments == report.xla["arguments"], report\n'
  ),
  'cli.md:orbax-checkpoint': (
    'import json\n'
    "meta = json.load(open('state/_CHECKPOINT_METADATA'))\n"
    "assert 'init_timestamp_nsecs' in meta, meta\n"
  ),
}

DONE = 'BLOCK DONE'


def _script(chain: list[script_util.Block]) -> str:
  parts = []
  for block in chain:
    parts += [block.code, CHECKS.get(block.name, '')]
  return '\n'.join([*parts, f'print({DONE!r})\n'])


def _run(chain: list[script_util.Block], tmp: pathlib.Path, pool):
  """Runs a chain in a fresh directory: (exit status, stdout, stderr)."""
  script = tmp / 'block.py'
  code = _script(chain)
  processes = chain[-1].processes
  if processes == 1:
    script.write_text(code)
    run = script_util.run_script(
      script, tmp, 600, pool, fresh=any(b.fresh for b in chain)
    )
    return run.returncode, run.stdout, run.stderr
  # A block of a multi-process job, run as the reader runs it: process i
  # gets i as its argument, and no DTENSOR_* variable; the coordinator's
  # address is a free port.
  script.write_text(
    'import os\n'
    + code.replace("'127.0.0.1:9000'", "os.environ['FDT_MP_COORDINATOR']")
  )
  run = script_util.run_processes(script, processes, tmp, 600, pool)
  return run.returncode, run.stdout, run.stderr


@pytest.fixture(scope='session')
def run_chain(tmp_path_factory, warm_pool):
  """Runs a chain once, in a fresh directory: (exit status, stdout, stderr).

  Each chain is a test of its own (a slow machine slows one test, and the
  chains spread over pytest-xdist's workers); a test that reads another
  chain's outcome gets the one already run on its worker. Once a worker,
  not a module: between two of these tests a worker runs other files'.
  """
  done = {}

  def run(chain):
    name = chain[-1].name
    if name not in done:
      done[name] = _run(chain, tmp_path_factory.mktemp('block'), warm_pool)
    return done[name]

  return run


@pytest.mark.parametrize(
  'chain', CHAINS, ids=[' <- '.join(b.name for b in c[::-1]) for c in CHAINS]
)
def test_block_runs_alone(run_chain, chain):
  code, stdout, stderr = run_chain(chain)
  assert code == 0, f'{chain[-1].name}:\n{stderr[-4000:]}'
  if chain[-1].processes == 1:
    assert stdout.rstrip().endswith(DONE), stdout[-2000:]
  else:
    # Each process's output, which also holds what TF logs at its exit.
    assert stdout.count(DONE) == chain[-1].processes, stdout[-2000:]


def test_multi_host_block_runs_in_two_processes(run_chain):
  (chain,) = [
    c for c in CHAINS if c[-1].name == 'export_multi_process.md:multi-host'
  ]
  _, stdout, _ = run_chain(chain)
  assert 'PROCESS 0 8' in stdout and 'PROCESS 1 8' in stdout, stdout


def test_the_markers_hold():
  """Labels are unique per page, every check names a block, and every
  Python block runs in some chain."""
  names = [b.name for b in BLOCKS if b.label]
  assert len(names) == len(set(names)), names
  python = {b.name for b in BLOCKS if b.language == 'python'}
  assert set(CHECKS) <= python, set(CHECKS) - python
  assert {b.name for chain in CHAINS for b in chain} == python
  for block in BLOCKS:
    for name in block.continues:
      assert f'{block.page}:{name}' in names, (block.name, name)
  # The pages this test was written for are all found.
  assert {
    'concepts.md',
    'export_guide.md',
    'export_checkpoints.md',
    'export_training_runs.md',
    'export_saved_models.md',
    'export_way_back.md',
    'export_multi_process.md',
    'getting_started.md',
  } <= {b.page for b in BLOCKS if b.language == 'python'}


@pytest.mark.parametrize('page', [p.name for p in PAGES])
def test_yaml_rules_blocks_parse(page):
  for block in script_util.code_blocks(DOCS / page):
    if block.language == 'yaml' and 'logical_axis_rules' in block.code:
      rules = fdt.LogicalRules.from_yaml_text(block.code)
      assert len(rules) + len(rules.path_rules) == block.code.count('\n  - ')


def test_a_block_that_says_so_runs_in_a_new_python(tmp_path, warm_pool):
  page = tmp_path / 'page.md'
  code = 'import sys\nprint("flax_dtensor" in sys.modules)\n'
  page.write_text(
    f'```python\n# Fresh process: nothing imported yet.\n{code}```\n\n'
    f'```python\n{code}```\n'
  )
  fresh, forked = script_util.code_blocks(page)
  assert (fresh.fresh, forked.fresh) == ('nothing imported yet.', None)
  printed = []
  for block in (fresh, forked):
    script = tmp_path / f'block{block.line}.py'
    script.write_text(block.code)
    run = script_util.run_script(
      script, tmp_path, 300, warm_pool, fresh=bool(block.fresh)
    )
    assert run.returncode == 0, run.stderr
    printed.append(run.stdout)
  assert printed == ['False\n', 'True\n']  # Only the pool imported it.
