"""`flax-dtensor inspect`: what an export holds, read from its manifest
without JAX or TensorFlow, `--verify`, and exports without a manifest. How the CLI tests run: tests/cli/conftest.py.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
from flax import nnx
from support import output_util
from support.cli_helpers import (
  _cli_in_process,
  _without_heavy_libraries,
  assert_fits,
  bad_input,
  ok,
  run_cli,
  run_cli_process,
)

import flax_dtensor.dtensor as fdt_tf

# TF DTensor on the suite's 8 devices, before any other TF operation.
pytestmark = pytest.mark.usefixtures('dtensor')


@pytest.mark.parametrize(
  'path, fragments',
  [('missing', ['is not a directory']), ('empty', ['holds no TF checkpoint'])],
  ids=['missing', 'empty'],
)
def test_inspect_bad_directory(tmp_path, path, fragments):
  (tmp_path / 'empty').mkdir()
  bad_input(run_cli('inspect', tmp_path / path), *fragments)


def test_inspect_demo_export(demo_export):
  _, out, _, proc = demo_export
  ok(proc)
  proc = run_cli('inspect', out)
  stdout = ok(proc)
  assert proc.stderr == ''
  assert 'DTensor checkpoint' in stdout
  assert '24 variables' in stdout
  lines = [line for line in stdout.splitlines() if 'head/kernel' in line]
  # The checkpoint's row, and the SavedModel's (from its assets).
  assert len(lines) == 2, lines
  for line in lines:
    assert '(128, 256)' in line and 'float32' in line, line
    assert "P('data', 'model')" in line, line
    assert 'data,model' in line and '@' not in line, line
  # The meshes, once above each table.
  assert (
    stdout.count('JAX mesh data=2,model=4; DTensor mesh data=2,model=4') == 2
  )
  # The SavedModel: its signature and its variables.
  assert 'serving_default' in stdout
  assert 'tokens: [None, 128] int32' in stdout
  assert 'From assets/flax_dtensor.json' in ' '.join(stdout.split())


@pytest.fixture(scope='module')
def fused_export(tmp_path_factory):
  """A DTensor checkpoint with a fused axis, a single-device array and a
  float16 array (stored widened)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  out = tmp_path_factory.mktemp('fused')
  mesh = jax.make_mesh((2, 4), ('data', 'model'))

  def put(shape, sharding, dtype=jnp.float32):
    return nnx.Param(jax.device_put(jnp.ones(shape, dtype), sharding))

  state = nnx.Dict(
    fused=put((16, 4), NamedSharding(mesh, P(('data', 'model'), None))),
    single=put((3,), jax.devices()[2]),
    half=put((8, 4), NamedSharding(mesh, P('data', 'model')), jnp.float16),
  )
  fdt_tf.save_checkpoint(state, out / 'checkpoint')
  return out


def test_inspect_shows_fused_dtensor_axes(fused_export):
  wide = {'COLUMNS': '200'}  # One line per row, to parse.
  stdout = ok(run_cli('inspect', fused_export, env=wide))
  rows = {}
  for line in stdout.splitlines():
    cells = re.split(r'\s{2,}', line.strip())
    if cells and cells[0] in ('fused', 'single', 'half'):
      rows[cells[0]] = cells[1:]
  # The meshes most rows are on, once above the table.
  assert 'JAX mesh data=2,model=4 (others in their rows)' in stdout
  assert 'Every variable is a Param.' in stdout
  assert rows['fused'] == [
    '(16, 4)',
    'float32',
    "P(('data', 'model'), None)",
    # The real DTensor mesh: one axis fusing both JAX axes.
    'data+model,unsharded @ data+model=8',
  ]
  assert rows['single'][2:] == ['one device', 'unsharded @ single_device=1']
  assert rows['half'][1] == 'float16 (stored as float32)'
  assert rows['half'][3] == 'data,model @ data=2,model=4'
  assert '3 variables' in stdout


def test_inspect_at_80_columns_wraps_and_cuts_nothing(fused_export):
  narrow = {'COLUMNS': '80'}
  stdout = ok(run_cli('inspect', fused_export, env=narrow))
  assert_fits(stdout, 80, [str(fused_export / 'checkpoint')])
  # The table does not fit: each variable on a few whole lines.
  lines = stdout.splitlines()
  at = lines.index('fused')
  assert lines[at + 1 : at + 4] == [
    '  (16, 4)  float32',
    "  JAX      P(('data', 'model'), None)",
    '  DTensor  data+model,unsharded @ data+model=8',
  ]
  assert '  DTensor  data,model @ data=2,model=4' in lines
  assert '  (8, 4)  float16 (stored as float32)' in lines


