"""Golden layouts: a plan read back from JSON, and what changed (by values)."""

import json

import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P
from support import cli_runner, many_axes

import flax_dtensor as fdt

MESH = AbstractMesh((2, 4), ('data', 'model'))
RULES = [('embed', 'data'), ('mlp', 'model'), ('mlp', 'data')]


class MLP(nnx.Module):
  def __init__(self, rngs, *, hidden=64, extra=False, dtype=jnp.float32):
    init = nnx.initializers.lecun_normal()
    self.up = nnx.Linear(
      16,
      hidden,
      kernel_init=nnx.with_partitioning(init, ('embed', 'mlp')),
      param_dtype=dtype,
      rngs=rngs,
    )
    if extra:
      self.gate = nnx.Linear(
        16,
        hidden,
        kernel_init=nnx.with_partitioning(init, ('embed', 'mlp')),
        rngs=rngs,
      )


def _plan(rules=RULES, mesh=MESH, **kwargs):
  return fdt.plan(lambda: MLP(nnx.Rngs(0), **kwargs), mesh=mesh, rules=rules)


def test_json_round_trip_keeps_every_field():
  plan = _plan(hidden=6)  # 'mlp' falls back: the plan has fallbacks.
  back = fdt.ShardingPlan.from_json(plan.to_json())
  assert back.entries == plan.entries
  assert back.mesh_axes == plan.mesh_axes == {'data': 2, 'model': 4}
  assert back.num_devices == 8
  assert back['up/kernel'].spec == P('data', None)
  assert back['up/kernel'].fallbacks == plan['up/kernel'].fallbacks != ()
  assert not plan.diff(back)


def test_no_change():
  d = _plan().diff(_plan())
  assert not d
  assert (d.added, d.removed, d.changed, d.mesh) == ((), (), (), None)
  assert str(d) == (
    'No change: every variable is placed as in the golden layout.'
  )


def test_a_moved_variable_and_its_size_per_device():
  golden = _plan()
  now = _plan(rules=[('embed', None), ('mlp', 'model')])
  d = now.diff(golden)
  assert d
  assert d.moved == ('up/kernel',)
  assert d.resized == ('up/kernel',)
  (change,) = d.changed
  assert change.before.spec == P('data', 'model')
  assert change.after.spec == P(None, 'model')
  assert (change.before.bytes_per_device, change.after.bytes_per_device) == (
    16 * 64 * 4 // 8,
    16 * 64 * 4 // 4,
  )
  assert d.bytes_per_device == (golden.bytes_per_device, now.bytes_per_device)
  text = str(d)
  assert "  spec P('data', 'model') -> P(None, 'model')" in text
  assert '  per device 512 B -> 1.0 KiB' in text


def test_changed_fallbacks_are_reported():
  golden = _plan(hidden=6)  # 'mlp' -> 'model' skipped: 6 % 4.
  now = _plan(hidden=6, rules=[('embed', 'data'), ('mlp', None)])
  d = now.diff(golden)
  assert d.fallbacks_changed == ('up/kernel',)
  assert d.moved == ()  # P('data', None) both times, for other reasons.
  (change,) = d.changed
  assert change.after.fallbacks == ()
  assert len(change.before.fallbacks) == 2
  assert "  - fallback dim 1 ('mlp'): 'model': dim size 6" in str(d)


def test_added_removed_and_resized_by_dtype():
  golden = _plan()
  d = _plan(extra=True, dtype=jnp.bfloat16).diff(golden)
  assert d.added == ('gate/bias', 'gate/kernel')
  assert d.removed == ()
  assert set(d.resized) == {'up/kernel', 'up/bias'}
  assert d.moved == ()
  assert 'float32[16,64] -> bfloat16[16,64]' in str(d)
  assert golden.diff(_plan(extra=True)).removed == ('gate/bias', 'gate/kernel')


