"""Path rules: their forms, their YAML, and their semantics by values.

The semantics (first match, type filters, ``...``, thresholds, annotation
precedence, logical and mesh-axis targets) are checked against
`reference_semantics.path_rule_placement` on generated cases, through
`spec_of_variable` (variables) and `spec_of_array` (plain arrays).
"""

import pickle

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P
from support import profiles, reference_semantics

import flax_dtensor as fdt
from flax_dtensor._rules import _spec

SIZES = {'data': 2, 'model': 4}
# Auto axes, as the messages below spell them (the default axis type of an
# AbstractMesh is Auto in jax 0.10, Explicit from jax 0.11).
MESH = AbstractMesh(
  (2, 4), ('data', 'model'), axis_types=(AxisType.Auto, AxisType.Auto)
)
LOGICAL = [('embed', 'data'), ('mlp', 'model'), ('heads', 'model')]


# Forms
# ------------------------------------------------------------------------------


def test_a_rule_takes_logical_axes_a_spec_or_none():
  logical = fdt.PathRule(r'mlp/up/kernel$', (..., 'embed', 'mlp'))
  assert logical.target == (Ellipsis, 'embed', 'mlp')
  assert repr(logical) == "PathRule('mlp/up/kernel$', (..., 'embed', 'mlp'))"
  spec = fdt.PathRule('kernel', P(('data', 'model'), None), type=nnx.Param)
  assert spec.target == P(('data', 'model'), None)
  assert repr(spec) == (
    "PathRule('kernel', P(('data', 'model'), None), type=nnx.Param)"
  )
  for replicate in (None, (), [], P(), P(None, None)):
    assert fdt.PathRule('x', replicate).target is None
  assert fdt.PathRule('x', ['...', 'embed']).target == (Ellipsis, 'embed')
  assert fdt.PathRule('x', ('embed',), override=True).override
  rule = fdt.PathRule('a', P(..., 'data'), type=nnx.BatchStat, override=True)
  assert pickle.loads(pickle.dumps(rule)) == rule


def test_a_type_filter_matches_the_type_and_its_subclasses():
  rule = fdt.PathRule('w', ('embed',), type=nnx.Param)
  assert rule.matches('layers/0/w', nnx.Param)
  assert not rule.matches('layers/0/w', nnx.BatchStat)
  assert not rule.matches('layers/0/w', None)  # A plain array has no type.
  assert fdt.PathRule('w', ('embed',), type=nnx.Variable).matches(
    'w', nnx.BatchStat
  )
  untyped = fdt.PathRule('w', ('embed',))
  assert untyped.matches('w', None) and untyped.matches('w', nnx.Cache)


def test_logical_rules_carry_path_rules_and_thresholds():
  rules = fdt.LogicalRules(
    LOGICAL,
    path_rules=[('kernel$', ('embed', 'mlp')), {'pattern': 'b', 'spec': []}],
    min_size=16,
    min_bytes=64,
  )
  assert [r.pattern for r in rules.path_rules] == ['kernel$', 'b']
  assert (rules.min_size, rules.min_bytes) == (16, 64)
  assert pickle.loads(pickle.dumps(rules)) == rules
  assert rules != fdt.LogicalRules(LOGICAL)
  # Every way of deriving rules keeps them.
  for derived in (
    rules.replace(unknown='replicate'),
    rules.replace(strict=True),
    rules.prepend([('vocab', None)]),
    fdt.LogicalRules(rules),
  ):
    assert derived.path_rules == rules.path_rules
    assert (derived.min_size, derived.min_bytes) == (16, 64)
  assert rules.replace(path_rules=[]).path_rules == ()
  with fdt.logical_axis_rules(rules):
    assert fdt.get_logical_axis_rules().path_rules == rules.path_rules
  assert 'path_rules=[PathRule(' in repr(rules) and 'min_size=16' in repr(rules)


