"""A second `init` of a configuration in one compiled call: the replay.

The eager build in shards runs the factory's own Python and one compiled
initializer per variable (`_creation.create`). For a model of many small
variables that per-variable work (the module code, each draw from an
``nnx.Rngs``, a dispatch per initializer) costs 20x Flax's cached
``nnx.jit(factory)`` call. So the first build records, for every variable,
the initializer it ran and which draw of which stream of the ``nnx.Rngs``
passed in its key was; a second call of the same configuration computes
every variable in one compiled call, rebuilds the module from the first
build's graph definition (``nnx.merge``), and advances the caller's streams
as the factory did.

In the program, the draws are made inside it, and the calls of one
compiled initializer run in one loop (``lax.map``: one compile of the body
whatever the count, and each member computed by the arithmetic of the
eager call for its own shape; ``vmap`` would vectorize across members and
move values by an ulp, and 200 separate calls take 10x the compile). The
arrays no initializer call gave (a bias of plain zeros, unannotated) come
from the factory traced in the same program; the rest of that trace is
dead code, which XLA drops.

A build is replayed only where that is the whole story (`record` says):
one process; its state holds at least `MIN_ARRAYS` arrays; the arguments
passed hold graph nodes only (no arrays whose values the factory might
read), whose state is their streams' keys and counts; each key an
initializer was given is a draw ``fold_in(key, count)`` of such a stream,
or, where nothing at all is passed, a key the factory made itself (an
``nnx.Rngs(0)`` in its body); and the module holds no node of the
arguments. Anything else is built as before.

The program keeps no array of the caller's: a changed seed passed in is a
changed input, not a new compile. The keys a factory made itself are
constants of the program, as in a jitted factory's trace: they follow
from the configuration (`_init_cache.key`: its code, closure and globals,
where a seed written in the factory lies), so a changed seed there is
another configuration, built anew. Its values equal the eager build's:
the same draws, the same initializers, compiled with the same options
(`_creation.COMPILER_OPTIONS`).
The first build pays the program's compile (2.3 s for 200 small variables
on 8 CPU devices, against Flax's jitted factory's ~60 s).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from flax_dtensor._rules import _meshes


@dataclasses.dataclass(frozen=True)
class Created:
  """One call of `_creation.create` computed in its shards.

  Attributes:
    group: What determines the compiled initializer (its call's key, the
      spec and the mesh).
    run: The initializer of one key (the other arguments compiled in).
    spec: The output's partition spec, on the Auto copy of the mesh.
    key: The key it was given.
    out: What `create` returned.
  """

  group: Any
  run: Callable[[Any], Any]
  spec: Any
  key: Any
  out: Any


MIN_ARRAYS = 64
"""The fewest arrays a module's state holds for its build to be recorded:
below, the eager build's per-variable work costs less than compiling the
replay's program (about 10 ms a variable on 8 CPU devices)."""

_state = threading.local()


@contextlib.contextmanager
def recording() -> Iterator[list[Created]]:
  """Collects the `Created` calls of the block (this thread's)."""
  old = getattr(_state, 'records', None)
  _state.records = records = []
  try:
    yield records
  finally:
    _state.records = old


def is_recording() -> bool:
  return getattr(_state, 'records', None) is not None


def note(created: Created) -> None:
  """Called by `create` for each value it computed in its shards."""
  records = getattr(_state, 'records', None)
  if records is not None:
    records.append(created)


def _streams(nodes: Sequence[Any]) -> list[Any]:
  """The ``nnx.RngStream``s of `nodes`, in graph order (the same for every
  call of one configuration: its key holds the nodes' graph definitions)."""
  found = []
  for node in nodes:
    for _, x in nnx.iter_graph(node):
      if isinstance(x, nnx.RngStream):
        found.append(x)
  return found


def _is_key(x: Any) -> bool:
  return (
    isinstance(x, jax.Array)
    and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    and x.shape == ()
  )


