"""`fdt.suggest_rules`: presets, the generic proposal, budgets, by values.

The three models of `suggest_models` (Hugging Face, Gemma and GPT-2
names, nobody annotated them) get their preset, and the generic proposal
under another preset or none; a budget is met by the plan's count and by
the bytes a device really holds after `fdt.init`, whose values equal an
unsharded build's bit for bit; every suggestion is `fdt.check`-clean.
"""

import importlib.resources

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P
from support import creation_values
from support import suggest_models as sm
from support import unannotated_model as um

import flax_dtensor as fdt

AUTO = (AxisType.Auto, AxisType.Auto)
MESH = AbstractMesh((2, 4), ('data', 'model'), axis_types=AUTO)
MESH3 = AbstractMesh(
  (2, 2, 2), ('data', 'fsdp', 'tp'), axis_types=(AxisType.Auto,) * 3
)
MIN = 2**14  # The models are small: their weights are 16 to 256 KiB.
TX = optax.adam(1e-3)

MODELS = {
  'hf_llama': sm.make_llama,
  'gemma': sm.make_gemma,
  'gpt2': sm.make_gpt2,
}


def _suggest(factory, mesh=MESH, **kwargs):
  kwargs.setdefault('min_bytes', MIN)
  return fdt.suggest_rules(factory, mesh, **kwargs)


def _clean(factory, suggestion, mesh=MESH):
  report = fdt.check(factory, suggestion.rules, mesh, min_bytes=MIN)
  assert not report, str(report)


# Presets
# ------------------------------------------------------------------------------


def test_the_presets_are_rules_files_in_the_package():
  folder = importlib.resources.files('flax_dtensor') / 'presets'
  names = sorted(e.name for e in folder.iterdir())
  assert names == ['gemma.yaml', 'gpt2.yaml', 'hf_llama.yaml']
  for name in names:
    with importlib.resources.as_file(folder / name) as path:
      rules = fdt.LogicalRules.from_yaml(path)
    assert list(rules) == [] and len(rules.path_rules) == 7
    assert all(
      r.note and r.pattern.startswith('(^|/)') for r in rules.path_rules
    )


@pytest.mark.parametrize('preset', sorted(MODELS))
def test_a_preset_is_recognised_from_its_models_paths(preset):
  s = _suggest(MODELS[preset])
  assert s.preset == preset
  assert s.recognition.startswith(f'recognised {preset} ')
  params = {e.path: e for e in s.plan.entries}
  for path, why in s.reasons.items():
    e = params[path]
    if e.bytes >= MIN:
      # Every large weight by the preset, over all 8 devices.
      assert why.startswith(f'preset {preset} rule #'), (path, why)
      assert e.bytes_per_device * 8 == e.bytes, (path, e.spec)
      assert e.source.endswith(f'({why})'), e.source
    else:
      assert why == (
        f'replicated below the threshold ({e.bytes} bytes < min_bytes={MIN})'
      )
      assert e.spec == P(*(None,) * len(e.shape)), (path, e.spec)
      assert e.source.startswith('none ('), e.source
  _clean(MODELS[preset], s)


def test_a_vocabulary_nothing_divides_leaves_both_axes_to_embed():
  s = _suggest(lambda: sm.Gpt2(nnx.Rngs(0), vocab=50257), style='gpt2')
  assert s.plan['transformer/wte/embedding'].spec == P(None, ('data', 'model'))
  assert s.plan['transformer/h/0/mlp/c_fc/kernel'].spec == P('data', 'model')


def test_what_each_preset_does_to_its_model():
  specs = {
    'hf_llama': {
      'model/embed_tokens/embedding': P('model', 'data'),
      'model/layers/1/self_attn/k_proj/kernel': P('data', 'model'),
      'model/layers/1/self_attn/o_proj/kernel': P('model', 'data'),
      'model/layers/0/mlp/down_proj/kernel': P('model', 'data'),
      'lm_head/kernel': P('data', 'model'),
    },
    'gemma': {
      'embedder/input_embedding': P('model', 'data'),
      'layers/0/attn/q_einsum/w': P('model', 'data', None),
      # Two key/value heads do not divide by 4: they take 'data', and the
      # embedding dimension the model axis.
      'layers/0/attn/kv_einsum/w': P(None, 'data', 'model', None),
      'layers/1/mlp/gating_einsum': P(None, 'data', 'model'),
    },
    'gpt2': {
      'transformer/wte/embedding': P('model', 'data'),
      'transformer/wpe/embedding': P('model', 'data'),
      'transformer/h/0/attn/c_attn/kernel': P('data', 'model'),
      'transformer/h/1/mlp/c_proj/kernel': P('model', 'data'),
    },
  }
  for preset, want in specs.items():
    plan = _suggest(MODELS[preset]).plan
    assert {p: plan[p].spec for p in want} == want, preset


