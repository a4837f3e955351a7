"""Real faults, each met once per test session in processes of its own.

- `full_disk`: a process whose file size is limited (`RLIMIT_FSIZE`, the
  write fails with EFBIG, no mount or root needed) saves over a checkpoint;
  the limit lands on the manifest, on TensorFlow's data files, and on a
  SavedModel.
- `no_space`: a process saves over a checkpoint on a small, nearly full
  tmpfs (ENOSPC), mounted in a mount namespace of its own (`unshare -rm`,
  where the system allows unprivileged user namespaces).
- `unwritable`: saves into a read-only parent directory, a parent that is a
  file, and over exports this user may not delete. Run as root, the process
  drops to user `nobody` after its setup (root may write anywhere).
- `dead_peer`: two processes save one checkpoint, and one of them is killed
  mid-save.
- `absent_peer`: two processes without `DTENSOR_*` variables, of which only
  process 0 calls `flax_dtensor.dtensor.initialize()`.
- `lagging_peer`: three processes with TF DTensor set up; process 1 is
  killed, and process 2 reaches the wait only after process 0 has failed
  and would have exited at once.
- `write_fault`: the command line's writes (`demo`'s, `export`'s run
  folder) under a file-size limit, into a read-only directory, and with
  Orbax refused by the OS, in forks of the warm pool
  (workers/write_faults.py).

Each returns what the processes reported; `faults_test.py` and
`multiprocess_faults_test.py` check what each fault left on disk, and
`bad_input_cases.py` shows the messages on the troubleshooting page. So
nothing here imports pytest.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import os
import pathlib
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

from support import multiprocess_util, processes

TIMEOUT = 400
NOBODY = 65534

_FULL_DISK = textwrap.dedent(
  """
  import hashlib, json, os, resource, shutil, signal, sys
  import jax
  jax.config.update('jax_num_cpu_devices', 8)
  # Under a file-size limit, an entry written to the run's shared
  # compilation cache would be cut short, and break every later reader.
  jax.config.update('jax_enable_compilation_cache', False)
  import jax.numpy as jnp
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P
  from flax_dtensor import dtensor as fdt_tf
  from flax_dtensor.dtensor import _tf

  fdt_tf.initialize()
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  root = sys.argv[1]
  path = os.path.join(root, 'ckpt')

  def model(version):
    # Many small variables: the manifest is the biggest file, in a blocking
    # save (a data file per device) and a background one (one per process).
    s = NamedSharding(mesh, P('data', 'model'))
    return nnx.Dict({
      f'layer{i}': nnx.Param(jax.device_put(
          jnp.full((8, 8), 1000 * version + i, jnp.float32), s))
      for i in range(256)})

  def files():
    out = {}
    for d, _, names in os.walk(root):
      for n in names:
        with open(os.path.join(d, n), 'rb') as f:
          out[os.path.relpath(os.path.join(d, n), root)] = (
              hashlib.sha256(f.read()).hexdigest())
    return out

  def sizes(path):
    return {n: os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)}

  probe = os.path.join(root, 'probe')
  fdt_tf.save_checkpoint(model(1), probe, blocking=False).wait()
  written = sizes(probe)
  shutil.rmtree(probe)
  fdt_tf.save_checkpoint(model(1), path)
  written = list(written.items()) + list(sizes(path).items())
  manifest = max(n for name, n in written if name == 'flax_dtensor.json')
  other = max(n for name, n in written if name != 'flax_dtensor.json')
  out = {'before': files(), 'manifest_bytes': manifest,
         'other_bytes': other, 'attempts': {}}
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

  def attempt(name, limit, save):
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
      save()
      error = None
    except Exception as e:
      chain, c = [], e
      while c is not None:
        chain.append([type(c).__name__, getattr(c, 'errno', None)])
        c = c.__cause__
      error = [type(e).__name__, str(e), chain]
    finally:
      resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
    out['attempts'][name] = {'limit': limit, 'error': error,
                             'listing': sorted(os.listdir(root)),
                             'files': files()}

  # Between the largest file TF writes and the manifest: only the
  # manifest's write fails.
  attempt('manifest', (manifest + other) // 2,
          lambda: fdt_tf.save_checkpoint(model(2), path, overwrite=True))
  # The same, saved in the background: `wait()` raises what the save did.
  attempt('manifest_async', (manifest + other) // 2,
          lambda: fdt_tf.save_checkpoint(
              model(2), path, overwrite=True, blocking=False).wait())
  tf = _tf.tf()
  attempt('saved_model', 4096, lambda: fdt_tf.save_saved_model(
      nnx.Linear(16, 16, rngs=nnx.Rngs(0)), os.path.join(root, 'sm'),
      input_signature=[tf.TensorSpec([None, 16])]))
  # Written as several bundles at once (64 KiB in parts of 1 KiB or more),
  # each past the limit: the failure of another thread's part is ours too.
  from flax_dtensor.dtensor._storage import _host_write
  part_bytes = _host_write.PART_BYTES
  _host_write.PART_BYTES = 1024
  attempt('data_parts', 4096,
          lambda: fdt_tf.save_checkpoint(model(2), path, overwrite=True))
  _host_write.PART_BYTES = part_bytes
  # Last: TF DTensor cancels every later TF op of a process whose sharded
  # write failed.
  attempt('data', 4096,
          lambda: fdt_tf.save_checkpoint(model(2), path, overwrite=True))
  print('RESULT ' + json.dumps(out))
  """
)

_NO_SPACE = textwrap.dedent(
  """
  import hashlib, json, os, subprocess, sys
  import jax
  jax.config.update('jax_num_cpu_devices', 8)
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P
  from flax_dtensor import dtensor as fdt_tf

  fs = os.path.join(sys.argv[1], 'fs')
  os.mkdir(fs)
  subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=4m', 'tmpfs', fs],
                 check=True)
  fdt_tf.initialize()
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  path = os.path.join(fs, 'ckpt')

  def model(version):
    s = NamedSharding(mesh, P('data', 'model'))
    return nnx.Dict({
      f'layer{i}': nnx.Param(jax.device_put(
          jnp.full((8, 64), 1000 * version + i, jnp.float32), s))
      for i in range(32)})

  def files():
    out = {}
    for d, _, names in os.walk(path):
      for n in names:
        with open(os.path.join(d, n), 'rb') as f:
          out[n] = hashlib.sha256(f.read()).hexdigest()
    return out

  fdt_tf.save_checkpoint(model(1), path)
  read = fdt_tf.read_checkpoint(path)
  restorable = all(
      np.array_equal(read[(f'layer{i}',)], np.full((8, 64), 1000 + i))
      for i in range(32))
  before = files()
  # Fill the filesystem up to 24 KiB: less than the new version's data.
  info = os.statvfs(fs)
  with open(os.path.join(fs, 'filler'), 'wb') as f:
    f.write(b'\\0' * (info.f_bavail * info.f_frsize - 24 * 1024))
  error = None
  try:
    fdt_tf.save_checkpoint(model(2), path, overwrite=True)
  except Exception as e:
    chain, c = [], e
    while c is not None:
      chain.append(type(c).__name__)
      c = c.__cause__
    error = [type(e).__name__, str(e), chain]
  info = os.statvfs(fs)
  print('RESULT ' + json.dumps({
      'restorable': restorable, 'before': before, 'after': files(),
      'listing': sorted(os.listdir(fs)), 'error': error, 'fs': fs,
      'free': info.f_bavail * info.f_frsize}))
  """
)

_UNWRITABLE = textwrap.dedent(
  """
  import json, os, sys
  import jax
  jax.config.update('jax_num_cpu_devices', 8)
  from flax import nnx
  from flax_dtensor import dtensor as fdt_tf
  from flax_dtensor.dtensor import _tf
  from flax_dtensor.dtensor._storage import _atomic
  from flax_dtensor.dtensor._format import _decode

  fdt_tf.initialize()
  tf = _tf.tf()
  base = sys.argv[1]
  model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
  spec = [tf.TensorSpec([None, 4])]
  at = lambda *p: os.path.join(base, *p)
  for name in ('ro', 'open', 'sticky'):
    os.mkdir(at(name))
  with open(at('a_file'), 'w') as f:
    f.write('precious')
  # Set up as this user; these saves also load every module a save needs.
  fdt_tf.save_checkpoint(model, at('open', 'ckpt'))
  fdt_tf.save_checkpoint(model, at('sticky', 'ckpt'))
  fdt_tf.save_saved_model(model, at('sm'), input_signature=spec)
  os.chmod(at('ro'), 0o555)
  os.chmod(at('open'), 0o777)
  os.chmod(at('sticky'), 0o1777)
  root = os.geteuid() == 0
  if root:  # Root may write anywhere: become another user.
    os.setgroups([])
    os.setgid(int(sys.argv[2]))
    os.setuid(int(sys.argv[2]))
  else:  # The export is this user's: make it undeletable instead.
    os.chmod(at('open', 'ckpt'), 0o555)
  print('READY', flush=True)
  sys.stdin.readline()  # The parent has taken its snapshot.
  attempts = {
    'read-only parent': lambda: fdt_tf.save_checkpoint(model, at('ro', 'c')),
    'read-only parent, SavedModel': lambda: fdt_tf.save_saved_model(
        model, at('ro', 'sm'), input_signature=spec),
    'read-only parent, export command': lambda: _atomic.all_or_nothing(
        at('ro', 'out'), ['checkpoint'], overwrite=False,
        is_export=_decode.is_export).__enter__(),
    'parent is a file': lambda: fdt_tf.save_checkpoint(
        model, at('a_file', 'c')),
    'not deletable': lambda: fdt_tf.save_checkpoint(
        model, at('open', 'ckpt'), overwrite=True),
  }
  if root:  # Only another user can own it.
    attempts['sticky parent'] = lambda: fdt_tf.save_checkpoint(
        model, at('sticky', 'ckpt'), overwrite=True)
  errors = {}
  for name, attempt in attempts.items():
    try:
      attempt()
      errors[name] = None
    except Exception as e:
      errors[name] = [type(e).__name__, str(e)]
  print('RESULT ' + json.dumps({'uid': os.geteuid(), 'errors': errors}))
  """
)


def _scratch(prefix: str) -> str:
  """A directory every user may enter, removed at exit."""
  path = tempfile.mkdtemp(prefix=prefix)
  os.chmod(path, 0o755)
  atexit.register(_remove_tree, path)
  return path


def _remove_tree(path: str) -> None:
  """Removes `path`, first making what the faults locked writable again."""
  for root, dirs, _ in os.walk(path):
    for d in dirs:
      os.chmod(os.path.join(root, d), 0o755)
  shutil.rmtree(path, ignore_errors=True)


def _run(script: str, *args: str) -> tuple[dict[str, Any], str]:
  """Runs `script` in a fork of the warm pool (its limits its own);
  returns its RESULT line's JSON and its whole stdout."""
  from support import warm

  proc = warm.shared().run_code(
    script, *args, timeout=TIMEOUT, cwd=processes.REPO_ROOT
  )
  return processes.checked_result(proc), proc.stdout


