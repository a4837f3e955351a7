"""Worker of optimized_test.py: restores with flax_dtensor compiled as -O.

Usage: optimized_restore.py OUT_DIR. Before flax_dtensor is imported, an
import hook compiles every module of the package as `python -O` does
(`compile(..., optimize=1)`: no `assert`, `__debug__` false), while JAX,
Flax and TensorFlow load as they are (a real `python -O` would recompile
all of them, half a minute more). Then it saves a checkpoint of two
sharded variables and restores it, intact and with its manifest damaged,
and prints one line 'RESULT {case: outcome}': 'exact' where the values
came back bit for bit, else the error's class and message.
"""

# ruff: noqa: E402
import importlib.machinery
import sys


class _Optimized(importlib.machinery.SourceFileLoader):
  """Compiles a module's source as `python -O` would, ignoring caches."""

  def get_code(self, fullname):
    source = self.get_data(self.path)
    return compile(source, self.path, 'exec', dont_inherit=True, optimize=1)


class _Finder:
  """Finds flax_dtensor's modules as usual, loaded by `_Optimized`."""

  @classmethod
  def find_spec(cls, name, path=None, target=None):
    if name != 'flax_dtensor' and not name.startswith('flax_dtensor.'):
      return None
    spec = importlib.machinery.PathFinder.find_spec(name, path, target)
    if spec is not None and isinstance(
      spec.loader, importlib.machinery.SourceFileLoader
    ):
      spec.loader = _Optimized(spec.loader.name, spec.loader.path)
    return spec


sys.meta_path.insert(0, _Finder)

import base64
import json
import os
import shutil

import jax

jax.config.update('jax_num_cpu_devices', 8)

import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_dtensor as fdt
import flax_dtensor.dtensor as fdt_tf
from flax_dtensor.dtensor._format import _model as _format
from flax_dtensor.dtensor._layout import _layouts

fdt_tf.initialize()

MANIFEST = 'flax_dtensor.json'


def _stripped():
  """Whether asserts are gone: a step of 2 passes `normalize_index`."""
  try:
    _layouts.normalize_index((slice(0, 8, 2),), (8,))
  except AssertionError:
    return False
  return _Optimized.__name__ in type(_layouts.__loader__).__name__


def _model(mesh, specs, seed):
  rng = np.random.default_rng(seed)
  return nnx.Dict(
    {
      name: nnx.Param(
        jax.device_put(
          rng.standard_normal((8, 16)).astype(np.float32),
          NamedSharding(mesh, spec),
        )
      )
      for name, spec in specs.items()
    }
  )


def _crcs(shards, key='crc32c'):
  return np.frombuffer(base64.b64decode(shards[key]), '<u4')


def _as_version_3(meta):
  """A version 4 manifest as versions before 4 wrote it: a record per
  shard."""
  if meta['version'] != 4:
    raise ValueError(f'a version 4 manifest, not {meta["version"]}')
  meta['version'] = 3
  for var in meta['variables']:
    shape, blocks = var['shape'], var['shards']['blocks']
    steps = [n // b for n, b in zip(shape, blocks, strict=True)]
    var['shards'] = [
      {
        'index': [[k * s, (k + 1) * s] for k, s in zip(i, steps, strict=True)],
        'crc32': int(crc),
      }
      for i, crc in zip(
        np.ndindex(*blocks), _crcs(var['shards'], 'crc32'), strict=True
      )
    ]


def _edit(case, meta):
  a = next(v for v in meta['variables'] if v['path'] == ['a'])
  if case.startswith('v3'):
    _as_version_3(meta)
  if case == 'v3 a shard record removed':
    del a['shards'][5]
  elif case == 'v3 a shard index moved onto another':
    a['shards'][5]['index'] = a['shards'][6]['index']
  elif case == 'v3 a shard index off the grid':
    a['shards'][5]['index'] = [[4, 8], [4, 9]]
  elif case == 'v5 a shard checksum removed':
    a['shards']['crc32c'] = base64.b64encode(
      _crcs(a['shards'])[:-1].tobytes()
    ).decode()
  elif case == 'v5 a shard checksum changed':
    crcs = _crcs(a['shards']).copy()
    crcs[5] ^= 1
    a['shards']['crc32c'] = base64.b64encode(crcs.tobytes()).decode()
  elif case == 'v5 blocks changed':
    a['shards']['blocks'] = [4, 2]


def main():
  out = sys.argv[1]
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  specs = {'a': P('data', 'model'), 'b': P('model', 'data')}
  saved = _model(mesh, specs, 0)
  expected = {k: np.asarray(v.get_value()) for k, v in saved.items()}
  path = fdt_tf.save_checkpoint(saved, os.path.join(out, 'saved'))
  # As version 4 wrote it (CRC-32): what version 3's manifest is made from.
  _format.VERSION = 4
  try:
    path_v4 = fdt_tf.save_checkpoint(saved, os.path.join(out, 'saved_v4'))
  finally:
    _format.VERSION = 5
  result = {'asserts stripped': _stripped()}
  cases = [
    'intact',
    'intact onto another layout',
    'v3 intact',
    'v3 a shard record removed',
    'v3 a shard index moved onto another',
    'v3 a shard index off the grid',
    'v5 a shard checksum removed',
    'v5 a shard checksum changed',
    'v5 blocks changed',
  ]
  for k, case in enumerate(cases):
    root = os.path.join(out, f'case{k}')
    shutil.copytree(path_v4 if case.startswith('v3') else path, root)
    with open(os.path.join(root, MANIFEST)) as f:
      meta = json.load(f)
    _edit(case, meta)
    with open(os.path.join(root, MANIFEST), 'w') as f:
      json.dump(meta, f)
    onto = specs
    if case == 'intact onto another layout':
      onto = {'a': P('model', 'data'), 'b': P(None, ('data', 'model'))}
    target = _model(mesh, onto, 1)
    before = {k: np.asarray(v.get_value()) for k, v in target.items()}
    try:
      fdt_tf.restore_checkpoint(root, target)
    except fdt.ExportError as e:
      unchanged = all(
        np.array_equal(np.asarray(v.get_value()), before[k])
        for k, v in target.items()
      )
      result[case] = f'{type(e).__name__}: {e}' + (
        '' if unchanged else ' (TARGET CHANGED)'
      )
      continue
    got = {k: np.asarray(v.get_value()) for k, v in target.items()}
    exact = all(got[k].tobytes() == expected[k].tobytes() for k in expected)
    result[case] = 'exact' if exact else 'WRONG VALUES'
  print('RESULT ' + json.dumps(result), flush=True)


if __name__ == '__main__':
  main()
