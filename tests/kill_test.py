"""SIGKILL during an overwriting save: the old or the new checkpoint, whole.

A child process overwrites a checkpoint with the other of two versions and
is killed at a moment spread over the save (stratified: the i-th of N kills
lands in the i-th slice of the save's duration). After each kill, the path
must read back as one version exactly (the read finishes or undoes an
interrupted swap), and after a last save nothing else may remain.
"""

import contextlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

tf = pytest.importorskip('tensorflow')
fdt_tf = pytest.importorskip('flax_dtensor.dtensor')

KILLS = 24
SETUP_TIMEOUT = 240
SHAPE = (8, 16, 2048)  # 1 MiB of float32 per variable.
NAMES = [f'v{i}' for i in range(24)]

CHILD = textwrap.dedent(
  f"""
  import os, sys, time
  import jax, jax.numpy as jnp, numpy as np
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P
  from flax_dtensor import dtensor as fdt_tf

  fdt_tf.initialize()
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  path = sys.argv[1]
  base = np.arange(np.prod({SHAPE}), dtype=np.float32).reshape({SHAPE})
  models = {{
    version: nnx.Dict({{
      name: nnx.Param(jax.device_put(base + 1000 * version + i,
                                     NamedSharding(mesh, P('data', 'model'))))
      for i, name in enumerate({NAMES!r})
    }})
    for version in (1, 2)
  }}
  jax.block_until_ready(nnx.state(models))
  print('READY', flush=True)
  model = models[int(sys.stdin.readline())]
  start = time.perf_counter()
  fdt_tf.save_checkpoint(model, path, overwrite=True)
  print('DONE', time.perf_counter() - start, flush=True)
  """
)


def _expected(version):
  base = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
  return {(name,): base + 1000 * version + i for i, name in enumerate(NAMES)}


@contextlib.contextmanager
def _spawn(script, path):
  """A child ready to save at `path`; killed and closed after."""
  env = {k: v for k, v in os.environ.items() if not k.startswith('DTENSOR_')}
  with subprocess.Popen(
    [sys.executable, str(script), str(path)],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env=env,
  ) as proc:
    try:
      _wait_for(proc, 'READY', SETUP_TIMEOUT)
      yield proc
    finally:
      proc.kill()
      proc.wait(timeout=60)


def _go(proc, version):
  proc.stdin.write(f'{version}\n')
  proc.stdin.flush()


def _wait_for(proc, word, timeout):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    line = proc.stdout.readline()
    if line.startswith(word):
      return line
    if not line and proc.poll() is not None:
      break
  proc.kill()
  proc.wait(timeout=60)
  raise AssertionError(
    f'child did not print {word}: {proc.stderr.read()[-3000:]}'
  )


def _version_of(read):
  """Which version the checkpoint holds, checking every byte."""
  assert set(read) == set(_expected(1)), sorted(read)
  for version in (1, 2):
    if all(np.array_equal(read[k], v) for k, v in _expected(version).items()):
      return version
  raise AssertionError('the checkpoint is neither version, or mixes both')


def test_sigkill_during_overwriting_saves(tmp_path):
  script = tmp_path / 'child.py'
  script.write_text(CHILD)
  root = tmp_path / 'root'
  root.mkdir()
  path = root / 'ckpt'
  # A first save, whole: the old version, and the save's duration.
  with _spawn(script, path) as proc:
    _go(proc, 1)
    duration = float(_wait_for(proc, 'DONE', SETUP_TIMEOUT).split()[1])
  assert _version_of(fdt_tf.read_checkpoint(path)) == 1
  rng = random.Random(0)
  seen = {'old': 0, 'new': 0}
  interrupted = 0
  current = 1
  for i in range(KILLS):
    version = 3 - current
    with _spawn(script, path) as proc:
      moment = (i + rng.random()) / KILLS * 1.1 * duration
      _go(proc, version)
      time.sleep(moment)
      proc.send_signal(signal.SIGKILL)
      proc.wait(timeout=60)
    leftovers = [n for n in os.listdir(root) if n != 'ckpt']
    interrupted += bool(leftovers) or not path.exists()
    current = _version_of(fdt_tf.read_checkpoint(path))
    seen['new' if current == version else 'old'] += 1
  # Kills landed mid-save, and both outcomes occurred.
  assert interrupted >= KILLS // 4, (interrupted, seen)
  assert seen['old'] and seen['new'], seen
  # The next save removes whatever the killed writers left.
  with _spawn(script, path) as proc:
    _go(proc, 3 - current)
    _wait_for(proc, 'DONE', SETUP_TIMEOUT)
  assert os.listdir(root) == ['ckpt']
  assert _version_of(fdt_tf.read_checkpoint(path)) == 3 - current
