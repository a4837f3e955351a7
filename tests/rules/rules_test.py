"""Tests for LogicalRules, the rules context, and resolution."""

import concurrent.futures
import pickle
import threading

import flax.linen as nn
import jax
import pytest
from flax import nnx
from flax.core import spmd as core_spmd
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P
from support import profiles

import flax_dtensor as fdt

# Auto axes, as the messages below spell them (the default axis type of an
# AbstractMesh is Auto in jax 0.10, Explicit from jax 0.11).
MESH = AbstractMesh(
  (2, 4), ('data', 'model'), axis_types=(AxisType.Auto, AxisType.Auto)
)


# LogicalRules
# ------------------------------------------------------------------------------


def test_rules_normalize_targets():
  rules = fdt.LogicalRules(
    [
      ('a', 'x'),
      ('b', ['x', 'y']),
      ('c', ('y',)),
      ('d', []),
      ('e', None),
      ('f', ()),
    ]
  )
  assert list(rules) == [
    ('a', 'x'),
    ('b', ('x', 'y')),
    ('c', 'y'),
    ('d', None),
    ('e', None),
    ('f', None),
  ]


def test_rules_from_dict_and_copy_keep_options():
  rules = fdt.LogicalRules({'a': 'x', 'b': None}, unknown='replicate')
  assert list(rules) == [('a', 'x'), ('b', None)]
  copy = fdt.LogicalRules(rules)
  assert copy == rules and copy.unknown == 'replicate'
  strict = rules.replace(strict=True)
  assert strict.strict and strict.unknown == 'replicate'
  assert strict != rules
  assert hash(copy) == hash(rules)


def test_rules_candidates_names_and_repr():
  rules = fdt.LogicalRules([('mlp', 'model'), ('embed', 'x'), ('mlp', 'data')])
  assert rules.candidates('mlp') == ('model', 'data')
  assert rules.candidates('nope') == ()
  assert rules.names == ('mlp', 'embed')
  assert repr(rules.replace(strict=True)) == (
    "LogicalRules([('mlp', 'model'), ('embed', 'x'), ('mlp', 'data')], "
    'strict=True)'
  )


def test_rules_are_immutable_and_picklable():
  rules = fdt.LogicalRules([('a', ('x', 'y'))], strict=True)
  with pytest.raises(AttributeError, match='immutable'):
    rules.strict = False  # type: ignore[misc]
  with pytest.raises(AttributeError, match='immutable'):
    del rules.strict  # type: ignore[misc]
  restored = pickle.loads(pickle.dumps(rules))
  assert restored == rules and restored.strict


def test_rules_are_a_tuple_that_linen_accepts():
  rules = fdt.LogicalRules([('batch', 'data'), ('mlp', 'model')])
  assert isinstance(rules, tuple)
  assert nn.logical_to_mesh_axes(('batch', 'mlp'), rules) == P('data', 'model')


@pytest.mark.parametrize(
  'pairs, error, match',
  [
    (
      'batch',
      fdt.LogicalRulesError,
      'sequence of .logical_name, target. pairs',
    ),
    (42, fdt.LogicalRulesError, 'got int 42'),
    ([('a', 'x', 'y')], fdt.LogicalRulesError, r"rule 0 \('a', 'x', 'y'\)"),
    (['ab'], fdt.LogicalRulesError, 'expected a .logical_name, target. pair'),
    ([(1, 'x')], fdt.LogicalRulesError, 'logical name must be a non-empty str'),
    ([('', 'x')], fdt.LogicalRulesError, 'non-empty str'),
    ([('a', 3)], fdt.RuleTargetTypeError, 'got int 3'),
    ([('a', ['x', 3])], fdt.RuleTargetTypeError, 'non-str items'),
    ([('a', ('x', 'x'))], fdt.LogicalRulesError, 'more than once'),
  ],
  ids=[
    'str',
    'int',
    'triple',
    'string-pair',
    'int-name',
    'empty-name',
    'int-target',
    'mixed-target',
    'repeated-axis',
  ],
)
def test_malformed_rules_raise(pairs, error, match):
  with pytest.raises(error, match=match):
    fdt.LogicalRules(pairs)


