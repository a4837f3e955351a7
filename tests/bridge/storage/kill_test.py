"""SIGKILL during an overwriting save: the old or the new checkpoint, whole.

A process overwrites a checkpoint with the other of two versions and is
killed at a moment of the save chosen by its progress, as the test watches
the files it writes: in its first milliseconds (before and while it creates
its temporary directory), the instant the temporary appears, when a given
share of the checkpoint's bytes is written, when the manifest appears, and
during the final renames. After each kill, the path must read back as one
version exactly (the read finishes or undoes an interrupted swap) with
nothing else left beside it; the last kill's leftovers must be removed by
the next save. Every other save runs in the background
(`blocking=False`, then `wait()`): the same guarantees hold.

Each save runs in a fresh process forked from the session's warm pool
(tests/support/warm.py), which imported JAX and TensorFlow once: a kill
costs a process start without the imports.
"""

import contextlib
import os
import queue
import random
import subprocess
import tempfile
import textwrap
import threading
import time

import numpy as np
import pytest

tf = pytest.importorskip('tensorflow')
fdt_tf = pytest.importorskip('flax_dtensor.dtensor')

SETUP_TIMEOUT = 300
SHAPE = (8, 16, 2048)  # 1 MiB of float32 per variable.
NAMES = [f'v{i}' for i in range(24)]
# Kills by kind: ('ms', d) d milliseconds after the save is asked for;
# ('tmp', 0) when its temporary appears; ('bytes', f) when it holds that
# share of a checkpoint's bytes; ('manifest', 0) when the manifest appears;
# ('swap', 0) once the new checkpoint is renamed in (or the old aside).
MOMENTS = (
  [('ms', d) for d in (0, 1, 2, 3, 5, 8, 12, 20)]
  + [('tmp', 0)] * 8
  + [('bytes', f) for f in (0.05, 0.25, 0.5, 0.75, 0.95)]
  + [('manifest', 0)] * 3
  + [('swap', 0)] * 4
)
# The kinds whose kill always finds the save unfinished: after them, at
# least a whole TF write is left to do.
MID_SAVE = {'tmp', 'bytes'}

SAVER = textwrap.dedent(
  f"""
  import os, sys, time
  import jax, numpy as np
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P
  from flax_dtensor import dtensor as fdt_tf

  jax.config.update('jax_num_cpu_devices', 8)
  fdt_tf.initialize()
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  base = np.arange(np.prod({SHAPE}), dtype=np.float32).reshape({SHAPE})
  sharding = NamedSharding(mesh, P('data', 'model'))
  models = {{
    version: nnx.Dict({{
      name: nnx.Param(jax.device_put(base + 1000 * version + i, sharding))
      for i, name in enumerate({NAMES!r})
    }})
    for version in (1, 2, 3)
  }}
  jax.block_until_ready(nnx.state(models))
  print('READY', os.getpid(), flush=True)
  version, mode = sys.stdin.readline().split()
  model = models[int(version)]
  start = time.perf_counter()
  if mode == 'async':
    fdt_tf.save_checkpoint(
      model, sys.argv[1], overwrite=True, blocking=False
    ).wait()
  else:
    fdt_tf.save_checkpoint(model, sys.argv[1], overwrite=True)
  print('DONE', time.perf_counter() - start, flush=True)
  """
)


class Zygote:
  """Starts one saving process per kill, each a fork of the warm pool."""

  def __init__(self, pool, script, path):
    self.pool = pool
    self.script = script
    self.path = path
    self.lines = queue.Queue()
    self.finished = threading.Event()  # The saving process is done.
    self.errors = tempfile.TemporaryFile()
    self.case = None
    self.child = None

  def _read(self, case):
    for line in case.stdout:
      words = line.decode().split()
      if words and words[0] == 'DONE':
        self.finished.set()
      self.lines.put(words)
    self.lines.put(['EXIT', case.pid, case.wait(SETUP_TIMEOUT)])
    self.finished.set()

  def expect(self, word, timeout=SETUP_TIMEOUT):
    try:
      line = self.lines.get(timeout=timeout)
    except queue.Empty:
      line = None
    if not line or line[0] != word:
      self.errors.seek(0)
      raise AssertionError(
        f'expected {word}, got {line}: '
        + self.errors.read().decode(errors='replace')[-3000:]
      )
    return line

  def send(self, text):
    self.case.stdin.write(text.encode() + b'\n')

  def fork(self):
    """A new saving process, ready: its pid."""
    self.finished.clear()
    self.case = self.pool.start(
      self.script,
      str(self.path),
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=self.errors,
    )
    threading.Thread(target=self._read, args=(self.case,), daemon=True).start()
    self.child = int(self.expect('READY')[1])
    return self.child

  def reap(self):
    """Waits for the saving process's end (it was killed or finished)."""
    while (line := self.expect_any())[0] != 'EXIT':
      pass
    for pipe in (self.case.stdin, self.case.stdout):
      with contextlib.suppress(OSError):
        pipe.close()
    self.case = self.child = None
    return line

  def expect_any(self):
    return self.lines.get(timeout=SETUP_TIMEOUT)

  def kill_child(self):
    if self.case is not None:
      self.case.kill()

  def close(self):
    if self.case is not None:
      self.kill_child()
      self.reap()
    self.errors.close()


