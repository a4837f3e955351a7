"""The command line as a whole: usage errors, help and metadata without JAX
or TensorFlow, what it prints on stderr, and its exit statuses. How the CLI tests run: tests/cli/conftest.py.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io

import pytest
import typer
from support import cli_models
from support.cli_helpers import (
  DEMO_TARGET,
  _without_heavy_libraries,
  assert_fits,
  bad_input,
  ok,
  run_cli,
)

import flax_dtensor.dtensor as fdt_tf
from flax_dtensor.cli import _command

# TF DTensor on the suite's 8 devices, before any other TF operation.
pytestmark = pytest.mark.usefixtures('dtensor')


def test_debug_shows_traceback():
  proc = run_cli('plan', DEMO_TARGET, '--mesh', 'data2', '--debug')
  assert proc.returncode == 2
  assert 'Traceback' in proc.stderr
  assert 'error: Malformed --mesh' in proc.stderr


# A factory file that writes to the process's stderr the way native libraries
# do (straight to file descriptor 2), and the way Python libraries do.
NOISY_FACTORY = """
import os, sys, warnings
os.write(2, b'I0000 00:00:0.0  1 native.cc:1] noise at import\\n')
from flax import nnx

def noisy_model():
  os.write(2, b'native noise while building\\n')
  warnings.warn('a library warning')
  print('python noise', file=sys.stderr)
  return nnx.Linear(4, 4, rngs=nnx.Rngs(0))

def noisy_failure():
  os.write(2, b'native noise before failing\\n')
  raise RuntimeError('the factory broke')
"""


def test_stderr_holds_only_our_messages(tmp_path):
  path = tmp_path / 'noisy.py'
  path.write_text(NOISY_FACTORY)
  proc = run_cli('plan', f'{path}:noisy_model', '--mesh', 'data=8')
  assert 'Sharding plan' in ok(proc)
  assert proc.stderr == ''
  proc = run_cli('plan', f'{path}:noisy_failure', '--mesh', 'data=8')
  line = bad_input(proc, 'the factory broke')
  assert proc.stderr.splitlines() == [line]


def test_debug_shows_other_libraries_output(tmp_path):
  path = tmp_path / 'noisy.py'
  path.write_text(NOISY_FACTORY)
  proc = run_cli('plan', f'{path}:noisy_model', '--mesh', 'data=8', '--debug')
  ok(proc)
  for noise in (
    'noise at import',
    'native noise while building',
    'python noise',
  ):
    assert noise in proc.stderr


class _Writes(io.StringIO):
  """A stream that keeps each write apart."""

  def __init__(self):
    super().__init__()
    self.writes = []

  def write(self, text):
    self.writes.append(text)
    return super().write(text)


@pytest.mark.parametrize(
  'raised, line',
  [
    (
      fdt_tf.DiskFullError('Writing the export failed:\nthe disk is full.'),
      'error: Writing the export failed: the disk is full.',
    ),
    (KeyboardInterrupt(), 'interrupted'),
  ],
  ids=['error', 'interrupted'],
)
def test_the_error_line_is_one_write(raised, line):
  """Our last line goes out in one write, its newline with it: written in
  two, another library's thread (Orbax prints tracebacks as a write fails)
  could land between the text and its newline, in the middle of our
  line, as it once did."""
  from flax_dtensor import _interrupts, _output

  stream = _Writes()
  with _output.routed_to(stream), pytest.raises(typer.Exit) as exit_info:
    with _command.handle_errors(debug=True):
      raise raised
  _interrupts.acknowledge()
  assert stream.writes == [f'{line}\n']
  assert exit_info.value.exit_code == (2 if line.startswith('error') else 130)


@pytest.mark.parametrize(
  'args, fragments',
  [
    (['plan'], ["Missing argument 'TARGET'", "'flax-dtensor plan --help'"]),
    (['plan', DEMO_TARGET, '--bogus'], ['No such option: --bogus']),
    (['nope'], ["No such command 'nope'", "'flax-dtensor --help'"]),
    (
      ['inpsect'],
      [
        "No such command 'inpsect'. Did you mean 'inspect'? Run "
        "'flax-dtensor --help' for the usage."
      ],
    ),
  ],
  ids=[
    'missing-argument',
    'unknown-option',
    'unknown-command',
    'unknown-command-close-to-one',
  ],
)
def test_usage_errors_in_the_same_style(args, fragments):
  """Click's usage errors: one `error:` line and exit 2, no boxes."""
  proc = run_cli(*args)
  bad_input(proc, *fragments)
  assert '╭' not in proc.stderr and '│' not in proc.stderr