def test_rule_errors_are_valueerror_or_typeerror():
  assert issubclass(fdt.LogicalRulesError, ValueError)
  assert issubclass(fdt.RuleTargetTypeError, TypeError)
  assert issubclass(fdt.UnknownLogicalAxisError, fdt.FlaxDTensorError)


def test_bad_options_raise():
  with pytest.raises(fdt.LogicalRulesError, match='`unknown` must be one of'):
    fdt.LogicalRules([], unknown='ignore')  # type: ignore[arg-type]
  with pytest.raises(fdt.LogicalRulesError, match='`strict` must be a bool'):
    fdt.LogicalRules([], strict='yes')  # type: ignore[arg-type]


# YAML
# ------------------------------------------------------------------------------

MAXTEXT_YAML = """\
# Parallelism
mesh_axes: ['data', 'fsdp', 'tensor']
logical_axis_rules: [
  ['batch', ['data', 'fsdp']],
  ['embed', 'fsdp'],
  ['mlp', 'tensor'],
  ['vocab', []],
]
"""


def test_from_yaml_text_and_file(tmp_path):
  expected = [
    ('batch', ('data', 'fsdp')),
    ('embed', 'fsdp'),
    ('mlp', 'tensor'),
    ('vocab', None),
  ]
  assert list(fdt.LogicalRules.from_yaml_text(MAXTEXT_YAML)) == expected
  path = tmp_path / 'rules.yml'
  path.write_text(MAXTEXT_YAML)
  assert list(fdt.LogicalRules.from_yaml(path)) == expected
  assert list(fdt.LogicalRules.from_yaml(str(path))) == expected
  bare = '- [batch, data]\n- [embed, null]\n'
  rules = fdt.LogicalRules.from_yaml_text(bare, unknown='replicate')
  assert list(rules) == [('batch', 'data'), ('embed', None)]
  assert rules.unknown == 'replicate'


def test_python_and_yaml_take_the_same_mapping():
  """A mapping of each logical name to its one target, in either spelling."""
  mapping = {'embed': 'data', 'mlp': ['model', 'data'], 'vocab': None}
  python = fdt.LogicalRules(mapping)
  yaml_rules = fdt.LogicalRules.from_yaml_text(
    'logical_axis_rules: {embed: data, mlp: [model, data], vocab: null}\n'
  )
  assert yaml_rules == python
  assert list(python) == [
    ('embed', 'data'),
    ('mlp', ('model', 'data')),
    ('vocab', None),
  ]
  # A scalar is refused by both, each naming what it got.
  with pytest.raises(fdt.LogicalRulesError, match=r'got str .*embed'):
    fdt.LogicalRules('embed')
  with pytest.raises(fdt.LogicalRulesError, match=r'got str .*embed'):
    fdt.LogicalRules.from_yaml_text('logical_axis_rules: embed\n')


def test_from_yaml_uses_the_safe_loader():
  with pytest.raises(fdt.LogicalRulesError, match='not valid YAML'):
    fdt.LogicalRules.from_yaml_text(
      '- !!python/object/apply:os.system ["true"]\n'
    )


@pytest.mark.parametrize(
  'text, match',
  [
    ('a: [1, 2\n', 'not valid YAML'),
    ('mesh_axes: [data]\nother: 1\n', 'no `logical_axis_rules` key'),
    ('just a string\n', 'expected a list of'),
    ('- [batch]\n', 'expected a .logical_name, target. pair'),
  ],
  ids=['syntax', 'no-key', 'scalar', 'short-pair'],
)
def test_from_yaml_errors(text, match):
  with pytest.raises(fdt.LogicalRulesError, match=match):
    fdt.LogicalRules.from_yaml_text(text)


