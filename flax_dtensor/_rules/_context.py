"""The rules context: which rules apply in this thread, and since when.

`logical_axis_rules` and `set_logical_axis_rules` keep `LogicalRules` in
Flax's own thread-local holder, the single source of truth;
`get_logical_axis_rules` reads it, and `rules_in_effect` says which rules
apply here and so whose semantics (`FlaxRules` for Flax's). Each block
remembers what was said in it (`first_time_in_context`), for warning once
per block; `propagate` hands the rules and mesh to another thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax
from flax.core import spmd as core_spmd

from flax_dtensor import _errors
from flax_dtensor._rules import _logical, _meshes


@dataclasses.dataclass(frozen=True)
class FlaxRules:
  """Rules set with Flax's own context (a plain tuple): Flax's semantics.

  Flax NNX applies such rules as a dict (the last rule for a name wins, and
  a name no rule mentions is used as a mesh axis name). flax_dtensor reads
  them the same way everywhere, so that what it reports and places agrees
  with what Flax creates.

  Attributes:
    pairs: The rules exactly as set, ``()`` when none are set.
  """

  pairs: tuple[Any, ...] = ()


def rules_in_effect(
  rules: _logical.RulesLike | FlaxRules | None = None,
) -> _logical.LogicalRules | FlaxRules:
  """The rules that apply here, and by that, whose semantics.

  The one decision, applied by every API of the package: rules passed to a
  flax_dtensor function (`rules=`), or set with `logical_axis_rules` /
  `set_logical_axis_rules`, are `LogicalRules` and get flax_dtensor's
  semantics (priority, fallbacks, mesh and shape checks). Rules set with
  Flax's own ``nnx.logical_axis_rules`` or
  ``flax.core.spmd.set_logical_axis_rules`` (plain tuples), and no rules at
  all, keep Flax's semantics.

  Args:
    rules: Rules passed explicitly, or None for the context's.
  """
  if isinstance(rules, FlaxRules):
    return rules
  if rules is not None:
    return _logical.LogicalRules(rules)
  context = core_spmd.get_logical_axis_rules()
  if isinstance(context, _logical.LogicalRules):
    return context
  return FlaxRules(tuple(context) if context else ())


def get_logical_axis_rules() -> _logical.LogicalRules | tuple[Any, ...] | None:
  """Returns the logical-axis rules in effect in this thread, or None.

  A `LogicalRules` when they were set by flax_dtensor (its semantics
  apply); the plain tuple when they were set with Flax's own
  ``nnx.logical_axis_rules`` (Flax's semantics apply, see the concepts
  page); None when no rules are set.

  Example:
    >>> import flax_dtensor as fdt
    >>> with fdt.logical_axis_rules([('embed', 'data')]):
    ...   fdt.get_logical_axis_rules()
    LogicalRules([('embed', 'data')])
    >>> fdt.get_logical_axis_rules() is None
    True
  """
  rules = core_spmd.get_logical_axis_rules()
  if isinstance(rules, _logical.LogicalRules):
    return rules
  return tuple(rules) if rules else None


def set_logical_axis_rules(rules: _logical.RulesLike | None) -> None:
  """Sets the logical-axis rules of this thread until changed again.

  Prefer the `logical_axis_rules` context manager, which restores the outer
  rules on exit. ``None`` clears the rules.

  Args:
    rules: The rules, or None.

  Raises:
    LogicalRulesError: If the rules are malformed.
    RuleTargetTypeError: If a target is not a str, a sequence of str or None.
  """
  if rules is None:
    core_spmd.set_logical_axis_rules(())
    return
  core_spmd.set_logical_axis_rules(_logical.LogicalRules(rules))


@contextlib.contextmanager
def logical_axis_rules(
  rules: _logical.RulesLike,
) -> Iterator[_logical.LogicalRules]:
  """Sets the logical-axis rules of the current thread within a block.

  The rules are thread-local: other threads never see them (use `propagate`
  to hand them to a worker). Nesting replaces the outer rules and restores
  them on exit, also when the block raises. While the block is active, NNX
  variables annotated with logical axes (``nnx.with_partitioning``) are
  placed at creation by these rules, those the path rules cover when the
  outermost ``nnx.Module`` constructor returns, and Flax's
  ``nnx.get_partition_spec`` reports the same placement.

  Args:
    rules: A `LogicalRules`, or anything its constructor accepts.

  Like Flax's, the context is per thread, not per asyncio task: blocks of
  tasks that interleave in one thread (an ``await`` inside the block) would
  see each other's rules. That is detected: on exit, the block checks that
  the rules in effect are still its own, and raises otherwise.

  Yields:
    The rules as `LogicalRules`.

  Raises:
    LogicalRulesError: If the rules are malformed, or, on exit, the rules in
      effect are not the block's own (another block was interleaved with it,
      or rules were set inside it and not restored).
    RuleTargetTypeError: If a target is not a str, a sequence of str or None.

  Example:
    >>> import flax_dtensor as fdt
    >>> with fdt.logical_axis_rules([('batch', 'data'), ('mlp', 'model')]):
    ...   fdt.logical_to_mesh_axes(('batch', 'mlp'))
    P('data', 'model')
  """
  rules = _logical.LogicalRules(rules)
  block = _Block(rules, core_spmd.get_logical_axis_rules())
  _blocks.stack.append(block)
  core_spmd.set_logical_axis_rules(rules)
  try:
    yield rules
  except BaseException:
    _leave(block)
    raise
  interleaved = _leave(block)
  if interleaved is not None:
    raise _errors.LogicalRulesError(
      'A `logical_axis_rules` block ended while other rules were in effect '
      f'({interleaved!r}, expected its own {rules!r}): another block was '
      'interleaved with it in this thread (e.g. asyncio tasks awaiting '
      'inside their blocks), or rules were set inside it and not '
      'restored. Enter the rules in code that does not await, give each '
      'task its own thread (`fdt.propagate`), or restore what you set.'
    )


@dataclasses.dataclass
class _Block:
  rules: _logical.LogicalRules
  outer: Any
  said: set[str] = dataclasses.field(default_factory=set)


class _Blocks(threading.local):
  """This thread's active `logical_axis_rules` blocks, innermost last."""

  def __init__(self) -> None:
    self.stack: list[_Block] = []
    # For rules set by `set_logical_axis_rules` (no block): what was said.
    self.said: dict[int, tuple[Any, set[str]]] = {}


