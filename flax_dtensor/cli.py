"""The ``flax-dtensor`` command line: ``demo``, ``plan``, ``export``, ``inspect``.

Run ``flax-dtensor --help`` (or ``python -m flax_dtensor --help``) for the
commands and ``flax-dtensor COMMAND --help`` for their options.

Bad input (a malformed ``--mesh``, a ``TARGET`` that does not import, a
missing or corrupt checkpoint, a malformed rules file, a mesh whose size does
not match the device count, ...) ends with exit status 2 and a one-line
``error:`` message on stderr saying what was wrong and how to fix it; pass
``--debug`` for the traceback. Any other failure ends with exit status 1.

JAX, Flax and TensorFlow are imported inside the commands, not at the top of
this module: ``--help`` stays fast, and ``demo`` / ``export`` can configure
the virtual CPU devices before JAX starts its backend and initialize TF
DTensor before TensorFlow runs anything.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Annotated, Any

import rich.console
import rich.progress
import rich.table
import typer

EXIT_BAD_INPUT = 2
EXIT_FAILURE = 1

DEMO_TARGET = 'flax_dtensor.demo.model:make_model'
DEFAULT_MESH = 'data=2,model=4'
DEFAULT_OUT = 'flax_dtensor_out'
VERIFY_TIMEOUT_SECONDS = 300
_DEVICE_COUNT_FLAG = '--xla_force_host_platform_device_count'
_MESH_ITEM = re.compile(r'^([A-Za-z_][A-Za-z0-9_]*)=([0-9]+)$')
_MESH_HELP = 'Mesh axes as NAME=SIZE pairs, e.g. data=2,model=4.'
_RULES_HELP = (
  "A YAML rules file in MaxText's format (a logical_axis_rules list of "
  '(name, target) pairs). Default: the demo rules.'
)
_DEBUG_HELP = 'Show the traceback of an error.'
_CPU_DEVICES_HELP = (
  'Run on this many virtual CPU devices (sets XLA_FLAGS and '
  'jax_num_cpu_devices before JAX starts).'
)


class BadInputError(Exception):
  """Bad command-line input: exit status 2 and a one-line message."""


app = typer.Typer(
  name='flax-dtensor',
  help=(
    'Logical-axis sharding for Flax NNX, and export of sharded NNX models '
    'to TensorFlow DTensor.'
  ),
  no_args_is_help=True,
  add_completion=False,
  pretty_exceptions_enable=False,
  context_settings={'help_option_names': ['-h', '--help']},
)


# Output and errors
# ------------------------------------------------------------------------------


def _console(*, stderr: bool = False) -> rich.console.Console:
  from flax_dtensor import _output  # pylint: disable=g-import-not-at-top

  file = _output.stream() if stderr else sys.stdout
  console = rich.console.Console(file=file)
  if not console.is_terminal:
    # Piped or captured: wide enough that the tables do not wrap.
    console = rich.console.Console(file=file, width=200)
  return console


def _one_line(text: str) -> str:
  return ' '.join(str(text).split())


# Set by `main` (a real process): the capture of other libraries' output
# then lasts until the process exits, so that their exit-time logs are
# captured too.
_capture_until_exit = False


@contextlib.contextmanager
def _own_messages_only(debug: bool) -> Iterator[str | None]:
  """Within the block, stderr holds only our own messages.

  Everything written to file descriptor 2 (TensorFlow's and XLA's C++
  logs, absl, Python warnings of other libraries) goes to a log file;
  flax_dtensor's messages and progress bars go to the real stderr. With
  `debug`, nothing is redirected.

  Yields:
    The log file's path, or None with `debug`.
  """
  from flax_dtensor import _output  # pylint: disable=g-import-not-at-top

  if debug:
    yield None
    return
  sys.stderr.flush()
  own = os.fdopen(
    os.dup(2), 'w', buffering=1, encoding='utf-8', errors='replace'
  )
  log = tempfile.NamedTemporaryFile(
    prefix='flax-dtensor-', suffix='.log', delete=False
  )
  os.dup2(log.fileno(), 2)
  log.close()
  previous = _output.route(own)
  try:
    yield log.name
  finally:
    own.flush()
    if not _capture_until_exit:
      sys.stderr.flush()
      os.dup2(own.fileno(), 2)
      _output.route(previous)
      own.close()


@contextlib.contextmanager
def _handle_errors(debug: bool) -> Iterator[None]:
  """Turns exceptions into one-line messages and exit statuses.

  Also keeps other libraries' output off stderr (see `_own_messages_only`).
  """
  from flax_dtensor import _output  # pylint: disable=g-import-not-at-top

  with _own_messages_only(debug) as log:
    keep_log = False
    try:
      yield
    except (typer.Exit, typer.Abort):
      raise
    except KeyboardInterrupt:
      print('interrupted', file=_output.stream(), flush=True)
      raise typer.Exit(130) from None
    except Exception as e:  # pylint: disable=broad-except
      from flax_dtensor import _errors  # pylint: disable=g-import-not-at-top

      if isinstance(e, BadInputError):
        message, status = str(e), EXIT_BAD_INPUT
      elif isinstance(e, _errors.FlaxDTensorError):
        message, status = f'{type(e).__name__}: {e}', EXIT_BAD_INPUT
      else:
        message = f'{type(e).__name__}: {e}'
        if not debug:
          message += ' (rerun with --debug for the traceback'
          if log is not None:
            keep_log = True
            message += f"; other libraries' output is in {log}"
          message += ')'
        status = EXIT_FAILURE
      if debug:
        traceback.print_exc()
      print(f'error: {_one_line(message)}', file=_output.stream(), flush=True)
      raise typer.Exit(status) from None
    finally:
      if log is not None and not keep_log:
        atexit.register(_remove, log)


def _remove(path: str) -> None:
  with contextlib.suppress(OSError):
    os.remove(path)


def _human_bytes(n: float) -> str:
  from flax_dtensor import _plan  # pylint: disable=g-import-not-at-top

  return _plan.human_bytes(n)


def _disk_usage(path: pathlib.Path) -> int:
  if path.is_file():
    return path.stat().st_size
  return sum(p.stat().st_size for p in path.rglob('*') if p.is_file())


# Parsing
# ------------------------------------------------------------------------------


def parse_mesh(text: str) -> tuple[tuple[str, int], ...]:
  """Parses ``'data=2,model=4'`` into ``(('data', 2), ('model', 4))``.

  Args:
    text: Comma-separated ``NAME=SIZE`` pairs.

  Returns:
    The axis names and sizes, in order.

  Raises:
    BadInputError: If the text is malformed, a size is not a positive
      integer, or a name repeats.
  """
  fix = f'Pass --mesh as comma-separated NAME=SIZE pairs, e.g. {DEFAULT_MESH}.'
  items = [item.strip() for item in text.split(',')]
  axes = []
  for item in items:
    match = _MESH_ITEM.match(item)
    if match is None:
      raise BadInputError(
        f'Malformed --mesh {text!r}: expected NAME=SIZE, got {item!r}. {fix}'
      )
    name, size = match.group(1), int(match.group(2))
    if size < 1:
      raise BadInputError(
        f'Malformed --mesh {text!r}: axis {name!r} has size {size}; sizes '
        f'must be positive. {fix}'
      )
    axes.append((name, size))
  names = [n for n, _ in axes]
  repeated = sorted({n for n in names if names.count(n) > 1})
  if repeated:
    raise BadInputError(
      f'Malformed --mesh {text!r}: axis name(s) {repeated} repeat. Give '
      f'each mesh axis its own name. {fix}'
    )
  return tuple(axes)


@dataclasses.dataclass(frozen=True)
class InputSpec:
  """One ``--input-shape`` entry: ``NAME:DIMS:DTYPE``."""

  name: str
  shape: tuple[int | None, ...]
  dtype: str


_DTYPES = (
  'bool',
  'int8',
  'int16',
  'int32',
  'int64',
  'uint8',
  'uint32',
  'float16',
  'bfloat16',
  'float32',
  'float64',
)


def parse_input_shape(text: str, *, static_batch: bool) -> InputSpec:
  """Parses ``'x:1,128:int32'``; the first dim is the batch dim.

  Unless `static_batch`, the first dimension is exported polymorphic (its
  size only serves as an example); ``b``, ``?`` or ``None`` also mark a
  polymorphic dimension.

  Raises:
    BadInputError: If the text is malformed.
  """
  fix = (
    'Pass --input-shape NAME:DIMS:DTYPE, e.g. x:1,128:int32 (one per '
    'positional input of the method, in order).'
  )
  parts = text.split(':')
  if len(parts) != 3 or not parts[0] or not parts[1]:
    raise BadInputError(f'Malformed --input-shape {text!r}. {fix}')
  name, dims_text, dtype = parts
  if dtype not in _DTYPES:
    raise BadInputError(
      f'Malformed --input-shape {text!r}: unknown dtype {dtype!r}; expected '
      f'one of {", ".join(_DTYPES)}. {fix}'
    )
  shape: list[int | None] = []
  for d in dims_text.split(','):
    d = d.strip()
    if d in ('b', '?', 'None'):
      shape.append(None)
    elif d.isdigit() and int(d) > 0:
      shape.append(int(d))
    else:
      raise BadInputError(
        f'Malformed --input-shape {text!r}: dimension {d!r} is not a '
        f'positive integer (or b for a polymorphic one). {fix}'
      )
  if not static_batch:
    shape[0] = None
  return InputSpec(name, tuple(shape), dtype)


def load_rules(path: str | None) -> Any:
  """Reads a rules file (the demo rules when `path` is None).

  Raises:
    BadInputError: If the file is missing or malformed.
  """
  from flax_dtensor import _errors  # pylint: disable=g-import-not-at-top
  from flax_dtensor.demo import train  # pylint: disable=g-import-not-at-top

  if path is None:
    return train.default_rules()
  if not pathlib.Path(path).is_file():
    raise BadInputError(
      f'Rules file {path!r} does not exist. Pass --rules the path of a YAML '
      "file in MaxText's format, e.g. one holding: logical_axis_rules: "
      "[['batch', 'data'], ['embed', null]]."
    )
  try:
    return train.load_rules(path)
  except (_errors.LogicalRulesError, _errors.RuleTargetTypeError) as e:
    raise BadInputError(
      f'Malformed rules file {path!r}: {e} Fix the file, e.g. '
      "logical_axis_rules: [['batch', 'data'], ['embed', null]]."
    ) from e


def load_target(target: str) -> Callable[[], Any]:
  """Imports ``package.module:factory`` (or ``path/to/file.py:factory``).

  The current directory is put on ``sys.path`` first, so a module next to
  where the command runs imports.

  Raises:
    BadInputError: If the target is malformed, does not import, or does not
      name a callable.
  """
  example = f'e.g. {DEMO_TARGET} or path/to/models.py:make_model'
  module_name, sep, attr = target.rpartition(':')
  if not sep or not module_name or not attr:
    raise BadInputError(
      f'TARGET {target!r} is not of the form package.module:factory '
      f'({example}).'
    )
  if module_name.endswith('.py') or os.sep in module_name:
    path = pathlib.Path(module_name)
    if not path.is_file():
      raise BadInputError(
        f'TARGET {target!r}: file {str(path)!r} does not exist. Check the '
        f'path ({example}).'
      )
    unique = f'_flax_dtensor_target_{abs(hash(str(path.resolve())))}'
    spec = importlib.util.spec_from_file_location(unique, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[unique] = module
    try:
      spec.loader.exec_module(module)
    except Exception as e:
      raise BadInputError(
        f'TARGET {target!r}: running {str(path)!r} raised '
        f'{type(e).__name__}: {e}. Fix the file (rerun with --debug for the '
        'traceback).'
      ) from e
  else:
    cwd = os.getcwd()
    if cwd not in sys.path and '' not in sys.path:
      sys.path.insert(0, cwd)
    try:
      module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
      if e.name and module_name.startswith(e.name):
        raise BadInputError(
          f'TARGET {target!r}: no module named {module_name!r}. Check the '
          'spelling, install the package, or run from the directory that '
          f'holds it (or add it to PYTHONPATH); {example}.'
        ) from e
      raise BadInputError(
        f'TARGET {target!r}: importing {module_name!r} failed: {e}. Install '
        'the missing package.'
      ) from e
    except Exception as e:
      raise BadInputError(
        f'TARGET {target!r}: importing {module_name!r} raised '
        f'{type(e).__name__}: {e}. Fix the module (rerun with --debug for '
        'the traceback).'
      ) from e
  factory: Any = module
  for part in attr.split('.'):
    if not hasattr(factory, part):
      raise BadInputError(
        f'TARGET {target!r}: module {module_name!r} has no attribute '
        f'{attr!r}. Name a callable that returns an nnx.Module ({example}).'
      )
    factory = getattr(factory, part)
  if not callable(factory):
    raise BadInputError(
      f'TARGET {target!r}: {attr!r} is a {type(factory).__name__}, not a '
      'callable. Name a function or class that returns an nnx.Module.'
    )
  return factory


# JAX and TF set-up
# ------------------------------------------------------------------------------


def configure_cpu_devices(count: int) -> None:
  """Makes JAX run on `count` virtual CPU devices.

  Must run before JAX starts its backend (the first time anything asks for
  devices). Sets ``XLA_FLAGS`` too, so subprocesses inherit the setting.
  """
  flags = re.sub(
    _DEVICE_COUNT_FLAG + r'=\S*', '', os.environ.get('XLA_FLAGS', '')
  )
  os.environ['XLA_FLAGS'] = f'{flags} {_DEVICE_COUNT_FLAG}={count}'.strip()
  import jax  # pylint: disable=g-import-not-at-top

  try:
    jax.config.update('jax_platforms', 'cpu')
    jax.config.update('jax_num_cpu_devices', count)
  except RuntimeError:  # The backend already started; checked by make_mesh.
    pass


def make_mesh(axes: Sequence[tuple[str, int]], mesh_text: str) -> Any:
  """Builds a mesh of Auto axes over all devices, checking the count.

  Raises:
    BadInputError: If the mesh size differs from the device count.
  """
  import jax  # pylint: disable=g-import-not-at-top

  size = math.prod(s for _, s in axes)
  count = jax.device_count()
  if size != count:
    raise BadInputError(
      f'--mesh {mesh_text} needs {size} devices but JAX sees {count} '
      f'({jax.default_backend()}). Pass a mesh of {count} devices, or on CPU '
      f'run on {size} virtual devices with --cpu-devices {size}.'
    )
  return jax.make_mesh(
    tuple(s for _, s in axes),
    tuple(n for n, _ in axes),
    axis_types=(jax.sharding.AxisType.Auto,) * len(axes),
  )


def abstract_mesh(axes: Sequence[tuple[str, int]]) -> Any:
  import jax  # pylint: disable=g-import-not-at-top

  return jax.sharding.AbstractMesh(
    tuple(s for _, s in axes),
    tuple(n for n, _ in axes),
    axis_types=(jax.sharding.AxisType.Auto,) * len(axes),
  )


def build_abstract(factory: Callable[[], Any], target: str) -> Any:
  """``nnx.eval_shape(factory)``: the model's shapes, nothing allocated.

  Call it under a mesh and rules: annotated variables then carry their
  sharding.

  Raises:
    BadInputError: If the factory raises or does not return an nnx.Module.
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from flax_dtensor import _errors  # pylint: disable=g-import-not-at-top

  try:
    model = nnx.eval_shape(factory)
  except _errors.FlaxDTensorError:
    raise
  except Exception as e:
    raise BadInputError(
      f'TARGET {target!r}: calling the factory raised {type(e).__name__}: '
      f'{e}. It must build the model with no arguments (rerun with --debug '
      'for the traceback).'
    ) from e
  if not isinstance(model, nnx.Module):
    raise BadInputError(
      f'TARGET {target!r} returned a {type(model).__name__}, expected an '
      'nnx.Module. Name a callable that builds the model with no arguments.'
    )
  return model


