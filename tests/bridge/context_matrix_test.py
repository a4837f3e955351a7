"""The context matrix: every entry point, in every context, on both ends.

The cells come from tests/support/context_matrix.py's lists (entry points,
contexts, features), generated there; each cell either works, its values
compared (placements: the plan = `nnx.get_partition_spec` = the arrays'
shardings, compared as placements; restores and round trips bit-exact;
served SavedModels within a tolerance of JAX), or is refused with our
error, as `context_matrix.REFUSALS` says.

Kept cheap: each model is built once per context (`World`), checkpoints
are written once and read by the cells that need them, and every
SavedModel of the matrix is served by one JAX-free TF process, at every
batch size of `context_matrix.SERVED_BATCHES`.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import textwrap
import warnings
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx
from support import context_matrix as cm
from support import creation_values, maxtext_style, processes, scheduling

import flax_dtensor as fdt

tf = pytest.importorskip('tensorflow')
fdt_tf = pytest.importorskip('flax_dtensor.dtensor')

X = np.random.default_rng(7).standard_normal((max(cm.SERVED_BATCHES), cm.EMBED))
X = X.astype(np.float32)


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
    self.narrowed: dict[str, list[str]] = {}

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

  def reference_output(self, cell, batch: int, *, one_device: bool = False):
    """The served method's result in JAX on `batch` rows, jitted under the
    context's mesh, or on one device (a copy of the mesh whose axes are
    each of size 1, the model's arrays moved there). JAX's own refusal,
    if it refuses, is raised."""
    context, mesh = cell.context, self.mesh(cell.context)

    def make():
      # A copy: `nnx.view` of a module with a kept nnx.Rngs advances it.
      view = _serving(nnx.clone(self.model(cell)))
      on = _one_device(mesh) if one_device else mesh
      if one_device:
        state = nnx.state(view)
        nnx.update(
          view,
          jax.device_put(state, jax.sharding.NamedSharding(on, cm.P())),
        )
      with jax.set_mesh(on), cm.scope(context, on):
        x = jax.device_put(X[:batch], jax.sharding.NamedSharding(on, cm.P()))
        out = nnx.jit(lambda m, x: m(x, None))(view, x)
      return [np.asarray(jax.device_get(o)) for o in jax.tree.leaves(out)]

    key = ('jax_out', context, cell.features, batch, one_device)
    return self.memo(key, make)

  def export(self, cell) -> str:
    context, mesh = cell.context, self.mesh(cell.context)

    def make():
      # A copy: `nnx.view` of a module with a kept nnx.Rngs advances it.
      view = _serving(nnx.clone(self.model(cell)))
      path = self.directory('sm', context, cell.features)
      with cm.scope(context, mesh), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always', fdt_tf.ServedShapeWarning)
        path = fdt_tf.save_saved_model(view, path, input_signature=SIGNATURE)
      self.narrowed[path] = [
        str(x.message)
        for x in w
        if issubclass(x.category, fdt_tf.ServedShapeWarning)
      ]
      return path

    return self.memo(('sm', context, cell.features), make)


ALL_CELLS = cm.cells() + cm.feature_cells() + cm.export_cells()


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
# import JAX, at each batch size: {path: {batch: {output name: values}, or
# {'error': TF's error}}}.
_SERVE = processes.NO_JAX + textwrap.dedent(
  """
  import json, sys
  import numpy as np
  import tensorflow as tf

  job = json.load(open(sys.argv[1]))
  x = np.load(job['x'])
  report = {}
  for path in job['paths']:
    report[path] = {}
    try:
      serve = tf.saved_model.load(path).signatures['serving_default']
    except Exception as e:
      report[path] = {'load': f'{type(e).__name__}: {e}'[-3000:]}
      continue
    for batch in job['batches']:
      try:
        out = serve(x=tf.constant(x[:batch]))
        got = {k: out[k].numpy().tolist() for k in sorted(out)}
      except Exception as e:
        got = {'error': f'{type(e).__name__}: {e}'[-3000:]}
      report[path][str(batch)] = got
  print(RESULT + json.dumps(report))
  """
).replace('RESULT', repr(processes.RESULT))


@pytest.fixture(scope='module')
def served(world, tmp_path_factory, tf_pool):
  """`of(cell)`: the report of the SavedModel cells of `cell`'s part
  (`scheduling.served_part`), each part exported, then served by one TF
  process (a fork of the TensorFlow-only pool), at its first cell (the
  parts go to different workers)."""
  parts = {}

  def of(cell):
    part = scheduling.served_part(cell.id)
    if part not in parts:
      parts[part] = _serve(
        world,
        tmp_path_factory,
        tf_pool,
        [
          c
          for c in ALL_CELLS
          if c.entry == cm.SAVED_MODEL and scheduling.served_part(c.id) == part
        ],
      )
    return parts[part]

  return of


def _serve(world, tmp_path_factory, pool, cells):
  """Exports `cells`' models, then serves them all in one TF process."""
  paths = []
  for cell in cells:
    try:
      paths.append(world.export(cell))
    except Exception:
      continue
  if not paths:
    return {}
  work = tmp_path_factory.mktemp('serve')
  np.save(work / 'x.npy', X)
  (work / 'job.json').write_text(
    json.dumps(
      {
        'x': str(work / 'x.npy'),
        'paths': paths,
        'batches': list(cm.SERVED_BATCHES),
      }
    )
  )
  (work / 'serve.py').write_text(_SERVE)
  return processes.checked_result(
    pool.run(work / 'serve.py', work / 'job.json')
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
  """Rules only for activations are unused by variables; a matrix with one
  logical name is pointed out; nothing else."""
  short = (
    {('short-annotation', repr(cm.short_annotation(cell.context)))}
    if 'short annotation' in cell.features
    else set()
  )
  if cell.context.rules == 'no rules':
    return short
  unused = {n for n, _ in cm.rule_table(cell.context) if 'activation_' in n}
  if 'nnx.scan-stacked layers' not in cell.features:
    unused.add('layers')
  return {('unused-rule', repr(name)) for name in unused} | short


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


def _one_device(mesh):
  """`mesh`'s axis names and types, each axis of size 1, on one device."""
  devices = np.array(jax.devices()[:1]).reshape((1,) * len(mesh.shape))
  return jax.sharding.Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)