def snapshot(root: str) -> dict[str, list[Any]]:
  """Every entry under `root`: [type, mode, owner, size, SHA-256 of files]."""
  out = {}
  for directory, dirs, files in os.walk(root):
    for name in dirs + files:
      path = os.path.join(directory, name)
      info = os.lstat(path)
      digest = None
      if stat.S_ISREG(info.st_mode):
        with open(path, 'rb') as f:
          digest = hashlib.sha256(f.read()).hexdigest()
      out[os.path.relpath(path, root)] = [
        stat.filemode(info.st_mode),
        info.st_uid,
        info.st_size if digest else 0,
        digest,
      ]
  return out


@functools.cache
def full_disk() -> dict[str, Any]:
  """The full-disk run: {'root', 'before', 'attempts': {name: ...}, ...}."""
  root = _scratch('fdt_full_disk_')
  out, _ = _run(_FULL_DISK, root)
  out['root'] = root
  return out


def _can_unshare() -> str | None:
  """Why `unshare -rm` cannot run here, or None if it can."""
  if shutil.which('unshare') is None:
    return 'the unshare command is not installed'
  probe = processes.run(['unshare', '-rm', 'true'], timeout=60)
  if probe.returncode != 0:
    return f'unshare -rm fails here: {probe.stderr.strip()}'
  return None


