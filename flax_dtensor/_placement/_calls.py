"""A factory's call, as a compiled or abstract build makes it.

`split` parts a call's arguments into those passed to the build (graph
nodes such as ``nnx.Rngs``, and arrays) and those compiled in (sizes,
dtypes, initializers, positional or keyword); `Split.calling` calls a
factory on other values in place of those passed. `nodes_on` carries the
caller's graph nodes onto a build's mesh and back (`put_back`),
`expect_module` checks that a factory returned a model, and `scope` enters
the mesh and rules a build runs under.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from flax_dtensor import _errors
from flax_dtensor._rules import _context, _logical, _meshes


@contextlib.contextmanager
def scope(
  mesh: _meshes.MeshLike | None,
  rules: _logical.RulesLike | _context.FlaxRules | None,
) -> Iterator[None]:
  """Enters the mesh (``jax.set_mesh``, or ``use_abstract_mesh`` for an
  abstract one) and `logical_axis_rules(rules)`, each if given; `FlaxRules`
  are the context's own (Flax's, or none): nothing is entered for them."""
  with contextlib.ExitStack() as stack:
    if isinstance(mesh, Mesh):
      stack.enter_context(jax.set_mesh(mesh))
    elif mesh is not None:
      stack.enter_context(jax.sharding.use_abstract_mesh(mesh))
    if rules is not None and not isinstance(rules, _context.FlaxRules):
      stack.enter_context(_context.logical_axis_rules(rules))
    yield


def is_node(x: Any) -> bool:
  """Whether `x` is an NNX graph node or variable (passed, not compiled in)."""
  return nnx.graph.is_graph_node(x) or isinstance(x, nnx.Variable)


@dataclasses.dataclass(frozen=True)
class Split:
  """A call's arguments, flattened: `leaves` at the positions `dynamic`
  are passed to the build, the others compiled in."""

  leaves: list[Any]
  treedef: Any
  dynamic: list[int]

  @property
  def passed(self) -> list[Any]:
    """The values passed, in order."""
    return [self.leaves[i] for i in self.dynamic]

  @property
  def nodes(self) -> list[Any]:
    """The graph nodes passed (``nnx.Rngs``), in order."""
    return [x for x in self.passed if is_node(x)]

  def calling(self, fn: Callable[..., Any]) -> Callable[[list[Any]], Any]:
    """`fn` called on other values in place of those passed (traced, or
    abstract), the arguments compiled in as they are; it keeps only those,
    never the values passed."""
    passed = set(self.dynamic)
    statics = [None if i in passed else x for i, x in enumerate(self.leaves)]
    dynamic, treedef = self.dynamic, self.treedef

    def call(values: list[Any]) -> Any:
      full = list(statics)
      for i, value in zip(dynamic, values, strict=True):
        full[i] = value
      a, k = jax.tree_util.tree_unflatten(treedef, full)
      return fn(*a, **k)

    return call


def split(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Split:
  """`args` and `kwargs` split into what a build is passed and the rest."""
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_node)
  dynamic = [
    i for i, x in enumerate(leaves) if is_node(x) or isinstance(x, jax.Array)
  ]
  return Split(leaves, treedef, dynamic)


@contextlib.contextmanager
def nodes_on(nodes: list[Any], mesh: Mesh) -> Iterator[None]:
  """The caller's graph nodes (nnx.Rngs) on `mesh` for a build, and back
  after it: zero-copy where they can, keeping their own Variable objects
  and shardings."""
  originals = nnx.state(nodes, graph=True)
  original_shardings = jax.tree.map(
    lambda x: getattr(x, 'sharding', None), originals
  )
  try:
    nnx.update(
      nodes, jax.tree.map(lambda x: _meshes.retype(x, mesh), originals)
    )
    yield
  finally:
    nnx.update(
      nodes,
      jax.tree.map(put_back, nnx.state(nodes, graph=True), original_shardings),
    )


def put_back(x: Any, sharding: Any) -> Any:
  """`x` moved back to `sharding` (a leaf of a state; None leaves it)."""
  if sharding is None or not isinstance(x, jax.Array) or x.sharding == sharding:
    return x
  return _meshes.put(x, sharding)


def factory_name(factory: Any) -> str:
  """'make_model' (a function), 'nnx.Linear' (a class), for messages."""
  name = getattr(factory, '__qualname__', None) or type(factory).__name__
  return name.replace('.<locals>', '')


def expect_module(built: Any, factory: Any) -> Any:
  """Returns `built`, what `factory` returned, if it is an NNX graph node
  (or a tuple, list or dict of them).

  Called on the value itself, before JAX traces, stages or places it, so a
  factory returning a number, a string or a tuple holding one hears so in
  our words.

  Raises:
    NotAModelError: Naming the type returned.
  """
  leaves = jax.tree.leaves(built, is_leaf=is_node)
  if is_node(built) or (
    isinstance(built, tuple | list | dict)
    and leaves
    and all(is_node(x) for x in leaves)
  ):
    return built
  raise _errors.NotAModelError(
    f'Expected the factory {factory_name(factory)!r} to return an NNX '
    f'module (or another NNX graph node), got {type(built).__name__}: '
    f'{built!r:.100}. Pass a callable that builds the model and returns it, '
    'e.g. lambda: Model(rngs=nnx.Rngs(0)).'
  )


def checked(factory: Callable[..., Any]) -> Callable[..., Any]:
  """`factory`, its result checked by `expect_module` as it returns."""

  def build(*args: Any, **kwargs: Any) -> Any:
    return expect_module(factory(*args, **kwargs), factory)

  return build
