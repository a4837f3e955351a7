"""Rule linting: each finding by its code and its values; the CLI's exit."""

import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P
from support import cli_runner, many_axes, maxtext_style

import flax_dtensor as fdt
from flax_dtensor._planning import _check_report

# Auto axes, as JAX 0.10 makes an AbstractMesh by default (0.12: Explicit).
MESH = AbstractMesh(
  (2, 4), ('data', 'model'), axis_types=(jax.sharding.AxisType.Auto,) * 2
)


class Model(nnx.Module):
  def __init__(self, rngs, *, wide=1024):
    init = nnx.initializers.lecun_normal()
    up = nnx.with_partitioning(init, ('embed', 'mlp'))
    self.up = nnx.Linear(16, 64, kernel_init=up, rngs=rngs)
    # 1024 x 512 float32 = 2 MiB, annotated with a name the rules replicate.
    table = nnx.with_partitioning(init, ('vocab', 'embed_out'))
    self.table = nnx.Embed(wide, 512, embedding_init=table, rngs=rngs)


def _factory(**kwargs):
  return lambda: Model(nnx.Rngs(0), **kwargs)


GOOD = [
  ('embed', 'data'),
  ('mlp', 'model'),
  ('vocab', 'model'),
  ('embed_out', 'data'),
]


def test_clean_rules_have_no_findings():
  report = fdt.check(_factory(), GOOD, MESH)
  assert not report
  assert report.findings == ()
  assert str(report) == 'No findings.'


def test_unused_rule():
  report = fdt.check(_factory(), [*GOOD, ('batch', 'data')], MESH)
  assert [(f.code, f.subject) for f in report.findings] == [
    ('unused-rule', "'batch'")
  ]
  assert 'with_logical_constraint' in report.findings[0].message


@pytest.mark.parametrize(
  'extra, earlier, why',
  [
    ([('mlp', None), ('mlp', 'data')], "('mlp', None)", 'replicates'),
    ([('mlp', 'model')], "('mlp', 'model')", 'is the same rule'),
  ],
  ids=['after-none', 'duplicate'],
)
def test_shadowed_rule(extra, earlier, why):
  rules = [('embed', 'data'), *extra, ('mlp', 'model')]
  rules += [('vocab', 'model'), ('embed_out', 'data')]
  report = fdt.check(_factory(), rules, MESH)
  shadowed = [f for f in report.findings if f.code == 'shadowed-rule']
  assert shadowed, report
  assert all(earlier in f.message and why in f.message for f in shadowed)


def test_unknown_mesh_axis_with_did_you_mean():
  rules = [('embed', 'data'), ('mlp', 'modle'), ('mlp', 'fsdp')]
  rules += [('vocab', 'model'), ('embed_out', 'data')]
  report = fdt.check(_factory(), rules, MESH)
  found = {f.subject: f.message for f in report.findings}
  codes = {f.subject: f.code for f in report.findings}
  # A likely typo has its own code; an axis spelled like none is a fallback.
  assert codes == {
    "('mlp', 'modle')": 'mesh-axis-typo',
    "('mlp', 'fsdp')": 'unknown-mesh-axis',
  }
  assert "Did you mean 'model'?" in found["('mlp', 'modle')"]
  assert 'Did you mean' not in found["('mlp', 'fsdp')"]
  assert "(axes: ['data', 'model'])" in found["('mlp', 'fsdp')"]


def test_large_replicated_variable_names_what_could_shard_it():
  rules = [('embed', 'data'), ('mlp', 'model'), ('vocab', None)]
  rules += [('embed_out', None)]
  report = fdt.check(_factory(), rules, MESH)
  (finding,) = [f for f in report.findings if f.code == 'replicated-large']
  assert finding.subject == 'table/embedding'
  assert 'float32[1024,512] (2.0 MiB) is whole on each of the 8' in (
    finding.message
  )
  assert "dim 0 (1024) by 'data', 'model'; dim 1 (512) by 'data', 'model'" in (
    finding.message
  )
  # Below the threshold: not reported.
  small = fdt.check(_factory(wide=8), rules, MESH)
  assert 'replicated-large' not in small.codes()
  lower = fdt.check(_factory(wide=8), rules, MESH, min_bytes=1024)
  assert 'replicated-large' in lower.codes()