@dataclasses.dataclass(frozen=True)
class Replay:
  """A configuration's build as one compiled call (see the module doc).

  Attributes:
    graphdef: The module's graph definition, from the first build.
    treedef: The tree of its state's arrays.
    compiled: The program: the streams' key data and counts in, the
      state's arrays out.
    shardings: Where each array of the state goes (the first build's).
    deltas: How far the factory advanced each stream.
  """

  graphdef: Any
  treedef: Any
  compiled: Any
  shardings: tuple[Any, ...]
  deltas: tuple[int, ...]

  def __call__(self, nodes: Sequence[Any], mesh: Mesh) -> Any:
    streams = _streams(nodes)
    if len(streams) != len(self.deltas):
      return None
    auto = _meshes.auto_copy(mesh)
    data = [
      _meshes.retype(jax.random.key_data(s.key[...]), auto) for s in streams
    ]
    counts = [_meshes.retype(s.count[...], auto) for s in streams]
    with jax.set_mesh(auto):
      out, counts = self.compiled(data, counts)
    moved = [
      i
      for i, (x, s) in enumerate(zip(out, self.shardings, strict=True))
      if x.sharding != s
    ]
    if moved:  # The caller's mesh is not all Auto: zero-copy, one call.
      placed = jax.device_put(
        [out[i] for i in moved], [self.shardings[i] for i in moved]
      )
      for i, x in zip(moved, placed, strict=True):
        out[i] = x
    # Each stream's count as the factory's draws left it (computed in the
    # program: no dispatch here).
    for stream, count in zip(streams, counts, strict=True):
      old = stream.count.get_value()
      stream.count.set_value(_meshes.put(count, old.sharding))
    state = jax.tree_util.tree_unflatten(self.treedef, out)
    return nnx.merge(self.graphdef, state)


def record(
  built: Any,
  records: Sequence[Created],
  before: Sequence[Any],
  nodes: Sequence[Any],
  mesh: Mesh,
  rerun: Callable[[list[Any]], Any],
  options: dict[str, Any],
) -> Replay | None:
  """The replay of a first build, or None where it would not be the same.

  Args:
    built: What the factory returned, placed.
    records: The `create` calls of its build.
    before: A copy of the graph nodes passed, as they were before the build.
    nodes: Those nodes, after it.
    mesh: The caller's mesh.
    rerun: The factory called on nodes like `nodes` (traced, in the
      program, for the arrays no `create` call gave: a bias an
      initializer of the user's zeros, say; the rest of its trace is
      dead code that XLA drops).
    options: XLA's options, those the initializers were compiled with
      (`_creation.COMPILER_OPTIONS`).
  """
  streams, old = _streams(nodes), _streams(before)
  # One process: the draws are compared by their values, which a key laid
  # over several processes' devices does not give here.
  if not records or len(streams) != len(old) or jax.process_count() > 1:
    return None
  graphdef, state = nnx.split(built)
  leaves, treedef = jax.tree_util.tree_flatten(state)
  by_out = {id(r.out): i for i, r in enumerate(records)}
  if len(leaves) < MIN_ARRAYS or _shares_nodes(built, nodes):
    return None
  others = [i for i, x in enumerate(leaves) if id(x) not in by_out]
  slots = _slots(before, old) if others else []
  if slots is None:
    return None
  # Which draw of which stream each key was: fold_in(key, count) for the
  # counts the factory went through, computed at once per stream.
  draws: dict[tuple[str, bytes], tuple[int, int]] = {}
  deltas = []
  for s, (now, was) in enumerate(zip(streams, old, strict=True)):
    key, start = was.key[...], was.count[...]
    if not _is_key(key) or np.shape(start) != ():
      return None
    first, last = int(start), int(now.count[...])
    deltas.append(last - first)
    if last <= first:
      continue
    impl = str(jax.random.key_impl(key))
    counts = jnp.arange(first, last, dtype=jnp.uint32)
    data = np.asarray(
      jax.vmap(lambda c, k=key: jax.random.key_data(jax.random.fold_in(k, c)))(
        counts
      )
    )
    for j in range(last - first):
      draws[(impl, data[j].tobytes())] = (s, j)
  # (call, stream, draw), or (call, None, the key's data) for a key the
  # factory made from its own constants (`nnx.Rngs(0)` in its body), kept
  # only where nothing is passed: the configuration's key then determines
  # it, as a jitted factory's trace does.
  plan: list[tuple[Created, int | None, Any] | None] = []
  for x in leaves:
    if id(x) not in by_out:
      plan.append(None)
      continue
    r = records[by_out[id(x)]]
    if not _is_key(r.key):
      return None
    data = np.asarray(jax.random.key_data(r.key))
    found = draws.get((str(jax.random.key_impl(r.key)), data.tobytes()))
    if found is None and nodes:
      return None
    plan.append((r, *found) if found is not None else (r, None, data))
  shardings = tuple(x.sharding for x in leaves)
  auto = _meshes.auto_copy(mesh)
  example = (
    [_meshes.retype(jax.random.key_data(s.key[...]), auto) for s in old],
    [_meshes.retype(s.count[...], auto) for s in old],
  )
  impls = [jax.random.key_impl(s.key[...]) for s in old]
  rest = None
  if others:
    nodes_def = nnx.graphdef(list(before))
    nodes_tree = jax.tree_util.tree_structure(nnx.state(list(before)))
    rest = _Rest(rerun, nodes_def, nodes_tree, slots, impls)
  # Each array computed where it goes (on the Auto copy of the mesh).
  out_shardings = [
    NamedSharding(auto, x.sharding.spec)
    if isinstance(x.sharding, NamedSharding)
    and _meshes.same_devices(x.sharding.mesh, auto)
    else None
    for x in leaves
  ]
  compiled = _compile(
    plan, impls, example, auto, rest, out_shardings, options, deltas
  )
  return Replay(graphdef, treedef, compiled, shardings, tuple(deltas))


