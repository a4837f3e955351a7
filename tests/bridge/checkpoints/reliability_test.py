"""Nothing lost, nothing left behind: manifests, names, overwrites, recovery.

Each test is one row of what could go wrong with a model that took weeks to
train: a checkpoint damaged on disk or edited by hand, a restore into the
wrong model, an overwrite of a directory that is not ours, a save killed
between its two renames, names that collide.
"""

import base64
import concurrent.futures
import json
import os
import re
import socket
import subprocess
import sys
import textwrap

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support import manifests, processes, profiles

import flax_dtensor as fdt

tf = pytest.importorskip('tensorflow')
fdt_tf = pytest.importorskip('flax_dtensor.dtensor')
from flax_dtensor.dtensor._conversion import _names  # noqa: E402
from flax_dtensor.dtensor._format import _decode, _verify  # noqa: E402
from flax_dtensor.dtensor._storage import _atomic, _temporaries  # noqa: E402


def _model(mesh, seed=0, width=16):
  """Two sharded params and a replicated one, by seed."""
  key = jax.random.key(seed)
  return nnx.Dict(
    w=nnx.Param(
      jax.device_put(
        jax.random.normal(key, (8, width)),
        NamedSharding(mesh, P('data', 'model')),
      )
    ),
    b=nnx.Param(
      jax.device_put(
        jnp.arange(width, dtype=jnp.float32) + seed, NamedSharding(mesh, P())
      )
    ),
    n=nnx.BatchStat(
      jax.device_put(
        jnp.full((4,), seed, jnp.int32), NamedSharding(mesh, P('data'))
      )
    ),
  )


def _same(read, model):
  for path, variable in nnx.to_flat_state(nnx.state(model)):
    np.testing.assert_array_equal(read[path], np.asarray(variable.get_value()))


def _listing(path):
  return sorted(os.listdir(path))


# The manifest is checked
# ------------------------------------------------------------------------------


def test_manifest_records_every_variable_and_file(explicit_mesh, tmp_path):
  model = _model(explicit_mesh)
  path = fdt_tf.save_checkpoint(model, tmp_path / 'c')
  with open(os.path.join(path, 'flax_dtensor.json')) as f:
    meta = json.load(f)
  records = {tuple(r['path']): r for r in meta['variables']}
  assert set(records) == {('w',), ('b',), ('n',)}
  assert records[('w',)]['shape'] == [8, 16]
  # A CRC-32C (4 bytes, base64) per distinct block of the layout's grid.
  assert records[('w',)]['shards']['blocks'] == [2, 4]
  assert len(base64.b64decode(records[('w',)]['shards']['crc32c'])) == 8 * 4
  assert records[('b',)]['shards']['blocks'] == [1]  # Replicated: one copy.
  assert len(base64.b64decode(records[('b',)]['shards']['crc32c'])) == 4
  assert sorted(meta['files']) == sorted(
    n for n in os.listdir(path) if n != 'flax_dtensor.json'
  )


