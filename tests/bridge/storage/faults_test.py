"""Faults a real cluster has, met for real: full disks, unwritable places,
files that change while a restore reads them.

A full disk is a process with a file-size limit (`RLIMIT_FSIZE`: a write
past it fails with EFBIG, as ENOSPC would, without root or a mount); an
unwritable place is met as user `nobody` when the tests run as root (see
fault_runs.py, which runs each fault once per session). Each fault must
leave the previous export bit for bit, no temporary, and our `ExportError`
saying what happened and what to do.
"""

import dataclasses
import errno
import itertools
import os
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support import fault_runs, processes

import flax_dtensor as fdt

tf = pytest.importorskip('tensorflow')
fdt_tf = pytest.importorskip('flax_dtensor.dtensor')
from flax_dtensor.dtensor import _tf_errors  # noqa: E402
from flax_dtensor.dtensor._checkpoints import _restore  # noqa: E402
from flax_dtensor.dtensor._format import _checksums, _decode, _model, _verify  # noqa: E402
from flax_dtensor.dtensor._format import _grid as _grid_module  # noqa: E402
from flax_dtensor.dtensor._storage import _host_read  # noqa: E402

# A full disk
# ------------------------------------------------------------------------------

_EFBIG = (
  r"Writing '{path}' failed: File too large: this process may write files "
  r'of at most [\d.]+ KiB \({limit} bytes\), its RLIMIT_FSIZE \(`ulimit -f`\); '
  r"the export's variables alone take [\d.]+ KiB \({needed} bytes\), and .* "
  r"bytes\) are free on the filesystem of '{root}'\. The previous export at "
  r"'{path}', if any, is unchanged, and the partial one was removed\. Raise "
  r'the limit'
)


@pytest.mark.parametrize(
  'where, needed, cause',
  [
    ('manifest', 256 * 8 * 8 * 4, ['OSError', errno.EFBIG]),
    ('manifest_async', 256 * 8 * 8 * 4, ['OSError', errno.EFBIG]),
    ('data', 256 * 8 * 8 * 4, ['OutOfRangeError', None]),
    ('data_parts', 256 * 8 * 8 * 4, ['OutOfRangeError', None]),
    ('saved_model', 16 * 16 * 4 + 16 * 4, ['OutOfRangeError', None]),
  ],
)
def test_a_full_disk_leaves_the_previous_checkpoint_bit_for_bit(
  where, needed, cause
):
  run = fault_runs.full_disk()
  attempt = run['attempts'][where]
  if where.startswith('manifest'):  # The limit lands on the manifest alone.
    assert run['other_bytes'] < attempt['limit'] < run['manifest_bytes']
  name, message, chain = attempt['error']
  assert name == 'DiskFullError'
  target = 'sm' if where == 'saved_model' else 'ckpt'
  pattern = _EFBIG.format(
    path=re.escape(os.path.join(run['root'], target)),
    root=re.escape(run['root']),
    limit=attempt['limit'],
    needed=needed,
  )
  assert re.match(pattern, message), message
  # The write really failed with the OS's EFBIG (TF reports it as an
  # OutOfRangeError naming the OS's words).
  assert chain[-1] == cause, chain
  # Nothing changed: no temporary, every file of the old checkpoint intact.
  assert attempt['listing'] == ['ckpt']
  assert attempt['files'] == run['before']


def test_after_a_full_disk_the_old_checkpoint_restores_exactly(explicit_mesh):
  run = fault_runs.full_disk()
  path = os.path.join(run['root'], 'ckpt')
  expected = {
    (f'layer{i}',): np.full((8, 8), 1000 + i, np.float32) for i in range(256)
  }
  read = fdt_tf.read_checkpoint(path)
  assert set(read) == set(expected)
  for key, value in expected.items():
    np.testing.assert_array_equal(read[key], value)
  # Restored onto another layout too.
  sharding = NamedSharding(explicit_mesh, P('model', 'data'))
  target = nnx.Dict(
    {k[0]: nnx.Param(jax.device_put(jnp.zeros((8, 8)), sharding)) for k in read}
  )
  fdt_tf.restore_checkpoint(path, target)
  for key, value in expected.items():
    np.testing.assert_array_equal(np.asarray(target[key[0]][...]), value)
  assert sorted(os.listdir(run['root'])) == ['ckpt']


