"""Runs a worker script in several local processes: JAX distributed + DTensor.

Test side: `run_workers(script, num_processes=2)` starts the processes on
127.0.0.1 (free ports picked by the OS), each with its own CPU devices, bounds
them by a timeout, kills them all if one fails, and returns their outputs. On
failure it raises `WorkerError` with every process's output.

Worker side (first thing in the script, before anything touches JAX):

    from support import multiprocess_util
    multiprocess_util.initialize_jax()

which calls `jax.distributed.initialize` from the environment set here. The
environment also holds `DTENSOR_JOBS`, `DTENSOR_CLIENT_ID` and
`DTENSOR_JOB_NAME` (unless `dtensor_env=False`: then
`flax_dtensor.dtensor.initialize()` sets them from JAX), so
`flax_dtensor.dtensor.initialize()` then sets up one DTensor client per JAX
process.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence

from support import processes

# Environment variables read by `initialize_jax`.
COORDINATOR_ENV = 'FDT_MP_COORDINATOR'
NUM_PROCESSES_ENV = 'FDT_MP_NUM_PROCESSES'
PROCESS_ID_ENV = 'FDT_MP_PROCESS_ID'
DEVICES_ENV = 'FDT_MP_DEVICES_PER_PROCESS'


# On failure, each worker's last lines of output are reported.
REPORT_LINES = 80


class WorkerError(RuntimeError):
  """A worker process failed or timed out; the message has all outputs."""


def _ephemeral_low() -> int:
  """The first port of the kernel's range for outgoing connections."""
  try:
    with open('/proc/sys/net/ipv4/ip_local_port_range') as f:
      return int(f.read().split()[0])
  except (OSError, ValueError, IndexError):
    return 32768  # Linux's default.


def _bindable(port: int) -> bool:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    try:
      s.bind(('127.0.0.1', port))
    except OSError:
      return False
  return True


def free_ports(n: int) -> list[int]:
  """Returns `n` distinct free TCP ports on 127.0.0.1, chosen at random.

  Below the kernel's ephemeral range: a port the kernel hands out for a
  bind to port 0 is also one it hands to outgoing connections as their
  local port, so between its release and the worker's bind any client
  (gRPC's, in a test running beside this one) could take it. A port below
  that range is taken only by another server's bind.
  """
  high = _ephemeral_low()
  low = max(1024, high - 12_000)
  rng = random.SystemRandom()
  ports: list[int] = []
  while len(ports) < n:
    port = rng.randrange(low, high)
    if port not in ports and _bindable(port):
      ports.append(port)
  return ports


def worker_env(
  process_id: int,
  num_processes: int,
  *,
  coordinator_port: int,
  dtensor_ports: Sequence[int],
  devices_per_process: int,
  extra: Mapping[str, str] | None = None,
  dtensor_env: bool = True,
) -> dict[str, str]:
  """Returns the environment of worker `process_id`.

  With `dtensor_env=False`, no `DTENSOR_*` variable is set.
  """
  env = processes.clean_env(support=True)
  if dtensor_env:
    env.update(
      {
        'DTENSOR_JOBS': ','.join(f'127.0.0.1:{p}' for p in dtensor_ports),
        'DTENSOR_CLIENT_ID': str(process_id),
        'DTENSOR_JOB_NAME': 'worker',
      }
    )
  env.update(
    {
      COORDINATOR_ENV: f'127.0.0.1:{coordinator_port}',
      NUM_PROCESSES_ENV: str(num_processes),
      PROCESS_ID_ENV: str(process_id),
      DEVICES_ENV: str(devices_per_process),
      'XLA_FLAGS': (
        f'--xla_force_host_platform_device_count={devices_per_process}'
      ),
      'JAX_PLATFORMS': 'cpu',
      'TF_CPP_MIN_LOG_LEVEL': '2',
      'PYTHONUNBUFFERED': '1',
    }
  )
  env.update(extra or {})
  return env


