"""Fresh processes without the start-up: forks of a Python that imported once.

A test that needs its own process (a reader's script, a process to kill,
a device count or a DTensor set-up of its own) pays ~10 s of imports for
JAX, Flax and TensorFlow when it starts `python`. A `Pool` imports them
once, in a server process (workers/warm_server.py) that has started
neither JAX's backend nor TensorFlow's runtime and runs one thread, and
forks it for each script. The fork is a fresh process in everything the
script can see: its own devices (`jax_num_cpu_devices`, `XLA_FLAGS`), its
own DTensor `initialize()` (one client or several, with
`jax.distributed`), Flax's configuration, module globals, the directory,
the environment and PYTHONPATH, stdin/stdout/stderr, its exit status, a
process group of its own (a kill or a timeout takes what it started too),
signals (one sent as the fork starts waits for the script, as a fresh
`python` would take it); only the imports are done. A session's pool,
and every script still running, end with the session.

    pool = warm.Pool()  # Or the session's: the `warm_pool` fixture.
    proc = pool.run(script, 'arg', cwd=tmp, env=processes.reader_env())
    case = pool.start(script, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

`run` is `processes.run_python` (captured text, bounded by a timeout, a
`CompletedProcess`); `start` is `subprocess.Popen` (a `Case` to talk to,
kill and wait for). What a fork cannot give is a process whose subject is
an import itself (that `import flax_dtensor` imports no TensorFlow, what
runs at import time): such a test starts `python` (`processes`), or uses a
pool that does not preload its subject. The variables modules read when
imported (`JAX_PLATFORMS`, `TF_CPP_MIN_LOG_LEVEL`) are the pool's: its
environment is `processes.clean_env()` without `XLA_FLAGS`, so each script's
devices are its own (`env=` sets the script's environment, `XLA_FLAGS`
included), and with numpy's BLAS on one thread, as forking needs.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence

from support import processes

SERVER = processes.WORKERS_DIR / 'warm_server.py'
# What a pool imports by default: the stack every test script uses.
PRELOAD = (
  'numpy',
  'jax',
  'jax.numpy',
  'flax',
  'flax.nnx',
  'optax',
  'orbax.checkpoint',
  'tensorflow',
  'flax_dtensor',
  'flax_dtensor.dtensor',
  'flax_dtensor.demo.model',
  'flax_dtensor.demo.train',
)
# What a reader's pool imports: TensorFlow with JAX blocked first (TF
# imports `jax.version` where JAX is installed), as `processes.NO_JAX` does
# in the scripts: plain TensorFlow, as on a machine that serves with it.
TF_ONLY = ('-jax', '-jaxlib', 'numpy', 'tensorflow')
STARTUP_TIMEOUT = 600


_shared: Pool | None = None
_shared_tf: Pool | None = None


def shared() -> Pool:
  """This process's pool: started at its first use, closed at exit.

  The test session's `warm_pool` fixture is this pool, so a helper that
  starts processes (multiprocess_util) and the tests share one server.
  """
  global _shared
  if _shared is None:
    _shared = Pool()
    atexit.register(_shared.close)
  return _shared


def tf_only() -> Pool:
  """This process's TensorFlow-only pool (`TF_ONLY`), as `shared()`.

  For the scripts that serve or read in plain TensorFlow with JAX blocked:
  each a fork, so TensorFlow's ~6 s import is paid once a worker, not once
  a script. The `tf_pool` fixture is this pool.
  """
  global _shared_tf
  if _shared_tf is None:
    _shared_tf = Pool(TF_ONLY)
    atexit.register(_shared_tf.close)
  return _shared_tf


class PoolError(RuntimeError):
  """The pool's server could not start, or died."""


class Case:
  """One script running in a fork of the pool, as `subprocess.Popen` is."""

  def __init__(self, pool: Pool, args: list[str]):
    self.pool = pool
    self.args = args
    self.pid: int | None = None
    self.returncode: int | None = None
    self.stdin = self.stdout = self.stderr = None
    self._started = threading.Event()
    self._exited = threading.Event()

  def _wait_started(self, timeout: float = STARTUP_TIMEOUT) -> None:
    if not self._started.wait(timeout):
      raise PoolError(f'the pool did not start {self.args}')
    if self.pid is None:
      raise PoolError(f'the pool died: {self.pool.log()}')

  def poll(self) -> int | None:
    return self.returncode

  def wait(self, timeout: float | None = None) -> int:
    """The exit status (negative: killed by that signal), as Popen's."""
    if not self._exited.wait(timeout):
      raise subprocess.TimeoutExpired(self.args, timeout)
    if self.returncode is None:
      raise PoolError(f'the pool died: {self.pool.log()}')
    return self.returncode

  def send_signal(self, sig: int) -> None:
    """Signals the script and every process it started."""
    self._wait_started()
    if not self._exited.is_set():
      with contextlib.suppress(ProcessLookupError):
        os.killpg(self.pid, sig)

  def kill(self) -> None:
    self.send_signal(signal.SIGKILL)