def test_budget():
  plan = fdt.plan(_factory(), mesh=MESH, rules=GOOD)
  at = fdt.check(_factory(), GOOD, MESH, budget=plan.bytes_per_device)
  assert not at
  over = fdt.check(_factory(), GOOD, MESH, budget=plan.bytes_per_device - 1)
  (finding,) = over.findings
  assert finding.code == 'over-budget'
  n = plan.bytes_per_device
  assert finding.message.startswith(
    f'{n / 1024:.1f} KiB ({n:,} bytes) per device is above the budget of '
  )
  assert f'({n - 1:,} bytes; ideal' in finding.message


def test_allow_and_json():
  rules = [*GOOD, ('batch', 'data'), ('mlp', 'modle')]
  report = fdt.check(_factory(), rules, MESH, allow=['unused-rule'])
  assert report.codes() == ('mesh-axis-typo',)
  data = json.loads(report.to_json())
  assert data['allowed'] == ['unused-rule']
  assert data['findings'] == [
    {
      'code': 'mesh-axis-typo',
      'subject': "('mlp', 'modle')",
      'message': report.findings[0].message,
    }
  ]
  assert set(report.codes()) <= set(_check_report.CODES)


def test_rules_from_the_context_and_errors():
  with fdt.logical_axis_rules([*GOOD, ('batch', 'data')]):
    assert fdt.check(_factory(), mesh=MESH).codes() == ('unused-rule',)
  # No rules: Flax's semantics, as creation takes them (names are axes).
  with pytest.raises(
    fdt.UnknownLogicalAxisError,
    match=r"'vocab', which is not an axis of the mesh.*No rules are in effect",
  ):
    fdt.check(_factory(), mesh=MESH)
  with pytest.raises(
    fdt.LogicalRulesError, match=r"unknown finding codes \['nope'\]"
  ):
    fdt.check(_factory(), GOOD, MESH, allow=['nope'])


def _cli(*args):
  """`flax-dtensor ARGS` in this process, as a shell sees it."""
  return cli_runner.run(*args, env={'COLUMNS': '200'})


def test_cli_check_exit_status_and_json(tmp_path):
  target = 'flax_dtensor.demo.model:make_model'
  found = _cli('plan', target, '--check')
  assert found.returncode == 1, found.stderr
  assert "[unknown-mesh-axis] ('embed', 'fsdp'): the mesh has no axis" in (
    found.stdout
  )
  clean = _cli(
    'plan',
    target,
    '--mesh',
    'data=2,fsdp=2,model=2',
    '--check',
    '--allow',
    'unused-rule',
  )
  assert clean.returncode == 0, clean.stdout + clean.stderr
  assert 'No findings.' in clean.stdout
  data = json.loads(_cli('plan', target, '--check', '--json').stdout)
  assert {f['code'] for f in data['findings']} == {
    'unused-rule',
    'unknown-mesh-axis',
  }
  over = _cli(
    'plan',
    target,
    '--check',
    '--allow',
    'unused-rule',
    '--allow',
    'unknown-mesh-axis',
    '--budget',
    '100KiB',
  )
  assert over.returncode == 1
  assert '[over-budget] per device: 260.0 KiB (266,240 bytes) per device' in (
    over.stdout
  )
  bad = _cli('plan', target, '--check', '--budget', '12XB')
  assert bad.returncode == 2
  assert "Malformed --budget '12XB'" in bad.stderr


# eager-sharding-off: placements compared, and predicted for a factory
# ------------------------------------------------------------------------------