def _initialize_dtensor() -> Any:
  from flax_dtensor import dtensor  # pylint: disable=g-import-not-at-top

  dtensor.initialize()
  return dtensor


# plan
# ------------------------------------------------------------------------------


@app.command()
def plan(
  target: Annotated[
    str,
    typer.Argument(
      help=(
        'package.module:factory (or path/to/file.py:factory), a callable '
        f'returning an NNX module, e.g. {DEMO_TARGET}.'
      ),
      show_default=False,
    ),
  ],
  mesh: Annotated[str, typer.Option(help=_MESH_HELP)] = DEFAULT_MESH,
  rules: Annotated[str | None, typer.Option(help=_RULES_HELP)] = None,
  json_output: Annotated[
    bool, typer.Option('--json', help='Print the plan as JSON.')
  ] = False,
  debug: Annotated[bool, typer.Option('--debug', help=_DEBUG_HELP)] = False,
) -> None:
  """Show where every variable of a model would go, without allocating it.

  The model is built abstractly (nnx.eval_shape) on an abstract mesh: no
  device and no parameter memory is needed. The table lists each variable's
  shape, dtype, logical axes, PartitionSpec, bytes per device and the
  fallbacks taken; the footer compares the total bytes per device with the
  ideal (total / device count).
  """
  with _handle_errors(debug):
    axes = parse_mesh(mesh)
    rules_ = load_rules(rules)
    factory = load_target(target)
    import jax  # pylint: disable=g-import-not-at-top

    import flax_dtensor as fdt  # pylint: disable=g-import-not-at-top

    mesh_ = abstract_mesh(axes)
    with jax.sharding.use_abstract_mesh(mesh_), fdt.logical_axis_rules(rules_):
      model = build_abstract(factory, target)
      result = fdt.plan(model, mesh=mesh_, rules=rules_)
    if json_output:
      sys.stdout.write(result.to_json(indent=2) + '\n')
    else:
      _console().print(result)


