"""Checkpoints the previous release wrote (manifest version 4, CRC-32)
restore bit for bit: from files committed under release_4/, never
rewritten (release_4/README.md says how they were written).

Each restores onto the mesh it was saved from and onto others, reads back
with `read_checkpoint`, passes `inspect --verify`, and is refused with our
error, naming its CRC-32, once a byte of it changes. Saved again, it is
written as version 5 and restores the same.
"""

import concurrent.futures
import json
import pathlib
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.cli_runner import run as run_cli

pytest.importorskip('tensorflow')
fdt_tf = pytest.importorskip('flax_dtensor.dtensor')
from flax_dtensor.dtensor._format import _decode, _model, _verify  # noqa: E402

RELEASE = pathlib.Path(__file__).parent / 'release_4'
FIXTURES = ['one_process', 'two_processes']


def expected():
  """{path: (values, spec)} of the state the fixtures hold."""
  rng = np.random.default_rng(61)
  return {
    ('embed',): (rng.standard_normal((8, 16), np.float32), ('data', 'model')),
    ('dense', 'kernel'): (
      rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16),
      (None, 'model'),
    ),
    ('dense', 'bias'): (
      rng.standard_normal((8,)).astype(np.float16),
      ('model',),
    ),
    ('scale',): (np.float32(1.5), ()),
    ('count',): (np.arange(12, dtype=np.int8).reshape(3, 4), (None, 'model')),
    ('replicated',): (rng.standard_normal((5, 3)).astype(np.float32), ()),
  }


def _target(mesh, specs):
  """Zeros of the fixtures' shapes and dtypes, laid out by `specs(spec)`."""
  tree = {}
  for path, (value, spec) in expected().items():
    kind = nnx.BatchStat if path == ('count',) else nnx.Param
    value = np.zeros_like(np.asarray(value))
    node = tree
    for name in path[:-1]:
      node = node.setdefault(name, {})
    sharding = NamedSharding(mesh, P(*specs(spec)))
    node[path[-1]] = kind(jax.device_put(value, sharding))
  return nnx.State(tree)


MESHES = {
  'as saved': (lambda: jax.make_mesh((2, 4), ('data', 'model')), lambda s: s),
  'axes swapped': (
    lambda: jax.make_mesh((4, 2), ('data', 'model')),
    lambda s: tuple({'data': 'model', 'model': 'data'}.get(a, a) for a in s),
  ),
  'one device': (
    lambda: jax.make_mesh((1, 1), ('data', 'model'), devices=jax.devices()[:1]),
    lambda s: s,
  ),
}


def _assert_expected(state):
  flat = dict(nnx.to_flat_state(state))
  for path, (value, _) in expected().items():
    got = np.asarray(flat[path].get_value())
    assert got.dtype == np.asarray(value).dtype, path
    assert got.tobytes() == np.asarray(value).tobytes(), path


@pytest.fixture
def release(tmp_path, request):
  """A copy of a fixture (restores may tidy up beside an export)."""
  copy = tmp_path / request.param
  shutil.copytree(RELEASE / request.param, copy)
  return copy


@pytest.mark.parametrize('release', FIXTURES, indirect=True)
def test_the_fixtures_are_version_4_as_written(release):
  """What is committed is what version 4 wrote: CRC-32, intact."""
  manifest = _decode.read(str(release))
  assert (manifest.version, manifest.checksum) == (4, 'crc32')
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    assert _verify.problems_of(manifest, pool) == []
  data = [n for n in manifest.files if '.data-' in n]
  assert len(data) == (1 if release.name == 'one_process' else 3)


@pytest.mark.parametrize('mesh', MESHES, ids=list(MESHES))
@pytest.mark.parametrize('release', FIXTURES, indirect=True)
def test_a_release_4_checkpoint_restores_bit_for_bit(release, mesh):
  make, specs = MESHES[mesh]
  target = _target(make(), specs)
  restored = fdt_tf.restore_checkpoint(str(release), target)
  _assert_expected(restored)
  # Placed as the target asks, not as saved.
  flat = dict(nnx.to_flat_state(restored))
  for path, (_, spec) in expected().items():
    assert flat[path].get_value().sharding.spec == P(*specs(spec)), path
  arrays = fdt_tf.read_checkpoint(str(release))
  for path, (value, _) in expected().items():
    assert np.asarray(arrays[path]).tobytes() == np.asarray(value).tobytes()


@pytest.mark.parametrize('release', FIXTURES, indirect=True)
def test_a_release_4_checkpoint_passes_inspect_verify(release):
  result = run_cli('inspect', '--verify', str(release))
  assert result.returncode == 0, result.stdout + result.stderr
  assert 'intact: ' in (result.stdout + result.stderr)
  assert 'checked against flax_dtensor.json' in (result.stdout + result.stderr)


@pytest.mark.parametrize('release', FIXTURES, indirect=True)
def test_a_changed_byte_of_a_release_4_checkpoint_is_refused(release):
  """Its CRC-32s still check it: a byte of `embed` flipped in its data
  file is found by `inspect --verify` and by the restore (which checks a
  small export's files whole before TF reads them), which changes
  nothing."""
  manifest = _decode.read(str(release))
  data = sorted(n for n in manifest.files if '.data-' in n)
  path = release / data[0]
  raw = bytearray(path.read_bytes())
  raw[0] ^= 0xFF
  path.write_bytes(bytes(raw))
  result = run_cli('inspect', '--verify', str(release))
  assert result.returncode == 1, result.stdout + result.stderr
  assert 'changed (CRC-32 ' in ' '.join((result.stdout + result.stderr).split())
  make, specs = MESHES['as saved']
  target = _target(make(), specs)
  before = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(target)}
  with pytest.raises(
    fdt_tf.DamagedExportError,
    match=r'bytes 0\.\.\d+ changed \(CRC-32 [0-9a-f]{8}, recorded',
  ):
    fdt_tf.restore_checkpoint(str(release), target)
  for p, v in nnx.to_flat_state(target):
    np.testing.assert_array_equal(np.asarray(v.get_value()), before[p])


@pytest.mark.parametrize('release', FIXTURES, indirect=True)
def test_a_release_4_checkpoint_saved_again_is_version_5(release, tmp_path):
  """Restored and saved again: CRC-32C, intact, the same values."""
  make, specs = MESHES['as saved']
  restored = fdt_tf.restore_checkpoint(str(release), _target(make(), specs))
  again = fdt_tf.save_checkpoint(restored, tmp_path / 'again')
  meta = json.loads((pathlib.Path(again) / _model.FILE).read_text())
  assert (meta['version'], meta['checksum']) == (5, 'crc32c')
  _assert_expected(fdt_tf.restore_checkpoint(again, _target(make(), specs)))