def test_a_different_mesh():
  other = AbstractMesh((4, 2), ('data', 'model'))
  d = _plan(mesh=other).diff(_plan())
  assert d.mesh == ({'data': 2, 'model': 4}, {'data': 4, 'model': 2})
  assert d.resized == ()  # 8 devices either way, each a 1/8 block.
  assert "mesh {'data': 2, 'model': 4} -> {'data': 4, 'model': 2}" in str(d)
  assert json.loads(json.dumps(d.to_dict()))['mesh'][1] == {
    'data': 4,
    'model': 2,
  }


def test_a_spec_that_only_gains_axes_of_size_1_has_not_moved():
  """On a mesh of 12 axes, most of size 1, a rule that adds axes of size 1
  places nothing elsewhere; a golden layout read back says the same."""
  mesh = many_axes.abstract_mesh()
  golden = _plan(rules=[('embed', 'fsdp'), ('mlp', 'tensor')], mesh=mesh)
  wider = [
    ('embed', ('fsdp', 'context', 'expert')),
    ('mlp', ('stage', 'tensor')),
  ]
  now = _plan(rules=wider, mesh=mesh)
  assert now['up/kernel'].spec == P(
    ('fsdp', 'context', 'expert'), ('stage', 'tensor')
  )
  assert golden['up/kernel'].spec == P('fsdp', 'tensor')
  assert not now.diff(golden)
  assert not now.diff(fdt.ShardingPlan.from_json(golden.to_json()))
  # Really moved: the same axes of size > 1 on other dimensions.
  swapped = _plan(
    rules=[('embed', ('tensor', 'context')), ('mlp', 'fsdp')], mesh=mesh
  )
  d = swapped.diff(fdt.ShardingPlan.from_json(now.to_json()))
  assert d.moved == ('up/kernel',)
  # Shown without the axes of size 1, as the plan shows them.
  assert "  spec P('fsdp', 'tensor') -> P('tensor', 'fsdp')" in str(d)


@pytest.mark.parametrize(
  'text, match',
  [
    ('{not json', r'is not JSON'),
    ('[1, 2]', r'is not a plan: expected a JSON object with a "variables"'),
    ('{"variables": [{"path": "x"}]}', r'variable 0 is malformed \(KeyError'),
    (
      '{"variables": [{"path": "x", "kind": "Param", "shape": [2], '
      '"dtype": "float32", "logical_axes": null, "spec": "data", "bytes": 8,'
      ' "bytes_per_device": 8, "fallbacks": []}]}',
      r"variable 0 \('x'\): expected a spec as a list",
    ),
  ],
  ids=['not-json', 'not-a-plan', 'missing-field', 'bad-spec'],
)
def test_malformed_layouts(text, match):
  with pytest.raises(fdt.LayoutFileError, match=match + r'.*--json'):
    fdt.ShardingPlan.from_json(text)


def _cli(*args):
  """`flax-dtensor ARGS` in this process, as a shell sees it."""
  return cli_runner.run(*args, env={'COLUMNS': '120'})


def test_cli_diff_exit_status_like_diff(tmp_path):
  target = 'flax_dtensor.demo.model:make_model'
  golden = tmp_path / 'layout.json'
  proc = _cli('plan', target, '--json')
  assert proc.returncode == 0, proc.stderr
  golden.write_text(proc.stdout)
  same = _cli('plan', target, '--diff', golden)
  assert same.returncode == 0, same.stderr
  assert 'No change' in same.stdout
  moved = _cli('plan', target, '--mesh', 'data=4,model=2', '--diff', golden)
  assert moved.returncode == 1, moved.stderr
  assert "mesh {'data': 2, 'model': 4} -> {'data': 4, 'model': 2}" in (
    moved.stdout
  )
  missing = _cli('plan', target, '--diff', tmp_path / 'nope.json')
  assert missing.returncode == 2
  assert 'cannot read the golden layout' in missing.stderr
  (tmp_path / 'bad.json').write_text('{}')
  bad = _cli('plan', target, '--diff', tmp_path / 'bad.json')
  assert bad.returncode == 2
  assert 'is not a plan' in bad.stderr and 'bad.json' in bad.stderr
  assert 'Error' not in bad.stderr  # No class names: they go to --debug.
