"""Exports into directories that do not exist yet: TF Serving's
``base/<version>`` layout.

Every export (a SavedModel, a checkpoint, a run folder) creates its missing
parent directories, as TensorFlow's own save does; nothing else is written
outside the export, a failed export removes the parents it created, and a
file in the way (or an ancestor this user may not write in) is our
`ExportError`, before any byte is written. In a multi-process run only
process 0 creates them.
"""

import json
import os
import pwd
import re
import shutil
import tempfile
import textwrap

import numpy as np
import pytest
from flax import nnx
from support import multiprocess_util, warm

import flax_dtensor as fdt

tf = pytest.importorskip('tensorflow')
fdt_tf = pytest.importorskip('flax_dtensor.dtensor')
from flax_dtensor.dtensor._storage import _atomic  # noqa: E402


def _tree(root) -> list[str]:
  """Every path under `root`, relative, directories with a trailing /."""
  out = []
  for here, dirs, files in os.walk(root):
    rel = os.path.relpath(here, root)
    for d in dirs:
      out.append(os.path.normpath(os.path.join(rel, d)) + '/')
    for f in files:
      out.append(os.path.normpath(os.path.join(rel, f)))
  return sorted(out)


def _never(path):
  del path
  return False


@pytest.fixture(scope='module')
def model():
  return nnx.Linear(4, 3, rngs=nnx.Rngs(0))


def test_saved_model_into_tf_serving_layout_creates_parents(model, tmp_path):
  spec = [tf.TensorSpec([None, 4], tf.float32, 'x')]
  path = fdt_tf.save_saved_model(
    model, tmp_path / 'models' / 'mlp' / '1', input_signature=spec
  )
  assert path == str(tmp_path / 'models' / 'mlp' / '1')
  # Only the parents and the export: no temporary left beside it.
  assert sorted(os.listdir(tmp_path)) == ['models']
  assert os.listdir(tmp_path / 'models') == ['mlp']
  assert os.listdir(tmp_path / 'models' / 'mlp') == ['1']
  loaded = tf.saved_model.load(path)
  x = np.arange(8, dtype=np.float32).reshape(2, 4)
  (got,) = loaded.signatures['serving_default'](x=tf.constant(x)).values()
  np.testing.assert_allclose(got.numpy(), np.asarray(model(x)), atol=1e-6)
  # A second version goes beside the first, in the existing base.
  fdt_tf.save_saved_model(
    model, tmp_path / 'models' / 'mlp' / '2', input_signature=spec
  )
  assert sorted(os.listdir(tmp_path / 'models' / 'mlp')) == ['1', '2']


@pytest.mark.parametrize('blocking', [True, False], ids=['blocking', 'async'])
def test_checkpoint_creates_parents(model, tmp_path, blocking):
  target = tmp_path / 'runs' / 'a' / 'ckpt'
  saved = fdt_tf.save_checkpoint(model, target, blocking=blocking)
  if not blocking:
    saved.wait()
  assert _tree(tmp_path / 'runs')[:3] == ['a/', 'a/ckpt/', 'a/ckpt/checkpoint']
  assert sorted(os.listdir(tmp_path / 'runs' / 'a')) == ['ckpt']
  values = fdt_tf.read_checkpoint(target)
  np.testing.assert_array_equal(
    values['kernel'], np.asarray(model.kernel.get_value())
  )


