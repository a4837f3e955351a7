"""The context matrix: every entry point, in every context, on both ends.

The cells come from tests/support/context_matrix.py's lists (entry points,
contexts, features), generated there; each cell either works, its values
compared (placements: the plan = `nnx.get_partition_spec` = the arrays'
shardings, compared as placements; restores and round trips bit-exact;
served SavedModels within a tolerance of JAX), or is refused with our
error, as `context_matrix.REFUSALS` says.

Kept cheap: each model is built once per context (`World`), checkpoints
are written once and read by the cells that need them, and every
SavedModel of the matrix is served by one JAX-free TF process.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import textwrap
from typing import Any

import context_matrix as cm
import creation_values
import jax
import maxtext_style
import numpy as np
import processes
import pytest
from flax import nnx

import flax_dtensor as fdt

tf = pytest.importorskip('tensorflow')
fdt_tf = pytest.importorskip('flax_dtensor.dtensor')

X = np.random.default_rng(7).standard_normal((cm.BATCH, cm.EMBED))
X = X.astype(np.float32)


@pytest.fixture(scope='session', autouse=True)
def _dtensor_initialized():
  """DTensor must be set up before any other TF op in the process."""
  fdt_tf.initialize()


def test_maxtext_style_check_predicts_eager_sharding_off_of_a_factory():
  """Before anything is built: the factory's own abstract build tells.

  First in the module, so that no variable created unplaced earlier (the
  eager MaxText-style build below) can be what the check reports.
  """
  mesh = maxtext_style.make_mesh()
  with _maxtext_scope(mesh):
    report = fdt.check(
      lambda: maxtext_style.Decoder(mesh, rngs=nnx.Rngs(0, dropout=1))
    )
  codes = {f.code for f in report.findings}
  assert 'eager-sharding-off' in codes
  assert codes <= {'eager-sharding-off', 'unused-rule'}


def _key(path) -> str:
  return '/'.join(str(p) for p in path)


def _host(value) -> np.ndarray:
  if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
    value = jax.random.key_data(value)
  return np.asarray(jax.device_get(value))


def flat(module_or_state, *, rng: bool = True) -> dict[str, np.ndarray]:
  """{path: host value} of every variable (RNG state if `rng`)."""
  state = nnx.state(module_or_state)
  out = {}
  for path, var in nnx.to_flat_state(state):
    if not rng and isinstance(var, nnx.RngState):
      continue
    out[_key(path)] = _host(var.get_value())
  return out


def assert_bit_exact(got: dict[str, np.ndarray], want: dict[str, np.ndarray]):
  assert sorted(got) == sorted(want)
  for k, w in want.items():
    g = got[k]
    assert (g.dtype, g.shape) == (w.dtype, w.shape), k
    assert g.tobytes() == w.tobytes(), k


def assert_created(got: dict[str, np.ndarray], want: dict[str, np.ndarray]):
  """A sharded creation against the unsharded build: within the bound the
  docs state (`creation_values.MAX_ULP`); placed values are bit-exact."""
  assert sorted(got) == sorted(want)
  for k, w in want.items():
    creation_values.assert_close(got[k], w, err_msg=k)


def _annotation(var) -> tuple[Any, ...] | None:
  names = var.get_metadata().get('out_sharding')
  return None if names is None else tuple(names)


def expected_placements(module, context, mesh) -> dict[str, tuple]:
  """Each variable's placement, from its annotation and the rule table.

  The test's own resolution: a logical name by `context_matrix.rule_table`,
  a mesh axis (no rules) as it is; unannotated: replicated.
  """
  rules = dict(cm.rule_table(context))
  out = {}
  for path, var in nnx.to_flat_state(nnx.state(module)):
    names = _annotation(var)
    if names is None:
      out[_key(path)] = ()
      continue
    spec = [
      rules.get(n) if isinstance(n, str) and n in rules else n for n in names
    ]
    out[_key(path)] = cm.placement(jax.sharding.PartitionSpec(*spec), mesh)
  return out


def check_placements(module, context, mesh):
  """Plan = nnx.get_partition_spec = placement = what the rules say."""
  want = expected_placements(module, context, mesh)
  with cm.scope(context, mesh):
    plan = fdt.plan(module, **cm.mesh_kwargs(context, mesh))
    pspecs = nnx.get_partition_spec(nnx.state(module))
  planned = {e.path: cm.placement(e.spec, mesh) for e in plan.entries}
  placed = {e.path: cm.placement(e.placed, mesh) for e in plan.entries}
  assert planned == want
  assert placed == want
  assert not [e.path for e in plan.entries if e.misplaced]
  flax_specs = {
    _key(p): cm.placement(v.get_value(), mesh)
    for p, v in nnx.to_flat_state(pspecs)
  }
  assert flax_specs == want
  actual = {}
  for p, v in nnx.to_flat_state(nnx.state(module)):
    sharding = v.get_value().sharding
    assert isinstance(sharding, jax.sharding.NamedSharding), (p, sharding)
    assert sharding.mesh.shape_tuple == mesh.shape_tuple
    actual[_key(p)] = cm.placement(sharding.spec, mesh)
  assert actual == want


SIGNATURE = [tf.TensorSpec([None, cm.EMBED], tf.float32, name='x'), None]


def _signature(context):
  """A polymorphic batch; static on a mesh with an Explicit axis.

  On an Explicit mesh the forward reshards the batch over 'data', which JAX
  cannot do to a batch of unknown size (see
  `test_a_batch_resharded_on_an_explicit_axis_needs_a_static_size`). On a
  mixed mesh a polymorphic batch exports, but TF 2.21 refuses every call
  of it ("shape_assertion: expects static assert_what"), even for a model
  without constraints: a bug reported, not yet fixed.
  """
  if context.mesh in ('Explicit', 'mixed'):
    return [tf.TensorSpec([cm.BATCH, cm.EMBED], tf.float32, name='x'), None]
  return SIGNATURE


def _serving(model):
  if model.has('nnx.Rngs and dropout'):
    return nnx.view(model, deterministic=True)
  return model


def abstract_target(cell, factory, mesh):
  """`nnx.eval_shape` of the model, as the context allows building it.

  Where eager creation is refused (no mesh; Flax's creation on a mixed
  mesh), the target is built with eager sharding off, and the restore
  places it (`mesh=`, the rules).
  """
  eager = cm.Cell('eager creation', cell.context, cell.features)
  with cm.scope(cell.context, mesh), contextlib.ExitStack() as stack:
    if cm.refusal(eager) is not None:
      stack.enter_context(nnx.use_eager_sharding(False))
    return nnx.eval_shape(factory)


class World:
  """What the cells share: meshes, models, checkpoints, exports."""

  def __init__(self, root: pathlib.Path):
    self.root = root
    self._memo: dict[Any, Any] = {}

  def memo(self, key, make):
    if key not in self._memo:
      try:
        self._memo[key] = ('ok', make())
      except Exception as e:
        self._memo[key] = ('error', e)
    kind, value = self._memo[key]
    if kind == 'error':
      raise value
    return value

  def mesh(self, context) -> jax.sharding.Mesh:
    return self.memo(('mesh', context.mesh), lambda: cm.make_mesh(context.mesh))

  def factory(self, cell, seed=0):
    return cm.factory(
      cell.context, self.mesh(cell.context), cell.features, seed
    )

  def reference(self, cell) -> dict[str, np.ndarray]:
    """The values of an unsharded build (no mesh, no rules, eager off)."""

    def make():
      with nnx.use_eager_sharding(False):
        return flat(self.factory(cell)())

    return self.memo(('reference', cell.features), make)

  def model(self, cell, seed=0):
    """The context's model, built by `fdt.init` there (once)."""
    context, mesh = cell.context, self.mesh(cell.context)

    def make():
      with cm.scope(context, mesh):
        return fdt.init(
          self.factory(cell, seed), **cm.mesh_kwargs(context, mesh)
        )

    return self.memo(('model', context, cell.features, seed), make)

  def zeroed(self, cell):
    """A copy of the context's model, every non-RNG value zero (or False).

    Zeroed elementwise, so each array keeps its sharding.
    """
    target = nnx.clone(self.model(cell))
    state = nnx.state(target, nnx.Not(nnx.RngState))
    nnx.update(target, jax.tree.map(lambda x: (x != x).astype(x.dtype), state))
    return target

  def directory(self, *parts) -> str:
    self._count = getattr(self, '_count', 0) + 1
    return str(self.root / f'{parts[0]}-{self._count}')

  def checkpoint(self, cell, *, blocking: bool) -> str:
    """The model saved once: blocking with RNG state, else without."""
    context, mesh = cell.context, self.mesh(cell.context)

    def make():
      model = self.model(cell)
      path = self.directory('ckpt', context, cell.features, blocking)
      with cm.scope(context, mesh):
        if blocking:
          return fdt_tf.save_checkpoint(model, path, exclude=())
        handle = fdt_tf.save_checkpoint(model, path, blocking=False)
      handle.wait()
      return path

    return self.memo(('ckpt', context, cell.features, blocking), make)

  def tf_module(self, cell):
    context, mesh = cell.context, self.mesh(cell.context)

    def make():
      with cm.scope(context, mesh):
        return fdt_tf.to_tf_module(self.model(cell))

    return self.memo(('tf_module', context, cell.features), make)

  def reference_output(self, cell):
    """The served method's result in JAX, under the context's mesh."""
    context, mesh = cell.context, self.mesh(cell.context)

    def make():
      # A copy: `nnx.view` of a module with a kept nnx.Rngs advances it.
      view = _serving(nnx.clone(self.model(cell)))
      with jax.set_mesh(mesh), cm.scope(context, mesh):
        x = jax.device_put(X, jax.sharding.NamedSharding(mesh, cm.P()))
        out = view(x, None)
      return [np.asarray(jax.device_get(o)) for o in jax.tree.leaves(out)]

    return self.memo(('jax_out', context, cell.features), make)

  def export(self, cell) -> str:
    context, mesh = cell.context, self.mesh(cell.context)

    def make():
      # A copy: `nnx.view` of a module with a kept nnx.Rngs advances it.
      view = _serving(nnx.clone(self.model(cell)))
      path = self.directory('sm', context, cell.features)
      with cm.scope(context, mesh):
        return fdt_tf.save_saved_model(
          view,
          path,
          input_signature=_signature(context),
        )

    return self.memo(('sm', context, cell.features), make)