@functools.cache
def no_space() -> dict[str, Any]:
  """The ENOSPC run, or {'unavailable': why} without mount namespaces."""
  why = _can_unshare()
  if why is not None:
    return {'unavailable': why}
  root = _scratch('fdt_no_space_')
  proc = processes.run(
    ['unshare', '-rm', sys.executable, '-c', _NO_SPACE, root],
    timeout=TIMEOUT,
    cwd=processes.REPO_ROOT,
  )
  return processes.checked_result(proc)


@functools.cache
def unwritable() -> dict[str, Any]:
  """The unwritable-places run: {'base', 'uid', 'errors', 'before', ...}.

  'before' is the tree as the child left it after its setup, 'after' as it
  is once the child is gone.
  """
  from support import warm

  base = _scratch('fdt_unwritable_')
  script = pathlib.Path(_scratch('fdt_unwritable_script_'), 'unwritable.py')
  script.write_text(_UNWRITABLE)
  before: dict[str, Any] = {}
  # A fork of the warm pool: it drops to `nobody` itself, after its setup.
  with tempfile.TemporaryFile() as err_file:
    proc = warm.shared().start(
      script,
      base,
      str(NOBODY),
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=err_file,
      env=processes.clean_env(),
      cwd=base,
    )
    try:
      with proc.stdout:
        line = proc.stdout.readline().decode()
        if line.strip() == 'READY':
          before = snapshot(base)
        with proc.stdin:
          proc.stdin.write(b'go\n')
        out = proc.stdout.read().decode()
      proc.wait(TIMEOUT)
    finally:
      if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=60)
    err_file.seek(0)
    err = err_file.read().decode(errors='replace')
  if proc.returncode != 0 or not before:
    raise RuntimeError(f'exit {proc.returncode}:\n{out[-3000:]}\n{err[-5000:]}')
  result = processes.result(out, context=err[-5000:])
  result.update(base=base, before=before, after=snapshot(base))
  return result


