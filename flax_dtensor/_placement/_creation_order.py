"""Path-ruled variables created in their shards, by creation order.

A path rule matches a variable by its path, which Flax only gives a
variable once the model is built: an initializer runs long before. So, under
path rules, a model's modules are first built abstractly (``nnx.eval_shape``,
nothing allocated), recording every module construction in order with the
path the module ends at (`record`). Flax builds a model in the same order
when the same code runs again, so in the concrete build the N-th module
construction is the N-th record (`Order`):

- A *leaf* (a module whose variables are its own, no submodules, e.g.
  ``nnx.Linear``) whose arguments determine it (`_creation.static_key`: no
  user function, no state but arrays and graph nodes) is built under a
  ``jit`` whose output is constrained to each variable's placement, as its
  path in the record says; compiled once per distinct leaf, so 24 identical
  blocks compile twice, not 24 times, and no device computes more than its
  shards.
- Any other module is built as Flax builds it; the variables it creates
  itself are placed as soon as its constructor returns, by the record.

Nothing is trusted blindly: a construction whose class differs from the
record stops the order for the rest of the build, and when the outermost
constructor returns every variable is checked against its actual path
(`_placing.place_by_path_rules`), so a variable whose path or shape the
abstract build did not predict is moved there, never left misplaced.
`notes` keeps, per variable, how it was created, for the plan.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_dtensor._placement import _calls, _creation, _variables
from flax_dtensor._rules import _logical, _meshes, _spec

IN_SHARDS = 'in its shards'
"""A note: built under a jit that computes only its shards."""

MOVED = 'moved when '
"""How every note of a variable created, then moved, starts."""


@dataclasses.dataclass
class Record:
  """One module construction of the abstract build."""

  cls: type
  module: Any = None  # The module, inside the abstract build only.
  path: str | None = None  # Where it ends in the model; None if nowhere.
  leaf: bool = False
  keyable: bool = False  # Its arguments determine it (see `split_args`).
  # Its variables, by path relative to it, as abstract copies.
  variables: dict[str, nnx.Variable] = dataclasses.field(default_factory=dict)


class Recording:
  """Module constructions, in the order they started (the hook, `flax_dtensor._hook`, fills it)."""

  def __init__(self) -> None:
    self.records: list[Record] = []

  def enter(
    self, cls: type, args: tuple[Any, ...] = (), kwargs: Any = None
  ) -> Record:
    record = Record(cls, keyable=split_args(args, kwargs or {}) is not None)
    self.records.append(record)
    return record


def split_args(
  args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[_calls.Split, tuple[Any, ...]] | None:
  """A constructor's arguments, split (`_calls.split`), and their static
  key.

  Graph nodes (``nnx.Rngs``) and arrays are passed to the compiled
  constructor; everything else is compiled in and must determine it
  (`_creation.static_key`). None if something does not (a function of the
  user's, an object).
  """
  split = _calls.split(args, kwargs)
  try:
    static = tuple(
      ('dynamic',) if i in split.dynamic else _creation.static_key(x)
      for i, x in enumerate(split.leaves)
    )
  except _creation.Unkeyable:
    return None
  return split, static


def _children(module: Any) -> list[tuple[Any, Any]]:
  return [
    (key, value)
    for key, value in nnx.graph.iter_children(module)
    if not isinstance(value, nnx.Variable)
  ]


def finish(recording: Recording, built: Any) -> list[Record]:
  """Gives each record its path in the built model, and its variables.

  Called inside the abstract build, on the model it returns: the records'
  modules are that build's own objects (its values are traced). Each
  record keeps abstract copies of its variables, and lets go of the module.
  """
  paths: dict[int, str] = {}
  for path, node in nnx.graph.iter_graph(built):
    if nnx.graph.is_graph_node(node) and not isinstance(node, nnx.Variable):
      paths.setdefault(id(node), _variables.path_str(path))
  for record in recording.records:
    module = record.module
    record.module = None
    if module is None:
      continue
    record.path = paths.get(id(module))
    record.leaf = isinstance(module, nnx.Module) and not any(
      nnx.graph.is_graph_node(value) for _, value in _children(module)
    )
    for path, variable in _variables.iter_variables(module):
      value = _spec.value_of(variable)
      record.variables[_variables.path_str(path)] = variable.replace(
        jax.ShapeDtypeStruct(value.shape, value.dtype)
      )
  return recording.records


# How each variable was created, for the plan: {id(variable): (id of its
# value then, note)}. Variables take no weak references, so an entry counts
# only while the variable still holds that value; the oldest go first.
_notes: collections.OrderedDict[int, tuple[int, str]] = (
  collections.OrderedDict()
)
_NOTES_KEPT = 2**16
_notes_lock = threading.Lock()


def note(variable: nnx.Variable, text: str) -> None:
  """Records how `variable` was created (read by `note_of`)."""
  with _notes_lock:
    _notes[id(variable)] = (id(variable.get_raw_value()), text)
    _notes.move_to_end(id(variable))
    while len(_notes) > _NOTES_KEPT:
      _notes.popitem(last=False)


def note_of(variable: nnx.Variable) -> str | None:
  """How `variable` was created under path rules, if flax_dtensor knows."""
  with _notes_lock:
    found = _notes.get(id(variable))
  if found is None or found[0] != id(variable.get_raw_value()):
    return None
  return found[1]


@dataclasses.dataclass
class Order:
  """The concrete build following the abstract one's records."""

  records: list[Record]
  rules: _logical.LogicalRules
  mesh: Mesh
  # A context in which Flax's calls do not reach the hook (`_switches.building`).
  quiet: Callable[[], Any]
  strict: bool = False  # fdt.init: a covered variable not in shards raises.
  next: int = 0
  stopped: str | None = None  # Why the order stopped being followed.

  def construct(
    self,
    flax_call: Callable[..., Any],
    cls: type,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    build: Callable[[], Any],
  ) -> Any:
    """One module construction of the concrete build.

    `build` constructs it as Flax does (the hook's nested construction);
    a leaf is built under a jit instead where its record allows.
    """
    index = self.next
    self.next += 1
    record = self.records[index] if index < len(self.records) else None
    if self.stopped is None and (record is None or record.cls is not cls):
      self.stopped = (
        f'the construction order differed from the abstract build at module '
        f'#{index} ({cls.__name__}, expected '
        f'{record.cls.__name__ if record else "no more modules"})'
      )
    if self.stopped is not None and self.strict:
      raise _creation.NotInShards(self.stopped)
    if self.stopped is not None or record is None or record.path is None:
      return build()
    if record.leaf and not traced(args, kwargs):
      split = split_args(args, kwargs)
      module = None if split is None else self._jitted(flax_call, split, record)
      if module is not None:
        return module
      if self.strict and any(
        self._covered(record, path) for path in record.variables
      ):
        raise _creation.NotInShards(f'{cls.__name__} at {record.path}')
    module = build()
    self._place_own(module, record)
    return module

  def _covered(self, record: Record, path: str) -> bool:
    """Whether a path rule places this variable of a recorded module."""
    resolution = _spec.spec_of_variable(
      record.variables[path],
      rules=self.rules,
      mesh=self.mesh,
      path=_join(record.path, path),
    )
    return resolution is not None and resolution.by_path_rule

  def _partition_specs(self, record: Record) -> dict[str, PartitionSpec] | None:
    """Each variable of a recorded module: its placement by its path."""
    specs = {}
    for path, variable in record.variables.items():
      resolution = _spec.spec_of_variable(
        variable,
        rules=self.rules,
        mesh=self.mesh,
        path=_join(record.path, path),
      )
      specs[path] = PartitionSpec() if resolution is None else resolution.spec
    return specs

  def _jitted(
    self,
    flax_call: Callable[..., Any],
    split: tuple[_calls.Split, tuple[Any, ...]],
    record: Record,
  ) -> Any:
    """The leaf (`split`: its arguments, `split_args`) built under a
    cached jit, in its shards; None if it cannot."""
    call, static = split
    cls = record.cls
    specs = self._partition_specs(record)
    if specs is None:
      return None
    auto = _meshes.auto_copy(self.mesh)
    key = (cls, call.treedef, static, tuple(sorted(specs.items())), auto)
    with _calls.nodes_on(call.nodes, auto):
      inputs = [
        v if _calls.is_node(v) else _meshes.retype(v, auto) for v in call.passed
      ]
      with jax.set_mesh(auto):
        compiled = _creation.leaves.get(
          key,
          lambda: (
            _creator(flax_call, cls, call, specs, self.quiet)
            .lower(inputs)
            .compile(_creation.COMPILER_OPTIONS)
          ),
        )
        module = compiled(inputs)
    built = {
      _variables.path_str(path): variable
      for path, variable in _variables.iter_variables(module)
    }
    expected = {
      path: (v.shape, v.dtype) for path, v in record.variables.items()
    }
    found = {
      path: (np.shape(_spec.value_of(v)), _spec.value_of(v).dtype)
      for path, v in built.items()
    }
    if found != expected:  # Built, but not as the record said.
      self.stopped = (
        f'{cls.__name__} at {record.path} made variables '
        f'{_shapes(found)}, where the abstract build made {_shapes(expected)}'
      )
      if self.strict:
        raise _creation.NotInShards(self.stopped)
      # Onto the caller's mesh as they are; checked against their actual
      # paths when the outermost constructor returns.
      for variable in built.values():
        variable.set_value(_meshes.retype(_spec.value_of(variable), self.mesh))
        note(
          variable,
          'in its shards as the abstract build predicted them, checked '
          f'against its path when the outermost constructor returned: '
          f'{self.stopped}',
        )
      return module
    for path, variable in built.items():
      spec = specs.get(path, PartitionSpec())
      variable.set_value(
        _meshes.put(
          _spec.value_of(variable),
          _spec.sharding_for(variable, self.mesh, spec),
        )
      )
      note(variable, IN_SHARDS)
    return module

  def _place_own(self, module: Any, record: Record) -> None:
    """Places, by the record, the variables a module created itself."""
    own = {
      key: value
      for key, value in nnx.graph.iter_children(module)
      if isinstance(value, nnx.Variable)
    }
    if not own:
      return
    for key, variable in own.items():
      where = _join(record.path, str(key))
      value = _spec.value_of(variable)
      if isinstance(value, jax.core.Tracer) or not isinstance(value, jax.Array):
        continue
      resolution = _spec.spec_of_variable(
        variable, rules=self.rules, mesh=self.mesh, path=where
      )
      if resolution is None or not resolution.by_path_rule:
        continue
      if self.strict:
        raise _creation.NotInShards(where)
      variable.set_value(
        jax.device_put(
          value, _spec.sharding_for(variable, self.mesh, resolution.spec)
        )
      )
      note(
        variable,
        f"{MOVED}{type(module).__name__}'s constructor returned, computed "
        'whole (not a leaf module, or an argument that does not determine '
        'it, such as a function of your own)',
      )


def _shapes(found: dict[str, tuple[Any, Any]]) -> str:
  return ', '.join(
    f'{path} {np.dtype(dtype).name}{list(shape)}'
    for path, (shape, dtype) in sorted(found.items())
  )


def _join(prefix: str | None, rest: str) -> str:
  if not prefix:
    return rest
  return f'{prefix}/{rest}' if rest else prefix


def traced(args: Any, kwargs: Any) -> bool:
  """Whether a construction runs inside a JAX transform."""
  if any(
    isinstance(x, jax.core.Tracer)
    for x in jax.tree_util.tree_leaves((args, kwargs))
  ):
    return True
  try:  # JAX has no public name for it.
    from jax._src import core

    return not core.trace_state_clean()
  except (ImportError, AttributeError):
    return False


def _creator(
  flax_call: Callable[..., Any],
  cls: type,
  split: _calls.Split,
  specs: dict[str, PartitionSpec],
  quiet: Callable[[], Any],
) -> Any:
  """The jitted constructor of a leaf, its variables constrained."""
  construct = split.calling(lambda *a, **k: flax_call(cls, *a, **k))

  @nnx.jit(graph=True, graph_updates=True)
  def create(values: list[Any]) -> Any:
    with quiet():
      module = construct(values)
    for path, variable in _variables.iter_variables(module):
      spec = specs.get(_variables.path_str(path), PartitionSpec())
      variable.set_value(
        jax.lax.with_sharding_constraint(
          _spec.value_of(variable),
          NamedSharding(jax.sharding.get_abstract_mesh(), spec),
        )
      )
    return module

  return create
