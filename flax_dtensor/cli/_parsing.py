"""Parsers of the flags that need no model: meshes, axis types, sizes, --out.

Each raises `BadInputError` naming the flag, what arrived and how to write
it. JAX is imported inside the functions, so ``--help`` stays fast.
"""

from __future__ import annotations

import os
import pathlib
import re
from collections.abc import Sequence
from typing import Any

from flax_dtensor.cli import _options
from flax_dtensor.cli._command import BadInputError

_MESH_ITEM = re.compile(r'^([A-Za-z_][A-Za-z0-9_]*)=(\S*)$')
_AXIS_TYPE_NAMES = ('auto', 'explicit')


def parse_axis_types(text: str, axes: Sequence[tuple[str, int]]) -> tuple:
  """Parses ``--axis-types`` against the axes of ``--mesh``.

  Returns:
    One `jax.sharding.AxisType` per axis of `axes`, in order.

  Raises:
    BadInputError: If a type is not auto or explicit, or a NAME is not an
      axis of the mesh.
  """
  import jax

  kinds = {
    'auto': jax.sharding.AxisType.Auto,
    'explicit': jax.sharding.AxisType.Explicit,
  }
  names = [n for n, _ in axes]
  fix = (
    'Pass --axis-types auto, explicit, or NAME=TYPE pairs naming axes of '
    f'--mesh ({", ".join(names)}), each type auto or explicit.'
  )
  whole = text.strip().lower()
  if whole in kinds:
    return (kinds[whole],) * len(axes)
  chosen: dict[str, Any] = {}
  for item in text.split(','):
    name, eq, kind = (part.strip() for part in item.partition('='))
    if not eq or not name:
      raise BadInputError(
        f'Malformed --axis-types {text!r}: expected auto, explicit or '
        f'NAME=TYPE, got {item.strip()!r}. {fix}'
      )
    if name not in names:
      raise BadInputError(
        f'Malformed --axis-types {text!r}: {name!r} is not an axis of '
        f'--mesh (its axes: {", ".join(names)}). {fix}'
      )
    if kind.lower() not in kinds:
      raise BadInputError(
        f'Malformed --axis-types {text!r}: axis {name!r} has type {kind!r}; '
        f'expected one of {", ".join(_AXIS_TYPE_NAMES)}. {fix}'
      )
    if name in chosen:
      raise BadInputError(
        f'Malformed --axis-types {text!r}: axis {name!r} is named twice. {fix}'
      )
    chosen[name] = kinds[kind.lower()]
  return tuple(chosen.get(n, kinds['auto']) for n in names)


def parse_mesh(text: str) -> tuple[tuple[str, int], ...]:
  """Parses ``'data=2,model=4'`` into ``(('data', 2), ('model', 4))``.

  Args:
    text: Comma-separated ``NAME=SIZE`` pairs.

  Returns:
    The axis names and sizes, in order.

  Raises:
    BadInputError: If the text is malformed, a size is not a positive
      integer, or a name repeats.
  """
  fix = f'Pass --mesh as comma-separated NAME=SIZE pairs, e.g. {_options.DEFAULT_MESH}.'
  items = [item.strip() for item in text.split(',')]
  axes = []
  for item in items:
    match = _MESH_ITEM.match(item)
    if match is None:
      raise BadInputError(
        f'Malformed --mesh {text!r}: expected NAME=SIZE, got {item!r}. {fix}'
      )
    name, size_text = match.groups()
    try:
      size = int(size_text)
    except ValueError:
      size = None
    if size is None or size < 1:
      raise BadInputError(
        f'Malformed --mesh {text!r}: axis {name!r} has size {size_text!r}; '
        f'sizes must be positive integers. {fix}'
      )
    axes.append((name, size))
  names = [n for n, _ in axes]
  repeated = sorted({n for n in names if names.count(n) > 1})
  if repeated:
    raise BadInputError(
      f'Malformed --mesh {text!r}: axis name(s) {repeated} repeat. Give '
      f'each mesh axis its own name. {fix}'
    )
  return tuple(axes)


