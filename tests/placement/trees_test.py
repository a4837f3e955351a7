"""Plain pytrees: `shard_tree` places weights dicts block by block; back.

The weights dict of `unannotated_model` (as a converter would hand it over)
is placed by the same path rules as the model, so its placement equals the
model's plan; every device receives only its block, counted by a lazily
read array; `gather_tree` gives the values back.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from support import unannotated_model as um

import flax_dtensor as fdt
from flax_dtensor._rules import _partition_specs

RULES = fdt.LogicalRules(um.LOGICAL_RULES, path_rules=um.PATH_RULES)


class LazyArray:
  """An array read block by block (as from a memory map or an h5py file),
  counting the bytes it hands out."""

  def __init__(self, data):
    self.data = data
    self.shape = data.shape
    self.dtype = data.dtype
    self.reads = []

  def __getitem__(self, index):
    block = np.array(self.data[index])  # A copy, as a file read makes.
    self.reads.append(block.nbytes)
    return block


def _weights():
  """The model's parameters as a nested dict of NumPy arrays."""
  with nnx.use_eager_sharding(False):
    model = um.make_model()
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))


def _leaves_with_paths(tree):
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {'/'.join(str(getattr(k, 'key', k)) for k in p): x for p, x in flat}


def test_a_weights_dict_is_placed_like_the_model(any_mesh):
  weights = _weights()
  placed = fdt.shard_tree(weights, RULES, mesh=any_mesh)
  assert jax.tree.structure(placed) == jax.tree.structure(weights)
  model_plan = fdt.plan(um.make_model, mesh=any_mesh, rules=RULES)
  tree_plan = fdt.plan(weights, mesh=any_mesh, rules=RULES)
  got = _leaves_with_paths(placed)
  assert set(got) == {e.path for e in model_plan.entries}
  for path, array in got.items():
    n = array.ndim
    want = _partition_specs.canonical(model_plan[path].spec, n)
    assert _partition_specs.canonical(tree_plan[path].spec, n) == want, path
    assert _partition_specs.canonical(array.sharding.spec, n) == want, path
    assert tree_plan[path].source == model_plan[path].source, path
    assert array.sharding.mesh == any_mesh
  # The placed tree's own plan reports where the arrays are.
  assert not any(e.misplaced for e in fdt.plan(placed, rules=RULES).entries)
  back = fdt.gather_tree(placed)
  jax.tree.map(np.testing.assert_array_equal, back, weights)
  assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(back))


def test_each_device_receives_only_its_block(explicit_mesh):
  kernel = LazyArray(np.arange(64 * 256, dtype=np.float32).reshape(64, 256))
  bias = LazyArray(np.arange(256, dtype=np.float32))
  tree = {'mlp': {'up': {'kernel': kernel, 'bias': bias}}}
  placed = fdt.shard_tree(tree, RULES, mesh=explicit_mesh)
  out = placed['mlp']['up']['kernel']
  assert out.sharding.spec == P('data', 'model')
  # 8 blocks, each read once, none whole: 1/8 of the bytes per read.
  assert kernel.reads == [kernel.data.nbytes // 8] * 8
  for shard in out.addressable_shards:
    assert shard.data.nbytes == kernel.data.nbytes // 8
    np.testing.assert_array_equal(
      np.asarray(shard.data), kernel.data[shard.index]
    )
  # A replicated array is read once, and every device holds it whole.
  assert bias.reads == [bias.data.nbytes]
  assert placed['mlp']['up']['bias'].sharding.is_fully_replicated
  # Sharded over 'model' only, the two 'data' rows share blocks: 4 reads.
  down = LazyArray(np.ones((256, 64), np.float32))
  rules = RULES.replace(path_rules=[('down/kernel$', P('model', None))])
  fdt.shard_tree({'down': {'kernel': down}}, rules, mesh=explicit_mesh)
  assert down.reads == [down.data.nbytes // 4] * 4


def test_logical_axes_and_their_precedence(auto_mesh):
  tree = {
    'w': np.ones((8, 16), np.float32),
    'b': np.ones(16, np.float32),
    'step': 3,
  }
  axes = {'w': ('embed', 'mlp'), 'b': ('mlp',), 'step': None}
  placed = fdt.shard_tree(
    tree, um.LOGICAL_RULES, mesh=auto_mesh, logical_axes=axes
  )
  assert placed['w'].sharding.spec == P('data', 'model')
  assert placed['b'].sharding.spec == P('model')
  assert int(placed['step']) == 3 and placed['step'].sharding.spec == P()
  plan = fdt.plan(
    tree, mesh=auto_mesh, rules=um.LOGICAL_RULES, logical_axes=axes
  )
  assert plan['w'].source == 'annotation' and plan['step'].source == (
    'none (replicated)'
  )
  # Logical axes win over a path rule, unless it says override=True.
  rules = fdt.LogicalRules(
    um.LOGICAL_RULES,
    path_rules=[
      ('w', P(None, 'data')),
      (
        'b',
        P('data'),
      ),
    ],
  )
  kept = fdt.shard_tree(tree, rules, mesh=auto_mesh, logical_axes=axes)
  assert kept['w'].sharding.spec == P('data', 'model')
  forced = rules.replace(
    path_rules=[fdt.PathRule('w', P(None, 'data'), override=True)]
  )
  moved = fdt.shard_tree(tree, forced, mesh=auto_mesh, logical_axes=axes)
  assert moved['w'].sharding.spec == P(None, 'data')
  np.testing.assert_array_equal(np.asarray(moved['w']), tree['w'])


def test_jax_arrays_and_the_rules_in_effect(auto_mesh):
  one_device = jnp.arange(32.0).reshape(4, 8)
  rules = fdt.LogicalRules([], path_rules=[(r'^x$', P(None, 'model'))])
  with jax.set_mesh(auto_mesh), fdt.logical_axis_rules(rules):
    placed = fdt.shard_tree({'x': one_device, 'y': one_device})
  assert placed['x'].sharding.spec == P(None, 'model')
  assert placed['y'].sharding.is_fully_replicated
  np.testing.assert_array_equal(np.asarray(placed['x']), one_device)
  # A list and a tuple keep their structure; paths count their positions.
  seq = fdt.shard_tree(
    [np.ones((4, 8)), (np.zeros((4, 8)),)],
    fdt.LogicalRules([], path_rules=[('^1/0$', P('data', 'model'))]),
    mesh=auto_mesh,
  )
  assert isinstance(seq, list) and isinstance(seq[1], tuple)
  assert seq[1][0].sharding.spec == P('data', 'model')
  assert not any(seq[0].sharding.spec)


def test_no_mesh_is_an_error():
  with pytest.raises(fdt.MeshError, match=r'place a tree of arrays, but no'):
    fdt.shard_tree({'w': np.ones(4)}, RULES)
