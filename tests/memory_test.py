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
