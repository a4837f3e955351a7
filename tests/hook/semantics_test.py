"""One semantics, whatever set the rules: plan = get_partition_spec = placement.

A property test over generated rule tables, annotations, shapes, mesh axis
types, the ways of setting rules and the ways of giving the mesh. Each case
is checked three ways against each other and against a small reference of
the documented semantics written here, so a change of semantics in one
place, or everywhere at once, fails.
"""

import contextlib

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from flax import nnx
from flax.core import spmd as core_spmd
from jax.sharding import AxisType
from support import profiles, reference_semantics

import flax_dtensor as fdt
from flax_dtensor._hook import _wrappers
from flax_dtensor._rules import _resolution

SIZES = {'data': 2, 'model': 4}
NAMES = ('embed', 'mlp', 'vocab', 'heads')
TARGETS = ('data', 'model', 'fsdp', None, ('data', 'model'), ('model', 'data'))
TYPES = {
  'explicit': (AxisType.Explicit, AxisType.Explicit),
  'auto': (AxisType.Auto, AxisType.Auto),
  'mixed': (AxisType.Explicit, AxisType.Auto),
}
MESHES = {
  k: jax.make_mesh((2, 4), ('data', 'model'), axis_types=v)
  for k, v in TYPES.items()
}
# How the rules are set; the first four mean flax_dtensor's semantics.
WAYS = (
  'fdt.logical_axis_rules',
  'fdt.set_logical_axis_rules',
  'nnx.logical_axis_rules(LogicalRules)',
  'fdt.shard_module(rules=)',
  'nnx.logical_axis_rules(tuple)',
  'core_spmd.set_logical_axis_rules(tuple)',
  'sharding_rules only',
)
FDT_WAYS = WAYS[:4]
MESH_SOURCES = ('jax.set_mesh', 'mesh= metadata', 'the array')


Invalid = reference_semantics.Invalid


def reference_fdt(axes, shape, rules):
  return reference_semantics.flax_dtensor(axes, shape, rules, SIZES)


def reference_flax(axes, shape, context, local):
  return reference_semantics.flax(axes, shape, context, local, SIZES)


def _canonical(spec, ndim):
  entries = tuple(spec) + (None,) * (ndim - len(spec))
  return tuple(tuple(e) if isinstance(e, list) else e for e in entries)


@st.composite
def cases(draw):
  target = st.sampled_from(TARGETS)
  first = draw(st.sampled_from((*NAMES, None)))
  second = draw(
    st.sampled_from([n for n in (*NAMES, None) if n != first or n is None])
  )
  rules = draw(st.lists(st.tuples(st.sampled_from(NAMES), target), max_size=6))
  # Mostly, every name used has a rule somewhere (else it is an error).
  for name in (first, second):
    if name is not None and draw(st.integers(0, 9)):
      rules.insert(draw(st.integers(0, len(rules))), (name, draw(target)))
  shape = (
    draw(st.sampled_from((1, 2, 3, 4, 6, 8, 16))),
    draw(st.sampled_from((1, 2, 3, 4, 6, 8, 16))),
  )
  local = draw(st.lists(st.tuples(st.sampled_from(NAMES), target), max_size=2))
  # Annotation lengths: sometimes one name for the two dimensions (the
  # second is None, as Flax reads it).
  axes = (first,) if draw(st.integers(0, 4)) == 0 else (first, second)
  return {
    'rules': rules,
    'axes': axes,
    'shape': shape,
    'local': local,
    'way': draw(st.sampled_from(WAYS)),
    'mesh_source': draw(st.sampled_from(MESH_SOURCES)),
    'types': draw(st.sampled_from(tuple(TYPES))),
  }


def _expected(case):
  axes, shape, rules, local = (
    case['axes'],
    case['shape'],
    case['rules'],
    case['local'],
  )
  if case['way'] in FDT_WAYS:
    return reference_fdt(axes, shape, [*local, *rules])
  context = [] if case['way'] == 'sharding_rules only' else rules
  return reference_flax(axes, shape, context, local)


@contextlib.contextmanager
def _rules_set(case):
  """Sets the rules the way the case says; restores what was there."""
  rules, way = case['rules'], case['way']
  old = core_spmd.get_logical_axis_rules()
  try:
    if way == 'fdt.logical_axis_rules':
      with fdt.logical_axis_rules(rules):
        yield
    elif way == 'fdt.set_logical_axis_rules':
      fdt.set_logical_axis_rules(rules)
      yield
    elif way == 'nnx.logical_axis_rules(LogicalRules)':
      with nnx.logical_axis_rules(fdt.LogicalRules(rules)):
        yield
    elif way == 'nnx.logical_axis_rules(tuple)':
      with nnx.logical_axis_rules(tuple(rules)):
        yield
    elif way == 'core_spmd.set_logical_axis_rules(tuple)':
      core_spmd.set_logical_axis_rules(tuple(rules))
      yield
    else:  # 'sharding_rules only' and 'fdt.shard_module(rules=)'.
      yield
  finally:
    core_spmd.set_logical_axis_rules(old)