@functools.cache
def dead_peer(moment: str) -> dict[str, Any]:
  """Process 1 of 2 killed at `moment` (see _mp_worker_dead_peer.py).

  Returns process 0's RESULT (its error, the listing after) and 'root',
  where the checkpoint is.
  """
  root = _scratch('fdt_dead_peer_')
  outputs = multiprocess_util.run_workers(
    processes.WORKERS_DIR / '_mp_worker_dead_peer.py',
    2,
    args=[root, moment],
    timeout=TIMEOUT,
    env={'FLAX_DTENSOR_PEER_TIMEOUT': str(PEER_TIMEOUT)},
    may_die=[1],
  )
  result = processes.result(outputs[0], context='(process 0)')
  result['root'] = root
  return result


# The dead-peer run's bound: well above a live process's heartbeat interval
# (a tenth of it) on a loaded machine, well below JAX's own 100 s.
PEER_TIMEOUT = 10


_ABSENT_PEER = textwrap.dedent(
  """
  import json, os, pathlib, sys, time
  from support import multiprocess_util
  multiprocess_util.initialize_jax()
  import jax
  done = pathlib.Path(sys.argv[1], 'done')
  if jax.process_index() == 1:  # Never sets DTensor up.
    while not done.exists():
      time.sleep(0.05)
    os._exit(0)
  import flax_dtensor as fdt
  from flax_dtensor import dtensor as fdt_tf
  start = time.monotonic()
  result = {'error': None}
  try:
    fdt_tf.initialize()
  except fdt.DTensorInitializationError as e:
    result['error'] = str(e)
  result['seconds'] = time.monotonic() - start
  result['tensorflow'] = 'tensorflow' in sys.modules
  print('RESULT ' + json.dumps(result), flush=True)
  done.touch()
  os._exit(0)
  """
)
# The absent peer's bound: short, as nothing but that wait is measured.
ABSENT_PEER_TIMEOUT = 3


@functools.cache
def absent_peer() -> dict[str, Any]:
  """Process 0's RESULT: the error of its `initialize()`, and how long."""
  root = _scratch('fdt_absent_peer_')
  script = pathlib.Path(root, 'worker.py')
  script.write_text(_ABSENT_PEER)
  outputs = multiprocess_util.run_workers(
    script,
    2,
    args=[root],
    timeout=TIMEOUT,
    env={'FLAX_DTENSOR_PEER_TIMEOUT': str(ABSENT_PEER_TIMEOUT)},
    dtensor_env=False,
    fresh=True,  # What it imports is tested: no TensorFlow yet.
  )
  return processes.result(outputs[0], context='(process 0)')


_LAGGING_PEER = textwrap.dedent(
  """
  import json, os, signal, sys, time
  from support import multiprocess_util
  multiprocess_util.initialize_jax()
  import jax
  from flax_dtensor import dtensor as fdt_tf
  from flax_dtensor.dtensor import _processes
  fdt_tf.initialize()  # TF DTensor's coordination service watches too.
  _processes.sync('ready')
  me = jax.process_index()
  if me == 1:
    os.kill(os.getpid(), signal.SIGKILL)
  client = jax._src.distributed.global_state.client
  start = time.monotonic()
  result = {'process': me, 'error': None, 'kind': None}
  try:
    with _processes.session('the wait', 'Nothing changed.'):
      if me == 2:  # Busy elsewhere until process 0 has failed.
        failed = _processes._local.current.prefix + '/failed/'
        while not client.key_value_dir_get(failed):
          time.sleep(0.05)
        time.sleep(1)
      _processes.sync('all')
  except Exception as e:
    result['error'], result['kind'] = str(e), type(e).__name__
  result['seconds'] = time.monotonic() - start
  print('RESULT ' + json.dumps(result), flush=True)
  os._exit(0)  # At once, as a process that fails may (JAX's atexit waits).
  """
)


