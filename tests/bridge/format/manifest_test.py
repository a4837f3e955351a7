"""A checkpoint from elsewhere reads nothing outside itself.

Crafted manifests (paths out of the export, links out of it, files TF would
read unverified, a downgrade to no checksums, malformed documents of every
shape) each meet our `ExportError` before TensorFlow opens anything; and a
property test mutates a valid manifest: every outcome is our error or an
exact restore, and no file outside the export is opened by Python (an audit
hook sees every `open`) or handed to TensorFlow as a prefix (a spy on our
own call site).
"""

import base64
import concurrent.futures
import contextlib
import itertools
import json
import os
import pathlib
import shutil
import zlib

import google_crc32c
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support import manifests, opened

import flax_dtensor as fdt

tf = pytest.importorskip('tensorflow')
fdt_tf = pytest.importorskip('flax_dtensor.dtensor')
from flax_dtensor.cli import _command  # noqa: E402
from flax_dtensor.cli import inspect as inspect_command  # noqa: E402
from flax_dtensor.dtensor._checkpoints import _restore  # noqa: E402
from flax_dtensor.dtensor._format import _checksums, _decode, _model, _verify  # noqa: E402
from flax_dtensor.dtensor._format import _model as format_model  # noqa: E402

MANIFEST = _model.FILE
VERSION = _model.VERSION
CHECKSUM = _model.READABLE[VERSION]  # The key of per-entry checksums.


def _model(mesh, seed):
  """A plain dict of layers: a sharded kernel, a bias, a BatchNorm."""
  key = jax.random.key(seed)
  return nnx.Dict(
    dense=nnx.Dict(
      kernel=nnx.Param(
        jax.device_put(
          jax.random.normal(key, (8, 16)),
          NamedSharding(mesh, P('data', 'model')),
        )
      ),
      bias=nnx.Param(jnp.arange(16, dtype=jnp.float32) + seed),
    ),
    norm=nnx.BatchNorm(16, rngs=nnx.Rngs(seed)),
  )


def _values(tree):
  return {
    path: np.asarray(v.get_value())
    for path, v in nnx.to_flat_state(nnx.state(tree))
  }


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  """(root of everything, checkpoint 'mine', another one 'theirs', mesh)."""
  base = tmp_path_factory.mktemp('confined')
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  mine = fdt_tf.save_checkpoint(_model(mesh, 0), base / 'mine')
  theirs = fdt_tf.save_checkpoint(_model(mesh, 7), base / 'theirs')
  return base, str(mine), str(theirs), mesh


def _meta(directory):
  with open(os.path.join(directory, MANIFEST)) as f:
    return json.load(f)


def _write(directory, meta):
  with open(os.path.join(directory, MANIFEST), 'w') as f:
    json.dump(meta, f)


# What Python opens, and what our code hands TensorFlow
# ------------------------------------------------------------------------------


@contextlib.contextmanager
def _watched(monkeypatch, base, root):
  """Asserts that nothing under `base` outside `root` is opened or read."""
  prefixes = []
  real = _restore._reader

  def spy(prefix, manifest):
    prefixes.append(prefix)
    return real(prefix, manifest)

  monkeypatch.setattr(_restore, '_reader', spy)
  try:
    with opened.recording() as paths:
      yield
  finally:
    monkeypatch.setattr(_restore, '_reader', real)
  opened.assert_inside(paths, base, root)
  inside = os.path.realpath(root) + os.sep
  for prefix in prefixes:
    real_prefix = os.path.realpath(prefix)
    assert real_prefix.startswith(inside), f'TF was handed {prefix}'


# Crafted manifests
# ------------------------------------------------------------------------------


def _prefix_elsewhere(absolute):
  def edit(meta, root, theirs):
    other = _meta(theirs)
    where = theirs if absolute else os.path.relpath(theirs, root)
    meta.update(other)
    meta['checkpoint_prefix'] = os.path.join(where, other['checkpoint_prefix'])
    meta['files'] = {
      os.path.join(where, n): s for n, s in other['files'].items()
    }

  return edit


