"""Runs a Python script as a reader would: a fresh process on 8 CPU devices."""

import os
import pathlib
import subprocess
import sys


def run_script(
  script: pathlib.Path, cwd: pathlib.Path, timeout: float
) -> subprocess.CompletedProcess:
  """Runs `script` in `cwd` (bounded by `timeout`); returns the result."""
  env = {
    **os.environ,
    'XLA_FLAGS': '--xla_force_host_platform_device_count=8',
    'JAX_PLATFORMS': 'cpu',
  }
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