def test_path_rules_from_yaml():
  text = """
logical_axis_rules: [['embed', 'data'], ['mlp', 'model']]
path_rules:
  - ['embed/embedding$', ['vocab', 'embed']]
  - {pattern: 'attn/(q|k|v)/kernel$', spec: ['...', 'data', ['model']]}
  - {pattern: 'up/kernel', logical: ['...', 'embed', 'mlp'], override: true}
  - {pattern: 'norm', logical: null, type: Param}
  - {pattern: 'mean', spec: [null, ['data', 'model']], type: nnx.BatchStat}
min_size: 8
min_bytes: 65536
"""
  rules = fdt.LogicalRules.from_yaml_text(text)
  assert list(rules) == [('embed', 'data'), ('mlp', 'model')]
  assert rules.path_rules == (
    fdt.PathRule('embed/embedding$', ('vocab', 'embed')),
    fdt.PathRule('attn/(q|k|v)/kernel$', P(..., 'data', 'model')),
    fdt.PathRule('up/kernel', (..., 'embed', 'mlp'), override=True),
    fdt.PathRule('norm', None, type=nnx.Param),
    fdt.PathRule('mean', P(None, ('data', 'model')), type=nnx.BatchStat),
  )
  assert (rules.min_size, rules.min_bytes) == (8, 65536)
  # Path rules alone make a rules file; each rule writes itself back.
  alone = fdt.LogicalRules.from_yaml_text(
    "path_rules: [{pattern: 'k$', spec: [data]}]"
  )
  assert list(alone) == [] and alone.path_rules[0].target == P('data')
  assert rules.path_rules[1].to_yaml_dict() == {
    'pattern': 'attn/(q|k|v)/kernel$',
    'spec': ['...', 'data', 'model'],
  }
  assert rules.path_rules[4].to_yaml_dict()['type'] == 'BatchStat'


def test_a_note_says_why_and_the_plan_shows_it():
  rule = fdt.PathRule('up/kernel$', ('embed', 'mlp'), note='mlp  up\n')
  assert rule.note == 'mlp up'  # One line, as the plan's column shows it.
  assert repr(rule) == (
    "PathRule('up/kernel$', ('embed', 'mlp'), note='mlp up')"
  )
  assert rule.describe(2) == "path rule #2 'up/kernel$' (mlp up)"
  assert pickle.loads(pickle.dumps(rule)) == rule
  assert rule != fdt.PathRule('up/kernel$', ('embed', 'mlp'))
  read = fdt.LogicalRules.from_yaml_text(
    "path_rules: [{pattern: 'up/kernel$', logical: [embed, mlp], "
    "note: 'mlp up'}]"
  )
  assert read.path_rules == (rule,)
  rules = fdt.LogicalRules(LOGICAL, path_rules=[rule])
  plan = fdt.plan(
    {'up': {'kernel': jax.ShapeDtypeStruct((8, 16), np.float32)}},
    mesh=MESH,
    rules=rules,
  )
  assert plan['up/kernel'].source == "path rule #0 'up/kernel$' (mlp up)"
  with pytest.raises(fdt.LogicalRulesError, match='`note` must be a non-e'):
    fdt.PathRule('x', None, note=' ')


def test_rules_write_themselves_as_yaml_and_read_back():
  rules = fdt.LogicalRules(
    [('embed', 'data'), ('mlp', ('data', 'model')), ('vocab', None)],
    path_rules=[
      ('up/kernel$', ('embed', None)),
      fdt.PathRule(r"(^|/)a\d+/b's", P(..., ('data', 'model')), note="it's"),
      fdt.PathRule('norm', None, type=nnx.Param, override=True),
    ],
    min_size=4,
    min_bytes=64,
  )
  text = rules.to_yaml_text()
  assert text.splitlines() == [
    'logical_axis_rules:',
    "  - ['embed', 'data']",
    "  - ['mlp', ['data', 'model']]",
    "  - ['vocab', null]",
    'path_rules:',
    "  - {pattern: 'up/kernel$', logical: ['embed', null]}",
    "  - {pattern: '(^|/)a\\d+/b''s', spec: ['...', ['data', 'model']], "
    "note: 'it''s'}",
    "  - {pattern: 'norm', logical: [], type: 'Param', override: true}",
    'min_size: 4',
    'min_bytes: 64',
  ]
  assert fdt.LogicalRules.from_yaml_text(text) == rules
  assert fdt.LogicalRules([]).to_yaml_text() == 'logical_axis_rules: []\n'