@pytest.mark.parametrize(
  'where, pattern',
  [
    (
      ('a_file', 'mlp', '1'),
      r"An ancestor of export target '{base}/a_file/mlp/1' is not a "
      r"directory: '{base}/a_file' is a file, so the directories the export "
      r'goes in cannot be created\. .*move that file away',
    ),
    (
      ('a_file', '1'),
      r"The parent of export target '{base}/a_file/1' is not a directory: "
      r"'{base}/a_file' is a file",
    ),
    (
      ('dangling', 'mlp', '1'),
      r"An ancestor of export target '{base}/dangling/mlp/1' is not a "
      r"directory: '{base}/dangling' is a symbolic link to nothing",
    ),
  ],
  ids=['file-above-parent', 'file-as-parent', 'dangling-link'],
)
def test_a_file_in_the_way_is_refused_before_any_write(
  model, tmp_path, where, pattern
):
  (tmp_path / 'a_file').write_text('precious')
  os.symlink(tmp_path / 'nowhere', tmp_path / 'dangling')
  before = _tree(tmp_path)
  spec = [tf.TensorSpec([None, 4], tf.float32)]
  match = pattern.format(base=tmp_path)
  with pytest.raises(fdt.ExportError, match=match):
    fdt_tf.save_saved_model(
      model, tmp_path.joinpath(*where), input_signature=spec
    )
  with pytest.raises(fdt.ExportError, match=match):
    fdt_tf.save_checkpoint(model, tmp_path.joinpath(*where))
  assert _tree(tmp_path) == before
  assert (tmp_path / 'a_file').read_text() == 'precious'


def test_a_parent_the_os_refuses_is_our_error_and_nothing_is_left(tmp_path):
  # A name longer than the filesystem takes (ENAMETOOLONG): checked paths
  # pass, and the OS refuses the second of the parents to create.
  long = 'n' * 300
  target = tmp_path / 'base' / long / '1'
  with pytest.raises(
    fdt.ExportError,
    match=(
      rf"Cannot create '{tmp_path}/base/{long}', a parent directory of "
      rf"export target '{target}': File name too long\. Create it yourself"
    ),
  ):
    with _atomic.atomic_directory(str(target), is_export=_never):
      pytest.fail('not reached')
  assert os.listdir(tmp_path) == []  # 'base', made first, removed again.
  with pytest.raises(
    fdt.ExportError,
    match=rf"Cannot create the directory '{tmp_path}/{long}': File name too",
  ):
    with _atomic.all_or_nothing(
      tmp_path / long, ['checkpoint'], overwrite=False, is_export=_never
    ):
      pytest.fail('not reached')
  assert os.listdir(tmp_path) == []


def test_a_failed_export_removes_the_parents_it_created(tmp_path):
  (tmp_path / 'base').mkdir()
  target = tmp_path / 'base' / 'mlp' / 'v' / '1'
  with pytest.raises(RuntimeError, match='disk on fire'):
    with _atomic.atomic_directory(str(target), is_export=_never) as tmp:
      assert _tree(tmp_path / 'base')[:2] == ['mlp/', 'mlp/v/']
      open(os.path.join(tmp, 'part'), 'w').close()
      raise RuntimeError('disk on fire')
  # The existing 'base' stays; what the export made is gone.
  assert _tree(tmp_path) == ['base/']
  # A parent someone else wrote into meanwhile is theirs too: kept.
  with pytest.raises(RuntimeError, match='disk on fire'):
    with _atomic.atomic_directory(str(target), is_export=_never):
      (tmp_path / 'base' / 'mlp' / 'theirs').write_text('x')
      raise RuntimeError('disk on fire')
  assert _tree(tmp_path) == ['base/', 'base/mlp/', 'base/mlp/theirs']


def test_all_or_nothing_creates_and_removes_its_parents(tmp_path):
  out = tmp_path / 'runs' / 'today' / 'out'
  with pytest.raises(RuntimeError, match='stop'):
    with _atomic.all_or_nothing(
      out, ['checkpoint'], overwrite=False, is_export=_never
    ) as staged:
      os.mkdir(staged['checkpoint'])
      raise RuntimeError('stop')
  assert os.listdir(tmp_path) == []
  with _atomic.all_or_nothing(
    out, ['checkpoint'], overwrite=False, is_export=_never
  ) as staged:
    os.mkdir(staged['checkpoint'])
  assert _tree(tmp_path) == [
    'runs/',
    'runs/today/',
    'runs/today/out/',
    'runs/today/out/checkpoint/',
  ]