@functools.cache
def lagging_peer() -> list[dict[str, Any]]:
  """The RESULTs of processes 0 and 2 (a run whose process 2 died raises)."""
  root = _scratch('fdt_lagging_peer_')
  script = pathlib.Path(root, 'worker.py')
  script.write_text(_LAGGING_PEER)
  outputs = multiprocess_util.run_workers(
    script,
    3,
    args=[root],
    timeout=TIMEOUT,
    devices_per_process=1,
    env={'FLAX_DTENSOR_PEER_TIMEOUT': str(PEER_TIMEOUT)},
    may_die=[1],
  )
  return [
    processes.result(outputs[i], context=f'(process {i})') for i in (0, 2)
  ]


# The command line's writes
# ------------------------------------------------------------------------------

WRITE_FAULTS = ('demo-full', 'export-full', 'demo-unwritable', 'orbax-denied')
_write_faults: dict[str, dict[str, Any]] = {}
# A traceback's last line, 'module.KindError: text'. Not anchored at the
# line's start: another thread's unfinished output (a library printing its
# own traceback, a piece at a time, as the write fails) may come before it.
_TRACEBACK_ERROR = re.compile(r'(\w+Error): (.*)$', re.M)


@contextlib.contextmanager
def _enterable_by_others() -> Iterator[None]:
  """Lets another user enter the folders above this checkout and its
  Python (a clone in a folder only its owner may enter, as `mktemp -d`
  makes), while a fault run acts as that user; the modes come back after.
  Only as root, who alone becomes another user there."""
  if os.geteuid() != 0:
    yield
    return
  import flax_dtensor

  changed = {}
  for start in (pathlib.Path(flax_dtensor.__file__), pathlib.Path(sys.prefix)):
    for folder in start.resolve().parents:
      mode = folder.stat().st_mode
      if not mode & stat.S_IXOTH and folder not in changed:
        changed[folder] = stat.S_IMODE(mode)
        os.chmod(folder, stat.S_IMODE(mode) | stat.S_IXOTH)
  try:
    yield
  finally:
    for folder, mode in changed.items():
      os.chmod(folder, mode)


def _run_piped(pool: Any, *args: Any) -> subprocess.CompletedProcess[str]:
  """`pool.run(*args)`, its output read through pipes, not files.

  A script under a file-size limit (`RLIMIT_FSIZE`) would cut its own
  output short at the limit in a file (Orbax's threads alone can print
  64 KiB of tracebacks as the write fails), and the `error:` line with it;
  a pipe has no size.
  """
  case = pool.start(
    *args,
    stdin=subprocess.DEVNULL,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
  )
  read: dict[str, bytes] = {}
  readers = [
    threading.Thread(target=lambda n, f: read.setdefault(n, f.read()), args=a)
    for a in (('out', case.stdout), ('err', case.stderr))
  ]
  for reader in readers:
    reader.start()
  try:
    case.wait(TIMEOUT)
  finally:
    case.kill()
    for reader in readers:
      reader.join(60)
    case.stdout.close()
    case.stderr.close()
  return subprocess.CompletedProcess(
    case.args,
    case.returncode,
    read.get('out', b'').decode(errors='replace'),
    read.get('err', b'').decode(errors='replace'),
  )


def write_fault(pool: Any, fault: str) -> dict[str, Any]:
  """One fault of workers/write_faults.py, run once a process (a fork of
  `pool`): {'status', 'error': [type, text], 'stderr', 'root', 'after':
  the tree left}.

  The command line's error is the last exception of its traceback
  (``--debug``) and its `error:` line; `orbax-denied` reports its own.
  """
  if fault in _write_faults:
    return _write_faults[fault]
  from flax_dtensor.cli import _command

  root = pathlib.Path(_scratch(f'fdt_{fault}_'))
  with _enterable_by_others():
    proc = _run_piped(
      pool, processes.WORKERS_DIR / 'write_faults.py', fault, str(root)
    )
  found = {
    'status': proc.returncode,
    'stderr': proc.stderr,
    'root': root,
    'after': snapshot(str(root)),
  }
  if fault == 'orbax-denied':
    found['error'] = processes.checked_result(proc)['error']
  else:
    # The traceback's exception that an `error:` line tells (other
    # libraries print theirs as the write fails and as the process exits,
    # from their own threads, so a line of theirs may begin before ours).
    told = [
      [kind, text]
      for kind, text in _TRACEBACK_ERROR.findall(proc.stderr)
      if f'error: {_command.one_line(text)}\n' in proc.stderr
    ]
    found['error'] = told[-1] if told else None
  _write_faults[fault] = found
  return found
