"""Tests of flax_dtensor.dtensor's JAX <-> TF DTensor bridge (topology, layouts, arrays).

Real TensorFlow and real JAX on 8 virtual CPU devices, no mocks. Every
conversion is checked by values: a DTensor relayout to replicated (a TF
all-gather) must give back the JAX array, and each DTensor component must be,
byte for byte and address for address, the JAX shard on the JAX device that
TF's logical CPU device stands for. Tests that need a fresh process
(initialization errors, shutdown) run in subprocesses.
"""

import re
import textwrap

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from support import processes, profiles, warm

tf = pytest.importorskip('tensorflow')

import flax_dtensor as fdt  # noqa: E402
from flax_dtensor import dtensor as fdt_dtensor  # noqa: E402
from flax_dtensor.dtensor._layout import _topology  # noqa: E402

dtensor = tf.experimental.dtensor
P = jax.sharding.PartitionSpec
NamedSharding = jax.sharding.NamedSharding
AxisType = jax.sharding.AxisType


# ---------------------------------------------------------------------------
# Helpers.
# ---------------------------------------------------------------------------


def _devices():
  return np.array(jax.devices(), dtype=object)


MESH_BUILDERS = {
  'identity': lambda: jax.sharding.Mesh(
    _devices().reshape(2, 4), ('data', 'model')
  ),
  'reversed': lambda: jax.sharding.Mesh(
    _devices()[::-1].reshape(2, 4), ('data', 'model')
  ),
  'transposed': lambda: jax.sharding.Mesh(
    _devices().reshape(4, 2).T, ('data', 'model')
  ),
  'shuffled': lambda: jax.sharding.Mesh(
    _devices()[[5, 2, 7, 0, 3, 6, 1, 4]].reshape(2, 4), ('data', 'model')
  ),
  'make_mesh_explicit': lambda: jax.make_mesh(
    (2, 4), ('data', 'model'), axis_types=(AxisType.Explicit,) * 2
  ),
  'make_mesh_auto': lambda: jax.make_mesh(
    (2, 4), ('data', 'model'), axis_types=(AxisType.Auto,) * 2
  ),
}

SPECS = {
  'data,model': P('data', 'model'),
  'model,data': P('model', 'data'),
  '(data,model)': P(('data', 'model')),
  '(model,data)': P(('model', 'data')),
  '(data,model),None': P(('data', 'model'), None),
  'None,(model,data)': P(None, ('model', 'data')),
  'data,None': P('data', None),
  'data': P('data'),
  'None,model': P(None, 'model'),
  'model': P('model'),
  'replicated': P(),
}


def _strip(spec):
  """A PartitionSpec without trailing Nones (JAX's canonical form)."""
  entries = list(spec)
  while entries and entries[-1] is None:
    entries.pop()
  return tuple(entries)


def _address(a: np.ndarray) -> int:
  return a.__array_interface__['data'][0]


def _gather(t):
  """The global value of a DTensor, gathered by TF (relayout to replicated)."""
  layout = dtensor.fetch_layout(t)
  replicated = dtensor.relayout(
    t, dtensor.Layout.replicated(layout.mesh, layout.rank)
  )
  components = dtensor.unpack(replicated)
  for c in components[1:]:
    _assert_values_equal(c.numpy(), components[0].numpy())
  return components[0].numpy()


def _local_jax_device(tf_device: str):
  """The JAX device that a TF logical CPU device stands for."""
  k = tf.DeviceSpec.from_string(tf_device).device_index
  return sorted(jax.local_devices(), key=lambda d: d.id)[k]


def _assert_values_equal(actual, expected):
  """Equal dtypes and values (NaN == NaN, -0.0 == 0.0), any dtype."""
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.dtype == expected.dtype
  if actual.dtype.kind == 'V':  # ml_dtypes (bfloat16, float8): exact in f32.
    actual, expected = actual.astype(np.float32), expected.astype(np.float32)
  np.testing.assert_array_equal(actual, expected, strict=True)


def _bits(a) -> bytes:
  return np.ascontiguousarray(np.asarray(a)).tobytes()


