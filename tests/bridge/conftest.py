"""The bridge's tests: TensorFlow DTensor set up once a session, first."""

import pytest


@pytest.fixture(scope='session', autouse=True)
def _dtensor_initialized(dtensor):
  """DTensor must be set up before any other TensorFlow op in the process."""
  del dtensor