def test_eager_sharding_off_compares_placements_not_axis_names():
  """On a mesh of 12 axes, most of size 1: a model created with eager
  sharding off, then placed by hand without the axes of size 1, is where
  the rules say; the one variable left unplaced is reported."""
  mesh = many_axes.mesh()
  with jax.set_mesh(mesh), fdt.logical_axis_rules(many_axes.RULES):
    model = many_axes.Stacked(nnx.Rngs(0), eager=False)
  plan = fdt.plan(model, mesh=mesh, rules=many_axes.RULES)
  assert all(not any(e.placed) and e.misplaced for e in plan.entries)
  for e in plan.entries:
    if e.path != 'wi':
      many_axes.place(
        getattr(model, e.path), mesh, many_axes.without_unit_axes(e.spec)
      )
  report = fdt.check(model, many_axes.RULES, mesh)
  assert [(f.code, f.subject) for f in report.findings] == [
    ('eager-sharding-off', 'wi')
  ]
  assert report.findings[0].message.startswith(
    "placed P(), but the rules say P('fsdp', None, 'tensor'): created while "
    'eager sharding was off'
  )


class Mixed(nnx.Module):
  """A kernel that says eager_sharding=False, a bias that does not, and a
  scale that says it but that the rules replicate."""

  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    self.kernel = nnx.Param(
      init(rngs.params(), (16, 64)),
      out_sharding=('embed', 'mlp'),
      eager_sharding=False,
    )
    self.bias = nnx.Param(jnp.zeros((64,)), out_sharding=('mlp',))
    self.scale = nnx.Param(
      jnp.ones((16,)), out_sharding=('norm',), eager_sharding=False
    )


def test_a_factory_is_checked_for_what_calling_it_creates_unplaced():
  rules = [*GOOD, ('norm', None)]
  report = fdt.check(
    lambda: Mixed(nnx.Rngs(0)), rules, MESH, allow=['unused-rule']
  )
  assert [(f.code, f.subject) for f in report.findings] == [
    ('eager-sharding-off', 'kernel')
  ]
  assert report.findings[0].message.startswith(
    "the rules say P('data', 'model'), but calling the factory (building the "
    'model eagerly) creates it unplaced: Flax leaves a variable where it is '
    'created when its `eager_sharding` metadata is False'
  )
  assert '`fdt.init(factory, ...)`' in report.findings[0].message
  assert 'nnx.use_eager_sharding(True)' in report.findings[0].message
  # The prediction is what happens: called on the mesh, the kernel stays
  # unplaced and the bias is placed; the concrete model is reported too.
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
    model = Mixed(nnx.Rngs(0))
  assert not any(model.kernel.get_value().sharding.spec)
  assert model.bias.get_value().sharding.spec == P('model')
  concrete = fdt.check(model, rules, mesh, allow=['unused-rule'])
  assert [(f.code, f.subject) for f in concrete.findings] == [
    ('eager-sharding-off', 'kernel')
  ]


@pytest.fixture
def eager_flag_off():
  """Flax's eager sharding off for everyone, as some libraries (MaxText)
  set it at import; restored after the test."""
  with maxtext_style.imported():
    yield


def test_a_factory_built_while_the_flag_is_off_is_reported(eager_flag_off):
  del eager_flag_off
  report = fdt.check(_factory(), GOOD, MESH)
  # Every variable the rules shard; the bias (no annotation) is replicated.
  assert [(f.code, f.subject) for f in report.findings] == [
    ('eager-sharding-off', 'table/embedding'),
    ('eager-sharding-off', 'up/kernel'),
  ]
  assert 'creates it unplaced (and 1 other variable):' in (
    report.findings[0].message
  )
  assert fdt.check(_factory(), GOOD, MESH, allow=['eager-sharding-off']) == (
    _check_report.CheckReport((), ('eager-sharding-off',))
  )
  # Built with eager sharding turned back on, nothing is created unplaced.
  with nnx.use_eager_sharding(True):
    assert not fdt.check(_factory(), GOOD, MESH)


