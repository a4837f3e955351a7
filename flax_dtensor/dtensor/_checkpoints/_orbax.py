"""Orbax checkpoints of ``nnx.state(model)``, restored straight onto a mesh.

What ``flax-dtensor export`` starts from: `find_checkpoint` accepts a
``StandardCheckpointer`` directory or a ``CheckpointManager`` one (its
latest step); `restore` checks the checkpoint's variables and shapes
against the model (`_sources`, as every restore does), then reads every
array directly into the sharding the rules give its variable
(`_spec.spec_of_variable`); damage TensorStore detects as it reads is
a `DamagedExportError`, and `unverified` says what it cannot detect.
Orbax is imported when these run (``pip install "flax-dtensor[cli]"``).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from flax_dtensor import _errors
from flax_dtensor._placement import _parts, _sources, _variables
from flax_dtensor._rules import _context, _logical, _spec

_FIX = (
  'Expected the directory written by orbax.checkpoint.StandardCheckpointer()'
  '.save(path, nnx.state(model)) (and waited for with wait_until_finished()),'
  ' or a CheckpointManager directory.'
)
REBUILD = (
  'Pass a TARGET that builds the model that was saved (the same configuration)'
)
# What TensorStore checks as it reads an Orbax checkpoint, and what it
# cannot: Orbax (0.12) writes each array as zarr chunks compressed by zstd,
# whose frames carry their size but no checksum, into OCDBT data files,
# which checksum (CRC-32C) only their manifest and B+tree nodes.
_UNVERIFIED_OCDBT = (
  "Orbax checkpoints carry no checksum of their arrays' bytes: TensorStore "
  "checked the OCDBT manifest's and tree nodes' CRC-32C and each chunk's "
  'framing as it read them, but damage inside the values cannot be '
  'detected. Steps of flax_dtensor.dtensor.CheckpointManager carry a CRC-32C '
  'of every byte.'
)
_UNVERIFIED_PLAIN = (
  "Orbax checkpoints carry no checksum of their arrays' bytes, and this one "
  '(not OCDBT) none of its index: damage inside it cannot be detected. '
  'Steps of flax_dtensor.dtensor.CheckpointManager carry a CRC-32C of every '
  'byte.'
)
# TensorStore's words for bytes that fail a check of the format.
_DAMAGE = re.compile(
  r'DATA_LOSS|OUT_OF_RANGE|CRC-32C|Data corruption|Error decoding|'
  r'is not valid for value of size|Unexpected end of'
)
_READING = re.compile(r'Error reading "([^"]+)"')


def _is_checkpoint(path: pathlib.Path) -> bool:
  return (path / '_CHECKPOINT_METADATA').exists() or (
    path / '_METADATA'
  ).exists()


def find_checkpoint(path: pathlib.Path) -> pathlib.Path:
  """The Orbax checkpoint directory at or below `path`.

  Raises:
    ExportNotFoundError: If there is no Orbax checkpoint there.
    ExportError: If `path` is a file.
  """
  if not path.exists():
    raise _errors.ExportNotFoundError(
      f'Orbax checkpoint {str(path)!r} does not exist. {_FIX}'
    )
  if not path.is_dir():
    raise _errors.ExportError(
      f'Orbax checkpoint {str(path)!r} is a file, not a directory. {_FIX}'
    )
  if _is_checkpoint(path):
    return path
  steps = sorted(
    (p for p in path.iterdir() if p.is_dir() and p.name.isdigit()),
    key=lambda p: int(p.name),
  )
  if steps:
    latest = steps[-1]
    if (latest / '_METADATA').exists():
      return latest
    items = [p for p in latest.iterdir() if p.is_dir() and _is_checkpoint(p)]
    if len(items) == 1:
      return items[0]
  raise _errors.ExportNotFoundError(
    f'{str(path)!r} holds no Orbax checkpoint (no _CHECKPOINT_METADATA or '
    f'_METADATA file). {_FIX}'
  )


@dataclasses.dataclass(frozen=True)
class _Wanted:
  """A variable of the model, as `_sources` checks it."""

  path: tuple[str, ...]
  shape: tuple[int, ...]
  dtype: Any

  @property
  def name(self) -> str:
    return '/'.join(self.path)

  @property
  def key(self) -> str:
    return self.name


def _parts_of(keypath: Any) -> tuple[str, ...]:
  return tuple(_variables.keypath_str(keypath).split('/'))


def check_matches(
  path: pathlib.Path,
  abstract_model: Any,
  *,
  part: tuple[str, ...] | None = None,
  allow_extra: bool = False,
) -> _parts.Choice:
  """Refuses a checkpoint whose variables or shapes are not the model's.

  Read from the checkpoint's metadata, before any array is. A checkpoint
  of a training state holds the model under one group (`_parts.choose`):
  `part`, or the one whose paths are the model's.

  Returns:
    The part of the checkpoint holding the model.

  Raises:
    ExportError: If the checkpoint (its part) lacks a variable of the
      model, holds one the model lacks (unless `allow_extra`), or holds one
      with another shape; the message names the variable, what the model
      expects and what the checkpoint holds.
  """
  import orbax.checkpoint as ocp

  with ocp.StandardCheckpointer() as checkpointer:
    return _check_matches(
      checkpointer, path, nnx.state(abstract_model), part, allow_extra
    )


def _check_matches(
  checkpointer: Any,
  path: pathlib.Path,
  abstract_state: Any,
  part: tuple[str, ...] | None,
  allow_extra: bool,
) -> _parts.Choice:
  try:
    metadata = checkpointer.metadata(path.absolute())
  except Exception:  # No metadata to compare: Orbax's restore says why.
    return _parts.Choice(part or (), False, {})
  tree = getattr(metadata, 'item_metadata', metadata)
  held = {}
  for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    shape = getattr(leaf, 'shape', None)
    if shape is None:
      continue
    parts = _parts_of(keypath)
    if parts[-1:] == ('value',):  # An nnx.Variable's array.
      parts = parts[:-1]
    dtype = np.dtype(getattr(leaf, 'dtype', None) or np.float32)
    held[parts] = _sources.Held(tuple(shape), dtype, dtype)
  if not held:  # Unreadable metadata (a damaged checkpoint): Orbax says.
    return _parts.Choice(part or (), False, {})
  name = f'The Orbax checkpoint {str(path)!r}'
  choice = _parts.choose(held, abstract_state, part, name)
  rebuild = REBUILD
  if choice.part:
    held = _parts.inside(held, choice.part)
    name = f'The part {choice.prefix} of the Orbax checkpoint {str(path)!r}'
  else:
    rebuild += choice.hint()
  wanted = []
  for keypath, variable in jax.tree_util.tree_flatten_with_path(
    abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable)
  )[0]:
    value = _spec.value_of(variable)
    if not hasattr(value, 'shape') or jax.dtypes.issubdtype(
      value.dtype, jax.dtypes.prng_key
    ):
      continue  # Keys are stored as their data: Orbax checks them.
    wanted.append(_Wanted(_parts_of(keypath), tuple(value.shape), value.dtype))
  source = _sources.Source(
    name, 'an Orbax checkpoint', 'saved', selects=False, rebuild=rebuild
  )
  extra = _sources.check_extra(
    abstract_state, held, source, allow_extra=allow_extra
  )
  # Orbax converts dtypes on restore, as it always did here.
  _sources.check_held(wanted, held, source, convert_dtypes=True, extra=extra)
  return choice


def unverified(path: pathlib.Path) -> str:
  """What the restore of the Orbax checkpoint at `path` could not check."""
  ocdbt = (path / 'manifest.ocdbt').is_file() or any(
    path.glob('ocdbt.process_*/manifest.ocdbt')
  )
  return _UNVERIFIED_OCDBT if ocdbt else _UNVERIFIED_PLAIN


def _damage(error: BaseException) -> tuple[str | None, str] | None:
  """(the variable read, TensorStore's message) if `error` says the
  checkpoint's bytes failed a check of the format, else None."""
  seen = 0
  while error is not None and seen < 8:
    text = ' '.join(str(error).split())
    if _DAMAGE.search(text):
      text = text.split(' [tensorstore_spec=')[0]
      text = text.split(' [source locations=')[0]
      reading = _READING.search(text)
      name = None
      if reading:
        key = reading.group(1).split('/')[0]
        name = key.removesuffix('.value').replace('.', '/')
      return name, text[:800]
    error = error.__cause__ or error.__context__
    seen += 1
  return None


def restore(
  path: pathlib.Path,
  abstract_model: Any,
  mesh: jax.sharding.Mesh,
  rules: _logical.RulesLike | None = None,
  *,
  part: tuple[str, ...] = (),
  allow_extra: bool = False,
) -> Any:
  """Restores an Orbax checkpoint of ``nnx.state(model)`` onto `mesh`.

  Args:
    path: The checkpoint directory (see `find_checkpoint`).
    abstract_model: The model from ``nnx.eval_shape``.
    mesh: Where to place it.
    rules: The rules; default the rules in effect.
    part: The group of the checkpoint holding the model (`check_matches`);
      ``()`` for the whole checkpoint.
    allow_extra: Ignore variables of the checkpoint (of `part`) the model
      lacks.

  Returns:
    The restored module, every array read into its planned sharding.

  Raises:
    DamagedExportError: If TensorStore finds the checkpoint's bytes damaged
      as it reads them (a checksum of the format, a compressed chunk that
      does not decode, a file too short); the message names the variable.
    ExportError: If the checkpoint cannot be read, lacks a variable of the
      model, holds one the model lacks, or holds one with another shape;
      the message names the variable.
  """
  import orbax.checkpoint as ocp

  rules_ = _context.rules_in_effect(rules)
  graphdef, abstract_state = nnx.split(abstract_model)

  def target(keypath: Any, variable: nnx.Variable) -> nnx.Variable:
    resolution = _spec.spec_of_variable(
      variable,
      rules=rules_,
      mesh=mesh,
      path=_variables.keypath_str(keypath),
    )
    spec = resolution.spec if resolution is not None else PartitionSpec()
    value = _spec.value_of(variable)
    return variable.replace(
      jax.ShapeDtypeStruct(
        value.shape, value.dtype, sharding=NamedSharding(mesh, spec)
      )
    )

  wanted = jax.tree_util.tree_map_with_path(
    target, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable)
  )
  nested: Any = wanted
  for name in reversed(part):
    nested = {name: nested}
  with ocp.StandardCheckpointer() as checkpointer:
    _check_matches(
      checkpointer, path, abstract_state, part or None, allow_extra
    )
  try:
    if part or allow_extra:  # The checkpoint's other variables left out.
      with ocp.PyTreeCheckpointer() as checkpointer:
        state = checkpointer.restore(
          path.absolute(),
          args=ocp.args.PyTreeRestore(
            item=nested,
            restore_args=ocp.checkpoint_utils.construct_restore_args(nested),
            partial_restore=True,
          ),
        )
      for name in part:
        state = state[name]
    else:
      with ocp.StandardCheckpointer() as checkpointer:
        state = checkpointer.restore(path.absolute(), wanted)
  except Exception as e:
    damage = _damage(e)
    if damage is not None:
      name, text = damage
      where = f' of {name!r}' if name else ''
      raise _errors.DamagedExportError(
        f'The Orbax checkpoint {str(path)!r} is damaged: reading the '
        f'array{where}, TensorStore found bytes that fail a check of its '
        f'format ({text}). Nothing was written. Export from an intact copy '
        'of the checkpoint, or save it again.'
      ) from e
    message = ' '.join(str(e).split())[:300]
    raise _errors.ExportError(
      f'Cannot restore the Orbax checkpoint {str(path)!r} into the model: '
      f'{type(e).__name__}: {message}. Expected a checkpoint of '
      f'nnx.state(model) for this model. {_FIX}'
    ) from e
  if part or allow_extra:
    nnx.replace_by_pure_dict(abstract_state, _pure(state))
    return nnx.merge(graphdef, abstract_state)
  return nnx.merge(graphdef, state)


def _pure(state: Any) -> Any:
  """The arrays of a restored tree (of variables, or of their values)."""
  if isinstance(state, nnx.State):
    return nnx.to_pure_dict(state)
  return jax.tree.map(
    lambda x: x.get_value() if isinstance(x, nnx.Variable) else x,
    state,
    is_leaf=lambda x: isinstance(x, nnx.Variable),
  )