def _symlinked_shards(meta, root, theirs):
  meta.clear()
  meta.update(_meta(theirs))
  for name in os.listdir(theirs):
    if name.startswith('ckpt.'):
      os.remove(os.path.join(root, name))
      os.symlink(os.path.join(theirs, name), os.path.join(root, name))


def _version(n):
  def edit(meta, root, theirs):
    meta['version'] = n

  return edit


def _downgraded(meta, root, theirs):
  """Version 2's shape: no checksums at all, and a prefix elsewhere."""
  _prefix_elsewhere(absolute=False)(meta, root, theirs)
  meta['version'] = 2
  meta['variables'] = {
    '/'.join(map(str, r['path'])): {
      k: v for k, v in r.items() if k not in ('path', 'shards')
    }
    for r in meta['variables']
  }
  for key in ('files', 'checksum', 'chunk_bytes'):
    del meta[key]


def _unlisted_data(meta, root, theirs):
  data = [n for n in meta['files'] if '.data-' in n]
  del meta['files'][data[0]]


def _prefix_is_a_directory(meta, root, theirs):
  # TF reads a prefix that is a directory as one: its `checkpoint` file may
  # name any checkpoint on the machine.
  os.mkdir(os.path.join(root, 'sub'))
  with open(os.path.join(root, 'sub', 'checkpoint'), 'w') as f:
    f.write(f'model_checkpoint_path: "{theirs}/ckpt"\n')
  meta['checkpoint_prefix'] = 'sub'
  meta['files'] = {
    n.replace('ckpt.', 'sub.'): s for n, s in meta['files'].items()
  }
  for name in os.listdir(root):
    if name.startswith('ckpt.'):
      os.rename(
        os.path.join(root, name),
        os.path.join(root, name.replace('ckpt.', 'sub.')),
      )


def _manifest_linked_out(meta, root, theirs):
  os.remove(os.path.join(root, MANIFEST))
  os.symlink(os.path.join(theirs, MANIFEST), os.path.join(root, MANIFEST))
  return 'linked'


def _set(key, value):
  def edit(meta, root, theirs):
    meta[key] = value

  return edit


def _shape_bomb(meta, root, theirs):
  record = _variable(meta, 'bias')  # Replicated: one shard, whatever size.
  record['shape'] = [10**13]


def _no_shards(meta, root, theirs):
  for record in meta['variables']:
    record['shards'][CHECKSUM] = ''


def _variable(meta, name):
  return next(v for v in meta['variables'] if v['path'][-1] == name)


def _text(text):
  def edit(meta, root, theirs):
    return text

  return edit


def _deep(meta, root, theirs):
  return '[' * 100_000 + ']' * 100_000


def _huge_file(meta, root, theirs):
  with open(os.path.join(root, MANIFEST), 'wb') as f:
    f.truncate(_decode.MAX_BYTES + 1)  # Sparse: no bytes written.
  return 'written'