def test_from_yaml_missing_file(tmp_path):
  with pytest.raises(fdt.LogicalRulesError, match='Cannot read rules file'):
    fdt.LogicalRules.from_yaml(str(tmp_path / 'missing.yaml'))


# Resolution
# ------------------------------------------------------------------------------

RULES = fdt.LogicalRules(
  [
    ('batch', 'data'),
    ('embed', 'fsdp'),
    ('mlp', 'model'),
    ('mlp', 'data'),
    ('vocab', None),
    ('heads', ('data', 'model')),
    ('heads', 'model'),
  ]
)


@pytest.mark.parametrize(
  'axes, shape, expected',
  [
    # 'fsdp' is not in the mesh: skipped, 'embed' stays unsharded.
    (('embed', 'mlp'), (512, 2048), P(None, 'model')),
    # 'model' is used by 'mlp'... no: batch claims 'data' first, mlp 'model'.
    (('batch', 'mlp'), (8, 16), P('data', 'model')),
    # 6 is not divisible by 4: 'mlp' falls back to 'data'.
    (('embed', 'mlp'), (512, 6), P(None, 'data')),
    # 'data' is taken by 'batch' and 6 % 4 != 0: unsharded.
    (('batch', 'mlp'), (8, 6), P('data', None)),
    # Product target (8 divides 16).
    (('heads', 'embed'), (16, 4), P(('data', 'model'), None)),
    # Product does not divide 12; falls back to 'model'.
    (('heads', 'embed'), (12, 4), P('model', None)),
    # None entries and replicate rules.
    ((None, 'vocab'), (3, 5), P(None, None)),
    ((), (), P()),
  ],
  ids=[
    'missing-axis',
    'priority',
    'non-divisible',
    'taken-and-non-divisible',
    'product',
    'product-fallback',
    'replicate',
    'scalar',
  ],
)
def test_resolution_with_mesh_and_shape(axes, shape, expected):
  assert fdt.logical_to_mesh_axes(axes, shape, mesh=MESH, rules=RULES) == (
    expected
  )


def test_resolution_records_skips():
  from flax_dtensor._rules import _resolution

  res = _resolution.resolve_dims(
    ('batch', 'mlp'), (8, 6), mesh=MESH, rules=RULES
  )
  dim = res.dims[1]
  assert dim.target is None and dim.fell_back
  assert [str(s) for s in dim.skipped] == [
    "'model': dim size 6 is not divisible by 4 (mesh axes ['model'])",
    "'data': mesh axis 'data' already shards dim 0 ('batch')",
  ]


def test_size_one_mesh_axes_are_harmless():
  mesh = AbstractMesh((1, 8), ('data', 'model'))
  spec = fdt.logical_to_mesh_axes(
    ('batch', 'mlp'), (3, 16), mesh=mesh, rules=RULES
  )
  assert spec == P('data', 'model')


def test_strict_mode_raises_when_no_candidate_fits():
  strict = RULES.replace(strict=True)
  assert fdt.logical_to_mesh_axes(
    ('batch', 'mlp'), (8, 16), mesh=MESH, rules=strict
  ) == P('data', 'model')
  with pytest.raises(
    fdt.ShardingResolutionError,
    match=r"No rule fits dim 1 \('mlp'\).*not divisible by 4.*already shards"
    r'.*drop `strict=True`',
  ):
    fdt.logical_to_mesh_axes(('batch', 'mlp'), (8, 6), mesh=MESH, rules=strict)


def test_unknown_name_errors_by_default_and_can_replicate():
  with pytest.raises(
    fdt.UnknownLogicalAxisError,
    match=r"\['length'\] are not mentioned by any rule.*\('length', None\)"
    r'.*unknown="replicate"',
  ):
    fdt.logical_to_mesh_axes(('batch', 'length'), rules=RULES)
  lenient = RULES.replace(unknown='replicate')
  assert fdt.logical_to_mesh_axes(('batch', 'length'), rules=lenient) == P(
    'data', None
  )


