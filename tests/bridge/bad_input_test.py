"""Bad input at every public entry point, answered in our own words.

Runs every case of `bad_input_cases.CASES` (also the source of the docs'
troubleshooting page), and checks that the matrix covers every error class
and every public entry point.
"""

import pytest
from support import fault_runs
from support.bad_input_cases import CASES, Context

import flax_dtensor as fdt


@pytest.fixture(scope='module')
def ctx(tmp_path_factory, request):
  return Context(
    tmp_path_factory.mktemp('bad_input'),
    pool=lambda: request.getfixturevalue('warm_pool'),
  )


@pytest.mark.parametrize('case', CASES, ids=[c.id for c in CASES])
def test_bad_input(case, ctx, monkeypatch):
  """The case raises its documented error, with its message.

  Slow: the cases of a killed peer, a full disk or a file-size limit read
  what a multi-process fault run recorded (fault_runs, scale_runs: run once
  a session, shared with faults_test.py and multiprocess_scale_test.py);
  those of TensorFlow missing or not initialized start a fresh process;
  the command line's writes under a fault (the demo trains a step before
  it writes) run in forks of the warm pool, once a session.
  """
  if case.tf:
    pytest.importorskip('tensorflow')
  monkeypatch.chdir(ctx.tmp)
  with pytest.raises(case.error, match=case.match):
    case.run(ctx)


@pytest.mark.parametrize('fault', fault_runs.WRITE_FAULTS)
def test_a_write_fault_of_the_command_line_exits_2_leaving_nothing(ctx, fault):
  """`demo` and `export` under a real fault (the matrix's cases above):
  exit status 2 with our one `error:` line naming the user's --out (not the
  run's temporary, nor "unexpected failure ... a bug"), and nothing of the
  run left beside what the test put there.

  Slow: the first run of each fault here (a fork of the warm pool; the
  demo trains a step before it writes) is shared with the cases above.
  """
  from flax_dtensor.cli import _command

  run = fault_runs.write_fault(ctx.pool, fault)
  kind, text = run['error']
  assert kind in ('DiskFullError', 'ExportError', 'BadInputError'), run
  assert "'/" in text or "'ro/" in text, text
  assert '.tmp-' not in text and 'staging' not in text, text
  inputs = {'export-full': 'orbax', 'demo-unwritable': 'ro'}.get(fault)
  assert {p.split('/')[0] for p in run['after']} <= {inputs}, run['after']
  if fault != 'orbax-denied':  # The command line's own line and status.
    assert run['status'] == 2, run['stderr'][-3000:]
    # Written whole, in one write (other libraries' threads print as the
    # write fails): the line and its newline, nothing inside.
    line = f'error: {_command.one_line(text)}\n'
    assert line in run['stderr'], run['stderr'][-3000:]
    assert 'unexpected failure' not in run['stderr']


def test_every_error_class_appears():
  import flax_dtensor.dtensor as fdt_tf

  documented = {c.error for c in CASES}
  errors = {
    getattr(module, name)
    for module in (fdt, fdt_tf)
    for name in module.__all__
    if isinstance(getattr(module, name), type)
    and issubclass(getattr(module, name), fdt.FlaxDTensorError)
    and getattr(module, name) is not fdt.FlaxDTensorError
  }
  assert errors - documented == set()


def test_every_public_entry_point_appears():
  import flax_dtensor.dtensor as fdt_tf

  entries = {c.entry for c in CASES}
  core = {
    f'fdt.{n}'
    for n in fdt.__all__
    if callable(getattr(fdt, n)) and not isinstance(getattr(fdt, n), type)
  }
  # Its error classes are not entry points (each is a case's error).
  bridge = {
    f'flax_dtensor.dtensor.{n}'
    for n in fdt_tf.__all__
    if not (
      isinstance(getattr(fdt_tf, n), type)
      and issubclass(getattr(fdt_tf, n), Exception)
    )
  }
  # Functions with nothing a user can get wrong beyond the cases above.
  exempt = {
    'fdt.get_logical_axis_rules',
    'fdt.set_logical_axis_rules',
    'fdt.propagate',
    'fdt.with_logical_constraint',
    'fdt.clear_init_cache',  # Takes nothing.
    'flax_dtensor.dtensor.is_initialized',
    'flax_dtensor.dtensor.nnx_path',
    # Reports returned by the export functions, not called by users.
    'flax_dtensor.dtensor.RelaidVariable',
    'flax_dtensor.dtensor.SingleMeshReport',
    'flax_dtensor.dtensor.VerificationReport',
  }
  assert core | bridge - exempt <= entries | exempt