def check_array_to_dtensor(arr: jax.Array, *, zero_copy: bool = True):
  """Converts `arr` and checks the DTensor by values, shards and addresses."""
  expected = np.asarray(arr)
  t = fdt_dtensor.array_to_dtensor(arr)
  assert tuple(t.shape) == arr.shape
  assert np.dtype(t.dtype.as_numpy_dtype) == arr.dtype
  layout = dtensor.fetch_layout(t)
  # Each component is the JAX shard living on the JAX device that its TF
  # device stands for: same bytes and, on CPU, the same buffer.
  components = dtensor.unpack(t)
  shards = {s.device: s for s in arr.addressable_shards}
  assert len(components) == len(shards)
  for component in components:
    shard = shards[_local_jax_device(component.device)]
    shard_np = np.asarray(shard.data)
    assert component.shape == shard_np.shape
    assert _bits(component._numpy()) == _bits(shard_np)
    # (TF returns NumPy scalars, copies, for rank-0 components.)
    if zero_copy and arr.ndim:
      assert _address(component._numpy()) == _address(shard_np)
  # TF's own gather agrees with JAX's global value (by value: TF's all-gather
  # sums zero-padded pieces, so -0.0 comes back as 0.0).
  # Each component holds the slice that TF's own layout semantics
  # (Layout.offset_to_shard) assign to its mesh position.
  for position, component in zip(
    layout.mesh.local_device_ids(), components, strict=True
  ):
    shard_coords = layout.offset_to_shard()[position]
    index = tuple(
      slice(
        c * (n // layout.num_shards(d)), (c + 1) * (n // layout.num_shards(d))
      )
      for d, (c, n) in enumerate(zip(shard_coords, arr.shape, strict=True))
    )
    assert _bits(component._numpy()) == _bits(expected[index])
  if not t.dtype.name.startswith('float8'):  # TF has no float8 kernels.
    _assert_values_equal(_gather(t), expected)
  return t, layout


def check_round_trip(arr: jax.Array, t, *, zero_copy: bool = True):
  """Checks dtensor_to_array(t) == arr: values, sharding, shard placement."""
  back = fdt_dtensor.dtensor_to_array(t)
  assert back.shape == arr.shape and back.dtype == arr.dtype
  assert _bits(back) == _bits(arr)
  if isinstance(arr.sharding, NamedSharding):
    assert back.sharding.mesh == arr.sharding.mesh
    assert _strip(back.sharding.spec) == _strip(arr.sharding.spec)
  else:
    assert back.sharding == arr.sharding
  assert back.sharding.is_equivalent_to(arr.sharding, arr.ndim)
  original = {s.device: s for s in arr.addressable_shards}
  for shard in back.addressable_shards:
    assert shard.index == original[shard.device].index
    assert _bits(shard.data) == _bits(original[shard.device].data)
    if zero_copy and arr.ndim:
      assert shard.data.unsafe_buffer_pointer() == (
        original[shard.device].data.unsafe_buffer_pointer()
      )
  return back


def _values(shape, dtype, seed=0):
  """Distinct values of `dtype`, with NaN/inf/-0.0 for floating types."""
  rng = np.random.default_rng(seed)
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return rng.integers(0, 2, size=shape).astype(np.bool_)
  if np.issubdtype(dtype, np.integer):
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, endpoint=True).astype(
      dtype
    )
  x = rng.standard_normal(shape).astype(np.float32) * 100
  flat = x.reshape(-1)
  if flat.size >= 4:
    flat[:4] = [np.nan, np.inf, -np.inf, -0.0]
  return x.astype(dtype)


# ---------------------------------------------------------------------------
# Initialization.
# ---------------------------------------------------------------------------


def test_initialize_twice_is_a_no_op():
  before = fdt_dtensor.mesh_to_dtensor(MESH_BUILDERS['identity']())
  fdt_dtensor.initialize()
  assert fdt_dtensor.is_initialized()
  assert fdt_dtensor.mesh_to_dtensor(MESH_BUILDERS['identity']()) is before
  assert dtensor.num_local_devices('CPU') == jax.local_device_count() == 8


def _run_python(
  script: str, *, env: dict[str, str] | None = None, imports: bool = False
):
  """Runs `script` in a fresh process with 8 CPU devices; returns stdout.

  A fork of the warm pool (DTensor and TF's runtime not yet started), or,
  where what importing does is the subject (`imports`), a new Python.
  """
  child_env = processes.clean_env(
    XLA_FLAGS='--xla_force_host_platform_device_count=8',
    TF_CPP_MIN_LOG_LEVEL='2',
    **(env or {}),
  )
  code = _CHILD_PRELUDE + textwrap.dedent(script)
  kwargs = {'env': child_env, 'cwd': processes.REPO_ROOT, 'timeout': 240}
  if imports:
    result = processes.run_python('-c', code, **kwargs)
  else:
    result = warm.shared().run_code(code, **kwargs)
  if result.returncode != 0 or 'CHILD OK' not in result.stdout:
    pytest.fail(
      f'child process failed (exit {result.returncode})\n'
      f'--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}'
    )
  return result.stdout


# Shared by the subprocess tests: a value check that needs no pytest.
_CHILD_PRELUDE = textwrap.dedent("""\
  import os
  import sys

  import jax
  import numpy as np
  import pytest

  def check_values(fdt_dtensor):
    from tensorflow.experimental import dtensor
    devices = np.array(jax.devices())[::-1].reshape(2, 4)
    mesh = jax.sharding.Mesh(devices, ('data', 'model'))
    x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    sharding = jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(('model', 'data')))
    arr = jax.device_put(x, sharding)
    t = fdt_dtensor.array_to_dtensor(arr)
    layout = dtensor.fetch_layout(t)
    replicated = dtensor.relayout(
      t, dtensor.Layout.replicated(layout.mesh, 2))
    np.testing.assert_array_equal(dtensor.unpack(replicated)[0].numpy(), x)
    back = fdt_dtensor.dtensor_to_array(t)
    np.testing.assert_array_equal(np.asarray(back), x)
    assert back.sharding == sharding, back.sharding
""")