def test_no_rules_at_all_keeps_flax_semantics():
  # No rules: names are mesh axes, as in Flax. Against a mesh, a name that
  # is no mesh axis is an error naming the fix.
  assert fdt.logical_to_mesh_axes(('data', None)) == P('data', None)
  with pytest.raises(
    fdt.UnknownLogicalAxisError,
    match=r"maps to 'embed', which is not an axis of the mesh.*No rules are "
    r"in effect, so Flax's semantics apply.*for_mesh_axes",
  ):
    fdt.logical_to_mesh_axes(('embed',), mesh=MESH)


@pytest.mark.parametrize(
  'axes, shape, match',
  [
    (('mlp', 'mlp'), None, r"\['mlp'\] occur more than once"),
    (
      ('mlp', 'batch'),
      (3,),
      r'at most one logical axis per dimension: the array has shape \(3,\) '
      r'\(rank 1\) but got 2 logical axes',
    ),
    ((('mlp', 'batch'),), None, 'to be a str or None'),
  ],
  ids=['repeated', 'rank', 'tuple-entry'],
)
def test_resolution_errors(axes, shape, match):
  with pytest.raises(fdt.ShardingResolutionError, match=match):
    fdt.logical_to_mesh_axes(axes, shape, rules=RULES)


def test_error_messages_name_rules_and_mesh():
  with pytest.raises(
    fdt.ShardingResolutionError,
    match=r"rules \[\('batch', 'data'\).*mesh\(data=2, model=4; Auto, Auto\)",
  ):
    fdt.logical_to_mesh_axes(('mlp', 'mlp'), mesh=MESH, rules=RULES)


def test_uses_context_rules_and_mesh():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  with fdt.logical_axis_rules([('mlp', 'fsdp'), ('mlp', 'model')]):
    # Without a mesh, 'fsdp' cannot be checked: Linen semantics.
    assert fdt.logical_to_mesh_axes(('mlp',)) == P('fsdp')
    with jax.set_mesh(mesh):
      assert fdt.logical_to_mesh_axes(('mlp',)) == P('model')


# Agreement with Flax Linen
# ------------------------------------------------------------------------------

LOGICAL = ['batch', 'embed', 'mlp', 'heads', 'kv', 'vocab']
MESH_AXES = ['data', 'fsdp', 'model', 'expert']

targets = st.one_of(
  st.none(),
  st.sampled_from(MESH_AXES),
  st.lists(st.sampled_from(MESH_AXES), min_size=0, max_size=3, unique=True),
)
rule_lists = st.lists(
  st.tuples(st.sampled_from(LOGICAL), targets), min_size=0, max_size=12
)


def _canonical(spec):
  out = []
  for entry in spec:
    if isinstance(entry, (tuple, list)):
      entry = tuple(entry)
      entry = None if not entry else entry[0] if len(entry) == 1 else entry
    out.append(entry)
  return tuple(out)


@settings(max_examples=profiles.examples(300), deadline=None)
@given(
  rules=rule_lists,
  axes=st.lists(
    st.one_of(st.none(), st.sampled_from(LOGICAL)), max_size=4
  ).filter(lambda a: len([x for x in a if x]) == len({x for x in a if x})),
)
def test_agrees_with_linen_without_shape(rules, axes):
  """Linen's semantics, for names the rules mention and no shape."""
  mentioned = {name for name, _ in rules}
  axes = tuple(a if a in mentioned else None for a in axes)
  linen_rules = tuple(
    (n, tuple(t) if isinstance(t, list) else t) for n, t in rules
  )
  expected = nn.logical_to_mesh_axes(axes, linen_rules)
  ours = fdt.logical_to_mesh_axes(axes, rules=rules)
  assert _canonical(ours) == _canonical(expected)
  # A mesh that has every named axis changes nothing.
  mesh = AbstractMesh((1, 2, 2, 1), tuple(MESH_AXES))
  assert _canonical(
    fdt.logical_to_mesh_axes(axes, mesh=mesh, rules=rules)
  ) == _canonical(expected)