def test_qwen_biases_follow_their_preset_rule_once_large_enough():
  s = _suggest(sm.make_qwen, min_bytes=256)
  assert s.reasons['model/layers/0/self_attn/k_proj/bias'] == (
    'preset hf_llama rule #6: attention biases (Qwen)'
  )
  assert s.plan['model/layers/0/self_attn/q_proj/bias'].spec == P('model')
  _clean(sm.make_qwen, s)


@pytest.mark.parametrize(
  'style, other',
  [
    ('hf_llama', 'gemma'),
    ('gemma', 'gpt2'),
    ('gpt2', 'gemma'),
  ],
)
def test_a_preset_on_a_model_it_does_not_match_falls_back_to_generic(
  style, other
):
  s = _suggest(MODELS[other], style=style)
  assert s.preset is None
  assert s.recognition.startswith(f'preset {style}, as style={style!r} asks')
  assert s.recognition.endswith(
    'none of its rules matches, so the proposal is generic'
  )
  assert len(s.notes) == 7  # Each of its rules, left out.
  large = [e for e in s.plan.entries if e.bytes >= MIN]
  for e in large:
    assert s.reasons[e.path].startswith('generic largest-dimension'), e.path
    assert e.bytes_per_device * 8 == e.bytes, (e.path, e.spec)
  _clean(MODELS[other], s)


def test_a_preset_that_covers_part_of_a_model_leaves_the_rest_generic():
  s = _suggest(sm.make_llama, style='gpt2')  # GPT-2's lm_head rule only.
  assert s.preset == 'gpt2'
  assert s.reasons['lm_head/kernel'] == 'preset gpt2 rule #6: output head'
  assert s.reasons['model/embed_tokens/embedding'].startswith('generic ')
  assert len(s.notes) == 6
  _clean(sm.make_llama, s)


def test_no_preset_recognised_is_said_and_the_proposal_is_generic():
  s = _suggest(um.make_model)
  assert s.preset is None
  assert s.recognition.startswith('no preset recognised: gemma needs ')
  assert 'hf_llama needs q_proj + gate_proj + (embed_tokens or lm_head)' in (
    s.recognition
  )
  # The largest dimension that divides on the fsdp-like axis, the next on
  # the model axis: (64, 256) and (256, 64); (256, 64) for the embedding.
  assert s.plan['layers/0/mlp/up/kernel'].spec == P('model', 'data')
  assert s.plan['layers/1/mlp/down/kernel'].spec == P('data', 'model')
  assert s.plan['embed/embedding'].spec == P('data', 'model')
  rules = {r.pattern: r for r in s.rules.path_rules}
  assert rules[r'(^|/)layers/\d+/mlp/up/kernel$'].target == P('model', 'data')
  _clean(um.make_model, s)


def test_generic_takes_what_divides_and_replicates_what_nothing_divides():
  tree = {
    'odd': jax.ShapeDtypeStruct((6, 4096), np.float32),  # 6 % 4, 6 % 2 = 0
    'prime': jax.ShapeDtypeStruct((4099, 5), np.float32),
    'stacked': jax.ShapeDtypeStruct((3, 64, 512), np.float32),
  }
  s = _suggest(tree, style='generic')
  # 6 takes no 4: both axes go on the one dimension that divides by 8.
  assert s.plan['odd'].spec == P(None, ('data', 'model'))
  assert s.plan['stacked'].spec == P(None, 'model', 'data')
  assert not any(s.plan['prime'].spec)
  assert s.reasons['prime'] == (
    "replicated: no dimension of (4099, 5) divides by 'data' (2) or 'model' (4)"
  )
  assert s.plan['prime'].source.startswith("path rule #2 '.*' (the rest")


