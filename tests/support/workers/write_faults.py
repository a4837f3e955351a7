"""A write of the command line under one real fault, in a fork of the pool.

    python write_faults.py FAULT ROOT

Sets the fault up in ROOT, then:

- ``demo-full``, ``export-full``: runs ``flax-dtensor demo`` (``export`` of
  an Orbax checkpoint of the demo model, written first) with its
  ``--out`` in ROOT, under a file-size limit (`RLIMIT_FSIZE`, SIGXFSZ
  ignored: a write past it fails with EFBIG, as on a full disk);
- ``demo-unwritable``: runs ``flax-dtensor demo`` with its ``--out`` under
  a read-only directory, as a user who may not write there (root drops to
  ``nobody``, who owns nothing there);
- ``orbax-denied``: as that user, writes a run's folder
  (`_run_folder.writing`, what ``demo`` writes through) whose Orbax part
  is refused by the OS (its directory read-only).

The command line exits with its own status (its traceback shown:
``--debug``); ``orbax-denied`` prints ``RESULT {"error": [type, text]}``.
"""

import json
import os
import pathlib
import resource
import signal
import sys

NOBODY = 65534
LIMIT = 64 * 2**10  # Below the demo model's Orbax and TF data files.

fault, root = sys.argv[1], pathlib.Path(sys.argv[2])
root.mkdir(parents=True, exist_ok=True)
os.chdir(root)


def limit_file_size() -> None:
  # An entry written to the run's shared compilation cache under the limit
  # would be cut short, and break every later reader.
  import jax
  from jax._src import compilation_cache

  jax.config.update('jax_enable_compilation_cache', False)
  compilation_cache.reset_cache()  # Its use is decided once, else.
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.RLIM_INFINITY))


def become_another_user() -> None:
  """Root may write anywhere: become a user who owns nothing here."""
  if os.geteuid() == 0:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def read_only(name: str) -> pathlib.Path:
  path = root / name
  path.mkdir()
  os.chmod(path, 0o555)
  return path


def cli(*args: str) -> None:
  from flax_dtensor import cli

  cli.main([*args, '--debug'])


if fault == 'demo-full':
  limit_file_size()
  # No training steps saved: the faults of the run folder's own writes.
  cli(
    'demo',
    '--steps',
    '1',
    '--batch-size',
    '1',
    '--save-every',
    '0',
    '-q',
    '--out',
    'out',
  )
elif fault == 'export-full':
  import jax

  jax.config.update('jax_num_cpu_devices', 8)
  import orbax.checkpoint as ocp
  from flax import nnx

  from flax_dtensor.demo import model

  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(root / 'orbax', nnx.state(model.make_model()))
    checkpointer.wait_until_finished()
  limit_file_size()
  cli(
    'export',
    'flax_dtensor.demo.model:make_model',
    '--checkpoint',
    'orbax',
    '--out',
    'out',
  )
elif fault == 'demo-unwritable':
  read_only('ro')
  become_another_user()
  cli('demo', '--steps', '1', '--out', 'ro/sub/out')
elif fault == 'orbax-denied':
  import jax

  jax.config.update('jax_num_cpu_devices', 8)
  import orbax.checkpoint as ocp
  from flax import nnx

  from flax_dtensor.cli import _run_folder

  state = nnx.state(nnx.Linear(64, 64, rngs=nnx.Rngs(0)))
  os.chmod(root, 0o777)  # The other user's: the run's folder goes here.
  become_another_user()
  error = None
  try:
    with _run_folder.writing(root / 'out', needed=4 * 64 * 65) as tmp:
      (tmp / 'orbax').mkdir()
      os.chmod(tmp / 'orbax', 0o555)
      with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp / 'orbax' / 'state', state)
        checkpointer.wait_until_finished()
  except Exception as e:
    error = [type(e).__name__, str(e)]
  print('RESULT ' + json.dumps({'error': error}), flush=True)
  # Orbax's failed save thread keeps the interpreter from exiting (minutes).
  os._exit(0)
else:
  raise SystemExit(f'unknown fault {fault!r}')