def test_no_space_left_mid_save_leaves_the_previous_checkpoint():
  """ENOSPC from a nearly full tmpfs, as TensorFlow writes the new data."""
  run = fault_runs.no_space()
  if 'unavailable' in run:
    pytest.skip(f'no mount namespace here: {run["unavailable"]}')
  assert run['restorable']  # The old version read back exactly, before.
  name, message, chain = run['error']
  assert name == 'DiskFullError'
  path = os.path.join(run['fs'], 'ckpt')
  match = re.match(
    rf"Writing '{re.escape(path)}' failed: No space left on device: the "
    r"export's variables alone take 64\.0 KiB \(65536 bytes\), and "
    rf'[\d.]+ KiB \((\d+) bytes\) are free on the filesystem of '
    rf"'{re.escape(run['fs'])}'\. The previous export at '{re.escape(path)}', "
    r'if any, is unchanged, and the partial one was removed\. Free space or '
    r'save elsewhere',
    message,
  )
  assert match, message
  # The bytes free, once the partial export is gone, as the OS counts them.
  assert int(match[1]) == run['free'] < 65536
  assert chain[-1] == 'ResourceExhaustedError'  # TF's words for ENOSPC.
  assert run['listing'] == ['ckpt', 'filler']
  assert run['after'] == run['before']


def test_a_full_disk_is_measured_with_statvfs(tmp_path):
  """ENOSPC, for real: /dev/full refuses every write."""
  path = str(tmp_path / 'ckpt')
  with pytest.raises(fdt_tf.DiskFullError) as raised:
    with _tf_errors.space_checked(path, 3 * 2**30):
      with open('/dev/full', 'w') as f:
        f.write('x')
        f.flush()
  message = str(raised.value)
  match = re.match(
    rf"Writing '{re.escape(path)}' failed: No space left on device: the "
    r"export's variables alone take 3\.0 GiB \(3221225472 bytes\), and "
    rf'[\d.]+ \w+ \((\d+) bytes\) are free on the filesystem of '
    rf"'{re.escape(str(tmp_path))}'\. The previous export .* is unchanged.*"
    r'Free space or save elsewhere: an overwrite needs room for the old '
    r'export and the new one',
    message,
  )
  assert match, message
  info = os.statvfs(tmp_path)
  # The bytes free are the filesystem's, as statvfs counts them for users
  # (others may write meanwhile: within 1 GiB).
  assert abs(int(match[1]) - info.f_bavail * info.f_frsize) < 2**30
  assert isinstance(raised.value.__cause__, OSError)
  assert raised.value.__cause__.errno == errno.ENOSPC


def test_other_errors_are_not_taken_for_a_full_disk(tmp_path):
  with pytest.raises(PermissionError):
    with _tf_errors.space_checked(str(tmp_path / 'c'), 1):
      raise PermissionError(errno.EACCES, 'Permission denied')


# Unwritable places
# ------------------------------------------------------------------------------


@pytest.mark.parametrize(
  'case, pattern',
  [
    (
      'read-only parent',
      r"Cannot write export target '{base}/ro/c': its parent directory "
      r"'{base}/ro' is not writable \(this process \(uid {uid}\) may not "
      r'write in it \(owner uid \d+, mode dr-xr-xr-x\)\)\. .*choose a '
      r'directory you may write in',
    ),
    (
      'read-only parent, SavedModel',
      r"Cannot write export target '{base}/ro/sm': its parent directory "
      r"'{base}/ro' is not writable",
    ),
    (
      'read-only parent, export command',
      r"Cannot write export target '{base}/ro/out': its parent directory "
      r"'{base}/ro' is not writable",
    ),
    (
      'parent is a file',
      r"The parent of export target '{base}/a_file/c' is not a directory: "
      r"'{base}/a_file' is a file",
    ),
    (
      'not deletable',
      r"Cannot replace '{base}/open/ckpt': '{base}/open/ckpt' is not "
      r'writable \(this process \(uid {uid}\) may not write in it .*\), so '
      r'the old export could not be deleted once the new one is in place',
    ),
  ],
)
def test_unwritable_places_are_refused_before_any_byte_is_written(
  case, pattern
):
  run = fault_runs.unwritable()
  # As root, the run drops to `nobody`: root may write anywhere.
  assert run['uid'] == (fault_runs.NOBODY if os.geteuid() == 0 else os.getuid())
  name, message = run['errors'][case]
  assert name == 'ExportError'
  expected = pattern.format(base=re.escape(run['base']), uid=run['uid'])
  assert re.match(expected, message), message
  # Nothing changed anywhere: no temporary, no file, no mode.
  assert run['after'] == run['before']


