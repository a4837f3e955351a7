"""The bad-input matrix: every public entry point, every kind of bad input.

`CASES` lists, for each, the documented exception type, a pattern of its
message, and the fix. `bad_input_test.py` runs every case; the docs'
troubleshooting page is generated from this list
(tools/generate_docs.py), which is why it imports nothing of pytest.
Cases that need a fresh process (TensorFlow missing, DTensor not or wrongly
initialized) run in one; those that leave TensorFlow as they found it share
theirs.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import os
import textwrap
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_dtensor as fdt
import flax_dtensor.dtensor as fdt_tf
from flax_dtensor.cli import _command
from support import fault_runs, manifests, processes, scale_runs


@dataclasses.dataclass(frozen=True)
class Case:
  """One bad input.

  Attributes:
    entry: The public entry point, as a user spells it.
    bad: What the user did, in a few words.
    error: The exception type raised.
    match: A regular expression the message matches.
    fix: What to do, one sentence (shown in the docs).
    run: Does the bad thing, given a `Context`.
    tf: Whether TensorFlow (and DTensor initialized here) is needed.
  """

  entry: str
  bad: str
  error: type[BaseException]
  match: str
  fix: str
  run: Callable[[Context], Any]
  tf: bool = False

  @property
  def id(self) -> str:
    return f'{self.entry}: {self.bad}'


class Context:
  """What the cases need: meshes, a scratch directory, models, TF."""

  def __init__(self, tmp_path, pool=None):
    self.tmp = tmp_path
    self._pool = pool
    types = (AxisType.Explicit, AxisType.Explicit)
    self.mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=types)
    self.mixed = jax.make_mesh(
      (2, 4), ('data', 'model'), axis_types=(AxisType.Explicit, AxisType.Auto)
    )
    self.rules = fdt.LogicalRules([('embed', 'data'), ('mlp', 'model')])

  @functools.cached_property
  def pool(self):
    """The session's warm pool (`warm.Pool`), for faults in forks."""
    if self._pool is None:
      raise AssertionError('Context(pool=...) is needed for this case')
    return self._pool()

  @functools.cached_property
  def tf(self):
    import tensorflow as tf

    return tf

  @functools.cached_property
  def dt(self):
    from flax_dtensor import dtensor

    dtensor.initialize()
    return dtensor

  def model(self, width=16):
    init = nnx.with_partitioning(nnx.initializers.ones, ('embed', 'mlp'))
    with jax.set_mesh(self.mesh), fdt.logical_axis_rules(self.rules):
      return nnx.Linear(8, width, kernel_init=init, rngs=nnx.Rngs(0))

  @functools.cached_property
  def checkpoint(self) -> str:
    return self.dt.save_checkpoint(self.model(), self.tmp / 'ckpt')

  @functools.cached_property
  def checkpoint_v4(self) -> str:
    """The checkpoint as manifest version 4 wrote it (CRC-32)."""
    with manifests.writing_version(4):
      return self.dt.save_checkpoint(self.model(), self.tmp / 'ckpt_v4')


def _captures_its_rngs():
  """A factory whose nnx.Rngs comes from the enclosing scope."""
  rngs = nnx.Rngs(0)

  def make():
    return nnx.Linear(
      8, 16, kernel_init=_annotated(('embed', 'mlp')), rngs=rngs
    )

  return make


def _annotated(axes):
  return nnx.with_partitioning(nnx.initializers.ones, axes)


class LanguageModel(nnx.Module):
  """A forward pass in another library's style, and results that cannot be
  served."""

  def __init__(self):
    self.embed = nnx.Embed(16, 8, rngs=nnx.Rngs(0))

  def __call__(self, tokens, positions, cache, attention_mask):
    x = self.embed(tokens) + self.embed(positions)
    scores = jnp.einsum('btd,bsd->bts', x, x)
    return jnp.where(attention_mask, scores, 0.0), cache

  def tagged(self, tokens, positions, cache, attention_mask):
    return self(tokens, positions, cache, attention_mask)[0], 'v1'

  def mixed_keys(self, tokens, positions, cache, attention_mask):
    scores = self(tokens, positions, cache, attention_mask)[0]
    return {'scores': scores, 0: scores}

  def clashing(self, tokens, positions, cache, attention_mask):
    scores = self(tokens, positions, cache, attention_mask)[0]
    return {'a/b': scores, 'a': {'b': scores}}

  def nothing(self, tokens, positions, cache, attention_mask):
    return cache


def _serve_lm(ctx, signature=None, **kwargs):
  """save_saved_model of a `LanguageModel`, by default with its cache None."""
  tf = ctx.tf
  if signature is None:
    signature = [
      tf.TensorSpec([None, 4], tf.int32),
      tf.TensorSpec([None, 4], tf.int32),
      None,
      tf.TensorSpec([None, 4, 4], tf.bool),
    ]
  return ctx.dt.save_saved_model(
    LanguageModel(), ctx.tmp / 'sm', input_signature=signature, **kwargs
  )


def _lengths_of_their_own(ctx):
  tf = ctx.tf
  return _serve_lm(
    ctx,
    [
      tf.TensorSpec([None, None], tf.int32),
      tf.TensorSpec([None, None], tf.int32),
      None,
      tf.TensorSpec([None, None, None], tf.bool),
    ],
  )


# The scripts of each group of `_in_a_fresh_process`, in the order given.
_GROUPS: dict[str, list[str]] = {}
# The groups whose subject is what importing does: each a new Python.
_IMPORTING: set[str] = set()


def _in_a_fresh_process(
  script: str, *, group: str | None = None, imports: bool = False
) -> Callable[[Context], None]:
  """A case run by `script` in a fresh process; its error is re-raised.

  The process is a fork of the warm pool (JAX, Flax, TensorFlow and
  flax_dtensor imported; neither JAX's backend nor TensorFlow's runtime
  started, DTensor not set up), or, where the subject is what an import
  does (`imports`), a new Python.

  The scripts of one `group` run one after the other in the same process
  (one process start instead of several), each where the ones before left
  TensorFlow: they only read or refuse its state, until the last, which
  may change it. The process starts at the first case of the group to run.
  """
  if group is None:
    group = f'alone {len(_GROUPS)}'
  if imports:
    _IMPORTING.add(group)
  scripts = _GROUPS.setdefault(group, [])
  index = len(scripts)
  scripts.append(script)

  def run(ctx):
    del ctx
    raised = _group_results(group)[index]
    if raised is not None:
      name, message = raised
      builtins = __import__('builtins')
      error = getattr(fdt, name, None) or getattr(builtins, name, None)
      raise (error or RuntimeError)(message)

  return run


@functools.cache
def _group_results(group: str) -> list[list[str] | None]:
  """Runs the scripts of `group` in one fresh process: [type, text] of what
  each raised (None: nothing), in order."""
  cases = ''.join(
    f'def case_{i}():\n{textwrap.indent(textwrap.dedent(script), "  ")}\n'
    for i, script in enumerate(_GROUPS[group])
  )
  program = (
    'import json, sys\n'
    + cases
    + textwrap.dedent(
      f"""
      results = []
      for case in [{', '.join(f'case_{i}' for i in range(len(_GROUPS[group])))}]:
        try:
          case()
        except Exception as e:
          results.append([type(e).__name__, str(e)])
        else:
          results.append(None)
      print(json.dumps(results))
      """
    )
  )
  if group in _IMPORTING:
    proc = processes.run_python('-c', program)
  else:
    from support import warm

    proc = warm.shared().run_code(program)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _unreadable_stablehlo(ctx):
  """What save_saved_model checks before writing, met with a module TF's
  XlaCallModule loader refuses (as TF 2.21 refuses jax 0.12's default
  StableHLO)."""
  from tensorflow.compiler.tf2xla.python import xla

  from flax_dtensor.dtensor._serving import _serialization

  tf = ctx.tf
  traced = tf.function(
    lambda x: xla.call_module(
      [x],
      version=9,
      module=b'ML\xefR not a StableHLO artifact',
      Sout=[tf.TensorShape([2])],
      Tout=[tf.float32],
      platforms=['CPU'],
    ),
    autograph=False,
  ).get_concrete_function(tf.TensorSpec([2], tf.float32))
  _serialization.check_readable(traced, 'save_saved_model')


class BareConstraint(nnx.Module):
  """A forward that constrains with a bare PartitionSpec."""

  def __init__(self):
    self.w = nnx.Param(jnp.ones((8, 4)))

  def __call__(self, x):
    return jax.lax.with_sharding_constraint(x @ self.w[...], P('data'))


def _bare_constraint(ctx):
  """Variables on one device, and no mesh in context."""
  ctx.dt.save_saved_model(
    BareConstraint(),
    ctx.tmp / 'bare',
    input_signature=[ctx.tf.TensorSpec([None, 8])],
  )


def _eager_without_mesh():
  rules = fdt.LogicalRules([], path_rules=[('kernel$', P(None, 'model'))])
  with fdt.logical_axis_rules(rules):
    nnx.Linear(8, 16, rngs=nnx.Rngs(0))


def _jit_mixed_product(ctx):
  with jax.set_mesh(ctx.mixed):
    jax.jit(
      lambda x: fdt.shard_value(
        x, ('embed',), rules=[('embed', ('data', 'model'))]
      )
    )(jnp.ones(16))


def _manual_axes(ctx):
  def body(x):
    return fdt.shard_value(x, ('embed',), rules=[('embed', 'data')])

  x = jax.device_put(jnp.ones(16), NamedSharding(ctx.mesh, P('data')))
  jax.shard_map(body, mesh=ctx.mesh, in_specs=P('data'), out_specs=P('data'))(x)


def _interleaved_blocks(ctx):
  import asyncio

  async def task(axis):
    with fdt.logical_axis_rules([('mlp', axis)]):
      await asyncio.sleep(0)

  async def main():
    for result in await asyncio.gather(
      task('data'), task('model'), return_exceptions=True
    ):
      if isinstance(result, Exception):
        raise result

  asyncio.run(main())


def _edited_manifest(ctx):
  def change(meta):
    meta['variables'][0]['shape'] = [32]

  path = ctx.dt.save_checkpoint(ctx.model(), ctx.tmp / 'edited')
  manifests.edit(path, change)
  ctx.dt.read_checkpoint(path)