def first_time_in_context(what: str) -> bool:
  """True the first time `what` is asked about in the rules context in
  effect (the innermost `logical_axis_rules` block, or the rules set by
  `set_logical_axis_rules`), False after: for saying a thing once."""
  rules = core_spmd.get_logical_axis_rules()
  stack = _blocks.stack
  if stack and stack[-1].rules is rules:
    said = stack[-1].said
  else:
    kept = _blocks.said.get(id(rules))
    if kept is None or kept[0] is not rules:
      kept = _blocks.said[id(rules)] = (rules, set())
    said = kept[1]
  if what in said:
    return False
  said.add(what)
  return True


def forget_in_context(what: str) -> None:
  """Undoes `first_time_in_context(what)` in the rules context in effect."""
  rules = core_spmd.get_logical_axis_rules()
  stack = _blocks.stack
  if stack and stack[-1].rules is rules:
    stack[-1].said.discard(what)
  elif id(rules) in _blocks.said:
    _blocks.said[id(rules)][1].discard(what)


_blocks = _Blocks()


def _leave(block: _Block) -> Any:
  """Ends `block`; returns the rules found in effect if not its own.

  The innermost block restores the rules it found. A block ending while an
  inner one is still active (interleaved) leaves the inner one's rules in
  effect, and hands it its outer rules, so that every block restores what
  was there before all of them.
  """
  stack = _blocks.stack
  position = next(i for i, b in enumerate(stack) if b is block)
  current = core_spmd.get_logical_axis_rules()
  del stack[position]
  if position < len(stack):  # Inner blocks are still active.
    stack[position].outer = block.outer
    return current
  core_spmd.set_logical_axis_rules(block.outer)
  return None if current is block.rules else current


# Threads
# ------------------------------------------------------------------------------

C = TypeVar('C', bound=Callable[..., Any])


def propagate(fn: C) -> C:
  """Wraps `fn` so it runs with the caller's rules and mesh in any thread.

  Rules and ``jax.set_mesh`` meshes are thread-local: a new thread starts
  with none. ``propagate`` captures both when it is called and re-enters
  them around every call of the wrapper, so a worker thread sees exactly
  the caller's context (and nothing leaks back).

  Args:
    fn: The callable to run in another thread.

  Returns:
    A wrapper with the same signature.

  Example:
    >>> import concurrent.futures, flax_dtensor as fdt
    >>> with fdt.logical_axis_rules([('embed', 'data')]):
    ...   work = fdt.propagate(fdt.get_logical_axis_rules)
    >>> with concurrent.futures.ThreadPoolExecutor() as pool:
    ...   pool.submit(work).result()
    LogicalRules([('embed', 'data')])
  """
  rules = core_spmd.get_logical_axis_rules()
  abstract, concrete = _meshes.context_meshes()

  @functools.wraps(fn)
  def wrapper(*args: Any, **kwargs: Any) -> Any:
    with contextlib.ExitStack() as stack:
      if concrete is not None:
        stack.enter_context(jax.set_mesh(concrete))
      if abstract is not None and (
        concrete is None or concrete.abstract_mesh != abstract
      ):
        stack.enter_context(jax.sharding.use_abstract_mesh(abstract))
      stack.enter_context(core_spmd.logical_axis_rules(rules))
      return fn(*args, **kwargs)

  return wrapper  # type: ignore[return-value]