def _corrupt(path, name, how):
  target = os.path.join(path, name)
  with open(target, 'r+b') as f:
    data = bytearray(f.read())
    if how == 'flip':
      data[len(data) // 2] ^= 0xFF
    elif how == 'zero':
      data = bytearray(len(data))
    elif how == 'truncate':
      data = data[: len(data) // 2]
    f.seek(0)
    f.truncate()
    f.write(bytes(data))


@pytest.mark.parametrize(
  'name, how, match',
  [
    ('ckpt.index', 'flip', r'ckpt\.index bytes 0\.\.\d+ changed'),
    ('ckpt.index', 'zero', r'ckpt\.index bytes 0\.\.\d+ changed'),
    ('ckpt.index', 'truncate', r'ckpt\.index has \d+ bytes, not \d+'),
    ('data', 'truncate', r'ckpt\.data-\d+-of-\d+ has \d+ bytes, not \d+'),
    ('checkpoint', 'zero', r'checkpoint bytes 0\.\.\d+ changed'),
  ],
  ids=[
    'index-flipped',
    'index-zeroed',
    'index-truncated',
    'data-truncated',
    'state-zeroed',
  ],
)
def test_damaged_files_are_refused_before_tf_reads(
  explicit_mesh, tmp_path, name, how, match
):
  model = _model(explicit_mesh)
  path = fdt_tf.save_checkpoint(model, tmp_path / 'c')
  if name == 'data':  # The biggest data file: the variables' values.
    name = max(
      (n for n in os.listdir(path) if n.startswith('ckpt.data')),
      key=lambda n: os.path.getsize(os.path.join(path, n)),
    )
  _corrupt(path, name, how)
  for read in (
    lambda: fdt_tf.read_checkpoint(path),
    lambda: fdt_tf.restore_checkpoint(path, _model(explicit_mesh, seed=1)),
  ):
    with pytest.raises(
      fdt_tf.DamagedExportError,
      match=rf'{match}.*Nothing was read into TensorFlow',
    ):
      read()


@pytest.mark.parametrize('where', ['values', 'object graph', 'all'])
def test_damaged_data_is_refused_or_unused(explicit_mesh, tmp_path, where):
  """Data files are checked as they are read, each byte once.

  The data file is damaged: its first byte (a shard's values, written
  first), its last (TF's object graph, written last, which no reader here
  uses), or all of it zeroed. Where the readers use the bytes, TF's
  checksum stops the read and the whole check that follows names the file
  and bytes, the target unchanged. Where only the object graph is hit, the
  values come back exact, and the full check (`inspect --verify`) names
  the damage.
  """
  model = _model(explicit_mesh)
  path = fdt_tf.save_checkpoint(model, tmp_path / 'saved')
  (name,) = [n for n in os.listdir(path) if n.startswith('ckpt.data')]
  if where == 'all':
    _corrupt(path, name, 'zero')
  else:
    with open(os.path.join(path, name), 'r+b') as f:
      f.seek(
        0 if where == 'values' else -1,
        os.SEEK_SET if where == 'values' else os.SEEK_END,
      )
      byte = f.read(1)[0]
      f.seek(-1, os.SEEK_CUR)
      f.write(bytes([byte ^ 0xFF]))
  target = _model(explicit_mesh, seed=1)
  before = {
    p: np.asarray(v.get_value())
    for p, v in nnx.to_flat_state(nnx.state(target))
  }
  manifest = _decode.read(path)
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    (problem,) = _verify.problems_of(manifest, pool)
  # The range is the file's checked block: here the whole (small) file.
  size = os.path.getsize(os.path.join(path, name))
  assert re.fullmatch(
    rf'{re.escape(name)} bytes 0\.\.{size} changed \(CRC-32C '
    r'[0-9a-f]{8}, recorded [0-9a-f]{8}\)',
    problem,
  )
  if where == 'object graph':
    _same(fdt_tf.read_checkpoint(path), model)
    fdt_tf.restore_checkpoint(path, target)
    _same(
      {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(target))},
      model,
    )
    # Only TF's metadata was hit: a plain TF restore of the object graph
    # meets the damage through TF's own checksum.
    with pytest.raises(tf.errors.OpError):
      tf.train.load_checkpoint(os.path.join(path, 'ckpt')).get_tensor(
        '_CHECKPOINTABLE_OBJECT_GRAPH'
      )
    return
  with pytest.raises(fdt_tf.DamagedExportError) as e:
    fdt_tf.restore_checkpoint(path, target)
  assert re.search(
    rf'is damaged: {re.escape(problem)} \(.*found in the bytes read.*'
    r'Nothing was restored: the target is unchanged',
    str(e.value),
  ), str(e.value)
  for p, v in nnx.to_flat_state(nnx.state(target)):
    np.testing.assert_array_equal(np.asarray(v.get_value()), before[p])
  with pytest.raises(
    fdt_tf.DamagedExportError, match=rf'{re.escape(problem)} \('
  ):
    fdt_tf.read_checkpoint(path)


def test_a_plain_checkpoint_without_its_index_is_named(explicit_mesh, tmp_path):
  """TF's checkpoint file names a prefix whose index is gone: said so."""
  path = fdt_tf.save_checkpoint(_model(explicit_mesh), tmp_path / 'c')
  os.remove(os.path.join(path, 'flax_dtensor.json'))
  os.remove(os.path.join(path, 'ckpt.index'))
  for read in (
    lambda: fdt_tf.read_checkpoint(path),
    lambda: fdt_tf.restore_checkpoint(path, _model(explicit_mesh, seed=1)),
  ):
    with pytest.raises(
      fdt_tf.DamagedExportError,
      match=r"Expected a TF checkpoint in '.*c': its checkpoint state file "
      r"names the prefix 'ckpt', but ckpt\.index is not there\. The "
      r'checkpoint is incomplete: restore it from an intact copy, or '
      r're-export it\.',
    ):
      read()


def test_missing_file_is_refused(explicit_mesh, tmp_path):
  path = fdt_tf.save_checkpoint(_model(explicit_mesh), tmp_path / 'c')
  os.remove(os.path.join(path, 'ckpt.index'))
  with pytest.raises(
    fdt_tf.DamagedExportError, match=r'ckpt\.index is missing'
  ):
    fdt_tf.read_checkpoint(path)


# A damaged checkpoint must not break TF for the next one: in a fresh process,
# a damaged restore fails in our words, then a good restore and a save work.
_NOT_POISONED = textwrap.dedent(
  """
  import os, sys
  import jax, jax.numpy as jnp, numpy as np
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P
  import flax_dtensor as fdt
  from flax_dtensor import dtensor as fdt_tf

  fdt_tf.initialize()
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  def model(seed):
    return nnx.Dict(w=nnx.Param(jax.device_put(
        jnp.full((8, 16), seed, jnp.float32), NamedSharding(mesh, P('data')))))
  root = sys.argv[1]
  good = fdt_tf.save_checkpoint(model(1), os.path.join(root, 'good'))
  bad = fdt_tf.save_checkpoint(model(2), os.path.join(root, 'bad'))
  data = max((n for n in os.listdir(bad) if n.startswith('ckpt.data')),
             key=lambda n: os.path.getsize(os.path.join(bad, n)))
  with open(os.path.join(bad, data), 'r+b') as f:
    f.seek(100)
    f.write(b'garbage')
  try:
    fdt_tf.restore_checkpoint(bad, model(0))
    print('NOT REFUSED')
  except fdt.ExportError as e:
    print('REFUSED', 'damaged' in str(e))
  target = fdt_tf.restore_checkpoint(good, model(0))
  print('GOOD', float(np.asarray(target['w'].get_value()).mean()))
  fdt_tf.save_checkpoint(target, os.path.join(root, 'again'))
  print('SAVED', sorted(fdt_tf.read_checkpoint(os.path.join(root, 'again'))))
  """
)


def test_a_damaged_checkpoint_does_not_break_the_next_ones(warm_pool, tmp_path):
  script = tmp_path / 'script.py'
  script.write_text(_NOT_POISONED)
  out = warm_pool.run(script, tmp_path)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.strip().splitlines()
  assert lines == ['REFUSED True', 'GOOD 1.0', "SAVED [('w',)]"]


def _record_of(meta, name):
  (record,) = [r for r in meta['variables'] if r['path'] == [name]]
  return record


def _set_crc(record, k, value):
  """Sets the k-th shard's CRC-32C (the manifest keeps them in base64)."""
  crcs = np.frombuffer(base64.b64decode(record['shards']['crc32c']), '<u4')
  crcs = crcs.copy()
  crcs[k] = value
  record['shards']['crc32c'] = base64.b64encode(crcs.tobytes()).decode()


@pytest.mark.parametrize(
  'edit, kind, match',
  [
    (
      lambda m: _record_of(m, 'w').update(shape=[16, 8]),
      fdt_tf.MalformedExportError,
      r'w has shape \(8, 16\) in the data, \(16, 8\) in the manifest',
    ),
    (
      lambda m: _record_of(m, 'n').update(
        dtype='float32', stored_dtype='float32'
      ),
      fdt_tf.MalformedExportError,
      r'n is stored as int32 in the data, as float32 in the manifest',
    ),
    (
      lambda m: m['variables'].remove(_record_of(m, 'b')),
      fdt_tf.MalformedExportError,
      r'the data holds b, which the manifest does not list',
    ),
    (
      lambda m: _set_crc(_record_of(m, 'w'), 0, 12345),
      # Bytes that do not match their recorded CRC: damaged, as far as
      # anything can tell.
      fdt_tf.DamagedExportError,
      r'w\[0:4, 0:4\] read back with CRC-32C [0-9a-f]{8}, recorded 00003039',
    ),
  ],
  ids=['shape', 'dtype', 'dropped-record', 'shard-crc'],
)
def test_an_edited_manifest_is_refused(
  explicit_mesh, tmp_path, edit, kind, match
):
  model = _model(explicit_mesh)
  path = fdt_tf.save_checkpoint(model, tmp_path / 'c')
  manifests.edit(path, edit)
  for read in (
    lambda: fdt_tf.read_checkpoint(path),
    lambda: fdt_tf.restore_checkpoint(path, _model(explicit_mesh, seed=1)),
  ):
    with pytest.raises(kind, match=rf'is damaged: {match}'):
      read()


def test_read_checkpoint_never_casts(explicit_mesh, tmp_path):
  # The dtype of a float32 variable edited to bfloat16: stored alike? No:
  # bfloat16 is stored as itself, so the index disagrees at once. And to
  # float16, stored as float32 like float32: the shard CRCs disagree.
  model = nnx.Dict(w=nnx.Param(jnp.linspace(0, 1, 512, dtype=jnp.float32)))
  path = fdt_tf.save_checkpoint(model, tmp_path / 'c')
  manifests.edit(path, lambda m: _record_of(m, 'w').update(dtype='float16'))
  with pytest.raises(
    fdt_tf.DamagedExportError, match=r'w\[0:512\] read back with CRC-32'
  ):
    fdt_tf.read_checkpoint(path)
  manifests.edit(path, lambda m: _record_of(m, 'w').update(dtype='bfloat16'))
  with pytest.raises(
    fdt_tf.MalformedExportError, match='bfloat16 is stored as bfloat16'
  ):
    fdt_tf.read_checkpoint(path)


def test_restore_into_another_model_is_refused(explicit_mesh, tmp_path):
  model = _model(explicit_mesh)
  path = fdt_tf.save_checkpoint(model, tmp_path / 'c')
  smaller = nnx.Dict(w=nnx.Param(jnp.zeros((8, 16))))
  with pytest.raises(
    fdt.ExportError,
    match=r'holds 2 variable\(s\) the target does not have: b, n.*'
    r'`allow_extra=True`',
  ):
    fdt_tf.restore_checkpoint(path, smaller)
  np.testing.assert_array_equal(smaller['w'].get_value(), 0)
  fdt_tf.restore_checkpoint(path, smaller, allow_extra=True)
  np.testing.assert_array_equal(
    smaller['w'].get_value(), np.asarray(model['w'].get_value())
  )
  # A restore with a narrower filter is not "another model".
  target = _model(explicit_mesh, seed=1)
  fdt_tf.restore_checkpoint(path, target, include=nnx.Param)
  np.testing.assert_array_equal(target['n'].get_value(), 1)
  np.testing.assert_array_equal(
    target['b'].get_value(), np.asarray(model['b'].get_value())
  )


def test_os_errors_are_ours(explicit_mesh, tmp_path, monkeypatch):
  model = _model(explicit_mesh)
  # A real OS error, whoever runs the tests: a name too long.
  with pytest.raises(
    fdt.ExportError,
    match=r'File name too long.*Check the path and its permissions',
  ):
    fdt_tf.save_checkpoint(model, tmp_path / ('x' * 300))

  # A read-only parent directory. Tests here run as root, who may write
  # anywhere, so the OS's refusal is simulated where the save would meet it.
  def refuse(path, *args, **kwargs):
    raise PermissionError(13, 'Permission denied', path)

  monkeypatch.setattr(_atomic.os, 'mkdir', refuse)
  with pytest.raises(
    fdt.ExportError,
    match=r'Permission denied.*Check the path and its permissions',
  ):
    fdt_tf.save_checkpoint(model, tmp_path / 'c')
  assert _listing(tmp_path) == []


def test_permission_errors_are_ours_even_for_root(explicit_mesh, tmp_path):
  """A path through a file: the OS refuses whoever asks."""
  (tmp_path / 'a_file').write_text('x')
  with pytest.raises(
    fdt.ExportError, match=r"is not a directory: '.*a_file' is a file"
  ):
    fdt_tf.save_checkpoint(_model(explicit_mesh), tmp_path / 'a_file' / 'c')
  path = fdt_tf.save_checkpoint(_model(explicit_mesh), tmp_path / 'c')
  os.remove(os.path.join(path, 'flax_dtensor.json'))
  with open(os.path.join(path, 'ckpt.index'), 'wb') as f:
    f.write(b'not an index')
  with pytest.raises(
    fdt_tf.DamagedExportError,
    match=r'Reading the index of the checkpoint .* failed in TensorFlow: '
    r'.*The checkpoint is damaged or not a TF checkpoint: restore it from an '
    r'intact copy',
  ):
    fdt_tf.read_checkpoint(path)


# Names cannot collide
# ------------------------------------------------------------------------------


def test_paths_that_differ_by_a_slash_or_a_type_stay_apart(tmp_path):
  model = nnx.Dict(
    {
      'x': nnx.Dict(
        {
          'a/b': nnx.Param(jnp.zeros((2,), jnp.float32)),
          'a': nnx.Dict({'b': nnx.Param(jnp.ones((3,), jnp.int32))}),
          'c.d e': nnx.Param(jnp.full((1,), 2.0)),
          'ü': nnx.Param(jnp.full((1,), 3.0)),
          '0': nnx.Param(jnp.full((1,), 4.0)),
          '~1': nnx.Param(jnp.full((1,), 5.0)),
        }
      ),
      'l': nnx.List([nnx.Param(jnp.full((1,), 6.0))]),
    }
  )
  expected = {
    p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))
  }
  assert len(expected) == 7
  path = fdt_tf.save_checkpoint(model, tmp_path / 'c')
  read = fdt_tf.read_checkpoint(path)
  assert set(read) == set(expected)
  for p, value in expected.items():
    assert read[p].dtype == value.dtype, p
    np.testing.assert_array_equal(read[p], value)
  assert isinstance(next(k for k in read if k[0] == 'l')[1], int)
  assert ('x', '0') in read and ('x', 0) not in read
  flat = fdt_tf.flat_variables(fdt_tf.to_tf_module(model))
  assert set(flat) == set(expected)
  # The model just saved restores.
  fresh = jax.tree.map(jnp.zeros_like, model)
  fdt_tf.restore_checkpoint(path, fresh)
  for p, variable in nnx.to_flat_state(nnx.state(fresh)):
    np.testing.assert_array_equal(np.asarray(variable.get_value()), expected[p])


