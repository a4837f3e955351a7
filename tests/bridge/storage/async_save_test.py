"""Saves in the background: the values of the call, errors at `wait()`, exit.

`save_checkpoint(..., blocking=False)` returns a `SaveHandle` once the state
is copied. The checkpoint must hold the values of the call even when the
caller overwrites or donates its arrays right after; a pending save must
finish when the interpreter exits; a second save to the same path waits for
the first. The full disk (tests/bridge/storage/faults_test.py) and the kills
(tests/bridge/storage/kill_test.py) cover background saves too.
"""

import os
import re
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_dtensor as fdt

tf = pytest.importorskip('tensorflow')
fdt_tf = pytest.importorskip('flax_dtensor.dtensor')


from flax_dtensor.dtensor._storage import _host_write  # noqa: E402

TIMEOUT = 300


class Stack(nnx.Module):
  """Plain NNX, not the demo's style: a list of layers and a BatchNorm."""

  def __init__(self, mesh, rngs):
    init = nnx.with_partitioning(
      nnx.initializers.lecun_normal(), ('embed', 'mlp')
    )
    with fdt.logical_axis_rules([('embed', 'data'), ('mlp', 'model')]):
      with jax.set_mesh(mesh):
        self.layers = nnx.List(
          [nnx.Linear(16, 16, kernel_init=init, rngs=rngs) for _ in range(3)]
        )
        self.norm = nnx.BatchNorm(16, rngs=rngs)

  def __call__(self, x):
    for layer in self.layers:
      x = jax.nn.relu(layer(x))
    return self.norm(x)


def _values(model):
  return {
    path: np.array(v.get_value())
    for path, v in nnx.to_flat_state(
      nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat))
    )
  }


def _assert_holds(path, expected):
  read = fdt_tf.read_checkpoint(path)
  assert set(read) == set(expected)
  for key, value in expected.items():
    np.testing.assert_array_equal(read[key], value, err_msg=str(key))


def test_holds_the_values_of_the_call_after_an_update(auto_mesh, tmp_path):
  model = Stack(auto_mesh, nnx.Rngs(0))
  expected = _values(model)
  kernel = model.layers[0].kernel
  assert kernel.get_value().sharding.spec == P('data', 'model')
  handle = fdt_tf.save_checkpoint(model, tmp_path / 'c', blocking=False)
  assert isinstance(handle, fdt_tf.SaveHandle)
  # The caller moves on at once: every parameter changes in place.
  nnx.update(
    model,
    jax.tree.map(lambda x: x + 100, nnx.state(model, nnx.Param)),
  )
  assert float(kernel.get_value()[0, 0]) == expected[('layers', 0, 'kernel')][
    0, 0
  ] + np.float32(100)
  assert handle.result() == str(tmp_path / 'c')
  assert handle.done()
  _assert_holds(tmp_path / 'c', expected)
  # And the restore places them as the model's own arrays are placed.
  fresh = Stack(auto_mesh, nnx.Rngs(1))
  fdt_tf.restore_checkpoint(tmp_path / 'c', fresh)
  assert fresh.layers[0].kernel.get_value().sharding.spec == P('data', 'model')
  for key, value in _values(fresh).items():
    np.testing.assert_array_equal(value, expected[key])


@pytest.mark.parametrize('threads', [1, 4], ids=['one copy thread', 'four'])
def test_holds_the_values_of_the_call_after_a_donating_step(
  explicit_mesh, tmp_path, monkeypatch, threads
):
  """The copy to host memory is done when the call returns, on the
  caller's thread or (the bar lowered to 64 bytes) on a pool of 4."""
  monkeypatch.setattr(_host_write, 'COPY_THREADS', threads)
  monkeypatch.setattr(_host_write, '_COPY_TASK_BYTES', 64)
  copied_on, copyto = set(), np.copyto

  def counted(*args, **kwargs):
    copied_on.add(threading.current_thread().name)
    return copyto(*args, **kwargs)

  monkeypatch.setattr(np, 'copyto', counted)
  model = nnx.Dict(
    w=nnx.Param(
      jax.device_put(
        jnp.arange(8 * 32, dtype=jnp.float32).reshape(8, 32),
        NamedSharding(explicit_mesh, P('data', 'model')),
      )
    ),
    h=nnx.Param(
      jax.device_put(
        jnp.arange(8, dtype=jnp.float16), NamedSharding(explicit_mesh, P())
      )
    ),
  )
  expected = _values(model)
  graphdef, state = nnx.split(model)
  handle = fdt_tf.save_checkpoint(state, tmp_path / 'c', blocking=False)
  monkeypatch.setattr(np, 'copyto', copyto)
  if threads == 1:
    assert copied_on == {threading.current_thread().name}
  else:  # The pool's (how many of its threads ran depends on timing).
    assert copied_on, copied_on
    assert all(n.startswith('flax_dtensor copy') for n in copied_on)

  @jax.jit
  def step(state):
    return jax.tree.map(lambda x: x * 0 - 1, state)

  donating = jax.jit(step, donate_argnums=0)
  old = jax.tree.leaves(state)
  state = donating(state)
  # The step took the buffers: the originals are gone.
  assert all(x.is_deleted() for x in old)
  assert all(bool(jnp.all(x == -1)) for x in jax.tree.leaves(state))
  handle.wait()
  _assert_holds(tmp_path / 'c', expected)
  assert nnx.merge(graphdef, state) is not None