_REFUSED = r'Nothing was read into TensorFlow'
CRAFTED = [
  (
    '../ prefix',
    _prefix_elsewhere(absolute=False),
    r"checkpoint_prefix '\.\./theirs/ckpt' is refused: it has a `\.\.`",
  ),
  (
    'absolute prefix',
    _prefix_elsewhere(absolute=True),
    r"checkpoint_prefix '/.*/theirs/ckpt' is refused: it is absolute",
  ),
  (
    'version 2',
    _downgraded,
    r'its version is 2;.*version 2, without checksums, is not read',
  ),
  (
    'version as a float',
    _version(float(VERSION)),
    rf'its version is {float(VERSION)};',
  ),
  ('version true', _version(True), r'its version is True;'),
  (
    'shards symlinked to another checkpoint',
    _symlinked_shards,
    r'ckpt\.\S+ is refused: it resolves to .*/theirs/ckpt\S+, outside the '
    r'export \(a symbolic link\).*' + _REFUSED,
  ),
  (
    'a data file not listed',
    _unlisted_data,
    r'ckpt\.data-\S+ is on disk but not in the manifest.*' + _REFUSED,
  ),
  (
    'prefix is a directory',
    _prefix_is_a_directory,
    r'the checkpoint prefix sub is a file or directory on disk',
  ),
  (
    'manifest linked out',
    _manifest_linked_out,
    r'the manifest itself is refused: it resolves to .*/theirs/',
  ),
  ('file named ./ckpt', _set('checkpoint_prefix', './ckpt'), 'not normalized'),
  ('drive letter', _set('checkpoint_prefix', 'C:ckpt'), 'a drive letter'),
  ('NUL', _set('checkpoint_prefix', 'ck\0pt'), 'a NUL character'),
  ('backslash', _set('checkpoint_prefix', '..\\ckpt'), 'a backslash'),
  ('prefix a number', _set('checkpoint_prefix', 5), 'not a string but'),
  (
    'another checksum',
    _set('checksum', 'md5'),
    f"version {VERSION} uses '{CHECKSUM}'",
  ),
  (
    'shape bomb',
    _shape_bomb,
    r'has shape \(16,\) in the data, \(10000000000000,\) in the manifest',
  ),
  (
    'no shards recorded',
    _no_shards,
    r'dense/bias has 0 shard checksums, where its layout \(one device\) '
    r'implies 1 shard\b',
  ),
  ('deep nesting', _deep, 'nests deeper than Python parses'),
  (
    'nesting past the limit',
    _text('[' * 65 + ']' * 65),
    'nests more than 64 levels deep',
  ),
  ('duplicate keys', _text('{"a": 1, "a": 2}'), "the key 'a' appears twice"),
  ('NaN', _text('{"version": NaN}'), 'NaN is not a JSON number'),
  ('Infinity', _text('{"version": -Infinity}'), 'Infinity is not a JSON'),
  ('huge number', _text('{"version": 1' + '0' * 5000 + '}'), 'ValueError'),
  ('not UTF-8', _text(b'{"format": "\xff"}'), 'it is not UTF-8'),
  ('huge file', _huge_file, 'bytes, more than a manifest'),
  ('negative size', None, r'has -1 bytes'),
  ('crc too big', None, r'expected a list of ints in \[0, 4294967296\)'),
  ('negative shape', None, r'a shape is \[-8, 16\]'),
  (
    "blocks not the layout's",
    None,
    r'the shards of dense/kernel are \[4, 2\] blocks, where its layout '
    r"\(\[\['data'\], \['model'\]\] over data=2,model=4\) cuts its shape "
    r'\(8, 16\) into \[2, 4\]',
  ),
  (
    'a shard checksum removed',
    None,
    r'dense/kernel has 7 shard checksums, where its layout .* implies 8',
  ),
  (
    'shards of an uneven layout',
    None,
    r'the layout of dense/kernel implies no shards: its layout cuts a '
    r'dimension of 16 into 3 blocks, unevenly',
  ),
  (
    'checksums not base64',
    None,
    rf'the {CHECKSUM} of the shards of dense/kernel are not base64',
  ),
  (
    'checksums a number',
    None,
    rf'the shards of dense/kernel are .*expected blocks and {CHECKSUM}',
  ),
  ('path missing', None, r'a variable path is None'),
  ('dtype a list', None, r'the dtype of .* is \[1\]'),
]


def _field_edit(case):
  def edit(meta, root, theirs):
    files = meta['files']
    first = sorted(files)[0]
    var = meta['variables'][0]
    if case == 'negative size':
      files[first]['bytes'] = -1
    elif case == 'crc too big':
      files[first][CHECKSUM] = [2**32]
    elif case == 'negative shape':
      var['shape'] = [-8, 16]
    elif case == "blocks not the layout's":
      _variable(meta, 'kernel')['shards']['blocks'] = [4, 2]
    elif case == 'a shard checksum removed':
      shards = _variable(meta, 'kernel')['shards']
      shards[CHECKSUM] = _b64(_crcs(shards)[:-1])
    elif case == 'shards of an uneven layout':
      layout = _variable(meta, 'kernel')['sharding']['mesh']
      layout['axis_sizes'] = [2, 3]
    elif case == 'checksums not base64':
      _variable(meta, 'kernel')['shards'][CHECKSUM] = 'not base64!'
    elif case == 'checksums a number':
      _variable(meta, 'kernel')['shards'][CHECKSUM] = 12
    elif case == 'path missing':
      del var['path']
    elif case == 'dtype a list':
      var['dtype'] = [1]

  return edit