def test_mesh_axes_by_name_and_an_axis_of_size_one():
  three = _suggest(um.make_model, MESH3)
  assert three.axes == {'fsdp': 'fsdp', 'model': 'tp'}
  one = fdt.suggest_rules(
    um.make_model, AbstractMesh((1, 8), ('model', 'x')), min_bytes=MIN
  )
  assert one.axes == {'fsdp': 'x', 'model': None}
  assert one.plan['layers/0/mlp/up/kernel'].spec == P(None, 'x')
  alone = _suggest(sm.make_gemma, AbstractMesh((1,), ('data',)))
  assert alone.axes == {'fsdp': None, 'model': None}
  assert ('head_dim', None) in alone.rules  # Every name has a rule.
  assert alone.bytes_per_device == alone.plan.total_bytes


# Budgets
# ------------------------------------------------------------------------------


def test_a_budget_shards_further_the_variables_that_save_most():
  # On (data, fsdp, tp) the preset uses fsdp and tp: 4-way. The budget
  # needs the largest weights over 'data' too, and nothing else.
  base = _suggest(sm.make_llama, MESH3, optimizer=TX)
  assert base.bytes_per_device == 1_285_640
  s = _suggest(sm.make_llama, MESH3, optimizer=TX, budget=1_000_000)
  assert s.fits and s.bytes_per_device == 990_728
  further = {p for p, why in s.reasons.items() if 'further' in why}
  assert further == {
    'lm_head/kernel',
    'model/embed_tokens/embedding',
    'model/layers/0/mlp/down_proj/kernel',
    'model/layers/1/mlp/down_proj/kernel',
  }
  assert s.reasons['lm_head/kernel'] == (
    'sharded further for the budget (was: preset hf_llama rule #5: output head)'
  )
  assert s.plan['lm_head/kernel'].spec == P(('fsdp', 'data'), 'tp')
  # Its optimizer state follows it (the rules are searched, not anchored).
  mu = s.plan['optimizer/opt_state/0/mu/lm_head/kernel']
  assert mu.spec == P(('fsdp', 'data'), 'tp')
  assert [n.split("'")[0] for n in s.notes] == [
    f'preset hf_llama rule #{i} ' for i in (0, 4, 5, 6)
  ]
  assert s.notes[2].endswith(
    'left out: it places no variable of at least min_bytes=16384 that is '
    'not sharded further.'
  )
  _clean(sm.make_llama, s, MESH3)


def test_small_arrays_are_sharded_last_and_the_threshold_says_so():
  base = _suggest(sm.make_gpt2, optimizer=TX)
  assert base.bytes_per_device == 743_432  # Every large weight 8 ways.
  s = _suggest(sm.make_gpt2, optimizer=TX, budget=730_000)
  assert s.fits and s.bytes_per_device == 724_616
  assert s.rules.min_bytes == 1536  # c_attn's bias; c_proj's stays whole.
  assert s.notes[-1] == (
    'min_bytes lowered from 16384 to 1536: arrays below the threshold are '
    'sharded too, for the budget.'
  )
  assert {p for p, why in s.reasons.items() if 'further' in why} == {
    f'transformer/h/{i}/{name}/bias'
    for i in range(2)
    for name in ('attn/c_attn', 'mlp/c_fc')
  }
  assert s.plan['transformer/h/0/mlp/c_fc/bias'].spec == P(('data', 'model'))
  assert s.reasons['transformer/h/0/ln_1/scale'].startswith('replicated below')
  _clean(sm.make_gpt2, s)


def test_an_impossible_budget_says_so_with_the_smallest_total_found():
  s = _suggest(sm.make_gemma, optimizer=TX, budget=100_000)
  assert s.fits is False
  assert s.bytes_per_device == 541_640  # Everything split 8 ways.
  assert s.budget_text().startswith(
    'Does not fit: the smallest total found is 528.9 KiB per device '
    '(541,640 bytes), above the budget of 97.7 KiB (100,000 bytes); even '
    'the ideal'
  )
  assert str(s).splitlines()[2] == s.budget_text()


# End to end: check, init, measured bytes, values
# ------------------------------------------------------------------------------


