"""A process killed in a multi-process save: the others fail, bounded, in words.

Two local processes (jax.distributed and DTensor on 127.0.0.1, see
fault_runs.dead_peer and _mp_worker_dead_peer.py) save a checkpoint, then
overwrite it; process 1 is killed mid-save, while it writes its shards or
at our barrier after them, or as a restore begins. Process 0 must raise our
`ExportError` naming process 1, within FLAX_DTENSOR_PEER_TIMEOUT (10 s
here) rather than hang until JAX's own heartbeat timeout aborts it (100 s);
the checkpoint must be the old version, whole, with nothing else left, a
restore's target unchanged, and process 0's TensorFlow still working. In four processes (scale_runs.four_processes), process 2 is
killed during a background save: the three others raise at `wait()`. And
`initialize()` names a process that never joins the set-up of DTensor.
"""

import os
import re

import numpy as np
import pytest
from support import fault_runs, scale_runs

pytest.importorskip('tensorflow')
fdt_tf = pytest.importorskip('flax_dtensor.dtensor')


# Either moment: process 0 meets process 1's silence at our barrier (a save
# runs no collective, so nothing of TF waits for it).
_WHY = {
  moment: rf'no heartbeat from it for {fault_runs.PEER_TIMEOUT} s \(it '
  r'died, or hangs; FLAX_DTENSOR_PEER_TIMEOUT sets this bound, 60 s by '
  r'default\)'
  for moment in ('in-write', 'at-barrier')
}


def _version(version):
  """The values _mp_worker_dead_peer.py saves as `version`."""
  base = np.arange(8 * 256, dtype=np.float32).reshape(8, 256)
  return {(f'v{i}',): base + 1000 * version + i for i in range(8)}


def _assert_peer_named(run, during, why):
  """Process 0 of `run` failed, naming process 1, stopped `during` (e.g.
  'save to') its checkpoint, for the reason `why` (a regex)."""
  path = os.path.join(run['root'], 'ckpt')
  doing = during.split()[0]
  assert run['error'] is not None, f'process 0 ended its {doing} alone'
  assert re.match(
    rf"Process 1 of 2 stopped during the {during} '{re.escape(path)}': "
    rf'{why}\. Restart every process of the job',
    run['error'],
  ), run['error']


def test_a_dead_peer_in_a_restore_leaves_the_target_unchanged():
  run = fault_runs.dead_peer('in-restore')
  _assert_peer_named(
    run, 'restore from', rf'{_WHY["at-barrier"]}\. The target was not changed'
  )
  assert run['unchanged']
  assert run['listing'] == ['ckpt']


@pytest.mark.parametrize('moment', ['in-write', 'at-barrier'])
def test_a_dead_peer_is_named_and_the_checkpoint_stays_whole(moment):
  run = fault_runs.dead_peer(moment)
  assert run['process'] == 0
  path = os.path.join(run['root'], 'ckpt')
  _assert_peer_named(
    run,
    'save to',
    rf'{_WHY[moment]}.*{re.escape(repr(path))} holds the previous checkpoint '
    r'or the new one, whole',
  )
  # Process 0 removed its temporary before reporting, and its TensorFlow
  # still works: it read the checkpoint back.
  assert run['listing'] == ['ckpt']
  assert run['read_after'] == float(sum(v.sum() for v in _version(1).values()))
  read = fdt_tf.read_checkpoint(path)
  expected = _version(1)
  assert set(read) == set(expected)
  for key, value in expected.items():
    np.testing.assert_array_equal(read[key], value)
  assert os.listdir(run['root']) == ['ckpt']


def test_a_dead_peer_of_a_background_save_is_named_at_every_wait():
  """Process 2 of 4 dies mid-save: 0, 1 and 3 raise at `wait()`, bounded."""
  run = scale_runs.four_processes()
  path = os.path.join(run['root'], 'c4')
  survivors = [r for r in run['results'] if r['process'] != scale_runs.DEAD]
  assert [r['process'] for r in survivors] == [0, 1, 3]
  assert 'dead_peer' not in run['results'][scale_runs.DEAD]
  for r in survivors:
    error = r['dead_peer']['error']
    assert error is not None, f'process {r["process"]} saved without 2'
    assert re.match(
      rf"Process 2 of 4 stopped during the save to '{re.escape(path)}': "
      rf'no heartbeat from it for {scale_runs.PEER_TIMEOUT} s \(it died, or '
      r'hangs; FLAX_DTENSOR_PEER_TIMEOUT sets this bound.*'
      rf'{re.escape(repr(path))} holds the previous checkpoint or the new '
      r'one, whole\. Restart every process of the job',
      error,
    ), error
    # Within the bound of the last heartbeat (plus writing and a margin).
    assert r['dead_peer']['seconds'] < scale_runs.PEER_TIMEOUT + 30
  # Process 0 removed the temporary, the dead process's part with it.
  assert sorted(os.listdir(run['root'])) == ['c2', 'c4', 's4']
  read = fdt_tf.read_checkpoint(path)
  for name, value in scale_runs.values(1).items():
    assert read[(name,)].tobytes() == value.tobytes(), name


def test_no_process_dies_of_process_0_leaving_after_a_dead_peer():
  """Process 1 of 3 dies; process 0 fails and exits at once, process 2 is
  busy elsewhere. Process 0 hosts JAX's coordination service, whose end
  JAX answers with SIGABRT in every process still connected (and TF
  DTensor's service, which sees process 1 go too): process 2 must still
  raise a PeerError naming process 1, and exit by itself."""
  first, lagging = fault_runs.lagging_peer()
  why = (
    rf'Process 1 of 3 stopped during the wait: no heartbeat from it for '
    rf'{fault_runs.PEER_TIMEOUT} s \(it died, or hangs; '
    r'FLAX_DTENSOR_PEER_TIMEOUT sets this bound.*Nothing changed\. Restart '
    r'every process of the job'
  )
  for r in (first, lagging):
    assert r['kind'] == 'PeerError', r
    assert re.search(why, r['error']), r['error']


def test_initialize_names_a_process_that_never_joins():
  """Without DTENSOR_*: a process that never calls initialize() is named."""
  run = fault_runs.absent_peer()
  assert re.match(
    r'Process 1 of 2 stopped during the set-up of TF DTensor, which every '
    r"process's flax_dtensor\.dtensor\.initialize\(\) joins: no heartbeat "
    rf'from it for {fault_runs.ABSENT_PEER_TIMEOUT} s .*TF DTensor was not '
    r'set up\.',
    run['error'],
  ), run['error']
  assert run['seconds'] < fault_runs.ABSENT_PEER_TIMEOUT + 30
  # The addresses are exchanged before TensorFlow is imported.
  assert not run['tensorflow']