# Semantics by values
# ------------------------------------------------------------------------------


def _variable(kind, shape, annotation=None):
  value = jax.ShapeDtypeStruct(shape, np.float32)
  if annotation is None:
    return kind(value)
  return kind(value, out_sharding=annotation, eager_sharding=False)


def _place(variable, path, rules):
  return _spec.spec_of_variable(variable, rules=rules, mesh=MESH, path=path)


def test_the_first_matching_rule_wins_and_annotations_win_unless_override():
  rules = fdt.LogicalRules(
    LOGICAL,
    path_rules=[
      ('attn/q/kernel$', P('model', None)),
      ('kernel$', ('embed', 'mlp')),
      ('up/kernel$', P(None, 'data')),  # Shadowed by 'kernel$'.
      ('bias$', ('mlp',)),
    ],
  )
  q = _place(_variable(nnx.Param, (8, 16)), 'attn/q/kernel', rules)
  assert (
    q.spec == P('model', None) and q.source == "path rule #0 'attn/q/kernel$'"
  )
  up = _place(_variable(nnx.Param, (8, 16)), 'mlp/up/kernel', rules)
  assert up.spec == P('data', 'model') and up.source == "path rule #1 'kernel$'"
  annotated = _variable(nnx.Param, (8, 16), ('mlp', 'embed'))
  mine = _place(annotated, 'mlp/up/kernel', rules)
  assert mine.spec == P('model', 'data') and mine.source == 'annotation'
  override = rules.replace(
    path_rules=[fdt.PathRule('kernel$', P(None, 'model'), override=True)]
  )
  forced = _place(annotated, 'mlp/up/kernel', override)
  assert forced.spec == P(None, 'model') and forced.by_path_rule
  assert _place(_variable(nnx.Param, (8,)), 'norm/scale', rules) is None
  # Without a path, path rules cannot apply (nnx.get_partition_spec lends
  # one, see hook_test.py).
  assert (
    _spec.spec_of_variable(
      _variable(nnx.Param, (8, 16)), rules=rules, mesh=MESH
    )
    is None
  )


def test_ellipsis_serves_stacked_layers_and_a_wrong_rank_is_an_error():
  rules = fdt.LogicalRules(
    LOGICAL, path_rules=[('up/kernel$', (..., 'embed', 'mlp'))]
  )
  for shape, spec in (
    ((8, 16), P('data', 'model')),
    ((3, 8, 16), P(None, 'data', 'model')),
    ((5, 3, 8, 16), P(None, None, 'data', 'model')),
  ):
    assert _place(_variable(nnx.Param, shape), 'up/kernel', rules).spec == spec
  with pytest.raises(
    fdt.ShardingResolutionError,
    match=r"path rule #0 'up/kernel\$' matches 'up/kernel', of shape \(16,\) "
    r'\(rank 1\), but its target \(\.\.\., \'embed\', \'mlp\'\) has 2 entries '
    r'after \.\.\.\. Expected at most one entry per dimension',
  ):
    _place(_variable(nnx.Param, (16,)), 'up/kernel', rules)
  exact = rules.replace(path_rules=[('up/kernel$', ('embed', 'mlp'))])
  with pytest.raises(
    fdt.ShardingResolutionError,
    match=r"target \('embed', 'mlp'\) has 2 entries\. Expected one entry per "
    r"dimension: write a target of rank 3 \(e\.g\. \('embed', 'mlp', None\)"
    r"\), or lead it with \.\.\. \(\(\.\.\., 'embed', 'mlp'\)\)",
  ):
    _place(_variable(nnx.Param, (3, 8, 16)), 'up/kernel', exact)


