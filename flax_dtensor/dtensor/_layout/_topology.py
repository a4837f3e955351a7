"""TF DTensor's set-up, mirroring this process's JAX topology.

`initialize` gives TF one logical CPU device per local JAX device and one
DTensor client per JAX process (described by JAX when the ``DTENSOR_*``
variables are unset: `_client_env_from_jax`); `shutdown` undoes it;
`require_initialized` guards every conversion.
"""

from __future__ import annotations

import os
import socket
import threading
import warnings
from collections.abc import Callable
from typing import Any

import jax
from jax._src import distributed  # The client; JAX has no public accessor.

from flax_dtensor import _errors
from flax_dtensor.dtensor import _processes, _tf

NOT_INITIALIZED_MSG = (
  'TF DTensor is not initialized: expected flax_dtensor.dtensor.initialize() '
  'to have been called. Call it once per process, before any other '
  'TensorFlow operation (it sets up one TF logical CPU device per local JAX '
  'device).'
)
_ENV_HELP = (
  'In a multi-process job, call jax.distributed.initialize() before '
  'flax_dtensor.dtensor.initialize(), and leave DTENSOR_JOBS, '
  'DTENSOR_CLIENT_ID and DTENSOR_JOB_NAME unset: initialize() then sets '
  'them from JAX. To set them yourself, set, in every process and before '
  'initialize(): DTENSOR_JOBS to a '
  'comma-separated list of one free host:port per JAX process, in '
  'jax.process_index() order (the same list everywhere); DTENSOR_CLIENT_ID to '
  'jax.process_index(); and DTENSOR_JOB_NAME to one job name shared by all '
  'processes (e.g. "worker"). For a single process leave DTENSOR_JOBS unset.'
)
# The DTENSOR_* job name `initialize` sets when it sets the variables.
JOB_NAME = 'worker'

_lock = threading.RLock()
_topology_checked = False
# Called by `shutdown`: caches of DTensor meshes built for the old context.
_on_shutdown: list[Callable[[], None]] = []


def initialize(*, reset_context: bool = False) -> None:
  """Sets up TF DTensor to mirror the JAX topology of this process.

  Configures one TF logical CPU device per local JAX device
  (`jax.local_device_count()`), and one DTensor client per JAX process.

  In a multi-process job, call `jax.distributed.initialize` first. When
  the environment variables `DTENSOR_JOBS`, `DTENSOR_CLIENT_ID` and
  `DTENSOR_JOB_NAME` are unset, this sets them: each process picks a free
  port on the address it reaches JAX's coordinator from (127.0.0.1 when
  the coordinator is local), and the processes exchange their addresses
  through JAX's coordination service (a process that never arrives is
  named after `FLAX_DTENSOR_PEER_TIMEOUT` seconds). Variables that are set
  win, and must describe the same processes as JAX (client id ==
  `jax.process_index()`). TF's DTensor server listens on that port on
  every interface of the host. SIGTERM stays with JAX's preemption service
  (``multihost_utils.reached_preemption_sync_point``), which TF's set-up
  would otherwise take over.

  Call it once per process, before any other TensorFlow operation (TF fixes
  its devices the first time it runs anything). Calling it again is a no-op.

  TensorFlow's C++ logging is kept to errors for the rest of the process
  (unless ``TF_CPP_MIN_LOG_LEVEL`` says otherwise), also when the program
  imported TensorFlow itself before: DTensor's "cache key lookup missed"
  lines then stay away. TF's start-up lines are dropped when flax_dtensor
  imports it; import TensorFlow after calling `initialize()` to keep them
  away too.

  Args:
    reset_context: Escape hatch when TensorFlow already ran something: reset
      TF's context first. Every TF object created before (tensors, variables)
      becomes invalid. Prefer calling `initialize()` earlier.

  Raises:
    DTensorInitializationError: If TF was already initialized (and
      `reset_context` is False), if the DTensor client environment does not
      match the JAX processes, or if DTensor was set up elsewhere with a
      different number of devices.
    ImportError: If TensorFlow is not installed.
  """
  global _topology_checked
  _processes.start()  # So that the other processes can tell this one lives.
  with _lock:
    # Before TF's import, so that the other processes wait less for this.
    reserved = None if is_initialized() else _client_env_from_jax()
    try:
      dt = _tf.dtensor()
      _tf.quiet_cpp_logs()
      if _tf.accelerator_util().is_initialized():
        _check_topology()
        return
      _check_client_env()
      if reserved is not None:  # TF's server binds the port now.
        reserved.close()
      try:
        with warnings.catch_warnings():
          # TF's reset path calls the deprecated `logging.warn`.
          warnings.simplefilter('ignore', DeprecationWarning)
          dt.initialize_accelerator_system(
            device_type='CPU',
            num_logical_cpu_devices=jax.local_device_count(),
            experimental_reset_context=reset_context,
          )
      except ValueError as e:
        if 'already been initialized' not in str(e):
          raise
        raise _errors.DTensorInitializationError(
          'TensorFlow was already initialized: expected '
          'flax_dtensor.dtensor.initialize() to run before any other '
          'TensorFlow operation, but TF already ran something (got '
          f'{str(e).splitlines()[0]!r}). Call '
          'flax_dtensor.dtensor.initialize() first thing in the program, or '
          'pass `reset_context=True` (invalidates every existing TF tensor '
          'and variable).'
        ) from e
    finally:
      if reserved is not None:
        reserved.close()
    _topology_checked = False
    _check_topology()
    _rearm_jax_preemption_notice()