def _crcs(shards):
  return list(np.frombuffer(base64.b64decode(shards[CHECKSUM]), '<u4'))


def _b64(crcs):
  return base64.b64encode(np.asarray(crcs, '<u4').tobytes()).decode()


def _craft(saved, tmp_path, edit):
  base, mine, theirs, _ = saved
  root = os.path.join(base, tmp_path.name)
  shutil.copytree(mine, root)
  meta = _meta(root)
  text = edit(meta, root, theirs)
  if text is None:
    _write(root, meta)
  elif isinstance(text, str | bytes) and text not in ('linked', 'written'):
    mode = 'wb' if isinstance(text, bytes) else 'w'
    with open(os.path.join(root, MANIFEST), mode) as f:
      f.write(text)
  return root


@pytest.mark.parametrize(
  ('edit', 'match'),
  [(e or _field_edit(name), m) for name, e, m in CRAFTED],
  ids=[c[0] for c in CRAFTED],
)
def test_a_crafted_manifest_is_refused(
  saved, tmp_path, monkeypatch, edit, match
):
  base, _, _, mesh = saved
  root = _craft(saved, tmp_path, edit)
  target = _model(mesh, 1)
  before = _values(target)
  with _watched(monkeypatch, base, root):
    with pytest.raises(fdt_tf.MalformedExportError, match=match):
      fdt_tf.restore_checkpoint(root, target)
    with pytest.raises(fdt_tf.MalformedExportError, match=match):
      fdt_tf.read_checkpoint(root)
  after = _values(target)
  assert before.keys() == after.keys()
  for path, value in before.items():
    np.testing.assert_array_equal(after[path], value)


# Version 3: each shard its own record
# ------------------------------------------------------------------------------


as_version_3 = manifests.as_version_3


@pytest.fixture(scope='module')
def saved_v4(saved):
  """`saved`, with 'mine' written as version 4 wrote it (CRC-32)."""
  base, _, theirs, mesh = saved
  with manifests.writing_version(4):
    mine = fdt_tf.save_checkpoint(_model(mesh, 0), base / 'mine_v4')
  return base, str(mine), theirs, mesh


def _kernel_shards(meta):
  return _variable(meta, 'kernel')['shards']


def _v3_edit(case):
  def edit(meta, root, theirs):
    shards = _kernel_shards(as_version_3(meta))
    if case == 'a record removed':
      del shards[5]
    elif case == 'an index moved onto another':
      shards[5]['index'] = shards[6]['index']
    elif case == 'an index changed off the grid':
      shards[5]['index'] = [[4, 8], [4, 9]]
    elif case == 'an index reversed':
      shards[0]['index'] = [[4, 0]]
    elif case == 'an index out of shape':
      shards[7]['index'] = [[4, 9], [12, 16]]
    elif case == 'a crc a string':
      shards[0]['crc32'] = '12'
    elif case == 'no records':
      shards.clear()

  return edit


VERSION_3 = [
  (
    'a record removed',
    r'the shards recorded for dense/kernel do not cover \[4:8, 4:8\], so '
    r'those values were never saved or their records are lost',
  ),
  (
    'an index moved onto another',
    r'the shards recorded for dense/kernel record the block \[4:8, 8:12\] '
    r'twice',
  ),
  (
    'an index changed off the grid',
    r'the shards recorded for dense/kernel are not the equal blocks of a '
    r'grid \(dimension 1 is cut into 0:4, 4:8, 4:9, 8:12, 12:16\)',
  ),
  (
    'an index reversed',
    r'the shard index \[\[4, 0\]\] is not a list of \[start, stop\] pairs',
  ),
  (
    'an index out of shape',
    r'the shards recorded for dense/kernel do not fit its shape \(8, 16\)',
  ),
  ('a crc a string', r'the crc32 of a shard is .*expected an int'),
  (
    'no records',
    r'the shards recorded for dense/kernel do not cover \[0:8, 0:16\]',
  ),
]


