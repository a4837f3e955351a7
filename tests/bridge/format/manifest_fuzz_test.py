"""The manifest's reader, fuzzed: our error or a correct read, bounded.

The manifest is what grows with the devices, and every process reads it
before anything else: it must stand any bytes. Hypothesis starts from the
manifests of a real checkpoint (version 5; the same state saved as version
4 wrote it, and that as version 3 wrote it) and breaks them the ways files break and attackers write: truncations,
bytes inserted, values of another type, huge and negative numbers, floats,
deep nesting, duplicate keys, paths that climb out of the export, shard
grids and checksum counts that disagree with the layout, and checksum
strings that are not base64 of 4-byte CRCs. Each case goes through what
every reader does with a manifest before TensorFlow opens a file
(`_decode.read`; the check of the files, `inspect --verify`'s; the
regions a process would read and the checksums it would check), and must
either come back as the original document says or be refused with our
`ExportError`; within 1 s of CPU time and 64 MiB of Python memory; opening
nothing outside the export (an audit hook sees every `open`).

The suite runs the quick profile (100 cases); the thorough one runs 5,000
cases::

    HYPOTHESIS_PROFILE=thorough .venv/bin/python -m pytest \\
      tests/bridge/format/manifest_fuzz_test.py -p no:cacheprovider -n 0
"""

import base64
import concurrent.futures
import contextlib
import gc
import json
import os
import re
import shutil
import signal
import time
import tracemalloc

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support import manifests, opened, profiles

import flax_dtensor as fdt

pytest.importorskip('tensorflow')
fdt_tf = pytest.importorskip('flax_dtensor.dtensor')
from flax_dtensor.dtensor._format import _decode, _model, _verify  # noqa: E402
from flax_dtensor.dtensor._storage import _host_read  # noqa: E402

MANIFEST = _model.FILE
CPU_SECONDS = 1.0
MEMORY_BYTES = 64 * 2**20


@pytest.fixture(scope='module')
def export(tmp_path_factory):
  """(parent, the export, {version: its manifest as that version wrote it},
  {version: the export that manifest is of}).

  Version 5 is today's; version 4's the same state saved as its writer
  did (CRC-32); version 3's that manifest as version 3 wrote it.
  """
  base = tmp_path_factory.mktemp('fuzz')
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  rng = np.random.default_rng(0)
  state = nnx.Dict(
    {
      name: nnx.Param(
        jax.device_put(
          rng.standard_normal(shape).astype(np.float32),
          NamedSharding(mesh, spec),
        )
      )
      for name, shape, spec in (
        ('kernel', (8, 16), P('data', 'model')),
        ('fused', (16, 4), P(('data', 'model'))),
        ('bias', (16,), P()),
        ('scalar', (), P()),
      )
    }
  )
  path = fdt_tf.save_checkpoint(state, base / 'ckpt')
  with manifests.writing_version(4):
    old = fdt_tf.save_checkpoint(state, base / 'ckpt_v4')
  metas = {}
  for version, where in ((_model.VERSION, path), (4, old)):
    with open(os.path.join(where, MANIFEST)) as f:
      metas[version] = json.load(f)
  metas[3] = manifests.as_version_3(json.loads(json.dumps(metas[4])))
  assert sorted(m['version'] for m in metas.values()) == [3, 4, 5]
  return str(base), path, metas, {5: path, 4: old, 3: old}


# What to break, and how
# ------------------------------------------------------------------------------

EVIL_PATHS = [
  '../ckpt/ckpt.index',
  '../../etc/passwd',
  '/etc/passwd',
  'ckpt/../../x',
  './ckpt',
  'ckpt\0',
  'C:ckpt',
  'a\\..\\b',
  '',
  '.',
  '..',
  'ckpt.data-00000-of-00001/..',
]
HUGE = [
  -1,
  -(2**63),
  2**31,
  2**32,
  2**63,
  2**64,
  10**13,
  10**100,
]
_ANY = manifests.json_values(HUGE, EVIL_PATHS, text_size=8, max_leaves=6)


def _b64(crcs):
  return base64.b64encode(np.asarray(crcs, '<u4').tobytes()).decode()


def _crcs(text):
  return list(np.frombuffer(base64.b64decode(text), '<u4'))


def _pair(value):
  return (
    isinstance(value, list)
    and len(value) == 2
    and all(type(v) is int for v in value)
  )


def _is_b64(text):
  try:
    return (
      isinstance(text, str)
      and len(base64.b64decode(text, validate=True)) % 4 == 0
    )
  except ValueError:
    return False