@pytest.mark.skipif(os.geteuid() != 0, reason='needs a second user')
def test_an_export_in_a_sticky_directory_is_its_owners():
  run = fault_runs.unwritable()
  name, message = run['errors']['sticky parent']
  assert name == 'ExportError'
  assert re.match(
    rf"Cannot replace '{re.escape(run['base'])}/sticky/ckpt': it belongs to "
    r'uid 0, and its parent .* has the sticky bit, so only its owner may '
    r'rename it',
    message,
  ), message
  assert run['after'] == run['before']


# Damage while a restore reads
# ------------------------------------------------------------------------------


class Blocks(nnx.Module):
  """A plain NNX stack: a list of layers and a BatchNorm (sharded by hand)."""

  def __init__(self, mesh, spec, value, rngs, norm=None):
    sharding = NamedSharding(mesh, spec)
    self.blocks = nnx.List(
      [
        nnx.Param(
          jax.device_put(
            jnp.arange(128, dtype=jnp.float32).reshape(8, 16) + value + i,
            sharding,
          )
        )
        for i in range(3)
      ]
    )
    self.norm = nnx.BatchNorm(16, rngs=rngs)
    norm = value if norm is None else norm
    self.norm.mean[...] = jnp.full((16,), norm, jnp.float32)


def _values(module):
  return {
    p: np.asarray(v.get_value())
    for p, v in nnx.to_flat_state(nnx.state(module))
  }


def _after_the_check(monkeypatch, damage):
  """Runs `damage` once the files passed the manifest check, before TF reads.

  That is the moment the check cannot see: what changes after it must
  still be refused.
  """
  real = _verify.verify_files

  def check_then_damage(manifest, pool, **kwargs):
    real(manifest, pool, **kwargs)
    damage()

  monkeypatch.setattr(_verify, 'verify_files', check_then_damage)


def _refused_unchanged(read, path, target, before, kind, match):
  """`read` ('restore' or 'read_checkpoint') of `path` refused, in a `kind`
  error; target kept."""
  with pytest.raises(kind, match=match):
    if read == 'restore':
      fdt_tf.restore_checkpoint(path, target)
    else:
      fdt_tf.read_checkpoint(path)
  for key, value in _values(target).items():
    np.testing.assert_array_equal(value, before[key])


def _first_data_file(path):
  """The data file of the first device's shards (blocks' values)."""
  (name,) = [n for n in os.listdir(path) if n.startswith('ckpt.data-00000-')]
  return os.path.join(path, name)


def _flip(path):
  data = _first_data_file(path)
  with open(data, 'r+b') as f:
    f.seek(64)
    byte = f.read(1)
    f.seek(64)
    f.write(bytes([byte[0] ^ 0x10]))


