"""`suggest_rules`: rules proposed for a model, from what it says.

The model is built abstractly and read: the logical names its annotations
carry get logical rules (`_suggest_roles.Names`, chosen by the bytes each
device holds); the variables without them are read by their paths and
shapes: a preset (`_presets`) recognised from the paths, or the generic
proposal (the largest dimension that divides on the fsdp-like axis, the
next on the model axis), sharded further until a memory budget fits
(`_suggest_search`). Given inputs, the forward is traced on them too
(`_suggest_forward`): the logical names it constrains activations with and
no variable has (``'batch'``) get rules of their own. `RulesSuggestion`
holds the rules, the plan under them, and why each variable goes where.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh

from flax_dtensor import _errors, _text
from flax_dtensor._placement import _abstract_build, _trees
from flax_dtensor._planning import (
  _plan,
  _plan_build,
  _presets,
  _suggest_forward,
  _suggest_roles,
  _suggest_search,
)
from flax_dtensor._rules import _logical, _partition_specs

DEFAULT_MIN_BYTES = 2**16
"""Variables below this size are replicated unless a budget needs them."""

_UNTRACED_TEXT = (
  'The forward was not traced (no inputs given), so the logical names it '
  "constrains activations with (such as 'batch') have no rules here: "
  'pass inputs= (the command line: --input-shape) to trace it, or add a '
  "rule for each, e.g. ['batch', 'data']."
)


@dataclasses.dataclass(frozen=True, repr=False)
class RulesSuggestion:
  """Rules proposed by `suggest_rules`, and why each variable goes where.

  Print it for the report, write it (`write`) for a rules file that
  ``flax-dtensor plan --rules`` and `LogicalRules.from_yaml` read.

  Attributes:
    rules: The proposed `LogicalRules`: path rules (each with a note that
      says where it comes from, shown in the plan's `source` column), the
      logical rules a preset's targets need, and the threshold.
    plan: The plan under `rules`, the optimizer's state included when one
      was given.
    preset: The preset used (``'hf_llama'``, ``'gemma'``, ``'gpt2'``), or
      None for the generic proposal.
    recognition: How the preset was chosen, or why none was.
    axes: The mesh axes taken as ``{'fsdp': ..., 'model': ...}`` (None
      where the mesh has no axis for that role).
    reasons: ``{path: why}`` for every variable of the model (the
      optimizer's state follows its parameter).
    budget: The budget in bytes per device, or None.
    notes: What else the proposal did: preset rules left out, thresholds
      lowered.
    logical_names: ``{name: its targets, in priority order}`` for each
      logical name the model's annotations use, for which the rules were
      proposed (empty when no variable is annotated).
    forward_names: ``{name: its targets}`` for each logical name that only
      the forward uses (an activation's ``with_logical_constraint``, found
      by tracing it on `inputs`): a batch name on the fsdp-like axis then
      None, any other None.
    traced_on: The inputs the forward was traced on, as text
      (``'int32[16,128]'``), or None when it was not traced (no `inputs`):
      then the names only the forward uses are unknown here.
  """

  rules: _logical.LogicalRules
  plan: _plan.ShardingPlan
  preset: str | None
  recognition: str
  axes: dict[str, str | None]
  reasons: dict[str, str]
  budget: int | None
  notes: tuple[str, ...]
  logical_names: dict[str, tuple[Any, ...]] = dataclasses.field(
    default_factory=dict
  )
  forward_names: dict[str, tuple[Any, ...]] = dataclasses.field(
    default_factory=dict
  )
  traced_on: str | None = None

  @property
  def bytes_per_device(self) -> int:
    """What one device holds under `rules` (the plan's count)."""
    return self.plan.bytes_per_device

  @property
  def fits(self) -> bool | None:
    """Whether `bytes_per_device` is within the budget (None without)."""
    if self.budget is None:
      return None
    return self.bytes_per_device <= self.budget

  def budget_text(self) -> str:
    """One sentence on the budget: met, or the smallest total found."""
    total = _text.human_bytes(self.bytes_per_device)
    ideal = _text.human_bytes(math.ceil(self.plan.ideal_bytes_per_device))
    if self.budget is None:
      return f'{total} per device (ideal {ideal}); no budget given.'
    budget = _text.human_bytes(self.budget)
    if self.fits:
      return f'{total} per device fits the budget of {budget} (ideal {ideal}).'
    why = (
      f'even the ideal (every byte split over every device) is {ideal}'
      if self.plan.ideal_bytes_per_device > self.budget
      else f'the ideal is {ideal}, which no layout reaches where '
      'dimensions do not divide'
    )
    return (
      f'Does not fit: the smallest total found is {total} per device '
      f'({self.bytes_per_device:,} bytes), above the budget of {budget} '
      f'({self.budget:,} bytes); {why}. Use more devices, a smaller '
      'optimizer state, or a larger budget.'
    )

  def to_yaml(self) -> str:
    """The rules file: a comment header, then `LogicalRules.to_yaml_text`."""
    where = ', '.join(
      f'{k}={v}' for k, v in (self.plan.mesh_axes or {}).items()
    )
    # The file says what its rules are for; why no preset applied (each
    # preset's missing names) is the report's, not the rules file's.
    source = (
      self.recognition
      if self.preset is not None
      else (
        "from the model's own annotations"
        if self.logical_names
        else 'the generic proposal (no naming preset applies)'
      )
    )
    lines = [
      '# Rules proposed by flax_dtensor.suggest_rules: edit them freely.',
      f'# Mesh {where}; {source}.',
      f'# {self.budget_text()}',
    ]
    if self.traced_on is None and self.logical_names:
      lines += [f'# {line}' for line in _text.wrap_words(_UNTRACED_TEXT, 78)]
    body = self.rules.to_yaml_text()
    if self.forward_names:
      # Above the rules of the names only the forward uses (listed first).
      comment = ''.join(
        f'  # {line}\n' for line in _text.wrap_words(self.forward_text(), 76)
      )
      head, sep, rest = body.partition('logical_axis_rules:\n')
      body = head + sep + comment + rest
    return '\n'.join(lines) + '\n' + body

  def forward_text(self) -> str:
    """One sentence on the names only the forward uses (found at run time,
    by tracing it), and what their rules do; '' if there are none."""
    if not self.forward_names:
      return ''
    names = '; '.join(
      f'{name!r} -> '
      + ', '.join(_partition_specs.format_entry(t) for t in targets)
      for name, targets in self.forward_names.items()
    )
    return (
      "Logical names found only at run time, in the forward's activation "
      f'constraints (traced on {self.traced_on}), not on any variable: '
      f'{names}. Each ends in a rule to None (replicated); a batch name '
      'goes on the fsdp-like axis first (data parallelism).'
    )

  def write(self, path: str | os.PathLike[str]) -> pathlib.Path:
    """Writes `to_yaml` to `path` and returns the path.

    Raises:
      LogicalRulesError: If the file cannot be written.
    """
    target = pathlib.Path(path)
    try:
      target.write_text(self.to_yaml())
    except OSError as e:
      raise _errors.LogicalRulesError(
        f'Cannot write the rules file {str(target)!r}: '
        f'{e.strerror or e}. Expected a writable path, e.g. rules.yaml in '
        'an existing directory.'
      ) from e
    return target

  def summary(self) -> str:
    """The report without its per-variable lines: the preset or why none,
    the mesh axes taken, the budget, and the notes."""
    lines = [
      f'Suggested rules: {self.recognition}.',
      f'Mesh axes: fsdp-like {self.axes["fsdp"]!r}, model '
      f'{self.axes["model"]!r}.',
    ]
    if self.logical_names:
      lines.append(
        "Logical names from the model's annotations: "
        + '; '.join(
          f'{name!r} -> '
          + ', '.join(_partition_specs.format_entry(t) for t in targets)
          for name, targets in self.logical_names.items()
        )
        + '.'
      )
    if self.forward_names:
      lines.append(self.forward_text())
    elif self.traced_on is None and self.logical_names:
      lines.append(_UNTRACED_TEXT)
    lines += [
      self.budget_text(),
    ]
    lines += [f'Note: {note}' for note in self.notes]
    return '\n'.join(lines)

  def __str__(self) -> str:
    lines = [self.summary()]
    by_path = {e.path: e for e in self.plan.entries}
    width = max((len(p) for p in self.reasons), default=0)
    for path, why in self.reasons.items():
      e = by_path[path]
      lines.append(
        f'  {path:<{width}}  {_partition_specs.format_spec(e.spec)}  '
        f'{_text.human_bytes(e.bytes_per_device)}  {why}'
      )
    return '\n'.join(lines)

  __repr__ = __str__


def _options(budget: Any, min_bytes: Any, style: Any) -> None:
  for name, value, low in (('budget', budget, 1), ('min_bytes', min_bytes, 0)):
    if value is None and name == 'budget':
      continue
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
      raise _errors.LogicalRulesError(
        f'`{name}` must be an int >= {low} (bytes'
        + (' per device' if name == 'budget' else '')
        + f'); got {value!r}.'
      )
  if style is not None:
    _presets.by_style(style)


def _abstract(target: Any, mesh: Any, optimizer: Any) -> tuple[Any, Any]:
  """(model, optimizer) as abstract values, whatever was given."""
  lenient = _logical.LogicalRules([], unknown='replicate')
  if _trees.is_array_tree(target):
    tree = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), target
    )
    return tree, optimizer
  if _plan_build.is_factory(target):
    target = _abstract_build.build_abstract(target, mesh=mesh, rules=lenient)
  elif nnx.graph.is_node(target):
    node = (
      (target, optimizer) if isinstance(optimizer, nnx.Optimizer) else target
    )
    graphdef, state = nnx.split(node)
    state = jax.tree.map(
      lambda x: (
        jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, 'shape') else x
      ),
      state,
    )
    node = nnx.merge(graphdef, state)
    target, optimizer = (
      node if isinstance(optimizer, nnx.Optimizer) else (node, optimizer)
    )
  if optimizer is not None and not isinstance(target, nnx.State):
    optimizer = _plan_build.optimizer_of(target, optimizer, mesh, lenient)
  return target, optimizer