_KEY = st.one_of(
  st.integers(min_value=0, max_value=10**6),
  st.text(
    alphabet=st.characters(blacklist_categories=('Cs',)), min_size=0, max_size=6
  ),
  st.sampled_from(['', '0', '-1', '~', '~0', '.', '..', '/', 'a/b', 'a.S']),
)


@hypothesis.settings(
  max_examples=profiles.examples(3000), deadline=None, derandomize=True
)
@hypothesis.given(
  st.lists(st.lists(_KEY, min_size=1, max_size=4), min_size=2, max_size=2)
)
def test_checkpoint_keys_are_injective(paths):
  a, b = map(tuple, paths)
  for p in (a, b):
    assert fdt_tf.nnx_path(fdt_tf.checkpoint_key(p)) == p
  if a != b:
    assert fdt_tf.checkpoint_key(a) != fdt_tf.checkpoint_key(b)


def test_path_keys_that_are_neither_str_nor_int_are_refused():
  with pytest.raises(fdt.ExportError, match=r'str or int, got float 1\.5'):
    fdt_tf.checkpoint_key(('a', 1.5))


# Never destroy what is not ours
# ------------------------------------------------------------------------------


@pytest.mark.parametrize(
  'where, why',
  [
    ('cwd', 'the current directory or one of its ancestors'),
    ('dot', 'the current directory or one of its ancestors'),
    ('ancestor', 'the current directory or one of its ancestors'),
    ('home', 'the home directory'),
    ('root', 'the filesystem root'),
    ('user-dir', 'non-empty directory without a flax_dtensor.json'),
    ('file', 'a file, not an export directory'),
    ('symlink', 'a symbolic link'),
  ],
)
def test_overwrite_refuses_what_is_not_ours(
  explicit_mesh, tmp_path, monkeypatch, where, why
):
  work = tmp_path / 'project' / 'work'
  work.mkdir(parents=True)
  (work / 'notes.txt').write_text('precious')
  monkeypatch.chdir(work)
  home = tmp_path / 'home'
  home.mkdir()
  (home / '.bashrc').write_text('precious')
  monkeypatch.setenv('HOME', str(home))
  user_dir = tmp_path / 'user-dir'
  user_dir.mkdir()
  (user_dir / 'data.csv').write_text('precious')
  (tmp_path / 'file').write_text('precious')
  (tmp_path / 'symlink').symlink_to(user_dir)
  target = {
    'cwd': str(work),
    'dot': '.',
    'ancestor': str(tmp_path / 'project'),
    'home': str(home),
    'root': '/',
    'user-dir': str(user_dir),
    'file': str(tmp_path / 'file'),
    'symlink': str(tmp_path / 'symlink'),
  }[where]
  before = sorted(os.walk(tmp_path))
  with pytest.raises(
    fdt.ExportError, match=rf'Refusing to overwrite .*{why}.*export written by'
  ):
    fdt_tf.save_checkpoint(_model(explicit_mesh), target, overwrite=True)
  assert sorted(os.walk(tmp_path)) == before
  assert (work / 'notes.txt').read_text() == 'precious'


