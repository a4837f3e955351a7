"""Resolution against a reference of the documented semantics, 5,000 cases.

Random rule tables (repeated names, tuple targets, None, axes the mesh
lacks), random meshes (size-1 axes, absent axes, no mesh), random shapes
(or none), and the `unknown` and `strict` options: `resolve_dims` and the
public `logical_to_mesh_axes` must give what `reference_semantics` gives,
and raise exactly when it does.
"""

import hypothesis
import hypothesis.strategies as st
import pytest
from jax.sharding import AbstractMesh
from support import profiles, reference_semantics

import flax_dtensor as fdt
from flax_dtensor._rules import _context, _resolution

NAMES = ('batch', 'embed', 'mlp', 'heads', 'vocab')
AXES = ('data', 'fsdp', 'model', 'expert')

target = st.one_of(
  st.none(),
  st.sampled_from(AXES),
  st.lists(st.sampled_from(AXES), min_size=2, max_size=3, unique=True).map(
    tuple
  ),
)


@st.composite
def cases(draw):
  present = draw(
    st.lists(st.sampled_from(AXES), min_size=1, max_size=4, unique=True)
  )
  sizes = {a: draw(st.sampled_from((1, 2, 3, 4))) for a in present}
  with_mesh = draw(st.integers(0, 9)) > 0
  rank = draw(st.integers(1, 4))
  # Annotation lengths: mostly one name per dimension; sometimes fewer (the
  # missing trailing names are None, as Flax reads them) or one more (an
  # error, when the shape is known).
  length = rank + draw(st.sampled_from((0, 0, 0, 0, 0, 0, -1, 1)))
  axes = tuple(
    draw(
      st.lists(
        st.sampled_from((*NAMES, None)), min_size=length, max_size=length
      )
    )
  )
  shape = (
    tuple(
      draw(
        st.lists(
          st.sampled_from((1, 2, 3, 4, 6, 8, 12, 16)),
          min_size=rank,
          max_size=rank,
        )
      )
    )
    if draw(st.integers(0, 9)) > 0
    else None
  )
  rules = draw(st.lists(st.tuples(st.sampled_from(NAMES), target), max_size=10))
  return {
    'axes': axes,
    'shape': shape,
    'rules': rules,
    'sizes': sizes if with_mesh else None,
    'unknown': draw(st.sampled_from(('error', 'replicate'))),
    'strict': draw(st.booleans()),
  }


def _ours(case):
  rules = fdt.LogicalRules(
    case['rules'], unknown=case['unknown'], strict=case['strict']
  )
  mesh = (
    AbstractMesh(tuple(case['sizes'].values()), tuple(case['sizes']))
    if case['sizes'] is not None
    else None
  )
  resolution = _resolution.resolve_dims(
    case['axes'], case['shape'], mesh=mesh, rules=rules
  )
  public = fdt.logical_to_mesh_axes(
    case['axes'], case['shape'], mesh=mesh, rules=rules
  )
  assert public == resolution.spec
  return tuple(d.target for d in resolution.dims)


def _reference(case):
  """What the reference semantics give for a case (or `Invalid`)."""
  return reference_semantics.flax_dtensor(
    case['axes'],
    case['shape'],
    case['rules'],
    case['sizes'],
    unknown=case['unknown'],
    strict=case['strict'],
  )


@hypothesis.settings(
  max_examples=profiles.examples(5000),
  deadline=None,
  derandomize=True,
  suppress_health_check=list(hypothesis.HealthCheck),
)
@hypothesis.given(cases())
def test_resolution_matches_the_reference(case):
  try:
    expected = _reference(case)
  except reference_semantics.Invalid:
    with pytest.raises(fdt.FlaxDTensorError):
      _ours(case)
    return
  assert _ours(case) == expected


def test_the_generator_reaches_every_outcome():
  """The cases are not all errors, nor all unsharded."""
  seen = set()

  @hypothesis.settings(max_examples=400, deadline=None, derandomize=True)
  @hypothesis.given(cases())
  def survey(case):
    try:
      out = _reference(case)
    except reference_semantics.Invalid:
      seen.add('error')
      return
    seen.add('sharded' if any(t is not None for t in out) else 'replicated')
    if any(isinstance(t, tuple) for t in out):
      seen.add('product')

  survey()
  assert seen == {'error', 'sharded', 'replicated', 'product'}


@pytest.mark.parametrize(
  'axes, shape, expected',
  [
    (('mlp',), (8, 6), ('model', None)),
    (('batch',), (8, 6, 4), ('data', None, None)),
    ((), (8, 6), (None, None)),
    (('batch', 'mlp'), (8, 8), ('data', 'model')),
  ],
  ids=['one-of-two', 'one-of-three', 'none-of-two', 'whole'],
)
def test_fewer_names_than_dims_leave_the_rest_none(axes, shape, expected):
  """As Flax and a PartitionSpec read them, under both semantics."""
  mesh = AbstractMesh((2, 4), ('data', 'model'))
  rules = [('batch', 'data'), ('mlp', 'model')]
  ours = _resolution.resolve_dims(
    axes, shape, mesh=mesh, rules=fdt.LogicalRules(rules)
  )
  assert tuple(d.target for d in ours.dims) == expected
  assert ours.logical_axes == axes + (None,) * (len(shape) - len(axes))
  flax = _resolution.resolve_flax(
    axes, shape, mesh=mesh, rules=_context.FlaxRules(tuple(rules))
  )
  assert tuple(flax.spec) == expected


@pytest.mark.parametrize('semantics', ['flax_dtensor', 'flax'])
def test_more_names_than_dims_is_an_error_under_both_semantics(semantics):
  rules = fdt.LogicalRules([('batch', 'data'), ('mlp', 'model')])
  resolve = (
    _resolution.resolve_dims
    if semantics == 'flax_dtensor'
    else _resolution.resolve_flax
  )
  with pytest.raises(
    fdt.ShardingResolutionError,
    match=r"at 'w': the array has shape \(8,\) \(rank 1\) but got 2 "
    r"logical axes \('batch', 'mlp'\).*names left out at the end are None",
  ):
    resolve(
      ('batch', 'mlp'),
      (8,),
      rules=rules
      if semantics == 'flax_dtensor'
      else _context.FlaxRules(tuple(rules)),
      path="'w'",
    )