# demo
# ------------------------------------------------------------------------------

# Runs in a fresh interpreter that imports TensorFlow and NumPy only. JAX is
# blocked: TF would otherwise import it when installed (tensorflow.lite
# tries `from jax import jit`), and the SavedModel must not need it.
VERIFY_SCRIPT = """\
import json, os, sys, time
for blocked in ('jax', 'jaxlib', 'flax', 'flax_dtensor'):
  sys.modules[blocked] = None  # `import jax` now raises ImportError.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
import numpy as np
import tensorflow as tf
saved_model, tokens_path, logits_path = sys.argv[1:4]
start = time.perf_counter()
serve = tf.saved_model.load(saved_model).signatures['serving_default']
(name,) = serve.structured_input_signature[1]
outputs = serve(**{name: tf.constant(np.load(tokens_path))})
(logits,) = outputs.values()
np.save(logits_path, logits.numpy())
print(json.dumps({
  'seconds': time.perf_counter() - start,
  'tensorflow': tf.__version__,
  'jax_imported': any(
    sys.modules.get(m) is not None for m in ('jax', 'jaxlib', 'flax')),
}))
"""


def verify_saved_model(
  saved_model: pathlib.Path,
  tokens: Any,
  *,
  timeout: float = VERIFY_TIMEOUT_SECONDS,
) -> tuple[Any, dict[str, Any]]:
  """Runs a SavedModel in a fresh TensorFlow-only process.

  Args:
    saved_model: The SavedModel directory (one input, one output).
    tokens: The input batch (a NumPy array).
    timeout: Seconds before the subprocess is killed.

  Returns:
    The logits (NumPy) and the subprocess's report.

  Raises:
    RuntimeError: If the subprocess fails or times out.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top

  with tempfile.TemporaryDirectory(prefix='flax_dtensor_verify_') as tmp:
    tokens_path = os.path.join(tmp, 'tokens.npy')
    logits_path = os.path.join(tmp, 'logits.npy')
    np.save(tokens_path, np.asarray(tokens))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES='-1', TF_CPP_MIN_LOG_LEVEL='2')
    try:
      proc = subprocess.run(
        [
          sys.executable,
          '-c',
          VERIFY_SCRIPT,
          str(saved_model),
          tokens_path,
          logits_path,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
        check=False,
      )
    except subprocess.TimeoutExpired as e:
      raise RuntimeError(
        f'Loading the SavedModel in a fresh TensorFlow process took longer '
        f'than {timeout:.0f} s; it was stopped.'
      ) from e
    if proc.returncode != 0:
      tail = proc.stderr.strip().splitlines()[-1:] or ['(no output)']
      raise RuntimeError(
        f'Loading the SavedModel in a fresh TensorFlow process failed (exit '
        f'status {proc.returncode}): {tail[0]}'
      )
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return np.load(logits_path), report


@dataclasses.dataclass
class _Timer:
  """Wall-clock seconds per phase, in order."""

  phases: dict[str, float] = dataclasses.field(default_factory=dict)

  @contextlib.contextmanager
  def __call__(self, name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
      yield
    finally:
      self.phases[name] = time.perf_counter() - start


def _progress(console: rich.console.Console) -> rich.progress.Progress:
  return rich.progress.Progress(
    rich.progress.TextColumn('[bold]train'),
    rich.progress.BarColumn(),
    rich.progress.MofNCompleteColumn(),
    rich.progress.TextColumn('loss {task.fields[loss]:.3f}'),
    rich.progress.TextColumn('{task.fields[tokens_per_second]:,.0f} tokens/s'),
    rich.progress.TimeElapsedColumn(),
    rich.progress.TimeRemainingColumn(),
    console=console,
  )


@app.command()
def demo(
  steps: Annotated[int, typer.Option(min=1, help='Training steps.')] = 300,
  mesh: Annotated[str, typer.Option(help=_MESH_HELP)] = DEFAULT_MESH,
  rules: Annotated[str | None, typer.Option(help=_RULES_HELP)] = None,
  out: Annotated[
    pathlib.Path,
    typer.Option(help='Output directory (created; its outputs replaced).'),
  ] = pathlib.Path(DEFAULT_OUT),
  seed: Annotated[int, typer.Option(help='Seed of init and data.')] = 0,
  batch_size: Annotated[
    int, typer.Option(min=1, help='Sequences per step.')
  ] = 16,
  cpu_devices: Annotated[
    int | None,
    typer.Option(
      min=1, help=_CPU_DEVICES_HELP + ' Default: the size of --mesh.'
    ),
  ] = None,
  debug: Annotated[bool, typer.Option('--debug', help=_DEBUG_HELP)] = False,
) -> None:
  """Train a small Transformer LM on a sharded mesh and export it to TF.

  On virtual CPU devices: builds the demo model with its params sharded by
  the rules, trains it with optax on the shipped corpus, prints the plan,
  writes an Orbax checkpoint, a DTensor checkpoint and a SavedModel, then
  loads the SavedModel in a fresh TensorFlow-only process and compares its
  logits on held-out text with JAX's.
  """
  with _handle_errors(debug):
    _run_demo(
      steps=steps,
      mesh_text=mesh,
      rules_path=rules,
      out=out,
      seed=seed,
      batch_size=batch_size,
      cpu_devices=cpu_devices,
    )


def _run_demo(
  *,
  steps: int,
  mesh_text: str,
  rules_path: str | None,
  out: pathlib.Path,
  seed: int,
  batch_size: int,
  cpu_devices: int | None,
) -> None:
  console = _console()
  timer = _Timer()
  start = time.perf_counter()
  axes = parse_mesh(mesh_text)
  rules_ = load_rules(rules_path)
  size = math.prod(s for _, s in axes)
  configure_cpu_devices(cpu_devices or size)
  if out.exists() and not out.is_dir():
    raise BadInputError(
      f'--out {str(out)!r} exists and is not a directory. Pass a directory.'
    )

  with timer('set up (JAX, TF DTensor)'):
    import jax  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    from flax import nnx  # pylint: disable=g-import-not-at-top

    import flax_dtensor as fdt  # pylint: disable=g-import-not-at-top
    from flax_dtensor.demo import (
      data,  # pylint: disable=g-import-not-at-top
      train,  # pylint: disable=g-import-not-at-top
    )
    from flax_dtensor.demo import model as model_lib  # pylint: disable=g-import-not-at-top

    mesh_ = make_mesh(axes, mesh_text)
    dtensor = _initialize_dtensor()  # Before any other TF operation.
  console.print(
    f'[bold]flax-dtensor demo[/]: {jax.device_count()} '
    f'{jax.default_backend()} devices, mesh {mesh_text}, {steps} steps, '
    f'batch {batch_size}, seed {seed}',
    highlight=False,
  )

  length = model_lib.Config().max_length
  train_tokens, _ = data.split_tokens()
  batches = data.Batches(train_tokens, batch_size, length, seed=seed)
  held_out = data.held_out_batch(8, length)[:, :length]
  losses: list[float] = []
  with jax.set_mesh(mesh_), fdt.logical_axis_rules(rules_):
    with timer('build model + optimizer'):
      model = model_lib.make_model(seed=seed)
      optimizer = train.make_optimizer(model, steps=steps)
    console.print(fdt.plan(model))
    tokens_per_step = batch_size * length
    with timer('train (incl. compile)'):
      with _progress(console) as progress:
        task = progress.add_task(
          'train', total=steps, loss=float('nan'), tokens_per_second=0.0
        )
        last = time.perf_counter()
        rate = 0.0
        for step in range(steps):
          loss = float(train.train_step(model, optimizer, next_batch(batches)))
          now = time.perf_counter()
          losses.append(loss)
          current = tokens_per_step / max(now - last, 1e-9)
          # Smoothed; the first step (compilation) does not count.
          rate = current if step == 1 else 0.9 * rate + 0.1 * current
          progress.update(
            task, advance=1, loss=loss, tokens_per_second=rate if step else 0
          )
          last = now
    with timer('held-out logits (JAX)'):
      forward = nnx.jit(lambda m, x: m(x))
      jax_logits = np.asarray(
        forward(model, train.shard_batch(held_out)), np.float32
      )

  # Exports, outside the rules context: the SavedModel then has no sharding
  # constraints and runs on one TF device.
  out.mkdir(parents=True, exist_ok=True)
  paths = {
    'orbax': out / 'orbax',
    'checkpoint': out / 'checkpoint',
    'saved_model': out / 'saved_model',
  }
  with timer('write Orbax checkpoint'):
    if paths['orbax'].exists():
      shutil.rmtree(paths['orbax'])
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(paths['orbax'].absolute(), nnx.state(model))
    checkpointer.wait_until_finished()
  with timer('write DTensor checkpoint'):
    dtensor.save_checkpoint(model, paths['checkpoint'], overwrite=True)
  with timer('write SavedModel'):
    tf = sys.modules['tensorflow']
    dtensor.save_saved_model(
      model,
      paths['saved_model'],
      input_signature=[tf.TensorSpec([None, length], tf.int32, name='tokens')],
      overwrite=True,
    )
  rules_copy = out / 'rules.yaml'
  if rules_path is None:
    rules_copy.write_text(train.rules_text())
  else:
    shutil.copyfile(rules_path, rules_copy)
  with timer('verify in TF-only subprocess'):
    tf_logits, report = verify_saved_model(paths['saved_model'], held_out)
  diff = float(np.max(np.abs(tf_logits - jax_logits)))
  scale = float(np.max(np.abs(jax_logits)))
  total = time.perf_counter() - start

  summary = {
    'mesh': dict(axes),
    'devices': jax.device_count(),
    'steps': steps,
    'batch_size': batch_size,
    'seed': seed,
    'loss_first': losses[0],
    'loss_last': losses[-1],
    'loss_min': min(losses),
    'losses': losses,
    'max_abs_logits_diff': diff,
    'max_abs_logits': scale,
    'held_out_shape': list(held_out.shape),
    'tf_subprocess': report,
    'files': {k: str(v) for k, v in paths.items()},
    'bytes': {k: _disk_usage(v) for k, v in paths.items()},
    'seconds': timer.phases,
    'total_seconds': total,
  }
  (out / 'summary.json').write_text(json.dumps(summary, indent=1) + '\n')
  _print_summary(console, summary, out)


def next_batch(batches: Any) -> Any:
  from flax_dtensor.demo import train  # pylint: disable=g-import-not-at-top

  return train.shard_batch(next(batches))


def _print_summary(
  console: rich.console.Console, summary: dict[str, Any], out: pathlib.Path
) -> None:
  files = rich.table.Table(title='Files written', title_justify='left')
  files.add_column('what')
  files.add_column('path')
  files.add_column('size', justify='right')
  labels = {
    'orbax': 'Orbax checkpoint (JAX)',
    'checkpoint': 'DTensor checkpoint (TF)',
    'saved_model': 'SavedModel (TF serving)',
  }
  for key, label in labels.items():
    files.add_row(
      label, summary['files'][key], _human_bytes(summary['bytes'][key])
    )
  files.add_row('summary', str(out / 'summary.json'), '')
  timings = rich.table.Table(title='Timings', title_justify='left')
  timings.add_column('phase')
  timings.add_column('seconds', justify='right')
  for phase, seconds in summary['seconds'].items():
    timings.add_row(phase, f'{seconds:.1f}')
  timings.add_row('[bold]total', f'[bold]{summary["total_seconds"]:.1f}')
  results = rich.table.Table(title='Results', title_justify='left')
  results.add_column('measure')
  results.add_column('value', justify='right')
  losses = summary['losses']
  results.add_row(
    'train loss, first -> last (nats/byte)',
    f'{losses[0]:.3f} -> {losses[-1]:.3f}',
  )
  results.add_row('train loss, minimum', f'{summary["loss_min"]:.3f}')
  stride = max(1, len(losses) // 8)
  results.add_row(
    f'train loss every {stride} steps',
    ' '.join(f'{x:.2f}' for x in losses[::stride]),
  )
  results.add_row(
    'max |logits TF - logits JAX| (held-out batch '
    f'{tuple(summary["held_out_shape"])})',
    f'{summary["max_abs_logits_diff"]:.2e}',
  )
  results.add_row('max |logits JAX|', f'{summary["max_abs_logits"]:.2f}')
  results.add_row(
    'TF subprocess imported JAX',
    str(summary['tf_subprocess']['jax_imported']),
  )
  console.print(files)
  console.print(timings)
  console.print(results)


# export
# ------------------------------------------------------------------------------


def find_orbax_checkpoint(path: pathlib.Path) -> pathlib.Path:
  """Returns the Orbax checkpoint directory at or below `path`.

  Accepts the directory given to ``StandardCheckpointer.save`` or a
  ``CheckpointManager`` directory (its latest step, with one item).

  Raises:
    BadInputError: If there is no checkpoint there.
  """
  fix = (
    'Pass --checkpoint the directory written by orbax.checkpoint.'
    'StandardCheckpointer().save(path, nnx.state(model)) (or a '
    'CheckpointManager directory).'
  )
  if not path.exists():
    raise BadInputError(f'Checkpoint {str(path)!r} does not exist. {fix}')
  if not path.is_dir():
    raise BadInputError(
      f'Checkpoint {str(path)!r} is a file, not a directory. {fix}'
    )

  def is_checkpoint(p: pathlib.Path) -> bool:
    return (p / '_CHECKPOINT_METADATA').exists() or (p / '_METADATA').exists()

  if is_checkpoint(path):
    return path
  steps = sorted(
    (p for p in path.iterdir() if p.is_dir() and p.name.isdigit()),
    key=lambda p: int(p.name),
  )
  if steps:
    latest = steps[-1]
    if (latest / '_METADATA').exists():
      return latest
    items = [p for p in latest.iterdir() if p.is_dir() and is_checkpoint(p)]
    if len(items) == 1:
      return items[0]
  raise BadInputError(
    f'Checkpoint {str(path)!r} holds no Orbax checkpoint (no '
    f'_CHECKPOINT_METADATA or _METADATA file). {fix}'
  )


def restore_orbax(path: pathlib.Path, abstract_model: Any, mesh: Any) -> Any:
  """Restores an Orbax checkpoint of ``nnx.state(model)`` onto `mesh`.

  Every array is read directly into the sharding its variable resolves to
  under the current rules (from ``nnx.eval_shape``).

  Returns:
    The restored module.

  Raises:
    BadInputError: If the checkpoint cannot be read or does not match.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  graphdef, abstract_state = nnx.split(abstract_model)

  def concrete(leaf: Any) -> Any:
    sharding = getattr(leaf, 'sharding', None)
    spec = (
      sharding.spec
      if isinstance(sharding, jax.sharding.NamedSharding)
      else jax.sharding.PartitionSpec()
    )
    return jax.ShapeDtypeStruct(
      leaf.shape, leaf.dtype, sharding=jax.sharding.NamedSharding(mesh, spec)
    )

  target = jax.tree.map(concrete, abstract_state)
  checkpointer = ocp.StandardCheckpointer()
  try:
    state = checkpointer.restore(path.absolute(), target)
  except Exception as e:
    raise BadInputError(
      f'Cannot restore the Orbax checkpoint {str(path)!r} into the model: '
      f'{type(e).__name__}: {_one_line(str(e))[:300]}. Expected a checkpoint '
      'of nnx.state(model) for this TARGET, written by orbax.checkpoint.'
      'StandardCheckpointer().save(path, nnx.state(model)).'
    ) from e
  return nnx.merge(graphdef, state)