def test_inspect_of_an_earlier_manifest_reads_signatures_with_tf(
  demo_export, tmp_path
):
  """A SavedModel whose manifest predates recorded signatures."""
  _, out, _, proc = demo_export
  ok(proc)
  shutil.copytree(out / 'saved_model', tmp_path / 'saved_model')
  manifest = tmp_path / 'saved_model' / 'assets' / 'flax_dtensor.json'
  data = json.loads(manifest.read_text())
  del data['signatures']
  manifest.write_text(json.dumps(data))
  stdout = ok(run_cli('inspect', tmp_path))
  assert 'tokens: [None, 128] int32' in stdout  # From TensorFlow.
  assert '24 variables' in stdout  # From the manifest.


def test_inspect_without_a_manifest_reads_with_tensorflow(
  fused_export, tmp_path
):
  """A checkpoint written by plain TF: names, shapes and stored dtypes.

  In a process of its own (`python -m flax_dtensor`): TensorFlow is first
  imported, runs and exits there, and nothing it prints reaches stderr.
  """
  shutil.copytree(fused_export / 'checkpoint', tmp_path / 'checkpoint')
  (tmp_path / 'checkpoint' / 'flax_dtensor.json').unlink()
  proc = run_cli_process('inspect', tmp_path)
  stdout = ok(proc)
  assert proc.stderr == ''
  rows = {}
  for line in stdout.splitlines():
    cells = re.split(r'\s{2,}', line.strip())
    if cells and cells[0] in ('fused', 'single', 'half'):
      rows[cells[0]] = cells[1:]
  assert rows['fused'] == ['-', '(16, 4)', 'float32', '-', '-']
  assert rows['half'] == ['-', '(8, 4)', 'float32', '-', '-']  # As stored.
  assert 'No flax_dtensor.json: no layouts; read with TensorFlow.' in stdout


def test_inspect_without_a_manifest_never_loads_the_saved_model(
  demo_export, tmp_path, monkeypatch
):
  """Signatures from saved_model.pb, variables from the checkpoint index.

  TensorFlow's SavedModel loader is a tripwire while `inspect` runs:
  loading would run the SavedModel's graphs.
  """
  import tensorflow as tf

  loads = []
  monkeypatch.setattr(
    tf.saved_model, 'load', lambda *a, **k: loads.append(a) or 1 / 0
  )
  _, out, _, proc = demo_export
  ok(proc)
  saved = tmp_path / 'saved_model'
  shutil.copytree(out / 'saved_model', saved)
  (saved / 'assets' / 'flax_dtensor.json').unlink()
  proc = run_cli('inspect', saved)
  text = ok(proc)
  assert loads == []
  assert 'tokens: [None, 128] int32' in text
  assert 'output_0: [None, 128, 256] float32' in text
  assert '24 variables. No assets/flax_dtensor.json: no layouts.' in text
  # Every variable the manifest listed, with its shape as TF stores it.
  manifest = json.loads(
    (out / 'saved_model' / 'assets' / 'flax_dtensor.json').read_text()
  )
  for record in manifest['variables']:
    name = '/'.join(map(str, record['path']))
    shape = str(tuple(record['shape']))
    assert any(name in line and shape in line for line in text.splitlines()), (
      name,
      shape,
    )

  # A saved_model.pb that is not one: our error, exit 2, still never loaded.
  (saved / 'saved_model.pb').write_bytes(b'\x0a\xff\xff not a protobuf')
  proc = run_cli('inspect', saved)
  assert proc.returncode == 2, proc.stderr
  assert loads == []
  assert re.search(
    r"TensorFlow cannot parse the SavedModel in '.*saved_model': .*\. "
    r'Expected saved_model\.pb with one MetaGraph\. Pass a directory '
    r'written by `save_saved_model`, `flax-dtensor export --saved-model`',
    ' '.join(proc.stderr.split()),
  ), proc.stderr
  # An empty one parses as a SavedModel of no MetaGraph: named as such.
  (saved / 'saved_model.pb').write_bytes(b'')
  proc = run_cli('inspect', saved)
  assert proc.returncode == 2, proc.stderr
  assert re.search(
    r"cannot parse the SavedModel in '.*saved_model': saved_model\.pb "
    r'holds 0 MetaGraphs, not one\. Expected',
    ' '.join(proc.stderr.split()),
  ), proc.stderr


@pytest.mark.parametrize(
  'text',
  [
    '{not json',
    '{"variables": [1]}',
    '{"variables": {"fused": 3}}',
    '{"format": "flax_dtensor.saved_model", "version": 3, "variables": [], '
    '"checkpoint_prefix": "x", "files": {}, "signatures": {"s": 5}}',
  ],
  ids=['json', 'list', 'record', 'signature'],
)
def test_inspect_malformed_metadata(fused_export, tmp_path, text):
  shutil.copytree(fused_export / 'checkpoint', tmp_path / 'checkpoint')
  (tmp_path / 'checkpoint' / 'flax_dtensor.json').write_text(text)
  bad_input(
    run_cli('inspect', tmp_path),
    'flax_dtensor.json',
    'is not a valid flax_dtensor manifest',
    'Re-export the checkpoint',
  )