@st.composite
def _shard_edit(draw, var):
  """Counts against the layout, and checksum strings that are not CRCs."""
  shards = var.get('shards') if isinstance(var, dict) else None
  if isinstance(shards, list):  # Version 3: a record per shard.
    op = draw(st.sampled_from(['drop', 'dup', 'move', 'index', 'many']))
    records = [r for r in shards if isinstance(r, dict)]
    if op == 'drop' and shards:
      del shards[draw(st.integers(0, len(shards) - 1))]
    elif op == 'dup' and records:
      shards.append(dict(draw(st.sampled_from(records))))
    elif op == 'move' and records:
      index = draw(st.sampled_from(records)).get('index')
      pairs = [p for p in index if _pair(p)] if isinstance(index, list) else []
      if pairs:
        draw(st.sampled_from(pairs))[draw(st.integers(0, 1))] += draw(
          st.sampled_from([-1, 1, 10**13, -(10**13)])
        )
    elif op == 'index' and records:
      draw(st.sampled_from(records))['index'] = draw(_ANY)
    elif op == 'many':
      # Many small records: a grid of thousands, or records that would
      # make one (a diagonal) if their product were allocated.
      n = draw(st.sampled_from([1000, 4096]))
      diagonal = draw(st.booleans())
      var['shape'] = [n, n if diagonal else 4]
      var['shards'] = [
        {'index': [[i, i + 1], [i, i + 1] if diagonal else [0, 4]], 'crc32': 0}
        for i in range(n)
      ]
    return
  if not isinstance(shards, dict):
    return
  sharding = var.get('sharding')
  op = draw(
    st.sampled_from(
      ['blocks', 'shorter', 'longer', 'garbage', 'not ascii', 'huge', 'spec']
    )
  )
  if op in ('huge', 'spec') and not (
    isinstance(sharding, dict) and isinstance(sharding.get('mesh'), dict)
  ):
    return
  # The grid's checksums: 'crc32c' from version 5, 'crc32' before.
  key = 'crc32' if 'crc32' in shards else 'crc32c'
  if op == 'blocks':
    shards['blocks'] = draw(
      st.lists(st.sampled_from([0, 1, 2, 3, 4, 8, *HUGE]), max_size=3)
    )
  elif op in ('shorter', 'longer') and _is_b64(shards.get(key)):
    crcs = _crcs(shards[key])
    crcs = crcs[:-1] if op == 'shorter' else [*crcs, 7]
    shards[key] = _b64(crcs)
  elif op == 'garbage' and isinstance(shards.get(key), str):
    text = shards[key]
    at = draw(st.integers(0, len(text)))
    shards[key] = (
      text[:at]
      + draw(st.sampled_from(['=', '==', '!', ' ', 'A', '\n']))
      + text[at:]
    )
  elif op == 'not ascii':
    shards[key] = draw(st.text(min_size=1, max_size=12))
  elif op == 'huge':
    # A layout claiming thousands of devices, with few checksums.
    sharding['mesh']['axis_sizes'] = [
      draw(st.sampled_from([4096, 2**31, 10**13])),
      4,
    ]
  elif op == 'spec':
    sharding['spec'] = draw(
      st.sampled_from(
        [[['data'], ['data']], [['nope'], []], [['data', 'model']], [], [[]]]
      )
    )


@st.composite
def broken(draw, metas):
  """A manifest broken by one to three edits, as the bytes to write."""
  meta = json.loads(json.dumps(draw(st.sampled_from(list(metas.values())))))
  for _ in range(draw(st.integers(1, 3))):
    kind = draw(st.sampled_from(['shards', 'shards', 'node', 'path', 'none']))
    variables = meta.get('variables')
    if kind == 'shards' and isinstance(variables, list) and variables:
      draw(_shard_edit(draw(st.sampled_from(variables))))
    elif kind == 'path' and isinstance(meta.get('files'), dict):
      where = draw(st.sampled_from(['prefix', 'file', 'rename']))
      evil = draw(st.sampled_from(EVIL_PATHS))
      if where == 'prefix':
        meta['checkpoint_prefix'] = evil
      elif meta['files']:
        files = meta['files']
        name = draw(st.sampled_from(sorted(files)))
        files[evil] = files.pop(name) if where == 'rename' else files[name]
    elif kind == 'node':
      # Any node of the document replaced, removed or retyped.
      parent, key, node = None, None, meta
      while isinstance(node, dict | list) and node and draw(st.booleans()):
        keys = list(node) if isinstance(node, dict) else range(len(node))
        parent, key = node, draw(st.sampled_from(list(keys)))
        node = node[key]
      if parent is not None:
        op = draw(st.sampled_from(['replace', 'delete', 'number']))
        if op == 'delete':
          del parent[key]
        elif op == 'number':
          parent[key] = draw(st.sampled_from(HUGE))
        else:
          parent[key] = draw(_ANY)
  text = json.dumps(meta).encode()
  damage = draw(
    st.sampled_from(['none'] * 5 + ['cut', 'bytes', 'dup', 'deep', 'number'])
  )
  if damage == 'cut':
    text = text[: draw(st.integers(0, len(text)))]
  elif damage == 'bytes':
    at = draw(st.integers(0, len(text)))
    text = text[:at] + draw(st.binary(min_size=1, max_size=4)) + text[at:]
  elif damage == 'dup':
    key = draw(st.sampled_from([b'"version"', b'"variables"', b'"files"']))
    text = text.replace(b'{', b'{' + key + b': 0, ', 1)
  elif damage == 'deep':
    depth = draw(st.sampled_from([63, 65, 5000, 200_000]))
    text = b'{"variables": ' + b'[' * depth + b']' * depth + b'}'
  elif damage == 'number':
    text = re.sub(
      rb'"version": (\d+)', rb'"version": \g<1>' + b'0' * 5000, text, count=1
    )
  return text