def _truncate(path):
  data = _first_data_file(path)
  os.truncate(data, os.path.getsize(data) // 2)


@pytest.mark.parametrize(
  'damage, match',
  [
    (_flip, r'ckpt\.data-00000-of-\d+ bytes 0\.\.\d+ changed \(CRC-32'),
    (_truncate, r'ckpt\.data-00000-of-\d+ has \d+ bytes, not \d+'),
  ],
  ids=['flipped', 'truncated'],
)
def test_a_file_damaged_after_the_check_is_refused(
  explicit_mesh, tmp_path, monkeypatch, damage, match
):
  saved = Blocks(explicit_mesh, P('data', 'model'), 1.0, nnx.Rngs(0))
  path = fdt_tf.save_checkpoint(saved, tmp_path / 'c')
  target = Blocks(explicit_mesh, P('model', 'data'), -7.0, nnx.Rngs(1))
  before = _values(target)
  _after_the_check(monkeypatch, lambda: damage(path))
  # TF's own checksum (or a short read) stops the read; the whole check
  # that follows names the file and the bytes.
  with pytest.raises(
    fdt_tf.DamagedExportError,
    match=rf'{match}.*found in the bytes read.*Nothing '
    r'was restored: the target is unchanged',
  ) as refused:
    fdt_tf.restore_checkpoint(path, target)
  assert re.match(
    r'TensorFlow failed to read the NNX variable',
    str(refused.value.__cause__),
  )
  after = _values(target)
  assert after.keys() == before.keys()
  for key, value in before.items():
    np.testing.assert_array_equal(after[key], value)


@pytest.mark.parametrize('read', ['restore', 'read_checkpoint'])
def test_a_checkpoint_replaced_during_a_restore_is_refused(
  explicit_mesh, tmp_path, monkeypatch, read
):
  """Another save swaps the directory after the check: TF sees no fault.

  The versions differ only in sharded values, and the restore is onto
  another layout, so no device holds a saved shard whole: only a check of
  every byte read sees the change.
  """
  path = fdt_tf.save_checkpoint(
    Blocks(explicit_mesh, P('data', 'model'), 1.0, nnx.Rngs(0)), tmp_path / 'c'
  )
  other = fdt_tf.save_checkpoint(
    Blocks(explicit_mesh, P('data', 'model'), 2.0, nnx.Rngs(0), norm=1.0),
    tmp_path / 'o',
  )

  def swap():
    os.rename(path, tmp_path / 'aside')
    os.rename(other, path)

  target = Blocks(explicit_mesh, P('model', 'data'), -7.0, nnx.Rngs(1))
  before = _values(target)
  _after_the_check(monkeypatch, swap)
  _refused_unchanged(
    read,
    path,
    target,
    before,
    fdt_tf.DamagedExportError,
    r'is damaged: blocks/\d\[0:4, 0:4\] read back with CRC-32C '
    r'[0-9a-f]{8}, recorded [0-9a-f]{8} \(expected what its manifest '
    r'flax_dtensor.json records; found in the bytes read, so the files may '
    r'also have changed during the read\)\. Nothing was restored: the '
    r'target is unchanged',
  )
  # TensorFlow alone reads the swapped-in checkpoint without complaint.
  key = fdt_tf.checkpoint_key(('blocks', 0))
  (value,) = tf.raw_ops.RestoreV2(
    prefix=os.path.join(path, 'ckpt'),
    tensor_names=[key],
    shape_and_slices=[''],
    dtypes=[tf.float32],
  )
  np.testing.assert_array_equal(
    value.numpy(), np.arange(128, dtype=np.float32).reshape(8, 16) + 2.0
  )


def test_a_manifest_that_vanishes_once_found_is_a_read_failure(
  explicit_mesh, tmp_path, monkeypatch
):
  """Not "not a valid manifest": the export moved away while it was read."""
  path = fdt_tf.save_checkpoint(
    Blocks(explicit_mesh, P('data', 'model'), 1.0, nnx.Rngs(0)), tmp_path / 'c'
  )
  real = _decode.locate

  def locate_then_move(where):
    found = real(where)
    if os.path.isdir(path):
      os.rename(path, tmp_path / 'moved')
    return found

  monkeypatch.setattr(_decode, 'locate', locate_then_move)
  with pytest.raises(
    fdt_tf.SaveInProgressError,
    match=r"failed to read the manifest '.*c/flax_dtensor\.json': it "
    r'vanished after it was found \(No such file or directory\)\. Expected '
    r'the export to stay in place while it is read; another process may '
    r'be replacing it\. Retry once that write is done\.',
  ):
    fdt_tf.read_checkpoint(path)


def test_an_unreadable_manifest_is_a_read_failure(
  explicit_mesh, tmp_path, monkeypatch
):
  path = fdt_tf.save_checkpoint(
    Blocks(explicit_mesh, P('data', 'model'), 1.0, nnx.Rngs(0)), tmp_path / 'c'
  )

  # Tests run as root, whom chmod does not stop: the OS's refusal is raised
  # where the manifest is opened.
  def refuse(file, *args, **kwargs):
    raise PermissionError(13, 'Permission denied', file)

  monkeypatch.setattr(_decode, 'open', refuse, raising=False)
  with pytest.raises(
    fdt.ExportError,
    match=r"failed to read the manifest '.*flax_dtensor\.json': "
    r'PermissionError: .*Permission denied.*Expected a readable file\. '
    r'Check the path and its permissions\.',
  ):
    fdt_tf.read_checkpoint(path)


@pytest.mark.parametrize('read', ['restore', 'read_checkpoint'])
def test_a_plain_checkpoint_replaced_during_a_read_is_refused(
  explicit_mesh, tmp_path, monkeypatch, read
):
  """Without a manifest there are no CRCs: the files' identity is checked."""
  path = str(tmp_path / 'c')
  other = str(tmp_path / 'o')
  fdt_tf.save_checkpoint(
    Blocks(explicit_mesh, P('data', 'model'), 1.0, nnx.Rngs(0)), path
  )
  fdt_tf.save_checkpoint(
    Blocks(explicit_mesh, P('data', 'model'), 2.0, nnx.Rngs(0)), other
  )
  for where in (path, other):
    os.remove(os.path.join(where, 'flax_dtensor.json'))
  real = _restore._identity
  swaps = []

  def identity_then_swap(prefix):
    # The read notes which files it starts from; then they are replaced.
    found = real(prefix)
    if not swaps:
      os.rename(path, tmp_path / 'aside')
      os.rename(other, path)
      swaps.append(prefix)
    return found

  monkeypatch.setattr(_restore, '_identity', identity_then_swap)
  target = Blocks(explicit_mesh, P('model', 'data'), -7.0, nnx.Rngs(1))
  before = _values(target)
  _refused_unchanged(
    read,
    path,
    target,
    before,
    fdt_tf.SaveInProgressError,
    r"The checkpoint '.*c/ckpt' changed while it was read \(its files "
    r'are not the ones it had when the read began\), so what was read may '
    r'mix two versions\. Nothing was restored: the target is unchanged\. '
    r'Expected the checkpoint to stay in place while it is read; retry '
    r'once the process replacing it is done\.',
  )
  # Left in place, the new version reads whole and exactly.
  assert swaps == [os.path.join(path, 'ckpt')]
  arrays = fdt_tf.read_checkpoint(path)
  np.testing.assert_array_equal(
    arrays['blocks/0'],
    np.arange(128, dtype=np.float32).reshape(8, 16) + 2.0,
  )


def test_restores_while_another_thread_swaps_the_checkpoint(
  explicit_mesh, tmp_path
):
  """Each restore gets one version exactly, or our error; never a mix."""
  versions = {
    v: Blocks(explicit_mesh, P('data', 'model'), v, nnx.Rngs(0))
    for v in (1.0, 2.0)
  }
  expected = {v: _values(m) for v, m in versions.items()}
  path = str(tmp_path / 'c')
  spare = str(tmp_path / 'spare')
  fdt_tf.save_checkpoint(versions[1.0], path)
  fdt_tf.save_checkpoint(versions[2.0], spare)
  stop = threading.Event()

  def swap_forever():
    while not stop.is_set():
      os.rename(path, tmp_path / 'moving')
      os.rename(spare, path)
      os.rename(tmp_path / 'moving', spare)

  swapper = threading.Thread(target=swap_forever, daemon=True)
  swapper.start()
  outcomes = []
  try:
    for _ in range(12):
      target = Blocks(explicit_mesh, P('model', 'data'), -7.0, nnx.Rngs(1))
      sentinel = _values(target)
      try:
        fdt_tf.restore_checkpoint(path, target)
      except fdt.ExportError as e:
        assert re.search(
          r'damaged|failed to read|holds no TF checkpoint|kept changing|'
          r'changed while|incomplete',
          str(e),
        )
        got = _values(target)
        assert all(np.array_equal(got[k], sentinel[k]) for k in got)
        outcomes.append('refused')
        continue
      got = _values(target)
      same = [
        v
        for v, want in expected.items()
        if all(np.array_equal(got[k], want[k]) for k in want)
      ]
      assert len(same) == 1, 'a mix of both versions'
      outcomes.append(same[0])
  finally:
    stop.set()
    swapper.join(timeout=60)
  assert len(outcomes) == 12


def _grid(shape, blocks, full=None):
  """The saved shards of a `blocks` grid over `shape`, CRCs of `full`."""
  steps = [n // b for n, b in zip(shape, blocks, strict=True)]
  out = []
  for i in np.ndindex(*blocks):
    index = tuple((k * s, (k + 1) * s) for k, s in zip(i, steps, strict=True))
    value = 0 if full is None else _checksums.crc(_view(full, index))
    out.append((index, value))
  return _grid_module.from_shards(tuple(shape), out)


def _record(shape, shards):
  return _model.Record(
    path=('w',),
    key='w',
    type='Param',
    dtype='float32',
    stored_dtype='float32',
    shape=shape,
    key_impl=None,
    sharding=None,
    shards=shards,
  )


def _view(full, index):
  return full[tuple(slice(a, b) for a, b in index)]


@pytest.mark.parametrize('whole', [False, True])
@pytest.mark.parametrize(
  'shape, saved, held',
  [
    ((8, 16), (2, 4), (4, 2)),
    ((8, 16), (4, 1), (1, 4)),
    ((8, 16), (2, 2), (2, 2)),
    ((8, 16), (8, 1), (2, 1)),
    # Held slices straddling saved blocks: their boxes overlap, merged.
    ((8, 12), (1, 3), (1, 2)),
  ],
)
def test_a_process_reads_whole_saved_shards_and_cuts_its_slices(
  shape, saved, held, whole
):
  """The read plan, by values: read boxes of saved shards, then cut views."""
  full = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
  grid = _grid(shape, saved)
  record = _record(shape, grid)
  # Some slices of another layout (as a process of several holds), or the
  # whole variable (as one process holding all of it does).
  steps = [n // b for n, b in zip(shape, held, strict=True)]
  slices = [
    tuple((k * s, (k + 1) * s) for k, s in zip(i, steps, strict=True))
    for i in np.ndindex(*held)
  ]
  needed = {((0, shape[0]), (0, shape[1]))} if whole else set(slices[:3])
  regions = _host_read.regions(shape, needed, whole, record)
  # Whole saved shards, disjoint, each meeting a needed slice, and each
  # needed slice inside one of them.
  for region in regions:
    assert grid.aligned(region)
    assert any(_host_read._meet(region, n) for n in needed)
  for a, b in itertools.combinations(regions, 2):
    assert not _host_read._meet(a, b)
  read = {r: _view(full, r) for r in regions}
  for index in needed:
    cut = _host_read._cut(read, index)
    np.testing.assert_array_equal(cut, _view(full, index))
    # A view of what TF read, never a copy.
    assert any(np.shares_memory(cut, data) for data in read.values())


def test_regions_merge_boxes_that_meet_and_keep_apart_those_that_do_not():
  shape = (8, 16)
  record = _record(shape, _grid(shape, (4, 4)))
  # Two slices in one saved block's row: one box of the blocks they meet.
  assert _host_read.regions(
    shape, {((0, 1), (0, 2)), ((1, 2), (5, 6))}, False, record
  ) == [((0, 2), (0, 8))]
  # Slices far apart: two boxes, nothing read between them.
  assert _host_read.regions(
    shape, {((0, 2), (0, 4)), ((6, 8), (12, 16))}, False, record
  ) == [((0, 2), (0, 4)), ((6, 8), (12, 16))]
  # Slices one above the other: one box, each a contiguous part of it.
  assert _host_read.regions(
    shape, {((0, 2), (0, 16)), ((2, 4), (0, 16))}, False, record
  ) == [((0, 4), (0, 16))]
  # Side by side: a box each, so that each is placed without a copy.
  assert _host_read.regions(
    shape, {((0, 2), (0, 4)), ((0, 2), (4, 8))}, False, record
  ) == [((0, 2), (0, 4)), ((0, 2), (4, 8))]
  # A plain TF checkpoint: the slices themselves, or the whole.
  assert _host_read.regions(shape, {((0, 2), (0, 4))}, False, None) == [
    ((0, 2), (0, 4))
  ]
  assert _host_read.regions(shape, {((0, 2), (0, 4))}, True, None) == [
    ((0, 8), (0, 16))
  ]


@pytest.mark.parametrize(
  'index',
  [
    ((0, 8), (0, 16)),
    ((2, 4), (0, 16)),
    ((3, 4), (2, 9)),
    ((2, 4), (0, 8)),
    ((0, 8), (4, 5)),
    ((5, 6), (15, 16)),
  ],
)
def test_contiguous_slices_are_told_apart(index):
  region = ((0, 8), (0, 16))
  block = np.zeros((8, 16), np.float32)
  view = _view(block, index)
  assert _host_read._contiguous(index, region) == view.flags.c_contiguous


def test_the_read_check_refuses_slices_that_are_not_whole_shards(tmp_path):
  shape = (8, 16)
  full = np.arange(128, dtype=np.float32).reshape(shape)
  manifest = _model.Manifest(
    _model.CHECKPOINT_FORMAT, _model.VERSION, str(tmp_path), 'ckpt', {}, ()
  )
  record = _record(shape, _grid(shape, (2, 2), full))
  whole = {((0, 8), (0, 16)): full}
  _verify.verify_read(manifest, record, whole)  # Every byte checked.
  _verify.verify_read(manifest, record, {((4, 8), (0, 8)): full[4:, :8]})
  with pytest.raises(
    fdt_tf.MalformedExportError,
    match=r'the shards recorded for w do not cover \[0:6, 0:16\] whole, so '
    r'its bytes cannot be checked',
  ):
    _verify.verify_read(manifest, record, {((0, 6), (0, 16)): full[:6]})
  changed = full.copy()
  changed[7, 15] += 1
  with pytest.raises(
    fdt_tf.DamagedExportError, match=r'w\[4:8, 8:16\] read back with CRC-32C '
  ):
    _verify.verify_read(manifest, record, {((0, 8), (0, 16)): changed})


def test_every_process_raises_the_kind_found_of_the_export():
  """A condition of the export one process found (a full disk, damage, ...)
  is the same kind on every other; any other failure is a PeerError."""
  from flax_dtensor.dtensor import _processes

  for kind in (
    fdt_tf.DiskFullError,
    fdt_tf.DamagedExportError,
    fdt_tf.MalformedExportError,
    fdt_tf.ExportNotFoundError,
    fdt_tf.SaveInProgressError,
  ):
    assert _processes.shared_kind(kind.__name__) is kind
  for other in ('ExportError', 'PeerError', 'KeyError', ''):
    assert _processes.shared_kind(other) is fdt_tf.PeerError
  session = _processes.Session(None, 'p', 'the save to /c', 'Nothing changed.')
  full = _processes._failed(session, 1, 'DiskFullError: Writing /c failed')
  assert type(full) is fdt_tf.DiskFullError
  assert re.match(r'Process 1 of \d+ failed during the save to /c', str(full))
  assert type(_processes._failed(session, 1, 'KeyError: x')) is fdt_tf.PeerError
  setup = dataclasses.replace(session, error=fdt.DTensorInitializationError)
  failed = _processes._failed(setup, 1, 'DiskFullError: x')
  assert type(failed) is fdt.DTensorInitializationError


def test_a_stop_process_0_saw_at_a_sync_stays_a_stop_on_the_others():
  """Process 0 saw process 2 stop while the others waited at a `sync`: what
  it tells them (`_told`, JSON in the store) is raised there as that stop,
  seen by process 0, so that a process reporting it in turn names process
  2, not itself (a race CI once lost: "Process 1 of 4 failed ...")."""
  import json

  from flax_dtensor.dtensor import _processes

  session = _processes.Session(None, 'p', 'the save to /c', '/c is whole.')
  why = 'no heartbeat from it for 10 s'
  seen = _processes._stopped(session, 2, why, seen_by=0)
  told = json.loads(json.dumps(_processes._told(seen)))
  heard = _processes._heard(session, told)
  assert type(heard) is fdt_tf.PeerError
  assert getattr(heard, _processes._STOP) == (2, why, 0)
  assert str(heard) == str(seen)
  assert str(heard).startswith(
    'Process 2 of 1 stopped during the save to /c: no heartbeat from it '
    'for 10 s. Process 0 saw it first; this process stops too.'
  )
  # Any other failure of process 0 is told in its words, as a PeerError.
  other = _processes._heard(
    session, json.loads(json.dumps(_processes._told(ValueError('disk gone'))))
  )
  assert type(other) is fdt_tf.PeerError and str(other) == 'disk gone'
  assert getattr(other, _processes._STOP, None) is None


def test_a_stop_another_process_saw_is_named_as_the_stop():
  """Whichever process sees a dead peer first, every other names that peer.

  What the store holds after process 3 saw process 2 stop (`Session.fail`
  of the error `_stopped` made) becomes, on the others, the same stop, not
  "process 3 failed": the root cause, whichever process saw it first.
  """
  from flax_dtensor.dtensor import _processes

  session = _processes.Session(None, 'p', 'the save to /c', '/c is whole.')
  why = 'no heartbeat from it for 10 s'
  seen = _processes._stopped(session, 2, why)
  assert getattr(seen, _processes._STOP)[:2] == (2, why)
  told = [
    ('p/failed/1', 'KeyError: x'),
    ('p/failed/3-saw-2', why),
  ]
  relayed = _processes._reported(session, told)
  assert type(relayed) is fdt_tf.PeerError
  assert re.fullmatch(
    r'Process 2 of \d+ stopped during the save to /c: no heartbeat from it '
    r'for 10 s\. Process 3 saw it first; this process stops too\. /c is '
    r'whole\. Restart every process of the job, then try again\.',
    str(relayed),
  ), str(relayed)
  # Told on again, it still names the process that saw it.
  assert getattr(relayed, _processes._STOP) == (2, why, 3)
  failed = _processes._reported(session, [('p/failed/1', 'KeyError: x')])
  assert re.match(
    r'Process 1 of \d+ failed during the save to /c, so this process stops '
    r'too\. /c is whole\. Its error: KeyError: x',
    str(failed),
  ), str(failed)


DAMAGED_RESTORE = """
import os, sys
import jax
import flax_dtensor as fdt
import flax_dtensor.dtensor as fdt_dt
from flax import nnx

mesh = jax.make_mesh((2, 4), ('data', 'model'))
fdt_dt.initialize()
rules = fdt.LogicalRules([('embed', 'data'), ('mlp', 'model')])
init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ('embed', 'mlp'))
with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
  saved = nnx.Linear(64, 128, kernel_init=init, rngs=nnx.Rngs(0))
  target = nnx.Linear(64, 128, kernel_init=init, rngs=nnx.Rngs(1))
path = fdt_dt.save_checkpoint(saved, sys.argv[1])
(data,) = [n for n in os.listdir(path) if n.startswith('ckpt.data')]
with open(os.path.join(path, data), 'r+b') as f:  # Its first value's byte.
  byte = f.read(1)[0]
  f.seek(0)
  f.write(bytes([byte ^ 0xFF]))
print('saved', flush=True)
try:
  fdt_dt.restore_checkpoint(path, target)
except fdt_dt.DamagedExportError as e:
  print('refused', str(e).split(' (expected')[0])
"""


def test_a_damaged_restore_prints_no_tensorflow_log_line(tmp_path):
  """As a user's script meets it, in a fresh `python` (a fork of the warm
  pool inherits a logging set up otherwise): TF's checksum fails its
  restore op, which logs a WARNING (op_kernel.cc) and an INFO line
  (local_rendezvous.cc), whatever the log level. Only our error is seen."""
  script = tmp_path / 'damaged.py'
  script.write_text(DAMAGED_RESTORE)
  proc = processes.run_python(
    script,
    str(tmp_path / 'c'),
    env=processes.reader_env(
      XLA_FLAGS='--xla_force_host_platform_device_count=8'
    ),
  )
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  assert lines[0] == 'saved'
  assert re.fullmatch(
    r"refused The export at '.*c' is damaged: ckpt\.data-00000-of-00001 "
    r'bytes 0\.\.\d+ changed \(CRC-32C [0-9a-f]{8}, recorded [0-9a-f]{8}\)',
    lines[1],
  )
  assert not re.search(r'^[IW]\d{4} ', proc.stderr, re.M), proc.stderr
  assert 'DATA_LOSS' not in proc.stderr, proc.stderr