ALL_CELLS = cm.cells() + cm.feature_cells()


@pytest.fixture(scope='module')
def world(tmp_path_factory):
  return World(tmp_path_factory.mktemp('context-matrix'))


@pytest.fixture(scope='module', autouse=True)
def _compiled_once(tmp_path_factory):
  """One compile of a program the contexts share (a traced `fdt.init`).

  The same model built under another rules spelling or mesh context
  compiles to the same program: JAX's persistent cache, in a directory of
  this module's, finds it. The old settings come back afterwards.
  """
  from jax._src import compilation_cache

  options = {
    'jax_compilation_cache_dir': str(tmp_path_factory.mktemp('xla-cache')),
    'jax_persistent_cache_min_compile_time_secs': 0.0,
    'jax_persistent_cache_min_entry_size_bytes': 0,
  }
  old = {k: getattr(jax.config, k) for k in options}
  for k, v in options.items():
    jax.config.update(k, v)
  compilation_cache.reset_cache()
  yield
  for k, v in old.items():
    jax.config.update(k, v)
  compilation_cache.reset_cache()


# Serves every SavedModel of the matrix in one TF process that cannot
# import JAX: {path: [outputs in name order]}.
_SERVE = processes.NO_JAX + textwrap.dedent(
  """
  import json, sys
  import numpy as np
  import tensorflow as tf

  job = json.load(open(sys.argv[1]))
  x = np.load(job['x'])
  report = {}
  for path in job['paths']:
    try:
      serve = tf.saved_model.load(path).signatures['serving_default']
      out = serve(x=tf.constant(x))
      report[path] = {k: out[k].numpy().tolist() for k in sorted(out)}
    except Exception as e:
      report[path] = {'error': f'{type(e).__name__}: {e}'[-3000:]}
  print(RESULT + json.dumps(report))
  """
).replace('RESULT', repr(processes.RESULT))


