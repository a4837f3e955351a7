"""Runs across process counts, each met once per test session.

- `two_processes`: 2 local processes with 4 CPU devices each, set up with
  no `DTENSOR_*` variable (`initialize()` sets them from JAX), save one
  model in the background (`blocking=False`) while the caller donates its
  arrays, save it blocking beside a pending background save, restore a
  path with a save pending, and exit with one pending.
- `four_processes`: 4 processes with 2 devices each restore that
  checkpoint onto another mesh shape and onto another layout (counting the
  bytes each reads), save it in the background, export a SavedModel, and
  then overwrite the checkpoint in the background while process 2 is
  killed.

The values are a function of the variable and the version only
(`values`), so any process checks its own shards against them bit for bit
(`mismatched`). `multiprocess_scale_test.py` and
`multiprocess_faults_test.py` check what the runs report and what they
left on disk; `bad_input_cases.py` shows the dead peer's message on the
troubleshooting page. So nothing here imports pytest, and JAX only in the
functions that build and check models.
"""

from __future__ import annotations

import atexit
import functools
import pathlib
import shutil
import tempfile
from typing import Any

import ml_dtypes
import numpy as np

from support import multiprocess_util, processes

TIMEOUT = 600
WORKER = processes.WORKERS_DIR / '_mp_worker_scale.py'
# The dead peer's bound in the four-process run (as fault_runs.PEER_TIMEOUT).
PEER_TIMEOUT = 10
# Killed in the four-process run's last save.
DEAD = 2

# {name: (global shape, dtype, mesh axes of each dimension)}.
VARIABLES = {
  # Saved as 8 shards of 1 MiB: big beside TF's 1 MiB read buffer, so the
  # bytes a restore reads show which shards it read.
  'w': ((1024, 2048), 'float32', ('data', 'model')),
  'e': ((512, 128), 'bfloat16', ('model', 'data')),
  'h': ((128, 256), 'float16', ('data', None)),  # Stored widened.
  'c': ((64, 32), 'uint32', (('data', 'model'), None)),  # Widened, fused.
  'r': ((1024,), 'float32', (None,)),  # Replicated on every device.
  'b': ((256,), 'int8', ('model',)),
  's': ((), 'int32', ()),
}
# The layout each dimension takes in the restores onto "another layout".
SWAPPED = {
  name: tuple(reversed(axes)) if len(axes) == 2 else axes
  for name, (_, _, axes) in VARIABLES.items()
}


def dtype(name: str) -> np.dtype:
  return np.dtype(getattr(ml_dtypes, name, None) or name)


def values(version: int) -> dict[str, np.ndarray]:
  """The global value of each variable at `version`."""
  out = {}
  for i, (name, (shape, kind, _)) in enumerate(VARIABLES.items()):
    n = int(np.prod(shape, dtype=np.int64))
    raw = np.arange(n, dtype=np.float64) * 0.37 + 1000 * version + i
    if dtype(kind).kind in 'iu':
      raw = np.arange(n, dtype=np.int64) * 7 + 100 * version + i
    out[name] = raw.astype(dtype(kind)).reshape(shape)
  return out


def model(mesh: Any, version: int, layout: dict[str, Any] | None = None):
  """The model at `version` on `mesh`, each variable laid out as `layout`
  says (else as `VARIABLES` does), built from this process's slices."""
  import jax
  from flax import nnx
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  params = {}
  for name, full in values(version).items():
    axes = (layout or {}).get(name, VARIABLES[name][2])
    params[name] = nnx.Param(
      jax.make_array_from_callback(
        full.shape,
        NamedSharding(mesh, P(*axes)),
        lambda index, full=full: np.asarray(full[index]),
      )
    )
  return _model_class()(params)


@functools.cache
def _model_class() -> type:
  from flax import nnx

  class Model(nnx.Module):
    """The variables of `VARIABLES`, and a forward pass to serve."""

    def __init__(self, params):
      for name, param in params.items():
        setattr(self, name, param)

    def __call__(self, x):
      return x @ self.w[...]

  return Model


def mismatched(module: Any, version: int) -> list[str]:
  """The variables whose shards here differ from `version`, bit for bit."""
  want = values(version)
  out = []
  for name in VARIABLES:
    value = getattr(module, name)[...]
    for shard in value.addressable_shards:
      got = np.asarray(shard.data)
      expected = np.asarray(want[name][shard.index])
      if got.dtype != expected.dtype or got.tobytes() != expected.tobytes():
        out.append(name)
        break
  return out


def held(module: Any, name: str) -> list[list[list[int]]]:
  """The global slices of variable `name` this process's devices hold."""
  value = getattr(module, name)[...]
  shape = value.shape
  return sorted(
    {
      tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
      for index in value.sharding.addressable_devices_indices_map(
        shape
      ).values()
    }
  )


def rchar() -> int:
  """Bytes this process has read with read() and pread() so far (Linux)."""
  with open('/proc/self/io') as f:
    for line in f:
      if line.startswith('rchar:'):
        return int(line.split()[1])
  raise RuntimeError('no rchar in /proc/self/io')


def shard_bytes(manifest: dict[str, Any], name: str, slices: Any) -> int:
  """Bytes of variable `name`'s saved shards meeting any of `slices`.

  From the checkpoint's manifest (the JSON): each shard's volume times the
  stored dtype's size. `slices=None` counts every shard.
  """
  (record,) = [v for v in manifest['variables'] if v['path'] == [name]]
  size = dtype(record['stored_dtype']).itemsize
  # Version 4: the blocks of a grid (version 3 listed each shard).
  blocks = record['shards']['blocks']
  steps = [n // b for n, b in zip(record['shape'], blocks, strict=True)]
  total = 0
  for coords in np.ndindex(*blocks):
    index = [(k * s, (k + 1) * s) for k, s in zip(coords, steps, strict=True)]
    if slices is None or any(
      all(
        max(a, c) < min(b, d) for (a, b), (c, d) in zip(index, s, strict=True)
      )
      for s in slices
    ):
      total += size * int(np.prod([b - a for a, b in index], dtype=np.int64))
  return total


def _scratch(prefix: str) -> str:
  path = tempfile.mkdtemp(prefix=prefix)
  atexit.register(shutil.rmtree, path, True)
  return path


def _run(root: str, count: int, role: str, **kwargs) -> dict[str, Any]:
  """`count` workers of `role` on the 8 devices, in `root`: {'root',
  'results'}, each process's RESULT lines merged (by process id)."""
  outputs = multiprocess_util.run_workers(
    WORKER,
    count,
    args=[root, role],
    timeout=TIMEOUT,
    devices_per_process=8 // count,
    dtensor_env=False,
    **kwargs,
  )
  results = [
    processes.result(text, merge=True, context=f'(process {i})')
    for i, text in enumerate(outputs)
  ]
  return {'root': root, 'results': results}


@functools.cache
def two_processes() -> dict[str, Any]:
  """The two-process run: {'root', 'results' (per process), 'seconds'}."""
  return _run(_scratch('fdt_two_'), 2, 'two')


@functools.cache
def four_processes() -> dict[str, Any]:
  """The four-process run, on `two_processes`'s checkpoint."""
  two = two_processes()
  root = _scratch('fdt_four_')
  shutil.copytree(pathlib.Path(two['root'], 'c2'), pathlib.Path(root, 'c2'))
  return _run(
    root,
    4,
    'four',
    env={'FLAX_DTENSOR_PEER_TIMEOUT': str(PEER_TIMEOUT)},
    may_die=[DEAD],
  )
