"""A process with much to write writes several TF bundles at once, merged.

One SaveV2 writes on one thread; from twice `_host_write.PART_BYTES` a save
splits its shards into bundles written at once and merges them with TF's
`MergeV2Checkpoints` (no byte copied). The result is TF's own sharded
format, `ckpt.data-0000k-of-0000N`. These tests lower `PART_BYTES` so that
a small state is split, and check what a user relies on: the values come
back exactly through `restore_checkpoint` and through plain TensorFlow
(`tf.train.load_checkpoint`), nothing of the parts is left over, and a byte
changed in any part is refused in our words, naming that file.
"""

import os
import re

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

tf = pytest.importorskip('tensorflow')
fdt_tf = pytest.importorskip('flax_dtensor.dtensor')

from flax_dtensor.dtensor._format import _checksums  # noqa: E402
from flax_dtensor.dtensor._storage import _host_write  # noqa: E402

SPECS = [P('data', 'model'), P('model', None), P(), P(None, 'data')]


def _state(mesh, count=8):
  """`count` (16, 64) float32 arrays of random values, in mixed layouts."""
  rng = np.random.default_rng(0)
  return nnx.State(
    {
      f'w{i}': nnx.Param(
        jax.device_put(
          rng.standard_normal((16, 64), dtype=np.float32),
          NamedSharding(mesh, SPECS[i % len(SPECS)]),
        )
      )
      for i in range(count)
    }
  )


def _data_files(path):
  return sorted(n for n in os.listdir(path) if n.startswith('ckpt.data-'))


@pytest.fixture
def small_parts(monkeypatch):
  """Bundles of at least 4 KiB: a save of 32 KiB writes as many as threads."""
  monkeypatch.setattr(_host_write, 'PART_BYTES', 4096)
  return min(_checksums.THREADS, 8)


@pytest.mark.parametrize('blocking', [True, False], ids=['blocking', 'async'])
def test_several_bundles_merge_into_tf_sharded_format(
  auto_mesh, tmp_path, small_parts, blocking
):
  state = _state(auto_mesh)
  saved = fdt_tf.save_checkpoint(state, tmp_path / 'c', blocking=blocking)
  path = saved if blocking else saved.result()
  # The parts, then the object graph's bundle: one data file each.
  count = small_parts + 1
  assert _data_files(path) == [
    f'ckpt.data-{k:05d}-of-{count:05d}' for k in range(count)
  ]
  assert not os.path.exists(os.path.join(path, '.parts'))
  reader = tf.train.load_checkpoint(path)
  target = nnx.State(
    {
      k: nnx.Param(jax.numpy.zeros_like(v.get_value()))
      for k, v in state.items()
    }
  )
  target = fdt_tf.restore_checkpoint(path, target)
  for name, variable in state.items():
    expected = np.asarray(variable.get_value())
    tf_read = reader.get_tensor(fdt_tf.checkpoint_key(name))
    np.testing.assert_array_equal(tf_read, expected, err_msg=name)
    restored = target[name].get_value()
    np.testing.assert_array_equal(np.asarray(restored), expected, err_msg=name)
    assert restored.sharding == variable.get_value().sharding, name


def test_a_byte_changed_in_any_part_is_refused_naming_it(
  auto_mesh, tmp_path, small_parts
):
  state = _state(auto_mesh)
  path = fdt_tf.save_checkpoint(state, tmp_path / 'c')
  name = _data_files(path)[1]  # A part this thread did not write.
  with open(os.path.join(path, name), 'r+b') as f:
    first = f.read(1)
    f.seek(0)
    f.write(bytes([first[0] ^ 0xFF]))
  target = nnx.State(
    {
      k: nnx.Param(jax.numpy.zeros_like(v.get_value()))
      for k, v in state.items()
    }
  )
  with pytest.raises(
    fdt_tf.DamagedExportError,
    match=rf"The export at '.*c' is damaged: {re.escape(name)} bytes 0\.\.\d+ "
    r'changed \(CRC-32C [0-9a-f]{8}, recorded [0-9a-f]{8}\).*Nothing was '
    r'restored',
  ):
    fdt_tf.restore_checkpoint(path, target)
  for value in target.values():  # Nothing placed.
    np.testing.assert_array_equal(np.asarray(value.get_value()), 0)


@pytest.mark.parametrize(
  ('nbytes', 'threads', 'expected'),
  [
    (0, 4, 1),  # Nothing to write: one (empty) bundle's worth.
    (4096, 4, 1),
    (3 * 4096, 4, 3),
    (100 * 4096, 4, 4),  # No more than the pool's threads.
    (100 * 4096, 1, 1),
  ],
)
def test_parts_grow_with_bytes_up_to_the_threads(
  monkeypatch, nbytes, threads, expected
):
  monkeypatch.setattr(_host_write, 'PART_BYTES', 4096)
  pieces = [
    _host_write.Piece(0, ((0, 1),), np.zeros(n, np.uint8), np.dtype('uint8'))
    for n in ([nbytes // 2, nbytes - nbytes // 2] if nbytes else [])
  ]
  assert _host_write.parts(pieces, threads) == expected