def test_an_empty_path_is_refused(explicit_mesh):
  with pytest.raises(fdt.ExportError, match='got an empty path'):
    fdt_tf.save_checkpoint(_model(explicit_mesh), '', overwrite=True)


def test_overwrite_replaces_our_exports_and_empty_directories(
  explicit_mesh, tmp_path
):
  (tmp_path / 'empty').mkdir()
  path = fdt_tf.save_checkpoint(
    _model(explicit_mesh, seed=1), tmp_path / 'empty', overwrite=True
  )
  _same(fdt_tf.read_checkpoint(path), _model(explicit_mesh, seed=1))
  path = fdt_tf.save_checkpoint(
    _model(explicit_mesh, seed=2), path, overwrite=True
  )
  _same(fdt_tf.read_checkpoint(path), _model(explicit_mesh, seed=2))
  assert _listing(tmp_path) == ['empty']


# Remote paths
# ------------------------------------------------------------------------------


@pytest.mark.parametrize('url', ['gs://bucket/x', 's3://b/x', 'hdfs://h/x'])
def test_remote_paths_are_refused_up_front(
  explicit_mesh, tmp_path, monkeypatch, url
):
  monkeypatch.chdir(tmp_path)
  (tmp_path / 'gs:').mkdir()  # A local look-alike must not be written.
  for call in (
    lambda: fdt_tf.save_checkpoint(_model(explicit_mesh), url),
    lambda: fdt_tf.read_checkpoint(url),
    lambda: fdt_tf.restore_checkpoint(url, _model(explicit_mesh)),
  ):
    with pytest.raises(
      fdt.ExportError, match=r'got the URL .*Supported: a local filesystem path'
    ):
      call()
  assert _listing(tmp_path) == ['gs:']
  assert os.listdir(tmp_path / 'gs:') == []


