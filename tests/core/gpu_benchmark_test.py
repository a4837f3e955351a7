"""The one-accelerator benchmark group, in its `--quick` form on the CPU.

``python benchmarks/run.py --only gpu`` runs on one CUDA device where
TensorFlow is not installed; here the same group runs on one CPU device,
as on the one GPU, with TensorFlow made unimportable, so the core (the plan, `fdt.init`,
eager creation, `with_logical_constraint` in a jitted step) is shown to
need none of it.
"""

import json

from support import processes

RUN = processes.REPO_ROOT / 'benchmarks' / 'run.py'

# What the quick decoder holds: 2 blocks (4 attention kernels of 64 x 64, 3
# MLP kernels of 64 x 128, 2 norms of 64), the embedding and head (256 x
# 64 each) and the final norm, in bfloat16.
BLOCK = 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64
PARAM_BYTES = 2 * (2 * BLOCK + 2 * 256 * 64 + 64)


def test_the_gpu_group_runs_without_tensorflow(tmp_path):
  """`benchmarks/run.py --quick --only gpu` runs where TensorFlow cannot
  be imported.

  Its methods run in one fresh process (`--one-process`): what is tested
  is that the group runs and what it reports, not each method's peak
  memory, which the benchmark's own run measures in a process of its own.
  """
  # A `tensorflow` that cannot be imported, first on the path: as on a
  # machine where it is not installed.
  absent = tmp_path / 'absent'
  (absent / 'tensorflow').mkdir(parents=True)
  (absent / 'tensorflow' / '__init__.py').write_text(
    "raise ImportError('TensorFlow is not installed here')\n"
  )
  out = tmp_path / 'results.json'
  env = processes.reader_env()
  env['PYTHONPATH'] = f'{absent}:{env["PYTHONPATH"]}'
  proc = processes.run_python(
    RUN,
    *('--quick', '--only', 'gpu', '--one-process', '--out', str(out)),
    env=env,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  (entry,) = json.loads(out.read_text())['current']['results']
  assert entry['measured']['one_process'] is True
  methods = entry['methods']
  assert sorted(methods) == sorted(
    [
      *('ours', 'peer', 'ours_again', 'peer_again', 'ours_eager'),
      *('peer_eager', 'ours_plan', 'peer_plan', 'ours_step', 'peer_step'),
    ]
  )
  for role, m in methods.items():
    assert 'error' not in m, (role, m)
    assert m['seconds']['median'] > 0, role
    assert m['device'] == 'cpu' and m['tensorflow_imported'] is False, role
  # Every build holds the whole decoder, ours and Flax's alike.
  for role in ('ours', 'peer', 'ours_again', 'peer_again', 'ours_eager'):
    assert methods[role]['param_bytes'] == PARAM_BYTES, role
  assert methods['peer_eager']['param_bytes'] == PARAM_BYTES
  # The CPU keeps no device memory count: no peak is claimed for it (nor
  # was one measured, that one process could not attribute).
  assert not any('device_peak_per_param' in m for m in methods.values())
  assert not any('device_peak_unattributed' in m for m in methods.values())
  assert sorted(entry['ratio']) == [
    'ours/peer',
    'ours_again/peer_again',
    'ours_eager/peer_eager',
    'ours_plan/peer_plan',
    'ours_step/peer_step',
  ]
  assert 'ours_again/peer_again' in proc.stdout