def test_lifecycle_in_fresh_process():
  """No TF import on import; errors before init; init/shutdown/re-init."""
  _run_python(
    imports=True,
    script="""
    import flax_dtensor
    import flax_dtensor.dtensor as fdt_dtensor
    assert 'tensorflow' not in sys.modules
    assert not fdt_dtensor.is_initialized()
    assert 'tensorflow' not in sys.modules

    # TF missing: the install hint, only when a function runs.
    sys.modules['tensorflow'] = None
    with pytest.raises(ImportError, match=r'pip install "flax-dtensor\\[tf\\]"'):
      fdt_dtensor.initialize()
    del sys.modules['tensorflow']

    # The bridge before initialize(): a clear error, still no TF import.
    mesh = jax.make_mesh((2, 4), ('data', 'model'))
    arr = jax.device_put(
      np.ones((8, 4), np.float32), jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec('data')))
    match = r'not initialized.*Call it once per process, before any other'
    err = flax_dtensor.DTensorInitializationError
    with pytest.raises(err, match=match):
      fdt_dtensor.mesh_to_dtensor(mesh)
    with pytest.raises(err, match=match):
      fdt_dtensor.layout_for(arr.sharding, 2)
    with pytest.raises(err, match=match):
      fdt_dtensor.array_to_dtensor(arr)
    with pytest.raises(err, match=match):
      fdt_dtensor.dtensor_to_array(None)
    with pytest.raises(err, match=r'shutdown\\(\\) was called but TF DTensor is not'):
      fdt_dtensor.shutdown()
    assert 'tensorflow' not in sys.modules

    fdt_dtensor.initialize()
    fdt_dtensor.initialize()  # A no-op.
    assert fdt_dtensor.is_initialized()
    check_values(fdt_dtensor)

    fdt_dtensor.shutdown()
    assert not fdt_dtensor.is_initialized()
    with pytest.raises(err, match=match):
      fdt_dtensor.mesh_to_dtensor(mesh)
    with pytest.raises(err, match=r'not initialized'):
      fdt_dtensor.shutdown()

    fdt_dtensor.initialize()
    check_values(fdt_dtensor)
    print('CHILD OK')
  """,
  )


def test_initialize_after_tf_already_ran():
  _run_python("""
    import tensorflow as tf
    import flax_dtensor
    import flax_dtensor.dtensor as fdt_dtensor

    tf.constant(1.0) + 1.0  # TF initializes its context here.
    with pytest.raises(
        flax_dtensor.DTensorInitializationError,
        match=r'TensorFlow was already initialized.*'
              r'flax_dtensor\\.dtensor\\.initialize\\(\\) first thing.*'
              r'reset_context=True'):
      fdt_dtensor.initialize()
    assert not fdt_dtensor.is_initialized()

    fdt_dtensor.initialize(reset_context=True)
    assert fdt_dtensor.is_initialized()
    check_values(fdt_dtensor)
    print('CHILD OK')
  """)


def test_initialize_checks_clients_and_devices():
  _run_python("""
    import flax_dtensor
    import flax_dtensor.dtensor as fdt_dtensor
    err = flax_dtensor.DTensorInitializationError

    # Two DTensor clients for one JAX process.
    os.environ['DTENSOR_JOBS'] = '127.0.0.1:1,127.0.0.1:2'
    with pytest.raises(
        err, match=r"expected 1 DTensor client\\(s\\) and client id 0 .* got 2 "
                   r"client\\(s\\) from DTENSOR_JOBS='127.0.0.1:1,127.0.0.1:2'"
                   r".*DTENSOR_CLIENT_ID.*DTENSOR_JOB_NAME"):
      fdt_dtensor.initialize()
    # A client id that is not jax.process_index().
    os.environ['DTENSOR_JOBS'] = '127.0.0.1:1'
    os.environ['DTENSOR_CLIENT_ID'] = '1'
    with pytest.raises(err, match=r"client id 0 .* got 1 client\\(s\\) .* "
                                  r"client id '1' from DTENSOR_CLIENT_ID"):
      fdt_dtensor.initialize()
    os.environ['DTENSOR_CLIENT_ID'] = 'zero'
    with pytest.raises(err, match=r"client id 'zero' from DTENSOR_CLIENT_ID"):
      fdt_dtensor.initialize()
    del os.environ['DTENSOR_CLIENT_ID']
    os.environ['DTENSOR_JOBS'] = ''
    with pytest.raises(err, match=r"DTENSOR_JOBS is set but empty.*got ''"):
      fdt_dtensor.initialize()
    del os.environ['DTENSOR_JOBS']
    assert not fdt_dtensor.is_initialized()

    # DTensor set up by other code with 4 devices while JAX has 8.
    from tensorflow.experimental import dtensor
    dtensor.initialize_accelerator_system(
      device_type='CPU', num_logical_cpu_devices=4)
    match = r'one logical CPU device per local JAX device: expected 8 .* got 4'
    with pytest.raises(err, match=match):
      fdt_dtensor.initialize()
    with pytest.raises(err, match=match):
      fdt_dtensor.mesh_to_dtensor(jax.make_mesh((8,), ('x',)))
    dtensor.shutdown_accelerator_system()

    # DTensor set up by other code, then the environment says 2 clients.
    dtensor.initialize_accelerator_system(
      device_type='CPU', num_logical_cpu_devices=8)
    os.environ['DTENSOR_JOBS'] = '127.0.0.1:1,127.0.0.1:2'
    with pytest.raises(err, match=r'one client per JAX process: expected 1 '
                                  r'client\\(s\\) and client id 0, got 2'):
      fdt_dtensor.initialize()
    del os.environ['DTENSOR_JOBS']
    fdt_dtensor.initialize()  # Adopts the matching DTensor setup.
    check_values(fdt_dtensor)
    print('CHILD OK')
  """)


# ---------------------------------------------------------------------------
# Meshes.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize('name', list(MESH_BUILDERS), ids=list(MESH_BUILDERS))
def test_mesh_to_dtensor_ids_are_positions(name):
  mesh = MESH_BUILDERS[name]()
  dmesh = fdt_dtensor.mesh_to_dtensor(mesh)
  assert list(dmesh.dim_names) == ['data', 'model']
  assert list(dmesh.shape()) == [2, 4]
  np.testing.assert_array_equal(
    dmesh.global_device_ids(), np.arange(8).reshape(2, 4)
  )
  # Local device i of the DTensor mesh is the JAX device at mesh position
  # local_device_ids[i].
  assert list(dmesh.local_device_ids()) == list(range(8))
  for position, tf_device in zip(
    dmesh.local_device_ids(), dmesh.local_devices(), strict=True
  ):
    assert _local_jax_device(tf_device) == mesh.devices.flat[position]
  assert fdt_dtensor.mesh_to_dtensor(mesh) is dmesh  # Cached.


