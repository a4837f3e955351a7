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
`FEATURE_CONTEXT`), so that a failure there names its feature. The export
to a served SavedModel, where a mesh with Explicit axes changes what JAX
writes, also runs each model of `EXPORT_MODELS` in each of
`EXPORT_CONTEXTS` (`export_cells()`): outside ``jax.set_mesh``, inside it,
and inside it under our rules, on ``jax.make_mesh``'s default mesh (every
axis Explicit) and on a mixed one.

A cell either works (its values are compared: placements with the plan
and `nnx.get_partition_spec`, restores bit-exact, served within a
tolerance of JAX at several batch sizes) or is refused with one of
flax_dtensor's errors, and only where JAX itself refuses the same thing:
`REFUSALS` lists those, each with the reason, and `refusal(cell)` finds a
cell's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_dtensor as fdt
from support import maxtext_style

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
  'short annotation',
  'nnx.scan-stacked layers',
  'constrained activations',
  'out_sharding= forwards',
  'tuple and dict results',
  'None argument',
)

EMBED, MLP, LAYERS, BATCH = maxtext_style.EMBED, maxtext_style.MLP, 2, 8
# The batch sizes each SavedModel is served at.
SERVED_BATCHES = (1, 2, 3, 8)

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
SAVED_MODEL = 'save_saved_model (served by TF)'
# Where a SavedModel is exported from on meshes with Explicit axes: outside
# `jax.set_mesh`, inside it, and inside it under our rules.
EXPORT_CONTEXTS = tuple(
  Context(mesh_context, rules, mesh)
  for mesh in ('Explicit', 'mixed')
  for mesh_context, rules in (
    ('no mesh context', 'no rules'),
    ('jax.set_mesh', 'no rules'),
    ('jax.set_mesh', 'fdt.logical_axis_rules'),
  )
)
# The models exported there: a plain one, then one feature each whose
# forward or variables a mesh with Explicit axes changes.
EXPORT_MODELS = (
  (),
  ('0-d variable',),
  ('constrained activations',),
  ('out_sharding= forwards',),
  ('nnx.Rngs and dropout',),
)


@dataclasses.dataclass(frozen=True)
class Cell:
  entry: str
  context: Context
  features: tuple[str, ...] = FEATURES

  @property
  def what(self) -> str:
    """The model: 'all' its features, 'plain' none, else them, '+'-joined."""
    if self.features == FEATURES:
      return 'all'
    return '+'.join(self.features) or 'plain'

  def __str__(self) -> str:
    return f'{self.entry} | {self.context} | {self.what}'

  @property
  def id(self) -> str:
    """A test id: the words of each part, '-' between parts."""
    parts = (self.entry, *dataclasses.astuple(self.context), self.what)
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


def export_cells() -> list[Cell]:
  """The SavedModel export of each of `EXPORT_MODELS` in `EXPORT_CONTEXTS`."""
  return [
    Cell(SAVED_MODEL, c, f)
    for c, f in itertools.product(EXPORT_CONTEXTS, EXPORT_MODELS)
  ]


def runs_on_its_mesh(cell: Cell, batch: int) -> bool:
  """Whether JAX runs the cell's forward on `batch` rows on its own mesh.

  A forward that reshards its batch over the Explicit axis 'data' (2
  devices) runs there for even batches only; on one device (a mesh of the
  same axes, each of size 1) for every batch, unless it names the mesh it
  reshards on (`batch_multiple`).
  """
  reshards = {'constrained activations', 'out_sharding= forwards'}
  explicit = cell.context.mesh in ('Explicit', 'mixed')
  return not (explicit and reshards & set(cell.features) and batch % 2)