@pytest.fixture(scope='module')
def served(world, tmp_path_factory):
  """Exports every SavedModel cell's model, then serves them all at once."""
  paths = []
  for cell in ALL_CELLS:
    if cell.entry != 'save_saved_model (served by TF)':
      continue
    try:
      paths.append(world.export(cell))
    except Exception:
      continue
  if not paths:
    return {}
  work = tmp_path_factory.mktemp('serve')
  np.save(work / 'x.npy', X)
  (work / 'job.json').write_text(
    json.dumps({'x': str(work / 'x.npy'), 'paths': paths})
  )
  (work / 'serve.py').write_text(_SERVE)
  return processes.checked_result(
    processes.run_python(work / 'serve.py', work / 'job.json')
  )


def _eager(world, cell):
  context, mesh = cell.context, world.mesh(cell.context)
  with cm.scope(context, mesh):
    model = world.factory(cell)()
  check_placements(model, context, mesh)
  assert_created(flat(model), world.reference(cell))


def _init(world, cell):
  model = world.model(cell)
  check_placements(model, cell.context, world.mesh(cell.context))
  assert_created(flat(model), world.reference(cell))


def _shard_module(world, cell):
  context, mesh = cell.context, world.mesh(cell.context)
  with nnx.use_eager_sharding(False):
    model = world.factory(cell)()
  with cm.scope(context, mesh):
    assert fdt.shard_module(model, **cm.mesh_kwargs(context, mesh)) is model
  check_placements(model, context, mesh)
  assert_bit_exact(flat(model), world.reference(cell))


