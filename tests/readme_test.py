"""The README's quickstart runs as written, in a fresh process."""

import pathlib
import re

import script_util

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_readme_quickstart_runs(tmp_path):
  blocks = re.findall(
    r'```python\n(.*?)```', (ROOT / 'README.md').read_text(), re.S
  )
  assert len(blocks) == 2, 'expected the quickstart and its export sequel'
  script = tmp_path / 'quickstart.py'
  script.write_text(
    '\n'.join(blocks)
    + '\nimport tensorflow as tf\n'
    + "reader = tf.train.load_checkpoint('ckpt')\n"
    + 'names = sorted(reader.get_variable_to_shape_map())\n'
    + "print('KEYS', [n for n in names if 'kernel' in n])\n"
  )
  out = script_util.run_script(script, tmp_path, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "P(None, 'model')" in out.stdout  # up/kernel: 'fsdp' fell back.
  assert "'embed' -> 'fsdp': the mesh has no axis 'fsdp'" in out.stdout
  assert (
    "KEYS ['state/down/kernel/.ATTRIBUTES/VARIABLE_VALUE', "
    "'state/up/kernel/.ATTRIBUTES/VARIABLE_VALUE']" in out.stdout
  )