@pytest.mark.parametrize('value', [None, 42], ids=repr)
def test_saves_refuse_what_is_no_model(tmp_path, value):
  """Not "no variable matched `include=`": what arrived, named."""
  match = (
    r'Expected an NNX module, another NNX graph node \(e\.g\. '
    rf'nnx\.Optimizer\) or an nnx\.State; got {type(value).__name__}'
  )
  with pytest.raises(fdt.NotAModelError, match=match):
    fdt_tf.save_checkpoint(value, tmp_path / 'c')
  assert not (tmp_path / 'c').exists()


def test_file_urls_are_local_paths(explicit_mesh, tmp_path):
  path = fdt_tf.save_checkpoint(_model(explicit_mesh), f'file://{tmp_path}/c')
  assert path == str(tmp_path / 'c')
  _same(fdt_tf.read_checkpoint(f'file://{tmp_path}/c'), _model(explicit_mesh))


# Recovery after a kill
# ------------------------------------------------------------------------------


def _dead_pid():
  proc = subprocess.Popen(
    [sys.executable, '-c', 'pass'],
    env=processes.clean_env(),
    stdin=subprocess.DEVNULL,
  )
  proc.wait(timeout=60)
  return proc.pid


def _mark(directory, state, pid=None, host=None):
  with open(os.path.join(directory, _temporaries.MARKER), 'w') as f:
    json.dump(
      {
        'pid': pid if pid is not None else _dead_pid(),
        'host': host or socket.gethostname(),
        'started': None,
        'state': state,
      },
      f,
    )