class Pool:
  """A server process that imported `preload` and forks one per script."""

  def __init__(
    self,
    preload: Sequence[str] = PRELOAD,
    *,
    env: Mapping[str, str] | None = None,
  ):
    if env is None:
      env = processes.clean_env(
        XLA_FLAGS=None, OPENBLAS_NUM_THREADS='1', OMP_NUM_THREADS='1'
      )
    self.env = dict(env)
    self._sock, theirs = socket.socketpair(
      socket.AF_UNIX, socket.SOCK_SEQPACKET
    )
    self._log = tempfile.TemporaryFile()
    with theirs:
      self._proc = subprocess.Popen(
        [sys.executable, str(SERVER), str(theirs.fileno()), *preload],
        pass_fds=[theirs.fileno()],
        env=self.env,
        cwd=processes.REPO_ROOT,
        stdin=subprocess.DEVNULL,
        stdout=self._log,
        stderr=subprocess.STDOUT,
      )
    self._lock = threading.Lock()
    self._cases: dict[int, Case] = {}
    self._next = 0
    self._ready = threading.Event()
    self._problem = 'no answer'
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()
    if not self._ready.wait(STARTUP_TIMEOUT) or self._problem:
      log = self.log()
      self.close()
      raise PoolError(f'the pool could not start: {self._problem}\n{log}')

  def log(self) -> str:
    """What the server printed (its import-time output, a crash)."""
    self._log.seek(0)
    return self._log.read().decode(errors='replace')[-5000:]

  def _read(self) -> None:
    while True:
      try:
        data = self._sock.recv(1 << 16)
      except OSError:
        data = b''
      if not data:
        break
      message = json.loads(data)
      if 'ready' in message:
        self._problem = message['problem']
        self._ready.set()
        continue
      case = self._cases[message['id']]
      if 'pid' in message:
        case.pid = message['pid']
        case._started.set()
      else:
        case.returncode = message['exit']
        del self._cases[message['id']]
        case._exited.set()
    self._ready.set()
    for case in list(self._cases.values()):  # The server died.
      case._started.set()
      case._exited.set()

  def start(
    self,
    script: str | os.PathLike[str],
    *args: str,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    stdin=subprocess.DEVNULL,
    stdout=None,
    stderr=None,
  ) -> Case:
    """Starts `python SCRIPT ARGS` as a fork; a `Popen`-like `Case`.

    Args:
      script: The script's path.
      *args: Its arguments.
      cwd: Its directory (the repository's by default).
      env: Its environment (`processes.clean_env()` by default).
      stdin, stdout, stderr: `subprocess.PIPE` (then the case has that
        file, binary), `subprocess.DEVNULL`, `subprocess.STDOUT` (stderr
        only), an open file, or None (the pool's log).
    """
    sys.audit('flax_dtensor.tests.warm_fork', str(script))
    case = Case(self, [str(script), *args])
    theirs, ours = [], []
    for i, how in enumerate((stdin, stdout, stderr)):
      if how is None:
        fd = os.dup(self._log.fileno())
      elif how == subprocess.STDOUT:
        fd = os.dup(theirs[1])
      elif how == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
      elif how == subprocess.PIPE:
        r, w = os.pipe()
        fd, mine = (r, w) if i == 0 else (w, r)
        ours.append((i, os.fdopen(mine, 'wb' if i == 0 else 'rb', 0)))
      else:
        fd = os.dup(how.fileno())
      theirs.append(fd)
    for i, file in ours:
      setattr(case, ('stdin', 'stdout', 'stderr')[i], file)
    request = {
      'script': str(pathlib.Path(script).resolve()),
      'args': [str(a) for a in args],
      'cwd': str(processes.REPO_ROOT if cwd is None else cwd),
      'env': dict(processes.clean_env() if env is None else env),
    }
    try:
      with self._lock:
        request['id'] = self._next
        self._cases[self._next] = case
        self._next += 1
        socket.send_fds(self._sock, [json.dumps(request).encode()], theirs)
    finally:
      for fd in theirs:
        os.close(fd)
    case._wait_started()
    return case

  def run(
    self,
    script: str | os.PathLike[str],
    *args: str,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = processes.TIMEOUT,
    input: str | None = None,
  ) -> subprocess.CompletedProcess[str]:
    """Runs `python SCRIPT ARGS` to its end, as `processes.run_python`.

    Captured text output; stdin is `input`, or closed; at most `timeout`
    seconds, then the script (and all it started) is killed and
    `subprocess.TimeoutExpired` raised.
    """
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
      case = self.start(
        script,
        *args,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL if input is None else subprocess.PIPE,
        stdout=out,
        stderr=err,
      )
      if input is not None:
        with case.stdin:
          case.stdin.write(input.encode())
      try:
        case.wait(timeout)
      except subprocess.TimeoutExpired:
        case.kill()
        case.wait(60)
        raise
      out.seek(0)
      err.seek(0)
      return subprocess.CompletedProcess(
        case.args,
        case.returncode,
        out.read().decode(errors='replace'),
        err.read().decode(errors='replace'),
      )

  def run_code(
    self, code: str, *args: str, **kwargs
  ) -> subprocess.CompletedProcess[str]:
    """`run` of the script `code` (as ``python -c CODE ARGS``, but with
    `__file__` a temporary file's; `kwargs` as `run`'s)."""
    with tempfile.TemporaryDirectory(prefix='fdt-warm-') as folder:
      script = pathlib.Path(folder, 'script.py')
      script.write_text(code)
      return self.run(script, *args, **kwargs)

  def close(self) -> None:
    """Kills the scripts still running, then the server."""
    global _shared, _shared_tf
    if _shared is self:
      _shared = None
    if _shared_tf is self:
      _shared_tf = None
    with contextlib.suppress(OSError):
      self._sock.shutdown(socket.SHUT_RDWR)
    try:
      self._proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
      self._proc.kill()
      self._proc.wait(timeout=60)
    self._reader.join(timeout=60)
    self._sock.close()
    self._log.close()