def test_mesh_to_dtensor_size_one_axes():
  mesh = jax.sharding.Mesh(
    _devices()[::-1].reshape(1, 2, 4), ('stage', 'data', 'model')
  )
  dmesh = fdt_dtensor.mesh_to_dtensor(mesh)
  assert list(dmesh.dim_names) == ['stage', 'data', 'model']
  assert list(dmesh.shape()) == [1, 2, 4]


def test_mesh_over_a_subset_of_devices():
  mesh = jax.sharding.Mesh(_devices()[[6, 1, 3]], ('x',))
  x = jnp.arange(12.0).reshape(3, 4)
  arr = jax.device_put(x, NamedSharding(mesh, P('x')))
  t, _ = check_array_to_dtensor(arr)
  check_round_trip(arr, t)


# ---------------------------------------------------------------------------
# Layouts.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
  ('spec', 'dim_names', 'shape', 'specs'),
  [
    (P('data', 'model'), ['data', 'model'], [2, 4], ['data', 'model']),
    (P('model', 'data'), ['data', 'model'], [2, 4], ['model', 'data']),
    (P(('data', 'model')), ['data+model'], [8], ['data+model', 'unsharded']),
    (P(('model', 'data')), ['model+data'], [8], ['model+data', 'unsharded']),
    (
      P(None, ('model', 'data')),
      ['model+data'],
      [8],
      ['unsharded', 'model+data'],
    ),
    (P('data'), ['data', 'model'], [2, 4], ['data', 'unsharded']),
    (P(None, 'model'), ['data', 'model'], [2, 4], ['unsharded', 'model']),
    (P(), ['data', 'model'], [2, 4], ['unsharded', 'unsharded']),
  ],
  ids=[
    'data,model',
    'model,data',
    '(data,model)',
    '(model,data)',
    'None,(model,data)',
    'data',
    'None,model',
    'replicated',
  ],
)
def test_layout_for(spec, dim_names, shape, specs):
  mesh = MESH_BUILDERS['reversed']()
  layout = fdt_dtensor.layout_for(NamedSharding(mesh, spec), 2)
  assert list(layout.mesh.dim_names) == dim_names
  assert list(layout.mesh.shape()) == shape
  assert list(layout.sharding_specs) == specs


def test_layout_for_fused_axes_orders_devices_row_major():
  """P(('model', 'data')): position p is device devices.T.flat[p]."""
  mesh = MESH_BUILDERS['shuffled']()
  for spec, grid in [
    (P(('data', 'model')), mesh.devices),
    (P(('model', 'data')), mesh.devices.T),
  ]:
    dmesh = fdt_dtensor.layout_for(NamedSharding(mesh, spec), 1).mesh
    for position, tf_device in zip(
      dmesh.local_device_ids(), dmesh.local_devices(), strict=True
    ):
      assert _local_jax_device(tf_device) == grid.flat[position]


def test_layout_for_three_axes_mixed_fusion():
  mesh = jax.sharding.Mesh(_devices()[::-1].reshape(2, 2, 2), ('x', 'y', 'z'))
  layout = fdt_dtensor.layout_for(NamedSharding(mesh, P(('z', 'x'), None)), 3)
  assert list(layout.mesh.dim_names) == ['z+x', 'y']
  assert list(layout.sharding_specs) == ['z+x', 'unsharded', 'unsharded']


def test_layout_for_single_device():
  layout = fdt_dtensor.layout_for(
    jax.sharding.SingleDeviceSharding(jax.devices()[3]), 2
  )
  assert list(layout.mesh.dim_names) == ['single_device']
  assert list(layout.sharding_specs) == ['unsharded', 'unsharded']
  (tf_device,) = layout.mesh.local_devices()
  assert _local_jax_device(tf_device) == jax.devices()[3]


# ---------------------------------------------------------------------------
# Arrays: layouts checked by values, zero-copy, round trip.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize('spec_id', list(SPECS), ids=list(SPECS))
@pytest.mark.parametrize(
  'mesh_id', list(MESH_BUILDERS), ids=list(MESH_BUILDERS)
)
def test_array_round_trip(mesh_id, spec_id):
  mesh = MESH_BUILDERS[mesh_id]()
  x = _values((8, 16), np.float32, seed=1)
  arr = jax.device_put(x, NamedSharding(mesh, SPECS[spec_id]))
  t, _ = check_array_to_dtensor(arr)
  assert float(tf.reduce_sum(tf.where(tf.math.is_finite(t), t, 0.0))) == (
    pytest.approx(float(np.sum(np.where(np.isfinite(x), x, 0.0))), rel=1e-5)
  )
  check_round_trip(arr, t)


