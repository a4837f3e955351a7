"""The Flax hook: it cannot silently stop working, and changes nothing else.

Flax's own behaviour, with flax_dtensor imported but its rules not in use,
is checked two ways: cases of Flax's ``tests/nnx/spmd_test.py`` (0.12.8)
re-expressed here on 8 devices, and a differential run of the same
scenarios in fresh processes with and without ``import flax_dtensor``.
"""

import json
import pathlib
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.core import spmd as core_spmd
from flax.nnx import spmd as nnx_spmd
from flax.nnx import variablelib
from jax.experimental.layout import Format, Layout
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from support import processes, warm

import flax_dtensor as fdt
from flax_dtensor._hook import _install, _wrappers
from flax_dtensor._placement import _switches

RULES = fdt.LogicalRules([('embed', 'data'), ('mlp', 'model')])


def _mesh(types=(AxisType.Auto, AxisType.Auto), names=('data', 'model')):
  return jax.make_mesh((2, 4), names, axis_types=types)


# The hook cannot silently stop working
# ------------------------------------------------------------------------------


def test_routing_is_checked_at_import():
  # `fdt.LogicalRules` above installed the hook and ran the check; running
  # it again proves the route.
  _install.check_routing()
  assert getattr(core_spmd.shard_value, '__flax_dtensor_hook__', False)


def test_each_hooked_function_is_one_wrapper_in_every_place_flax_holds_it():
  """`_install.HOOKED` is what is installed: one marked wrapper of Flax's own
  function, the same object in each of its owners."""
  assert len(_install.HOOKED) == 8
  assert sum(len(owners) for owners, _, _ in _install.HOOKED) == 14
  for owners, attribute, _ in _install.HOOKED:
    hooks = {getattr(o, attribute) for o in owners}
    assert len(hooks) == 1, (attribute, hooks)
    (hook,) = hooks
    assert getattr(hook, '__flax_dtensor_hook__', False), attribute
    flax_fn = hook.__wrapped__
    assert not getattr(flax_fn, '__flax_dtensor_hook__', False), attribute
    assert flax_fn.__name__ == hook.__name__ == attribute
  assert nnx.eval_shape is nnx.spmd.eval_shape
  # Installing again changes nothing.
  before = [getattr(o, a) for owners, a, _ in _install.HOOKED for o in owners]
  _install.install()
  assert before == [
    getattr(o, a) for owners, a, _ in _install.HOOKED for o in owners
  ]


def test_the_compatibility_page_lists_what_the_hook_touches():
  """The docs' table of what the hook touches in Flax names every wrapped
  function (`_install.HOOKED` and the module metaclass's call), and no other."""
  docs = pathlib.Path(__file__).parents[2] / 'docs'
  sections = [
    page.read_text().partition('## What the hook touches\n')[2]
    for page in sorted(docs.glob('*.md'))
  ]
  (section,) = [s.split('\n## ')[0] for s in sections if s]
  rows = [r for r in section.splitlines() if r.startswith('| flax |')]
  named = {
    name.rpartition('.')[2]
    for row in rows
    for name in re.findall(r'`([\w.]+)`', row.split('|')[2])
  }
  hooked = {attribute for _, attribute, _ in _install.HOOKED}
  assert named == hooked | {'__call__'}, section


# The guarantee, in fresh processes: `import flax_dtensor` imports neither JAX
# nor Flax; the first public name used installs the hook, before any rules
# object of flax_dtensor exists. Rules under which Flax's own dict semantics
# (the last rule for a name wins) and ours (the first that fits) differ, so
# that a model built without the hook lands elsewhere.
_GUARANTEE_PRELUDE = """
import os, pickle, sys
import jax
jax.config.update('jax_num_cpu_devices', 8)
from flax import nnx
from flax.core import spmd

def hooked():
  return getattr(spmd.shard_value, '__flax_dtensor_hook__', False)

def build():
  init = nnx.with_partitioning(nnx.initializers.ones, ('embed', 'mlp'))
  return nnx.Linear(8, 16, kernel_init=init, use_bias=False, rngs=nnx.Rngs(0))

RULES = [('embed', 'model'), ('embed', 'data'), ('mlp', None)]
"""