def _killed_between_renames(mesh, tmp_path, *, new_complete):
  """The state a save leaves when killed after moving the old one aside."""
  old = fdt_tf.save_checkpoint(_model(mesh, seed=1), tmp_path / 'old-src')
  new = fdt_tf.save_checkpoint(_model(mesh, seed=2), tmp_path / 'new-src')
  os.rename(old, tmp_path / '.c.old-0000aaaa')
  _mark(tmp_path / '.c.old-0000aaaa', _temporaries.REPLACED)
  os.rename(new, tmp_path / '.c.tmp-0000bbbb')
  _mark(
    tmp_path / '.c.tmp-0000bbbb',
    _temporaries.COMPLETE if new_complete else _temporaries.WRITING,
  )
  return str(tmp_path / 'c')


@pytest.mark.parametrize('new_complete', [True, False], ids=['new', 'old'])
def test_a_kill_between_the_renames_is_recovered_by_a_read(
  explicit_mesh, tmp_path, new_complete
):
  path = _killed_between_renames(
    explicit_mesh, tmp_path, new_complete=new_complete
  )
  assert not os.path.exists(path)
  read = fdt_tf.read_checkpoint(path)
  _same(read, _model(explicit_mesh, seed=2 if new_complete else 1))
  assert _listing(tmp_path) == ['c']
  assert _temporaries.MARKER not in os.listdir(path)