def _rearm_jax_preemption_notice() -> None:
  """Gives SIGTERM back to JAX's preemption service, in a multi-process run.

  TF's multi-client set-up installs a SIGTERM handler of its own in C++,
  replacing the one `jax.distributed.initialize` installed: JAX's
  ``reached_preemption_sync_point`` (and so `CheckpointManager`'s
  ``save_on_preemption``) would then never hear of a preemption. A new
  preemption sync manager installs JAX's handler again. Nothing else runs
  yet, so no notice or step count is lost.
  """
  state = distributed.global_state
  if jax.process_count() == 1 or state.preemption_sync_manager is None:
    return
  state.preemption_sync_manager.shutdown()
  state.preemption_sync_manager = None
  state.initialize_preemption_sync_manager()


def shutdown() -> None:
  """Shuts TF DTensor down and forgets every DTensor mesh built here.

  Every TF object created under DTensor (tensors, variables) becomes invalid.
  `initialize()` may be called again afterwards.

  TensorFlow cannot shut DTensor down in multi-client mode (several
  processes): there, keep it initialized until the processes exit.

  Raises:
    DTensorInitializationError: If DTensor is not initialized, or runs in
      multi-client mode.
  """
  global _topology_checked
  with _lock:
    if not is_initialized():
      raise _errors.DTensorInitializationError(
        'flax_dtensor.dtensor.shutdown() was called but TF DTensor is not '
        'initialized: expected a prior flax_dtensor.dtensor.initialize(). '
        'Nothing to shut down.'
      )
    dt = _tf.dtensor()
    if dt.num_clients() > 1:
      raise _errors.DTensorInitializationError(
        'TF DTensor cannot be shut down in multi-client mode: expected a '
        f'single client, got {dt.num_clients()} clients '
        f'(DTENSOR_JOBS={os.environ.get("DTENSOR_JOBS")!r}). TensorFlow does '
        'not support it; keep DTensor initialized until the processes exit.'
      )
    dt.shutdown_accelerator_system()
    # TF keeps its DTensor device, bound to the context just reset; a later
    # initialize() would then fail every pack ('device:CUSTOM:0 unknown
    # device'). Drop it so that the next use creates a new one.
    api = _tf.internal('tensorflow.dtensor.python.api')
    reset = getattr(api, '_reset', None)
    if reset is not None:
      reset()
    _topology_checked = False
    for clear in _on_shutdown:
      clear()


def is_initialized() -> bool:
  """Returns whether TF DTensor is initialized (never imports TensorFlow)."""
  if not _tf.is_imported():
    return False
  return bool(_tf.accelerator_util().is_initialized())


def _client_env_from_jax() -> socket.socket | None:
  """Sets the DTENSOR_* variables from JAX's processes, if none is set.

  Multi-process only, and only when none of `DTENSOR_JOBS`,
  `DTENSOR_CLIENT_ID` and `DTENSOR_JOB_NAME` is set. Returns the socket
  holding this process's port until TF takes it, or None when nothing was
  set.

  Raises:
    DTensorInitializationError: If no address and port can be picked, or
      another process never arrives.
  """
  names = ('DTENSOR_JOBS', 'DTENSOR_CLIENT_ID', 'DTENSOR_JOB_NAME')
  if jax.process_count() == 1 or any(n in os.environ for n in names):
    return None
  coordinator = distributed.global_state.coordinator_address
  # Several JAX processes always come from jax.distributed.initialize().
  assert coordinator, 'several JAX processes without a coordinator'
  reserved, job = reserve(coordinator)
  try:
    jobs = _processes.exchange(
      'dtensor-jobs',
      job,
      what=(
        "the set-up of TF DTensor, which every process's "
        'flax_dtensor.dtensor.initialize() joins'
      ),
      aftermath='TF DTensor was not set up.',
      error=_errors.DTensorInitializationError,
    )
  except BaseException:
    reserved.close()
    raise
  os.environ['DTENSOR_JOBS'] = ','.join(jobs)
  os.environ['DTENSOR_CLIENT_ID'] = str(jax.process_index())
  os.environ['DTENSOR_JOB_NAME'] = JOB_NAME
  return reserved