_FIRST_USE = (
  _GUARANTEE_PRELUDE
  + """
assert not hooked()
mesh = jax.make_mesh((2, 4), ('data', 'model'))
with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
  flax_spec = build().kernel[...].sharding.spec  # Flax's semantics: a dict.
import flax_dtensor as fdt
assert not hooked()
with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):  # The first use.
  assert hooked()
  ours = build().kernel[...].sharding.spec
print(flax_spec, ours)
print(pickle.dumps(fdt.LogicalRules(RULES)).hex())
"""
)

_UNPICKLE = (
  _GUARANTEE_PRELUDE
  + """
assert not hooked()
rules = pickle.loads(bytes.fromhex(sys.argv[1]))
assert hooked()
mesh = jax.make_mesh((2, 4), ('data', 'model'))
with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):  # Flax's context.
  print(build().kernel[...].sharding.spec)
"""
)


_MODULE_ROUTING = (
  _GUARANTEE_PRELUDE
  + """
from flax.nnx import module as module_lib

def routed():
  return getattr(module_lib.ModuleMeta.__call__, '__flax_dtensor_hook__', False)

import flax_dtensor as fdt
fdt.plan  # The first public name: the hook goes in, ...
assert hooked() and not routed()  # ... not yet the module routing.
mesh = jax.make_mesh((2, 4), ('data', 'model'))
plain = nnx.Linear(8, 16, use_bias=False, rngs=nnx.Rngs(0))  # Flax's call.
flax_spec = nnx.get_partition_spec(nnx.state(plain))['kernel'].get_value()
rules = fdt.LogicalRules(RULES, path_rules=[('kernel$', ('embed', None))])
assert routed()  # The first rules of ours route it: path rules need it.
with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
  plain = nnx.Linear(8, 16, use_bias=False, rngs=nnx.Rngs(0))
print(flax_spec, plain.kernel[...].sharding.spec)
"""
)


@pytest.fixture(scope='module')
def flax_pool():
  """Fresh processes that imported JAX and Flax, but no flax_dtensor.

  Forks of a warm pool (tests/support/warm.py): the subject of these
  scripts, what importing and first using flax_dtensor does, is still to
  happen in each.
  """
  pool = warm.Pool(('numpy', 'jax', 'jax.numpy', 'flax', 'flax.nnx'))
  yield pool
  pool.close()


