"""Rules naming mesh axes the mesh lacks: likely typos said, intent kept."""

import pickle
import warnings

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import flax_dtensor as fdt
from flax_dtensor._rules import _missing_axes
from flax_dtensor.demo import train

ABSTRACT = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
TYPO = [('embed', 'fsdp'), ('embed', 'dta'), ('embed', None), ('mlp', 'model')]
INTENDED = [('embed', 'fsdp'), ('embed', 'data'), ('mlp', 'model')]
TYPO_TEXT = (
  "('embed', 'dta') names mesh axis 'dta', which the mesh lacks (did you "
  "mean 'data'?)"
)


def _make():
  init = nnx.with_partitioning(nnx.initializers.ones, ('embed', 'mlp'))
  return nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
  'axis, mesh_axes, meant',
  [
    ('dta', ('data', 'model'), 'data'),
    ('modle', ('data', 'model'), 'model'),
    ('mdoel', ('data', 'model'), 'model'),
    ('dataa', ('data', 'model'), 'data'),
    ('Data', ('data', 'model'), 'data'),
    ('tensr', ('fsdp', 'tensor'), 'tensor'),
    ('fsdp', ('data', 'model'), None),
    ('fsdp', ('dp', 'tp'), None),
    ('tp', ('dp', 'model'), None),
    ('expert', ('data', 'model'), None),
    ('fsdp_transpose', ('fsdp', 'tensor'), None),
  ],
  ids=lambda x: str(x),
)
def test_the_similarity_rule(axis, mesh_axes, meant):
  assert _missing_axes.likely_meant(axis, mesh_axes) == meant


def _built_twice(make, mesh, rules, then=lambda model: None):
  """`make()` twice under `mesh` and `rules`, the first warning a likely
  typo: the first model, the first call's warnings, and those of the
  second call and of `then(model)` after it."""
  with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
    with pytest.warns(fdt.LikelyTypoWarning) as caught:
      model = make()
    with warnings.catch_warnings(record=True) as again:
      warnings.simplefilter('always')
      make()
      then(model)
  return model, caught, again


def test_building_warns_a_likely_typo_once_per_rules_and_mesh():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  rules = fdt.LogicalRules(TYPO)
  model, caught, again = _built_twice(_make, mesh, rules, then=fdt.shard_module)
  (warning,) = caught
  assert str(warning.message).startswith('Likely typo in the rules: ')
  assert TYPO_TEXT in str(warning.message)
  assert "missing_mesh_axes='error'" in str(warning.message)
  assert [w for w in again if w.category is fdt.LikelyTypoWarning] == []
  # The typo really replicated 'embed': 'mlp' alone shards the kernel.
  assert model.kernel.sharding.spec == P(None, 'model')
  np.testing.assert_array_equal(np.asarray(model.kernel[...]), 1.0)
  # Other rules on the same mesh, or these rules on another mesh, warn anew.
  with jax.set_mesh(mesh), fdt.logical_axis_rules(TYPO):
    with pytest.warns(fdt.LikelyTypoWarning, match="did you mean 'data'"):
      _make()


def test_intended_fallbacks_stay_quiet():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  with jax.set_mesh(mesh), fdt.logical_axis_rules(INTENDED):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter('always')
      model = _make()
  assert caught == []
  assert model.kernel.sharding.spec == P('data', 'model')
  plan = fdt.plan(_make, mesh=ABSTRACT, rules=INTENDED)
  assert plan.likely_typos == ()
  text = plan.render(100)
  assert 'Likely typo' not in text
  assert 'Fallbacks: 1 reason, 1 variable' in text


def test_the_plan_heads_with_the_typo_and_counts_it_apart():
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    plan = fdt.plan(_make, mesh=ABSTRACT, rules=TYPO)
  assert caught == []  # Said by the headline, not a warning.
  assert plan.likely_typos == (TYPO_TEXT,)
  assert plan['kernel'].spec == P(None, 'model')
  assert plan['kernel'].bytes_per_device == 16 * 32 * 4 // 4
  text = plan.render(200)
  lines = text.splitlines()
  assert lines[1] == f'Likely typo: {TYPO_TEXT}'
  assert (
    'Fallbacks: 1 intended reason, 1 variable; 1 likely typo, 1 variable'
  ) in text
  assert "a likely typo of 'data'" in text
  assert f'Likely typo: {TYPO_TEXT}' in plan.summary().render(200)
  assert 'Likely typo' in plan._repr_html_()
  back = fdt.ShardingPlan.from_json(plan.to_json())
  assert back.likely_typos == plan.likely_typos
  # At 80 columns the headline wraps between words, indented under itself.
  narrow = plan.render(80).splitlines()
  assert narrow[1:3] == [
    "Likely typo: ('embed', 'dta') names mesh axis 'dta', which the mesh "
    'lacks (did',
    "  you mean 'data'?)",
  ]
  assert max(map(len, narrow)) <= 80