def test_inspect_reads_the_manifest_without_jax_or_tensorflow(demo_export):
  _, out, _, proc = demo_export
  ok(proc)
  ((code, text),) = _without_heavy_libraries(['inspect', str(out)])
  assert code == 0, text
  assert '24 variables' in text and 'serving_default' in text
  # What TensorFlow itself reads from the SavedModel: the same signature.
  assert 'tokens: [None, 128] int32' in text
  assert 'output_0: [None, 128, 256] float32' in text


def _damaged_copies(out, tmp):
  """Copies of the demo export, each broken in one way; name -> directory."""
  copies = {}

  def copy(name):
    copies[name] = tmp / name
    shutil.copytree(out, copies[name], symlinks=True)
    return copies[name]

  copy('intact')
  ckpt = copy('flipped') / 'checkpoint'
  data = sorted(ckpt.glob('ckpt.data-*'))[0]
  raw = bytearray(data.read_bytes())
  raw[100] ^= 0xFF
  data.write_bytes(bytes(raw))
  ckpt = copy('unlisted') / 'checkpoint'
  (ckpt / 'ckpt.data-00000-of-00002').write_bytes(b'x')
  ckpt = copy('linked') / 'checkpoint'
  (ckpt / 'ckpt.index').unlink()
  (ckpt / 'ckpt.index').symlink_to(out / 'checkpoint' / 'ckpt.index')
  assets = copy('deep') / 'saved_model' / 'assets' / 'flax_dtensor.json'
  assets.write_text('[' * 100_000 + ']' * 100_000)
  ckpt = copy('downgraded') / 'checkpoint'
  meta = json.loads((ckpt / 'flax_dtensor.json').read_text())
  meta['version'] = 2
  (ckpt / 'flax_dtensor.json').write_text(json.dumps(meta))
  ckpt = copy('escaping') / 'checkpoint'
  meta = json.loads((ckpt / 'flax_dtensor.json').read_text())
  meta['checkpoint_prefix'] = '../../intact/checkpoint/ckpt'
  (ckpt / 'flax_dtensor.json').write_text(json.dumps(meta))
  (copy('unmanifested') / 'checkpoint' / 'flax_dtensor.json').unlink()
  return copies


def test_inspect_verify_exit_statuses_without_jax_or_tensorflow(
  demo_export, tmp_path
):
  """0 intact, 1 damaged (each problem listed), 2 malformed; no JAX, no TF."""
  _, out, _, proc = demo_export
  ok(proc)
  copies = _damaged_copies(out, tmp_path)
  argvs = [['inspect', '--verify', str(d)] for d in copies.values()]
  results, heavy = _cli_in_process(
    *argvs,
    report="[m for m in ('jax', 'tensorflow', 'numpy') if m in sys.modules]",
  )
  assert heavy == []
  got = dict(zip(copies, results, strict=True))
  code, text = got['intact']
  assert code == 0, text
  assert text.count('\nintact: ') == 2
  assert 'intact: 3 files, 1.8 MiB, checked against flax_dtensor.json' in text
  assert '12 files, 1.9 MiB, checked against assets/flax_dtensor.json' in text
  code, text = got['flipped']
  assert code == 1, text
  assert re.search(
    r'- ckpt\.data-00000-of-00001 bytes 0\.\.\d+ changed \(CRC-32C [0-9a-f]{8}, '
    r'recorded [0-9a-f]{8}\)',
    ' '.join(text.split()),
  ), text
  assert '\ndamaged: 1 problem\n' in text and '\nintact: ' in text
  code, text = got['unlisted']
  assert code == 1, text
  assert (
    '- ckpt.data-00000-of-00002 is on disk but not in the manifest'
    in ' '.join(text.split())
  )
  code, text = got['linked']
  assert code == 1, text
  assert re.search(
    r"- ckpt\.index is refused: it resolves to '.*/out/checkpoint/ckpt\.index', "
    r'outside the export \(a symbolic link\)',
    output_util.unwrapped(text),
  ), text
  for name in ('deep', 'downgraded', 'escaping', 'unmanifested'):
    code, text = got[name]
    assert code == 2, (name, text)
  # The messages, from the command line itself; without --verify too.
  bad_input(
    run_cli('inspect', copies['deep']),
    'is not a valid flax_dtensor manifest: it nests deeper than Python parses',
  )
  bad_input(
    run_cli('inspect', '--verify', copies['downgraded']),
    'its version is 2; this flax_dtensor reads version',
    'version 2, without checksums, is not read',
  )