def _shares_nodes(built: Any, nodes: Sequence[Any]) -> bool:
  """Whether the module holds a node of the arguments (a replay would
  hold a copy)."""

  def held(root: Any) -> set[int]:
    return {
      id(x)
      for _, x in nnx.iter_graph(root)
      if nnx.graph.is_graph_node(x) or isinstance(x, nnx.Variable)
    }

  theirs = set().union(*(held(node) for node in nodes))
  return not theirs.isdisjoint(held(built))


def _slots(
  before: Sequence[Any], streams: Sequence[Any]
) -> list[tuple[str, int]] | None:
  """For each array of the nodes' state: ('key' or 'count', its stream);
  None if they hold anything else."""
  where = {}
  for s, stream in enumerate(streams):
    where[id(stream.key.get_value())] = ('key', s)
    where[id(stream.count.get_value())] = ('count', s)
  slots = [where.get(id(x)) for x in jax.tree.leaves(nnx.state(list(before)))]
  return None if None in slots else slots


@dataclasses.dataclass(frozen=True)
class _Rest:
  """How the program builds the arrays no `create` call gave."""

  rerun: Callable[[list[Any]], Any]
  nodes_def: Any
  nodes_tree: Any
  slots: list[tuple[str, int]]
  impls: list[Any]

  def leaves(self, data: list[Any], counts: list[Any]) -> list[Any]:
    values = [
      jax.random.wrap_key_data(data[s], impl=self.impls[s])
      if kind == 'key'
      else counts[s]
      for kind, s in self.slots
    ]
    nodes = nnx.merge(
      self.nodes_def, jax.tree_util.tree_unflatten(self.nodes_tree, values)
    )
    return jax.tree.leaves(nnx.state(self.rerun(nodes)))


def _compile(
  plan: list[tuple[Created, int | None, Any] | None],
  impls: list[Any],
  example: tuple[list[Any], list[Any]],
  auto: Mesh,
  rest: _Rest | None,
  out_shardings: list[Any],
  options: dict[str, Any],
  deltas: list[int],
) -> Any:
  """The program of `Replay`: each kind of initializer once, over its keys
  (compiled for arguments laid out as `example`'s)."""
  groups: dict[Any, list[int]] = collections.defaultdict(list)
  for i, p in enumerate(plan):
    if p is not None:
      made = p[1] is None
      impl = jax.random.key_impl(p[0].key) if made else impls[p[1]]
      groups[(p[0].group, str(impl), made)].append(i)

  def program(data: list[Any], counts: list[Any]) -> list[Any]:
    out: list[Any] = [None] * len(plan)
    if rest is not None:
      built = rest.leaves(data, counts)
      for i, p in enumerate(plan):
        if p is None:
          out[i] = built[i]
    for (_, _, made), members in groups.items():
      run = plan[members[0]][0].run
      if made:  # The keys themselves, constants of the program.
        keys = jax.random.wrap_key_data(
          jnp.asarray(np.stack([plan[i][2] for i in members])),
          impl=jax.random.key_impl(plan[members[0]][0].key),
        )
        values = jax.lax.map(lambda k, run=run: run(k), keys)
        for j, i in enumerate(members):
          out[i] = values[j]
        continue
      stream = [plan[i][1] for i in members]
      keys = jax.random.wrap_key_data(
        jnp.stack([data[s] for s in stream]), impl=impls[stream[0]]
      )
      at = jnp.stack([counts[s] for s in stream]) + jnp.asarray(
        [plan[i][2] for i in members], dtype=jnp.uint32
      )
      # A loop, not `vmap`: each member computed by the very arithmetic
      # (vector code for its own shape) of the eager build's call.
      values = jax.lax.map(
        lambda kc, run=run: run(jax.random.fold_in(*kc)), (keys, at)
      )
      for j, i in enumerate(members):
        out[i] = values[j]
    return out, [c + jnp.uint32(d) for c, d in zip(counts, deltas, strict=True)]

  with jax.set_mesh(auto):
    return (
      jax.jit(
        program,
        out_shardings=(out_shardings, [c.sharding for c in example[1]]),
      )
      .lower(*example)
      .compile(options)
    )
