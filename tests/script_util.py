"""Runs a Python script as a reader would: a fresh process on 8 CPU devices."""

import os
import pathlib
import subprocess
import sys


def run_script(
  script: pathlib.Path,
  cwd: pathlib.Path,
  timeout: float,
  *,
  devices_from_env: bool = True,
) -> subprocess.CompletedProcess:
  """Runs `script` in `cwd` (bounded by `timeout`); returns the result.

  With `devices_from_env=False` the environment gives JAX no virtual
  devices (XLA_FLAGS unset, as on a reader's laptop): the script sets its
  own with `jax.config.update('jax_num_cpu_devices', n)`.
  """
  env = {
    **os.environ,
    'XLA_FLAGS': '--xla_force_host_platform_device_count=8',
    'JAX_PLATFORMS': 'cpu',
  }
  if not devices_from_env:
    del env['XLA_FLAGS']
  return subprocess.run(
    [sys.executable, str(script)],
    cwd=cwd,
    capture_output=True,
    text=True,
    timeout=timeout,
    env=env,
    stdin=subprocess.DEVNULL,
    check=False,
  )