@pytest.mark.parametrize(
  'spec',
  [
    P('stage', 'data'),
    P(('stage', 'model'), 'data'),
    P('data', ('model', 'stage')),
    P(('data', 'stage', 'model')),
    P(None, ('model', 'data')),
    P('model'),
    P(),
  ],
  ids=str,
)
def test_size_one_mesh_axes(spec):
  mesh = jax.sharding.Mesh(
    _devices()[[3, 0, 6, 5, 2, 7, 1, 4]].reshape(1, 2, 4),
    ('stage', 'data', 'model'),
  )
  x = _values((8, 8), np.float32, seed=2)
  arr = jax.device_put(x, NamedSharding(mesh, spec))
  t, _ = check_array_to_dtensor(arr)
  check_round_trip(arr, t)


@pytest.mark.parametrize(
  'spec',
  [P(('z', 'x'), 'y'), P('y', ('x', 'z')), P(None, ('y', 'z', 'x')), P('z')],
  ids=str,
)
def test_three_axis_mesh(spec):
  mesh = jax.sharding.Mesh(
    _devices().reshape(2, 4).T.reshape(2, 2, 2), ('x', 'y', 'z')
  )
  x = _values((8, 8), np.float32, seed=3)
  arr = jax.device_put(x, NamedSharding(mesh, spec))
  t, _ = check_array_to_dtensor(arr)
  check_round_trip(arr, t)


DTYPES = {
  'float32': np.float32,
  'bfloat16': ml_dtypes.bfloat16,
  'float16': np.float16,
  'int8': np.int8,
  'uint8': np.uint8,
  'int16': np.int16,
  'int32': np.int32,
  'uint32': np.uint32,
  'bool': np.bool_,
  'complex64': np.complex64,
  'float8_e4m3fn': ml_dtypes.float8_e4m3fn,
}