def test_a_version_3_manifest_still_reads(saved_v4, tmp_path, monkeypatch):
  """Checkpoints on disk from before version 4 restore as they did."""
  base, _, _, mesh = saved_v4
  root = _craft(
    saved_v4, tmp_path, lambda meta, *_: as_version_3(meta) and None
  )
  assert _meta(root)['version'] == 3
  target = _model(mesh, 1)
  with _watched(monkeypatch, base, root):
    fdt_tf.restore_checkpoint(root, target)
    arrays = fdt_tf.read_checkpoint(root)
  expected = _values(_model(mesh, 0))
  for path, value in _values(target).items():
    np.testing.assert_array_equal(value, expected[path])
  for path, value in expected.items():
    key = path[:-1] if path[-1] == 'value' else path
    np.testing.assert_array_equal(arrays[key], value)
  # The same grid and checksums as the version 4 manifest it came from.
  old = _decode.read(root).by_key
  new = _decode.read(saved_v4[1]).by_key
  assert {k: r.shards for k, r in old.items()} == {
    k: r.shards for k, r in new.items()
  }


@pytest.mark.parametrize(
  ('case', 'match'), VERSION_3, ids=[c for c, _ in VERSION_3]
)
def test_version_3_shard_records_that_do_not_tile_are_refused(
  saved_v4, tmp_path, monkeypatch, case, match
):
  """Before a byte is read: a region no record covers is named."""
  base, _, _, mesh = saved_v4
  root = _craft(saved_v4, tmp_path, _v3_edit(case))
  target = _model(mesh, 1)
  before = _values(target)
  with _watched(monkeypatch, base, root):
    for read in (
      lambda: fdt_tf.restore_checkpoint(root, target),
      lambda: fdt_tf.read_checkpoint(root),
      lambda: inspect_command.inspect_checkpoint(pathlib.Path(root), 80),
    ):
      with pytest.raises(
        (fdt_tf.MalformedExportError, _command.BadInputError), match=match
      ):
        read()
  for path, value in _values(target).items():
    np.testing.assert_array_equal(value, before[path])


def test_links_inside_the_export_are_followed(saved, tmp_path, monkeypatch):
  """A link whose target stays in the export is allowed, and verified."""
  base, mine, _, mesh = saved
  root = os.path.join(base, tmp_path.name)
  shutil.copytree(mine, root)
  data = sorted(n for n in os.listdir(root) if n.startswith('ckpt.data-'))[0]
  os.mkdir(os.path.join(root, 'store'))
  os.rename(os.path.join(root, data), os.path.join(root, 'store', data))
  os.symlink(os.path.join('store', data), os.path.join(root, data))
  target = _model(mesh, 1)
  with _watched(monkeypatch, base, root):
    fdt_tf.restore_checkpoint(root, target)
  expected = _values(_model(mesh, 0))
  got = _values(target)
  for path, value in expected.items():
    np.testing.assert_array_equal(got[path], value)


def test_an_intact_checkpoint_restores_under_watch(saved, monkeypatch):
  """The watch itself: what restore opens is inside, and values are exact."""
  base, mine, _, mesh = saved
  target = _model(mesh, 1)
  with _watched(monkeypatch, base, mine):
    fdt_tf.restore_checkpoint(mine, target)
  assert not opened.is_recording()
  expected = _values(_model(mesh, 0))
  for path, value in _values(target).items():
    np.testing.assert_array_equal(value, expected[path])


def test_the_watch_sees_a_python_open_outside(saved, monkeypatch):
  """The audit hook is no formality: an open of a file outside is caught."""
  base, mine, theirs, _ = saved
  with pytest.raises(AssertionError, match='outside'):
    with _watched(monkeypatch, base, mine):
      with open(os.path.join(theirs, MANIFEST), 'rb'):
        pass


# Mutations of a valid manifest
# ------------------------------------------------------------------------------

