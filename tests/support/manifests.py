"""A checkpoint's manifest (``flax_dtensor.json``), edited as the tests
that damage it or write it as an older version did, and the JSON values a
fuzzed one holds."""

import base64
import contextlib
import json
import os

import numpy as np
import pytest

FILE = 'flax_dtensor.json'


def edit(path, change) -> None:
  """Rewrites the manifest of the checkpoint at `path` with `change(meta)`
  applied to it."""
  file = os.path.join(path, FILE)
  with open(file) as f:
    meta = json.load(f)
  change(meta)
  with open(file, 'w') as f:
    json.dump(meta, f)


@contextlib.contextmanager
def writing_version(version: int):
  """Exports written inside are written as that version's writer wrote
  them: its version number and its checksum (CRC-32 before version 5)."""
  from flax_dtensor.dtensor._format import _model

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(_model, 'VERSION', version)
    yield


def as_version_3(meta):
  """`meta`, a version 4 manifest (changed in place, and returned), as
  versions before 4 wrote it: a record per shard, its index and its
  CRC-32."""
  if meta['version'] != 4:
    raise ValueError(f'a version 4 manifest, not {meta["version"]}')
  meta['version'] = 3
  for var in meta['variables']:
    shape, blocks = var['shape'], var['shards']['blocks']
    steps = [n // b for n, b in zip(shape, blocks, strict=True)]
    crcs = np.frombuffer(base64.b64decode(var['shards']['crc32']), '<u4')
    var['shards'] = [
      {
        'index': [[k * s, (k + 1) * s] for k, s in zip(i, steps, strict=True)],
        'crc32': int(crc),
      }
      for i, crc in zip(np.ndindex(*blocks), crcs, strict=True)
    ]
  return meta


def json_values(numbers, paths, *, text_size: int, max_leaves: int):
  """A Hypothesis strategy: JSON values as a crafted manifest may hold them
  (None, booleans, huge integers, `numbers`, any float, text of up to
  `text_size` characters, `paths`), nested in lists and dicts."""
  import hypothesis.strategies as st

  leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from(numbers)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=text_size)
    | st.sampled_from(paths)
  )
  return st.recursive(
    leaves,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c),
    max_leaves=max_leaves,
  )
