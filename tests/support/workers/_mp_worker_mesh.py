"""Worker of multiprocess_test.py: the DTensor bridge across 2 JAX processes.

Each process holds 4 of the 8 CPU devices. For meshes whose rows, columns or
interleaved positions span both processes, every array is converted with
`array_to_dtensor` and checked by values in every process: the local DTensor
components against TF's own layout semantics and against the local JAX shards
(bytes and addresses), a DTensor all-gather (relayout to replicated) against
the global JAX value from `process_allgather`, and the round trip back.
Then, on `jax.make_mesh`'s default mesh (Explicit axes), an Auto one and a
mixed one over both processes, variables are created under our rules
(eagerly, by `fdt.init` with the `nnx.Rngs` passed, by `fdt.init` of a
closure): each placed by the rules, with an unsharded build's values.
"""

from support import multiprocess_util

multiprocess_util.initialize_jax()

# ruff: noqa: E402
import jax
import numpy as np
import pytest
from flax import nnx
from jax.experimental import multihost_utils
from support import creation_values

import flax_dtensor as fdt
from flax_dtensor import dtensor as fdt_dtensor

P = jax.sharding.PartitionSpec
NamedSharding = jax.sharding.NamedSharding


def _bits(a) -> bytes:
  return np.ascontiguousarray(np.asarray(a)).tobytes()


def _address(a) -> int:
  return np.asarray(a).__array_interface__['data'][0]


