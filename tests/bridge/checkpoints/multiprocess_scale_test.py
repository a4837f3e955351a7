"""Across process counts: background saves, DTensor from JAX, restores.

Two local processes (4 CPU devices each) save a model in the background,
with no `DTENSOR_*` variable set; four processes (2 devices each) restore
that checkpoint onto another mesh shape and another layout, save it in the
background and export a SavedModel; this process (8 devices) restores all
three. Every value is compared bit for bit, and every restore counts the
bytes it reads (the OS's count, /proc/self/io): each process reads the
saved shards that meet its slices, once, and no others. The runs themselves
are in scale_runs.py (one of each per session); the dead peer of the
four-process run is checked in multiprocess_faults_test.py.
"""

import json
import os
import re

import jax
import pytest
from flax import nnx
from support import scale_runs

pytest.importorskip('tensorflow')
fdt_tf = pytest.importorskip('flax_dtensor.dtensor')


MIB = 2**20
# Bytes TF may read beyond what it is asked for, in one read of a variable:
# its read buffer (1 MiB), plus the index and manifest read around it.
READ_SLACK = MIB + 64 * 1024


def _manifest(path):
  with open(os.path.join(path, 'flax_dtensor.json')) as f:
    return json.load(f)


def _assert_values(path, version):
  read = fdt_tf.read_checkpoint(path)
  want = scale_runs.values(version)
  assert set(read) == {(name,) for name in want}
  for name, value in want.items():
    got = read[(name,)]
    assert got.dtype == value.dtype, name
    assert got.tobytes() == value.tobytes(), name


@pytest.mark.parametrize('run', ['two', 'four'])
def test_initialize_sets_dtensor_up_from_jax_alone(run):
  """No DTENSOR_* variable set: one entry per process, from JAX's store."""
  results = getattr(scale_runs, f'{run}_processes')()['results']
  jobs = results[0]['jobs'].split(',')
  assert len(jobs) == len(results)
  assert all(re.fullmatch(r'127\.0\.0\.1:\d+', job) for job in jobs), jobs
  assert len(set(jobs)) == len(jobs), jobs
  for i, r in enumerate(results):
    assert r['process'] == i
    assert r['jobs'] == results[0]['jobs']
    assert r['client_id'] == str(i)


def test_a_background_save_of_two_processes_holds_the_values_of_the_call():
  run = scale_runs.two_processes()
  root = run['root']
  for r in run['results']:
    # Every array saved was donated right after the call.
    assert r['donated'] == [True] * len(scale_runs.VARIABLES), r
    assert r['result'] == os.path.join(root, 'c2')
    # The restore of the path waited for the pending save, and read it.
    assert r['done_before_restore_returned']
    assert r['restored_mismatched'] == []
  _assert_values(os.path.join(root, 'c2'), 1)
  # The same checkpoint as a blocking save's: every variable's record,
  # its shards' slices and CRCs included.
  background = _manifest(os.path.join(root, 'c2'))
  blocking = _manifest(os.path.join(root, 'c2_blocking'))
  assert background['variables'] == blocking['variables']
  # The interpreter waited for the save left pending at exit.
  _assert_values(os.path.join(root, 'c2_exit'), 1)
  assert sorted(os.listdir(root)) == ['c2', 'c2_blocking', 'c2_exit']


@pytest.mark.parametrize('layout', ['same', 'swapped'])
def test_four_processes_restore_two_processes_checkpoint(layout):
  """Onto a (4, 2) mesh: each process reads the shards meeting its slices."""
  run = scale_runs.four_processes()
  manifest = _manifest(os.path.join(run['root'], 'c2'))
  total = scale_runs.shard_bytes(manifest, 'w', None)
  assert total == 1024 * 2048 * 4
  for r in run['results']:
    restored = r[f'restore_{layout}']
    assert restored['mismatched'] == [], r['process']
    needed = scale_runs.shard_bytes(manifest, 'w', restored['held_w'])
    assert needed <= total // 2
    read = restored['read_w']
    assert needed <= read <= needed + READ_SLACK, (r['process'], read, needed)


def _restore_here(path, layout, shape):
  """Restores onto this process's 8 devices: (bytes read for w, model)."""
  mesh = jax.make_mesh(
    shape, ('data', 'model'), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  target = scale_runs.model(mesh, 0, layout)
  before = scale_runs.rchar()
  fdt_tf.restore_checkpoint(path, target, include=nnx.PathContains('w'))
  read = scale_runs.rchar() - before
  fdt_tf.restore_checkpoint(path, target)
  return read, target


@pytest.mark.parametrize(
  ('name', 'layout', 'shape'),
  [
    ('c2', None, (2, 4)),
    ('c2', scale_runs.SWAPPED, (4, 2)),
    ('c4', None, (2, 4)),
    ('s4', scale_runs.SWAPPED, (8, 1)),
  ],
  ids=['two-same', 'two-swapped', 'four', 'saved-model-of-four'],
)
def test_one_process_restores_what_several_wrote(name, layout, shape):
  """Checkpoints of 2 and 4 processes, a SavedModel of 4: read once each."""
  root = (
    scale_runs.two_processes if name == 'c2' else scale_runs.four_processes
  )()['root']
  path = os.path.join(root, name)
  read, target = _restore_here(path, layout, shape)
  assert scale_runs.mismatched(target, 1) == []
  manifest_path = path if name != 's4' else os.path.join(path, 'assets')
  total = scale_runs.shard_bytes(_manifest(manifest_path), 'w', None)
  assert total == 1024 * 2048 * 4
  assert total <= read <= total + READ_SLACK, read
