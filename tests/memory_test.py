"""Memory: a sharded build never holds a whole unsharded model.

Each build runs in a fresh process (`benchmarks/cases.py`, the benchmarks'
own measurement), which resets the OS's peak-RSS mark before the build and
reads it after. With 8 virtual devices on one host, sharded parameters take
their bytes once; a build that made any kernel whole on every device (8 copies)
or kept every initializer's temporaries alive at once would exceed 1.5x.
"""

import json
import pathlib
import subprocess
import sys

import pytest

CASES = pathlib.Path(__file__).resolve().parents[1] / 'benchmarks' / 'cases.py'


def _measure(method: str, layers: int) -> dict:
  proc = subprocess.run(
    [
      sys.executable,
      str(CASES),
      'init',
      method,
      json.dumps({'layers': layers, 'width': 1024}),
    ],
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize('method', ['fdt_init', 'fdt_eager'])
def test_sharded_creation_peaks_below_one_and_a_half_times_the_params(method):
  result = _measure(method, layers=8)  # 134M parameters, 512 MiB.
  above = (result['rss_peak_mib'] - result['rss_before_mib']) * 2**20
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


def test_path_ruled_creation_peaks_far_below_whole_copies():
  """`fdt.init` of a model without annotations, every kernel path-ruled.

  It takes the traced build, whose program keeps each kernel's random bits
  (in shards) until the outputs are done: about twice the parameters, as
  XLA's own figures say (next test), never the 8 whole copies of a
  replicated build.
  """
  result = _measure('fdt_init_paths', layers=8)
  above = (result['rss_peak_mib'] - result['rss_before_mib']) * 2**20
  assert result['shard_shape'] == [512, 1024]
  assert above <= 3 * result['param_bytes'], (
    f'peak {above / 2**20:.0f} MiB above the baseline for '
    f'{result["param_bytes"] / 2**20:.0f} MiB of parameters'
  )


def test_path_ruled_creation_never_makes_a_whole_kernel_on_a_device():
  """XLA's program for one device, as `fdt.init` compiles it: every buffer
  of a kernel's size is a block of it, never the whole kernel."""
  import re

  import jax
  from flax import nnx

  import flax_dtensor as fdt
  from flax_dtensor import _init

  sys.path.insert(0, str(CASES.parent))
  try:
    import cases
  finally:
    sys.path.remove(str(CASES.parent))
  width = 256
  factory = cases._mlp_stack(2, width, annotated=False)
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  rules = fdt.LogicalRules(
    [('embed', 'data'), ('mlp', 'model')], path_rules=cases.PATH_RULES
  )
  compiled = _init.compiled_build(factory, nnx.Rngs(0), mesh=mesh, rules=rules)
  shapes = set(re.findall(r'\[(\d+),(\d+)\]', compiled.as_text()))
  whole = {(str(width), str(4 * width)), (str(4 * width), str(width))}
  blocks = {(str(width // 2), str(width)), (str(width), str(width // 2))}
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