@app.command()
def export(
  target: Annotated[
    str,
    typer.Argument(
      help='package.module:factory building the model (see `plan`).',
      show_default=False,
    ),
  ],
  checkpoint: Annotated[
    pathlib.Path,
    typer.Option(
      help='Orbax checkpoint of nnx.state(model) to restore.',
      show_default=False,
    ),
  ],
  out: Annotated[
    pathlib.Path,
    typer.Option(help='Output directory.', show_default=False),
  ],
  mesh: Annotated[str, typer.Option(help=_MESH_HELP)] = DEFAULT_MESH,
  rules: Annotated[str | None, typer.Option(help=_RULES_HELP)] = None,
  saved_model: Annotated[
    bool,
    typer.Option(
      '--saved-model', help='Also write a SavedModel (needs --input-shape).'
    ),
  ] = False,
  input_shape: Annotated[
    list[str] | None,
    typer.Option(
      help=(
        'NAME:DIMS:DTYPE of a positional input of the served method, e.g. '
        'x:1,128:int32; repeat for several inputs. The first dimension is '
        'exported as a polymorphic batch dimension.'
      ),
    ),
  ] = None,
  static_batch: Annotated[
    bool,
    typer.Option(
      '--static-batch', help='Keep the first dimension of --input-shape fixed.'
    ),
  ] = False,
  method: Annotated[
    str, typer.Option(help='The module method to serve.')
  ] = '__call__',
  overwrite: Annotated[
    bool, typer.Option('--overwrite', help='Replace existing outputs.')
  ] = False,
  cpu_devices: Annotated[
    int | None, typer.Option(min=1, help=_CPU_DEVICES_HELP)
  ] = None,
  debug: Annotated[bool, typer.Option('--debug', help=_DEBUG_HELP)] = False,
) -> None:
  """Restore an Orbax checkpoint onto a mesh and export it to TF DTensor.

  Builds TARGET abstractly, restores the checkpoint with every array sharded
  by the rules on the mesh, then writes OUT/checkpoint (a TF checkpoint of
  DTensor variables, readable by plain TensorFlow) and, with --saved-model,
  OUT/saved_model.
  """
  with _handle_errors(debug):
    console = _console()
    axes = parse_mesh(mesh)
    rules_ = load_rules(rules)
    specs = [
      parse_input_shape(s, static_batch=static_batch)
      for s in (input_shape or [])
    ]
    if saved_model and not specs:
      raise BadInputError(
        '--saved-model needs the shape of the served inputs: pass '
        '--input-shape NAME:DIMS:DTYPE, e.g. --input-shape x:1,128:int32.'
      )
    if specs and not saved_model:
      raise BadInputError(
        '--input-shape only applies with --saved-model; add --saved-model '
        'or drop --input-shape.'
      )
    source = find_orbax_checkpoint(checkpoint)
    factory = load_target(target)
    if out.exists() and not out.is_dir():
      raise BadInputError(
        f'--out {str(out)!r} exists and is not a directory. Pass a directory.'
      )
    outputs = {'checkpoint': out / 'checkpoint'}
    if saved_model:
      outputs['saved_model'] = out / 'saved_model'
    for path in outputs.values():
      if path.exists() and not overwrite:
        raise BadInputError(
          f'{str(path)!r} already exists. Pass --overwrite to replace it, '
          'or choose another --out.'
        )
    if cpu_devices is not None:
      configure_cpu_devices(cpu_devices)
    import jax  # pylint: disable=g-import-not-at-top

    import flax_dtensor as fdt  # pylint: disable=g-import-not-at-top

    mesh_ = make_mesh(axes, mesh)
    _initialize_dtensor()  # Before any other TF operation.
    start = time.perf_counter()
    with jax.set_mesh(mesh_), fdt.logical_axis_rules(rules_):
      abstract = build_abstract(factory, target)
      model = restore_orbax(source, abstract, mesh_)
    restored = time.perf_counter()
    _write_all_or_nothing(
      out,
      outputs,
      lambda staged: _write_exports(model, staged, specs, method),
      overwrite=overwrite,
    )
    table = rich.table.Table(title='Exported', title_justify='left')
    table.add_column('what')
    table.add_column('path')
    table.add_column('size', justify='right')
    for name, path in outputs.items():
      table.add_row(name, str(path), _human_bytes(_disk_usage(path)))
    console.print(
      f'Restored {source} onto mesh {mesh} in {restored - start:.1f} s; '
      f'exported in {time.perf_counter() - restored:.1f} s.',
      highlight=False,
    )
    console.print(table)


