"""Verifying an export against its manifest: files, TF's index, bytes read.

`verify_files` checks where the files lead and their bytes before
TensorFlow reads them (`problems_of` lists what is wrong, for
``--verify``; `confinement_problems` where they are); `verify_index`
checks the variables against TF's index; `verify_read` checks every value
read back against its saved checksum (`_checksums.crc`: CRC-32C, CRC-32
before version 5). `damaged` is the
error naming what is wrong.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from flax_dtensor import _errors
from flax_dtensor.dtensor._conversion import _names
from flax_dtensor.dtensor._format import _checksums, _grid, _model, _paths
from flax_dtensor.dtensor._layout import _index

if TYPE_CHECKING:
  import numpy as np


def damaged(
  manifest: _model.Manifest,
  problems: list[str],
  *,
  read: bool = False,
  kind: type[_errors.ExportError] = _errors.DamagedExportError,
) -> _errors.ExportError:
  """The error naming what is wrong with an export's files.

  `kind` is `DamagedExportError` (bytes changed, a file truncated or
  missing) or `MalformedExportError` (a file outside the export or not in
  the manifest; a manifest that disagrees with TF's index).
  """
  shown = '; '.join(problems[:4]) + (
    f'; and {len(problems) - 4} more' if len(problems) > 4 else ''
  )
  if read:
    return kind(
      f'The export at {manifest.root!r} is damaged: {shown} (expected what '
      f'its manifest {manifest.location} records; found in the bytes read, '
      'so the files may also have changed during the read). Nothing was '
      'restored: the target is unchanged. Restore from an intact copy, or '
      're-export it; if another process was saving to that path, read again '
      'once it is done.'
    )
  return kind(
    f'The export at {manifest.root!r} is damaged: {shown} (expected what its '
    f'manifest {manifest.location} records). Nothing was read into '
    'TensorFlow. Restore from an intact copy, or re-export it.'
  )


_DATA = re.compile(r'\.data-(\d{5})-of-(\d{5})$')


def confinement_problems(manifest: _model.Manifest) -> list[str]:
  """What breaks the rules of where an export's files may be, on disk.

  Every file the manifest lists must resolve inside the export (a symbolic
  link may point inside it, not out of it). TensorFlow's reader opens
  ``PREFIX.index`` and ``PREFIX.data-I-of-N`` for I < N: the manifest must
  list the index and every data file of one N, no other file on disk may
  match the prefix, and the prefix itself must not exist (TF would read a
  directory there as a checkpoint directory, following its ``checkpoint``
  file anywhere). Nothing is opened: only names and links are looked at.
  """
  problems = [
    f'{name} is refused: {escape}'
    for name, escape in _escapes(manifest).items()
  ]
  prefix = os.path.join(manifest.root, manifest.prefix)
  if os.path.lexists(prefix):
    problems.append(
      f'the checkpoint prefix {manifest.prefix} is a file or directory on '
      'disk (TensorFlow would read it as a checkpoint directory)'
    )
  base = os.path.basename(manifest.prefix)
  if f'{manifest.prefix}.index' not in manifest.files:
    problems.append(f'the manifest does not list {manifest.prefix}.index')
  counts = set()
  shards = set()
  for name in manifest.files:
    if name.startswith(f'{manifest.prefix}.data-'):
      match = _DATA.search(name[len(manifest.prefix) :])
      if match is None or match.start() != 0:
        problems.append(f'{name} is not a TF data file name')
        continue
      shards.add(int(match.group(1)))
      counts.add(int(match.group(2)))
  if len(counts) > 1 or (counts and shards != set(range(max(counts)))):
    problems.append(
      f'the data files listed for {manifest.prefix} are not one complete '
      f'set (shards {sorted(shards)} of {sorted(counts)})'
    )
  directory = os.path.dirname(prefix)
  try:
    present = os.listdir(directory)
  except OSError:
    present = []
  for entry in sorted(present):
    if entry.startswith(f'{base}.index') or entry.startswith(f'{base}.data-'):
      name = os.path.join(os.path.dirname(manifest.prefix), entry)
      if name not in manifest.files:
        problems.append(
          f'{name} is on disk but not in the manifest (TensorFlow may read '
          'it unverified)'
        )
  return problems


def _escapes(manifest: _model.Manifest) -> dict[str, str]:
  """{name: why} of the prefix and files resolving outside the export."""
  out = {}
  for name in (manifest.prefix, *sorted(manifest.files)):
    escape = _paths.escape_problem(manifest.root, name)
    if escape is not None:
      out[name] = escape
  return out


def problems_of(
  manifest: _model.Manifest,
  pool: concurrent.futures.Executor,
  *,
  data: bool = True,
) -> list[str]:
  """Everything wrong with an export's files against its manifest.

  First where they are (`confinement_problems`); then the size and chunk
  checksums of every file, except those resolving outside the export: they
  are never opened. With `data=False`, TF's data files (`PREFIX.data-*`)
  are checked for their size only: a reader that checks every byte it
  reads (`verify_read`) need not read them twice.
  """
  problems = confinement_problems(manifest)
  outside = _escapes(manifest)
  jobs = []
  for name, expected in sorted(manifest.files.items()):
    if name in outside:
      continue
    path = os.path.join(manifest.root, name)
    try:
      size = os.path.getsize(path)
    except OSError:
      problems.append(f'{name} is missing')
      continue
    if size != expected.size:
      problems.append(f'{name} has {size} bytes, not {expected.size}')
      continue
    if not data and _DATA.search(name):
      continue
    chunks = _checksums.file_chunks(path, size)
    if len(chunks) != len(expected.chunks):
      problems.append(f'{name} has {len(chunks)} chunks recorded wrongly')
      continue
    for i, (offset, length) in enumerate(chunks):
      jobs.append(
        (
          name,
          offset,
          length,
          expected.chunks[i],
          pool.submit(
            _checksums.crc_chunk, path, offset, length, manifest.checksum
          ),
        )
      )
  for name, offset, length, crc, future in jobs:
    try:
      got = future.result()
    except OSError as e:
      problems.append(f'{name} cannot be read ({e})')
      continue
    if got != crc:
      problems.append(
        f'{name} bytes {offset}..{offset + length} changed '
        f'({manifest.checksum_name} {got:08x}, recorded {crc:08x})'
      )
  return sorted(set(problems), key=problems.index)


def verify_files(
  manifest: _model.Manifest,
  pool: concurrent.futures.Executor,
  *,
  data: bool = True,
) -> None:
  """Checks where every file is, then its size and CRCs, before TF reads.

  With `data=False` the data files' contents are left to the read, which
  checks every byte it reads (TF's index and every other file are still
  checked whole first).

  Raises:
    MalformedExportError: Naming every file outside the export or
      unlisted (and any other problem found), if there is one.
    DamagedExportError: Naming every file missing, resized or changed.
  """
  problems = problems_of(manifest, pool, data=data)
  if problems:
    untrusted = bool(confinement_problems(manifest))
    raise damaged(
      manifest,
      problems,
      kind=(
        _errors.MalformedExportError
        if untrusted
        else _errors.DamagedExportError
      ),
    )


def verify_index(
  manifest: _model.Manifest,
  shapes: Mapping[str, Any],
  dtypes: Mapping[str, Any],
) -> None:
  """Checks TF's index (key -> shape, dtype) against the manifest.

  Raises:
    MalformedExportError: If a variable is missing on either side, or its
      shape or stored dtype differs.
  """
  import numpy as np

  from flax_dtensor.dtensor._layout import _dtypes

  held = {k for k in shapes if _names.nnx_path(k) is not None}
  recorded = manifest.by_key
  problems = []
  for key in sorted(set(recorded) - held):
    problems.append(
      f'{_names.path_text(recorded[key].path)} is not in the data'
    )
  for key in sorted(held - set(recorded)):
    problems.append(
      f'the data holds {_names.path_text(_names.nnx_path(key))}, which the '
      'manifest does not list'
    )
  for key in sorted(held & set(recorded)):
    r = recorded[key]
    name = _names.path_text(r.path)
    if tuple(shapes[key]) != r.shape:
      problems.append(
        f'{name} has shape {tuple(shapes[key])} in the data, {r.shape} in '
        'the manifest'
      )
    stored = np.dtype(dtypes[key].as_numpy_dtype)
    if stored.name != r.stored_dtype:
      problems.append(
        f'{name} is stored as {stored} in the data, as {r.stored_dtype} in '
        'the manifest'
      )
    saved = _dtypes.from_name(r.dtype, manifest.where)
    if _dtypes.stored(saved).name != r.stored_dtype:
      problems.append(
        f'{name} is recorded as {r.dtype} stored as {r.stored_dtype}, but '
        f'{r.dtype} is stored as {_dtypes.stored(saved)}'
      )
  if problems:
    raise damaged(manifest, problems, kind=_errors.MalformedExportError)


def verify_read(
  manifest: _model.Manifest,
  record: _model.Record,
  read: Mapping[_model.Index, np.ndarray],
) -> None:
  """Checks every byte TF read of one variable against the saved CRCs.

  This is the one check of values: whatever happened to the files after
  `verify_files` (a byte flipped, a file truncated, the whole export
  replaced by another save), a restore places only bytes that match what
  was saved. `read` maps each global slice TF returned to its host array,
  in the saved dtype: whole saved shards (a box of whole blocks of the
  grid, `ShardGrid.hull`), each of which is hashed (`_checksums.crc`) and
  compared. A slice that is not whole blocks is refused.

  Raises:
    DamagedExportError: If a shard's bytes differ from what was saved.
    MalformedExportError: If a slice read is not made of whole shards.
  """
  import numpy as np

  grid = record.shards
  for held, data in read.items():
    if not grid.aligned(held):
      raise damaged(
        manifest,
        [
          f'the shards recorded for {_names.path_text(record.path)} do not '
          f'cover [{_grid.text(held)}] whole, so its bytes cannot be checked'
        ],
        read=True,
        kind=_errors.MalformedExportError,
      )
    data = np.asarray(data)
    if held == grid.whole and len(grid) == 1:
      _check_shard(manifest, record, held, grid.crcs[0], data, held)
      continue
    for index, expected in grid.inside(held):
      _check_shard(manifest, record, index, expected, data, held)


def _check_shard(
  manifest: _model.Manifest,
  record: _model.Record,
  index: _model.Index,
  expected: int,
  data: Any,
  held: _model.Index,
) -> None:
  got = _checksums.crc(
    data[_index.local(index, held)], checksum=manifest.checksum
  )
  if got != expected:
    raise damaged(
      manifest,
      [
        f'{_names.path_text(record.path)}[{_grid.text(index)}] read back '
        f'with {manifest.checksum_name} {got:08x}, recorded {expected:08x}'
      ],
      read=True,
    )