def _plan_model(world, cell):
  check_placements(world.model(cell), cell.context, world.mesh(cell.context))


def _plan_factory(world, cell):
  context, mesh = cell.context, world.mesh(cell.context)
  want = expected_placements(world.model(cell), context, mesh)
  with cm.scope(context, mesh):
    plan = fdt.plan(world.factory(cell), **cm.mesh_kwargs(context, mesh))
  assert {e.path: cm.placement(e.spec, mesh) for e in plan.entries} == want


def _expected_findings(cell) -> set[tuple[str, str]]:
  """Rules only for activations are unused by variables; nothing else."""
  if cell.context.rules == 'no rules':
    return set()
  unused = {n for n, _ in cm.rule_table(cell.context) if 'activation_' in n}
  if 'nnx.scan-stacked layers' not in cell.features:
    unused.add('layers')
  return {('unused-rule', repr(name)) for name in unused}


def _check(world, cell, subject):
  context, mesh = cell.context, world.mesh(cell.context)
  with cm.scope(context, mesh):
    report = fdt.check(subject, **cm.mesh_kwargs(context, mesh))
  assert {(f.code, f.subject) for f in report.findings} == _expected_findings(
    cell
  )


def _check_model(world, cell):
  _check(world, cell, world.model(cell))


def _check_factory(world, cell):
  _check(world, cell, world.factory(cell))


def _save(world, cell, *, blocking):
  path = world.checkpoint(cell, blocking=blocking)
  # What was saved, bit for bit (RNG state is left out by default); the
  # model's own values are `_init`'s to compare with an unsharded build.
  want = flat(world.model(cell), rng=blocking)
  assert_bit_exact(
    {_key(k): v for k, v in fdt_tf.read_checkpoint(path).items()}, want
  )


def _restore_abstract(world, cell):
  context, mesh = cell.context, world.mesh(cell.context)
  path = world.checkpoint(cell, blocking=True)
  target = abstract_target(cell, world.factory(cell, seed=5), mesh)
  with cm.scope(context, mesh):
    restored = fdt_tf.restore_checkpoint(
      path, target, exclude=(), **cm.mesh_kwargs(context, mesh)
    )
  check_placements(restored, context, mesh)
  assert_bit_exact(flat(restored), flat(world.model(cell)))


