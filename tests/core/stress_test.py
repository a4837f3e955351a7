"""Threads, asyncio tasks and executors under load: rules never leak.

64 threads each enter 1,000 nested rules contexts with rules of their own
(every tenth block raises inside), while other threads create sharded
modules under their own rules. Afterwards no thread has seen another's
rules, every module sits where its rules say, and the main thread's rules
are unchanged.
"""

import asyncio
import concurrent.futures
import threading

import jax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import flax_dtensor as fdt

MESH = AbstractMesh((2, 4), ('data', 'model'))


class _Planned(Exception):
  """Raised inside a block on purpose."""


def _rules_of(thread, depth):
  axis = ('data', 'model')[(thread + depth) % 2]
  return [('mlp', axis), (f't{thread}d{depth}', None)]


def test_64_threads_x_1000_nested_contexts_while_modules_are_built(
  explicit_mesh,
):
  threads, depth_limit, blocks = 64, 8, 1000
  main_rules = fdt.LogicalRules([('main', 'data')])
  barrier = threading.Barrier(threads + 4)
  leaks = []

  def nest(thread, depth, done):
    if depth == depth_limit or done[0] >= blocks:
      return
    rules = fdt.LogicalRules(_rules_of(thread, depth))
    try:
      with fdt.logical_axis_rules(rules):
        done[0] += 1
        if fdt.get_logical_axis_rules() != rules:
          leaks.append((thread, depth))
        expected = P(None, ('data', 'model')[(thread + depth) % 2])
        if fdt.logical_to_mesh_axes((None, 'mlp'), mesh=MESH) != expected:
          leaks.append((thread, depth, 'resolution'))
        nest(thread, depth + 1, done)
        if done[0] % 10 == 0:
          raise _Planned
      if fdt.get_logical_axis_rules() != (
        fdt.LogicalRules(_rules_of(thread, depth - 1)) if depth else None
      ):
        leaks.append((thread, depth, 'restore'))
    except _Planned:
      pass

  def contexts(thread):
    barrier.wait(timeout=120)
    done = [0]
    while done[0] < blocks:
      nest(thread, 0, done)
    if fdt.get_logical_axis_rules() is not None:
      leaks.append((thread, 'left rules behind'))
    return done[0]

  def builder(i):
    axis = ('data', 'model')[i % 2]
    init = nnx.with_partitioning(nnx.initializers.ones, ('embed', 'mlp'))
    barrier.wait(timeout=120)
    placed = []
    for _ in range(10):
      with (
        jax.set_mesh(explicit_mesh),
        fdt.logical_axis_rules([('embed', None), ('mlp', axis)]),
      ):
        layer = nnx.Linear(8, 16, kernel_init=init, rngs=nnx.Rngs(i))
      placed.append(layer.kernel.get_value().sharding.spec)
    return i, placed

  fdt.set_logical_axis_rules(main_rules)
  try:
    with concurrent.futures.ThreadPoolExecutor(threads + 4) as pool:
      counted = pool.map(contexts, range(threads))
      built = pool.map(builder, range(4))
      assert list(counted) == [blocks] * threads
      for i, placed in built:
        assert placed == [P(None, ('data', 'model')[i % 2])] * 10
    assert leaks == []
    assert fdt.get_logical_axis_rules() is main_rules
  finally:
    fdt.set_logical_axis_rules(None)


def test_thread_pool_workers_see_the_callers_rules_through_propagate(
  explicit_mesh,
):
  def resolve(_):
    return fdt.logical_to_mesh_axes(('batch', 'mlp'), (8, 8))

  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    with (
      jax.set_mesh(explicit_mesh),
      fdt.logical_axis_rules([('batch', 'data'), ('mlp', 'model')]),
    ):
      work = fdt.propagate(resolve)
      propagated = list(pool.map(work, range(32)))
      bare = list(pool.map(resolve, range(8)))
  assert propagated == [P('data', 'model')] * 32
  # Without propagate, a worker has no rules (Flax's semantics: names pass
  # through) and no mesh.
  assert bare == [P('batch', 'mlp')] * 8


def test_asyncio_tasks_with_blocks_that_do_not_await_are_isolated():
  async def task(i):
    axis = ('data', 'model')[i % 2]
    seen = []
    for _ in range(20):
      with fdt.logical_axis_rules([('mlp', axis)]):
        seen.append(fdt.logical_to_mesh_axes(('mlp',), mesh=MESH))
      await asyncio.sleep(0)
    return i, seen

  async def main():
    return await asyncio.gather(*(task(i) for i in range(32)))

  for i, seen in asyncio.run(main()):
    assert seen == [P(('data', 'model')[i % 2])] * 20
  assert fdt.get_logical_axis_rules() is None


def test_asyncio_tasks_awaiting_inside_blocks_are_caught_not_silent():
  order = []

  async def task(name, axis):
    with fdt.logical_axis_rules([('mlp', axis)]):
      await asyncio.sleep(0)  # The other task enters its block meanwhile.
      order.append((name, fdt.logical_to_mesh_axes(('mlp',), mesh=MESH)))
      await asyncio.sleep(0)

  async def main():
    return await asyncio.gather(
      task('a', 'data'), task('b', 'model'), return_exceptions=True
    )

  results = asyncio.run(main())
  errors = [r for r in results if isinstance(r, Exception)]
  assert errors, order
  for error in errors:
    with pytest.raises(
      fdt.LogicalRulesError, match=r'interleaved with it in this thread'
    ):
      raise error
  assert fdt.get_logical_axis_rules() is None


def test_asyncio_run_in_executor_with_propagate(explicit_mesh):
  async def main():
    loop = asyncio.get_running_loop()
    with (
      jax.set_mesh(explicit_mesh),
      fdt.logical_axis_rules([('mlp', 'model'), ('embed', 'data')]),
    ):
      work = fdt.propagate(
        lambda: fdt.logical_to_mesh_axes(('embed', 'mlp'), (8, 8))
      )
    return await asyncio.gather(
      *(loop.run_in_executor(None, work) for _ in range(16))
    )

  assert asyncio.run(main()) == [P('data', 'model')] * 16
