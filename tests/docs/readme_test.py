"""The README's code blocks run as written, alone, in a fresh process.

As docs_snippets_test.py does for the docs (a fork of the session's warm
pool, without the test suite's ``XLA_FLAGS``: the quickstart sets its own
devices), the export block after the quickstart it continues.
"""

import pathlib

from support import script_util

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_readme_blocks_run_alone(tmp_path, warm_pool):
  blocks = script_util.code_blocks(ROOT / 'README.md')
  chains = script_util.chains(blocks)
  names = [[b.name for b in chain] for chain in chains]
  assert names == [['README.md:quickstart', 'README.md:to-tensorflow']]
  ((quickstart, export),) = chains
  assert export.continues == ('quickstart',)
  script = tmp_path / 'quickstart.py'
  script.write_text(
    quickstart.code
    + "\nprint('QUICKSTART DONE')\n"
    + export.code
    # A reader runs it again, in the same folder: what the first run wrote
    # is replaced, not refused.
    + '\n'
    + export.code
    + '\nimport tensorflow as tf\n'
    + "reader = tf.train.load_checkpoint('ckpt')\n"
    + 'names = sorted(reader.get_variable_to_shape_map())\n'
    + "print('KEYS', [n for n in names if 'kernel' in n])\n"
    # Served at odd batches too, each row as JAX computes it.
    + 'import numpy as np\n'
    + "serve = tf.saved_model.load('served').signatures['serving_default']\n"
    + 'want = np.asarray(y)\n'
    + 'for rows in (1, 3):\n'
    + '  (got,) = serve(tf.ones((rows, 512))).values()\n'
    + '  np.testing.assert_allclose(got.numpy(), want[:rows], rtol=1e-5, atol=1e-5)\n'
    + "print('SERVED', rows)\n"
  )
  out = script_util.run_script(script, tmp_path, 300, warm_pool)
  assert out.returncode == 0, out.stderr[-3000:]
  quick, _, after = out.stdout.partition('QUICKSTART DONE')
  assert "P(None, 'model')" in quick  # up/kernel: 'fsdp' fell back.
  # The forward pass ran, its batch on 'data'.
  assert quick.rstrip().endswith('float32[16@data,512]')
  assert "'embed' -> 'fsdp': the mesh has no axis 'fsdp'" in quick
  assert (
    "KEYS ['state/down/kernel/.ATTRIBUTES/VARIABLE_VALUE', "
    "'state/up/kernel/.ATTRIBUTES/VARIABLE_VALUE']" in after
  )
  assert after.rstrip().endswith('SERVED 3')