def _write_exports(
  model: Any, staged: dict[str, str], specs: Sequence[InputSpec], method: str
) -> None:
  from flax_dtensor import dtensor  # pylint: disable=g-import-not-at-top

  dtensor.save_checkpoint(model, staged['checkpoint'])
  if 'saved_model' in staged:
    tf = sys.modules['tensorflow']
    signature = [
      tf.TensorSpec(s.shape, tf.dtypes.as_dtype(s.dtype), name=s.name)
      for s in specs
    ]
    dtensor.save_saved_model(
      model, staged['saved_model'], input_signature=signature, method=method
    )


def _write_all_or_nothing(
  out: pathlib.Path,
  outputs: dict[str, pathlib.Path],
  write: Callable[[dict[str, str]], None],
  *,
  overwrite: bool,
) -> None:
  """Writes every output into a scratch directory, then moves all in place.

  If anything fails, nothing of this run is left: no output, no scratch
  directory, and no `out` if this run created it.
  """
  from flax_dtensor.dtensor import _atomic  # pylint: disable=g-import-not-at-top

  created = not out.exists()
  out.mkdir(parents=True, exist_ok=True)
  try:
    with _atomic.staging_directory(str(out.absolute())) as staging:
      staged = {name: os.path.join(staging, name) for name in outputs}
      write(staged)
      for name, path in outputs.items():
        _atomic.commit(staged[name], str(path.absolute()), overwrite=overwrite)
  except BaseException:
    if created:
      with contextlib.suppress(OSError):
        out.rmdir()  # Only if empty: nothing else was there.
    raise