def _expected(version):
  base = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
  return {(name,): base + 1000 * version + i for i, name in enumerate(NAMES)}


def _version_of(read):
  """Which version the checkpoint holds, checking every byte."""
  assert set(read) == set(_expected(1)), sorted(read)
  for version in (1, 2, 3):
    if all(np.array_equal(read[k], v) for k, v in _expected(version).items()):
      return version
  raise AssertionError('the checkpoint is no version, or mixes them')


def _progress(root):
  """(temporaries, old ones aside, bytes in the temporaries, a manifest)."""
  temporaries, olds, written, manifest = [], [], 0, False
  with contextlib.suppress(FileNotFoundError):
    for entry in os.scandir(root):
      if entry.name.startswith('.ckpt.tmp-'):
        temporaries.append(entry.path)
      elif entry.name.startswith('.ckpt.old-'):
        olds.append(entry.path)
  for tmp in temporaries:
    for directory, _, files in os.walk(tmp):
      for name in files:
        manifest |= name == 'flax_dtensor.json' and directory == tmp
        with contextlib.suppress(FileNotFoundError):
          written += os.stat(os.path.join(directory, name)).st_size
  return temporaries, olds, written, manifest


def _kill_at(zygote, root, moment, version, mode, total):
  """Asks for a save, kills it at `moment`; whether the moment was seen."""
  kind, amount = moment
  asked = time.monotonic()
  zygote.send(f'{version} {mode}')
  seen_tmp = False
  while not zygote.finished.is_set():
    if time.monotonic() - asked > SETUP_TIMEOUT:
      raise AssertionError(f'no progress towards {kind}')
    if kind == 'ms':
      if time.monotonic() - asked >= amount / 1000:
        break
      continue
    temporaries, olds, written, manifest = _progress(root)
    seen_tmp |= bool(temporaries)
    if (
      (kind == 'tmp' and temporaries)
      or (kind == 'bytes' and written >= amount * total)
      or (kind == 'manifest' and manifest)
      or (kind == 'swap' and (olds or (seen_tmp and not temporaries)))
    ):
      break
    time.sleep(0.0001)
  else:
    zygote.kill_child()
    zygote.reap()
    return False
  zygote.kill_child()
  zygote.reap()
  return True


def test_sigkill_during_overwriting_saves(tmp_path, warm_pool):
  """SIGKILL at each of many moments of a save over the last one leaves
  the old version or the new one readable, and nothing else behind.

  Slow: each moment is a save of its own in a fresh fork of the zygote (a
  killed process cannot be reused).
  """
  script = tmp_path / 'saver.py'
  script.write_text(SAVER)
  root = tmp_path / 'root'
  root.mkdir()
  path = root / 'ckpt'
  zygote = Zygote(warm_pool, script, path)
  try:
    # A first save, whole: the old version, and its size.
    zygote.fork()
    zygote.send('1 blocking')
    zygote.expect('DONE')
    zygote.reap()
    total = sum(f.stat().st_size for f in path.iterdir())
    assert _version_of(fdt_tf.read_checkpoint(path)) == 1
    moments = list(MOMENTS)
    random.Random(0).shuffle(moments)
    moments.append(('bytes', 0.5))  # Its leftovers go to the last save.
    seen = {'old': 0, 'new': 0}
    interrupted, aimed_mid_save = 0, 0
    current = 1
    for i, moment in enumerate(moments):
      version = 3 - current
      zygote.fork()
      mode = 'async' if i % 2 else 'blocking'
      hit = _kill_at(zygote, root, moment, version, mode, total)
      leftovers = [n for n in os.listdir(root) if n != 'ckpt']
      stopped = bool(leftovers) or not path.exists()
      interrupted += stopped
      if hit and moment[0] in MID_SAVE:
        aimed_mid_save += 1
        # Killed with a whole TF write still to do: the save was stopped.
        assert stopped, (moment, os.listdir(root))
      if i == len(moments) - 1:
        break
      current = _version_of(fdt_tf.read_checkpoint(path))
      seen['new' if current == version else 'old'] += 1
      # The read recovered what the kill left: nothing else remains.
      assert os.listdir(root) == ['ckpt'], (moment, os.listdir(root))
    # Kills landed mid-save, and both outcomes occurred.
    assert aimed_mid_save >= 8, aimed_mid_save
    assert interrupted >= len(moments) // 3, (interrupted, seen)
    assert seen['old'] and seen['new'], seen
    # The next save removes whatever the last killed writer left.
    assert stopped, os.listdir(root)
    zygote.fork()
    zygote.send('3 async')
    zygote.expect('DONE')
    zygote.reap()
    assert os.listdir(root) == ['ckpt']
    assert _version_of(fdt_tf.read_checkpoint(path)) == 3
  finally:
    zygote.close()