def test_a_path_rule_spec_with_a_typo():
  rules = fdt.LogicalRules([], path_rules=[('kernel$', P('dta', 'model'))])
  plan = fdt.plan(
    lambda: nnx.Linear(16, 32, rngs=nnx.Rngs(0)), mesh=ABSTRACT, rules=rules
  )
  assert plan.likely_typos == (
    "path rule #0 'kernel$' names mesh axis 'dta', which the mesh lacks "
    "(did you mean 'data'?)",
  )
  assert plan['kernel'].spec == P(None, 'model')


def test_missing_mesh_axes_error_names_every_such_rule():
  rules = fdt.LogicalRules(TYPO, missing_mesh_axes='error')
  assert rules.missing_mesh_axes == 'error'
  match = (
    r"say missing_mesh_axes='error': \('embed', 'fsdp'\) names mesh axis "
    r"'fsdp', which the mesh lacks; \('embed', 'dta'\) names mesh axis "
    r"'dta', which the mesh lacks \(did you mean 'data'\?\)\. Fix the names"
  )
  with pytest.raises(fdt.MissingMeshAxisError, match=match):
    fdt.plan(_make, mesh=ABSTRACT, rules=rules)
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
    with pytest.raises(fdt.MissingMeshAxisError, match=match):
      _make()
  # An intended fallback is an error too, for those who ask.
  intended = fdt.LogicalRules(INTENDED, missing_mesh_axes='error')
  with pytest.raises(fdt.MissingMeshAxisError, match=r"'fsdp', which the"):
    fdt.logical_to_mesh_axes(('embed',), mesh=ABSTRACT, rules=intended)
  # It is a LogicalRulesError: existing `except` clauses catch it.
  assert issubclass(fdt.MissingMeshAxisError, fdt.LogicalRulesError)
  # On a mesh with every axis, nothing to say.
  full = jax.sharding.AbstractMesh((2, 2, 2), ('fsdp', 'data', 'model'))
  assert fdt.logical_to_mesh_axes(
    ('embed', 'mlp'), mesh=full, rules=intended
  ) == P('fsdp', 'model')
  # check() reports them as findings instead of raising.
  report = fdt.check(_make, rules, ABSTRACT)
  assert {(f.code, f.subject) for f in report.findings} == {
    ('unknown-mesh-axis', "('embed', 'fsdp')"),
    ('mesh-axis-typo', "('embed', 'dta')"),
  }


def test_the_option_in_yaml_pickles_and_replace():
  text = (
    "logical_axis_rules:\n  - ['embed', 'dta']\nmissing_mesh_axes: 'error'\n"
  )
  rules = fdt.LogicalRules.from_yaml_text(text)
  assert rules.missing_mesh_axes == 'error'
  assert rules.to_yaml_text() == text
  assert pickle.loads(pickle.dumps(rules)) == rules
  assert rules.replace(missing_mesh_axes='fallback').missing_mesh_axes == (
    'fallback'
  )
  assert 'missing_mesh_axes' not in fdt.LogicalRules(TYPO).to_yaml_text()
  with pytest.raises(
    fdt.LogicalRulesError,
    match=r"`missing_mesh_axes` must be one of \('fallback', 'error'\).*"
    r"got 'raise'",
  ):
    fdt.LogicalRules.from_yaml_text(
      "logical_axis_rules: [['embed', 'data']]\nmissing_mesh_axes: raise\n"
    )


@pytest.mark.parametrize(
  'shape, names',
  [
    ((2, 4), ('data', 'model')),
    ((8,), ('data',)),
    ((4, 2), ('data', 'model')),
    ((2, 2, 2), ('fsdp', 'data', 'model')),
    ((8,), ('model',)),
  ],
  ids=lambda x: str(x),
)
def test_the_demo_rules_have_no_typo_on_the_demo_meshes(shape, names):
  mesh = jax.sharding.AbstractMesh(shape, names)
  from flax_dtensor.demo import model as demo_model

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    plan = fdt.plan(
      demo_model.make_model, mesh=mesh, rules=train.default_rules()
    )
    with fdt.logical_axis_rules(train.default_rules()):
      fdt.logical_to_mesh_axes(('embed', 'mlp'), mesh=mesh)
  assert plan.likely_typos == ()
  assert [w for w in caught if w.category is fdt.LikelyTypoWarning] == []


