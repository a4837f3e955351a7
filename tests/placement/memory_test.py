"""Memory: a sharded build never holds a whole unsharded model.

Each build runs in a fresh process (`benchmarks/measure.py`, the
benchmarks' own measurement), which resets the OS's peak-RSS mark before the build and
reads it after. With 8 virtual devices on one host, sharded parameters take
their bytes once; a build that made any kernel whole on every device (8 copies)
or kept every initializer's temporaries alive at once would exceed 1.5x.
"""

import importlib.util
import json

import pytest
from support import processes

MEASURE = processes.REPO_ROOT / 'benchmarks' / 'measure.py'


def _measure(method: str, layers: int) -> dict:
  proc = processes.run_python(
    MEASURE, 'init', method, json.dumps({'layers': layers, 'width': 1024})
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
  'method', ['fdt_init', 'fdt_eager', 'fdt_init_paths', 'fdt_eager_paths']
)
def test_sharded_creation_peaks_below_one_and_a_half_times_the_params(method):
  """Annotated, and without annotations under path rules (built in shards
  by creation order), eagerly and with fdt.init."""
  result = _measure(method, layers=8)  # 134M parameters, 512 MiB.
  above = (result['rss_peak_mib'] - result['rss_before_mib']) * 2**20
  if above > 1.5 * result['param_bytes']:
    # On a busy machine, JAX's asynchronous frees can lag the next
    # creation (seen once: 1.52x against 1.41-1.45x quiet). What the bound
    # rules out (a whole kernel per device, every temporary kept) exceeds
    # it on every run, so the lower peak of two runs is checked.
    again = _measure(method, layers=8)
    above = min(
      above, (again['rss_peak_mib'] - again['rss_before_mib']) * 2**20
    )
  assert result['shard_shape'] == [512, 1024]  # (1024, 4096) over (2, 4).
  assert above <= 1.5 * result['param_bytes'], (
    f'{method}: peak {above / 2**20:.0f} MiB above the baseline for '
    f'{result["param_bytes"] / 2**20:.0f} MiB of parameters'
  )


def test_replicated_creation_is_what_the_bound_rules_out():
  """The bound has teeth: the same model replicated peaks far above it."""
  result = _measure('replicated', layers=2)
  above = (result['rss_peak_mib'] - result['rss_before_mib']) * 2**20
  assert above > 1.5 * result['param_bytes'], (
    f'replicated: peak {above / 2**20:.0f} MiB above the baseline for '
    f'{result["param_bytes"] / 2**20:.0f} MiB of parameters ({result})'
  )


def test_path_ruled_creation_never_makes_a_whole_kernel_on_a_device():
  """XLA's programs for one device: every buffer of a kernel's size is a
  block of it, never the whole kernel. Both the programs of the leaf
  modules (`nnx.Linear`) that creation by order compiles, and the one
  traced program `fdt.init` falls back to."""
  import re

  import jax
  from flax import nnx

  import flax_dtensor as fdt
  from flax_dtensor._placement import _creation, _traced

  # The benchmarks' model builders, by file (benchmarks/ is no package).
  spec = importlib.util.spec_from_file_location(
    'benchmark_models', MEASURE.parent / 'models.py'
  )
  models = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(models)
  width = 256
  factory = models.mlp_stack(2, width, annotated=False)
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  rules = fdt.LogicalRules(
    [('embed', 'data'), ('mlp', 'model')], path_rules=models.PATH_RULES
  )
  whole = {(str(width), str(4 * width)), (str(4 * width), str(width))}
  blocks = {(str(width // 2), str(width)), (str(width), str(width // 2))}
  _creation.clear_caches()
  fdt.init(factory, nnx.Rngs(0), mesh=mesh, rules=rules)
  leaves = list(_creation.leaves._data.values())
  assert len(leaves) == 2  # The 'up' and the 'down' nnx.Linear.
  shapes = set()
  for leaf in leaves:
    shapes |= set(re.findall(r'\[(\d+),(\d+)\]', leaf.as_text()))
  assert not shapes & whole, shapes
  assert blocks <= shapes, shapes
  compiled = _traced.compiled_build(
    factory, nnx.Rngs(0), mesh=mesh, rules=rules
  )
  shapes = set(re.findall(r'\[(\d+),(\d+)\]', compiled.as_text()))
  assert not shapes & whole, shapes
  assert blocks <= shapes, shapes
  # Outputs per device: each kernel's block, the biases whole (replicated),
  # and the few bytes of the RNG state.
  kernels = 2 * 2 * width * 4 * width * 4 // 8
  biases = 2 * (4 * width + width) * 4
  memory = compiled.memory_analysis()
  assert (
    kernels + biases <= memory.output_size_in_bytes < kernels + biases + 256
  )
  plan = fdt.plan(lambda: factory(nnx.Rngs(0)), mesh=mesh, rules=rules)
  assert plan.bytes_per_device == kernels + biases