def _restore_concrete(world, cell):
  context, mesh = cell.context, world.mesh(cell.context)
  path = world.checkpoint(cell, blocking=False)
  target = world.zeroed(cell)
  with cm.scope(context, mesh):
    fdt_tf.restore_checkpoint(path, target, **cm.mesh_kwargs(context, mesh))
  check_placements(target, context, mesh)
  assert_bit_exact(flat(target, rng=False), flat(world.model(cell), rng=False))


def _to_tf_module(world, cell):
  variables = fdt_tf.flat_variables(world.tf_module(cell))
  got = {
    _key(k): _host(fdt_tf.dtensor_to_array(v.read_value()))
    for k, v in variables.items()
  }
  assert_bit_exact(got, flat(world.model(cell), rng=False))


def _from_tf_module(world, cell):
  context, mesh = cell.context, world.mesh(cell.context)
  tf_module = world.tf_module(cell)
  target = world.zeroed(cell)
  with cm.scope(context, mesh):
    fdt_tf.from_tf_module(tf_module, target, **cm.mesh_kwargs(context, mesh))
  check_placements(target, context, mesh)
  assert_bit_exact(flat(target, rng=False), flat(world.model(cell), rng=False))


def _saved_model(world, cell, served):
  path = world.export(cell)
  want = world.reference_output(cell)
  got = served[path]
  assert 'error' not in got, got.get('error')
  assert len(got) == len(want)
  for name, w in zip(sorted(got), want, strict=True):
    np.testing.assert_allclose(
      np.asarray(got[name]), w, rtol=1e-4, atol=1e-4, err_msg=name
    )


RUNNERS = {
  'eager creation': _eager,
  'fdt.init': _init,
  'shard_module': _shard_module,
  'plan(model)': _plan_model,
  'plan(factory)': _plan_factory,
  'check(model)': _check_model,
  'check(factory)': _check_factory,
  'save_checkpoint': lambda w, c: _save(w, c, blocking=True),
  'save_checkpoint(blocking=False)': lambda w, c: _save(w, c, blocking=False),
  'restore_checkpoint(abstract)': _restore_abstract,
  'restore_checkpoint(concrete)': _restore_concrete,
  'to_tf_module': _to_tf_module,
  'from_tf_module': _from_tf_module,
}


def test_every_list_element_is_in_a_cell():
  assert set(RUNNERS) | {'save_saved_model (served by TF)'} == set(
    cm.ENTRY_POINTS
  )
  cells = ALL_CELLS
  assert {c.entry for c in cells} == set(cm.ENTRY_POINTS)
  assert {c.context.mesh_context for c in cells} == set(cm.MESH_CONTEXTS)
  assert {c.context.rules for c in cells} == set(cm.RULES)
  assert {c.context.mesh for c in cells} == set(cm.MESHES)
  assert {f for c in cells for f in c.features} == set(cm.FEATURES)
  for feature in cm.FEATURES:
    assert any(c.features == (feature,) for c in cells)


@pytest.mark.parametrize('cell', ALL_CELLS, ids=lambda c: c.id)
def test_cell(cell, world, request):
  if cell.entry == 'save_saved_model (served by TF)':
    run = lambda: _saved_model(world, cell, request.getfixturevalue('served'))  # noqa: E731
  else:
    run = lambda: RUNNERS[cell.entry](world, cell)  # noqa: E731
  refusal = cm.refusal(cell)
  if refusal is None:
    run()
  else:
    with pytest.raises(refusal.error_class(), match=refusal.match):
      run()


def test_a_batch_resharded_on_an_explicit_axis_needs_a_static_size(world):
  """JAX cannot reshard a polymorphic batch: our error names the fix."""
  cell = cm.Cell(
    'save_saved_model (served by TF)',
    cm.Context('jax.set_mesh', 'fdt.logical_axis_rules', 'Explicit'),
  )
  mesh = world.mesh(cell.context)
  with cm.scope(cell.context, mesh):
    with pytest.raises(
      fdt.ExportError,
      match=r"polymorphic dimension 'b' \(x \(b, 16\)\) over 2 devices .*"
      r'static size there, a multiple of 2',
    ):
      fdt_tf.save_saved_model(
        world.model(cell),
        world.directory('refused'),
        input_signature=SIGNATURE,
      )