def test_a_spec_is_fitted_to_the_mesh_and_the_shape():
  rules = fdt.LogicalRules(
    [], path_rules=[('w$', P(('data', 'model'), 'fsdp', None))]
  )
  out = _place(_variable(nnx.Param, (16, 8, 6)), 'w', rules)
  assert out.spec == P(('data', 'model'), None, None)
  assert [str(s) for _, s in out.skipped] == [
    "'fsdp': the mesh has no axis 'fsdp' (axes: ['data', 'model'])",
  ]
  odd = rules.replace(path_rules=[('w$', P('model', None, 'data'))])
  out = _place(_variable(nnx.Param, (16, 8, 5)), 'w', odd)
  assert out.spec == P('model', None, None)
  assert [str(s) for _, s in out.skipped] == [
    "'data': dim size 5 is not divisible by 2 (mesh axes ['data'])",
  ]
  plan = fdt.plan(
    {'w': jax.ShapeDtypeStruct((16, 8, 6), np.float32)}, mesh=MESH, rules=rules
  )
  assert plan['w'].logical_axes is None
  assert plan['w'].fallbacks == (
    "dim 1 (P entry 'fsdp'): 'fsdp': the mesh has no axis 'fsdp' (axes: "
    "['data', 'model'])",
  )
  strict = odd.replace(strict=True)
  with pytest.raises(
    fdt.ShardingResolutionError,
    match=r"The mesh axes 'data' of path rule #0 'w\$' cannot shard dim 2 at "
    r'w \(shape \(16, 8, 5\), mesh\(data=2, model=4; Auto, Auto\)\): dim size '
    r'5 is not divisible by 2',
  ):
    _place(_variable(nnx.Param, (16, 8, 5)), 'w', strict)


def test_thresholds_and_scalars_keep_small_arrays_replicated():
  rules = fdt.LogicalRules(
    [], path_rules=[('.*', P(..., 'model'))], min_size=64, min_bytes=1024
  )
  mesh = MESH
  tree = {
    'scalar': jax.ShapeDtypeStruct((), np.float32),
    'few': jax.ShapeDtypeStruct((32,), np.float32),  # < min_size.
    'light': jax.ShapeDtypeStruct((128,), np.int8),  # < min_bytes.
    'big': jax.ShapeDtypeStruct((4, 256), np.float32),
  }
  plan = fdt.plan(tree, mesh=mesh, rules=rules)
  assert {e.path: e.source for e in plan.entries} == {
    'scalar': 'none (a scalar)',
    'few': 'none (32 elements, below min_size=64)',
    'light': 'none (128 bytes, below min_bytes=1024)',
    'big': "path rule #0 '.*'",
  }
  assert plan['big'].spec == P(None, 'model')


# Against the reference, on generated cases
# ------------------------------------------------------------------------------

PATHS = (
  'embed/embedding',
  'layers/0/attn/q/kernel',
  'layers/1/attn/q/kernel',
  'layers/0/mlp/up/kernel',
  'layers/0/norm/scale',
  'layers/0/bn/mean',
  'head/kernel',
)
PATTERNS = (
  r'kernel$',
  r'attn/.*/kernel',
  r'^layers/0/',
  r'embedding',
  r'mlp/(up|down)/kernel$',
  r'scale',
  r'q/',
  r'^head',
  r'.*',
  r'nothing',
)
KINDS = {'Param': nnx.Param, 'BatchStat': nnx.BatchStat, None: None}
RULE_TYPES = {None: None, 'Param': nnx.Param, 'Variable': nnx.Variable}
NAMES = ('embed', 'mlp', 'heads', 'vocab')
MESH_ENTRIES = ('data', 'model', None, ('data', 'model'), ('model', 'data'))


@st.composite
def _targets(draw):
  kind = draw(st.sampled_from(('logical', 'mesh', 'replicate')))
  if kind == 'replicate':
    return ('replicate',), None
  leading = draw(st.booleans())
  n = draw(st.integers(1, 4))
  if kind == 'logical':
    entries = tuple(
      draw(st.lists(st.sampled_from((*NAMES, None)), min_size=n, max_size=n))
    )
    names = [e for e in entries if e is not None]
    if len(names) != len(set(names)) or not names:
      entries = tuple(NAMES[:n])
    ours = ((Ellipsis,) if leading else ()) + entries
    return ('logical', entries, leading), ours
  entries, used = [], set()
  for _ in range(n):
    entry = draw(st.sampled_from(MESH_ENTRIES))
    axes = set(reference_semantics.axes_of(entry))
    if axes & used:
      entry = None
    used |= axes
    entries.append(entry)
  if not any(entries):
    entries[0] = 'model' if 'model' not in used else 'data'
  ours = P(*((Ellipsis,) if leading else ()), *entries)
  return ('mesh', tuple(entries), leading), ours