EVIL = [
  '../theirs/ckpt',
  '../theirs/ckpt.index',
  '/etc/passwd',
  'ckpt/../ckpt',
  './ckpt',
  'ckpt\0',
  'C:ckpt',
  'ckpt.data-00000-of-00001',
  'ckpt.index',
  'ckpt',
  '',
  'a\\b',
]
_JSON = manifests.json_values(
  [0, 1, -1, 2, 3, 16, 2**32, 2**63, 10**13], EVIL, text_size=6, max_leaves=5
)


@st.composite
def _mutated(draw, meta):
  """A valid manifest with one to three changes, as the bytes to write."""
  meta = json.loads(json.dumps(meta))
  for _ in range(draw(st.integers(1, 3))):
    parent, key = None, None
    node = meta
    while isinstance(node, dict | list) and node and draw(st.booleans()):
      keys = list(node) if isinstance(node, dict) else range(len(node))
      parent, key = node, draw(st.sampled_from(list(keys)))
      node = node[key]
    if parent is None:
      continue
    op = draw(
      st.sampled_from(['replace', 'delete', 'path', 'number', 'rename'])
    )
    if op == 'delete':
      del parent[key]
    elif op == 'path':
      parent[key] = draw(st.sampled_from(EVIL))
    elif op == 'number' and isinstance(node, int):
      parent[key] = node + draw(st.sampled_from([-1, 1, -node - 1, 10**13]))
    elif op == 'rename' and isinstance(parent, dict):
      parent[draw(st.sampled_from(EVIL))] = parent.pop(key)
    else:
      parent[key] = draw(_JSON)
  text = json.dumps(meta).encode()
  damage = draw(st.sampled_from(['none'] * 6 + ['dup', 'cut', 'bytes', 'deep']))
  if damage == 'dup':
    text = text.replace(b'{"format"', b'{"version": 2, "format"', 1)
  elif damage == 'cut':
    text = text[: draw(st.integers(0, len(text)))]
  elif damage == 'bytes':
    at = draw(st.integers(0, len(text)))
    text = text[:at] + draw(st.binary(min_size=1, max_size=4)) + text[at:]
  elif damage == 'deep':
    text = b'{"variables": ' + b'[' * 5000 + b']' * 5000 + b'}'
  return text


def test_a_mutated_manifest_gives_our_error_or_an_exact_restore(
  saved, tmp_path_factory, monkeypatch
):
  base, mine, _, mesh = saved
  root = os.path.join(base, tmp_path_factory.mktemp('mutated', True).name)
  shutil.copytree(mine, root)
  original = _meta(root)
  expected = _values(_model(mesh, 0))
  outcomes = {'refused': 0, 'read': 0, 'restored': 0, 'not listed': 0}

  @hypothesis.settings(
    # Fixed, under every profile: the outcome counts below need them all.
    max_examples=500,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(hypothesis.HealthCheck),
  )
  @hypothesis.given(st.data())
  def check(data):
    text = data.draw(_mutated(original))
    with open(os.path.join(root, MANIFEST), 'wb') as f:
      f.write(text)
    restore = data.draw(st.booleans())
    # What the command line reads: the listing, and --verify's checks.
    with _watched(monkeypatch, base, root):
      try:
        inspect_command.inspect_checkpoint(pathlib.Path(root), 80)
        manifest = _decode.read(root)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
          _verify.problems_of(manifest, pool)
      except (_command.BadInputError, fdt.ExportError):
        outcomes['not listed'] += 1
    try:
      with _watched(monkeypatch, base, root):
        if restore:
          target = _model(mesh, 1)
          fdt_tf.restore_checkpoint(root, target)
          got = _values(target)
        else:
          arrays = fdt_tf.read_checkpoint(root)
          got = {
            path: arrays[path[:-1] if path[-1] == 'value' else path]
            for path in expected
          }
    except fdt.ExportError:
      outcomes['refused'] += 1
      return
    outcomes['restored' if restore else 'read'] += 1
    for path, value in expected.items():
      np.testing.assert_array_equal(got[path], value)

  check()
  # Both outcomes happen: the mutations are neither all harmless nor all
  # fatal.
  assert outcomes['refused'] > 100, outcomes
  assert outcomes['read'] + outcomes['restored'] > 20, outcomes
  assert outcomes['not listed'] >= outcomes['refused'] // 2, outcomes