# The MaxText-style world (tests/support/maxtext_style.py): its mesh of 12
# axes, its rules of tuples, its decoder, and eager sharding turned off as
# importing MaxText does, each entry point in turn.


@pytest.fixture(scope='module')
def maxtext(tmp_path_factory):
  """The decoder built eagerly and by `fdt.init`, saved once."""
  mesh = maxtext_style.make_mesh()
  make = lambda: maxtext_style.Decoder(mesh, rngs=nnx.Rngs(0, dropout=1))  # noqa: E731
  with (
    maxtext_style.imported(),
    jax.set_mesh(mesh),
    fdt.logical_axis_rules(maxtext_style.RULES),
  ):
    with pytest.warns(fdt.EagerShardingOffWarning):
      eager = make()
    built = fdt.init(make)
    path = fdt_tf.save_checkpoint(
      built, str(tmp_path_factory.mktemp('maxtext') / 'ckpt'), exclude=()
    )
  with nnx.use_eager_sharding(False):
    reference = flat(make())
  return {
    'mesh': mesh,
    'make': make,
    'eager': eager,
    'built': built,
    'path': path,
    'reference': reference,
  }


@contextlib.contextmanager
def _maxtext_scope(mesh):
  with (
    maxtext_style.imported(),
    jax.set_mesh(mesh),
    fdt.logical_axis_rules(maxtext_style.RULES),
  ):
    yield


def _rule_placements(module, mesh):
  context = cm.Context('jax.set_mesh', 'fdt.logical_axis_rules', 'size-1 axes')
  return expected_placements(module, context, mesh)


def test_maxtext_style_eager_creation_is_unplaced_and_planned_so(maxtext):
  mesh, eager = maxtext['mesh'], maxtext['eager']
  with _maxtext_scope(mesh):
    plan = fdt.plan(eager)
  misplaced = {e.path for e in plan.entries if e.misplaced}
  # 'norm' is on size-1 axes only: unplaced is where it belongs.
  assert misplaced == {'layers/wi', 'layers/wo'}
  for e in plan.entries:
    if e.misplaced:
      assert 'eager sharding' in e.misplaced_reason
  assert_created(flat(eager), maxtext['reference'])


def test_maxtext_style_check_reports_eager_sharding_off_of_the_model(maxtext):
  with _maxtext_scope(maxtext['mesh']):
    report = fdt.check(maxtext['eager'])
  codes = {f.code for f in report.findings}
  assert 'eager-sharding-off' in codes
  assert codes <= {'eager-sharding-off', 'unused-rule'}


def test_maxtext_style_init_places_by_the_rules(maxtext):
  mesh, built = maxtext['mesh'], maxtext['built']
  want = _rule_placements(built, mesh)
  assert {k for k, v in want.items() if v} == {'layers/wi', 'layers/wo'}
  with _maxtext_scope(mesh):
    plan = fdt.plan(built)
  assert {e.path: cm.placement(e.spec, mesh) for e in plan.entries} == want
  assert not [e.path for e in plan.entries if e.misplaced]
  actual = {
    _key(p): cm.placement(v.get_value().sharding.spec, mesh)
    for p, v in nnx.to_flat_state(nnx.state(built))
  }
  assert actual == want
  assert_created(flat(built), maxtext['reference'])


def test_maxtext_style_restores_rng_state_into_an_abstract_target(maxtext):
  mesh = maxtext['mesh']
  with _maxtext_scope(mesh):
    target = nnx.eval_shape(maxtext['make'])
    restored = fdt_tf.restore_checkpoint(maxtext['path'], target, exclude=())
  assert_bit_exact(flat(restored), flat(maxtext['built']))
  want = _rule_placements(restored, mesh)
  actual = {
    _key(p): cm.placement(v.get_value().sharding.spec, mesh)
    for p, v in nnx.to_flat_state(nnx.state(restored))
  }
  assert actual == want