def _damaged_data(ctx):
  path = ctx.dt.save_checkpoint(ctx.model(), ctx.tmp / 'damaged')
  # Its first bytes: a shard's values (TF's object graph comes last).
  for name in os.listdir(path):
    if name.startswith('ckpt.data'):
      with open(os.path.join(path, name), 'r+b') as f:
        f.write(b'\xff' * 16)
  ctx.dt.restore_checkpoint(path, ctx.model())


def _crafted(ctx, name, edit, source=None):
  """A copy of the checkpoint (or of `source`) whose manifest
  `edit(meta, root)` changed."""
  import shutil

  root = str(ctx.tmp / name)
  shutil.copytree(source or ctx.checkpoint, root)
  file = os.path.join(root, 'flax_dtensor.json')
  with open(file) as f:
    meta = json.load(f)
  text = edit(meta, root)
  with open(file, 'w') as f:
    f.write(json.dumps(meta) if text is None else text)
  return root


def _prefix_outside(ctx):
  def edit(meta, root):
    meta['checkpoint_prefix'] = '../ckpt/ckpt'
    meta['files'] = {f'../ckpt/{n}': s for n, s in meta['files'].items()}

  ctx.dt.restore_checkpoint(_crafted(ctx, 'outside', edit), ctx.model())


def _linked_out(ctx):
  def edit(meta, root):
    index = os.path.join(root, 'ckpt.index')
    os.remove(index)
    os.symlink(os.path.join(ctx.checkpoint, 'ckpt.index'), index)

  ctx.dt.restore_checkpoint(_crafted(ctx, 'linked', edit), ctx.model())


def _unlisted(ctx):
  def edit(meta, root):
    data = sorted(n for n in meta['files'] if '.data-' in n)
    del meta['files'][data[0]]

  ctx.dt.read_checkpoint(_crafted(ctx, 'unlisted', edit))


def _kernel(meta):
  (record,) = [v for v in meta['variables'] if v['path'] == ['kernel']]
  return record


def _checksum_missing(ctx):
  def edit(meta, root):
    shards = _kernel(meta)['shards']
    crcs = base64.b64decode(shards['crc32c'])
    shards['crc32c'] = base64.b64encode(crcs[:-4]).decode()

  ctx.dt.restore_checkpoint(_crafted(ctx, 'short', edit), ctx.model())


def _version_3_record_missing(ctx):
  """A manifest of flax_dtensor before version 4 (a record per shard), one
  of its records gone."""

  def edit(meta, root):
    manifests.as_version_3(meta)
    del _kernel(meta)['shards'][-1]

  ctx.dt.restore_checkpoint(
    _crafted(ctx, 'v3', edit, ctx.checkpoint_v4), ctx.model()
  )


def _version_2(ctx):
  def edit(meta, root):
    meta['version'] = 2

  ctx.dt.read_checkpoint(_crafted(ctx, 'v2', edit))


def _deeply_nested(ctx):
  path = _crafted(ctx, 'deep', lambda meta, root: '[' * 10**5 + ']' * 10**5)
  ctx.dt.restore_checkpoint(path, ctx.model())


def _duplicate_keys(ctx):
  def edit(meta, root):
    return json.dumps(meta).replace('{"format"', '{"version": 2, "format"', 1)

  ctx.dt.read_checkpoint(_crafted(ctx, 'duplicate', edit))


def _state_file_outside(ctx):
  root = ctx.tmp / 'stateful'
  root.mkdir()
  (root / 'checkpoint').write_text(
    f'model_checkpoint_path: "{ctx.checkpoint}/ckpt"\n'
  )
  ctx.dt.read_checkpoint(root)


