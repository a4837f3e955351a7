"""The warm pool's forks are fresh processes (tests/support/warm.py).

Each script sees its own devices, DTensor set-up, Flax configuration,
module globals, directory, environment and standard streams, whatever the
script before it did in its fork; it exits with Python's status (output
flushed, atexit handlers run, threads joined); a timeout kills it and all
it started. A server that would fork unsafely refuses to serve.
"""

import os
import signal
import subprocess
import textwrap
import time

import pytest
from support import processes, warm

pytest.importorskip('tensorflow')

# Leaves every kind of state behind if asked ('dirty'), then reports it.
STATE = textwrap.dedent(
  """
  import json, os, sys
  import flax, jax
  devices = int(sys.argv[1])
  if devices > 1:
    jax.config.update('jax_num_cpu_devices', devices)
  import flax_dtensor as fdt
  from flax_dtensor import dtensor as fdt_dt
  fdt_dt.initialize()
  import tensorflow as tf
  report = {
    'jax': jax.device_count(),
    'tf': len(tf.config.list_logical_devices('CPU')),
    'flax': flax.config.flax_always_shard_variable,
    'rules': fdt.get_logical_axis_rules() is not None,
    'global': hasattr(json, 'LEFT_BEHIND'),
    'files': sorted(os.listdir('.')),
    'env': os.environ.get('LEFT_BEHIND'),
  }
  if sys.argv[2] == 'dirty':
    flax.config.update('flax_always_shard_variable', False)
    fdt.logical_axis_rules([('embed', 'data')]).__enter__()
    json.LEFT_BEHIND = True
    os.environ['LEFT_BEHIND'] = '1'
    open('left_behind', 'w').close()
  print('RESULT ' + json.dumps(report))
  """
)


def _script(tmp_path, name, code):
  path = tmp_path / name
  path.write_text(textwrap.dedent(code))
  return path


def test_each_fork_starts_fresh(tmp_path, warm_pool):
  script = _script(tmp_path, 'state.py', STATE)
  fresh = {
    'flax': True,
    'rules': False,
    'global': False,
    'files': [],
    'env': None,
  }
  for devices, mode in [(8, 'dirty'), (1, 'dirty'), (8, 'check')]:
    cwd = tmp_path / f'{devices}-{mode}'
    cwd.mkdir()
    proc = warm_pool.run(
      script, str(devices), mode, cwd=cwd, env=processes.reader_env()
    )
    report = processes.checked_result(proc)
    assert report == {'jax': devices, 'tf': devices, **fresh}, report


def test_the_script_runs_as_python_runs_it(tmp_path, warm_pool):
  script = _script(
    tmp_path,
    'echo.py',
    """
    import atexit, os, sys, threading, time
    atexit.register(lambda: print('atexit', flush=True))
    threading.Thread(target=lambda: (time.sleep(0.5), print('joined'))).start()
    print(__name__, os.path.basename(__file__), sys.argv[1:], os.getcwd())
    print(sys.stdin.read(), os.environ['GREETING'], sys.path[0])
    import only_on_its_path
    print('to stderr', file=sys.stderr)
    print('unflushed', end='')
    sys.exit(int(sys.argv[1]))
    """,
  )
  elsewhere = tmp_path / 'elsewhere'
  elsewhere.mkdir()
  (elsewhere / 'only_on_its_path.py').write_text('')
  proc = warm_pool.run(
    script,
    '3',
    'b',
    cwd=tmp_path,
    env=processes.clean_env(GREETING='hi', PYTHONPATH=str(elsewhere)),
    input='from stdin',
  )
  assert proc.returncode == 3, proc.stderr
  assert proc.stdout.splitlines() == [
    f"__main__ echo.py ['3', 'b'] {tmp_path}",
    f'from stdin hi {tmp_path}',
    'unflushedjoined',
    'atexit',
  ]
  assert proc.stderr == 'to stderr\n'


def test_an_error_is_reported_as_python_reports_it(tmp_path, warm_pool):
  script = _script(
    tmp_path,
    'fails.py',
    """
    def broken():
      raise ValueError('the docs are wrong')
    broken()
    """,
  )
  proc = warm_pool.run(script, cwd=tmp_path)
  assert proc.returncode == 1
  lines = proc.stderr.splitlines()
  assert lines[0] == 'Traceback (most recent call last):', proc.stderr
  assert lines[-1] == 'ValueError: the docs are wrong', proc.stderr
  assert 'warm_server' not in proc.stderr and str(script) in lines[1]
  killed = _script(
    tmp_path, 'killed.py', 'import os, signal\nos.kill(os.getpid(), 9)\n'
  )
  assert warm_pool.run(killed).returncode == -signal.SIGKILL