@pytest.mark.parametrize('preset', sorted(MODELS))
def test_init_under_a_suggestion_meets_the_budget_on_the_devices(preset):
  factory = MODELS[preset]
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=AUTO)
  budget = {'hf_llama': 643_000, 'gemma': 545_000, 'gpt2': 740_000}[preset]
  s = _suggest(factory, mesh, optimizer=TX, budget=budget)
  assert s.fits and s.preset == preset
  _clean(factory, s, mesh)
  model = fdt.init(factory, mesh=mesh, rules=s.rules)
  with jax.set_mesh(mesh), fdt.logical_axis_rules(s.rules):
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
  device = mesh.devices.flat[0]
  held = sum(
    shard.data.nbytes
    for x in jax.tree.leaves(nnx.state((model, optimizer)))
    for shard in x.addressable_shards
    if shard.device == device
  )
  assert held == s.bytes_per_device <= budget
  reference = factory()
  for (path, a), (_, b) in zip(
    nnx.to_flat_state(nnx.state(model)),
    nnx.to_flat_state(nnx.state(reference)),
    strict=True,
  ):
    a, b = a.get_value(), b.get_value()
    creation_values.assert_close(a, b, err_msg=str(path))
    if a.nbytes >= MIN:  # Every large parameter in shards.
      assert a.addressable_shards[0].data.nbytes * 8 == a.nbytes, path


# The report and the file
# ------------------------------------------------------------------------------


def test_the_written_file_reads_back_and_the_plan_says_why(tmp_path):
  s = _suggest(sm.make_gemma, optimizer=TX, budget=545_000)
  path = s.write(tmp_path / 'rules.yaml')
  text = path.read_text()
  assert text.startswith(
    '# Rules proposed by flax_dtensor.suggest_rules: edit them freely.\n'
    '# Mesh data=2, model=4; recognised gemma '
  )
  read = fdt.LogicalRules.from_yaml(path)
  assert read == s.rules
  plan = fdt.plan(sm.make_gemma, mesh=MESH, rules=read)
  assert plan['layers/0/attn/q_einsum/w'].source == (
    "path rule #3 '(^|/)q_einsum/w$' (preset gemma rule #1: attention q "
    '(heads, embed, head_dim))'
  )
  assert plan['final_norm/scale'].source == (
    r"path rule #1 '(^|/)final_norm/scale$' (sharded further for the budget "
    '(was: replicated below the threshold (512 bytes < min_bytes=16384)))'
  )
  # As large as the smallest array sharded, so no longer exempt: the last
  # rule replicates it.
  assert plan['layers/1/pre_ffw_norm/scale'].source.startswith(
    "path rule #8 '.*' (the rest: replicated"
  )
  lines = str(s).splitlines()
  assert lines[0].startswith('Suggested rules: recognised gemma ')
  assert lines[1] == "Mesh axes: fsdp-like 'data', model 'model'."


def test_a_weights_dict_and_annotated_variables():
  rng = np.random.default_rng(0)
  weights = {
    'model': {
      'embed_tokens': {'embedding': rng.normal(size=(512, 128))},
      'layers': [
        {
          'self_attn': {'q_proj': {'kernel': rng.normal(size=(128, 128))}},
          'mlp': {'gate_proj': {'kernel': rng.normal(size=(128, 256))}},
        }
      ],
    }
  }
  s = _suggest(weights)
  assert s.preset == 'hf_llama'
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=AUTO)
  placed = fdt.shard_tree(weights, s.rules, mesh=mesh)
  kernel = placed['model']['layers'][0]['mlp']['gate_proj']['kernel']
  assert kernel.sharding.spec == P('data', 'model')
  init = nnx.with_partitioning(nnx.initializers.ones, ('embed', 'mlp'))
  annotated = _suggest(
    lambda: nnx.Linear(128, 256, kernel_init=init, rngs=nnx.Rngs(0))
  )
  assert annotated.reasons['kernel'] == (
    'annotated: its logical names placed by the rules proposed for them'
  )
  # By their roles: 'embed' on the fsdp-like axis, 'mlp' on the model's.
  assert annotated.logical_names == {
    'embed': ('data', 'model', None),
    'mlp': ('model', 'data', None),
  }
  assert annotated.plan['kernel'].spec == P('data', 'model')
  assert annotated.notes[-1] == (
    "1 annotated variables (e.g. 'kernel') keep their logical names; the "
    "logical rules are proposed for the names they use ('embed', 'mlp')."
  )


def test_bad_options():
  with pytest.raises(fdt.LogicalRulesError, match=r"one of \['gemma', 'gpt2'"):
    _suggest(sm.make_gpt2, style='llama')
  with pytest.raises(fdt.LogicalRulesError, match='`budget` must be an int'):
    _suggest(sm.make_gpt2, budget='8GiB')
  with pytest.raises(fdt.MeshError, match='Expected a mesh'):
    fdt.suggest_rules(sm.make_gpt2, ('data', 'model'))


