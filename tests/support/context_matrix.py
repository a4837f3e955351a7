"""The context matrix: every public entry point in every context, as data.

Three lists, and the cells generated from them (tests/bridge/
context_matrix_test.py runs them; docs/compatibility.md shows `table()`):

- `ENTRY_POINTS`: what a user calls.
- `CONTEXTS`: where it is called from, the product of `MESH_CONTEXTS` (no
  mesh context, or inside ``jax.set_mesh``), `RULES` (ours, Flax's own
  ``nnx.logical_axis_rules``, or none: the model then names mesh axes) and
  `MESHES` (Auto, Explicit, mixed, and MaxText's 12 axes, 10 of size 1).
- `FEATURES`: what the model carries. `Model` carries every one of them.

The pruning rule: every entry point runs in every context on `Model`
(`cells()`, the full product); each feature is then run alone
(`feature_cells()`: a model with only that feature, every entry point, in
`FEATURE_CONTEXT`), so that a failure there names its feature.

A cell either works (its values are compared: placements with the plan
and `nnx.get_partition_spec`, restores bit-exact, served within a
tolerance) or is refused with one of flax_dtensor's errors: `REFUSALS`
lists those, each with the reason, and `refusal(cell)` finds a cell's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import maxtext_style
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_dtensor as fdt

ENTRY_POINTS = (
  'eager creation',
  'fdt.init',
  'shard_module',
  'plan(model)',
  'plan(factory)',
  'check(model)',
  'check(factory)',
  'save_checkpoint',
  'save_checkpoint(blocking=False)',
  'restore_checkpoint(abstract)',
  'restore_checkpoint(concrete)',
  'to_tf_module',
  'from_tf_module',
  'save_saved_model (served by TF)',
)
MESH_CONTEXTS = ('no mesh context', 'jax.set_mesh')
RULES = ('fdt.logical_axis_rules', 'nnx.logical_axis_rules', 'no rules')
MESHES = ('Auto', 'Explicit', 'mixed', 'size-1 axes')
FEATURES = (
  '0-d variable',
  'nnx.Rngs and dropout',
  'int variable',
  'bool variable',
  'bfloat16 variable',
  'nnx.scan-stacked layers',
  'constrained activations',
  'tuple and dict results',
  'None argument',
)

EMBED, MLP, LAYERS, BATCH = maxtext_style.EMBED, maxtext_style.MLP, 2, 8

# The rules of the (2, 4) meshes; the size-1 mesh has MaxText's.
RULES_2X4 = (
  ('activation_batch', 'data'),
  ('activation_embed', None),
  ('activation_mlp', 'model'),
  ('embed', None),
  ('mlp', 'model'),
  ('layers', None),
)


@dataclasses.dataclass(frozen=True)
class Context:
  """Where an entry point is called from."""

  mesh_context: str
  rules: str
  mesh: str

  def __str__(self) -> str:
    return f'{self.mesh_context}, {self.rules}, {self.mesh}'


CONTEXTS = tuple(
  Context(*c) for c in itertools.product(MESH_CONTEXTS, RULES, MESHES)
)
# Where each feature runs alone.
FEATURE_CONTEXT = Context('jax.set_mesh', 'fdt.logical_axis_rules', 'Auto')


@dataclasses.dataclass(frozen=True)
class Cell:
  entry: str
  context: Context
  features: tuple[str, ...] = FEATURES

  def __str__(self) -> str:
    what = 'all' if self.features == FEATURES else '+'.join(self.features)
    return f'{self.entry} | {self.context} | {what}'

  @property
  def id(self) -> str:
    """A test id: the words of each part, '-' between parts."""
    what = 'all' if self.features == FEATURES else '+'.join(self.features)
    parts = (self.entry, *dataclasses.astuple(self.context), what)
    return '-'.join(_slug(p) for p in parts)


def _slug(text: str) -> str:
  return ''.join(c if c.isalnum() or c in '_+' else '_' for c in text)


def cells() -> list[Cell]:
  """Every entry point in every context, on the model with every feature."""
  return [Cell(e, c) for e, c in itertools.product(ENTRY_POINTS, CONTEXTS)]


def feature_cells() -> list[Cell]:
  """Every entry point on a model with each feature alone."""
  return [
    Cell(e, FEATURE_CONTEXT, (f,))
    for f, e in itertools.product(FEATURES, ENTRY_POINTS)
  ]


@dataclasses.dataclass(frozen=True)
class Refusal:
  """Cells refused with one of our errors, and why."""

  entries: tuple[str, ...]
  when: Callable[[Context], bool]
  condition: str
  error: str
  match: str
  reason: str

  def error_class(self) -> type[Exception]:
    # Flax's own refusals are ValueErrors; ours are classes of ours.
    return (
      ValueError if self.error == 'ValueError' else getattr(fdt, self.error)
    )


REFUSALS = (
  Refusal(
    entries=('eager creation',),
    when=lambda c: (
      c.mesh_context == 'no mesh context'
      and c.rules == 'fdt.logical_axis_rules'
    ),
    condition='no mesh context, our rules',
    error='MeshError',
    match='no mesh is set',
    reason=(
      'an annotated variable is placed when it is created: set a mesh, or '
      'use `fdt.init(..., mesh=)`'
    ),
  ),
  Refusal(
    entries=('eager creation',),
    when=lambda c: (
      c.mesh_context == 'no mesh context'
      and c.rules != 'fdt.logical_axis_rules'
    ),
    condition="no mesh context, Flax's rules or none",
    error='ValueError',
    match='mesh context or metadata is required',
    reason=(
      "Flax's own error: without our rules in effect flax_dtensor leaves "
      "Flax's creation as it is"
    ),
  ),
  Refusal(
    entries=('eager creation',),
    when=lambda c: (
      c.mesh_context == 'jax.set_mesh'
      and c.mesh == 'mixed'
      and c.rules != 'fdt.logical_axis_rules'
    ),
    condition="a mixed mesh, Flax's rules or none",
    error='ValueError',
    match='all axes as Explicit or all axes as Auto',
    reason=(
      "Flax's own error: Flax places variables on all-Auto or all-Explicit "
      'meshes only; under our rules, or with `fdt.init`, mixed meshes work'
    ),
  ),
)


def refusal(cell: Cell) -> Refusal | None:
  for r in REFUSALS:
    if cell.entry in r.entries and r.when(cell.context):
      return r
  return None


# ---------------------------------------------------------------------------
# Meshes, rules, scopes.


def make_mesh(kind: str) -> jax.sharding.Mesh:
  if kind == 'size-1 axes':
    return maxtext_style.make_mesh()
  types = {
    'Auto': (AxisType.Auto,) * 2,
    'Explicit': (AxisType.Explicit,) * 2,
    'mixed': (AxisType.Explicit, AxisType.Auto),
  }[kind]
  return jax.make_mesh((2, 4), ('data', 'model'), axis_types=types)


def rule_table(context: Context) -> tuple[tuple[str, Any], ...]:
  """The logical names' mesh axes on the context's mesh."""
  if context.mesh == 'size-1 axes':
    return maxtext_style.RULES
  return RULES_2X4


def annotation_axes(context: Context) -> dict[str, Any] | None:
  """What the model names instead of logical names (none: the names)."""
  return dict(rule_table(context)) if context.rules == 'no rules' else None


@contextlib.contextmanager
def scope(context: Context, mesh: jax.sharding.Mesh) -> Iterator[None]:
  """The context: its mesh (or none) and its rules (or none) in effect."""
  with contextlib.ExitStack() as stack:
    if context.mesh_context == 'jax.set_mesh':
      stack.enter_context(jax.set_mesh(mesh))
    if context.rules == 'fdt.logical_axis_rules':
      stack.enter_context(fdt.logical_axis_rules(rule_table(context)))
    elif context.rules == 'nnx.logical_axis_rules':
      stack.enter_context(nnx.logical_axis_rules(rule_table(context)))
    yield


def mesh_kwargs(context: Context, mesh: jax.sharding.Mesh) -> dict[str, Any]:
  """`mesh=` for a call made where no mesh is set."""
  return {'mesh': mesh} if context.mesh_context == 'no mesh context' else {}


def placement(spec: Any, mesh: jax.sharding.Mesh) -> tuple[Any, ...]:
  """A spec as a placement: which mesh axes of size > 1 split each dim.

  Size-1 axes are left out, 1-tuples and strings are one form, trailing
  unsplit dimensions dropped: two specs that place alike compare equal.
  """
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
  dims = []
  for entry in tuple(spec):
    axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
    dims.append(tuple(a for a in axes if sizes[a] > 1))
  while dims and not dims[-1]:
    dims.pop()
  return tuple(dims)


def expected_spec(logical: tuple[Any, ...], context: Context) -> P:
  """The PartitionSpec the rules give these logical names."""
  rules = dict(rule_table(context))
  return P(*(rules.get(n) if n else None for n in logical))


# ---------------------------------------------------------------------------
# The model.


def constrain(x, mesh, spec, *, bare: bool = False):
  """Constrains `x` as MaxText does: reshard on Explicit, else a constraint.

  On a mixed mesh only the spec's Auto axes are constrained. `bare` uses
  a bare PartitionSpec (the mesh is the context's), else `mesh`'s.
  """
  explicit = {
    n
    for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
    if t == AxisType.Explicit
  }
  all_explicit = len(explicit) == len(mesh.axis_names)
  dims = []
  for entry in tuple(spec):
    axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
    if not all_explicit:
      axes = tuple(a for a in axes if a not in explicit)
    dims.append(axes or None)
  spec = P(*dims)
  target = spec if bare else NamedSharding(mesh, spec)
  if all_explicit:
    return jax.sharding.reshard(x, target)
  return jax.lax.with_sharding_constraint(x, target)


_LECUN = nnx.initializers.lecun_normal()


class Layer(nnx.Module):
  """One MLP block; constrains its activations on its own mesh."""

  def __init__(self, mesh, names, spec, constrained, *, rngs: nnx.Rngs):
    self.mesh = mesh
    self.spec = spec
    self.constrained = constrained
    self.wi = nnx.Param(
      nnx.with_partitioning(_LECUN, names('embed', 'mlp'))(
        rngs.params(), (EMBED, MLP)
      )
    )
    self.wo = nnx.Param(
      nnx.with_partitioning(_LECUN, names('mlp', 'embed'))(
        rngs.params(), (MLP, EMBED)
      )
    )

  def __call__(self, x):
    h = jax.nn.gelu(x @ self.wi[...])
    if self.constrained:
      h = constrain(h, self.mesh, self.spec)
    y = h @ self.wo[...]
    if self.constrained:
      y = constrain(y, self.mesh, self.spec)
    return x + y


class Model(nnx.Module):
  """A model with the features of `features` (default: all of `FEATURES`).

  Args:
    mesh: Its mesh, which its forward constrains activations on.
    axes: None to annotate with logical names; else a dict of the mesh
      axes each logical name stands for, annotated instead (no rules).
    rules: The rule table its activation constraints resolve by.
    features: The features it carries.
    rngs: Its RNG streams.
  """

  def __init__(
    self,
    mesh: jax.sharding.Mesh,
    axes: dict[str, Any] | None,
    rules: tuple[tuple[str, Any], ...],
    features: tuple[str, ...] = FEATURES,
    *,
    rngs: nnx.Rngs,
  ):
    self.mesh = mesh
    self.axes = None if axes is None else tuple(axes.items())
    self.rules = rules
    self.features = tuple(features)
    spec = self.spec('activation_batch', None)
    constrained = self.has('constrained activations')
    if self.has('nnx.scan-stacked layers'):

      @nnx.split_rngs(splits=LAYERS)
      @nnx.vmap(
        in_axes=(0,),
        out_axes=0,
        transform_metadata={nnx.PARTITION_NAME: self.names('layers')[0]},
      )
      def stack(rngs):
        return Layer(mesh, self.names, spec, constrained, rngs=rngs)

      self.layers = stack(rngs)
    else:
      self.layer = Layer(mesh, self.names, spec, constrained, rngs=rngs)
    if self.has('0-d variable'):
      self.scale = nnx.Param(jnp.asarray(0.75, jnp.float32))
    if self.has('bfloat16 variable'):
      self.table = nnx.Param(
        nnx.with_partitioning(_LECUN, self.names('embed', 'mlp'))(
          rngs.params(), (EMBED, MLP), jnp.bfloat16
        )
      )
    if self.has('int variable'):
      self.count = nnx.Variable(
        jnp.arange(MLP, dtype=jnp.int32) * 3 - 40,
        out_sharding=self.names('mlp'),
      )
    if self.has('bool variable'):
      self.keep = nnx.Variable(
        jnp.arange(MLP) % 3 != 0, out_sharding=self.names('mlp')
      )
    if self.has('nnx.Rngs and dropout'):
      self.dropout = nnx.Dropout(0.25, rngs=rngs)
      self.rngs = rngs

  def has(self, feature: str) -> bool:
    return feature in self.features

  def names(self, *logical: str | None) -> tuple[Any, ...]:
    if self.axes is None:
      return logical
    axes = dict(self.axes)
    return tuple(axes.get(n) if n else None for n in logical)

  def spec(self, *logical: str | None) -> P:
    rules = dict(self.rules)
    return P(*(rules.get(n) if n else None for n in logical))

  def __call__(self, x, bias=None):
    if self.has('constrained activations'):
      # The batch as the layers leave it (a scan's carry keeps its type).
      x = constrain(x, self.mesh, self.spec('activation_batch', None))
    if self.has('nnx.scan-stacked layers'):

      @nnx.scan(
        in_axes=(nnx.Carry, 0),
        out_axes=nnx.Carry,
        transform_metadata={nnx.PARTITION_NAME: self.names('layers')[0]},
      )
      def run(h, layer):
        return layer(h)

      h = run(x, self.layers)
    else:
      h = self.layer(x)
    if self.has('0-d variable'):
      h = h * self.scale[...]
    if self.has('None argument') and bias is not None:
      h = h + bias
    if self.has('nnx.Rngs and dropout'):
      h = self.dropout(h)
    if self.has('constrained activations'):
      # The context's mesh: a bare PartitionSpec.
      h = constrain(
        h, self.mesh, self.spec('activation_batch', None), bare=True
      )
    aux = h @ (
      self.table[...].astype(jnp.float32)
      if self.has('bfloat16 variable')
      else jnp.ones((EMBED, MLP), jnp.float32)
    )
    if self.has('bool variable'):
      aux = jnp.where(self.keep[...][None], aux, -aux)
    if self.has('int variable'):
      aux = aux + self.count[...].astype(jnp.float32)[None] * 0.01
    if self.has('tuple and dict results'):
      return h, {'hidden': aux, 'total': aux.sum(-1)}
    return h + aux.sum(-1, keepdims=True)


def factory(
  context: Context,
  mesh: jax.sharding.Mesh,
  features: tuple[str, ...] = FEATURES,
  seed: int = 0,
) -> Callable[[], Model]:
  """A function building the context's model (its rngs made inside)."""
  axes, rules = annotation_axes(context), rule_table(context)
  return lambda: Model(
    mesh, axes, rules, features, rngs=nnx.Rngs(seed, dropout=seed + 1)
  )


# ---------------------------------------------------------------------------
# The table of docs/compatibility.md.

TABLE_BEGIN = (
  '<!-- context matrix: generated by tests/support/context_matrix.py -->'
)
TABLE_END = '<!-- end of the context matrix -->'


def _short(entry: str) -> str:
  return entry


def table() -> str:
  """The markdown of docs/compatibility.md's "what works where"."""
  lines = [TABLE_BEGIN, '']
  lines.append(
    '| context | ' + ' | '.join(f'`{e}`' for e in ENTRY_POINTS) + ' |'
  )
  lines.append('| --- ' * (len(ENTRY_POINTS) + 1) + '|')
  used: list[Refusal] = []
  for context in CONTEXTS:
    row = []
    for entry in ENTRY_POINTS:
      r = refusal(Cell(entry, context))
      if r is None:
        row.append('yes')
      else:
        if r not in used:
          used.append(r)
        row.append(f'`{r.error}` ({used.index(r) + 1})')
    lines.append(f'| {context} | ' + ' | '.join(row) + ' |')
  lines.append('')
  lines.append(
    'Each model carries every feature: '
    + ', '.join(FEATURES)
    + '. Each feature is also run alone, through every entry point, in '
    f'the context "{FEATURE_CONTEXT}": '
    + (
      'every such cell works.'
      if not any(refusal(c) for c in feature_cells())
      else 'see the refusals.'
    )
  )
  if used:
    lines.append('')
    lines.append('Refusals:')
    lines.append('')
    for i, r in enumerate(used, 1):
      lines.append(f'{i}. {r.condition}: `{r.error}` ({r.reason}).')
  lines.append('')
  lines.append(TABLE_END)
  return '\n'.join(lines)