@st.composite
def cases(draw):
  rank = draw(st.integers(0, 4))
  shape = tuple(
    draw(
      st.lists(st.sampled_from((1, 2, 4, 6, 8)), min_size=rank, max_size=rank)
    )
  )
  annotation = None
  if rank and draw(st.integers(0, 3)) == 0:
    annotation = tuple(NAMES[:rank]) if rank <= len(NAMES) else None
  rules = []
  for _ in range(draw(st.integers(0, 5))):
    target, ours = draw(_targets())
    type_name = draw(st.sampled_from(tuple(RULE_TYPES)))
    override = draw(st.booleans())
    rules.append(
      (draw(st.sampled_from(PATTERNS)), target, type_name, override, ours)
    )
  logical = draw(
    st.lists(
      st.tuples(st.sampled_from(NAMES), st.sampled_from(MESH_ENTRIES)),
      max_size=6,
    )
  )
  return {
    'path': draw(st.sampled_from(PATHS)),
    'kind': draw(st.sampled_from(tuple(KINDS))),
    'annotation': annotation,
    'shape': shape,
    'rules': rules,
    'logical': logical,
    'min_size': draw(st.sampled_from((0, 4, 16))),
    'min_bytes': draw(st.sampled_from((0, 64))),
  }


def _reference(case):
  return reference_semantics.path_rule_placement(
    case['path'],
    case['kind'],
    case['annotation'],
    case['shape'],
    4,
    [(p, t, ty, o) for p, t, ty, o, _ in case['rules']],
    case['logical'],
    SIZES,
    min_size=case['min_size'],
    min_bytes=case['min_bytes'],
    unknown='replicate',
  )


def _ours(case):
  rules = fdt.LogicalRules(
    case['logical'],
    unknown='replicate',
    path_rules=[
      fdt.PathRule(p, ours, type=RULE_TYPES[ty], override=o)
      for p, _, ty, o, ours in case['rules']
    ],
    min_size=case['min_size'],
    min_bytes=case['min_bytes'],
  )
  value = jax.ShapeDtypeStruct(case['shape'], np.float32)
  kind = KINDS[case['kind']]
  if kind is None:
    resolution = _spec.spec_of_array(
      value,
      path=case['path'],
      logical_axes=case['annotation'],
      rules=rules,
      mesh=MESH,
    )
  else:
    resolution = _place(
      _variable(kind, case['shape'], case['annotation']), case['path'], rules
    )
  if resolution is None:
    return None, None
  source = resolution.source
  if source != 'annotation':
    source = int(source.split('#')[1].split()[0])
  return source, tuple(d.target for d in resolution.dims)


@hypothesis.settings(
  max_examples=profiles.examples(1500),
  deadline=None,
  derandomize=True,
  suppress_health_check=list(hypothesis.HealthCheck),
)
@hypothesis.given(cases())
def test_path_rules_match_the_reference(case):
  try:
    expected = _reference(case)
  except reference_semantics.Invalid:
    with pytest.raises(fdt.ShardingResolutionError):
      _ours(case)
    return
  assert _ours(case) == expected


def test_the_generator_reaches_every_outcome():
  seen = set()

  @hypothesis.settings(max_examples=600, deadline=None, derandomize=True)
  @hypothesis.given(cases())
  def survey(case):
    try:
      source, targets = _reference(case)
    except reference_semantics.Invalid:
      seen.add('rank error')
      return
    if source is None:
      seen.add('none')
    elif source == 'annotation':
      seen.add('annotation')
    else:
      seen.add('path rule')
      kind = case['rules'][source][1][0]
      seen.add(kind)
      if any(t is not None for t in targets):
        seen.add('sharded')
      if case['annotation'] is not None:
        seen.add('override')
      if kind != 'replicate' and case['rules'][source][1][2]:
        seen.add('...')
    if case['min_size'] or case['min_bytes']:
      seen.add('threshold')

  survey()
  assert seen == {
    'rank error',
    'none',
    'annotation',
    'path rule',
    'logical',
    'mesh',
    'replicate',
    'sharded',
    'override',
    '...',
    'threshold',
  }