def test_no_arguments_shows_the_help():
  out = ok(run_cli())
  assert 'Usage: flax-dtensor' in out
  for command in ('demo', 'plan', 'export', 'inspect'):
    assert command in out


def test_help_and_version_need_no_jax_and_show_no_placeholders():
  commands = ['demo', 'plan', 'export', 'inspect']
  argvs = [['--help'], ['--version'], *([c, '--help'] for c in commands)]
  results = _without_heavy_libraries(*argvs)
  for argv, (code, text) in zip(argvs, results, strict=True):
    assert code == 0, (argv, text)
    assert_fits(text, 80)
    for placeholder in ('<bool>', '<str>', '<int>', '<path>', '{', '}'):
      assert placeholder not in text, (argv, placeholder, text)
  (_, version), (_, plan_help) = results[1], results[3]
  assert version.startswith('flax-dtensor 0.1.0\nPython 3.')
  for name in (
    'jax',
    'flax',
  ):  # The versions installed here, whatever they are.
    assert f'\n{name} {importlib.metadata.version(name)}\n' in version
  assert plan_help.startswith('Usage: flax-dtensor plan [OPTIONS] TARGET\n')
  assert '  --json ' in plan_help and '--mesh NAME=SIZE,...' in plan_help


def _status_of(exception):
  """The exit status and `error:` line `handle_errors` makes of it."""
  err = io.StringIO()
  with contextlib.redirect_stderr(err), pytest.raises(typer.Exit) as exit_:
    with _command.handle_errors(debug=True):  # Nothing redirected.
      raise exception
  lines = [x for x in err.getvalue().splitlines() if x.startswith('error: ')]
  return exit_.value.exit_code, lines[-1] if lines else ''


def test_exit_statuses_by_kind_of_failure():
  import flax_dtensor as fdt

  assert _status_of(_command.BadInputError('bad --mesh.')) == (
    2,
    'error: bad --mesh.',
  )
  code, line = _status_of(fdt.ExportError('The export is damaged.'))
  assert (code, line) == (2, 'error: The export is damaged.')
  code, line = _status_of(RuntimeError('an internal invariant broke'))
  assert code == 3
  assert line.startswith('error: unexpected failure: an internal invariant ')
  assert 'please report it with the output of the same command run with ' in (
    line
  )
  assert '`flax-dtensor --version`' in line
  assert 'RuntimeError' not in line  # The class is in --debug's traceback.
  assert _status_of(KeyboardInterrupt())[0] == 130


def test_exit_statuses_of_every_command(demo_export, tmp_path):
  """0 ok, 1 findings or differences, 2 bad input: each command, for real."""
  _, out, _, proc = demo_export
  assert proc.returncode == 0  # export: ok.
  assert run_cli('inspect', out).returncode == 0
  assert run_cli('plan', DEMO_TARGET, '--summary').returncode == 0
  assert run_cli('plan', DEMO_TARGET, '--check').returncode == 1  # Findings.
  for args in (
    ['demo', '--mesh', 'data=-1'],
    ['demo', '--out', cli_models.FILE / 'sub'],  # Under a file.
    ['plan', DEMO_TARGET, '--mesh', 'data=-1'],
    ['export', DEMO_TARGET, '--checkpoint', tmp_path, '--out', tmp_path],
    ['inspect', tmp_path],
    ['nope'],
  ):
    assert run_cli(*args).returncode == 2, args
