"""One part of a checkpoint of ours restored into a model.

For a step that holds the model beside other state (``model/`` and
``optimizer/``, as the demo's manager saves a training state): `check`
compares the part `_parts.choose` picks with the model from the manifest
alone, before TensorFlow starts; `restore` reads that part into the model
with `restore_checkpoint`, each variable placed as the model's own path
says (path rules see ``layers/0/kernel``, not ``model/layers/0/kernel``).
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from flax_dtensor._placement import _parts, _sources, _variables
from flax_dtensor._rules import _context, _logical, _spec
from flax_dtensor.dtensor._conversion import _selection, _target
from flax_dtensor.dtensor._format import _decode, _model
from flax_dtensor.dtensor._layout import _dtypes


def _held(manifest: _model.Manifest) -> dict[tuple[Any, ...], _sources.Held]:
  out = {}
  for record in manifest.records:
    saved = _dtypes.from_name(record.dtype, manifest.where)
    stored = _dtypes.from_name(record.stored_dtype, manifest.where)
    note = f'saved as {saved}, stored as {stored}' if saved != stored else ''
    out[tuple(record.path)] = _sources.Held(
      tuple(record.shape), stored, saved, note
    )
  return out


def check(
  directory: str,
  target: Any,
  *,
  part: tuple[str, ...] | None,
  allow_extra: bool,
  rebuild: str,
) -> _parts.Choice:
  """The part of the checkpoint at `directory` to restore into `target`.

  Read from the manifest only (no TensorFlow); a checkpoint without one is
  left to the restore.

  Raises:
    ExportError: If the part named holds nothing, several groups match,
      or the part lacks a variable of `target`, holds one `target` lacks
      (unless `allow_extra`), or holds one with another shape or dtype.
  """
  manifest = _decode.read(directory)
  if manifest is None:
    return _parts.Choice((), False, {})
  held = _held(manifest)
  name = f'The checkpoint {directory!r}'
  choice = _parts.choose(held, target, part, name)
  if choice.part:
    held = _parts.inside(held, choice.part)
    name = f'The part {choice.prefix} of the checkpoint {directory!r}'
  else:
    rebuild += choice.hint()
  source = _sources.Source(
    name, 'a checkpoint', 'saved', selects=False, rebuild=rebuild
  )
  extra = _sources.check_extra(target, held, source, allow_extra)
  entries = _selection.select(target, ..., nnx.RngState, what='target')
  _sources.check_held(entries, held, source, convert_dtypes=False, extra=extra)
  return choice


def restore(
  directory: str,
  target: Any,
  part: tuple[str, ...],
  *,
  mesh: jax.sharding.Mesh,
  rules: _logical.RulesLike | None = None,
) -> Any:
  """`target` (abstract) filled from the variables under `part`.

  Each variable's sharding is resolved at its own path first (as
  `restore_checkpoint` would resolve it), then the state is restored as
  the part of a larger one, the checkpoint's other variables ignored.
  Check the part first (`check`): this ignores variables of the part the
  target lacks.
  """
  from flax_dtensor.dtensor._checkpoints import _restore

  rules_ = _context.rules_in_effect(rules)
  graphdef, state = nnx.split(target)
  placed = {}
  for entry in _selection.select(state, ..., nnx.RngState, what='target'):
    sharding = _target.target_sharding(entry, mesh, rules_)
    value = _spec.value_of(entry.variable)
    placed[_variables.path_str(entry.path)] = entry.variable.replace(
      jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding),
      out_sharding=_spec.sharding_for(
        entry.variable, sharding.mesh, sharding.spec
      ),
    )
  flat = [
    (part + tuple(path), placed.get(_variables.path_str(path), variable))
    for path, variable in nnx.to_flat_state(state)
  ]
  restored = _restore.restore_checkpoint(
    directory,
    nnx.from_flat_state(flat),
    mesh=mesh,
    rules=_logical.LogicalRules([]),  # Placed above, by the model's paths.
    allow_extra=True,  # The checkpoint's other parts.
  )
  inner = restored
  for name in part:
    inner = inner[name]
  nnx.replace_by_pure_dict(state, nnx.to_pure_dict(inner))
  return nnx.merge(graphdef, state)
