"""Where users start: one device, two, six, eight; every main step, by values.

A laptop or one GPU gives a mesh of one device, and `jax.make_mesh` gives
it Explicit axes. Each mesh here is built as users write it (JAX's default
axes, Auto, mixed) on the first N of the suite's devices, and each step a
new user takes runs on it: eager creation and `fdt.init` under our rules
(values against an unsharded build, placements against the plan), a jitted
forward written for the mesh, a checkpoint written and restored (bit for
bit), and a SavedModel served by a TensorFlow process without JAX (at 1, 3
and 8 rows, against JAX's forward); then the other entry points: a model
placed by `shard_module`, its DVariables and the way back, a background
save and a `CheckpointManager` step. A refusal anywhere is a failure: JAX
runs every one of these cases.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from support import creation_values, processes, warm

import flax_dtensor as fdt

tf = pytest.importorskip('tensorflow')
fdt_tf = pytest.importorskip('flax_dtensor.dtensor')

EMBED, MLP = 16, 24  # 16 divides by 2 but not 3; 24 by 2, 3 and 4.
SERVED_ROWS = (1, 3, 8)
RULES = fdt.LogicalRules(
  [('batch', 'data'), ('embed', 'data'), ('mlp', 'model'), ('mlp', 'data')]
)
X = np.random.default_rng(3).standard_normal((max(SERVED_ROWS), EMBED))
X = X.astype(np.float32)


@dataclasses.dataclass(frozen=True)
class MeshCase:
  name: str
  shape: tuple[int, ...]
  names: tuple[str, ...]
  types: str  # 'default' (jax.make_mesh's: Explicit), 'Auto' or 'mixed'.

  def make(self) -> jax.sharding.Mesh:
    devices = jax.devices()[: int(np.prod(self.shape))]
    if self.types == 'default':
      return jax.make_mesh(self.shape, self.names, devices=devices)
    types = {
      'Auto': (AxisType.Auto,) * len(self.shape),
      'mixed': (AxisType.Explicit, *(AxisType.Auto,) * (len(self.shape) - 1)),
    }[self.types]
    return jax.make_mesh(
      self.shape, self.names, axis_types=types, devices=devices
    )


MESHES = [
  MeshCase('1 device (1, 1)', (1, 1), ('data', 'model'), 'default'),
  MeshCase('1 device (1,)', (1,), ('data',), 'default'),
  MeshCase('1 device (1, 1) Auto', (1, 1), ('data', 'model'), 'Auto'),
  MeshCase('1 device (1, 1) mixed', (1, 1), ('data', 'model'), 'mixed'),
  MeshCase('2 devices (2,)', (2,), ('data',), 'default'),
  MeshCase('2 devices (1, 2) mixed', (1, 2), ('data', 'model'), 'mixed'),
  # 3 divides neither 16 nor the batch of 8: every rule on 'data' falls back.
  MeshCase('6 devices (3, 2)', (3, 2), ('data', 'model'), 'default'),
  MeshCase('8 devices (2, 4)', (2, 4), ('data', 'model'), 'default'),
  MeshCase('8 devices (2, 4) Auto', (2, 4), ('data', 'model'), 'Auto'),
]
IDS = [m.name for m in MESHES]


class Block(nnx.Module):
  """An MLP written for any mesh: its result placed as the rules say."""

  def __init__(self, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    self.up = nnx.Linear(
      EMBED,
      MLP,
      rngs=rngs,
      kernel_init=nnx.with_partitioning(init, ('embed', 'mlp')),
    )
    self.down = nnx.Linear(
      MLP,
      EMBED,
      rngs=rngs,
      kernel_init=nnx.with_partitioning(init, ('mlp', 'embed')),
    )

  def __call__(self, x):
    h = jax.nn.relu(self.up(x))
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AxisType.Explicit not in mesh.axis_types:
      return self.down(h)
    # Explicit axes: a matmul contracting a sharded dimension is told where
    # its result goes (JAX's rule); replicated, so any batch size serves.
    return self.down(h, out_sharding=jax.P())


def _reference() -> dict[str, np.ndarray]:
  with nnx.use_eager_sharding(False):
    model = Block(nnx.Rngs(0))
  return {k: np.asarray(v) for k, v in _flat(model).items()}


def _flat(model) -> dict[str, jax.Array]:
  return {
    '/'.join(map(str, path)): v.get_value()
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
  }


@pytest.fixture(scope='module')
def reference():
  return _reference()


def _check_built(model, mesh, reference) -> None:
  """Values within the bound of an unsharded build; placed as planned."""
  flat = _flat(model)
  assert set(flat) == set(reference)
  for path, value in flat.items():
    creation_values.assert_close(value, reference[path], err_msg=path)
  plan = fdt.plan(model, rules=RULES)
  for path, value in flat.items():
    assert value.sharding.mesh.shape == mesh.shape, path
    got = tuple(value.sharding.spec) + (None,) * value.ndim
    want = tuple(plan[path].spec) + (None,) * value.ndim
    assert got[: value.ndim] == want[: value.ndim], (path, got, want)


@pytest.mark.parametrize('case', MESHES, ids=IDS)
def test_eager_creation_and_init_on_the_mesh(case, reference):
  mesh = case.make()
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    eager = Block(nnx.Rngs(0))
    built = fdt.init(lambda: Block(nnx.Rngs(0)))
  _check_built(eager, mesh, reference)
  _check_built(built, mesh, reference)


@pytest.mark.parametrize('case', MESHES, ids=IDS)
def test_a_jitted_forward_and_a_checkpoint_round_trip(case, tmp_path):
  mesh = case.make()
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    model = fdt.init(lambda: Block(nnx.Rngs(0)))
    y = nnx.jit(lambda m, x: m(x))(model, X)
    path = fdt_tf.save_checkpoint(model, tmp_path / 'ckpt')
    abstract = nnx.eval_shape(lambda: Block(nnx.Rngs(1)))
    back = fdt_tf.restore_checkpoint(path, abstract)
  with nnx.use_eager_sharding(False):
    plain = Block(nnx.Rngs(0))
  np.testing.assert_allclose(
    np.asarray(y), np.asarray(plain(X)), rtol=1e-5, atol=1e-5
  )
  saved, restored = _flat(model), _flat(back)
  for key, value in saved.items():
    np.testing.assert_array_equal(np.asarray(restored[key]), np.asarray(value))
    # Placed alike (a 1-device Auto mesh's jitted step may drop its size-1
    # axes from the spec; the restore places as the plan says).
    assert restored[key].sharding.is_equivalent_to(value.sharding, value.ndim)


# Serves every export in one TF process that cannot import JAX.
_SERVE = processes.NO_JAX + textwrap.dedent(
  """
  import json, sys
  import numpy as np
  import tensorflow as tf

  job = json.load(open(sys.argv[1]))
  x = np.load(job['x'])
  report = {}
  for name, path in job['paths'].items():
    serve = tf.saved_model.load(path).signatures['serving_default']
    report[name] = {
      str(rows): serve(x=tf.constant(x[:rows]))['output_0'].numpy().tolist()
      for rows in job['rows']
    }
  print(RESULT + json.dumps(report))
  """
).replace('RESULT', repr(processes.RESULT))


@pytest.fixture(scope='module')
def served(tmp_path_factory):
  """Each mesh's SavedModel (exported inside its mesh and rules), served,
  with JAX's forward of the same model: {mesh name: (served, JAX's)}."""
  work = tmp_path_factory.mktemp('served')
  paths, want = {}, {}
  for case in MESHES:
    mesh = case.make()
    with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
      model = fdt.init(lambda: Block(nnx.Rngs(0)))
      want[case.name] = np.asarray(nnx.jit(lambda m, x: m(x))(model, X))
      paths[case.name] = str(
        fdt_tf.save_saved_model(
          model,
          work / f'm{len(paths)}',
          input_signature=[tf.TensorSpec([None, EMBED], tf.float32, name='x')],
        )
      )
  np.save(work / 'x.npy', X)
  (work / 'job.json').write_text(
    json.dumps(
      {'x': str(work / 'x.npy'), 'paths': paths, 'rows': list(SERVED_ROWS)}
    )
  )
  (work / 'serve.py').write_text(_SERVE)
  report = processes.checked_result(
    warm.tf_only().run(work / 'serve.py', work / 'job.json')
  )
  return {name: (report[name], want[name]) for name in paths}


@pytest.mark.parametrize('case', MESHES, ids=IDS)
def test_the_savedmodel_serves_in_plain_tensorflow(case, served):
  got, want = served[case.name]
  for rows in SERVED_ROWS:
    np.testing.assert_allclose(
      np.asarray(got[str(rows)], np.float32),
      want[:rows],
      rtol=1e-5,
      atol=1e-5,
      err_msg=f'{rows} rows',
    )


@pytest.mark.parametrize('case', MESHES, ids=IDS)
def test_shard_module_the_tf_round_trip_and_background_saves(
  case, reference, tmp_path
):
  """The other entry points on the mesh, by values: a model built whole
  then placed (`shard_module`, bit for bit), its DVariables (gathered by
  TF, against JAX's arrays) and the way back, a background save and a
  `CheckpointManager` step restored."""
  mesh = case.make()
  with nnx.use_eager_sharding(False):
    model = Block(nnx.Rngs(0))
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    assert fdt.shard_module(model) is model
  flat = _flat(model)
  plan = fdt.plan(model, mesh=mesh, rules=RULES)
  for path, value in flat.items():
    np.testing.assert_array_equal(np.asarray(value), reference[path])
    assert value.sharding.mesh.shape == mesh.shape, path
    got = (tuple(value.sharding.spec) + (None,) * value.ndim)[: value.ndim]
    want = (tuple(plan[path].spec) + (None,) * value.ndim)[: value.ndim]
    assert got == want, (path, got, want)
  variables = {
    '/'.join(map(str, key)): v
    for key, v in fdt_tf.flat_variables(fdt_tf.to_tf_module(model)).items()
  }
  assert set(variables) == set(flat)
  for path, variable in variables.items():
    gathered = fdt_tf.dtensor_to_array(variable.read_value())
    np.testing.assert_array_equal(np.asarray(gathered), reference[path])
  with nnx.use_eager_sharding(False):
    target = Block(nnx.Rngs(5))
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    fdt_tf.from_tf_module(fdt_tf.to_tf_module(model), target)
  for path, value in _flat(target).items():
    np.testing.assert_array_equal(np.asarray(value), reference[path])
  handle = fdt_tf.save_checkpoint(model, tmp_path / 'bg', blocking=False)
  saved = fdt_tf.read_checkpoint(handle.result())
  for path, value in reference.items():
    np.testing.assert_array_equal(saved[path], value)
  manager = fdt_tf.CheckpointManager(tmp_path / 'run')
  manager.save(1, model)
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    back = manager.restore(nnx.eval_shape(lambda: Block(nnx.Rngs(1))))
  manager.close()
  for path, value in _flat(back).items():
    np.testing.assert_array_equal(np.asarray(value), reference[path])
    assert value.sharding.is_equivalent_to(flat[path].sharding, value.ndim)