def _make(case, mesh):
  init = nnx.with_partitioning(
    nnx.initializers.ones,
    case['axes'],
    sharding_rules=tuple(case['local']) or None,
    **({'mesh': mesh} if case['mesh_source'] == 'mesh= metadata' else {}),
  )
  return nnx.Param(init(jax.random.key(0), case['shape']))


def check_case(case):
  """Creation, plan and nnx.get_partition_spec against the reference."""
  mesh = MESHES[case['types']]
  try:
    expected = _expected(case)
  except Invalid:
    expected = None
  flax_on_mixed = case['way'] not in FDT_WAYS and case['types'] == 'mixed'
  hypothesis.event(
    'refused'
    if expected is None
    else 'Flax refuses mixed'
    if flax_on_mixed
    else 'placed'
  )
  with contextlib.ExitStack() as stack:
    if case['mesh_source'] != 'mesh= metadata':
      stack.enter_context(jax.set_mesh(mesh))
    stack.enter_context(_rules_set(case))
    if expected is None or flax_on_mixed:
      # flax_dtensor's rules raise our error at creation; under Flax's
      # semantics Flax raises its own (and refuses mixed meshes), as ever.
      error = fdt.FlaxDTensorError if case['way'] in FDT_WAYS else Exception
      with pytest.raises(error):
        if case['way'] == 'fdt.shard_module(rules=)':
          with nnx.use_eager_sharding(False):
            fdt.shard_module(
              nnx.Dict(v=_make(case, mesh)), mesh=mesh, rules=case['rules']
            )
        else:
          _make(case, mesh)
      if expected is None:
        return
      state = nnx.State(
        {
          'v': nnx.Param(
            np.zeros(case['shape'], np.float32),
            out_sharding=case['axes'],
            sharding_rules=tuple(case['local']) or None,
            eager_sharding=False,
          )
        }
      )
      reported = nnx.get_partition_spec(state)['v'].get_value()
      planned = fdt.plan(state, mesh=mesh)['v'].spec
      assert _canonical(reported, 2) == expected
      assert _canonical(planned, 2) == expected
      return
    if case['way'] == 'fdt.shard_module(rules=)':
      with nnx.use_eager_sharding(False):
        holder = nnx.Dict(v=_make(case, mesh))
      fdt.shard_module(holder, mesh=mesh, rules=case['rules'])
      variable = holder['v']
      query = fdt.logical_axis_rules(case['rules'])
    else:
      try:
        variable = _make(case, mesh)
      except Exception as e:
        raise AssertionError(
          f'creation failed where the reference expects {expected}: {e}'
        ) from e
      query = contextlib.nullcontext()
    if case['mesh_source'] == 'the array':
      stack.close()  # Query outside the mesh (and rules) context ...
      stack.enter_context(_rules_set(case))  # ... with the rules back.
    with query:
      state = nnx.State({'v': variable})
      reported = nnx.get_partition_spec(state)['v'].get_value()
      planned = fdt.plan(state)['v'].spec
  placed = variable.get_value().sharding.spec
  assert _canonical(placed, 2) == expected, (placed, expected)
  assert _canonical(reported, 2) == expected, (reported, expected)
  assert _canonical(planned, 2) == expected, (planned, expected)


def _property(max_examples):
  @hypothesis.settings(
    max_examples=max_examples,
    deadline=None,
    derandomize=True,
    report_multiple_bugs=False,
    suppress_health_check=list(hypothesis.HealthCheck),
  )
  @hypothesis.given(cases())
  def run(case):
    hypothesis.event(case['way'])
    hypothesis.event(case['mesh_source'])
    check_case(case)

  return run


def test_one_semantics_over_generated_cases():
  """1,200 cases under the thorough profile."""
  _property(profiles.examples(1200))()


def test_a_changed_resolver_is_caught(monkeypatch):
  """A resolver that ignores divisibility, everywhere at once."""
  original = _resolution.resolve_dims

  def broken(logical_axes, shape=None, **kwargs):
    return original(logical_axes, None, **kwargs)

  monkeypatch.setattr(_resolution, 'resolve_dims', broken)
  with pytest.raises(AssertionError):
    _property(300)()


def test_a_hook_that_stops_answering_is_caught(monkeypatch):
  """nnx.get_partition_spec falls back to Flax's answer: APIs disagree."""
  monkeypatch.setattr(
    _wrappers, '_get_var_pspec', lambda flax_fn, *a, **k: flax_fn(*a, **k)
  )
  with pytest.raises(AssertionError):
    _property(300)()