# What is opened, and the bounds
# ------------------------------------------------------------------------------


@contextlib.contextmanager
def _bounded(base, root, *, traced):
  """Nothing under `base` outside `root` is opened; yields a list that
  then holds its CPU time; with `traced` (which slows Python down), its
  peak of Python memory is bounded."""

  def stuck(signum, frame):
    raise TimeoutError('a manifest read for 60 s of wall time')

  previous = signal.signal(signal.SIGALRM, stuck)
  signal.alarm(60)  # A hang fails the case rather than the suite.
  # The collector's passes over JAX's and TF's objects are not the read's.
  gc.disable()
  if traced:
    tracemalloc.start()
  start = time.thread_time()
  spent = []
  try:
    with opened.recording() as paths:
      yield spent
  finally:
    spent.append(time.thread_time() - start)
    peak = tracemalloc.get_traced_memory()[1] if traced else 0
    tracemalloc.stop()
    gc.enable()
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)
  opened.assert_inside(paths, base, root)
  assert peak < MEMORY_BYTES, f'{peak / 2**20:.0f} MiB'


def _consume(root):
  """What readers do with a manifest before TF opens a file: our error or
  the manifest."""
  manifest = _decode.read(root)
  if manifest is None:
    return None
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    _verify.problems_of(manifest, pool)
  for record in manifest.records:
    # The first device's slice of a 2-way split of each dimension: the
    # regions a process reads, and the checksums it would check.
    needed = {tuple((0, max(1, n // 2)) if n else (0, 0) for n in record.shape)}
    for region in _host_read.regions(record.shape, needed, False, record):
      for _ in record.shards.inside(region):
        pass
  return manifest


def _outcome(text, base, root):
  with open(os.path.join(root, MANIFEST), 'wb') as f:
    f.write(text)
  # Twice timed (the better counts: the first read may pay first-touch
  # page faults of fresh memory, which some machines make costly), then
  # once with its memory traced.
  outcomes = []
  cpu = []
  for traced in (False, False, True):
    with _bounded(base, root, traced=traced) as spent:
      try:
        outcomes.append(_consume(root))
      except fdt.ExportError as e:
        outcomes.append(e)
    if not traced:
      cpu.append(spent[0])
  assert min(cpu) < CPU_SECONDS, f'{min(cpu):.2f} s of CPU time'
  assert len({type(o) for o in outcomes}) == 1, outcomes
  return outcomes[-1]


def test_a_broken_manifest_is_read_right_or_refused(export):
  base, path, metas, _ = export
  root = os.path.join(base, 'case')
  shutil.copytree(path, root)
  outcomes = {'read': 0, 'refused': 0}

  @hypothesis.settings(
    max_examples=profiles.examples(5000),
    deadline=None,
    suppress_health_check=[
      hypothesis.HealthCheck.too_slow,
      hypothesis.HealthCheck.data_too_large,
    ],
  )
  @hypothesis.given(st.data())
  def check(data):
    text = data.draw(broken(metas))
    outcome = _outcome(text, base, root)
    if isinstance(outcome, Exception):
      outcomes['refused'] += 1
      return
    outcomes['read'] += 1
    # Read: then it says what the document says, the shards included.
    raw = json.loads(text)
    assert outcome.version == raw['version']
    assert outcome.prefix == raw['checkpoint_prefix']
    assert sorted(outcome.files) == sorted(raw['files'])
    for record, var in zip(outcome.records, raw['variables'], strict=True):
      assert list(record.path) == var['path']
      assert list(record.shape) == var['shape']
      shards = var['shards']
      if isinstance(shards, list):
        assert sorted(record.shards) == sorted(
          (tuple(map(tuple, s['index'])), s['crc32']) for s in shards
        )
      else:
        assert list(record.shards.blocks) == shards['blocks']
        checksum = _model.READABLE[raw['version']]
        assert list(record.shards.crcs) == _crcs(shards[checksum])

  check()
  # Both outcomes happen: the breaks are neither all harmless nor all
  # fatal (an edit of a value no reader checks, or one undone by the next).
  assert outcomes['refused'] > outcomes['read'] > 0, outcomes


@pytest.mark.parametrize('version', [5, 4, 3])
def test_the_intact_manifests_read_back_whole(export, version):
  """The starting points themselves read, with every shard's checksum,
  and each is intact against its own export's files."""
  base, _, metas, paths = export
  root = os.path.join(base, f'intact{version}')
  shutil.copytree(paths[version], root)
  meta = metas[version]
  outcome = _outcome(json.dumps(meta).encode(), base, root)
  assert isinstance(outcome, _model.Manifest), outcome
  assert outcome.version == version
  assert outcome.checksum == ('crc32c' if version == 5 else 'crc32')
  assert [len(r.shards) for r in outcome.records] == [1, 8, 8, 1]
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    assert _verify.problems_of(outcome, pool) == []