# Logical names no rule mentions, spelled like one: "did you mean"
# ------------------------------------------------------------------------------

NAMES = [('embed', 'data'), ('mlp', 'model')]


def _make_embedd():
  init = nnx.with_partitioning(nnx.initializers.ones, ('embedd', 'mlp'))
  return nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0))


def test_an_unknown_logical_name_is_told_what_it_likely_meant():
  """'embedd' in an annotation, 'embed' in the rules: the error, the plan's
  headline, `check`'s findings and the warning each say "did you mean
  'embed'?"."""
  with pytest.raises(
    fdt.UnknownLogicalAxisError,
    match=r"\['embedd'\] are not mentioned by any rule .*"
    r"'embedd': did you mean 'embed'\?",
  ):
    fdt.plan(_make_embedd, mesh=ABSTRACT, rules=NAMES)
  lenient = fdt.LogicalRules(NAMES, unknown='replicate')
  plan = fdt.plan(_make_embedd, mesh=ABSTRACT, rules=lenient)
  assert plan.likely_typos == (
    "'embedd' (at kernel) is in no rule, so it is replicated (did you mean "
    "'embed'?)",
  )
  assert plan['kernel'].spec == P(None, 'model')  # Replicated indeed.
  assert str(plan).splitlines()[1].startswith("Likely typo: 'embedd' (at ")
  report = fdt.check(_make_embedd, NAMES, ABSTRACT)
  by_code = {f.code: f for f in report.findings}
  assert by_code['unknown-logical-name'].subject == "'embedd'"
  assert by_code['unknown-logical-name'].message.startswith(
    "1 variable (e.g. kernel) has the logical axis 'embedd', which no rule "
    "mentions, so creating it fails (did you mean 'embed'?)."
  )
  assert "(did you mean 'embedd'?)" in by_code['unused-rule'].message
  # Replicated on creation: warned once per rules and name.
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  model, caught, again = _built_twice(_make_embedd, mesh, lenient)
  (warning,) = [w for w in caught if w.category is fdt.LikelyTypoWarning]
  assert str(warning.message).startswith(
    "Likely typo: the logical axis name(s) 'embedd' (did you mean 'embed'?) "
    'are in no rule'
  )
  assert [w for w in again if w.category is fdt.LikelyTypoWarning] == []
  assert model.kernel.sharding.spec == P(None, 'model')
  # A name like none of the rules' stays quiet (replicated as asked).
  init = nnx.with_partitioning(nnx.initializers.ones, ('vocab', 'mlp'))
  with jax.set_mesh(mesh), fdt.logical_axis_rules(lenient):
    with warnings.catch_warnings(record=True) as quiet:
      warnings.simplefilter('always')
      nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0))
  assert [w for w in quiet if w.category is fdt.LikelyTypoWarning] == []


class _UsersBlock(nnx.Module):
  """A user's module: the line creating the layer is what a warning names."""

  def __init__(self, axes):
    init = nnx.with_partitioning(nnx.initializers.ones, axes)
    self.up = nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0))  # here


def _line_of(marker, function):
  import inspect

  lines, start = inspect.getsourcelines(function)
  (offset,) = [i for i, line in enumerate(lines) if line.endswith(marker)]
  return start + offset


@pytest.mark.parametrize(
  'rules, axes',
  [
    (TYPO, ('embed', 'mlp')),
    (fdt.LogicalRules(NAMES, unknown='replicate'), ('embedd', 'mlp')),
  ],
  ids=['mesh-axis-typo', 'logical-name-typo'],
)
def test_a_warning_points_at_the_users_line(rules, axes):
  """Not at flax_dtensor's or Flax's frames, however deep the resolution
  ran: at the user's module, and at the user's call of `fdt.init`."""
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  rules = fdt.LogicalRules(list(rules), unknown=getattr(rules, 'unknown', None))
  with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
    with pytest.warns(fdt.LikelyTypoWarning) as caught:
      _UsersBlock(axes)
  (warning,) = [w for w in caught if w.category is fdt.LikelyTypoWarning]
  assert (warning.filename, warning.lineno) == (
    __file__,
    _line_of('# here\n', _UsersBlock.__init__),
  )
  again = fdt.LogicalRules(list(rules), unknown=rules.unknown)
  with pytest.warns(fdt.LikelyTypoWarning) as caught:
    fdt.init(_UsersBlock, axes, mesh=mesh, rules=again)  # call
  (warning,) = [w for w in caught if w.category is fdt.LikelyTypoWarning]
  assert warning.filename == __file__
  assert warning.lineno in (
    _line_of('# here\n', _UsersBlock.__init__),
    _line_of('# call\n', test_a_warning_points_at_the_users_line),
  )