# Annotated models: rules for the names they carry
# ------------------------------------------------------------------------------

# For each annotated model, rules a person would write for its names.
HAND_RULES = {
  'demo': None,  # The demo's own default rules (flax_dtensor/demo).
  'mlp': [('features', 'data'), ('hidden', 'model')],
  'decoder': [
    ('vocab', 'model'),
    ('embed', 'data'),
    ('q_heads', 'model'),
    ('kv_heads', 'model'),
    ('head_dim', None),
    ('mlp', 'model'),
    ('norm', None),
  ],
}


def _annotated(name):
  from flax_dtensor.demo import model as demo_model
  from flax_dtensor.demo import train

  if name == 'demo':
    return demo_model.make_model, train.default_rules()
  factory = {
    'mlp': sm.make_annotated_mlp,
    'decoder': sm.make_annotated_decoder,
  }[name]
  return factory, HAND_RULES[name]


@pytest.mark.parametrize('name', ['demo', 'mlp', 'decoder'])
@pytest.mark.parametrize('budget_kind', ['generous', 'hand', 'below-ideal'])
def test_annotated_models_get_rules_for_their_names(name, budget_kind):
  factory, hand = _annotated(name)
  reference = fdt.plan(factory, mesh=MESH, rules=hand)
  ideal = reference.ideal_bytes_per_device
  budget = {
    'generous': 2 * reference.bytes_per_device,
    'hand': reference.bytes_per_device,
    'below-ideal': int(ideal) - 1,
  }[budget_kind]
  s = _suggest(factory, budget=budget)
  # Rules for every name of the annotations, and the report names them.
  names = {a for e in reference.entries for a in e.logical_axes or () if a}
  assert set(s.logical_names) == names
  assert {n for n, _ in s.rules} >= names
  assert "Logical names from the model's annotations: " in s.summary()
  # The suggestion's count is the plan's under its rules.
  planned = fdt.plan(factory, mesh=MESH, rules=s.rules)
  assert s.bytes_per_device == planned.bytes_per_device
  assert s.fits == (planned.bytes_per_device <= budget)
  if budget_kind == 'below-ideal':
    assert not s.fits
    assert planned.bytes_per_device >= ideal
    assert 'Does not fit' in s.budget_text()
  else:
    # Where the hand-written rules fit, so do the proposed ones.
    assert s.fits
    assert planned.bytes_per_device <= reference.bytes_per_device
  # Nothing replicates that a rule could shard, unlike before: each
  # parameter of 64 KiB or more is split over at least 4 devices.
  for e in planned.entries:
    if e.bytes >= 2**16:
      assert e.bytes_per_device * 4 <= e.bytes, (e.path, e.spec)


def test_the_demo_fits_300_kib_on_the_command_line(capfd, monkeypatch):
  from typer.testing import CliRunner

  from flax_dtensor.cli import _app

  monkeypatch.setenv('COLUMNS', '200')
  result = CliRunner().invoke(
    _app.app,
    [
      'plan',
      'flax_dtensor.demo.model:make_model',
      '--suggest',
      '--budget',
      '300KiB',
    ],
  )
  _, err = capfd.readouterr()
  assert result.exit_code == 0, (result.stdout, err)
  out = result.stdout
  assert 'per device fits the budget of 300.0 KiB' in out
  assert "Logical names from the model's annotations: 'embed' -> " in out
  assert 'add rules for those names' not in out


# The forward's names: activations, found by tracing it on inputs
# ------------------------------------------------------------------------------

MLP_INPUTS = [jax.ShapeDtypeStruct((8, 96), jax.numpy.float32)]


def _train(model, rules, mesh, steps=3):
  """`steps` of plain SGD on a regression, under `mesh` and `rules` (as a
  user trains with suggested rules): the losses, and the output's spec."""
  x = jax.random.normal(jax.random.key(1), (8, 96))
  y = jax.random.normal(jax.random.key(2), (8, 96))

  @nnx.jit
  def step(model, x, y):
    def loss(model):
      return ((model(x) - y) ** 2).mean()

    value, grads = nnx.value_and_grad(loss)(model)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - 0.05 * g, params, grads))
    return value, model(x)

  losses = []
  with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
    for _ in range(steps):
      value, out = step(model, x, y)
      losses.append(float(value))
  return losses, out.sharding.spec