@pytest.mark.parametrize('dtype_id', list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize(
  'spec', [P('model', 'data'), P(('model', 'data'))], ids=str
)
def test_dtypes(dtype_id, spec):
  dtype = DTYPES[dtype_id]
  mesh = MESH_BUILDERS['reversed']()
  x = _values((8, 16), dtype, seed=4)
  arr = jax.device_put(x, NamedSharding(mesh, spec))
  assert arr.dtype == np.dtype(dtype)
  t, _ = check_array_to_dtensor(arr)
  assert t.dtype == tf.as_dtype(np.dtype(dtype))
  check_round_trip(arr, t)


@pytest.mark.parametrize('dtype_id', ['float32', 'bfloat16', 'int32', 'bool'])
def test_scalars(dtype_id):
  dtype = DTYPES[dtype_id]
  value = np.asarray(_values((1,), dtype, seed=5)[0])
  for sharding in [
    NamedSharding(MESH_BUILDERS['reversed'](), P()),
    jax.sharding.SingleDeviceSharding(jax.devices()[5]),
  ]:
    arr = jax.device_put(value, sharding)
    assert arr.ndim == 0
    t, layout = check_array_to_dtensor(arr)
    assert list(layout.sharding_specs) == []
    check_round_trip(arr, t)


def test_single_device():
  x = _values((6, 5), np.float32, seed=6)
  arr = jax.device_put(x, jax.devices()[3])
  t, _ = check_array_to_dtensor(arr)
  (component,) = dtensor.unpack(t)
  assert tf.DeviceSpec.from_string(component.device).device_index == 3
  back = check_round_trip(arr, t)
  assert back.sharding == jax.sharding.SingleDeviceSharding(jax.devices()[3])


def test_zero_size_array():
  mesh = MESH_BUILDERS['reversed']()
  arr = jax.device_put(np.zeros((0, 8), np.float32), NamedSharding(mesh, P()))
  t = fdt_dtensor.array_to_dtensor(arr)
  assert tuple(t.shape) == (0, 8)
  back = fdt_dtensor.dtensor_to_array(t)
  assert back.shape == (0, 8)
  assert back.sharding.mesh == mesh


def test_jit_output_and_explicit_mesh_types():
  mesh = MESH_BUILDERS['make_mesh_explicit']()
  arr = jax.device_put(
    _values((8, 16), np.float32, seed=7), NamedSharding(mesh, P('data'))
  )
  out = jax.jit(lambda a: a * 2)(arr)
  t, _ = check_array_to_dtensor(out)
  back = check_round_trip(out, t)
  assert back.sharding.mesh.axis_types == (AxisType.Explicit,) * 2


@hypothesis.settings(
  max_examples=profiles.examples(150),
  deadline=None,
  derandomize=True,
  database=None,
)
@hypothesis.given(
  perm=st.permutations(range(8)),
  shape=st.sampled_from([(8,), (2, 4), (4, 2), (2, 2, 2), (1, 8), (8, 1)]),
  rank=st.integers(1, 3),
  dtype=st.sampled_from(['float32', 'bfloat16', 'int8', 'uint32', 'bool']),
  data=st.data(),
)
def test_random_meshes_device_orders_and_layouts(
  perm, shape, rank, dtype, data
):
  """Round trips by values over random meshes, device orders and layouts.

  Each array dimension takes a random group of mesh axes (possibly fused,
  possibly none); the DTensor is checked against the JAX array by a TF
  all-gather, and converted back bit-exact, also onto another device
  order.
  """
  names = ('a', 'b', 'c')[: len(shape)]
  mesh = jax.sharding.Mesh(_devices()[list(perm)].reshape(shape), names)
  axes = data.draw(st.permutations(names))
  cuts = sorted(
    data.draw(st.lists(st.integers(0, len(axes)), min_size=rank, max_size=rank))
  )
  groups, start = [], 0
  for cut in cuts:
    groups.append(tuple(axes[start:cut]))
    start = cut
  spec = P(*(g or None for g in groups))
  dims = tuple(8 * data.draw(st.integers(1, 2)) for _ in range(rank))
  x = _values(dims, dtype, seed=data.draw(st.integers(0, 2**16)))
  arr = jax.device_put(x, NamedSharding(mesh, spec))
  t, _ = check_array_to_dtensor(arr)
  check_round_trip(arr, t)
  # Onto another device order with the same partitioning: the components
  # are matched to the new shards by slice.
  shuffled = jax.sharding.Mesh(
    _devices()[list(reversed(perm))].reshape(shape), names
  )
  back = fdt_dtensor.dtensor_to_array(t, sharding=NamedSharding(shuffled, spec))
  assert back.sharding.mesh == shuffled
  assert _bits(back) == _bits(x)


def test_zero_copy_both_ways():
  """Components alias the JAX buffers; the way back aliases the TF ones."""
  mesh = MESH_BUILDERS['transposed']()
  arr = jax.device_put(
    _values((64, 32), np.float32, seed=8), NamedSharding(mesh, P('model'))
  )
  t = fdt_dtensor.array_to_dtensor(arr)
  shards = {s.device: s for s in arr.addressable_shards}
  tf_addresses = {}
  for c in dtensor.unpack(t):
    device = _local_jax_device(c.device)
    tf_addresses[device] = _address(c._numpy())
    assert tf_addresses[device] == shards[device].data.unsafe_buffer_pointer()
  back = fdt_dtensor.dtensor_to_array(t)
  for s in back.addressable_shards:
    assert s.data.unsafe_buffer_pointer() == tf_addresses[s.device]


def test_tf_writes_do_not_change_jax_arrays():
  """DVariable writes are copy-on-write: no JAX array sees them."""
  mesh = MESH_BUILDERS['reversed']()
  x = _values((8, 16), np.float32, seed=9)
  arr = jax.device_put(x, NamedSharding(mesh, P('data', 'model')))
  variable = dtensor.DVariable(fdt_dtensor.array_to_dtensor(arr))
  read_back = fdt_dtensor.dtensor_to_array(variable)
  assert _bits(read_back) == _bits(x)
  variable.assign_add(fdt_dtensor.array_to_dtensor(jnp.ones_like(arr)))
  variable.assign(variable * 3.0)
  assert _bits(arr) == _bits(x)
  assert _bits(read_back) == _bits(x)
  expected = (x + 1) * 3
  assert _bits(fdt_dtensor.dtensor_to_array(variable)) == _bits(expected)
  np.testing.assert_array_equal(_gather(variable.read_value()), expected)


def test_jax_donation_and_deletion_do_not_change_dtensors():
  mesh = MESH_BUILDERS['shuffled']()
  x = _values((8, 16), np.float32, seed=10)
  arr = jax.device_put(x, NamedSharding(mesh, P(('model', 'data'))))
  t = fdt_dtensor.array_to_dtensor(arr)
  back = fdt_dtensor.dtensor_to_array(t)
  add_one = jax.jit(lambda a: a + 1, donate_argnums=0)
  add_one(back).block_until_ready()
  add_one(arr).block_until_ready()
  arr2 = jax.device_put(x * 2, NamedSharding(mesh, P('data')))
  t2 = fdt_dtensor.array_to_dtensor(arr2)
  arr2.delete()
  # Reuse freed memory, if any was freed.
  _ = [jax.device_put(np.full((8, 16), 7.0, np.float32), arr.sharding)] * 8
  np.testing.assert_array_equal(_gather(t), x, strict=True)
  np.testing.assert_array_equal(_gather(t2), x * 2, strict=True)


def test_tf_computation_matches_jax():
  mesh = MESH_BUILDERS['shuffled']()
  a = jax.device_put(
    _values((8, 16), np.float32, seed=11) / 1e3, NamedSharding(mesh, P('data'))
  )
  b = jax.device_put(
    _values((16, 4), np.float32, seed=12) / 1e3,
    NamedSharding(mesh, P(None, 'model')),
  )
  ta, tb = fdt_dtensor.array_to_dtensor(a), fdt_dtensor.array_to_dtensor(b)
  np.testing.assert_allclose(
    _gather(tf.matmul(ta, tb)), np.asarray(a @ b), rtol=1e-5, atol=1e-6
  )
  np.testing.assert_allclose(
    float(tf.reduce_sum(ta)), float(jnp.sum(a)), rtol=1e-5
  )


# ---------------------------------------------------------------------------
# dtensor_to_array with an explicit mesh or sharding.
# ---------------------------------------------------------------------------


def test_dtensor_to_array_with_mesh():
  mesh = MESH_BUILDERS['reversed']()
  x = _values((8, 16), np.float32, seed=13)
  arr = jax.device_put(x, NamedSharding(mesh, P(('model', 'data'), None)))
  t = fdt_dtensor.array_to_dtensor(arr)
  # Another mesh with the same axis names, other device order.
  other = MESH_BUILDERS['identity']()
  back = fdt_dtensor.dtensor_to_array(t, mesh=other)
  assert back.sharding == NamedSharding(other, P(('model', 'data')))
  assert _bits(back) == _bits(x)
  for s in back.addressable_shards:
    assert _bits(s.data) == _bits(x[s.index])


def test_dtensor_to_array_with_sharding():
  mesh = MESH_BUILDERS['transposed']()
  x = _values((8, 16), np.float32, seed=14)
  arr = jax.device_put(x, NamedSharding(mesh, P('data', 'model')))
  t = fdt_dtensor.array_to_dtensor(arr)
  sharding = NamedSharding(MESH_BUILDERS['shuffled'](), P('data', 'model'))
  back = fdt_dtensor.dtensor_to_array(t, sharding=sharding)
  assert back.sharding == sharding
  for s in back.addressable_shards:
    assert _bits(s.data) == _bits(x[s.index])


def test_dtensor_to_array_of_a_tf_made_dtensor():
  """A DTensor built by TF alone (dtensor.create_mesh) round-trips by slice."""
  dmesh = dtensor.create_mesh([('rows', 4), ('cols', 2)], device_type='CPU')
  x = _values((8, 12), np.float32, seed=15)
  replicated = dtensor.copy_to_mesh(
    tf.constant(x), dtensor.Layout.replicated(dmesh, 2)
  )
  t = dtensor.relayout(replicated, dtensor.Layout(['cols', 'rows'], dmesh))
  jax_mesh = jax.sharding.Mesh(_devices()[::-1].reshape(4, 2), ('rows', 'cols'))
  back = fdt_dtensor.dtensor_to_array(t, mesh=jax_mesh)
  assert back.sharding == NamedSharding(jax_mesh, P('cols', 'rows'))
  assert _bits(back) == _bits(x)
  for s in back.addressable_shards:
    assert _bits(s.data) == _bits(x[s.index])


def test_dtensor_to_array_replicates_from_one_component():
  arr = jax.device_put(_values((4, 4), np.float32, seed=16), jax.devices()[2])
  t = fdt_dtensor.array_to_dtensor(arr)
  mesh = MESH_BUILDERS['reversed']()
  back = fdt_dtensor.dtensor_to_array(t, mesh=mesh)
  assert back.sharding == NamedSharding(mesh, P())
  for s in back.addressable_shards:
    assert _bits(s.data) == _bits(arr)


# ---------------------------------------------------------------------------
# Errors.
# ---------------------------------------------------------------------------


def test_error_unsupported_sharding():
  from jax._src import sharding_impls

  gspmd = sharding_impls.GSPMDSharding.get_replicated(jax.devices())
  arr = jax.device_put(np.ones((8, 4), np.float32), gspmd)
  with pytest.raises(
    fdt.DTensorError,
    match=r'Expected a jax.sharding.NamedSharding or SingleDeviceSharding, '
    r'got GSPMDSharding.*jax.device_put',
  ):
    fdt_dtensor.array_to_dtensor(arr)
  with pytest.raises(fdt.DTensorError, match=r'got GSPMDSharding'):
    fdt_dtensor.layout_for(gspmd, 2)


def test_error_not_a_jax_array():
  with pytest.raises(
    fdt.DTensorError, match=r'Expected a jax.Array, got ndarray'
  ):
    fdt_dtensor.array_to_dtensor(np.ones(3))


def test_error_deleted_array():
  arr = jax.device_put(np.ones((8, 4), np.float32), jax.devices()[0])
  arr.delete()
  with pytest.raises(fdt.DTensorError, match=r'got a deleted one.*donat'):
    fdt_dtensor.array_to_dtensor(arr)


@pytest.mark.parametrize(
  'name',
  ['a,b', 'a b', 'a|b', 'a=b', 'a+b', '', 'unsharded', 'Match', 3],
  ids=repr,
)
def test_error_bad_axis_name(name):
  mesh = jax.sharding.Mesh(_devices()[::-1], (name,))
  with pytest.raises(
    fdt.DTensorError,
    match=rf'DTensor can use.*got {re.escape(repr(name))} in mesh axis names.*Rename',
  ):
    fdt_dtensor.mesh_to_dtensor(mesh)


def test_error_mesh_without_axes():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[0]), ())
  with pytest.raises(fdt.DTensorError, match=r'at least one axis'):
    fdt_dtensor.mesh_to_dtensor(mesh)


