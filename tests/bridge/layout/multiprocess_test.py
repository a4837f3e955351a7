"""Multi-process tests: 2 local JAX processes, one DTensor client each."""

import pytest
from support import multiprocess_util, processes

pytest.importorskip('tensorflow')

WORKERS_DIR = processes.WORKERS_DIR


@pytest.mark.multiprocess
def test_dtensor_bridge_across_two_processes():
  outputs = multiprocess_util.run_workers(
    WORKERS_DIR / '_mp_worker_mesh.py', num_processes=2, timeout=400
  )
  for i, out in enumerate(outputs):
    assert f'WORKER OK process={i} checks=49' in out, out


def test_run_workers_reports_a_failing_worker(tmp_path):
  """One worker fails: the launcher kills the other and shows both outputs."""
  script = WORKERS_DIR / '_mp_worker_fail.py'
  with pytest.raises(
    multiprocess_util.WorkerError,
    match=r'(?s)worker\(s\) \[1\] failed.*process 0.*waiting.*'
    r'process 1 \(exit 3\).*worker 1 gives up',
  ):
    multiprocess_util.run_workers(
      script, num_processes=2, args=[str(tmp_path / 'ready')], timeout=120
    )
