"""A save passes over the bytes once besides TF's write: no data file is
read back.

Each shard is hashed (CRC-32C) beside TF's write, and from the same bytes,
in the order TF writes them, the chunks of the data file they go into
(`_host_write._hash`, `_checksums.StreamSum`); only what TF adds itself (its
index, the object graph, the `checkpoint` state file) is read back. The
cases: one bundle and several, blocking and background saves, dtypes
stored widened (float16, uint32) and int4, a chunk edge inside a shard.
Each checkpoint is checked whole against its manifest, as `inspect
--verify` does, and restored bit for bit. Where TF's file does not hold
the bytes where the hashing assumed (probed at both ends, `_laid_out`), the
file is read back instead and the manifest is as right.
"""

import concurrent.futures
import os

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

pytest.importorskip('tensorflow')
fdt_tf = pytest.importorskip('flax_dtensor.dtensor')
from flax_dtensor.dtensor._conversion import _selection  # noqa: E402
from flax_dtensor.dtensor._format import (  # noqa: E402
  _checksums,
  _decode,
  _model,
  _verify,
)
from flax_dtensor.dtensor._storage import _host_write  # noqa: E402

DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16, np.uint32, ml_dtypes.int4]


def _values(rng, dtype):
  if dtype == np.uint32:
    return rng.integers(0, 2**32, (16, 64), dtype=np.uint32)
  if dtype == ml_dtypes.int4:
    return rng.integers(-8, 8, (16, 64)).astype(dtype)
  return (rng.standard_normal((16, 64)) * 7).astype(dtype)


def _state(mesh):
  rng = np.random.default_rng(5)
  specs = [P('data', 'model'), P('model', None), P(), P(None, 'data')]
  return nnx.State(
    {
      f'v{i}': nnx.Param(
        jax.device_put(
          _values(rng, dtype),
          NamedSharding(mesh, specs[i % len(specs)]),
        )
      )
      for i, dtype in enumerate(DTYPES * 2)
    }
  )


@pytest.fixture
def read_back(monkeypatch):
  """The files whose chunks a save read back from disk, by name."""
  names = []
  real = _checksums.crc_chunk

  def spy(path, offset, length, checksum=None):
    names.append(os.path.basename(path))
    return real(path, offset, length, checksum)

  monkeypatch.setattr(_checksums, 'crc_chunk', spy)
  return names


def _saved(state, path, blocking):
  if blocking:
    return fdt_tf.save_checkpoint(state, path)
  return fdt_tf.save_checkpoint(state, path, blocking=False).result()


def _check(path, state):
  """Intact against its manifest, file by file; restored bit for bit."""
  manifest = _decode.read(path)
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    assert _verify.problems_of(manifest, pool) == []
  target = jax.tree.map(
    lambda a: jax.numpy.zeros_like(a, device=a.sharding), state
  )
  restored = fdt_tf.restore_checkpoint(path, target)
  for (k, a), (_, b) in zip(
    nnx.to_flat_state(restored), nnx.to_flat_state(state), strict=True
  ):
    assert np.asarray(a.get_value()).tobytes() == (
      np.asarray(b.get_value()).tobytes()
    ), k
  return manifest


@pytest.mark.parametrize('blocking', [True, False], ids=['blocking', 'async'])
@pytest.mark.parametrize('bundles', ['one', 'several'])
def test_no_data_file_is_read_back(
  explicit_mesh, tmp_path, monkeypatch, read_back, blocking, bundles
):
  if bundles == 'several':
    monkeypatch.setattr(_host_write, 'PART_BYTES', 4096)
  # Chunks of 10,000 bytes: chunk edges inside shards and between them.
  monkeypatch.setattr(_model, 'CHUNK_BYTES', 10_000)
  state = _state(explicit_mesh)
  path = _saved(state, tmp_path / 'c', blocking)
  saved_reads = list(read_back)
  manifest = _check(path, state)
  data = sorted(n for n in manifest.files if '.data-' in n)
  assert len(data) == (1 if bundles == 'one' else 3)
  assert any(manifest.files[n].size > 10_000 for n in data)
  # Read back: TF's index, its state file and (several) the object graph's
  # bundle, which TF wrote itself; never a bundle of shards.
  graph = [] if bundles == 'one' else [data[-1]]
  assert sorted(set(saved_reads)) == sorted(
    ['checkpoint', 'ckpt.index', *graph]
  )


def test_a_bundle_tf_laid_out_otherwise_is_read_back(
  explicit_mesh, tmp_path, monkeypatch, read_back
):
  """If TF's data file does not start with the first shard's bytes (a TF
  release that lays bundles out otherwise), it is read back, and the
  manifest is as right."""
  monkeypatch.setattr(_host_write, '_laid_out', lambda prefix, pieces: False)
  state = _state(explicit_mesh)
  path = fdt_tf.save_checkpoint(state, tmp_path / 'c')
  assert 'ckpt.data-00000-of-00001' in read_back
  _check(path, state)


def test_the_layout_probe_sees_a_changed_or_short_file(explicit_mesh, tmp_path):
  """`_laid_out` is true of what SaveV2 wrote, false once its first or
  last shard's bytes are elsewhere or the file is short."""
  state = _state(explicit_mesh)
  values = [v.get_value() for _, v in nnx.to_flat_state(state)]
  entries = _selection.select(state, ..., nnx.RngState, what='state')
  pieces = _host_write.hand_over(entries, values)
  prefix = str(tmp_path / 'bundle')
  _host_write._save(entries, pieces, prefix, {})
  assert _host_write._laid_out(prefix, pieces)
  path = _host_write.data_file(prefix)
  with open(path, 'rb') as f:
    raw = f.read()
  for at in (0, len(raw) - 1):
    changed = bytearray(raw)
    changed[at] ^= 1
    with open(path, 'wb') as f:
      f.write(changed)
    assert not _host_write._laid_out(prefix, pieces)
  with open(path, 'wb') as f:
    f.write(raw[:-5])
  assert not _host_write._laid_out(prefix, pieces)
  os.remove(path)
  assert not _host_write._laid_out(prefix, pieces)