def _saved_model(world, cell, served):
  """Served at every batch JAX runs, with JAX's values; refused by TF at
  the batches JAX refuses, and only there (with our warning saying so).

  A batch that JAX refuses to split over its mesh's Explicit axis, but runs
  on one device, is served with JAX's values there: TF serves on one device.
  """
  path = world.export(cell)
  multiple = cm.batch_multiple(cell)
  warned = world.narrowed[path]
  if multiple == 1:
    assert warned == []
  else:
    assert len(warned) == 1
    assert f"'b' is exported as a multiple of {multiple}" in warned[0]
  report = served[path]
  assert 'load' not in report, report.get('load')
  for batch in cm.SERVED_BATCHES:
    got = report[str(batch)]
    on_mesh = cm.runs_on_its_mesh(cell, batch)
    if not on_mesh:
      with pytest.raises(ValueError, match='does not evenly divide'):
        world.reference_output(cell, batch)
    if batch % multiple:
      # JAX refuses this batch on any mesh, and TF refuses it as JAX does.
      with pytest.raises(ValueError, match='does not evenly divide'):
        world.reference_output(cell, batch, one_device=True)
      assert got.get('error', '').startswith('InvalidArgumentError'), got
      continue
    want = world.reference_output(cell, batch, one_device=not on_mesh)
    assert 'error' not in got, (batch, got.get('error'))
    assert len(got) == len(want)
    for name, w in zip(sorted(got), want, strict=True):
      np.testing.assert_allclose(
        np.asarray(got[name]),
        w,
        rtol=1e-4,
        atol=1e-4,
        err_msg=f'{name} at batch {batch}',
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
  assert set(RUNNERS) | {cm.SAVED_MODEL} == set(cm.ENTRY_POINTS)
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
  """The cell does what JAX itself does there, or raises its refusal.

  Slow: the first SavedModel cell of each part (`scheduling.served_part`)
  exports all of that part's cells and serves them in one TensorFlow
  process; the part's other cells read that report.
  """
  if cell.entry == cm.SAVED_MODEL:
    run = lambda: _saved_model(  # noqa: E731
      world, cell, request.getfixturevalue('served')(cell)
    )
  else:
    run = lambda: RUNNERS[cell.entry](world, cell)  # noqa: E731
  refusal = cm.refusal(cell)
  if refusal is None:
    run()
  else:
    with pytest.raises(refusal.error_class(), match=refusal.match):
      run()


def _explicit_cell(mesh_context='jax.set_mesh', features=cm.FEATURES):
  return cm.Cell(
    cm.SAVED_MODEL,
    cm.Context(mesh_context, 'fdt.logical_axis_rules', 'Explicit'),
    features,
  )


def test_a_batch_resharded_on_an_explicit_axis_is_served_as_jax_runs_it(
  world,
):
  """The warning says what is served and how to keep it quietly: passing
  the shapes it names exports the same, without a warning."""
  cell = _explicit_cell(features=('constrained activations',))
  mesh = world.mesh(cell.context)
  view = world.model(cell)
  with cm.scope(cell.context, mesh):
    with pytest.warns(
      fdt_tf.ServedShapeWarning,
      match=r"'b' is exported as a multiple of 2 \(x \(2\*b, 16\)\).*"
      r"polymorphic_shapes=\['\(2\*b, 16\)'\]",
    ) as record:
      fdt_tf.save_saved_model(
        view, world.directory('warned'), input_signature=SIGNATURE
      )
    # The warning points at this line, not at flax_dtensor's code.
    (ours,) = [w for w in record if w.category is fdt_tf.ServedShapeWarning]
    assert ours.filename == __file__
    with warnings.catch_warnings():
      warnings.simplefilter('error', fdt_tf.ServedShapeWarning)
      path = fdt_tf.save_saved_model(
        view,
        world.directory('quiet'),
        input_signature=SIGNATURE,
        polymorphic_shapes=['(2*b, 16)', None],
      )
  assert (pathlib.Path(path) / 'saved_model.pb').is_file()


class _Grows(nnx.Module):
  """Reshards, on the mesh it names, a batch one row longer than its
  input: 'b + 1' rows, which no multiple of 'b' makes even."""

  def __init__(self, mesh):
    self.mesh = mesh
    self.scale = nnx.Param(jax.numpy.ones((cm.EMBED,)))

  def __call__(self, x):
    y = jax.numpy.concatenate([x, x[:1]]) * self.scale[...][None]
    named = jax.sharding.NamedSharding(self.mesh, cm.P('data', None))
    return jax.sharding.reshard(y, named).sum(0)


def test_a_dimension_no_multiple_makes_divide_is_refused_in_our_words(world):
  mesh = world.mesh(cm.Context('jax.set_mesh', 'no rules', 'Explicit'))
  with jax.set_mesh(mesh):
    with pytest.raises(
      fdt.ExportError,
      match=r"splits a dimension of size 'b \+ 1' over 2 devices.*"
      r'The inputs: x \(b, 16\).*Auto axes',
    ):
      fdt_tf.save_saved_model(
        _Grows(mesh), world.directory('grows'), input_signature=[SIGNATURE[0]]
      )


@pytest.mark.parametrize('mesh_kind', ['Explicit', 'mixed'])
def test_a_model_in_training_mode_is_refused_naming_nnx_view(world, mesh_kind):
  """Dropout draws from the model's nnx.Rngs, which a served function
  cannot advance: our error, before anything is written."""
  cell = cm.Cell(
    cm.SAVED_MODEL,
    cm.Context('jax.set_mesh', 'fdt.logical_axis_rules', mesh_kind),
    ('nnx.Rngs and dropout',),
  )
  path = pathlib.Path(world.directory('training'))
  with cm.scope(cell.context, world.mesh(cell.context)):
    with pytest.raises(
      fdt.ExportError,
      match=r'Model.__call__ for the SavedModel failed: it changes the '
      r"model's RngCount.*nnx.view\(model, deterministic=True",
    ):
      fdt_tf.save_saved_model(
        nnx.clone(world.model(cell)), path, input_signature=SIGNATURE
      )
  assert not path.exists()


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