# inspect
# ------------------------------------------------------------------------------


def _axes_text(mesh: dict[str, Any]) -> str:
  names, sizes = mesh.get('axis_names', []), mesh.get('axis_sizes', [])
  return ','.join(f'{n}={s}' for n, s in zip(names, sizes, strict=True))


def sharding_texts(record: Any) -> tuple[str, str]:
  """(JAX sharding, DTensor layout) texts of a flax_dtensor.json record.

  The record is the structured ``sharding`` of a variable (the JAX spec as
  mesh axes per dimension, the JAX mesh, and the DTensor layout it was
  written with), e.g. ``P('data', 'model') @ data=2,model=4`` and
  ``data,model @ data=2,model=4``. A dimension over two JAX axes is on a
  fused DTensor axis: ``P(('data', 'model'), None) @ data=2,model=4`` and
  ``data+model,unsharded @ data+model=8``. A record of an older
  flax_dtensor (a display string) is shown as it is, with no DTensor
  layout; a missing one as '-'.
  """
  if not isinstance(record, dict):
    return (str(record) if record else '-'), '-'
  try:
    if record['kind'] == 'single_device':
      jax_text = 'one device'
    else:
      entries = []
      for axes in record['spec']:
        if not axes:
          entries.append('None')
        elif len(axes) == 1:
          entries.append(repr(axes[0]))
        else:
          entries.append('(' + ', '.join(map(repr, axes)) + ')')
      jax_text = f'P({", ".join(entries)}) @ {_axes_text(record["mesh"])}'
    layout = record['dtensor_layout']
    specs = ','.join(layout['sharding_specs']) or 'scalar'
    dtensor_text = f'{specs} @ {_axes_text(layout["mesh"])}'
  except (KeyError, TypeError, ValueError) as e:
    raise BadInputError(
      f'Malformed sharding record in flax_dtensor.json: {record!r:.200} '
      f'({type(e).__name__}: {e}). Re-export the checkpoint.'
    ) from e
  return jax_text, dtensor_text