def run_workers(
  script_path: str | os.PathLike[str],
  num_processes: int = 2,
  *,
  args: Sequence[str] | Callable[[int], Sequence[str]] = (),
  timeout: float = 300,
  devices_per_process: int = 4,
  env: Mapping[str, str] | None = None,
  may_die: Collection[int] = (),
  dtensor_env: bool = True,
  fresh: bool = False,
) -> list[str]:
  """Runs `script_path` in `num_processes` local processes; returns outputs.

  Each process is a fork of this process's warm pool (`warm.shared()`: JAX,
  Flax and TensorFlow imported once, neither's runtime started), which is
  a fresh process to the script in all it can see; with `fresh`, a new
  ``python`` each (for a test whose subject is what a start-up does).

  Args:
    script_path: The worker script. It calls `initialize_jax()` first.
    num_processes: How many processes (JAX processes and DTensor clients).
    args: Command-line arguments for every worker, or a function of the
      process id returning each one's.
    timeout: Seconds for the whole run; then every process is killed.
    devices_per_process: CPU devices of each process.
    env: Extra environment variables for every worker.
    may_die: Processes whose death (any exit status) does not fail the
      run: a test kills them on purpose, and the others go on.
    dtensor_env: Set the `DTENSOR_*` variables; if false, the workers'
      `flax_dtensor.dtensor.initialize()` sets them from JAX.
    fresh: Start each process as a new ``python``, not a fork.

  Returns:
    Each process's combined stdout and stderr, by process id.

  Raises:
    WorkerError: If a process exits with a non-zero status (the others are
      then killed) or the run times out. The message holds all outputs.
  """
  ports = free_ports(num_processes + 1)
  coordinator_port, dtensor_ports = ports[0], ports[1:]
  with tempfile.TemporaryDirectory(prefix='fdt_mp_') as tmp:
    logs = [pathlib.Path(tmp, f'worker{i}.log') for i in range(num_processes)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
      for i in range(num_processes):
        with open(logs[i], 'wb') as log:
          procs.append(
            _start(
              [str(script_path), *(args(i) if callable(args) else args)],
              env=worker_env(
                i,
                num_processes,
                coordinator_port=coordinator_port,
                dtensor_ports=dtensor_ports,
                devices_per_process=devices_per_process,
                extra=env,
                dtensor_env=dtensor_env,
              ),
              log=log,
              fresh=fresh,
            )
          )
      failure = _wait(procs, timeout, may_die)
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
      for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
          p.wait(timeout=30)
    outputs = [log.read_text(errors='replace') for log in logs]
  if failure:
    report = '\n'.join(
      f'--- process {i} (exit {p.returncode}), last {REPORT_LINES} lines ---\n'
      + '\n'.join(out.splitlines()[-REPORT_LINES:])
      for i, (p, out) in enumerate(zip(procs, outputs, strict=True))
    )
    raise WorkerError(f'{failure}\n{report}')
  return outputs


def _start(argv: list[str], *, env: dict[str, str], log, fresh: bool):
  """`python ARGV` writing to `log`: a `Popen`, or a warm fork (a `Case`)."""
  if fresh:
    return subprocess.Popen(
      [sys.executable, *argv],
      env=env,
      cwd=processes.REPO_ROOT,
      stdout=log,
      stderr=subprocess.STDOUT,
      stdin=subprocess.DEVNULL,
    )
  from support import warm

  return warm.shared().start(
    *argv,
    cwd=processes.REPO_ROOT,
    env=env,
    stdout=log,
    stderr=subprocess.STDOUT,
  )


def _wait(
  procs: Sequence[subprocess.Popen[bytes]],
  timeout: float,
  may_die: Collection[int] = (),
) -> str:
  """Waits for all processes; returns '' or why the run failed."""
  deadline = time.monotonic() + timeout
  while True:
    codes = [p.poll() for p in procs]
    failed = [
      i for i, c in enumerate(codes) if c not in (None, 0) and i not in may_die
    ]
    if failed:
      return f'worker(s) {failed} failed; killed the others'
    if all(
      c == 0 or (c is not None and i in may_die) for i, c in enumerate(codes)
    ):
      return ''
    if time.monotonic() > deadline:
      running = [i for i, c in enumerate(codes) if c is None]
      return f'timed out after {timeout} s; worker(s) {running} still running'
    time.sleep(0.1)


def initialize_jax() -> None:
  """In a worker: starts `jax.distributed` from the environment.

  Call it before anything else touches JAX.
  """
  import jax

  num_devices = int(os.environ[DEVICES_ENV])
  jax.config.update('jax_num_cpu_devices', num_devices)
  coordinator = os.environ[COORDINATOR_ENV]
  jax.distributed.initialize(
    coordinator_address=coordinator,
    num_processes=int(os.environ[NUM_PROCESSES_ENV]),
    process_id=int(os.environ[PROCESS_ID_ENV]),
    coordinator_bind_address=coordinator,
  )
  if jax.local_device_count() != num_devices:
    raise RuntimeError(
      f'Expected {num_devices} local CPU devices, got '
      f'{jax.local_device_count()}.'
    )


def die_when(pattern: str) -> None:
  """Worker side: kills this process the moment a file matching `pattern` exists.

  A thread polls every half millisecond; SIGKILL leaves nothing to clean up,
  as a machine's failure would.
  """

  def watch() -> None:
    while not glob.glob(pattern):
      time.sleep(0.0005)
    os.kill(os.getpid(), signal.SIGKILL)

  threading.Thread(target=watch, daemon=True).start()


def zeros_model() -> object:
  """In a worker: `nnx.Dict(w=(8, 16), b=(16,))` of zeros on a (2, N) mesh
  of all processes' devices, `w` over ('data', 'model'), `b` replicated
  (the checkpoint manager's workers)."""
  import jax
  import numpy as np
  from flax import nnx
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((2, jax.device_count() // 2), ('data', 'model'))

  def placed(value, spec):
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(
      value.shape, sharding, lambda i: value[i]
    )

  return nnx.Dict(
    w=nnx.Param(placed(np.zeros((8, 16), np.float32), P('data', 'model'))),
    b=nnx.Param(placed(np.zeros((16,), np.float32), P())),
  )