def batch_multiple(cell: Cell) -> int:
  """What the served batch must be a multiple of: JAX's own condition.

  A forward that reshards its batch over the Explicit axis 'data' (size 2)
  of a mesh it names (`constrained activations`) runs in JAX only for even
  batches, on that mesh or any other, and so serves only those (exported as
  '2*b', with `fdt_dt.ServedShapeWarning`); any batch otherwise, bare specs
  (`out_sharding= forwards`) included: they trace on one device.
  """
  reshards = 'constrained activations' in cell.features
  return 2 if reshards and cell.context.mesh in ('Explicit', 'mixed') else 1


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
    when=lambda c: c.mesh_context == 'no mesh context',
    condition='no mesh context',
    error='MeshError',
    match='no mesh is set',
    reason=(
      'an annotated variable is placed when it is created, on a mesh: set '
      'one, or use `fdt.init(..., mesh=)`; JAX itself needs a mesh to '
      'place an array by a PartitionSpec'
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
  """The mesh of a kind; 'Explicit' is `jax.make_mesh`'s own default."""
  if kind == 'size-1 axes':
    return maxtext_style.make_mesh()
  if kind == 'Explicit':
    mesh = jax.make_mesh((2, 4), ('data', 'model'))  # As users write it.
    if mesh.axis_types != (AxisType.Explicit,) * 2:
      raise ValueError(f'jax.make_mesh gave {mesh.axis_types}, not Explicit')
    return mesh
  types = {
    'Auto': (AxisType.Auto,) * 2,
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


def short_annotation(context: Context) -> tuple[Any, ...]:
  """The annotation of the 'short annotation' feature's matrix."""
  axes = annotation_axes(context)
  return ('mlp',) if axes is None else (axes.get('mlp'),)


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


def _explicit_axes(mesh: jax.sharding.Mesh) -> set[str]:
  return {
    n
    for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
    if t == AxisType.Explicit
  }


def _only(spec: Any, axes: set[str]) -> P:
  """`spec` with only the mesh axes in `axes` (the others replicated)."""
  dims = []
  for entry in tuple(spec):
    kept = (entry,) if isinstance(entry, str) else tuple(entry or ())
    dims.append(tuple(a for a in kept if a in axes) or None)
  return P(*dims)


def constrain(x, mesh, spec, *, bare: bool = False):
  """Places `x` as users write it for the mesh's axis types.

  ``jax.sharding.reshard`` to the spec's Explicit axes, then
  ``with_sharding_constraint`` to its Auto axes: one of them on an
  all-Explicit or all-Auto mesh, both on a mixed one. `bare` uses a bare
  PartitionSpec (the mesh is the context's), else `mesh`'s.
  """
  explicit = _explicit_axes(mesh)
  auto = set(mesh.axis_names) - explicit

  def target(axes):
    only = _only(spec, axes)
    return only if bare else NamedSharding(mesh, only)

  if explicit:
    x = jax.sharding.reshard(x, target(explicit))
  if auto:
    x = jax.lax.with_sharding_constraint(x, target(auto))
  return x


def out_sharding(mesh, x, *rest):
  """The `out_sharding=` a forward written for Explicit axes passes.

  `x`'s batch sharding, then `rest` with only the mesh's Explicit axes
  (an op may be told only those); None on a mesh without one, where users
  pass none.
  """
  explicit = _explicit_axes(mesh)
  if not explicit:
    return None
  spec = jax.typeof(x).sharding.spec
  batch = spec[0] if len(spec) else None
  return P(batch, *_only(P(*rest), explicit))


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
    # Contracts over 'mlp', sharded over 'model': on Explicit axes, told
    # where its result goes.
    y = jnp.dot(h, self.wo[...], out_sharding=out_sharding(self.mesh, h, None))
    if self.constrained:
      y = constrain(y, self.mesh, self.spec)
    return x + y


class OutShardingBlock(nnx.Module):
  """Layers called as forwards for Explicit axes call them, with bare specs.

  The batch resharded over the Explicit 'data' axis
  (``jax.sharding.reshard(x, P('data', None))``), then ``nnx.Linear``,
  ``nnx.Einsum`` and ``jnp.dot``, each told where its result goes
  (`out_sharding`): the last two contract over a dimension sharded over
  'model', which JAX refuses on Explicit axes without it. Bare
  `PartitionSpec`s, of the mesh in context: a polymorphic batch serves at
  every size (where the `constrained activations`, which name their mesh,
  serve even sizes only).
  """

  def __init__(self, mesh, names, *, rngs: nnx.Rngs):
    self.mesh = mesh
    self.up = nnx.Linear(
      EMBED,
      MLP,
      use_bias=False,
      kernel_init=nnx.with_partitioning(_LECUN, names('embed', 'mlp')),
      rngs=rngs,
    )
    self.mix = nnx.Einsum(
      'bm,mn->bn',
      (MLP, MLP),
      kernel_init=nnx.with_partitioning(_LECUN, names('mlp', None)),
      rngs=rngs,
    )
    self.down = nnx.Param(
      nnx.with_partitioning(_LECUN, names('mlp', 'embed'))(
        rngs.params(), (MLP, EMBED)
      )
    )

  def __call__(self, x):
    if 'data' in _explicit_axes(self.mesh):
      x = jax.sharding.reshard(x, P('data', None))
    h = self.up(x, out_sharding=out_sharding(self.mesh, x, 'model'))
    h = self.mix(h, out_sharding=out_sharding(self.mesh, h, None))
    return jnp.dot(
      h, self.down[...], out_sharding=out_sharding(self.mesh, h, None)
    )


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
    if self.has('short annotation'):
      # Fewer logical names than dimensions: the second is None (Flax's
      # reading, flax#5127's annotation).
      self.short = nnx.Param(
        nnx.with_partitioning(_LECUN, self.names('mlp'))(
          rngs.params(), (MLP, EMBED)
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
    if self.has('out_sharding= forwards'):
      self.head = OutShardingBlock(mesh, self.names, rngs=rngs)

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
    if self.has('out_sharding= forwards'):
      h = h + self.head(h)
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
  export_models = ', '.join(
    Cell(SAVED_MODEL, FEATURE_CONTEXT, f).what for f in EXPORT_MODELS
  )
  export_contexts = '; '.join(
    f'"{c}"' for c in EXPORT_CONTEXTS if c.mesh == EXPORT_CONTEXTS[0].mesh
  )
  lines.append('')
  lines.append(
    f'`{SAVED_MODEL}` exports with a polymorphic batch (`tf.TensorSpec('
    '[None, 16])`) and is served in a TensorFlow process that cannot '
    f'import JAX, at batches {", ".join(map(str, SERVED_BATCHES))}, each '
    "compared with JAX's forward pass. It also runs for each model of "
    f'{export_models} in each of the contexts {export_contexts}, on the '
    "Explicit mesh (`jax.make_mesh`'s default) and on the mixed one: "
    + (
      'every such cell works.'
      if not any(refusal(c) for c in export_cells())
      else 'see the refusals.'
    )
    + ' A forward that reshards its batch over the Explicit axis `data` '
    '(2 devices) runs in JAX on that mesh for even batches only, and on '
    'one device for every batch: written with bare PartitionSpecs (the '
    'mesh in context), it is traced on one device, as TensorFlow serves '
    "it, and serves every batch with JAX's values there; naming its mesh "
    '(`NamedSharding(mesh, ...)`), it runs for even batches only on any '
    "mesh, and is served so: its batch is exported as '2*b' (with "
    '`fdt_dt.ServedShapeWarning`), and TensorFlow refuses an odd one as '
    'JAX does.'
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