def test_error_not_a_concrete_mesh():
  abstract = MESH_BUILDERS['identity']().abstract_mesh
  with pytest.raises(fdt.DTensorError, match=r'concrete `jax.sharding.Mesh`'):
    fdt_dtensor.mesh_to_dtensor(abstract)
  with pytest.raises(fdt.DTensorError, match=r'concrete jax.sharding.Mesh'):
    fdt_dtensor.layout_for(NamedSharding(abstract, P('data')), 1)


def test_error_layout_for_bad_rank():
  sharding = NamedSharding(MESH_BUILDERS['identity'](), P('data', 'model'))
  with pytest.raises(fdt.DTensorError, match=r'at most 1 entries.*got'):
    fdt_dtensor.layout_for(sharding, 1)
  with pytest.raises(fdt.DTensorError, match=r'non-negative int, got -1'):
    fdt_dtensor.layout_for(sharding, -1)


def test_error_unconstrained_spec():
  sharding = NamedSharding(MESH_BUILDERS['identity'](), P(P.UNCONSTRAINED))
  with pytest.raises(fdt.DTensorError, match=r'UNCONSTRAINED.*inside jax.jit'):
    fdt_dtensor.layout_for(sharding, 2)


def test_error_unreduced_axes():
  mesh = MESH_BUILDERS['make_mesh_explicit']()
  sharding = NamedSharding(mesh, P('model', unreduced={'data'}))
  with pytest.raises(fdt.DTensorError, match=r"unreduced.*\['data'\]"):
    fdt_dtensor.layout_for(sharding, 2)