def main() -> None:
  assert jax.process_count() == 2, jax.process_count()
  assert jax.device_count() == 8 and jax.local_device_count() == 4
  fdt_dtensor.initialize()
  fdt_dtensor.initialize()  # A no-op.
  import tensorflow as tf

  dtensor = tf.experimental.dtensor
  assert dtensor.num_clients() == 2
  assert dtensor.client_id() == jax.process_index()

  me = jax.process_index()
  local = sorted(jax.local_devices(), key=lambda d: d.id)
  devices = np.array(jax.devices(), dtype=object)
  assert {d.process_index for d in devices[:4]} == {0}, devices
  meshes = {
    # Process p holds row p.
    'rows': devices.reshape(2, 4),
    # Each process holds 2 positions of each row.
    'transposed': devices.reshape(4, 2).T,
    'reversed': devices[::-1].reshape(2, 4),
    # Columns alternate between the processes.
    'interleaved': devices[[0, 4, 1, 5, 6, 2, 7, 3]].reshape(2, 4),
  }
  specs = [
    P('data', 'model'),
    P('model', 'data'),
    P(('data', 'model')),
    P(('model', 'data')),
    P(('model', 'data'), None),
    P('data'),
    P(None, 'model'),
    P(),
  ]
  rng = np.random.default_rng(0)  # The same values in every process.
  x = rng.standard_normal((8, 16)).astype(np.float32)
  checks = 0
  all_meshes = [
    (name, jax.sharding.Mesh(grid, ('data', 'model')))
    for name, grid in meshes.items()
  ]
  all_meshes.append(('make_mesh', jax.make_mesh((2, 4), ('data', 'model'))))
  for mesh_name, mesh in all_meshes:
    dmesh = fdt_dtensor.mesh_to_dtensor(mesh)
    assert sorted(dmesh.local_device_ids()) == sorted(
      p for p, d in enumerate(mesh.devices.flat) if d.process_index == me
    ), (mesh_name, dmesh.local_device_ids())
    for spec in specs:
      where = f'{mesh_name} {spec}'
      sharding = NamedSharding(mesh, spec)
      arr = jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])
      global_value = multihost_utils.process_allgather(arr, tiled=True)
      np.testing.assert_array_equal(global_value, x, err_msg=where)

      t = fdt_dtensor.array_to_dtensor(arr)
      layout = dtensor.fetch_layout(t)
      components = dtensor.unpack(t)
      shards = {s.device: s for s in arr.addressable_shards}
      assert len(components) == len(shards) == 4, where
      offsets = layout.offset_to_shard()
      for position, component in zip(
        layout.mesh.local_device_ids(), components, strict=True
      ):
        # TF's layout semantics: the slice this mesh position holds.
        index = tuple(
          slice(
            c * (n // layout.num_shards(d)),
            (c + 1) * (n // layout.num_shards(d)),
          )
          for d, (c, n) in enumerate(
            zip(offsets[position], x.shape, strict=True)
          )
        )
        assert _bits(component._numpy()) == _bits(x[index]), where
        # And the JAX shard on the device TF's CPU:k stands for, zero-copy.
        spec_k = tf.DeviceSpec.from_string(component.device)
        assert spec_k.task == me and spec_k.job == 'worker', component.device
        shard = shards[local[spec_k.device_index]]
        assert _address(component._numpy()) == _address(shard.data), where

      # A DTensor all-gather across both processes.
      replicated = dtensor.relayout(
        t, dtensor.Layout.replicated(layout.mesh, layout.rank)
      )
      for c in dtensor.unpack(replicated):
        np.testing.assert_array_equal(c.numpy(), global_value, err_msg=where)
      np.testing.assert_allclose(
        float(tf.reduce_sum(t)), float(x.sum()), rtol=1e-5, err_msg=where
      )

      back = fdt_dtensor.dtensor_to_array(t)
      assert back.sharding.mesh == mesh, where
      assert back.sharding.is_equivalent_to(sharding, 2), where
      for s in back.addressable_shards:
        assert s.index == shards[s.device].index, where
        assert _bits(s.data) == _bits(x[s.index]), where
      np.testing.assert_array_equal(
        multihost_utils.process_allgather(back, tiled=True), x, err_msg=where
      )
      checks += 1

  checks += _creation_checks()

  # A mesh of the other process's devices only: no part for this process.
  others = [d for d in devices if d.process_index != me]
  with pytest.raises(fdt.DTensorError, match=r'at least one of this process'):
    fdt_dtensor.mesh_to_dtensor(jax.sharding.Mesh(np.array(others), ('x',)))

  # TF cannot shut DTensor down in multi-client mode.
  with pytest.raises(
    fdt.DTensorInitializationError,
    match=r'cannot be shut down in multi-client mode.*got 2 clients',
  ):
    fdt_dtensor.shutdown()
  assert fdt_dtensor.is_initialized()

  # Leave together: no process exits while the other still gathers.
  multihost_utils.sync_global_devices('done')
  print(f'WORKER OK process={me} checks={checks}', flush=True)


class _Block(nnx.Module):
  """Two annotated layers and the nnx.Rngs they were built with."""

  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    up = nnx.with_partitioning(init, ('embed', 'mlp'))
    down = nnx.with_partitioning(init, ('mlp', 'embed'))
    self.up = nnx.Linear(16, 32, kernel_init=up, rngs=rngs)
    self.down = nnx.Linear(32, 16, kernel_init=down, rngs=rngs)
    self.rngs = rngs


def _creation_checks() -> int:
  """Variables created under our rules on meshes over both processes."""
  rules = [('embed', 'data'), ('mlp', 'model')]
  with nnx.use_eager_sharding(False):
    want = {
      k: np.asarray(v.get_value())
      for k, v in nnx.to_flat_state(nnx.state(_Block(nnx.Rngs(3)), nnx.Param))
    }
  axis_types = jax.sharding.AxisType
  meshes = {
    'make_mesh': jax.make_mesh((2, 4), ('data', 'model')),
    'Auto': jax.make_mesh(
      (2, 4), ('data', 'model'), axis_types=(axis_types.Auto,) * 2
    ),
    'mixed': jax.make_mesh(
      (2, 4),
      ('data', 'model'),
      axis_types=(axis_types.Explicit, axis_types.Auto),
    ),
  }
  builds = {
    'eager': lambda: _Block(nnx.Rngs(3)),
    'fdt.init, rngs passed': lambda: fdt.init(_Block, nnx.Rngs(3)),
    'fdt.init of a closure': lambda: fdt.init(lambda: _Block(nnx.Rngs(3))),
  }
  specs = {
    ('up', 'kernel'): P('data', 'model'),
    ('down', 'kernel'): P('model', 'data'),
  }
  checks = 0
  for mesh_name, mesh in meshes.items():
    for how, build in builds.items():
      where = f'{mesh_name}, {how}'
      with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
        block = build()
      got = dict(nnx.to_flat_state(nnx.state(block, nnx.Param)))
      assert sorted(got) == sorted(want), where
      for path, variable in got.items():
        value = variable.get_value()
        assert value.sharding.mesh == mesh, (where, path)
        if path in specs:
          assert value.sharding.spec == specs[path], (where, path)
        creation_values.assert_close(
          multihost_utils.process_allgather(value, tiled=True),
          want[path],
          err_msg=f'{where} {path}',
        )
      # The model's nnx.Rngs stay usable, on the caller's mesh.
      key = block.rngs.params()
      assert key.sharding.mesh == mesh, where
      checks += 1
  return checks


if __name__ == '__main__':
  main()
