"""The command line's tests, one file per command (and cli_test.py for the
command line as a whole).

Commands run in this process through `cli_runner` (tests/support), with
TensorFlow DTensor initialized once for the module, as the bridge tests do;
a test starts a process of its own only where that is what it tests. The
user's model files are `support.cli_models`, the shared helpers
`support.cli_helpers`.

Here: what several of those files read, the demo model's export.
"""

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