def test_error_dtensor_to_array_arguments():
  mesh = MESH_BUILDERS['identity']()
  arr = jax.device_put(
    np.ones((8, 4), np.float32), NamedSharding(mesh, P('data'))
  )
  t = fdt_dtensor.array_to_dtensor(arr)
  with pytest.raises(
    fdt.DTensorError, match=r'at most one of `mesh` and `sharding`'
  ):
    fdt_dtensor.dtensor_to_array(t, mesh=mesh, sharding=arr.sharding)
  with pytest.raises(
    fdt.DTensorError, match=r'Expected a TF DTensor.*got EagerTensor'
  ):
    fdt_dtensor.dtensor_to_array(tf.constant([1.0]))
  with pytest.raises(
    fdt.DTensorError, match=r'Expected a TF DTensor.*got ndarray'
  ):
    fdt_dtensor.dtensor_to_array(np.ones(3))
  with pytest.raises(
    fdt.DTensorError, match=r'Expected `mesh` to be a jax.sharding.Mesh'
  ):
    fdt_dtensor.dtensor_to_array(t, mesh=mesh.abstract_mesh)
  with pytest.raises(fdt.DTensorError, match=r'Expected `sharding` to be a'):
    fdt_dtensor.dtensor_to_array(t, sharding=jax.sharding.PartitionSpec('data'))
  other = jax.sharding.Mesh(_devices().reshape(2, 4), ('rows', 'cols'))
  with pytest.raises(
    fdt.DTensorError,
    match=r"shards over mesh axis 'data', expected its axis name\(s\) \('data',\) "
    r"in the JAX mesh axes \('rows', 'cols'\).*Pass a `mesh`",
  ):
    fdt_dtensor.dtensor_to_array(t, mesh=other)
  with pytest.raises(
    fdt.DTensorError, match=r'at most 2 entries for the rank-2'
  ):
    fdt_dtensor.dtensor_to_array(
      t, sharding=NamedSharding(mesh, P('data', 'model', None))
    )
  small = fdt_dtensor.array_to_dtensor(
    jax.device_put(np.ones((2, 4), np.float32), NamedSharding(mesh, P('data')))
  )
  with pytest.raises(
    fdt.DTensorError, match=r'fits the DTensor shape \(2, 4\).*evenly divide'
  ):
    fdt_dtensor.dtensor_to_array(
      small, sharding=NamedSharding(mesh, P('model'))
    )


@pytest.mark.parametrize(
  'spec',
  [
    P('model', 'data'),
    P(('data', 'model')),
    P(None, 'model'),
    P(),
    P('data', 'model'),
  ],
  ids=str,
)
def test_error_sharding_disagrees_with_layout(spec):
  mesh = MESH_BUILDERS['reversed']()
  arr = jax.device_put(
    np.ones((8, 16), np.float32), NamedSharding(mesh, P('data', None))
  )
  t = fdt_dtensor.array_to_dtensor(arr)
  with pytest.raises(
    fdt.DTensorError,
    match=r'sharding disagrees with the DTensor layout.*needing slice.*'
    r"layout \['data', 'unsharded'\].*Pass a sharding that partitions",
  ):
    fdt_dtensor.dtensor_to_array(t, sharding=NamedSharding(mesh, spec))


def test_error_unknown_dtensor_mesh():
  dmesh = dtensor.create_mesh([('x', 8)], device_type='CPU')
  replicated = dtensor.copy_to_mesh(
    tf.range(8.0), dtensor.Layout.replicated(dmesh, 1)
  )
  t = dtensor.relayout(replicated, dtensor.Layout(['x'], dmesh))
  with pytest.raises(
    fdt.DTensorError, match=r'whose JAX devices are unknown. Pass `mesh=`'
  ):
    fdt_dtensor.dtensor_to_array(t)
  back = fdt_dtensor.dtensor_to_array(t, mesh=jax.make_mesh((8,), ('x',)))
  assert _bits(back) == _bits(np.arange(8.0, dtype=np.float32))


def test_most_recent_of_meshes_sharing_a_dtensor_mesh_wins():
  """Explicit and Auto meshes over the same devices share a DTensor mesh."""
  devices = _devices()[[1, 0, 3, 2, 5, 4, 7, 6]].reshape(2, 4)
  explicit = jax.sharding.Mesh(
    devices, ('data', 'model'), axis_types=(AxisType.Explicit,) * 2
  )
  auto = jax.sharding.Mesh(
    devices, ('data', 'model'), axis_types=(AxisType.Auto,) * 2
  )
  x = _values((8, 16), np.float32, seed=17)
  t = fdt_dtensor.array_to_dtensor(
    jax.device_put(x, NamedSharding(explicit, P('data')))
  )
  assert fdt_dtensor.mesh_to_dtensor(auto) is dtensor.fetch_layout(t).mesh or (
    fdt_dtensor.mesh_to_dtensor(auto) == dtensor.fetch_layout(t).mesh
  )
  back = fdt_dtensor.dtensor_to_array(t)
  assert back.sharding == NamedSharding(auto, P('data'))
  assert _bits(back) == _bits(x)
  back = fdt_dtensor.dtensor_to_array(t, mesh=explicit)
  assert back.sharding == NamedSharding(explicit, P('data'))
  fdt_dtensor.layout_for(NamedSharding(explicit, P()), 2)
  back = fdt_dtensor.dtensor_to_array(t)
  assert back.sharding == NamedSharding(explicit, P('data'))
  assert _bits(back) == _bits(x)


def test_errors_are_value_errors():
  assert issubclass(fdt.DTensorError, ValueError)
  assert issubclass(fdt.DTensorInitializationError, ValueError)
  assert _topology.NOT_INITIALIZED_MSG.startswith(
    'TF DTensor is not initialized'
  )