# Root may write anywhere: the process drops to `nobody` (as fault_runs.py's
# unwritable saves do), a user who may not write in 'ro'.
_UNWRITABLE_ANCESTOR = textwrap.dedent(
  """
  import json, os, sys
  from flax_dtensor.dtensor._storage import _atomic

  base, uid = sys.argv[1], int(sys.argv[2])
  ro = os.path.join(base, 'ro')
  os.mkdir(ro)
  os.chmod(ro, 0o555)
  if os.geteuid() == 0:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
  try:
    with _atomic.atomic_directory(
        os.path.join(ro, 'mlp', '1'), is_export=lambda p: False):
      pass
    error = None
  except Exception as e:
    error = [type(e).__name__, str(e)]
  print(json.dumps({'error': error, 'listing': os.listdir(ro)}))
  """
)


def test_an_ancestor_this_user_may_not_write_in_is_refused():
  # Outside pytest's folders, which only root may enter.
  base = tempfile.mkdtemp(prefix='fdt-parents-')
  try:
    os.chmod(base, 0o755)  # `nobody` may enter it.
    nobody = pwd.getpwnam('nobody').pw_uid
    proc = warm.shared().run_code(
      _UNWRITABLE_ANCESTOR, base, str(nobody), timeout=120
    )
  finally:
    os.chmod(os.path.join(base, 'ro'), 0o755)
    shutil.rmtree(base)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(proc.stdout.strip().splitlines()[-1])
  kind, message = report['error']
  assert kind == 'ExportError'
  assert re.search(
    rf"Cannot write export target '{base}/ro/mlp/1': its parent "
    rf"'{base}/ro/mlp' does not exist, and '{base}/ro', where it "
    r'would be created, is not writable \(this process \(uid \d+\) may not '
    r'write in it .*The missing parent directories are created first: '
    r'choose a directory you may write in',
    message,
  ), message
  assert report['listing'] == []


# Two processes export to one missing base: process 0 creates it; both
# write their part into the one temporary and return together. Then a file
# in the way: both raise process 0's error, and nothing is written.
_TWO_PROCESSES = textwrap.dedent(
  """
  import json, os, sys
  from support import multiprocess_util
  multiprocess_util.initialize_jax()
  import jax
  from flax_dtensor.dtensor._storage import _atomic

  base = sys.argv[1]
  me = jax.process_index()
  target = os.path.join(base, 'models', 'mlp', '1')
  with _atomic.atomic_directory(target, is_export=lambda p: False) as tmp:
    open(os.path.join(tmp, f'part{me}'), 'w').close()
  blocked = os.path.join(base, 'a_file', 'mlp', '1')
  try:
    with _atomic.atomic_directory(blocked, is_export=lambda p: False):
      pass
    error = None
  except Exception as e:
    error = [type(e).__name__, str(e)]
  print('RESULT ' + json.dumps({
      'parts': sorted(os.listdir(target)), 'error': error}))
  """
)


@pytest.mark.multiprocess
def test_two_processes_process_zero_creates_the_parents(tmp_path):
  (tmp_path / 'a_file').write_text('x')
  script = tmp_path / 'worker.py'
  script.write_text(_TWO_PROCESSES)
  outputs = multiprocess_util.run_workers(
    script, 2, args=[str(tmp_path)], devices_per_process=1, timeout=240
  )
  reports = [
    json.loads(line.split(' ', 1)[1])
    for out in outputs
    for line in out.splitlines()
    if line.startswith('RESULT ')
  ]
  assert len(reports) == 2
  for report in reports:
    assert report['parts'] == ['part0', 'part1']
    kind, message = report['error']
    assert kind == 'ExportError'
    assert f"'{tmp_path}/a_file' is a file" in message
  assert reports[0]['error'] == reports[1]['error']
  assert _tree(tmp_path) == sorted(
    [
      'a_file',
      'models/',
      'models/mlp/',
      'models/mlp/1/',
      'models/mlp/1/part0',
      'models/mlp/1/part1',
      'worker.py',
    ]
  )