def _abstract_leftovers(ctx):
  class WithDropout(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(8, 16, rngs=rngs)
      self.drop = nnx.Dropout(0.1, rngs=rngs)

  with jax.set_mesh(ctx.mesh):
    model = WithDropout(nnx.Rngs(0))
    path = ctx.dt.save_checkpoint(model, ctx.tmp / 'leftovers')
    ctx.dt.restore_checkpoint(
      path, nnx.eval_shape(lambda: WithDropout(nnx.Rngs(0)))
    )


def _abstract_without_mesh(ctx, mesh=None):
  with jax.set_mesh(ctx.mesh):
    abstract = nnx.eval_shape(lambda: nnx.Linear(8, 16, rngs=nnx.Rngs(0)))
  # The abstract shardings name an abstract mesh; no concrete one is given.
  state = nnx.state(abstract)
  for _, v in nnx.to_flat_state(state):
    value = v.get_value()
    v.set_value(
      jax.ShapeDtypeStruct(
        value.shape,
        value.dtype,
        sharding=NamedSharding(mesh or ctx.mesh.abstract_mesh, P()),
      )
    )
  ctx.dt.restore_checkpoint(ctx.checkpoint, state)


# A mesh of 16 positions, where JAX has 8 devices: what a laptop user gets
# when `jax.make_mesh` cannot build the mesh (one CPU device).
_TOO_BIG = jax.sharding.AbstractMesh((4, 4), ('data', 'model'))
_TOO_BIG_MATCH = (
  r'The mesh needs 16 devices, and JAX has 8 \(cpu\)\. On CPU, make 16 '
  r"virtual devices .*jax\.config\.update\('jax_num_cpu_devices', 16\)"
)
_TOO_BIG_FIX = (
  "Make the devices first: jax.config.update('jax_num_cpu_devices', N) "
  'before any other JAX call (or XLA_FLAGS=--xla_force_host_platform_'
  'device_count=N), then build the mesh with jax.make_mesh.'
)


def _shard_module_too_big(ctx):
  with nnx.use_eager_sharding(False):
    model = ctx.model()
  fdt.shard_module(model, mesh=_TOO_BIG, rules=ctx.rules)


def _topology():
  from flax_dtensor.dtensor._layout import _topology

  return _topology


def _a_string():
  return 'str'


def _a_number():
  return 42


def _a_tuple():
  return (nnx.Linear(2, 2, rngs=nnx.Rngs(0)), 'v1')


# Function names as users write them (no leading underscore in messages).
_a_string.__qualname__ = 'a_string'
_a_number.__qualname__ = 'a_number'
_a_tuple.__qualname__ = 'a_tuple'


def _recorded_text(result: dict[str, Any]) -> None:
  """Re-raises the error a multi-process run recorded as its 'kind' (the
  class name) and 'error' (the text)."""
  if result['error'] is None:
    raise AssertionError('the fault run raised nothing')
  _recorded([result['kind'], result['error']])


def _recorded(error: list[str] | None) -> None:
  """Re-raises an error a fault run (fault_runs.py) recorded as [type, text]."""
  if error is None:
    raise AssertionError('the fault run raised nothing')
  kind = (
    getattr(fdt, error[0], None)
    or getattr(fdt_tf, error[0], None)
    or getattr(_command, error[0], None)
  )
  raise (kind or RuntimeError)(error[1])


def _write_fault(ctx, fault: str) -> None:
  """The error of a write of the command line under a real fault (a fork
  of the warm pool: workers/write_faults.py), as it was raised."""
  run = fault_runs.write_fault(ctx.pool, fault)
  if run['error'] is None:
    raise AssertionError(
      f'the fault run raised nothing (exit {run["status"]}); its stderr ends:'
      f'\n{run["stderr"][-3000:]}'
    )
  _recorded(run['error'])


def _no_space(ctx):
  """ENOSPC mid-save on a small tmpfs; else the same message from /dev/full.

  The tmpfs needs a mount namespace (`unshare -rm`), which some systems
  forbid; /dev/full refuses every write with ENOSPC everywhere, and the
  message comes from the same function.
  """
  run = fault_runs.no_space()
  if 'unavailable' not in run:
    _recorded(run['error'])
  from flax_dtensor.dtensor import _tf_errors

  with _tf_errors.space_checked(str(ctx.tmp / 'full'), 2**20):
    with open('/dev/full', 'w') as f:
      f.write('x')
      f.flush()


def _in_progress(ctx):
  """A temporary whose name says a live process (pid 1) writes it."""
  from flax_dtensor.dtensor._storage import _temporaries

  writer = _temporaries.Writer.on_this_host(1)
  path = ctx.tmp / 'busy'
  (ctx.tmp / f'.busy.tmp-{writer.tag()}').mkdir()
  ctx.dt.save_checkpoint(ctx.model(), path)


def _file_parent(ctx):
  (ctx.tmp / 'a_file').write_text('precious')
  ctx.dt.save_checkpoint(ctx.model(), ctx.tmp / 'a_file' / 'ckpt')


def _bad_peer_timeout(ctx):
  os.environ['FLAX_DTENSOR_PEER_TIMEOUT'] = 'soon'
  try:
    ctx.dt.save_checkpoint(ctx.model(), ctx.tmp / 'timeout')
  finally:
    del os.environ['FLAX_DTENSOR_PEER_TIMEOUT']


def _replaced_while_restoring(ctx):
  """Another save swaps the checkpoint in after the files were checked."""
  from flax_dtensor.dtensor._format import _verify

  path = ctx.dt.save_checkpoint(ctx.model(), ctx.tmp / 'swapped')
  with jax.set_mesh(ctx.mesh), fdt.logical_axis_rules(ctx.rules):
    other = nnx.Linear(
      8,
      16,
      kernel_init=_annotated(('embed', 'mlp')),
      bias_init=nnx.initializers.ones,
      rngs=nnx.Rngs(0),
    )
  other = ctx.dt.save_checkpoint(other, ctx.tmp / 'other')
  real = _verify.verify_files

  def check_then_swap(manifest, pool, **kwargs):
    real(manifest, pool, **kwargs)
    os.rename(path, ctx.tmp / 'swapped-aside')
    os.rename(other, path)

  _verify.verify_files = check_then_swap
  try:
    ctx.dt.restore_checkpoint(path, ctx.model())
  finally:
    _verify.verify_files = real


CASES = [
  # Golden layouts
  Case(
    'fdt.ShardingPlan.from_json',
    'a golden layout that is not a plan',
    fdt.LayoutFileError,
    r'is not a plan: expected a JSON object with a "variables" list',
    'Write the layout with `flax-dtensor plan TARGET --json > FILE`.',
    lambda ctx: fdt.ShardingPlan.from_json('[1, 2]'),
  ),
  # Linting
  Case(
    'fdt.check',
    'an unknown finding code to allow',
    fdt.LogicalRulesError,
    r"allow= names unknown finding codes \['unused-rules'\]; expected some",
    'Allow codes the linting page lists (unused-rule, ...).',
    lambda ctx: fdt.check(
      ctx.model(), [('embed', 'data')], ctx.mesh, allow=['unused-rules']
    ),
  ),
  Case(
    'fdt.check',
    'no rules, and annotations that name no mesh axis',
    fdt.UnknownLogicalAxisError,
    r"maps to 'embed', which is not an axis of the mesh .* No rules are in "
    r"effect, so Flax's semantics apply",
    'Pass rules= (or check under fdt.logical_axis_rules); for annotations '
    'that already name mesh axes, fdt.LogicalRules.for_mesh_axes(mesh).',
    lambda ctx: fdt.check(
      lambda: nnx.Linear(
        8, 16, kernel_init=_annotated(('embed', 'mlp')), rngs=nnx.Rngs(0)
      ),
      mesh=ctx.mesh,
    ),
  ),
  # Memory
  Case(
    'fdt.memory_report',
    'an optax transformation where the nnx.Optimizer goes',
    fdt.NotAModelError,
    r'memory_report\(\) expected an nnx.Optimizer; got GradientTransformation',
    'Pass nnx.Optimizer(model, tx, wrt=nnx.Param).',
    lambda ctx: fdt.memory_report(
      lambda m, o, b: 0.0, ctx.model(), optax.sgd(0.1), jnp.ones(8)
    ),
  ),
  Case(
    'fdt.plan',
    'optimizer= that is neither an nnx.Optimizer nor optax',
    fdt.NotAModelError,
    r'optimizer= expected an nnx.Optimizer or an optax transformation; got str',
    'Pass the nnx.Optimizer, or e.g. optax.adamw(1e-3).',
    lambda ctx: fdt.plan(ctx.model(), optimizer='adam'),
  ),
  # Rules
  Case(
    'fdt.plan',
    "rules naming a mesh axis the mesh lacks, with missing_mesh_axes='error'",
    fdt.MissingMeshAxisError,
    r"The rules name mesh axes the mesh lacks \(mesh axes \['data', "
    r"'model'\]\), and they say missing_mesh_axes='error': \('embed', "
    r"'dta'\) names mesh axis 'dta', which the mesh lacks \(did you mean "
    r"'data'\?\)",
    "Fix the name (here 'data'), remove the rule, or let such rules fall "
    "back (missing_mesh_axes='fallback', the default: a likely typo then "
    'warns LikelyTypoWarning).',
    lambda ctx: fdt.plan(
      ctx.model(),
      mesh=ctx.mesh,
      rules=fdt.LogicalRules(
        [('embed', 'dta'), ('mlp', 'model')], missing_mesh_axes='error'
      ),
    ),
  ),
  Case(
    'fdt.LogicalRules',
    'an unknown missing_mesh_axes',
    fdt.LogicalRulesError,
    r"`missing_mesh_axes` must be one of \('fallback', 'error'\)",
    "Pass missing_mesh_axes='fallback' (the default) or 'error'.",
    lambda ctx: fdt.LogicalRules([], missing_mesh_axes='raise'),
  ),
  Case(
    'fdt.LogicalRules.for_mesh_axes',
    'a str where a mesh or its axis names go',
    fdt.LogicalRulesError,
    r'Expected a mesh or a sequence of its axis names \(str\) for '
    r"`for_mesh_axes`, got 'fsdp'",
    "Pass the mesh, or its axis names: for_mesh_axes(('fsdp', 'tp')).",
    lambda ctx: fdt.LogicalRules.for_mesh_axes('fsdp'),
  ),
  Case(
    'fdt.LogicalRules',
    'rules given as a str',
    fdt.LogicalRulesError,
    r'Expected a sequence of \(logical_name, target\) pairs or a dict; got str',
    "Pass pairs, e.g. [('batch', 'data'), ('embed', None)], or a dict.",
    lambda ctx: fdt.LogicalRules('batch=data'),
  ),
  Case(
    'fdt.LogicalRules',
    'a pair of three',
    fdt.LogicalRulesError,
    r'expected a \(logical_name, target\) pair',
    'Give each rule as (logical_name, target).',
    lambda ctx: fdt.LogicalRules([('batch', 'data', 'x')]),
  ),
  Case(
    'fdt.LogicalRules',
    'a target of the wrong type',
    fdt.RuleTargetTypeError,
    r'expected a mesh axis name, a sequence of mesh axis names, or None; got int',
    'Name mesh axes with str, several as a tuple, or None to replicate.',
    lambda ctx: fdt.LogicalRules([('batch', 3)]),
  ),
  Case(
    'fdt.LogicalRules',
    'a mesh axis twice in one target',
    fdt.LogicalRulesError,
    r'names a mesh axis more than once',
    'Name each mesh axis once per target.',
    lambda ctx: fdt.LogicalRules([('batch', ('data', 'data'))]),
  ),
  Case(
    'fdt.LogicalRules',
    'an unknown option',
    fdt.LogicalRulesError,
    r"`unknown` must be one of \('error', 'replicate'\)",
    "Use unknown='error' or unknown='replicate'.",
    lambda ctx: fdt.LogicalRules([], unknown='ignore'),
  ),
  Case(
    'fdt.LogicalRules.from_yaml',
    'a rules file that does not exist',
    fdt.LogicalRulesError,
    r'Cannot read rules file',
    'Pass the path of a YAML file in MaxText format.',
    lambda ctx: fdt.LogicalRules.from_yaml(str(ctx.tmp / 'missing.yaml')),
  ),
  Case(
    'fdt.LogicalRules.from_yaml_text',
    'YAML that is not valid',
    fdt.LogicalRulesError,
    r'is not valid YAML',
    "Fix the file: logical_axis_rules: [['batch', 'data'], ...].",
    lambda ctx: fdt.LogicalRules.from_yaml_text('logical_axis_rules: [[\n'),
  ),
  Case(
    'fdt.LogicalRules.from_yaml_text',
    'a document without rules',
    fdt.LogicalRulesError,
    r'has no `logical_axis_rules` key',
    'Put the pairs under logical_axis_rules:.',
    lambda ctx: fdt.LogicalRules.from_yaml_text('other: 1\nmore: 2\n'),
  ),
  Case(
    'fdt.logical_axis_rules',
    'blocks interleaved by asyncio tasks',
    fdt.LogicalRulesError,
    r'interleaved with it in this thread',
    'Enter rules in code that does not await, or give each task its own '
    'thread with fdt.propagate.',
    _interleaved_blocks,
  ),
  Case(
    'fdt.logical_to_mesh_axes',
    'a logical name no rule mentions',
    fdt.UnknownLogicalAxisError,
    r"\['hidden'\] are not mentioned by any rule.*Add a rule for each",
    "Add a rule for the name, or LogicalRules(..., unknown='replicate').",
    lambda ctx: fdt.logical_to_mesh_axes(('hidden',), rules=ctx.rules),
  ),
  Case(
    'fdt.logical_to_mesh_axes',
    'one logical name on two dimensions',
    fdt.ShardingResolutionError,
    r"\['embed'\] occur more than once",
    'Give each dimension its own logical name.',
    lambda ctx: fdt.logical_to_mesh_axes(('embed', 'embed'), rules=ctx.rules),
  ),
  Case(
    'fdt.logical_to_mesh_axes',
    'more logical axes than the rank',
    fdt.ShardingResolutionError,
    r'shape \(4,\) \(rank 1\) but got 2 logical axes',
    'Annotate at most one logical name (or None) per dimension.',
    lambda ctx: fdt.logical_to_mesh_axes(
      ('embed', 'mlp'), (4,), rules=ctx.rules
    ),
  ),
  Case(
    'fdt.logical_to_mesh_axes',
    'strict rules with no fitting candidate',
    fdt.ShardingResolutionError,
    r"No rule fits dim 0 \('embed'\).*not divisible",
    'Add a fallback rule (a target that divides the dimension, or None).',
    lambda ctx: fdt.logical_to_mesh_axes(
      ('embed',),
      (3,),
      mesh=ctx.mesh,
      rules=fdt.LogicalRules([('embed', 'data')], strict=True),
    ),
  ),
  Case(
    'fdt.logical_to_mesh_axes',
    "Flax's rules naming an axis the mesh lacks",
    fdt.UnknownLogicalAxisError,
    r"maps to 'fsdp', which is not an axis of the mesh.*Flax's",
    'Add the rule, or set rules with fdt.logical_axis_rules for fallbacks.',
    lambda ctx: _with_flax_rules(
      (('embed', 'fsdp'),),
      lambda: fdt.logical_to_mesh_axes(('embed',), (8,), mesh=ctx.mesh),
    ),
  ),
  # Placement
  Case(
    'fdt.shard_value',
    'no mesh',
    fdt.MeshError,
    r'Expected a mesh to place a value.*jax.set_mesh',
    'Use jax.set_mesh(mesh) or pass mesh=.',
    lambda ctx: fdt.shard_value(jnp.ones(8), ('embed',), rules=ctx.rules),
  ),
  Case(
    'fdt.shard_value',
    'a concrete array and only an abstract mesh',
    fdt.MeshError,
    r'Expected a concrete mesh to place a concrete array',
    'Place arrays under jax.set_mesh(mesh) with a real mesh.',
    lambda ctx: fdt.shard_value(
      jnp.ones(8), ('embed',), mesh=ctx.mesh.abstract_mesh, rules=ctx.rules
    ),
  ),
  Case(
    'fdt.shard_value',
    'a dimension over Explicit and Auto axes inside jit',
    fdt.MeshAxisTypeError,
    r'mixes Explicit and Auto mesh axes',
    'Shard each dimension over axes of one type.',
    _jit_mixed_product,
  ),
  Case(
    'fdt.shard_value',
    'Manual axes (inside shard_map)',
    fdt.MeshAxisTypeError,
    r"mesh axes \['data'\] are Manual",
    'Create sharded variables outside shard_map.',
    _manual_axes,
  ),
  Case(
    'fdt.shard_module',
    'an abstract mesh with more positions than devices',
    fdt.MeshError,
    _TOO_BIG_MATCH,
    _TOO_BIG_FIX,
    _shard_module_too_big,
  ),
  Case(
    'fdt.shard_module',
    'a factory where a module is expected',
    fdt.NotAModelError,
    r'got function .*It is callable',
    'Build the model first, or pass the factory to fdt.plan or fdt.init.',
    lambda ctx: fdt.shard_module(
      lambda: nnx.Linear(2, 2, rngs=nnx.Rngs(0)), mesh=ctx.mesh, rules=ctx.rules
    ),
  ),
  Case(
    'fdt.shard_module',
    'a variable naming an axis no rule mentions',
    fdt.UnknownLogicalAxisError,
    r'not mentioned by any rule at kernel',
    'Add a rule for the name.',
    lambda ctx: fdt.shard_module(
      ctx.model(), mesh=ctx.mesh, rules=[('embed', 'data')]
    ),
  ),
  Case(
    'fdt.init',
    'a factory that returns a string, not a module',
    fdt.NotAModelError,
    r"Expected the factory 'a_string' to return an NNX module \(or another "
    r"NNX graph node\), got str: 'str'",
    'Return the model from the factory.',
    lambda ctx: fdt.init(_a_string, mesh=ctx.mesh, rules=ctx.rules),
  ),
  Case(
    'fdt.plan',
    'a factory that returns a number, not a module',
    fdt.NotAModelError,
    r"Expected the factory 'a_number' to return an NNX module .*got int: 42",
    'Return the model from the factory.',
    lambda ctx: fdt.plan(_a_number, mesh=ctx.mesh, rules=ctx.rules),
  ),
  Case(
    'fdt.check',
    'a factory that returns a tuple, not a module',
    fdt.NotAModelError,
    r"Expected the factory 'a_tuple' to return an NNX module .*got tuple: "
    r'\(Linear',
    'Return the model alone from the factory.',
    lambda ctx: fdt.check(_a_tuple, ctx.rules, ctx.mesh),
  ),
  Case(
    'fdt.suggest_rules',
    'a factory that returns a string, not a module',
    fdt.NotAModelError,
    r"Expected the factory 'a_string' to return an NNX module .*got str",
    'Return the model from the factory.',
    lambda ctx: fdt.suggest_rules(_a_string, ctx.mesh),
  ),
  Case(
    'fdt.init',
    'a factory drawing from an nnx.Rngs it was not passed (a closure)',
    fdt.FactoryError,
    r"fdt\.init could not trace '_captures_its_rngs\.make': it changes a "
    r'Flax graph node .*captured from the enclosing scope',
    'Pass the nnx.Rngs as an argument: fdt.init(Model, rngs=rngs).',
    lambda ctx: fdt.init(_captures_its_rngs(), mesh=ctx.mesh, rules=ctx.rules),
  ),
  Case(
    'fdt.init',
    'no mesh',
    fdt.MeshError,
    r'Expected a concrete mesh for `fdt\.init`, but no mesh is set',
    'Use jax.set_mesh(mesh) or pass mesh=.',
    lambda ctx: fdt.init(nnx.Linear, 2, 4, rngs=nnx.Rngs(0), rules=ctx.rules),
  ),
  Case(
    'fdt.init',
    'an abstract mesh with more positions than devices',
    fdt.MeshError,
    r'Expected a concrete mesh for `fdt\.init`.*' + _TOO_BIG_MATCH,
    _TOO_BIG_FIX,
    lambda ctx: fdt.init(
      nnx.Linear, 2, 4, rngs=nnx.Rngs(0), mesh=_TOO_BIG, rules=ctx.rules
    ),
  ),
  Case(
    'fdt.init',
    'no mesh, and a variable without one in its metadata beside others',
    fdt.MeshError,
    r'no mesh is set, and the variables at bias name none in their `mesh` '
    r'metadata \(the others do\)',
    'Use jax.set_mesh(mesh) or pass mesh=, or give it mesh= metadata.',
    lambda ctx: fdt.init(
      nnx.Linear,
      8,
      4,
      kernel_init=nnx.with_partitioning(
        nnx.initializers.ones,
        ('embed', None),
        mesh=jax.make_mesh((8,), ('data',)),
      ),
      bias_init=nnx.with_partitioning(nnx.initializers.zeros, ('embed',)),
      rngs=nnx.Rngs(0),
      rules=ctx.rules,
    ),
  ),
  Case(
    'fdt.plan',
    'a pure dict of arrays',
    fdt.NotAModelError,
    r'Expected NNX variables as the leaves, got ArrayImpl at w',
    'Pass the module or nnx.state(module).',
    lambda ctx: fdt.plan(nnx.State({'w': jnp.ones(2)}), rules=ctx.rules),
  ),
  Case(
    'fdt.plan',
    'something that is no model',
    fdt.NotAModelError,
    r'Expected an NNX module, another NNX graph node .*got int 3',
    'Pass an NNX module, graph node or nnx.State.',
    lambda ctx: fdt.plan(3),
  ),
  # Path rules
  Case(
    'fdt.PathRule',
    'a pattern that is no regular expression',
    fdt.LogicalRulesError,
    r"'layers/\(kernel' is not a valid regular expression \(missing \)",
    'Fix the pattern; escape special characters.',
    lambda ctx: fdt.PathRule('layers/(kernel', ('embed', 'mlp')),
  ),
  Case(
    'fdt.PathRule',
    'one logical name as a bare str',
    fdt.RuleTargetTypeError,
    r"got the str 'embed'. Write \('embed',\) for a 1-D variable",
    "Give one entry per dimension: ('embed',).",
    lambda ctx: fdt.PathRule('bias$', 'embed'),
  ),
  Case(
    'fdt.PathRule',
    '... after the first entry',
    fdt.LogicalRulesError,
    r'\.\.\. may only lead the target',
    'Put ... first: it stands for the leading (stacked) dimensions.',
    lambda ctx: fdt.PathRule('kernel$', ('embed', ..., 'mlp')),
  ),
  Case(
    'fdt.suggest_rules',
    'a style that names no preset',
    fdt.LogicalRulesError,
    r'`style` must be None \(recognise the naming convention from the '
    r"paths\) or one of \['gemma', 'gpt2', 'hf_llama', 'generic'\]; got "
    r"'llama'",
    "Leave `style` out, or name a preset ('hf_llama', 'gemma', 'gpt2') or "
    "'generic'.",
    lambda ctx: fdt.suggest_rules(ctx.model(), ctx.mesh, style='llama'),
  ),
  Case(
    'fdt.suggest_rules',
    'a budget that is not a number of bytes',
    fdt.LogicalRulesError,
    r"`budget` must be an int >= 1 \(bytes per device\); got '8GiB'",
    'Pass bytes: 8 * 2**30 for 8 GiB (the command line reads --budget 8GiB).',
    lambda ctx: fdt.suggest_rules(ctx.model(), ctx.mesh, budget='8GiB'),
  ),
  Case(
    'fdt.suggest_rules',
    'inputs the forward does not take (its traced names)',
    fdt.LogicalRulesError,
    r'Tracing Linear.__call__ on the inputs given \(float32\[4,7\]\) failed '
    r'with TypeError: .*one jax.ShapeDtypeStruct per positional argument',
    'Give one jax.ShapeDtypeStruct per positional argument of the forward.',
    lambda ctx: fdt.suggest_rules(
      ctx.model(),
      ctx.mesh,
      inputs=[jax.ShapeDtypeStruct((4, 7), jnp.float32)],
    ),
  ),
  Case(
    'fdt.suggest_rules',
    'inputs that are not shapes (a string)',
    fdt.LogicalRulesError,
    r'`inputs\[0\]` must be a jax.ShapeDtypeStruct, an array or None',
    'Pass jax.ShapeDtypeStruct((16, 128), jnp.int32) and the like.',
    lambda ctx: fdt.suggest_rules(ctx.model(), ctx.mesh, inputs=['tokens']),
  ),
  Case(
    'fdt.suggest_rules',
    'mesh axis names instead of a mesh',
    fdt.MeshError,
    r'Expected a mesh for `suggest_rules` \(jax.make_mesh or '
    r'jax.sharding.AbstractMesh\), got tuple',
    'Pass the mesh (an AbstractMesh will do: nothing is allocated).',
    lambda ctx: fdt.suggest_rules(ctx.model(), ('data', 'model')),
  ),
  Case(
    'fdt.RulesSuggestion.write',
    'a path in a directory that does not exist',
    fdt.LogicalRulesError,
    r"Cannot write the rules file '.*missing/rules.yaml': No such file or "
    r'directory. Expected a writable path',
    'Write into an existing directory.',
    lambda ctx: fdt.suggest_rules(ctx.model(), ctx.mesh).write(
      ctx.tmp / 'missing' / 'rules.yaml'
    ),
  ),
  Case(
    'fdt.PathRule',
    'a note that is not text',
    fdt.LogicalRulesError,
    r'`note` must be a non-empty str \(why the rule is there\) or None; '
    r'got 3',
    'Say in a few words why the rule is there, or leave the note out.',
    lambda ctx: fdt.PathRule('kernel$', ('embed', 'mlp'), note=3),
  ),
  Case(
    'fdt.PathRule',
    'a type that is no nnx.Variable',
    fdt.LogicalRulesError,
    r'`type` must be an nnx.Variable subclass',
    'Pass nnx.Param, nnx.BatchStat, ... or None.',
    lambda ctx: fdt.PathRule('kernel$', ('embed', 'mlp'), type=np.ndarray),
  ),
  Case(
    'fdt.LogicalRules',
    'a path rule that is not a pair',
    fdt.LogicalRulesError,
    r"path rule #0 'kernel\$': expected a \(pattern, target\) pair",
    'Give each path rule as (pattern, target), or a dict.',
    lambda ctx: fdt.LogicalRules([], path_rules=['kernel$']),
  ),
  Case(
    'fdt.LogicalRules',
    'a negative threshold',
    fdt.LogicalRulesError,
    r'`min_bytes` must be an int >= 0',
    'Pass a size in bytes (or elements, for min_size).',
    lambda ctx: fdt.LogicalRules([], min_bytes=-1),
  ),
  Case(
    'fdt.LogicalRules.from_yaml_text',
    'a path rule with both logical axes and a spec',
    fdt.LogicalRulesError,
    r'expected exactly one of `logical` \(logical axes\) and `spec`',
    'Give a path rule either `logical:` or `spec:`.',
    lambda ctx: fdt.LogicalRules.from_yaml_text(
      "path_rules:\n  - {pattern: 'k$', logical: [a], spec: [data]}\n"
    ),
  ),
  Case(
    'fdt.LogicalRules.from_yaml_text',
    'a path rule naming an unknown variable type',
    fdt.LogicalRulesError,
    r"`type` 'Parm' names no nnx.Variable type; expected one of .*'Param'",
    'Name an nnx.Variable type, e.g. Param or BatchStat.',
    lambda ctx: fdt.LogicalRules.from_yaml_text(
      "path_rules:\n  - {pattern: 'k$', logical: [a], type: Parm}\n"
    ),
  ),
  Case(
    'fdt.LogicalRules.from_yaml_text',
    'path_rules that are not a list',
    fdt.LogicalRulesError,
    r'`path_rules` must be a list of path rules; got dict',
    'Write path_rules: as a YAML list.',
    lambda ctx: fdt.LogicalRules.from_yaml_text(
      'path_rules: {kernel: [embed, mlp]}\n'
    ),
  ),
  Case(
    'fdt.plan',
    'a path rule whose target does not fit the rank',
    fdt.ShardingResolutionError,
    r"path rule #0 'kernel\$' matches 'kernel', of shape \(8, 16\) \(rank "
    r"2\), but its target \('embed',\) has 1 entry.*\(\.\.\., 'embed'\)",
    'Give one entry per dimension, or lead the target with ... .',
    lambda ctx: fdt.plan(
      lambda: nnx.Linear(8, 16, rngs=nnx.Rngs(0)),
      mesh=ctx.mesh,
      rules=fdt.LogicalRules(ctx.rules, path_rules=[('kernel$', ('embed',))]),
    ),
  ),
  Case(
    'fdt.plan',
    'a strict path rule spec that does not fit',
    fdt.ShardingResolutionError,
    r"mesh axes 'model' of path rule #0 'kernel\$' cannot shard dim 1 at "
    r'kernel .*not divisible by 4',
    'Change the spec, or drop strict=True to replicate that dimension.',
    lambda ctx: fdt.plan(
      lambda: nnx.Linear(8, 6, rngs=nnx.Rngs(0)),
      mesh=ctx.mesh,
      rules=fdt.LogicalRules(
        [], strict=True, path_rules=[('kernel$', P('data', 'model'))]
      ),
    ),
  ),
  Case(
    'fdt.plan',
    'logical_axes= for a module',
    fdt.NotAModelError,
    r'`logical_axes=` is for a pytree of arrays',
    'Annotate the variables, or use path rules.',
    lambda ctx: fdt.plan(ctx.model(), logical_axes={'kernel': ('a', 'b')}),
  ),
  Case(
    'nnx.Module (eager, under path rules)',
    'no mesh set',
    fdt.MeshError,
    r"place the variable at kernel, which path rule #0 'kernel\$' covers, "
    r'but no mesh is set',
    'Build under jax.set_mesh(mesh), or use fdt.init(..., mesh=mesh).',
    lambda ctx: _eager_without_mesh(),
  ),
  Case(
    'fdt.shard_tree',
    'logical_axes that do not mirror the tree',
    fdt.ShardingResolutionError,
    r'Expected `logical_axes` to have the structure of the tree',
    'Mirror the tree, with axes or None for each array.',
    lambda ctx: fdt.shard_tree(
      {'w': np.ones((8, 8)), 'b': np.ones(8)},
      ctx.rules,
      mesh=ctx.mesh,
      logical_axes={'w': ('embed', 'mlp')},
    ),
  ),
  Case(
    'fdt.shard_tree',
    'an abstract array',
    fdt.NotAModelError,
    r"Expected a concrete array at 'w' to place; got ShapeDtypeStruct",
    'Pass arrays with values; plan abstract ones with fdt.plan.',
    lambda ctx: fdt.shard_tree(
      {'w': jax.ShapeDtypeStruct((8, 8), jnp.float32)}, ctx.rules, mesh=ctx.mesh
    ),
  ),
  Case(
    'fdt.shard_tree',
    'an abstract mesh',
    fdt.MeshError,
    r'Expected a concrete mesh to place arrays, got the abstract',
    'Pass a jax.sharding.Mesh.',
    lambda ctx: fdt.shard_tree(
      {'w': np.ones(8)}, ctx.rules, mesh=ctx.mesh.abstract_mesh
    ),
  ),
  Case(
    'fdt.gather_tree',
    'abstract arrays',
    fdt.NotAModelError,
    r"Expected concrete arrays to gather; got ShapeDtypeStruct at 'w'",
    'Gather arrays with values.',
    lambda ctx: fdt.gather_tree({'w': jax.ShapeDtypeStruct((8,), jnp.float32)}),
  ),
  # The installed libraries
  Case(
    'flax_dtensor (its first public name)',
    'a Flax (or JAX) release outside the supported range',
    fdt.FlaxCompatibilityError,
    r'flax_dtensor supports jax>=0\.10\.2,<0\.13, flax>=0\.12\.8,<0\.13, but '
    r'found flax 0\.13\.0\. .* Install a supported release',
    'Install a supported release (pip install "flax>=0.12.8,<0.13"), or a '
    'flax_dtensor that supports yours; the compatibility page lists the '
    'tested pairs.',
    _in_a_fresh_process(
      """
      import flax
      flax.__version__ = '0.13.0'
      import flax_dtensor
      flax_dtensor.LogicalRules
      """,
      imports=True,
    ),
  ),
  # DTensor set-up
  Case(
    'flax_dtensor.dtensor (any function)',
    'TensorFlow not installed',
    ImportError,
    r'needs TensorFlow.*pip install "flax-dtensor\[tf\]"',
    'pip install "flax-dtensor[tf]".',
    _in_a_fresh_process(
      """
      sys.modules['tensorflow'] = None
      from flax_dtensor import dtensor
      dtensor.initialize()
      """,
      imports=True,
    ),
  ),
  Case(
    'flax_dtensor.dtensor.to_tf_module',
    'DTensor not initialized',
    fdt.DTensorInitializationError,
    r'TF DTensor is not initialized.*initialize\(\)',
    'Call flax_dtensor.dtensor.initialize() first thing.',
    _in_a_fresh_process(
      """
      import jax
      jax.config.update('jax_num_cpu_devices', 8)
      from flax import nnx
      from flax_dtensor import dtensor
      dtensor.to_tf_module(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
      """,
      group='dtensor-not-initialized',
    ),
  ),
  Case(
    'flax_dtensor.dtensor.initialize',
    'DTensor set up elsewhere with another device count',
    fdt.DTensorInitializationError,
    r'one logical CPU device per local JAX device: expected 8 .*got 4',
    'Let flax_dtensor.dtensor.initialize() set DTensor up.',
    _in_a_fresh_process(
      """
      import jax
      jax.config.update('jax_num_cpu_devices', 8)
      import tensorflow as tf
      tf.experimental.dtensor.initialize_accelerator_system(
          device_type='CPU', num_logical_cpu_devices=4)
      from flax_dtensor import dtensor
      dtensor.initialize()
      """
    ),
  ),
  Case(
    'flax_dtensor.dtensor.initialize',
    'DTENSOR_JOBS that do not match the JAX processes',
    fdt.DTensorInitializationError,
    r'one client per JAX process: expected 1 DTensor client.*got 2',
    'Set DTENSOR_JOBS to one host:port per JAX process, or unset it.',
    _in_a_fresh_process(
      """
      import os
      os.environ['DTENSOR_JOBS'] = '127.0.0.1:1,127.0.0.1:2'
      from flax_dtensor import dtensor
      try:
        dtensor.initialize()
      finally:
        del os.environ['DTENSOR_JOBS']
      """,
      group='dtensor-not-initialized',
    ),
  ),
  Case(
    'flax_dtensor.dtensor.shutdown',
    'shut down before initializing',
    fdt.DTensorInitializationError,
    r'shutdown\(\) was called but TF DTensor is not initialized',
    'Only shut down what initialize() set up.',
    _in_a_fresh_process(
      """
      from flax_dtensor import dtensor
      import tensorflow
      dtensor.shutdown()
      """,
      group='dtensor-not-initialized',
    ),
  ),
  Case(
    'flax_dtensor.dtensor.initialize',
    'TensorFlow already ran something',
    fdt.DTensorInitializationError,
    r'TensorFlow was already initialized.*reset_context=True',
    'Call initialize() before any other TensorFlow operation.',
    # The last of its group: TensorFlow runs something.
    _in_a_fresh_process(
      """
      import tensorflow as tf
      tf.constant(1.0) + 1
      from flax_dtensor import dtensor
      dtensor.initialize()
      """,
      group='dtensor-not-initialized',
    ),
  ),
  # DTensor conversions
  Case(
    'flax_dtensor.dtensor.mesh_to_dtensor',
    'an abstract mesh',
    fdt.DTensorError,
    r'Expected a concrete `jax.sharding.Mesh`',
    'Pass a mesh with devices (jax.make_mesh).',
    lambda ctx: ctx.dt.mesh_to_dtensor(ctx.mesh.abstract_mesh),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.mesh_to_dtensor',
    'a mesh axis name DTensor cannot parse',
    fdt.DTensorError,
    r"Expected mesh axis names DTensor can use.*'a,b'",
    "Rename the mesh axis: letters, digits, '_', '-' and '.'.",
    lambda ctx: ctx.dt.mesh_to_dtensor(jax.make_mesh((8,), ('a,b',))),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.layout_for',
    'a negative rank',
    fdt.DTensorError,
    r'Expected `ndim` to be a non-negative int, got -1',
    'Pass the rank of the arrays.',
    lambda ctx: ctx.dt.layout_for(NamedSharding(ctx.mesh, P()), -1),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.array_to_dtensor',
    'a NumPy array',
    fdt.DTensorError,
    r'Expected a jax.Array, got ndarray',
    'jax.device_put it on a mesh first.',
    lambda ctx: ctx.dt.array_to_dtensor(np.ones(4)),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.array_to_dtensor',
    'a donated (deleted) array',
    fdt.DTensorError,
    r'Expected a live jax.Array, got a deleted one',
    'Convert the array before donating it.',
    lambda ctx: ctx.dt.array_to_dtensor(_deleted()),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.dtensor_to_array',
    'a plain TF tensor',
    fdt.DTensorError,
    r'Expected a TF DTensor',
    'Pass a DTensor (from array_to_dtensor or dtensor.pack).',
    lambda ctx: ctx.dt.dtensor_to_array(ctx.tf.constant([1.0])),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.dtensor_to_array',
    'both mesh= and sharding=',
    fdt.DTensorError,
    r'Expected at most one of `mesh` and `sharding`',
    'Pass one of them.',
    lambda ctx: ctx.dt.dtensor_to_array(
      ctx.dt.array_to_dtensor(jnp.ones(8)),
      mesh=ctx.mesh,
      sharding=NamedSharding(ctx.mesh, P()),
    ),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.to_tf_module',
    'an abstract model',
    fdt.ExportError,
    r'Expected a concrete array .*got an abstract',
    'Export real values, or fill them with restore_checkpoint first.',
    lambda ctx: ctx.dt.to_tf_module(
      nnx.eval_shape(lambda: nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    ),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.to_tf_module',
    'a uint64 variable',
    fdt.ExportError,
    r"'w' has dtype uint64, which TF cannot store",
    'Cast it (e.g. to int64) or leave it out with exclude=.',
    lambda ctx: ctx.dt.to_tf_module(
      nnx.Dict(w=nnx.Variable(np.zeros(3, np.uint64))), include=...
    ),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.to_tf_module',
    'filters that select nothing',
    fdt.ExportError,
    r'No NNX variable of module_or_state matched',
    'Check include= and exclude=.',
    lambda ctx: ctx.dt.to_tf_module(ctx.model(), include=nnx.OptState),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.flat_variables',
    'something that is not from to_tf_module',
    fdt.ExportError,
    r'Expected a tf.Module from to_tf_module',
    'Pass what to_tf_module or tf.saved_model.load returned.',
    lambda ctx: ctx.dt.flat_variables(object()),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.checkpoint_key',
    'a path key that is neither str nor int',
    fdt.ExportError,
    r'Expected NNX path keys of type str or int, got float',
    'Name attributes and dict entries with str.',
    lambda ctx: __import__('flax_dtensor.dtensor').dtensor.checkpoint_key(
      ('a', 1.5)
    ),
  ),
  # Checkpoints
  Case(
    'flax_dtensor.dtensor.save_checkpoint',
    'a factory where a model is expected',
    fdt.NotAModelError,
    r'It is callable',
    'Build the model first.',
    lambda ctx: ctx.dt.save_checkpoint(
      lambda: nnx.Linear(2, 2, rngs=nnx.Rngs(0)), ctx.tmp / 'x'
    ),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.save_checkpoint',
    'a directory that exists',
    fdt.ExportError,
    r'already exists\. Pass `overwrite=True`',
    'Pass overwrite=True, or choose another directory.',
    lambda ctx: ctx.dt.save_checkpoint(ctx.model(), ctx.checkpoint),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.save_checkpoint',
    'overwriting a directory that is not an export',
    fdt.ExportError,
    r'Refusing to overwrite .*without a flax_dtensor.json manifest',
    'Choose a new directory; overwrite= only replaces exports.',
    lambda ctx: ctx.dt.save_checkpoint(
      ctx.model(), _user_directory(ctx), overwrite=True
    ),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.save_checkpoint',
    'overwriting the current directory',
    fdt.ExportError,
    r'Refusing to overwrite .*the current directory or one of its ancestors',
    'Choose a new directory for the export.',
    lambda ctx: ctx.dt.save_checkpoint(ctx.model(), '.', overwrite=True),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.save_checkpoint',
    'a file where a parent directory would be created',
    fdt.ExportError,
    r'An ancestor of export target .* is not a directory: .* is a file',
    'Move that file away, or choose another path.',
    lambda ctx: ctx.dt.save_checkpoint(
      ctx.model(),
      # The file written first (write_text returns its length, not 0).
      (ctx.tmp / 'in_the_way').write_text('x')
      and ctx.tmp / 'in_the_way' / 'no' / 'c',
    ),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.save_checkpoint',
    'a remote URL (gs://, s3://)',
    fdt.ExportError,
    r"got the URL 'gs://b/c'.*Supported: a local filesystem path",
    'Write locally (or to a mounted filesystem), then copy.',
    lambda ctx: ctx.dt.save_checkpoint(ctx.model(), 'gs://b/c'),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.read_checkpoint',
    'a directory without a checkpoint',
    fdt_tf.ExportNotFoundError,
    r'holds no TF checkpoint',
    'Pass the directory save_checkpoint returned.',
    lambda ctx: ctx.dt.read_checkpoint(ctx.tmp),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.read_checkpoint',
    'a manifest edited by hand',
    fdt_tf.MalformedExportError,
    r'is damaged: bias has shape \(16,\) in the data, \(32,\) in the manifest',
    'Restore an intact copy, or re-export.',
    _edited_manifest,
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.restore_checkpoint',
    'a manifest naming files outside its directory (../, /abs)',
    fdt_tf.MalformedExportError,
    r"the checkpoint_prefix '\.\./ckpt/ckpt' is refused: it has a `\.\.` "
    'component',
    'Use only checkpoints whose manifest names paths inside them; re-export.',
    _prefix_outside,
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.restore_checkpoint',
    'a checkpoint file that is a symbolic link out of the directory',
    fdt_tf.MalformedExportError,
    r'is damaged: ckpt\.index is refused: it resolves to .*, outside the '
    r'export \(a symbolic link\)',
    'Copy the real files into the directory (cp -L), or re-export.',
    _linked_out,
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.read_checkpoint',
    'a data file on disk that the manifest does not list',
    fdt_tf.MalformedExportError,
    r'is damaged: .*ckpt\.data-\S+ is on disk but not in the manifest',
    'Restore an intact copy, or re-export.',
    _unlisted,
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.restore_checkpoint',
    'a manifest with fewer shard checksums than its layout has shards',
    fdt_tf.MalformedExportError,
    r'is not a valid flax_dtensor manifest: kernel has 7 shard checksums, '
    r"where its layout \(\[\['data'\], \['model'\]\] over data=2,model=4\) "
    'implies 8 shards',
    'Restore an intact copy, or re-export.',
    _checksum_missing,
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.restore_checkpoint',
    'a version-3 manifest missing the record of a shard',
    fdt_tf.MalformedExportError,
    r'the shards recorded for kernel do not cover \[4:8, 12:16\], so those '
    'values were never saved or their records are lost',
    'Restore an intact copy, or re-export: nothing on disk says what those '
    'values are.',
    _version_3_record_missing,
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.read_checkpoint',
    'a version-2 manifest (no checksums)',
    fdt_tf.MalformedExportError,
    r'its version is 2;.*version 2, without checksums, is not read: re-save',
    'Re-save the model with save_checkpoint or save_saved_model.',
    _version_2,
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.restore_checkpoint',
    'a deeply nested manifest',
    fdt_tf.MalformedExportError,
    r'is not a valid flax_dtensor manifest: it nests deeper than Python',
    'Restore an intact copy, or re-export.',
    _deeply_nested,
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.read_checkpoint',
    'a manifest with a key twice in one object',
    fdt_tf.MalformedExportError,
    r"is not a valid flax_dtensor manifest: ValueError: the key 'version' "
    'appears twice',
    'Restore an intact copy, or re-export.',
    _duplicate_keys,
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.read_checkpoint',
    "a TF 'checkpoint' file naming a checkpoint elsewhere",
    fdt_tf.MalformedExportError,
    r'The checkpoint state file of .* names the prefix .*outside the export',
    'Pass the prefix itself if you trust that checkpoint.',
    _state_file_outside,
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.restore_checkpoint',
    'a data file damaged on disk',
    fdt_tf.DamagedExportError,
    r'is damaged: ckpt\.data-\S+ bytes 0\.\.\d+ changed.*Nothing was '
    r'restored: the target is unchanged',
    'Restore an intact copy, or re-export.',
    _damaged_data,
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.restore_checkpoint',
    'a model without a variable the checkpoint has',
    fdt.ExportError,
    r'holds 1 variable\(s\) the target does not have: bias.*allow_extra',
    'Restore into the model that was saved, or pass allow_extra=True.',
    lambda ctx: ctx.dt.restore_checkpoint(
      ctx.checkpoint, nnx.Dict(kernel=ctx.model().kernel)
    ),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.restore_checkpoint',
    'a model with a variable the checkpoint lacks',
    fdt.ExportError,
    r"has no variable 'extra'.*which the target needs",
    'Restore with a narrower include=/exclude=, or the matching checkpoint.',
    lambda ctx: ctx.dt.restore_checkpoint(
      ctx.checkpoint,
      nnx.Dict(
        kernel=ctx.model().kernel,
        bias=ctx.model().bias,
        extra=nnx.Param(jnp.ones(2)),
      ),
    ),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.restore_checkpoint',
    'a model of another shape',
    fdt.ExportError,
    r"Shape mismatch for 2 variables: 'bias': the target expects \(32,\)",
    'Build the target with the saved configuration.',
    lambda ctx: ctx.dt.restore_checkpoint(ctx.checkpoint, ctx.model(width=32)),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.restore_checkpoint',
    'a model of another dtype',
    fdt.ExportError,
    r"Dtype mismatch for 2 variables: 'bias': the target expects bfloat16.*"
    r'`convert_dtypes=True`',
    'Build the target in the saved dtype, or pass convert_dtypes=True.',
    lambda ctx: ctx.dt.restore_checkpoint(
      ctx.checkpoint,
      jax.tree.map(lambda x: x.astype(jnp.bfloat16), ctx.model()),
    ),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.restore_checkpoint',
    'an abstract model whose RNG state is not restored',
    fdt.ExportError,
    r'The target is abstract, and 2 of its variables are not restored.*'
    r'`rng_seed=`',
    'Pass rng_seed=, restore those variables too, or a concrete target.',
    _abstract_leftovers,
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.restore_checkpoint',
    'an abstract target and no concrete mesh',
    fdt.ExportError,
    r'has a sharding on an abstract mesh.*jax.set_mesh\(mesh\), or pass `mesh=`',
    'Call it under jax.set_mesh(mesh), or pass mesh=.',
    _abstract_without_mesh,
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.restore_checkpoint',
    'an abstract target on a mesh with more positions than devices',
    fdt.ExportError,
    r'has a sharding on an abstract mesh.*' + _TOO_BIG_MATCH,
    _TOO_BIG_FIX,
    lambda ctx: _abstract_without_mesh(ctx, _TOO_BIG),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.restore_checkpoint',
    'files replaced by another save during the restore',
    fdt_tf.DamagedExportError,
    r'is damaged: bias\[0:16\] read back with CRC-32C .*found in the bytes '
    r'read, so the files may also have changed during the read.*Nothing was '
    r'restored: the target is unchanged',
    'Read again once the other save is done; restore from an intact copy.',
    _replaced_while_restoring,
    tf=True,
  ),
  # Faults of the machine
  Case(
    'flax_dtensor.dtensor.save_checkpoint',
    'a parent path that is a file',
    fdt.ExportError,
    r"The parent of export target .* is not a directory: '.*a_file' is a "
    r'file',
    'Choose a path inside a directory.',
    _file_parent,
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.save_checkpoint',
    'a parent directory this user may not write in (or read-only)',
    fdt.ExportError,
    r'Cannot write export target .*: its parent directory .* is not '
    r'writable \(this process \(uid \d+\) may not write in it',
    'Save in a directory you may write in, or change its permissions.',
    lambda ctx: _recorded(
      fault_runs.unwritable()['errors']['read-only parent']
    ),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.save_checkpoint',
    "overwriting an export this user may not delete (someone else's)",
    fdt.ExportError,
    r'Cannot replace .* is not writable .*so the old export could not be '
    r'deleted once the new one is in place',
    'Save to a new directory, or have its owner remove it.',
    lambda ctx: _recorded(fault_runs.unwritable()['errors']['not deletable']),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.save_checkpoint',
    'another save to the same path in progress',
    fdt_tf.SaveInProgressError,
    r'Another save to .* is in progress \(pid 1 on host .*Wait for it to '
    r'finish, or save elsewhere',
    'Wait for the other save, or save elsewhere.',
    _in_progress,
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.save_checkpoint',
    'no space left on the disk (ENOSPC)',
    fdt_tf.DiskFullError,
    r"failed: No space left on device: the export's variables alone take "
    r'.* bytes\), and .* bytes\) are free on the filesystem of .*is '
    r'unchanged, and the partial one was removed',
    'Free space (an overwrite needs room for both versions) or save elsewhere.',
    _no_space,
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.save_checkpoint',
    'a file-size limit reached mid-save (EFBIG, `ulimit -f`)',
    fdt_tf.DiskFullError,
    r'failed: File too large: this process may write files of at most .*'
    r'RLIMIT_FSIZE.*is unchanged, and the partial one was removed\. Raise '
    r'the limit',
    'Raise the limit (ulimit -f unlimited), then save again.',
    lambda ctx: _recorded(fault_runs.full_disk()['attempts']['data']['error']),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.save_checkpoint',
    'another process of a multi-process save died',
    fdt_tf.PeerError,
    r'Process 1 of 2 stopped during the save to .*: no heartbeat from it '
    r'for \d+ s .*FLAX_DTENSOR_PEER_TIMEOUT sets this bound.*holds the '
    r'previous checkpoint or the new one, whole',
    'Restart every process of the job; set FLAX_DTENSOR_PEER_TIMEOUT for '
    'another bound.',
    lambda ctx: _recorded_text(fault_runs.dead_peer('at-barrier')),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.SaveHandle',
    'another process of a multi-process background save died (at `wait()`)',
    fdt_tf.PeerError,
    r'Process 2 of 4 stopped during the save to .*: no heartbeat from it '
    r'for \d+ s .*FLAX_DTENSOR_PEER_TIMEOUT sets this bound.*holds the '
    r'previous checkpoint or the new one, whole',
    'Restart every process of the job; set FLAX_DTENSOR_PEER_TIMEOUT for '
    'another bound.',
    lambda ctx: _recorded_text(
      scale_runs.four_processes()['results'][0]['dead_peer']
    ),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.initialize',
    'a process of the job never calls it (no DTENSOR_* variables set)',
    fdt.DTensorInitializationError,
    r'Process 1 of 2 stopped during the set-up of TF DTensor, which every '
    r"process's flax_dtensor\.dtensor\.initialize\(\) joins: no heartbeat "
    r'from it for \d+ s',
    'Call initialize() in every process, after jax.distributed.initialize().',
    lambda ctx: _recorded(
      ['DTensorInitializationError', fault_runs.absent_peer()['error']]
    ),
  ),
  Case(
    'flax_dtensor.dtensor.initialize',
    'a JAX coordinator address this host has no route to (what it sets '
    'DTENSOR_JOBS from)',
    fdt.DTensorInitializationError,
    r'TF DTensor needs an address and a free port in each process: expected '
    r"to find this host's address towards JAX's coordinator "
    r"'no-such-host\.invalid:1234' and a free port on it, got gaierror",
    "Fix jax.distributed.initialize()'s coordinator_address, or set the "
    'DTENSOR_* variables yourself.',
    # What initialize() runs with JAX's coordinator address (a job of one
    # process never gets there).
    lambda ctx: _topology().reserve('no-such-host.invalid:1234'),
  ),
  Case(
    'flax_dtensor.dtensor.SaveHandle',
    'a file-size limit reached by a background save (raised by `wait()`)',
    fdt_tf.DiskFullError,
    r'failed: File too large: this process may write files of at most .*'
    r'RLIMIT_FSIZE.*is unchanged, and the partial one was removed\. Raise '
    r'the limit',
    'Raise the limit (ulimit -f unlimited), then save again.',
    lambda ctx: _recorded(
      fault_runs.full_disk()['attempts']['manifest_async']['error']
    ),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.save_checkpoint',
    'FLAX_DTENSOR_PEER_TIMEOUT that is not a number of seconds',
    fdt.ExportError,
    r'Expected FLAX_DTENSOR_PEER_TIMEOUT to be a positive number of '
    r"seconds, got 'soon'",
    'Set it to a number of seconds, e.g. 60, or unset it.',
    _bad_peer_timeout,
    tf=True,
  ),
  # The command line's writes (its --out folder)
  Case(
    'flax-dtensor demo',
    "a file-size limit or a full disk during the Orbax checkpoint's write "
    '(TensorStore: OUT_OF_RANGE, RESOURCE_EXHAUSTED)',
    fdt_tf.DiskFullError,
    r"Writing '/\S+/out' failed: File too large: this process may write "
    r'files of at most .*RLIMIT_FSIZE.*The previous export at '
    r"'/\S+/out', if any, is unchanged, and the partial one was removed",
    'Free space or raise the limit, or pass another --out; exit status 2.',
    lambda ctx: _write_fault(ctx, 'demo-full'),
  ),
  Case(
    'flax-dtensor export',
    'a file-size limit or a full disk during the checkpoint',
    fdt_tf.DiskFullError,
    r"Writing '/\S+/out/checkpoint' failed: File too large: .*The "
    r"previous export at '/\S+/out/checkpoint', if any, is unchanged",
    'Free space or raise the limit, or pass another --out; exit status 2.',
    lambda ctx: _write_fault(ctx, 'export-full'),
  ),
  Case(
    'flax-dtensor demo',
    '--out in a directory this user may not write in (or read-only)',
    _command.BadInputError,
    r"--out 'ro/sub/out' cannot be written: 'ro' is not writable \(this "
    r'process \(uid \d+\) may not write in it',
    'Pass a directory you may write in; said before the model is built.',
    lambda ctx: _write_fault(ctx, 'demo-unwritable'),
  ),
  Case(
    'flax-dtensor demo',
    "the OS refusing a part's write (permission, read-only filesystem, "
    'I/O error)',
    fdt.ExportError,
    r"Writing the output folder '/\S+/out' failed \(its part 'orbax'\): "
    r'Permission denied\. The previous output there, if any, is unchanged',
    'Choose a --out you may write in (or on a writable filesystem).',
    lambda ctx: _write_fault(ctx, 'orbax-denied'),
  ),
  # SavedModels
  Case(
    'flax_dtensor.dtensor.ServingSignature',
    'a signature key serving clients cannot call',
    fdt.ExportError,
    r"Expected each key of `signatures` to be a plain name .* got '9 x'",
    "Name each signature as clients call it, e.g. 'embed'.",
    lambda ctx: ctx.dt.save_saved_model(
      ctx.model(),
      ctx.tmp / 'sm',
      signatures={
        '9 x': ctx.dt.ServingSignature([ctx.tf.TensorSpec([None, 8])])
      },
    ),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.ServingSignature',
    'a preprocess that is not a function',
    fdt.ExportError,
    r"Expected the preprocess of `signatures\['serving_default'\]` to be "
    r'a TF function \(a callable\), got str',
    "Pass a function of the signature's inputs (or None).",
    lambda ctx: ctx.dt.save_saved_model(
      ctx.model(),
      ctx.tmp / 'sm',
      signatures={
        'serving_default': ctx.dt.ServingSignature(
          [ctx.tf.TensorSpec([None, 8])], preprocess='lowercase'
        )
      },
    ),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.verify_saved_model',
    'a directory that holds no SavedModel',
    fdt_tf.ExportNotFoundError,
    r'Expected a SavedModel in .*, found no saved_model\.pb there',
    'Pass the directory save_saved_model wrote.',
    lambda ctx: ctx.dt.verify_saved_model(
      ctx.model(),
      ctx.tmp,
      {'serving_default': np.ones((2, 8), np.float32)},
      input_signature=[ctx.tf.TensorSpec([None, 8])],
    ),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.restore_from_tf',
    'a path that does not exist',
    fdt_tf.ExportNotFoundError,
    r"'.*no-such-model' does not exist",
    'Pass the SavedModel or checkpoint TF wrote (a checkpoint prefix where '
    'there is no `checkpoint` file).',
    lambda ctx: ctx.dt.restore_from_tf(ctx.tmp / 'no-such-model', ctx.model()),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.save_saved_model',
    'a method the module does not have',
    fdt.ExportError,
    r"Expected `method` to name a method of the module, got 'predict'",
    'Name a method of the module.',
    lambda ctx: ctx.dt.save_saved_model(
      ctx.model(),
      ctx.tmp / 'sm',
      input_signature=[ctx.tf.TensorSpec([None, 8])],
      method='predict',
    ),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.save_saved_model',
    'an input signature of the wrong type',
    fdt.ExportError,
    r'Expected each entry of `input_signature` to be a tf.TensorSpec',
    'Give tf.TensorSpec or jax.ShapeDtypeStruct entries, and None for an '
    'argument passed as None.',
    lambda ctx: ctx.dt.save_saved_model(
      ctx.model(), ctx.tmp / 'sm', input_signature=[(None, 8)]
    ),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.save_saved_model',
    'one spec, not a list of them',
    fdt.ExportError,
    r'Expected `input_signature` to be a list with one entry per positional '
    r'parameter of the method, got TensorSpec',
    'Pass a list: input_signature=[tf.TensorSpec(...)].',
    lambda ctx: ctx.dt.save_saved_model(
      ctx.model(), ctx.tmp / 'sm', input_signature=ctx.tf.TensorSpec([None, 8])
    ),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.save_saved_model',
    "a signature that does not fit the method's parameters",
    fdt.ExportError,
    r'Expected `input_signature` to fit LanguageModel\.__call__\(tokens, '
    r'positions, cache, attention_mask\), which takes 4 positional '
    r'arguments; got 3 entries: \[TensorSpec\(\[None, 4\], int32\), .*None '
    r'for an argument passed as None',
    'Give one entry per positional parameter, in order, and None for an '
    'argument passed as None (e.g. an empty cache).',
    lambda ctx: _serve_lm(
      ctx,
      [
        ctx.tf.TensorSpec([None, 4], ctx.tf.int32),
        ctx.tf.TensorSpec([None, 4], ctx.tf.int32),
        ctx.tf.TensorSpec([None, 4, 4], ctx.tf.bool),
      ],
    ),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.save_saved_model',
    'a polymorphic shape for an argument passed as None',
    fdt.ExportError,
    r'Expected None in `polymorphic_shapes` where `input_signature` has None '
    r'\(at \[2\]\)',
    'Write None there, or give the shapes of the arrays only.',
    lambda ctx: _serve_lm(
      ctx, polymorphic_shapes=['(b, 4)', '(b, 4)', '(b,)', '(b, 4, 4)']
    ),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.save_saved_model',
    'None dimensions, each a size of its own, that must be equal',
    fdt.ExportError,
    r'Tracing LanguageModel\.__call__ for the SavedModel failed where its '
    r"polymorphic dimensions meet .* a leading None is the batch 'b', .* any "
    r'other None is a size of its own, .* input_0 \(b, d0_1\), input_1 '
    r"\(b, d1_1\), input_3 \(b, d3_1, d3_2\)\. .* polymorphic_shapes=\['\(b, "
    r"t\)', '\(b, t\)', None, '\(b, t, t\)'\]",
    'Name the dimensions that are always equal alike in `polymorphic_shapes`, '
    "e.g. ['(b, t)', '(b, t)', None, '(b, t, t)'].",
    _lengths_of_their_own,
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.save_saved_model',
    'a result holding something other than arrays and None',
    fdt.ExportError,
    r'Expected the result of LanguageModel\.tagged to hold only arrays and '
    r"None, got str at result\[1\]: 'v1'",
    'Return arrays in tuples, lists and dicts; compute the rest outside the '
    'served method.',
    lambda ctx: _serve_lm(ctx, method='tagged'),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.save_saved_model',
    'a result JAX cannot flatten (dict keys that do not sort)',
    fdt.ExportError,
    r'Expected the result of LanguageModel\.mixed_keys to be a pytree of '
    r'arrays and None, got one JAX cannot flatten',
    'Key dicts with str keys only.',
    lambda ctx: _serve_lm(ctx, method='mixed_keys'),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.save_saved_model',
    'two arrays of one output name',
    fdt.ExportError,
    r"to have a name of its own, got 'a/b' twice: at "
    r"result\['a'\]\['b'\] and result\['a/b'\]",
    "Rename one of the keys (nested keys are joined by '/').",
    lambda ctx: _serve_lm(ctx, method='clashing'),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.save_saved_model',
    'a result without an array',
    fdt.ExportError,
    r'Expected the result of LanguageModel\.nothing to hold at least one '
    r'array, got None',
    'Return the arrays to serve.',
    lambda ctx: _serve_lm(ctx, method='nothing'),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.save_saved_model',
    'a forward pass whose StableHLO TensorFlow cannot load',
    fdt.ExportError,
    r'save_saved_model: the installed TensorFlow .* cannot load the '
    r'StableHLO module that JAX .* wrote for the forward pass .* '
    r"TensorFlow's XlaCallModule loader, the one that serves the "
    r'SavedModel, said: .* Nothing was written\. Install a TensorFlow that '
    r'reads what this JAX writes',
    'Install a TensorFlow that reads what this JAX writes (a newer '
    'tensorflow-cpu or tf-nightly), or a JAX and TF pair from the '
    'compatibility page.',
    lambda ctx: _unreadable_stablehlo(ctx),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.save_saved_model',
    'a bare PartitionSpec constraint, and no mesh anywhere',
    fdt.ExportError,
    r'Tracing BareConstraint\.__call__ for the SavedModel failed: it '
    r'constrains a sharding with a bare PartitionSpec, which needs a mesh in '
    r'context, and none is set, nor are the exported variables laid out on '
    r'one .* Export inside `with jax\.set_mesh\(mesh\):`',
    'Export inside `with jax.set_mesh(mesh):` (a model whose variables are '
    'on a mesh is traced under it).',
    lambda ctx: _bare_constraint(ctx),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.save_saved_model',
    'a gather limit that is not a number of bytes',
    fdt.ExportError,
    r'Expected `max_gather_bytes` to be a non-negative int .* got -1',
    'Pass a number of bytes; in a multi-process run, what process 0 can hold.',
    lambda ctx: ctx.dt.save_saved_model(
      ctx.model(),
      ctx.tmp / 'sm',
      input_signature=[ctx.tf.TensorSpec([None, 8])],
      max_gather_bytes=-1,
    ),
    tf=True,
  ),
  # The way back from TF, in memory
  Case(
    'flax_dtensor.dtensor.from_tf_module',
    'something other than TF variables',
    fdt.ExportError,
    r'Expected a tf\.Module from to_tf_module .* got Linear',
    'Pass the tf.Module of to_tf_module, or a dict of TF variables by path.',
    lambda ctx: ctx.dt.from_tf_module(ctx.model(), ctx.model()),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.from_tf_module',
    'a dict key that is not an NNX path',
    fdt.ExportError,
    r'got the key 0 \(int\)\. Key each variable by its NNX path',
    "Key the dict by NNX path: ('layers', 0, 'kernel') or 'layers/0/kernel'.",
    lambda ctx: ctx.dt.from_tf_module({0: ctx.tf.Variable([1.0])}, ctx.model()),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.from_tf_module',
    'two TF variables for one NNX path',
    fdt.ExportError,
    r"two TF variables for the NNX path 'bias': \('bias',\) and 'bias'",
    'Keep one variable per path.',
    lambda ctx: ctx.dt.from_tf_module(
      {('bias',): ctx.tf.Variable([1.0]), 'bias': ctx.tf.Variable([1.0])},
      ctx.model(),
    ),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.from_tf_module',
    'a value that is not a TF variable',
    fdt.ExportError,
    r"Expected a TF variable or tensor for the NNX path 'bias', got ndarray",
    'Pass TF variables (DVariables or plain) or tensors.',
    lambda ctx: ctx.dt.from_tf_module({'bias': np.ones(16)}, ctx.model()),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.from_tf_module',
    'a model with a variable TF lacks',
    fdt.ExportError,
    r"The dict of TF variables has no variable 'kernel', which the target "
    r'needs',
    'Restore with a narrower include=/exclude=, or the matching variables.',
    lambda ctx: ctx.dt.from_tf_module(
      {'bias': ctx.tf.Variable(np.ones(16, np.float32))}, ctx.model()
    ),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.from_tf_module',
    'TF variables the model does not have',
    fdt.ExportError,
    r'holds 1 variable\(s\) the target does not have: extra.*allow_extra',
    'Restore into the model that was exported, or pass allow_extra=True.',
    lambda ctx: ctx.dt.from_tf_module(
      {
        **ctx.dt.flat_variables(ctx.dt.to_tf_module(ctx.model())),
        'extra': ctx.tf.Variable([1.0]),
      },
      ctx.model(),
    ),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.from_tf_module',
    'a model of another shape',
    fdt.ExportError,
    r"Shape mismatch for 2 variables: 'bias': the target expects \(32,\), "
    r'the tf\.Module holds \(16,\)',
    'Build the target with the exported configuration.',
    lambda ctx: ctx.dt.from_tf_module(
      ctx.dt.to_tf_module(ctx.model()), ctx.model(width=32)
    ),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.from_tf_module',
    'a model of another dtype',
    fdt.ExportError,
    r"Dtype mismatch for 2 variables: 'bias': the target expects bfloat16, "
    r'the tf\.Module has float32.*`convert_dtypes=True`',
    'Build the target in the exported dtype, or pass convert_dtypes=True.',
    lambda ctx: ctx.dt.from_tf_module(
      ctx.dt.to_tf_module(ctx.model()),
      jax.tree.map(lambda x: x.astype(jnp.bfloat16), ctx.model()),
    ),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.CheckpointManager',
    'a retention setting out of range (max_to_keep=0)',
    fdt_tf.CheckpointManagerError,
    r'max_to_keep must be a positive int; got 0\. Pass None for no such limit',
    'Pass a positive number of steps to keep, or None to keep every step.',
    lambda ctx: ctx.dt.CheckpointManager(ctx.tmp / 'run', max_to_keep=0),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.CheckpointManager',
    'a step saved again, or one below the latest',
    fdt_tf.CheckpointManagerError,
    r'Step 3 is not above the latest saved step, 3, in .*Save a later step, '
    r'or restore from 3',
    'Save each step once, in increasing order; to go back, restore a step '
    'and save the steps after it in a new directory.',
    lambda ctx: _save_twice(ctx),
    tf=True,
  ),
  Case(
    'flax_dtensor.dtensor.CheckpointManager',
    'restore() where no step was saved',
    fdt_tf.ExportNotFoundError,
    r'holds no whole step to restore',
    'Start from a fresh model, or pass the directory the run wrote.',
    lambda ctx: ctx.dt.CheckpointManager(ctx.tmp / 'empty-run').restore(
      ctx.model()
    ),
    tf=True,
  ),
]


def _save_twice(ctx):
  manager = ctx.dt.CheckpointManager(ctx.tmp / 'run-twice', blocking=True)
  manager.save(3, ctx.model())
  manager.save(3, ctx.model())


def _with_flax_rules(rules, fn):
  with nnx.logical_axis_rules(rules):
    return fn()


def _deleted():
  x = jax.device_put(jnp.ones(8))
  x.delete()
  return x


def _user_directory(ctx):
  directory = ctx.tmp / 'user-data'
  directory.mkdir(exist_ok=True)
  (directory / 'results.csv').write_text('precious')
  return directory