def test_the_forwards_names_get_rules_and_the_model_trains(tmp_path):
  """A model constraining activations with names no variable has
  (`act_batch`, `act_hidden`): traced on its inputs, they get rules (the
  batch name data-parallel, the other replicated), said in the written
  file; the file read back trains the model, where the rules for its
  variables' names alone fail on the first activation."""
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=AUTO)
  s = _suggest(sm.make_constrained_mlp, inputs=MLP_INPUTS)
  assert s.traced_on == 'float32[8,96]'
  assert s.forward_names == {
    'act_batch': ('data', None),
    'act_hidden': (None,),
  }
  assert list(s.rules)[:3] == [
    ('act_batch', 'data'),
    ('act_batch', None),
    ('act_hidden', None),
  ]
  assert set(s.logical_names) == {'features', 'hidden'}
  text = s.to_yaml()
  # The file's head says where the rules come from, and nothing of the
  # naming presets that did not apply (those are the report's).
  assert s.preset is None and 'no preset recognised' in s.recognition
  assert text.splitlines()[1] == (
    "# Mesh data=2, model=4; from the model's own annotations."
  )
  assert 'preset' not in text and 'needs' not in text
  comment = text.split('logical_axis_rules:\n')[1].split('  - [')[0]
  assert "Logical names found only at run time, in the forward's" in ' '.join(
    line.strip(' #') for line in comment.splitlines()
  )
  assert "'act_hidden' -> None" in ' '.join(comment.split())
  assert s.forward_text() in s.summary()
  path = s.write(tmp_path / 'rules.yaml')
  rules = fdt.LogicalRules.from_yaml(path)
  assert list(rules) == list(s.rules)  # The file keeps every rule.
  with jax.set_mesh(mesh), fdt.logical_axis_rules(rules):
    model = sm.make_constrained_mlp()
  losses, spec = _train(model, rules, mesh)
  assert losses[-1] < losses[0], losses
  # act_batch data-parallel; 'features' takes its first rule left free.
  features = next(t for t in s.logical_names['features'] if t != 'data')
  assert spec == P('data', features)
  # The rules of the variables' names alone cannot run the forward.
  names_only = fdt.LogicalRules(
    [p for p in s.rules if not p[0].startswith('act_')],
    min_bytes=s.rules.min_bytes,
  )
  with jax.set_mesh(mesh), fdt.logical_axis_rules(names_only):
    model = sm.make_constrained_mlp()
  with pytest.raises(
    fdt.UnknownLogicalAxisError, match=r"\['act_batch'\] are not mentioned"
  ):
    _train(model, names_only, mesh, steps=1)


def test_without_inputs_the_forward_is_not_traced_and_it_says_so():
  s = _suggest(sm.make_constrained_mlp)
  assert s.traced_on is None and s.forward_names == {}
  assert 'act_batch' not in s.rules.names
  said = 'The forward was not traced (no inputs given)'
  assert said in s.summary()
  assert said in ' '.join(
    line.lstrip('# ') for line in s.to_yaml().splitlines()
  )


def test_bad_inputs_are_told_in_our_words():
  with pytest.raises(
    fdt.LogicalRulesError, match=r'`inputs` must be the positional arguments'
  ):
    _suggest(sm.make_constrained_mlp, inputs=42)
  with pytest.raises(
    fdt.LogicalRulesError, match=r'`inputs\[0\]` must be a jax.ShapeDtypeStruct'
  ):
    _suggest(sm.make_constrained_mlp, inputs=['tokens'])
  with pytest.raises(
    fdt.LogicalRulesError,
    match=r'Tracing ConstrainedMlp.__call__ on the inputs given '
    r'\(float32\[8,95\]\) failed with TypeError: .*one jax.ShapeDtypeStruct '
    r'per positional argument',
  ):
    _suggest(
      sm.make_constrained_mlp,
      inputs=[jax.ShapeDtypeStruct((8, 95), jax.numpy.float32)],
    )
  with pytest.raises(
    fdt.LogicalRulesError, match=r"ConstrainedMlp has no method 'predict'"
  ):
    _suggest(sm.make_constrained_mlp, inputs=MLP_INPUTS, method='predict')
  with pytest.raises(
    fdt.LogicalRulesError, match=r"`inputs` are for tracing a model's forward"
  ):
    _suggest({'w': np.zeros((4, 4))}, inputs=MLP_INPUTS)