# A SavedModel's manifest (assets/flax_dtensor.json)
# ------------------------------------------------------------------------------


class _Net(nnx.Module):
  def __init__(self):
    self.layers = nnx.List([nnx.Linear(4, 4, rngs=nnx.Rngs(i)) for i in (0, 1)])

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x)
    return x


@pytest.fixture(scope='module')
def saved_model(saved):
  base = saved[0]
  return base, str(
    fdt_tf.save_saved_model(
      _Net(),
      base / 'sm',
      input_signature=[tf.TensorSpec([None, 4], tf.float32)],
    )
  )


def _assets(root):
  return os.path.join(root, 'assets', MANIFEST)


@pytest.mark.parametrize(
  'how', ['../ prefix', 'manifest linked out', 'assets linked out']
)
def test_a_crafted_saved_model_manifest_is_refused(
  saved, saved_model, tmp_path, monkeypatch, how
):
  base, sm = saved_model
  root = os.path.join(base, tmp_path.name)
  shutil.copytree(sm, root, symlinks=True)
  theirs = saved[2]
  if how == '../ prefix':
    with open(_assets(root)) as f:
      meta = json.load(f)
    meta['checkpoint_prefix'] = os.path.relpath(
      os.path.join(theirs, 'ckpt'), root
    )
    with open(_assets(root), 'w') as f:
      json.dump(meta, f)
    match = r"checkpoint_prefix '\.\./theirs/ckpt' is refused: it has a `\.\.`"
  elif how == 'manifest linked out':
    os.remove(_assets(root))
    os.symlink(os.path.join(theirs, MANIFEST), _assets(root))
    match = r'the manifest itself is refused: it resolves to .*/theirs/'
  else:
    outside = os.path.join(base, f'{tmp_path.name}-assets')
    shutil.move(os.path.join(root, 'assets'), outside)
    os.symlink(outside, os.path.join(root, 'assets'))
    match = r'the manifest itself is refused: it resolves to .*-assets/'
  with _watched(monkeypatch, base, root):
    with pytest.raises(fdt_tf.MalformedExportError, match=match):
      fdt_tf.restore_checkpoint(root, _Net())
    with pytest.raises(fdt_tf.MalformedExportError, match=match):
      fdt_tf.read_checkpoint(root)


def test_an_intact_saved_model_reads_back_exactly(saved_model, monkeypatch):
  base, sm = saved_model
  with _watched(monkeypatch, base, sm):
    arrays = fdt_tf.read_checkpoint(sm)
  net = _Net()
  for i, layer in enumerate(net.layers):
    np.testing.assert_array_equal(
      arrays[('layers', i, 'kernel')], np.asarray(layer.kernel[...])
    )


def test_a_checkpoint_state_file_naming_elsewhere_is_refused(
  saved, tmp_path, monkeypatch
):
  """Without a manifest, TF's `checkpoint` file may not lead out either."""
  base, mine, theirs, mesh = saved
  root = os.path.join(base, tmp_path.name)
  shutil.copytree(mine, root)
  os.remove(os.path.join(root, MANIFEST))
  for name in os.listdir(root):
    if name.startswith('ckpt.'):
      os.remove(os.path.join(root, name))
  with open(os.path.join(root, 'checkpoint'), 'w') as f:
    f.write(f'model_checkpoint_path: "{theirs}/ckpt"\n')
  match = (
    r"The checkpoint state file of .* names the prefix '.*/theirs/ckpt', and "
    r'it resolves to .*, outside the export\. A checkpoint directory is read '
    'only inside itself'
  )
  with _watched(monkeypatch, base, root):
    with pytest.raises(fdt_tf.MalformedExportError, match=match):
      fdt_tf.restore_checkpoint(root, _model(mesh, 1))
    with pytest.raises(fdt_tf.MalformedExportError, match=match):
      fdt_tf.read_checkpoint(root)


# Hashing files through a small reused buffer
# ------------------------------------------------------------------------------