@settings(max_examples=profiles.examples(200), deadline=None)
@given(
  rules=rule_lists,
  axes=st.lists(st.sampled_from(LOGICAL), min_size=1, max_size=4, unique=True),
  dims=st.lists(
    st.sampled_from([1, 2, 3, 4, 6, 8, 12]), min_size=4, max_size=4
  ),
)
def test_resolution_invariants_with_shape(rules, axes, dims):
  """Every resolved dim exists in the mesh and divides; no axis is reused."""
  mesh = AbstractMesh((2, 4), ('data', 'model'))
  shape = tuple(dims[: len(axes)])
  rules = fdt.LogicalRules(rules, unknown='replicate')
  spec = fdt.logical_to_mesh_axes(axes, shape, mesh=mesh, rules=rules)
  sizes = {'data': 2, 'model': 4}
  used = []
  for dim, entry in zip(shape, spec, strict=True):
    names = (
      () if entry is None else (entry,) if isinstance(entry, str) else entry
    )
    assert all(n in sizes for n in names)
    product = 1
    for n in names:
      product *= sizes[n]
    assert dim % product == 0
    used.extend(names)
  assert len(used) == len(set(used))


# Context
# ------------------------------------------------------------------------------


def test_context_nests_and_restores_on_exception():
  outer = [('a', 'x')]
  inner = [('a', 'y')]
  assert fdt.get_logical_axis_rules() is None
  with fdt.logical_axis_rules(outer) as got:
    assert got == fdt.LogicalRules(outer)
    with pytest.raises(RuntimeError, match='boom'):
      with fdt.logical_axis_rules(inner):
        assert fdt.get_logical_axis_rules() == fdt.LogicalRules(inner)
        raise RuntimeError('boom')
    assert fdt.get_logical_axis_rules() == fdt.LogicalRules(outer)
  assert fdt.get_logical_axis_rules() is None


def test_set_logical_axis_rules():
  try:
    fdt.set_logical_axis_rules([('a', 'x')])
    assert fdt.get_logical_axis_rules() == fdt.LogicalRules([('a', 'x')])
  finally:
    fdt.set_logical_axis_rules(None)
  assert fdt.get_logical_axis_rules() is None


def test_single_source_of_truth_with_flax():
  rules = [('a', 'x')]
  with fdt.logical_axis_rules(rules):
    assert core_spmd.get_logical_axis_rules() == fdt.LogicalRules(rules)
  with nnx.logical_axis_rules((('b', 'y'),)):
    assert fdt.get_logical_axis_rules() == fdt.LogicalRules([('b', 'y')])


def test_rules_are_thread_local_under_load():
  """64 threads, each with its own rules, never see another's."""
  n = 64
  barrier = threading.Barrier(n)
  mesh = AbstractMesh((2, 4), ('data', 'model'))

  def work(i):
    axis = 'data' if i % 2 else 'model'
    rules = [('mlp', axis), (f'own{i}', None)]
    assert fdt.get_logical_axis_rules() is None
    with fdt.logical_axis_rules(rules):
      barrier.wait(timeout=60)
      results = []
      for _ in range(50):
        assert fdt.get_logical_axis_rules() == fdt.LogicalRules(rules)
        results.append(fdt.logical_to_mesh_axes(('mlp',), (8,), mesh=mesh))
      barrier.wait(timeout=60)
    assert fdt.get_logical_axis_rules() is None
    return i, set(results)

  with concurrent.futures.ThreadPoolExecutor(n) as pool:
    for i, specs in pool.map(work, range(n)):
      assert specs == {P('data' if i % 2 else 'model')}
  assert fdt.get_logical_axis_rules() is None