def _read_manifest(path: pathlib.Path) -> dict[str, Any]:
  """{variable path text: manifest record}, or {} without a manifest."""
  from flax_dtensor import _errors  # pylint: disable=g-import-not-at-top
  from flax_dtensor.dtensor import _manifest, _names  # pylint: disable=g-import-not-at-top

  try:
    manifest = _manifest.read(str(path))
  except _errors.ExportError as e:
    raise BadInputError(str(e)) from e
  if manifest is None or manifest.root != str(path.absolute()):
    return {}
  return {_names.path_text(r.path): r for r in manifest.records}


_LAYOUT_CAPTION = (
  'JAX sharding: the PartitionSpec @ the JAX mesh. DTensor layout: one '
  'sharding spec per dimension @ the DTensor mesh (an axis a+b fuses JAX '
  'axes a and b). From flax_dtensor.json.'
)


def inspect_checkpoint(path: pathlib.Path) -> rich.table.Table:
  """A table of a DTensor checkpoint's variables, read with TensorFlow."""
  from flax_dtensor import dtensor  # pylint: disable=g-import-not-at-top
  from flax_dtensor.dtensor import _names, _tf  # pylint: disable=g-import-not-at-top

  tf = _tf.tf()
  metadata = _read_manifest(path)
  try:
    reader = tf.train.load_checkpoint(str(path))
  except Exception as e:
    raise BadInputError(
      f'TensorFlow cannot read the checkpoint in {str(path)!r}: '
      f'{_one_line(str(e))[:200]}. Pass a directory written by '
      '`flax-dtensor export` or `flax-dtensor demo`.'
    ) from e
  shapes = reader.get_variable_to_shape_map()
  dtypes = reader.get_variable_to_dtype_map()
  table = rich.table.Table(
    title=f'DTensor checkpoint {path}', title_justify='left'
  )
  for column in _VARIABLE_COLUMNS:
    table.add_column(column)
  count = 0
  for key in sorted(shapes):
    nnx_path = dtensor.nnx_path(key)
    if nnx_path is None:
      continue
    name = _names.path_text(nnx_path)
    shape = tuple(shapes[key])
    table.add_row(
      name, *_variable_row(metadata.get(name), shape, dtypes[key].name)
    )
    count += 1
  table.caption = f'{count} variables. {_LAYOUT_CAPTION}'
  return table