def suggest_rules(
  model_or_factory: Any,
  mesh: Mesh | AbstractMesh,
  *,
  budget: int | None = None,
  optimizer: Any = None,
  style: str | None = None,
  min_bytes: int = DEFAULT_MIN_BYTES,
  inputs: Any = None,
  method: str = '__call__',
) -> RulesSuggestion:
  """Proposes rules for a model, from what it says, with the reasons.

  The model is built abstractly (nothing is allocated) and read:

  - **The logical names of its annotations** (``nnx.with_partitioning``)
    each get logical rules: targets in priority order, the model axis or
    the fsdp-like axis first (by the name's role in the presets where it
    has one), the other next, then None. A name at a time, the one on the
    most bytes first, the order holding the fewest bytes per device is
    kept; with a budget not met, both axes on one dimension too, and the
    names of small arrays last. `RulesSuggestion.logical_names` lists them.
  - **The logical names of its forward**, given `inputs`: the forward is
    traced on them (abstractly, under the mesh), and every name it
    constrains an activation with (``with_logical_constraint``) that no
    variable has gets rules of its own, listed first: a batch name
    (``'batch'``, ``'activation_batch'``) on the fsdp-like axis (data
    parallelism), then None; any other name None (replicated).
    `RulesSuggestion.forward_names` lists them, and the written file says
    so in a comment. Without `inputs` such names have no rules (the
    report and the file say so).

  The variables without logical names are read by their paths and shapes:

  - **A preset** for a known naming convention, recognised from the paths
    (or named by `style`): Hugging Face-style Llama, Mistral and Qwen
    (``hf_llama``: ``q_proj``, ``gate_proj``, ``embed_tokens``,
    ``lm_head``), Gemma-style (``gemma``: ``q_einsum``, ``kv_einsum``,
    ``input_embedding``), GPT-2-style (``gpt2``: ``c_attn``, ``c_fc``,
    ``wte``). The presets are YAML files in the package, in the
    ``path_rules:`` form; their logical axes are mapped to the mesh
    (``embed`` on the fsdp-like axis, ``heads``, ``kv_heads``, ``mlp`` and
    ``vocab`` on the model axis, each falling back to the other).
  - **Otherwise, the generic proposal**: every variable of at least
    `min_bytes` gets a rule putting its largest dimension that divides on
    the fsdp-like axis and the largest other that divides on the model
    axis. Smaller arrays, and those no axis divides, stay replicated.
    Variables a preset does not cover get the generic proposal too.
  - **With a budget**, variables are sharded further, those that save the
    most bytes first (over every mesh axis that divides, several on one
    dimension if need be), and then, if it still does not fit, the arrays
    below the threshold, largest first, until the plan's bytes per device
    (`ShardingPlan.bytes_per_device`, the optimizer's state included when
    `optimizer` is given) fit. If nothing fits, the report says so with
    the smallest total found.

  The fsdp-like axis is the first mesh axis named ``fsdp``, ``data``,
  ``dp`` or ``batch``; the model axis the first named ``model``, ``tp``,
  ``tensor`` or ``mp`` (else the last axis). Axes of size 1 are not used.

  Args:
    model_or_factory: An NNX module (concrete or abstract), a factory
      taking no arguments that builds one, or a pytree of arrays (a weights
      dict).
    mesh: The mesh (concrete or abstract).
    budget: Bytes per device not to exceed, or None.
    optimizer: Count the optimizer's state too: an optax transformation
      (``nnx.Optimizer(model, tx, wrt=nnx.Param)`` is built abstractly) or
      the model's ``nnx.Optimizer``; as `plan` counts it.
    style: None to recognise the naming convention from the paths; a
      preset's name (``'hf_llama'``, ``'gemma'``, ``'gpt2'``) to use it
      whatever the paths; ``'generic'`` for the generic proposal.
    min_bytes: Variables below this size stay replicated (unless the
      budget needs them sharded).
    inputs: The forward's positional arguments, as ``jax.ShapeDtypeStruct``
      (or arrays, or None), e.g. ``[jax.ShapeDtypeStruct((16, 128),
      jnp.int32)]``; nothing is computed. None not to trace it.
    method: The method of the model that `inputs` are for.

  Returns:
    The `RulesSuggestion`: ``.rules`` for `plan`, `init`, `check` and the
    command line, ``.plan`` under them, ``.reasons`` per variable, and
    ``.write(path)`` for an editable rules file.

  Raises:
    MeshError: If `mesh` is not a mesh.
    LogicalRulesError: If `budget`, `min_bytes`, `style`, `inputs` or
      `method` is invalid, or the forward fails on `inputs`.
    NotAModelError: If `model_or_factory` or `optimizer` is not what it
      should be.

  Example:
    >>> import jax, flax_dtensor as fdt
    >>> from flax import nnx
    >>> mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
    >>> s = fdt.suggest_rules(lambda: nnx.Linear(256, 512, rngs=nnx.Rngs(0)),
    ...                       mesh)
    >>> s.plan['kernel'].spec
    P('model', 'data')
    >>> s.reasons['bias']
    'replicated below the threshold (2048 bytes < min_bytes=65536)'
  """
  if not isinstance(mesh, Mesh | AbstractMesh):
    raise _errors.MeshError(
      f'Expected a mesh for `suggest_rules` (jax.make_mesh or '
      f'jax.sharding.AbstractMesh), got {type(mesh).__name__} {mesh!r:.80}.'
    )
  _options(budget, min_bytes, style)
  abstract_inputs = (
    None if inputs is None else _suggest_forward.as_inputs(inputs)
  )
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
  roles = _suggest_roles.roles(sizes)
  target, opt = _abstract(model_or_factory, mesh, optimizer)
  forward = (
    []
    if abstract_inputs is None
    else _suggest_forward.forward_names(target, abstract_inputs, method, mesh)
  )
  lenient = _logical.LogicalRules([], unknown='replicate')
  entries = _plan_build.plan(
    target, mesh=mesh, rules=lenient, optimizer=opt
  ).entries
  variables = _suggest_search.variables_of(entries)
  preset, recognition = _preset(style, variables)
  names = _suggest_roles.Names(entries, mesh, roles, min_bytes)
  names.search(None, 0)
  proposal = _suggest_search.Proposal(
    variables, preset, roles, sizes, min_bytes, names
  )
  if preset is not None and not proposal.used_preset_rules():
    recognition += '; none of its rules matches, so the proposal is generic'
  rules, why, result = _suggest_search.fit_budget(
    proposal,
    names,
    budget,
    lambda rules: _plan_build.plan(
      target, mesh=mesh, rules=rules, optimizer=opt
    ),
  )
  rules, forward_names = _suggest_forward.with_forward_names(
    rules, forward, roles
  )
  return RulesSuggestion(
    rules=rules,
    plan=result,
    preset=(
      None
      if preset is None or not proposal.used_preset_rules()
      else preset.name
    ),
    recognition=recognition,
    axes=roles,
    reasons=why,
    budget=budget,
    notes=_notes(proposal, names, variables, min_bytes),
    logical_names=names.targets(),
    forward_names=forward_names,
    traced_on=(
      None
      if abstract_inputs is None
      else _suggest_forward.inputs_text(abstract_inputs)
    ),
  )