def test_new_threads_start_without_rules_and_propagate_opts_in():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))

  def look():
    return (
      fdt.get_logical_axis_rules(),
      jax.sharding.get_abstract_mesh().axis_names,
    )

  with jax.set_mesh(mesh), fdt.logical_axis_rules([('a', 'data')]):
    wrapped = fdt.propagate(look)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      plain = pool.submit(look).result()
      carried = pool.submit(wrapped).result()
      # Nothing leaks into the pool's thread afterwards.
      after = pool.submit(look).result()
  assert plain == (None, ())
  assert carried == (fdt.LogicalRules([('a', 'data')]), ('data', 'model'))
  assert after == (None, ())


def test_propagate_carries_an_abstract_mesh_over_a_concrete_one():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  inner = AbstractMesh((8, 1), ('data', 'model'))

  def look():
    return fdt.logical_to_mesh_axes(('mlp',), (4,))

  rules = [('mlp', 'data'), ('mlp', 'model')]
  with jax.set_mesh(mesh), jax.sharding.use_abstract_mesh(inner):
    with fdt.logical_axis_rules(rules):
      here = look()
      wrapped = fdt.propagate(look)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    there = pool.submit(wrapped).result()
  # On the (8, 1) mesh, 4 % 8 != 0: 'mlp' falls back to 'model' (size 1).
  assert here == there == P('model')


def test_rules_hash_like_the_equal_tuple():
  pairs = (('a', 'x'), ('b', ('x', 'y')))
  rules = fdt.LogicalRules(pairs)
  assert rules == pairs and hash(rules) == hash(pairs)
  assert {rules: 1}[pairs] == 1


def test_from_yaml_path_that_does_not_exist_says_so():
  with pytest.raises(
    fdt.LogicalRulesError,
    match=r"Cannot read rules file 'configs/rules': No such file.*path of a "
    r'YAML file\.$',
  ):
    fdt.LogicalRules.from_yaml('configs/rules')
  # YAML text where a path is expected: never ambiguous, and hinted at.
  with pytest.raises(
    fdt.LogicalRulesError, match=r'looks like YAML text: use .*from_yaml_text'
  ):
    fdt.LogicalRules.from_yaml("logical_axis_rules: [['a', 'b']]")
  with pytest.raises(
    fdt.LogicalRulesError, match=r'Expected YAML text \(a str\)'
  ):
    fdt.LogicalRules.from_yaml_text(b'logical_axis_rules: []')


def test_pickles_of_every_earlier_form_still_load():
  """0.1.0 pickled rules by `flax_dtensor._rules._rebuild`; later versions
  by `LogicalRules._unpickled` with the options in their declared order."""
  import pickle

  old = (
    b'\x80\x04\x95D\x00\x00\x00\x00\x00\x00\x00\x8c\x13flax_dtensor._rules'
    b'\x94\x8c\x08_rebuild\x94\x93\x94\x8c\x05embed\x94\x8c\x04data\x94\x86'
    b'\x94\x85\x94\x8c\x05error\x94\x89\x87\x94R\x94.'
  )
  assert pickle.loads(old) == fdt.LogicalRules([('embed', 'data')])
  rules = fdt.LogicalRules(
    [('embed', 'data')], unknown='replicate', strict=True, min_bytes=64
  )
  assert pickle.loads(pickle.dumps(rules)) == rules
  three = fdt.LogicalRules._unpickled((('embed', 'data'),), 'replicate', True)
  assert three == fdt.LogicalRules(
    [('embed', 'data')], unknown='replicate', strict=True
  )


def test_replace_names_the_options_it_knows():
  with pytest.raises(
    fdt.LogicalRulesError,
    match=r"LogicalRules has no option \['unknwon'\]; expected some of "
    r"\['unknown', 'strict', 'path_rules', 'min_size', 'min_bytes', "
    r"'missing_mesh_axes'\]",
  ):
    fdt.LogicalRules([]).replace(unknwon='replicate')
