"""What a restore's source must hold: the target's variables, exactly.

Shared by every restore (`restore_checkpoint` from disk, `from_tf_module`
from TF variables, and the Orbax restore of ``flax-dtensor export``):
`check_extra` words a source holding variables the target lacks, and
`check_held` refuses it with every other misfit (a variable the target
needs that it lacks, one of another shape or dtype) in one message, which
names every variable concerned (up to a bound, then a count), what was expected, what was found, and the fix
(`Source` says in whose words).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from flax_dtensor import _errors
from flax_dtensor._placement import _variables


@dataclasses.dataclass(frozen=True)
class Source:
  """How messages name what a restore reads from.

  Attributes:
    name: The source, as the subject of a sentence ("The checkpoint
      '/x/ckpt'", "The tf.Module").
    kind: What a matching source is ("a checkpoint", "TF variables").
    verb: How the source was made from a model ("saved", "exported").
    keys: Whether messages show a variable's checkpoint key.
    selects: Whether the caller can restore some variables only
      (``include=``, ``exclude=``, ``allow_extra=``), so that the fixes
      offer it; the command line cannot.
    rebuild: How to build a target that matches (the fix of a shape or
      structure mismatch); None for "the target ... the same model
      configuration".
  """

  name: str
  kind: str
  verb: str
  keys: bool = False
  selects: bool = True
  rebuild: str | None = None

  def rebuild_text(self) -> str:
    return self.rebuild or (
      f'Build the target with the shapes that were {self.verb} (the same '
      'model configuration)'
    )

  @property
  def object(self) -> str:
    """The name in the middle of a sentence ("the checkpoint ...")."""
    return self.name[:1].lower() + self.name[1:]


@dataclasses.dataclass(frozen=True)
class Held:
  """What a source holds for one variable.

  Attributes:
    shape: Its shape.
    stored: The dtype the source holds it in.
    saved: The dtype the variable had when it was exported (a checkpoint
      stores some dtypes widened).
    note: Where `saved` comes from, for messages ('' if nothing to say).
  """

  shape: tuple[int, ...]
  stored: np.dtype
  saved: np.dtype
  note: str = ''


class Wanted(Protocol):
  """A variable the target needs (`_selection.Entry` is one)."""

  path: tuple[Any, ...]
  shape: tuple[int, ...]
  dtype: np.dtype

  @property
  def name(self) -> str: ...

  @property
  def key(self) -> str: ...


def check_held(
  entries: Sequence[Wanted],
  held: Mapping[tuple[Any, ...], Held],
  source: Source,
  convert_dtypes: bool,
  extra: str | None = None,
) -> list[Held]:
  """What the source holds for each entry; ExportError if it does not fit.

  A restore never changes a value unless asked to: the dtype a variable
  was exported with must be the target's, or `convert_dtypes` must be set.
  Every misfit is named at once, in one message: the variables the source
  holds beyond the target (`extra`, from `check_extra`, which names the
  ones it lacks too), the variables it lacks, each variable of another
  shape, and each of another dtype.
  """
  lacks = [e for e in entries if e.path not in held]
  found = [(e, held[e.path]) for e in entries if e.path in held]
  shapes = [(e, h) for e, h in found if h.shape != e.shape]
  dtypes = [
    (e, h) for e, h in found if h.saved != e.dtype and not convert_dtypes
  ]
  if extra:
    parts = [extra]
  else:
    parts = [_lacking(lacks, held, source)] if lacks else []
  if shapes:
    parts.append(_shape_mismatches(shapes, source))
  if dtypes:
    parts.append(_dtype_mismatches(dtypes, source))
  if parts:
    raise _errors.ExportError(' '.join(parts))
  return [h for _, h in found]


MISMATCHES_SHOWN = 8
"""The most mismatched variables one message describes (then a count)."""


def _lacking(
  lacks: Sequence[Wanted],
  held: Mapping[tuple[Any, ...], Held],
  source: Source,
) -> str:
  names = sorted(_variables.path_str(p) for p in held)
  if len(lacks) == 1:
    (e,) = lacks
    key = f' (key {e.key!r})' if source.keys else ''
    which = f'has no variable {e.name!r}{key}, which the target needs'
  else:
    shown = [
      f'{x.name} (key {x.key!r})' if source.keys else x.name for x in lacks
    ]
    which = (
      f'lacks {len(lacks)} variables the target needs: '
      f'{_variables.listing(shown)}'
    )
  fix = (
    'Restore with a narrower `include=`/`exclude=` (e.g. '
    f'`include=nnx.Param` for {source.kind} of the parameters only), '
    f'or {source.kind} {source.verb} from the same model.'
    if source.selects
    else f'Expected {source.kind} {source.verb} from this model. '
    f'{source.rebuild_text()}.'
  )
  return (
    f'{source.name} {which}. It holds {len(names)} variables: '
    f'{_variables.listing(names)}. {fix}'
  )


def _each(
  what: str,
  pairs: Sequence[tuple[Wanted, Held]],
  describe: Callable[[Wanted, Held, bool], str],
) -> str:
  """'Shape mismatch for 'a': ...' or, for several, each of them (the
  first `MISMATCHES_SHOWN`, then a count): the source is named once."""
  if len(pairs) == 1:
    ((e, h),) = pairs
    return f'{what} for {e.name!r}: {describe(e, h, True)}'
  shown = [
    f'{e.name!r}: {describe(e, h, i == 0)}'
    for i, (e, h) in enumerate(pairs[:MISMATCHES_SHOWN])
  ]
  rest = len(pairs) - len(shown)
  if rest:
    shown.append(f'and {rest} more')
  return f'{what} for {len(pairs)} variables: {"; ".join(shown)}'


def _shape_mismatches(
  pairs: Sequence[tuple[Wanted, Held]], source: Source
) -> str:
  def describe(e: Wanted, h: Held, first: bool) -> str:
    where = source.object if first else 'it'
    return f'the target expects {e.shape}, {where} holds {h.shape}'

  these = 'this variable' if len(pairs) == 1 else 'these variables'
  leave_out = (
    f', or leave {these} out with `include=`/`exclude=`'
    if source.selects
    else ''
  )
  return (
    f'{_each("Shape mismatch", pairs, describe)}. '
    f'{source.rebuild_text()}{leave_out}.'
  )


def _dtype_mismatches(
  pairs: Sequence[tuple[Wanted, Held]], source: Source
) -> str:
  def describe(e: Wanted, h: Held, first: bool) -> str:
    where = source.object if first else 'it'
    note = f' ({h.note})' if h.note else ''
    return f'the target expects {e.dtype}, {where} has {h.saved}{note}'

  saved = sorted({str(h.saved) for _, h in pairs})
  dtype = (
    f'dtype {saved[0]}' if len(saved) == 1 else f'dtypes {", ".join(saved)}'
  )
  these = 'this variable' if len(pairs) == 1 else 'these variables'
  return (
    f'{_each("Dtype mismatch", pairs, describe)}. A restore does not '
    'convert unless asked (that could round or wrap values): build the '
    f'target with {dtype} (e.g. `param_dtype=`), pass '
    f'`convert_dtypes=True`, or leave {these} out with `include=`/`exclude=`.'
  )


def check_extra(
  target: Any,
  held: Mapping[tuple[Any, ...], Any],
  source: Source,
  allow_extra: bool,
) -> str | None:
  """What a source holding variables the target does not have is told (None
  if it holds none, or `allow_extra`): `check_held` raises it with every
  other misfit, in one message."""
  if allow_extra:
    return None
  known = {_variables.path_str(p) for p, _ in _variables.iter_variables(target)}
  found = set(map(_variables.path_str, held))
  extra = sorted(found - known)
  if extra:
    fix = (
      f'restore into the model that was {source.verb}, or pass '
      '`allow_extra=True` to restore the variables the target has and '
      'ignore the others.'
      if source.selects
      else source.rebuild_text()[:1].lower() + source.rebuild_text()[1:] + '.'
    )
    # Both sides of the mismatch: what the source holds beyond the target,
    # and the target's variables it lacks.
    lacks = sorted(known - found)
    also = (
      f"; and it lacks {len(lacks)} of the target's variables: "
      f'{_variables.listing(lacks)}'
      if lacks
      else ''
    )
    return (
      f'{source.name} holds {len(extra)} variable(s) the target does not '
      f'have: {_variables.listing(extra)}{also}. Expected {source.kind} of '
      f'this model: {fix}'
    )
  return None