def _preset(
  style: str | None, variables: Sequence[_suggest_search.Variable]
) -> tuple[_presets.Preset | None, str]:
  """The preset `style` names, or the one the paths match (None for the
  generic proposal), and how it was chosen."""
  if style is None:
    return _presets.recognise(v.path for v in variables)
  preset = _presets.by_style(style)
  if preset is None:
    return None, "the generic proposal, as style='generic' asks"
  missing = preset.missing(
    part for v in variables for part in v.path.split('/')
  )
  return preset, f'preset {preset.name}, as style={style!r} asks' + (
    f' (the paths lack {", ".join(missing)})' if missing else ''
  )


def _notes(
  proposal: _suggest_search.Proposal,
  names: _suggest_roles.Names,
  variables: Sequence[_suggest_search.Variable],
  min_bytes: int,
) -> tuple[str, ...]:
  """What else the proposal did: preset rules left out, annotations kept,
  the threshold lowered."""
  notes = proposal.notes + proposal.left_out()
  annotated = [v.path for v in variables if v.annotated]
  if annotated and names.names:
    notes.append(
      f'{len(annotated)} annotated variables (e.g. {annotated[0]!r}) keep '
      'their logical names; the logical rules are proposed for the names '
      f'they use ({", ".join(map(repr, names.names))}).'
    )
  elif annotated:
    notes.append(
      f'{len(annotated)} annotated variables (e.g. {annotated[0]!r}) keep '
      'their annotations (they name no logical axis: their own sharding '
      'places them).'
    )
  if proposal.threshold() < min_bytes:
    notes.append(
      f'min_bytes lowered from {min_bytes} to {proposal.threshold()}: '
      'arrays below the threshold are sharded too, for the budget.'
    )
  return tuple(notes)
