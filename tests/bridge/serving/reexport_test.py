"""Tests of exporting a SavedModel again with new weights: the files of the
first export with the new variables, served by plain TF without JAX, and a
new trace wherever what the forward bakes in changed."""

import json
import logging
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import processes, warm

import flax_dtensor as fdt

tf = pytest.importorskip('tensorflow')
fdt_tf = pytest.importorskip('flax_dtensor.dtensor')

from flax_dtensor.dtensor._serving import _tracing  # noqa: E402

RULES = [('embed', None), ('mlp', 'model')]

_SCRIPT = processes.NO_JAX + textwrap.dedent(
  """
  import json, os, sys
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  import numpy as np
  import tensorflow as tf

  job = json.load(open(sys.argv[1]))
  x = tf.constant(np.load(job['x']))
  for name, path in job['models'].items():
    loaded = tf.saved_model.load(path)
    (out,) = loaded.signatures['serving_default'](x=x).values()
    np.save(os.path.join(job['out'], f'{name}.npy'), out.numpy())
  print(json.dumps(sorted(job['models'])))
  """
)


class Net(nnx.Module):
  """A kernel over 'model', and a running statistic baked in as a constant
  when exported with ``exclude=nnx.BatchStat``."""

  def __init__(self, rngs):
    init = nnx.with_partitioning(
      nnx.initializers.lecun_normal(), ('embed', 'mlp')
    )
    self.linear = nnx.Linear(8, 16, kernel_init=init, rngs=rngs)
    self.shift = nnx.BatchStat(jnp.zeros((16,)))

  def __call__(self, x):
    return self.linear(x) + self.shift[...][None]


SPEC = [tf.TensorSpec([None, 8], tf.float32, name='x')]


@pytest.fixture
def traces(monkeypatch):
  """How many forwards `save_saved_model` traced."""
  count = []
  original = _tracing.traced

  def counted(*args, **kwargs):
    count.append(1)
    return original(*args, **kwargs)

  monkeypatch.setattr(_tracing, 'traced', counted)
  return count


def _serve(tmp_path, models, x):
  np.save(tmp_path / 'x.npy', x)
  job = tmp_path / 'job.json'
  job.write_text(
    json.dumps(
      {
        'models': {k: str(v) for k, v in models.items()},
        'x': str(tmp_path / 'x.npy'),
        'out': str(tmp_path),
      }
    )
  )
  script = tmp_path / 'serve.py'
  script.write_text(_SCRIPT)
  out = warm.tf_only().run(script, job)
  assert out.returncode == 0, out.stderr[-4000:]
  return {k: np.load(tmp_path / f'{k}.npy') for k in models}


def _scaled(model, factor):
  params = nnx.state(model, nnx.Param)
  nnx.update(model, jax.tree.map(lambda a: a * factor, params))


def test_new_weights_are_written_without_a_new_trace(tmp_path, traces):
  """Four exports of one model through training-like updates: one trace,
  each SavedModel serving its own weights, each restored bit for bit."""
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    net = Net(nnx.Rngs(0))
    want, kernels, paths = {}, {}, {}
    for step in range(4):
      paths[f's{step}'] = fdt_tf.save_saved_model(
        net, tmp_path / f'step{step}', input_signature=SPEC
      )
      want[f's{step}'] = np.asarray(net(x))
      kernels[f's{step}'] = np.asarray(net.linear.kernel[...])
      _scaled(net, 1.5)
  assert len(traces) == 1
  served = _serve(tmp_path, paths, x)
  for name in paths:
    np.testing.assert_allclose(served[name], want[name], rtol=1e-5, atol=1e-5)
  # Each is whole as our own readers check it: every byte against its
  # manifest, restored onto another mesh.
  other = jax.make_mesh(
    (8,), ('model',), axis_types=(jax.sharding.AxisType.Auto,)
  )
  for name, path in paths.items():
    with jax.set_mesh(other), fdt.logical_axis_rules(RULES):
      target = Net(nnx.Rngs(7))
      fdt_tf.restore_checkpoint(path, target)
    np.testing.assert_array_equal(
      np.asarray(target.linear.kernel[...]), kernels[name]
    )
    assert tuple(target.linear.kernel[...].sharding.spec) == (None, 'model')


def test_what_the_forward_bakes_in_is_traced_again(tmp_path, traces):
  """A constant baked into the forward (a BatchStat left out of the
  variables), a signature, a shape and a sharding are part of the trace:
  changing any of them exports anew."""
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  x = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)
  baked = {'exclude': nnx.BatchStat}
  paths, want = {}, {}
  with jax.set_mesh(mesh), fdt.logical_axis_rules(RULES):
    net = Net(nnx.Rngs(0))
    paths['first'] = fdt_tf.save_saved_model(
      net, tmp_path / 'first', input_signature=SPEC, **baked
    )
    want['first'] = np.asarray(net(x))
    net.shift[...] = jnp.full((16,), 2.0)  # The constant changes.
    paths['shifted'] = fdt_tf.save_saved_model(
      net, tmp_path / 'shifted', input_signature=SPEC, **baked
    )
    want['shifted'] = np.asarray(net(x))
    assert len(traces) == 2
    paths['trainable'] = fdt_tf.save_saved_model(
      net, tmp_path / 'trainable', input_signature=SPEC, trainable=True, **baked
    )
    want['trainable'] = want['shifted']
    assert len(traces) == 3
  replicated = jax.make_mesh((8,), ('data',))
  with jax.set_mesh(replicated), fdt.logical_axis_rules(RULES):
    moved = Net(nnx.Rngs(0))  # The values of `net`, replicated.
    moved.shift[...] = jnp.full((16,), 2.0)
    paths['moved'] = fdt_tf.save_saved_model(
      moved, tmp_path / 'moved', input_signature=SPEC, **baked
    )
    want['moved'] = np.asarray(moved(x))
  assert len(traces) == 4
  served = _serve(tmp_path, paths, x)
  for name in paths:
    np.testing.assert_allclose(served[name], want[name], rtol=1e-5, atol=1e-5)
  assert not np.allclose(served['first'], served['shifted'])


def test_tf_s_warning_of_its_own_saver_is_dropped(
  tmp_path, monkeypatch, caplog
):
  """From a process's fifth save on, TF warns that its saver's function
  (``MultiDeviceSaver.save.<locals>.tf_function_save``) was traced again:
  TF's own function, not the user's. That record is dropped while the
  export saves; any other of TF's logger passes, and nothing stays on the
  logger after. (TF's records are emitted here, around its real save: the
  test depends on no line TF itself logs.)"""
  save = tf.saved_model.save
  logger = logging.getLogger('tensorflow')
  own = (
    '5 out of the last 5 calls to <function MultiDeviceSaver.save.<locals>.'
    'tf_function_save at 0x7f> triggered tf.function retracing.'
  )
  users = '5 out of the last 5 calls to <function serve> triggered retracing.'

  def saving(*args, **kwargs):
    logger.warning(own)
    logger.warning(users)
    return save(*args, **kwargs)

  monkeypatch.setattr(tf.saved_model, 'save', saving)
  filters = list(logger.filters)
  with caplog.at_level(logging.WARNING, logger='tensorflow'):
    fdt_tf.save_saved_model(
      nnx.Linear(2, 4, rngs=nnx.Rngs(0)),
      tmp_path / 'sm',
      input_signature=[tf.TensorSpec([None, 2], tf.float32)],
    )
  messages = [r.getMessage() for r in caplog.records if r.name == 'tensorflow']
  assert own not in messages
  assert users in messages
  assert logger.filters == filters