_BLOCK = _checksums._READ_BLOCK
_FILE_BYTES = 2 * _BLOCK + 12345


@pytest.fixture(scope='module')
def random_file(tmp_path_factory):
  data = np.random.default_rng(0).bytes(_FILE_BYTES)
  path = tmp_path_factory.mktemp('crc') / 'f'
  path.write_bytes(data)
  return str(path), data


# Each checksum a manifest names, and the one-shot function of its library.
_REFERENCES = {
  'crc32': zlib.crc32,
  'crc32c': lambda data: google_crc32c.value(bytes(data)),
}


@hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
@hypothesis.given(
  offset=st.sampled_from([0, 1, _BLOCK - 1, _BLOCK, _BLOCK + 7, _FILE_BYTES])
  | st.integers(0, _FILE_BYTES),
  length=st.sampled_from([0, 1, _BLOCK, _BLOCK + 1, 2 * _BLOCK])
  | st.integers(0, _FILE_BYTES),
  checksum=st.sampled_from(sorted(_REFERENCES)),
)
def test_chunk_crc_is_the_librarys_over_the_same_bytes(
  random_file, offset, length, checksum
):
  """Block by block, across block edges, equals one checksum of the bytes
  (CRC-32C from version 5, CRC-32 before)."""
  path, data = random_file
  length = min(length, _FILE_BYTES - offset)
  assert _checksums.crc_chunk(path, offset, length, checksum) == _REFERENCES[
    checksum
  ](data[offset : offset + length])


@hypothesis.settings(max_examples=40, deadline=None, derandomize=True)
@hypothesis.given(
  cuts=st.lists(st.integers(0, _FILE_BYTES), max_size=6),
  tail=st.sampled_from([0, 1, 999, 5000]) | st.integers(0, _FILE_BYTES),
  chunk=st.sampled_from([1000, 4096, _BLOCK, format_model.CHUNK_BYTES]),
  checksum=st.sampled_from(sorted(_REFERENCES)),
)
def test_a_file_hashed_as_written_sums_as_read_back(
  random_file, cuts, tail, chunk, checksum
):
  """The bytes a writer hashed, in pieces, then TF's tail read: the same
  size and chunk checksums as the whole file read back, at any chunk
  size (chunk edges inside pieces, between them and in the tail)."""
  path, data = random_file
  written = len(data) - min(tail, len(data))
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(format_model, 'CHUNK_BYTES', chunk)
    stream = _checksums.StreamSum(checksum)
    edges = sorted({0, written, *(c for c in cuts if c < written)})
    for a, b in itertools.pairwise(edges):
      stream.add(np.frombuffer(data[a:b], np.uint8))
    finished = stream.finish(path)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      root, name = os.path.split(path)
      with manifests.writing_version({'crc32': 4, 'crc32c': 5}[checksum]):
        read_back = _checksums.file_sums(root, [name], pool)[name]
  assert finished == read_back
  assert finished.chunks == tuple(
    _REFERENCES[checksum](data[o : o + chunk])
    for o in range(0, len(data), chunk)
  )


def test_a_file_shorter_than_what_was_hashed_is_read_back(tmp_path):
  """`finish` gives up on a file holding fewer bytes than were hashed for
  it (it is not what was written), and `file_sums` reads it back."""
  path = tmp_path / 'data'
  path.write_bytes(b'abc')
  stream = _checksums.StreamSum()
  stream.add(np.frombuffer(b'abcdef', np.uint8))
  assert stream.finish(str(path)) is None
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    sums = _checksums.file_sums(str(tmp_path), ['data'], pool, {'data': stream})
  assert sums == {
    'data': format_model.FileSum(3, (google_crc32c.value(b'abc'),))
  }


def test_chunk_crc_of_a_short_file_is_an_os_error(random_file):
  path, _ = random_file
  with pytest.raises(
    OSError,
    match=rf'^read {_FILE_BYTES - 5} of {_FILE_BYTES} bytes at offset 5$',
  ):
    # The file ends before the chunk: reported, never hashed short.
    _checksums.crc_chunk(path, 5, _FILE_BYTES)