def _python(pool, tmp_path, code, *args):
  script = tmp_path / 'script.py'
  script.write_text(code)
  proc = pool.run(script, *args, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout.splitlines()


def test_import_is_lazy_and_the_first_use_installs_the_hook(
  flax_pool, tmp_path
):
  code = (
    'import sys\n'
    "sys.modules['jax'] = sys.modules['flax'] = None  # Imports would fail.\n"
    'import flax_dtensor\n'
    "assert flax_dtensor.__version__ and 'LogicalRules' in dir(flax_dtensor)\n"
    "print('lazy')\n"
  )
  # A new Python: one that imported JAX would not tell.
  proc = processes.run_python('-c', code)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.splitlines() == ['lazy']
  specs, pickled = _python(flax_pool, tmp_path, _FIRST_USE)
  assert specs == "P('data', None) P('model', None)"
  # Unpickled rules install the hook too: in a process that never named
  # flax_dtensor, Flax's own context then applies flax_dtensor's semantics.
  assert _python(flax_pool, tmp_path, _UNPICKLE, pickled) == [
    "P('model', None)"
  ]


def test_modules_are_routed_once_rules_of_ours_exist(flax_pool, tmp_path):
  """Until the first `LogicalRules` is made, modules are built by Flax's own
  metaclass call (nothing of ours runs); then path rules place them."""
  assert _python(flax_pool, tmp_path, _MODULE_ROUTING) == [
    "P() P('model', None)"
  ]


def test_a_flax_that_bypasses_the_hook_is_refused(monkeypatch):
  """A Flax whose Variable calls an unwrapped shard_value directly."""
  original = core_spmd.shard_value.__wrapped__
  bypassing = types.SimpleNamespace(shard_value=original)
  monkeypatch.setattr(variablelib, 'core_spmd', bypassing)
  with pytest.raises(
    fdt.FlaxCompatibilityError,
    match=r'the installed Flax 0\.12\.\d+ did not call \[\'shard_value\'\]',
  ):
    _install.check_routing()


@pytest.mark.parametrize(
  'module, name',
  [
    # What a variable's PartitionSpec is asked through.
    pytest.param(nnx_spmd, 'get_var_pspec', id='pspec_query'),
    # `nnx.with_partitioning` no longer wraps through `with_metadata`.
    pytest.param(variablelib, 'with_metadata', id='initializers'),
    # `nnx.get_partition_spec` no longer the function the hook wraps: path
    # rules would see no paths there.
    pytest.param(nnx, 'get_partition_spec', id='partition_spec'),
  ],
)
def test_a_flax_whose_function_bypasses_the_hook_is_refused(
  monkeypatch, module, name
):
  """A Flax function of the hook's, called unwrapped, is refused by name."""
  monkeypatch.setattr(module, name, getattr(module, name).__wrapped__)
  with pytest.raises(
    fdt.FlaxCompatibilityError, match=rf"did not call \['{name}'\]"
  ):
    _install.check_routing()


def test_a_flax_whose_modules_bypass_the_hook_is_refused(monkeypatch):
  """Module construction no longer goes through the metaclass's call: path
  rules would never place a variable eagerly."""
  from flax.nnx import module as module_lib

  call = module_lib.ModuleMeta.__call__
  flax_call = getattr(call, '__wrapped__', call)

  class Bypassing(module_lib.ModuleMeta):
    def __call__(cls, *args, **kwargs):  # Not through ModuleMeta's call.
      return flax_call(cls, *args, **kwargs)

  class Probe(nnx.Module, metaclass=Bypassing):
    pass

  monkeypatch.setattr(_install, '_Probe', Probe)
  with pytest.raises(
    fdt.FlaxCompatibilityError, match=r"did not call \['module_call'\]"
  ):
    _install.check_routing()


PATH_RULES = RULES.replace(path_rules=[('up/kernel$', P(None, 'model'))])


class _Up(nnx.Module):
  def __init__(self, fail=False):
    self.up = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
    if fail:
      raise RuntimeError('a constructor that fails')


class _Holder(nnx.Module):
  def __init__(self, fail=False):
    self.inner = _Up(fail)


def test_a_failing_constructor_leaves_the_depth_count_clean():
  mesh = _mesh()
  with jax.set_mesh(mesh), fdt.logical_axis_rules(PATH_RULES):
    with pytest.raises(RuntimeError, match='a constructor that fails'):
      _Holder(fail=True)
    assert _switches.state.depth == 0
    held = _Holder()
  assert held.inner.up.kernel[...].sharding.spec == P(None, 'model')


def test_construction_under_path_rules_is_per_thread():
  """Threads building at once each place by their own rules."""
  import concurrent.futures

  mesh = _mesh()

  def build(i):
    with jax.set_mesh(mesh):
      if i % 2:
        with fdt.logical_axis_rules(PATH_RULES):
          return _Holder().inner.up.kernel[...].sharding.spec
      return _Holder().inner.up.kernel[...].sharding.spec

  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    specs = list(pool.map(build, range(16)))
  for i, spec in enumerate(specs):
    assert (spec == P(None, 'model')) == bool(i % 2), (i, spec)


def test_new_flax_arguments_pass_through():
  """A future Flax passing one more argument still reaches its function."""
  calls = []

  def future_flax_shard_value(
    value, out_sharding, sharding_rules, mesh, *, layout=None
  ):
    calls.append(layout)
    return value

  x = jnp.ones((8, 4))
  # No flax_dtensor rules: Flax's function gets every argument.
  out = _wrappers._shard_value(
    future_flax_shard_value, x, ('embed', None), None, None, layout='L'
  )
  assert out is x and calls == ['L']
  # flax_dtensor rules: placed by them, whatever the extra argument.
  mesh = _mesh()
  with fdt.logical_axis_rules(RULES):
    out = _wrappers._shard_value(
      future_flax_shard_value, x, ('embed', None), None, mesh, layout='L'
    )
  assert out.sharding.spec == P('data', None)
  np.testing.assert_array_equal(np.asarray(out), np.ones((8, 4)))
  assert calls == ['L']
  # A signature the hook cannot read at all is Flax's business alone.
  assert _wrappers._shard_value(lambda *a, **k: 'flax', 1, 2, 3, 4, 5) == 'flax'


# Flax's behaviour is unchanged (cases of Flax's tests/nnx/spmd_test.py)
# ------------------------------------------------------------------------------


class _Foo(nnx.Module):
  def __init__(self):
    init = nnx.with_partitioning(lambda: jnp.ones((8, 2)), ('model', 'data'))
    self.w = nnx.Param(init())


def test_flax_jit_creation_shards_by_annotation():
  mesh = jax.make_mesh(
    (4, 2), ('model', 'data'), axis_types=(AxisType.Auto,) * 2
  )
  with jax.set_mesh(mesh):
    m = nnx.merge(*jax.jit(lambda: nnx.split(_Foo()))())
  assert m.w.sharding.shard_shape(m.w.shape) == (2, 1)
  np.testing.assert_array_equal(np.asarray(m.w[...]), np.ones((8, 2)))


def test_flax_logical_rules_with_variable_rules_and_optimizer():
  class Foo(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(
        nnx.with_partitioning(
          lambda: jnp.ones((8, 4)),
          sharding=('row-alias', 'col-alias'),
          sharding_rules=(('row-alias', 'data'),),
        )()
      )

  mesh = _mesh()
  with jax.set_mesh(mesh), nnx.logical_axis_rules((('col-alias', 'model'),)):
    model = Foo()
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  expected = NamedSharding(mesh, P('data', 'model'))
  assert model.w.sharding.is_equivalent_to(expected, 2)
  assert opt.opt_state[0].mu['w'].sharding.is_equivalent_to(expected, 2)
  assert opt.opt_state[0].nu['w'].sharding.is_equivalent_to(expected, 2)


@pytest.mark.parametrize('eager', [True, False])
def test_flax_eager_sharding_switch(eager):
  rngs = nnx.Rngs(0)
  with nnx.use_eager_sharding(eager), jax.set_mesh(_mesh()):
    w = nnx.Param(rngs.lecun_normal()((4, 8)), out_sharding=(None, 'model'))
  assert (w.sharding.spec == P(None, 'model')) == eager


@pytest.mark.parametrize('kind', ['auto', 'explicit', 'mixed'])
def test_flax_mesh_axis_types(kind):
  axis_types = {
    'auto': (AxisType.Auto,) * 2,
    'explicit': (AxisType.Explicit,) * 2,
    'mixed': (AxisType.Auto, AxisType.Explicit),
  }[kind]
  mesh = _mesh(axis_types)
  if kind == 'mixed':  # Flax refuses mixed meshes; flax_dtensor leaves it so.
    with pytest.raises(ValueError, match='Mesh must have all axes'):
      nnx.Variable(jnp.ones((4, 4)), out_sharding=('data', 'model'), mesh=mesh)
    return
  v = nnx.Variable(jnp.ones((4, 4)), out_sharding=('data', 'model'), mesh=mesh)
  assert v.sharding.mesh == mesh
  assert v.sharding.spec == P('data', 'model')


def test_flax_out_sharding_kinds():
  mesh = _mesh()
  with jax.set_mesh(mesh):
    v = nnx.Variable(jnp.ones((4, 4)), out_sharding=P('data', 'model'))
  assert v.sharding.spec == P('data', 'model')
  named = NamedSharding(mesh, P('data', None))
  v = nnx.Variable(jnp.ones((4, 4)), out_sharding=named)
  assert v.sharding.is_equivalent_to(named, 2)
  v = nnx.Variable(
    jnp.ones((4, 4)), out_sharding=Format(Layout(major_to_minor=(1, 0)), named)
  )
  assert v.sharding == named


def test_flax_abstract_models_per_variable_mesh():
  mesh1 = _mesh()
  mesh2 = jax.make_mesh((1, 8), ('c', 'd'), axis_types=(AxisType.Auto,) * 2)

  class Model(nnx.Module):
    def __init__(self):
      self.p1 = nnx.Linear(
        8,
        8,
        rngs=nnx.Rngs(0),
        kernel_metadata={'out_sharding': ('data', 'model'), 'mesh': mesh1},
      )
      self.p2 = nnx.Linear(
        8,
        8,
        rngs=nnx.Rngs(0),
        kernel_metadata={'out_sharding': ('c', 'd'), 'mesh': mesh2},
      )

  abstract = nnx.as_abstract(nnx.eval_shape(Model))
  assert abstract.p1.kernel.sharding.spec == P('data', 'model')
  assert abstract.p1.kernel.sharding.mesh == mesh1
  assert abstract.p2.kernel.sharding.spec == P('c', 'd')
  assert abstract.p2.kernel.sharding.mesh == mesh2
  _, state = nnx.compat.get_abstract_model(
    lambda: nnx.Linear(
      8,
      8,
      use_bias=False,
      rngs=nnx.Rngs(0),
      kernel_init=nnx.with_partitioning(nnx.initializers.ones, (None, 'model')),
    ),
    mesh1,
  )
  (leaf,) = jax.tree.leaves(state)
  assert leaf.sharding.is_equivalent_to(
    NamedSharding(mesh1, P(None, 'model')), 2
  )


def test_flax_transform_metadata_adds_and_removes_the_layer_axis():
  class MLP(nnx.Module):
    @nnx.split_rngs(splits=4, graph=True, graph_updates=True)
    @nnx.vmap(
      in_axes=(0, 0),
      transform_metadata={nnx.PARTITION_NAME: 'layers'},
      graph=True,
      graph_updates=True,
    )
    def __init__(self, rngs):
      self.kernel = nnx.Param(
        nnx.initializers.lecun_normal()(rngs.params(), (8, 8)),
        out_sharding=('din', 'dout'),
      )

  mesh = jax.make_mesh(
    (1, 2, 4), ('layers', 'din', 'dout'), axis_types=(AxisType.Auto,) * 3
  )
  with jax.set_mesh(mesh):
    m = MLP(rngs=nnx.Rngs(0))
  assert m.kernel.shape == (4, 8, 8)
  assert m.kernel.out_sharding == ('layers', 'din', 'dout')
  assert m.kernel.sharding.is_equivalent_to(
    NamedSharding(mesh, P('layers', 'din', 'dout')), 3
  )


# Differential: the same scenarios with and without `import flax_dtensor`
# ------------------------------------------------------------------------------

_SCENARIOS = r"""
import json, sys
import jax
jax.config.update('jax_num_cpu_devices', 8)
if sys.argv[1] == 'with':
  import flax_dtensor  # noqa: F401
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType

out = {}
def record(name, fn):
  try:
    out[name] = repr(fn())
  except Exception as e:  # The error is part of the behaviour.
    out[name] = f'{type(e).__name__}: {str(e).splitlines()[0][:200]}'

def mesh(kind):
  t = {'auto': AxisType.Auto, 'explicit': AxisType.Explicit}
  types = (t['explicit'], t['auto']) if kind == 'mixed' else (t[kind],) * 2
  return jax.make_mesh((2, 4), ('data', 'model'), axis_types=types)

init = lambda axes, **kw: nnx.with_partitioning(nnx.initializers.ones, axes, **kw)
def linear(axes, **kw):
  return nnx.Linear(8, 16, kernel_init=init(axes, **kw), rngs=nnx.Rngs(0))

for kind in ('auto', 'explicit', 'mixed'):
  for rules in ((), (('mlp', 'data'), ('mlp', 'model')),
                (('embed', 'data'), ('mlp', 'model'))):
    for axes in ((None, 'mlp'), ('embed', 'mlp'), ('data', 'model')):
      name = f'{kind} {rules} {axes}'
      def create():
        with jax.set_mesh(mesh(kind)), nnx.logical_axis_rules(rules):
          m = linear(axes)
          return (m.kernel.sharding.spec,
                  nnx.get_partition_spec(nnx.state(m))['kernel'].get_value())
      record('create ' + name, create)
      def query():
        with nnx.logical_axis_rules(rules):
          return nnx.get_partition_spec(nnx.state(nnx.eval_shape(
              lambda: linear(axes))))['kernel'].get_value()
      with nnx.use_eager_sharding(False):
        record('query ' + name, query)
  def local():
    with jax.set_mesh(mesh(kind)):
      m = linear(('a', 'b'), sharding_rules=(('a', 'data'), ('b', 'model')))
      return m.kernel.sharding.spec
  record('local ' + kind, local)
print(json.dumps(out, sort_keys=True))
"""


def test_flax_behaviour_is_identical_with_and_without_flax_dtensor(
  flax_pool, tmp_path
):
  runs = {}
  for mode in ('without', 'with'):
    out = _python(flax_pool, tmp_path, _SCENARIOS, mode)
    runs[mode] = json.loads(out[-1])
  assert len(runs['with']) == 3 * (3 * 3 * 2 + 1)
  assert runs['with'] == runs['without']
  # The scenarios exercise Flax's semantics: last write wins, mixed raises.
  assert runs['with'][
    "create auto (('mlp', 'data'), ('mlp', 'model')) (None, 'mlp')"
  ] == ("(P(None, 'model'), P(None, 'model'))")
  assert runs['with']["create mixed () ('data', 'model')"].startswith(
    'ValueError'
  )