def test_a_kill_between_the_renames_is_recovered_by_a_save(
  explicit_mesh, tmp_path
):
  path = _killed_between_renames(explicit_mesh, tmp_path, new_complete=True)
  with pytest.raises(fdt.ExportError, match='already exists'):
    fdt_tf.save_checkpoint(_model(explicit_mesh, seed=3), path)
  _same(fdt_tf.read_checkpoint(path), _model(explicit_mesh, seed=2))
  assert _listing(tmp_path) == ['c']


@pytest.fixture
def live_pid():
  """The pid of a process that lives through the test (another writer)."""
  proc = subprocess.Popen(
    [sys.executable, '-c', 'import time; time.sleep(600)'],
    env=processes.clean_env(),
    stdin=subprocess.DEVNULL,
  )
  try:
    yield proc.pid
  finally:
    proc.kill()
    proc.wait(timeout=60)


def _named(directory, infix, pid, host=None):
  """A temporary's path whose name says its writer (as saves name them)."""
  writer = _temporaries.Writer.on_this_host(pid)
  if host is not None:
    writer = _temporaries.Writer(pid, host, None)
  name = f'.{os.path.basename(directory)}{infix}{writer.tag()}'
  path = os.path.join(os.path.dirname(directory), name)
  os.mkdir(path)
  with open(os.path.join(path, 'ckpt.data-00000-of-00001'), 'w') as f:
    f.write('partial')
  return os.path.basename(path)


def test_a_temporary_is_owned_from_the_moment_it_exists(
  explicit_mesh, tmp_path, live_pid
):
  """Its name says who writes it: no marker needed to judge it."""
  path = fdt_tf.save_checkpoint(_model(explicit_mesh), tmp_path / 'c')
  dead = [
    _named(path, '.tmp-', _dead_pid()),  # Killed before any marker.
    _named(path, '.old-', _dead_pid()),  # Killed between the renames.
  ]
  other_host = _named(path, '.tmp-', _dead_pid(), host='another-host')
  # A pid reused by a live process: another start time, so dead.
  reused = _temporaries.Writer(live_pid, _temporaries.Writer.me().host, '1')
  os.mkdir(tmp_path / f'.c.tmp-{reused.tag()}')
  # A failed save of this very process, not being written any more.
  dead.append(_named(path, '.tmp-', os.getpid()))
  assert set(dead) <= set(_listing(tmp_path))
  fdt_tf.save_checkpoint(_model(explicit_mesh, seed=1), path, overwrite=True)
  assert _listing(tmp_path) == sorted([other_host, 'c'])
  # A live writer is never disturbed, whatever its temporary holds.
  live = _named(path, '.tmp-', live_pid)
  with pytest.raises(
    fdt_tf.SaveInProgressError,
    match=rf'Another save to .* is in progress \(pid {live_pid} on host',
  ):
    fdt_tf.save_checkpoint(_model(explicit_mesh), path, overwrite=True)
  assert _listing(tmp_path) == sorted([other_host, live, 'c'])
  _same(fdt_tf.read_checkpoint(path), _model(explicit_mesh, seed=1))