def test_a_timeout_kills_the_script_and_what_it_started(tmp_path, warm_pool):
  script = _script(
    tmp_path,
    'hangs.py',
    """
    import subprocess, time
    child = subprocess.Popen(['sleep', '600'])
    open('child', 'w').write(str(child.pid))
    time.sleep(600)
    """,
  )
  with pytest.raises(subprocess.TimeoutExpired):
    warm_pool.run(script, cwd=tmp_path, timeout=5)
  child = int((tmp_path / 'child').read_text())
  for _ in range(100):  # Killed; gone once init reaps it.
    if not os.path.exists(f'/proc/{child}'):
      break
    with open(f'/proc/{child}/stat') as f:
      if f.read().split(') ')[1].startswith('Z'):
        break
    time.sleep(0.1)
  else:
    raise AssertionError(f'{child} still runs')


def test_a_started_script_is_talked_to_through_pipes(tmp_path, warm_pool):
  script = _script(
    tmp_path,
    'talks.py',
    """
    import sys
    for line in sys.stdin:
      print(line.strip().upper(), flush=True)
    """,
  )
  case = warm_pool.start(script, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
  with case.stdout:  # Closed whatever fails: no pipe left to the collector.
    with case.stdin:
      case.stdin.write(b'hello\n')
      assert case.stdout.readline() == b'HELLO\n'
    assert case.wait(60) == 0
    assert case.stdout.read() == b''


def test_a_signal_during_the_fork_reaches_the_script(tmp_path):
  """A SIGINT while the child runs Python's at-fork hooks is not lost.

  Raised in a hook, Python would print it and go on (the script then ran
  to its end, exit 0); held, it comes as the script starts, as to a fresh
  `python`: KeyboardInterrupt, death by SIGINT, the script not run. The
  hook waits for the test (no timing): it says it is in, and stays until
  the signal has been sent.
  """
  inside, sent = tmp_path / 'inside', tmp_path / 'sent'
  (tmp_path / 'held_fork.py').write_text(
    'import os, pathlib, time\n'
    'def _hold():\n'
    f'  pathlib.Path({str(inside)!r}).touch()\n'
    '  deadline = time.monotonic() + 120\n'
    f'  while not os.path.exists({str(sent)!r}):\n'
    '    if time.monotonic() > deadline:\n'
    '      os._exit(3)\n'
    '    time.sleep(0.01)\n'
    'os.register_at_fork(after_in_child=_hold)\n'
  )
  script = _script(tmp_path, 'ran.py', "print('ran')\n")
  env = processes.clean_env(
    XLA_FLAGS=None,
    OPENBLAS_NUM_THREADS='1',
    PYTHONPATH=f'{tmp_path}{os.pathsep}{processes.REPO_ROOT}',
  )
  pool = warm.Pool(['held_fork'], env=env)
  try:
    case = pool.start(script, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    with case.stdout:
      deadline = time.monotonic() + 120
      while not inside.exists():  # The child is in its hook.
        assert case.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
      case.send_signal(signal.SIGINT)
      sent.touch()
      status = case.wait(60)
      out = case.stdout.read().decode()
  finally:
    pool.close()
  assert status == -signal.SIGINT, out
  assert 'ran' not in out.split(), out
  assert out.rstrip().endswith('KeyboardInterrupt'), out


@pytest.mark.parametrize(
  'module, problem',
  [
    (
      'import threading, time\n'
      'threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n',
      '2 threads',
    ),
    ('import jax\njax.devices()\n', "JAX's backend started"),
  ],
  ids=['a-thread', 'jax-backend'],
)
def test_a_server_that_would_fork_unsafely_refuses(tmp_path, module, problem):
  (tmp_path / 'unsafe.py').write_text(module)
  env = processes.clean_env(
    XLA_FLAGS=None,
    OPENBLAS_NUM_THREADS='1',
    PYTHONPATH=f'{tmp_path}{os.pathsep}{processes.REPO_ROOT}',
  )
  with pytest.raises(warm.PoolError, match=problem):
    warm.Pool(['unsafe'], env=env)
