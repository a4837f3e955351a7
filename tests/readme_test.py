"""The README's quickstart runs as written, in a fresh process."""

import os
import pathlib
import re
import subprocess
import sys

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
  env = {
    **os.environ,
    'XLA_FLAGS': '--xla_force_host_platform_device_count=8',
    'JAX_PLATFORMS': 'cpu',
  }
  out = subprocess.run(
    [sys.executable, str(script)],
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
    check=False,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert "P(None, 'model')" in out.stdout  # up/kernel: 'fsdp' fell back.
  assert "'embed' -> 'fsdp': the mesh has no axis 'fsdp'" in out.stdout
  assert (
    "KEYS ['state/down/kernel/.ATTRIBUTES/VARIABLE_VALUE', "
    "'state/up/kernel/.ATTRIBUTES/VARIABLE_VALUE']" in out.stdout
  )
