"""What several command-line test files read: the demo model's export."""

import pytest
from support.cli_helpers import DEMO_TARGET, make_checkpoint, run_cli


# Once per worker: the export, inspect and exit-status tests read it (and
# copy it before they damage it).
@pytest.fixture(scope='session')
def demo_export(tmp_path_factory, dtensor):
  """Exports an Orbax checkpoint of the demo model with a SavedModel."""
  del dtensor  # TF DTensor on the suite's 8 devices, before any TF op.
  tmp = tmp_path_factory.mktemp('demo_export')
  orbax, expected = make_checkpoint(DEMO_TARGET, tmp)
  out = tmp / 'out'
  proc = run_cli(
    'export',
    DEMO_TARGET,
    '--checkpoint',
    orbax,
    '--mesh',
    'data=2,model=4',
    '--out',
    out,
    '--saved-model',
    '--input-shape',
    'tokens:1,128:int32',
  )
  return tmp, out, expected, proc
