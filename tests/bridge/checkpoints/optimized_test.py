"""Restores refuse what they must under `python -O` too.

A check of untrusted input that is an `assert` vanishes under `python -O`:
a manifest missing a shard's record would restore uninitialized memory as
values. One process (workers/optimized_restore.py) compiles flax_dtensor
as `-O` does, with no `assert` (JAX, Flax and TensorFlow load as they are:
a real `python -O` recompiles all of them, half a minute more), and runs
the restore cases: intact checkpoints come back bit for bit, onto the saved
layout and another, from a version 5 manifest and a version 3 one (made
from what version 4 wrote); a shard record removed or its index changed
(version 3), a checksum removed or changed, or blocks that are not the
layout's (version 5), are refused in our words, the target unchanged.
"""

import re

import pytest
from support import processes

pytest.importorskip('tensorflow')

WORKER = processes.WORKERS_DIR / 'optimized_restore.py'

_MALFORMED = (
  r"MalformedExportError: '.*/flax_dtensor\.json' is not a valid "
  r'flax_dtensor manifest: '
)
EXPECTED = {
  'asserts stripped': True,
  'intact': 'exact',
  'intact onto another layout': 'exact',
  'v3 intact': 'exact',
  'v3 a shard record removed': _MALFORMED
  + r'the shards recorded for a do not cover \[4:8, 4:8\]',
  'v3 a shard index moved onto another': _MALFORMED
  + r'the shards recorded for a record the block \[4:8, 8:12\] twice',
  'v3 a shard index off the grid': _MALFORMED
  + r'the shards recorded for a are not the equal blocks of a grid',
  'v5 a shard checksum removed': _MALFORMED
  + r'a has 7 shard checksums, where its layout .* implies 8 shards',
  'v5 a shard checksum changed': r"DamagedExportError: The export at '.*' "
  r'is damaged: a\[4:8, 4:8\] read back with CRC-32C [0-9a-f]{8}, recorded',
  'v5 blocks changed': _MALFORMED
  + r'the shards of a are \[4, 2\] blocks, where its layout',
}


def test_restores_compiled_as_python_dash_o(tmp_path):
  out = processes.run_python(WORKER, tmp_path)
  result = processes.result(out.stdout, context=out.stderr[-3000:])
  assert result.keys() == EXPECTED.keys()
  assert result['asserts stripped'] is True
  for case, expected in EXPECTED.items():
    if isinstance(expected, str):
      got = result[case]
      assert re.match(expected, got), (case, got)
      assert 'TARGET CHANGED' not in got, case