def test_a_second_save_to_the_path_waits_for_the_first(explicit_mesh, tmp_path):
  def model(version):
    return nnx.Dict(
      w=nnx.Param(
        jax.device_put(
          jnp.full((8, 8), version, jnp.float32),
          NamedSharding(explicit_mesh, P('data', 'model')),
        )
      )
    )

  path = tmp_path / 'c'
  first = fdt_tf.save_checkpoint(model(1), path, blocking=False)
  second = fdt_tf.save_checkpoint(
    model(2), path, overwrite=True, blocking=False
  )
  # The second call returned only once the first save had finished.
  assert first.done()
  first.wait()
  second.wait()
  _assert_holds(path, {('w',): np.full((8, 8), 2, np.float32)})
  assert os.listdir(tmp_path) == ['c']
  # A blocking save waits for a pending one too.
  third = fdt_tf.save_checkpoint(model(3), path, overwrite=True, blocking=False)
  fdt_tf.save_checkpoint(model(4), path, overwrite=True)
  assert third.done()
  _assert_holds(path, {('w',): np.full((8, 8), 4, np.float32)})


def test_a_read_of_the_path_waits_for_a_pending_save(explicit_mesh, tmp_path):
  sharding = NamedSharding(explicit_mesh, P('data', 'model'))

  def model(version):
    return nnx.Dict(
      w=nnx.Param(
        jax.device_put(jnp.full((8, 8), version, jnp.float32), sharding)
      )
    )

  path = tmp_path / 'c'
  fdt_tf.save_checkpoint(model(1), path)
  pending = fdt_tf.save_checkpoint(
    model(2), path, overwrite=True, blocking=False
  )
  # The restore reads the new version whole, never the old one or a mix.
  target = model(7)
  fdt_tf.restore_checkpoint(path, target)
  assert pending.done()
  np.testing.assert_array_equal(
    np.asarray(target['w'].get_value()), np.full((8, 8), 2, np.float32)
  )
  assert target['w'].get_value().sharding == sharding
  pending = fdt_tf.save_checkpoint(
    model(3), path, overwrite=True, blocking=False
  )
  read = fdt_tf.read_checkpoint(path)
  assert pending.done()
  np.testing.assert_array_equal(read[('w',)], np.full((8, 8), 3, np.float32))


def test_refusals_come_at_the_call(explicit_mesh, tmp_path):
  model = nnx.Dict(
    w=nnx.Param(
      jax.device_put(
        jnp.ones((8, 8)), NamedSharding(explicit_mesh, P('data', 'model'))
      )
    )
  )
  path = fdt_tf.save_checkpoint(model, tmp_path / 'c')
  with pytest.raises(fdt.ExportError, match='already exists'):
    fdt_tf.save_checkpoint(model, path, blocking=False)
  with pytest.raises(
    fdt.ExportError, match='No NNX variable of module_or_state matched'
  ):
    fdt_tf.save_checkpoint(
      model, tmp_path / 'd', include=nnx.BatchStat, blocking=False
    )
  (tmp_path / 'f').write_text('x')  # A missing parent is made; a file, not.
  with pytest.raises(
    fdt.ExportError, match=r'An ancestor .* is not a directory: .* is a file'
  ):
    fdt_tf.save_checkpoint(model, tmp_path / 'f' / 'no' / 'd', blocking=False)
  assert sorted(os.listdir(tmp_path)) == ['c', 'f']


_EXIT = textwrap.dedent(
  """
  import sys
  import jax
  jax.config.update('jax_num_cpu_devices', 8)
  import jax.numpy as jnp
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P
  from flax_dtensor import dtensor as fdt_tf

  fdt_tf.initialize()
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  model = nnx.Dict({
    f'v{i}': nnx.Param(jax.device_put(
        jnp.arange(64 * 256, dtype=jnp.float32).reshape(64, 256) * (i + 1),
        NamedSharding(mesh, P('data', 'model'))))
    for i in range(8)})
  fdt_tf.save_checkpoint(model, sys.argv[1], blocking=False)
  """
)


def test_exit_waits_for_a_pending_save(warm_pool, tmp_path):
  path = tmp_path / 'c'
  proc = warm_pool.run_code(_EXIT, path, timeout=TIMEOUT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'cannot schedule new futures' not in proc.stderr
  assert os.listdir(tmp_path) == ['c']
  base = np.arange(64 * 256, dtype=np.float32).reshape(64, 256)
  _assert_holds(path, {(f'v{i}',): base * (i + 1) for i in range(8)})


_EXIT_FAILING = textwrap.dedent(
  """
  import resource, signal, sys
  import jax
  jax.config.update('jax_num_cpu_devices', 8)
  # Not the run's shared compilation cache: cut short under the limit.
  jax.config.update('jax_enable_compilation_cache', False)
  import jax.numpy as jnp
  from flax import nnx
  from flax_dtensor import dtensor as fdt_tf

  fdt_tf.initialize()
  model = nnx.Dict({'w': nnx.Param(jnp.ones((256, 256)))})
  # Files of at most 4 KiB: the 256 KiB of variables fail to write (EFBIG).
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
  fdt_tf.save_checkpoint(model, sys.argv[1], blocking=False)
  print('returned', flush=True)
  """
)


def test_a_save_failing_at_exit_makes_the_exit_status_1(warm_pool, tmp_path):
  """Nobody waited for the save: its failure is the process's exit status."""
  path = tmp_path / 'c'
  proc = warm_pool.run_code(_EXIT_FAILING, path, timeout=TIMEOUT)
  assert proc.stdout == 'returned\n'
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert re.search(
    rf"flax_dtensor: the background save to '{re.escape(str(path))}' failed "
    r'and nobody called wait\(\) on it: Writing .* File too large.*The '
    r'process exits with status 1\.',
    proc.stderr,
    re.S,
  ), proc.stderr[-3000:]
  assert os.listdir(tmp_path) == []