_VARIABLE_COLUMNS = (
  'variable',
  'type',
  'shape',
  'dtype',
  'JAX sharding',
  'DTensor layout',
)


def _variable_row(
  record: Any, shape: tuple[int, ...], stored: str
) -> tuple[str, ...]:
  """type, shape, dtype, JAX sharding and DTensor layout cells."""
  if record is None:
    return ('-', str(shape), stored, '-', '-')
  dtype = record.dtype
  if dtype != stored:
    dtype = f'{dtype} (stored as {stored})'
  jax_text, dtensor_text = sharding_texts(record.sharding)
  return (record.type, str(shape), dtype, jax_text, dtensor_text)


def inspect_saved_model(path: pathlib.Path) -> list[rich.table.Table]:
  """Tables of a SavedModel's signatures and variables, read with TF."""
  from flax_dtensor import dtensor  # pylint: disable=g-import-not-at-top
  from flax_dtensor.dtensor import _names, _tf  # pylint: disable=g-import-not-at-top

  tf = _tf.tf()
  try:
    loaded = tf.saved_model.load(str(path))
  except Exception as e:
    raise BadInputError(
      f'TensorFlow cannot load the SavedModel in {str(path)!r}: '
      f'{_one_line(str(e))[:200]}. Pass a directory written by '
      '`flax-dtensor export --saved-model` or `flax-dtensor demo`.'
    ) from e
  signatures = rich.table.Table(
    title=f'SavedModel {path}: signatures', title_justify='left'
  )
  for column in ('signature', 'inputs', 'outputs'):
    signatures.add_column(column)

  def describe(specs: Any) -> str:
    return '\n'.join(
      f'{k}: {list(s.shape)} {s.dtype.name}' for k, s in sorted(specs.items())
    )

  for name, fn in sorted(loaded.signatures.items()):
    signatures.add_row(
      name,
      describe(fn.structured_input_signature[1]),
      describe(fn.structured_outputs),
    )
  metadata = _read_manifest(path)
  variables = rich.table.Table(
    title=f'SavedModel {path}: variables', title_justify='left'
  )
  for column in _VARIABLE_COLUMNS:
    variables.add_column(column)
  flat = dtensor.flat_variables(loaded)
  for nnx_path, v in flat.items():
    name = _names.path_text(nnx_path)
    shape = tuple(v.shape)
    variables.add_row(
      name, *_variable_row(metadata.get(name), shape, v.dtype.name)
    )
  variables.caption = f'{len(flat)} variables. ' + (
    _LAYOUT_CAPTION.replace('flax_dtensor.json', 'assets/flax_dtensor.json')
    if metadata
    else 'No assets/flax_dtensor.json: no layouts.'
  )
  return [signatures, variables]


@app.command()
def inspect(
  directory: Annotated[
    pathlib.Path,
    typer.Argument(
      help=(
        'A directory written by `export` or `demo` (holding checkpoint/ '
        'and saved_model/), or one checkpoint or SavedModel directory.'
      ),
      show_default=False,
    ),
  ],
  debug: Annotated[bool, typer.Option('--debug', help=_DEBUG_HELP)] = False,
) -> None:
  """List every variable's name, shape, dtype and DTensor layout.

  Read with TensorFlow (plain TF, no JAX involved in reading). The layouts
  (JAX PartitionSpec and mesh, and the DTensor layout written, whose mesh
  axis a+b fuses JAX axes a and b) come from the flax_dtensor.json next to
  a checkpoint, or in a SavedModel's assets; a SavedModel also shows its
  serving signatures.
  """
  with _handle_errors(debug):
    if not directory.is_dir():
      raise BadInputError(
        f'{str(directory)!r} is not a directory. Pass a directory written '
        'by `flax-dtensor export` or `flax-dtensor demo`.'
      )
    found: list[tuple[str, pathlib.Path]] = []
    for candidate in (directory, directory / 'checkpoint'):
      if (candidate / 'checkpoint').is_file() or any(candidate.glob('*.index')):
        found.append(('checkpoint', candidate))
        break
    for candidate in (directory, directory / 'saved_model'):
      if (candidate / 'saved_model.pb').is_file():
        found.append(('saved_model', candidate))
        break
    if not found:
      raise BadInputError(
        f'{str(directory)!r} holds no TF checkpoint or SavedModel. Pass a '
        'directory written by `flax-dtensor export` or `flax-dtensor demo`.'
      )
    console = _console()
    for kind, path in found:
      if kind == 'checkpoint':
        console.print(inspect_checkpoint(path))
      else:
        for table in inspect_saved_model(path):
          console.print(table)


def main(argv: Sequence[str] | None = None) -> None:
  """Runs the command line (the ``flax-dtensor`` entry point)."""
  global _capture_until_exit
  _capture_until_exit = True
  app(args=list(argv) if argv is not None else None, prog_name='flax-dtensor')