def test_a_short_annotation_is_a_finding_not_an_error():
  """('C',) on two matrices and a vector: one finding for the matrices,
  none for the vector, whose annotation is whole."""

  class Short(nnx.Module):
    def __init__(self):
      self.a = nnx.Param(jnp.ones((16, 16)), out_sharding=('C',))
      self.b = nnx.Param(jnp.ones((16, 8)), out_sharding=('C',))
      self.c = nnx.Param(jnp.ones((16,)), out_sharding=('C',))

  report = fdt.check(Short, [('C', 'data')], MESH)
  assert [(f.code, f.subject) for f in report.findings] == [
    ('short-annotation', "('C',)")
  ]
  assert report.findings[0].message.startswith(
    '2 variables of rank 2 (e.g. a) are annotated with 1 logical name, so '
    "the missing trailing names are None, as Flax reads it: ('C', None)."
  )
  assert not fdt.check(Short, [('C', 'data')], MESH, allow=['short-annotation'])


# activation-axis-clash: the batch's mesh axis on a kernel's output dimension


class _Up(nnx.Module):
  def __init__(self, rngs):
    self.l = nnx.Linear(
      16,
      64,
      kernel_init=nnx.with_partitioning(
        nnx.initializers.lecun_normal(), ('embed', 'mlp')
      ),
      rngs=rngs,
    )

  def __call__(self, x):
    return self.l(fdt.with_logical_constraint(x, ('batch', 'embed')))


# The Quickstart's rules: 'mlp' falls back to 'data' where 'model' is absent.
QUICKSTART = [
  ('batch', 'data'),
  ('embed', 'fsdp'),
  ('mlp', 'model'),
  ('mlp', 'data'),
  ('vocab', None),
]
_LINT = ['unused-rule', 'unknown-mesh-axis']


def test_the_batch_axis_on_a_kernel_output_is_caught_in_our_words():
  """On one device, 'mlp' falls back to 'data', the batch's axis: the
  forward fails in JAX eagerly and under jit; check says why first."""
  mesh = jax.make_mesh((1,), ('data',))
  report = fdt.check(lambda: _Up(nnx.Rngs(0)), QUICKSTART, mesh, allow=_LINT)
  assert [(f.code, f.subject) for f in report.findings] == [
    ('activation-axis-clash', "'data'")
  ]
  assert report.findings[0].message == (
    "the batch name 'batch', which no variable has (an activation's, as "
    'with_logical_constraint uses it), goes to the Explicit mesh axis '
    "'data', and so does the last dimension ('mlp') of 1 variable (e.g. "
    "l/kernel: P(None, 'data')) (by a fallback: the rules before it do not "
    'fit this mesh). A matmul of an activation sharded so with such a '
    "variable gives a result sharded over 'data' on two dimensions, which "
    'JAX refuses, eagerly and under jit (ShardingTypeError: ... illegally '
    "sharded result). Give 'mlp' or 'batch' another mesh axis in the rules, "
    'or reshard one of them in the forward.'
  )
  # What the finding foretells, eagerly and under jit alike.
  x = jnp.ones((32, 16))
  with jax.set_mesh(mesh), fdt.logical_axis_rules(QUICKSTART):
    model = _Up(nnx.Rngs(0))
    step = nnx.jit(lambda m, v: m(v))
    for forward in (model, lambda v: step(model, v)):
      # JAX's own ShardingTypeError (not public).
      with pytest.raises(Exception, match='illegally sharded result'):
        forward(x)


def test_no_clash_where_the_axes_differ_or_are_auto():
  """The Quickstart's own mesh; the same rules on one Auto device, where
  XLA resolves the two shardings; a fix the finding names."""
  quickstart_mesh = AbstractMesh((2, 4), ('data', 'model'))
  auto = jax.make_mesh(
    (1,), ('data',), axis_types=(jax.sharding.AxisType.Auto,)
  )
  fixed = [('batch', 'data'), ('embed', None), ('mlp', 'model'), ('mlp', None)]
  one = jax.make_mesh((1,), ('data',))
  for rules, mesh in (
    (QUICKSTART, quickstart_mesh),
    (QUICKSTART, auto),
    (fixed, one),
  ):
    report = fdt.check(lambda: _Up(nnx.Rngs(0)), rules, mesh, allow=_LINT)
    assert not report, (mesh, report)