def check_out(
  out: pathlib.Path,
  *,
  overwrite: bool,
  flag: bool,
  reads: pathlib.Path | None = None,
) -> bool:
  """Checks, before any work, that a run may write `out` as a whole.

  `out`, or the nearest of its parents that exists, must be a directory;
  an existing `out` is replaced as a whole (`_run_folder.writing`), so it
  may hold only an earlier run's output.

  Args:
    out: The output folder (``--out``).
    overwrite: Whether the user asked to replace an earlier run's output.
    flag: Whether the command has ``--overwrite`` (else it always may).
    reads: The input the run reads (``--checkpoint``), never inside `out`.

  Returns:
    Whether `out` exists and holds something (to be replaced).

  Raises:
    BadInputError: If `out` or its nearest existing parent is not a
      directory, `out` holds files no run wrote, or an earlier run's output
      and `overwrite` is false, or `reads` or the current directory is
      inside it.
  """
  from flax_dtensor.cli import _run_folder

  existing = out
  while not existing.exists() and existing.parent != existing:
    existing = existing.parent
  if not existing.is_dir():
    where = '' if existing == out else f' (its parent {str(existing)!r} is not)'
    raise BadInputError(
      f'--out {str(out)!r} is not a directory{where}. Pass a directory, '
      'existing or to be created.'
    )
  # Where the run creates its folder (`out`'s parent) or, for the current
  # directory, writes inside it: refused now rather than after training.
  here = out.is_dir() and _run_folder.holds_cwd(out)
  writes_in = existing if here or existing != out else existing.parent
  if writes_in.is_dir() and not os.access(writes_in, os.W_OK | os.X_OK):
    from flax_dtensor.dtensor._storage import _writable

    raise BadInputError(
      f'--out {str(out)!r} cannot be written: {str(writes_in)!r} is not '
      f'writable ({_writable.who_may_write(str(writes_in))}). Pass a '
      'directory you may write in.'
    )
  if not out.is_dir():
    return False
  if here:
    entries = [e for e in os.listdir(out) if not _run_folder.ours(e)]
    if entries or out.resolve() != pathlib.Path.cwd().resolve():
      raise BadInputError(
        f'--out {str(out)!r} is the current directory or holds it, and '
        'is not empty; a run replaces its output folder as a whole, which '
        'it cannot do to the directory it runs in. Pass a directory inside '
        'it, e.g. --out flax_dtensor_out (an empty current directory will '
        'do too).'
      )
    return False
  if reads is not None and reads.resolve().is_relative_to(out.resolve()):
    raise BadInputError(
      f'--checkpoint {str(reads)!r} is inside --out {str(out)!r}, which the '
      'run replaces as a whole. Choose another --out.'
    )
  if out.is_symlink():
    raise BadInputError(
      f'--out {str(out)!r} is a symbolic link; the output folder is replaced '
      'as a whole. Pass the directory it points to, or a new one.'
    )
  others = _run_folder.foreign(out)
  if others:
    shown = ', '.join(repr(n) for n in others[:5])
    more = f' and {len(others) - 5} more' if len(others) > 5 else ''
    raise BadInputError(
      f'--out {str(out)!r} holds {shown}{more}, which no flax-dtensor run '
      'wrote. A run replaces its output folder as a whole: pass a new or '
      'empty directory, or an earlier output of demo or export.'
    )
  if not os.listdir(out):
    return False
  if flag and not overwrite:
    raise BadInputError(
      f"{str(out)!r} already exists (an earlier run's output). Pass "
      '--overwrite to replace it as a whole, or choose another --out.'
    )
  return True


_UNITS = {'': 1, 'B': 1, 'KIB': 2**10, 'MIB': 2**20, 'GIB': 2**30, 'TIB': 2**40}


def parse_size(text: str, flag: str, *, minimum: int = 0) -> int:
  """Bytes from '16GiB', '512 MiB' or '1000' (IEC units), at least `minimum`.

  Raises:
    BadInputError: If the text is not a size, or is below `minimum`: one
      wording for every such value (``0``, ``-5KiB``, ``lots``).
  """
  m = re.fullmatch(r'\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*', text)
  unit = m.group(2).upper() if m else None
  size = None if m is None or unit not in _UNITS else m.group(1)
  if size is None or int(float(size) * _UNITS[unit]) < minimum:
    least = f' of at least {minimum} byte{"s" * (minimum != 1)}' * (minimum > 0)
    raise BadInputError(
      f'Malformed {flag} {text!r}: expected a size{least} in bytes, or with '
      'an IEC unit (KiB, MiB, GiB, TiB), e.g. 16GiB.'
    )
  return int(float(size) * _UNITS[unit])


# TF Serving reads a version directory's name as an int64.
_MAX_VERSION = 2**63 - 1


def parse_version(text: str) -> int:
  """The SavedModel's version of ``--version``: a positive integer.

  TF Serving serves the SavedModels of a base directory by the versions
  their directories are named by (``base/1``, ``base/2``: the highest by
  default), and skips any other name.

  Raises:
    BadInputError: If the text is not a positive (64-bit) integer.
  """
  stripped = text.strip()
  if not re.fullmatch('[0-9]+', stripped) or not (
    0 < int(stripped) <= _MAX_VERSION
  ):
    raise BadInputError(
      f'Malformed --version {text!r}: expected a positive integer, the '
      "SavedModel's version (TF Serving serves OUT/saved_model/<N>, the "
      'highest N by default), e.g. --version 1.'
    )
  return int(stripped)