def test_staging_directories_of_dead_writers_are_removed(tmp_path, live_pid):
  """The command line's scratch directory: named by its writer too."""

  def staging(pid):
    path = tmp_path / (
      '.flax_dtensor-staging-' + _temporaries.Writer.on_this_host(pid).tag()
    )
    (path / 'checkpoint').mkdir(parents=True)
    (path / 'checkpoint' / 'ckpt.index').write_text('partial')
    return path.name

  staging(_dead_pid())
  live = staging(live_pid)
  with _atomic.all_or_nothing(
    tmp_path, ['out'], overwrite=False, is_export=_decode.is_export
  ) as staged:
    os.mkdir(staged['out'])
    (tmp_path / staged['out'] / 'a.txt').write_text('new')
    # Its own scratch directory stays while it writes.
    mine = os.path.basename(os.path.dirname(staged['out']))
    assert _temporaries.Writer.from_name(mine, '.flax_dtensor-staging-') == (
      _temporaries.Writer.me()
    )
    assert _listing(tmp_path) == sorted([live, mine])
  assert _listing(tmp_path) == sorted([live, 'out'])
  assert (tmp_path / 'out' / 'a.txt').read_text() == 'new'


def test_temporaries_of_older_versions_are_judged_by_their_marker(
  explicit_mesh, tmp_path, live_pid
):
  """Names without the writer: the marker (or its half-written copy) says."""
  path = fdt_tf.save_checkpoint(_model(explicit_mesh), tmp_path / 'c')
  for name, kwargs in [
    ('.c.tmp-00000001', {}),  # Dead writer.
    ('.c.old-00000002', {}),  # Dead writer.
    ('.c.tmp-00000003', {'host': 'another-host'}),  # Unknown: kept.
    ('.c.tmp-00000006', {'pid': live_pid}),  # Live: kept.
  ]:
    os.mkdir(tmp_path / name)
    (tmp_path / name / 'ckpt.index').write_text('partial')
    _mark(tmp_path / name, _temporaries.WRITING, **kwargs)
  os.mkdir(tmp_path / '.c.tmp-00000004')  # Killed before its marker: empty.
  # Killed while renaming its marker into place: the copy says who.
  os.mkdir(tmp_path / '.c.tmp-00000007')
  _mark(tmp_path / '.c.tmp-00000007', _temporaries.WRITING)
  os.rename(
    tmp_path / '.c.tmp-00000007' / _temporaries.MARKER,
    tmp_path / '.c.tmp-00000007' / (_temporaries.MARKER + '.new'),
  )
  # Unmarked and not empty: nothing says whose, so it is kept.
  os.mkdir(tmp_path / '.c.tmp-00000008')
  (tmp_path / '.c.tmp-00000008' / 'ckpt.index').write_text('partial')
  with pytest.raises(
    fdt_tf.SaveInProgressError,
    match=rf'Another save to .* is in progress \(pid {live_pid}',
  ):
    fdt_tf.save_checkpoint(_model(explicit_mesh, seed=1), path, overwrite=True)
  _same(fdt_tf.read_checkpoint(path), _model(explicit_mesh))
  assert _listing(tmp_path) == [
    '.c.tmp-00000003',
    '.c.tmp-00000006',
    '.c.tmp-00000008',
    'c',
  ]


def test_the_parent_directory_is_synced_after_the_rename(
  explicit_mesh, tmp_path, monkeypatch
):
  synced = []
  real = _temporaries.fsync_dir
  monkeypatch.setattr(
    _temporaries,
    'fsync_dir',
    lambda p: (synced.append(os.path.abspath(p)), real(p)),
  )
  fdt_tf.save_checkpoint(_model(explicit_mesh), tmp_path / 'c')
  assert str(tmp_path) in synced
  assert synced.index(str(tmp_path)) > synced.index(str(tmp_path / 'c'))


def test_names_module_round_trips_str_paths():
  assert _names.parse_path('layers/0/kernel') == ('layers', 0, 'kernel')
  assert _names.parse_path(('a', '0')) == ('a', '0')