def reserve(coordinator: str) -> tuple[socket.socket, str]:
  """A free port for TF DTensor, held open; its DTENSOR_JOBS entry.

  The address is the one this host reaches JAX's coordinator from (the
  local address of a UDP socket connected towards it: 127.0.0.1 for a
  coordinator on 127.0.0.1); the port is free on every interface, as TF's
  server listens on all of them. The socket holds the port until TF's
  server binds it (`SO_REUSEADDR`: TF may bind it once it is closed).

  Args:
    coordinator: JAX's coordinator address, 'host:port' ('[v6]:port').

  Raises:
    DTensorInitializationError: If the address cannot be found or no port
      bound.
  """
  host, _, port = coordinator.rpartition(':')
  held = None
  try:
    family, kind, proto, _, where = socket.getaddrinfo(
      host.strip('[]'), int(port), type=socket.SOCK_DGRAM
    )[0]
    with socket.socket(family, kind, proto) as probe:
      probe.connect(where)
      address = probe.getsockname()[0]
    held = socket.socket(family, socket.SOCK_STREAM)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(('::' if family == socket.AF_INET6 else '0.0.0.0', 0))
    held.listen(1)
  except (OSError, ValueError) as e:
    if held is not None:
      held.close()
    raise _errors.DTensorInitializationError(
      'TF DTensor needs an address and a free port in each process: '
      "expected to find this host's address towards JAX's coordinator "
      f'{coordinator!r} and a free port on it, got {type(e).__name__}: '
      f"{e}. Check jax.distributed.initialize()'s `coordinator_address`, "
      'or set the DTENSOR_* variables. ' + _ENV_HELP
    ) from e
  free = held.getsockname()[1]
  if family == socket.AF_INET6:
    return held, f'[{address}]:{free}'
  return held, f'{address}:{free}'


def _expected_clients() -> tuple[int, int, str | None, str | None]:
  jobs = os.environ.get('DTENSOR_JOBS')
  raw_id = os.environ.get('DTENSOR_CLIENT_ID')
  num_clients = len(jobs.split(',')) if jobs else 1
  try:
    client_id = int(raw_id) if raw_id is not None else 0
  except ValueError:
    client_id = -1
  return num_clients, client_id, jobs, raw_id


def _check_client_env() -> None:
  """Checks the DTENSOR_* environment against the JAX processes."""
  num_clients, client_id, jobs, raw_id = _expected_clients()
  if jobs is not None and not jobs.strip():
    raise _errors.DTensorInitializationError(
      'DTENSOR_JOBS is set but empty: expected it unset (one process) or a '
      f'list of {jax.process_count()} host:port entries, got {jobs!r}. '
      + _ENV_HELP
    )
  if num_clients != jax.process_count() or client_id != jax.process_index():
    raise _errors.DTensorInitializationError(
      'TF DTensor must have one client per JAX process: expected '
      f'{jax.process_count()} DTensor client(s) and client id '
      f'{jax.process_index()} (jax.process_count() and '
      f'jax.process_index()), got {num_clients} client(s) from '
      f'DTENSOR_JOBS={jobs!r} and client id {raw_id!r} from '
      f'DTENSOR_CLIENT_ID (DTENSOR_JOB_NAME='
      f'{os.environ.get("DTENSOR_JOB_NAME")!r}). ' + _ENV_HELP
    )


def _check_topology() -> None:
  """Checks that initialized DTensor mirrors the JAX topology (cached)."""
  global _topology_checked
  if _topology_checked:
    return
  dt = _tf.dtensor()
  num_tf = dt.num_local_devices('CPU')
  if num_tf != jax.local_device_count():
    raise _errors.DTensorInitializationError(
      'TF DTensor must have one logical CPU device per local JAX device: '
      f'expected {jax.local_device_count()} (jax.local_device_count()), got '
      f'{num_tf}. DTensor was probably initialized by other code; call '
      'flax_dtensor.dtensor.initialize() instead, before any other '
      'TensorFlow operation.'
    )
  if dt.num_clients() != jax.process_count() or (
    dt.client_id() != jax.process_index()
  ):
    raise _errors.DTensorInitializationError(
      'TF DTensor must have one client per JAX process: expected '
      f'{jax.process_count()} client(s) and client id '
      f'{jax.process_index()}, got {dt.num_clients()} client(s) and client '
      f'id {dt.client_id()}. ' + _ENV_HELP
    )
  _topology_checked = True


def require_initialized() -> Any:
  """Returns the dtensor module, or raises if DTensor is not set up."""
  if not is_initialized():
    raise _errors.DTensorInitializationError(NOT_INITIALIZED_MSG)
  with _lock:
    _check_topology()
  return _tf.dtensor()
