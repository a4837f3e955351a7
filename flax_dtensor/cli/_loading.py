"""What commands read: meshes, input shapes, rules files, model factories.

Each parser raises `BadInputError` naming the flag, what arrived and how to
write it. JAX, Flax and TensorFlow are imported inside the functions, so
``--help`` stays fast and devices can be set up before JAX starts.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import os
import pathlib
import re
import sys
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import typer

from flax_dtensor.cli._command import BadInputError, one_line

DEMO_TARGET = 'flax_dtensor.demo.model:make_model'
DEFAULT_MESH = 'data=2,model=4'
_DEVICE_COUNT_FLAG = '--xla_force_host_platform_device_count'
_MESH_ITEM = re.compile(r'^([A-Za-z_][A-Za-z0-9_]*)=(\S*)$')
MESH_HELP = 'Mesh axes as NAME=SIZE pairs, e.g. data=2,model=4.'
MESH_METAVAR = 'NAME=SIZE,...'
RULES_METAVAR = 'RULES.yaml'
RULES_HELP = (
  "A YAML rules file in MaxText's format (a logical_axis_rules list of "
  '(name, target) pairs), and path_rules for variables without logical '
  'axes (see the path rules page). Default: the demo rules (a note says '
  'so: first on stdout, or on stderr with --json).'
)
DEMO_RULES_NOTE = (
  "note: no --rules given, so the demo's rules apply "
  '(flax_dtensor/demo/rules.yaml).'
)
OWN_RULES_HINT = (
  " For {target}'s own rules pass --rules RULES.yaml, or --suggest to "
  'propose some.'
)


def demo_rules_note(
  rules: str | None, mesh_axis_names: bool, target: str
) -> str | None:
  """The note that the demo's rules apply (no --rules), or None."""
  if rules is not None or mesh_axis_names:
    return None
  if target == DEMO_TARGET:
    return DEMO_RULES_NOTE
  return DEMO_RULES_NOTE + OWN_RULES_HINT.format(target=target)


MESH_AXIS_NAMES_HELP = (
  "The model's annotations name mesh axes (as tunix's ShardingConfig "
  'does): each axis of --mesh is its own rule '
  '(fdt.LogicalRules.for_mesh_axes). With --rules, after the rules of the '
  'file; without, instead of the demo rules.'
)
MISSING_MESH_AXES_HELP = (
  'What a rule naming a mesh axis the mesh lacks does: fallback (the '
  'default: it is skipped, the next rule for its name applies, and one '
  "spelled like a mesh axis is a likely typo, the plan's headline) or "
  "error (exit 2 naming each such rule). Overrides the rules file's "
  'missing_mesh_axes.'
)
OPTIMIZER_HELP = (
  "Also plan the optimizer's state (under optimizer/), as fdt.plan's "
  '`optimizer=` does: the name of an optax transformation taking a '
  'learning rate, e.g. adamw, adam, sgd, lion, adafactor.'
)
CPU_DEVICES_HELP = (
  'Run on this many virtual CPU devices (sets XLA_FLAGS and '
  'jax_num_cpu_devices before JAX starts).'
)

# The options every command that builds a model takes, declared once (typer
# reads a copy of each `typer.Option` per command).
MeshOption = Annotated[str, typer.Option(metavar=MESH_METAVAR, help=MESH_HELP)]
RulesOption = Annotated[
  str | None, typer.Option(metavar=RULES_METAVAR, help=RULES_HELP)
]
MeshAxisNamesOption = Annotated[
  bool, typer.Option('--mesh-axis-names', help=MESH_AXIS_NAMES_HELP)
]
AXIS_TYPES_HELP = (
  "The mesh axes' types: auto (the default: JAX's compiler places "
  'activations, as `with_sharding_constraint` asks), explicit (as '
  '`jax.make_mesh` gives: for models whose forward says where results go, '
  '`out_sharding=`, `jax.sharding.reshard`), or NAME=TYPE pairs, e.g. '
  'data=explicit,model=auto (an axis not named is auto).'
)
AxisTypesOption = Annotated[
  str,
  typer.Option(
    '--axis-types', metavar='auto|explicit|NAME=TYPE', help=AXIS_TYPES_HELP
  ),
]
_AXIS_TYPE_NAMES = ('auto', 'explicit')


def parse_axis_types(text: str, axes: Sequence[tuple[str, int]]) -> tuple:
  """Parses ``--axis-types`` against the axes of ``--mesh``.

  Returns:
    One `jax.sharding.AxisType` per axis of `axes`, in order.

  Raises:
    BadInputError: If a type is not auto or explicit, or a NAME is not an
      axis of the mesh.
  """
  import jax

  kinds = {
    'auto': jax.sharding.AxisType.Auto,
    'explicit': jax.sharding.AxisType.Explicit,
  }
  names = [n for n, _ in axes]
  fix = (
    'Pass --axis-types auto, explicit, or NAME=TYPE pairs naming axes of '
    f'--mesh ({", ".join(names)}), each type auto or explicit.'
  )
  whole = text.strip().lower()
  if whole in kinds:
    return (kinds[whole],) * len(axes)
  chosen: dict[str, Any] = {}
  for item in text.split(','):
    name, eq, kind = (part.strip() for part in item.partition('='))
    if not eq or not name:
      raise BadInputError(
        f'Malformed --axis-types {text!r}: expected auto, explicit or '
        f'NAME=TYPE, got {item.strip()!r}. {fix}'
      )
    if name not in names:
      raise BadInputError(
        f'Malformed --axis-types {text!r}: {name!r} is not an axis of '
        f'--mesh (its axes: {", ".join(names)}). {fix}'
      )
    if kind.lower() not in kinds:
      raise BadInputError(
        f'Malformed --axis-types {text!r}: axis {name!r} has type {kind!r}; '
        f'expected one of {", ".join(_AXIS_TYPE_NAMES)}. {fix}'
      )
    if name in chosen:
      raise BadInputError(
        f'Malformed --axis-types {text!r}: axis {name!r} is named twice. {fix}'
      )
    chosen[name] = kinds[kind.lower()]
  return tuple(chosen.get(n, kinds['auto']) for n in names)


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
    name, size_text = match.groups()
    try:
      size = int(size_text)
    except ValueError:
      size = None
    if size is None or size < 1:
      raise BadInputError(
        f'Malformed --mesh {text!r}: axis {name!r} has size {size_text!r}; '
        f'sizes must be positive integers. {fix}'
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
  """One ``--input-shape`` entry: ``NAME:DIMS:DTYPE``, or ``NAME:none``.

  Attributes:
    name: The name of the input in the served signature.
    dims: Each dimension: a size, a name (dimensions of one name are one
      size), or None (a size of its own). None for an argument passed as
      None.
    dtype: The dtype's name; None for an argument passed as None.
    given: The entry as the user wrote it (messages echo it so), or None.
  """

  name: str
  dims: tuple[int | str | None, ...] | None
  dtype: str | None
  given: str | None = dataclasses.field(default=None, compare=False)

  @property
  def shape(self) -> tuple[int | None, ...] | None:
    """The TF shape: None for each polymorphic dimension."""
    if self.dims is None:
      return None
    return tuple(d if isinstance(d, int) else None for d in self.dims)

  def tensor_spec(self) -> Any:
    """The `tf.TensorSpec` of the input, or None (imports TensorFlow)."""
    from flax_dtensor.dtensor import _tf

    if self.dims is None:
      return None
    tf = _tf.tf()
    return tf.TensorSpec(self.shape, tf.dtypes.as_dtype(self.dtype), self.name)

  def polymorphic_shape(self, index: int) -> str | None:
    """jax2tf's polymorphic shape of the input (`index`: its position)."""
    from flax_dtensor.dtensor._serving import _signature

    if self.dims is None:
      return None
    return _signature.shape_text(_signature.symbolic_dims(self.dims, index))

  def text(self, dims: Sequence[int | str | None] | None = None) -> str:
    """The entry as the user wrote it; with `dims` instead of its own if
    given (a suggestion)."""
    if dims is None and self.given is not None:
      return self.given
    dims = self.dims if dims is None else dims
    if dims is None:
      return f'{self.name}:none'
    written = ','.join('?' if d is None else str(d) for d in dims)
    return f'{self.name}:{written}:{self.dtype}'


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
_DIM_NAME = re.compile(r'^[A-Za-z_][A-Za-z0-9_]*$')
INPUT_SHAPE_FIX = (
  'Pass --input-shape NAME:DIMS:DTYPE, e.g. x:1,128:int32, or NAME:none for '
  'an argument passed as None (one per positional parameter of the '
  'method, in order).'
)


def parse_input_shape(text: str, *, static_batch: bool) -> InputSpec:
  """Parses ``'x:1,128:int32'``, ``'mask:b,t,t:bool'`` or ``'cache:none'``.

  A dimension is a size, a name (a polymorphic dimension; those of one name
  are one size, across inputs too), or ``?`` (``None``): a polymorphic
  dimension of its own. Unless `static_batch`, a leading size is the batch
  ``b`` (the size only serves as an example). ``NAME:none`` passes None.

  Raises:
    BadInputError: If the text is malformed.
  """
  parts = text.split(':')
  if len(parts) == 2 and parts[0] and parts[1].lower() == 'none':
    return InputSpec(parts[0], None, None, given=text)
  if len(parts) != 3 or not parts[0] or not parts[1]:
    raise BadInputError(f'Malformed --input-shape {text!r}. {INPUT_SHAPE_FIX}')
  name, dims_text, dtype = parts
  if dtype not in _DTYPES:
    raise BadInputError(
      f'Malformed --input-shape {text!r}: unknown dtype {dtype!r}; expected '
      f'one of {", ".join(_DTYPES)}. {INPUT_SHAPE_FIX}'
    )
  dims: list[int | str | None] = []
  for d in dims_text.split(','):
    d = d.strip()
    if d in ('?', 'None', 'none'):
      dims.append(None)
    elif d.isdigit() and int(d) > 0:
      dims.append(int(d))
    elif _DIM_NAME.match(d):
      dims.append(d)
    else:
      raise BadInputError(
        f'Malformed --input-shape {text!r}: dimension {d!r} is not a '
        'positive integer, a name (a polymorphic dimension: b, t, ...; '
        'those of one name are one size) or ? (one of its own). '
        f'{INPUT_SHAPE_FIX}'
      )
  if not static_batch and isinstance(dims[0], int):
    dims[0] = 'b'  # The batch symbol, `_signature.BATCH`.
  return InputSpec(name, tuple(dims), dtype, given=text)


def check_out(
  out: pathlib.Path,
  *,
  overwrite: bool,
  flag: bool,
  reads: pathlib.Path | None = None,
) -> bool:
  """Checks, before any work, that a run may write `out` as a whole.

  `out`, or the nearest of its parents that exists, must be a directory;
  an existing `out` is replaced as a whole (`_run_folder.writing`), so it
  may hold only an earlier run's output.

  Args:
    out: The output folder (``--out``).
    overwrite: Whether the user asked to replace an earlier run's output.
    flag: Whether the command has ``--overwrite`` (else it always may).
    reads: The input the run reads (``--checkpoint``), never inside `out`.

  Returns:
    Whether `out` exists and holds something (to be replaced).

  Raises:
    BadInputError: If `out` or its nearest existing parent is not a
      directory, `out` holds files no run wrote, or an earlier run's output
      and `overwrite` is false, or `reads` or the current directory is
      inside it.
  """
  from flax_dtensor.cli import _run_folder

  existing = out
  while not existing.exists() and existing.parent != existing:
    existing = existing.parent
  if not existing.is_dir():
    where = '' if existing == out else f' (its parent {str(existing)!r} is not)'
    raise BadInputError(
      f'--out {str(out)!r} is not a directory{where}. Pass a directory, '
      'existing or to be created.'
    )
  # Where the run creates its folder (`out`'s parent) or, for the current
  # directory, writes inside it: refused now rather than after training.
  here = out.is_dir() and _run_folder.holds_cwd(out)
  writes_in = existing if here or existing != out else existing.parent
  if writes_in.is_dir() and not os.access(writes_in, os.W_OK | os.X_OK):
    from flax_dtensor.dtensor._storage import _atomic

    raise BadInputError(
      f'--out {str(out)!r} cannot be written: {str(writes_in)!r} is not '
      f'writable ({_atomic._who_may_write(str(writes_in))}). Pass a '
      'directory you may write in.'
    )
  if not out.is_dir():
    return False
  if here:
    entries = [e for e in os.listdir(out) if not _run_folder.ours(e)]
    if entries or out.resolve() != pathlib.Path.cwd().resolve():
      raise BadInputError(
        f'--out {str(out)!r} is the current directory or holds it, and '
        'is not empty; a run replaces its output folder as a whole, which '
        'it cannot do to the directory it runs in. Pass a directory inside '
        'it, e.g. --out flax_dtensor_out (an empty current directory will '
        'do too).'
      )
    return False
  if reads is not None and reads.resolve().is_relative_to(out.resolve()):
    raise BadInputError(
      f'--checkpoint {str(reads)!r} is inside --out {str(out)!r}, which the '
      'run replaces as a whole. Choose another --out.'
    )
  if out.is_symlink():
    raise BadInputError(
      f'--out {str(out)!r} is a symbolic link; the output folder is replaced '
      'as a whole. Pass the directory it points to, or a new one.'
    )
  others = _run_folder.foreign(out)
  if others:
    shown = ', '.join(repr(n) for n in others[:5])
    more = f' and {len(others) - 5} more' if len(others) > 5 else ''
    raise BadInputError(
      f'--out {str(out)!r} holds {shown}{more}, which no flax-dtensor run '
      'wrote. A run replaces its output folder as a whole: pass a new or '
      'empty directory, or an earlier output of demo or export.'
    )
  if not os.listdir(out):
    return False
  if flag and not overwrite:
    raise BadInputError(
      f"{str(out)!r} already exists (an earlier run's output). Pass "
      '--overwrite to replace it as a whole, or choose another --out.'
    )
  return True


def load_rules(
  path: str | None, *, mesh_axes: Sequence[str] | None = None
) -> Any:
  """Reads a rules file (the demo rules when `path` is None).

  With `mesh_axes` (``--mesh-axis-names``), each mesh axis is also its own
  rule, after the file's rules (or alone, without a file).

  Raises:
    BadInputError: If the file is missing or malformed.
  """
  from flax_dtensor import _errors
  from flax_dtensor._rules import _logical

  if mesh_axes is not None:
    identity = _logical.LogicalRules.for_mesh_axes(tuple(mesh_axes))
    if path is None:
      return identity
    rules = load_rules(path)
    return _logical.LogicalRules([*rules, *identity]).replace(
      unknown=rules.unknown,
      strict=rules.strict,
      path_rules=rules.path_rules,
      min_size=rules.min_size,
      min_bytes=rules.min_bytes,
      missing_mesh_axes=rules.missing_mesh_axes,
    )
  from flax_dtensor.demo import train

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
    # The message names the file, what is wrong where, and an example.
    raise BadInputError(f'Malformed rules file: {e}') from e


def with_missing_mesh_axes(rules: Any, value: str | None) -> Any:
  """`rules` with ``--missing-mesh-axes`` applied (unchanged if None).

  Raises:
    BadInputError: If the value is not a choice.
  """
  if value is None:
    return rules
  choices = ('fallback', 'error')
  if value not in choices:
    raise BadInputError(
      f'--missing-mesh-axes expected one of {", ".join(choices)}; got '
      f'{value!r}. Pass --missing-mesh-axes error to make a rule naming a '
      'mesh axis the mesh lacks an error.'
    )
  return rules.replace(missing_mesh_axes=value)


def load_optimizer(name: str) -> Any:
  """The optax transformation ``optax.NAME(learning_rate=1e-3)``.

  Raises:
    BadInputError: If optax has no such transformation.
  """
  import optax

  fix = (
    'Pass --optimizer the name of an optax transformation taking a '
    'learning rate, e.g. adamw, adam, sgd, lion or adafactor.'
  )
  make = getattr(optax, name, None) if name.isidentifier() else None
  if not callable(make):
    raise BadInputError(f'--optimizer {name!r}: optax has no such name. {fix}')
  try:
    transformation = make(learning_rate=1e-3)
  except Exception as e:
    raise BadInputError(
      f'--optimizer {name!r}: optax.{name}(learning_rate=1e-3) raised '
      f'{type(e).__name__}: {one_line(e)}. {fix}'
    ) from e
  if not (
    hasattr(transformation, 'init') and hasattr(transformation, 'update')
  ):
    raise BadInputError(
      f'--optimizer {name!r}: optax.{name} is not a gradient '
      f'transformation. {fix}'
    )
  return transformation


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
    if spec is None or spec.loader is None:
      raise BadInputError(
        f'TARGET {target!r}: file {str(path)!r} is not a Python source file '
        f'Python can import (expected a .py file; {example}).'
      )
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


def configure_cpu_devices(count: int, *, only_cpu: bool = True) -> None:
  """Makes JAX run on `count` virtual CPU devices.

  Must run before JAX starts its backend (the first time anything asks for
  devices). Sets ``XLA_FLAGS`` too, so subprocesses inherit the setting.
  With `only_cpu` false, JAX keeps its platform (an accelerator if there is
  one): only the CPU backend's device count is set.
  """
  flags = re.sub(
    _DEVICE_COUNT_FLAG + r'=\S*', '', os.environ.get('XLA_FLAGS', '')
  )
  os.environ['XLA_FLAGS'] = f'{flags} {_DEVICE_COUNT_FLAG}={count}'.strip()
  import jax

  try:
    if only_cpu:
      jax.config.update('jax_platforms', 'cpu')
    jax.config.update('jax_num_cpu_devices', count)
  except RuntimeError:  # The backend already started; checked by make_mesh.
    pass


def make_mesh(
  axes: Sequence[tuple[str, int]],
  mesh_text: str,
  axis_types: tuple | None = None,
) -> Any:
  """Builds a mesh over all devices, checking the count.

  Its axes are `axis_types` (`parse_axis_types`), Auto if not given.

  Raises:
    BadInputError: If the mesh size differs from the device count.
  """
  import jax

  from flax_dtensor import _text

  size = math.prod(s for _, s in axes)
  count = jax.device_count()
  if size != count:
    raise BadInputError(
      f'--mesh {mesh_text} needs {_text.count(size, "device")}, but '
      f'JAX has {count} ({jax.default_backend()}). Pass a mesh of '
      f'{_text.count(count, "device")}, or on CPU run on {size} '
      f'virtual devices with --cpu-devices {size}.'
    )
  return jax.make_mesh(
    tuple(s for _, s in axes),
    tuple(n for n, _ in axes),
    axis_types=axis_types or (jax.sharding.AxisType.Auto,) * len(axes),
  )


def abstract_mesh(
  axes: Sequence[tuple[str, int]], axis_types: tuple | None = None
) -> Any:
  import jax

  return jax.sharding.AbstractMesh(
    tuple(s for _, s in axes),
    tuple(n for n, _ in axes),
    axis_types=axis_types or (jax.sharding.AxisType.Auto,) * len(axes),
  )


def build_abstract(factory: Callable[[], Any], target: str) -> Any:
  """The model built abstractly (nothing allocated, linear in its size).

  Call it under a mesh and rules: annotated variables then carry their
  sharding.

  Raises:
    BadInputError: If the factory raises or does not return an nnx.Module.
  """
  from flax import nnx

  from flax_dtensor import _errors
  from flax_dtensor._hook import _install
  from flax_dtensor._placement import _init
  from flax_dtensor._rules import _logical, _missing_axes

  _install.ensure_installed()  # Before the factory builds anything.

  # Built with unmentioned names replicated, so that a name the rules lack
  # is reported by the plan the caller makes next, with the variable's path
  # (creation does not know it yet).
  rules = _logical.get_logical_axis_rules()
  lenient = (
    rules.replace(unknown='replicate')
    if isinstance(rules, _logical.LogicalRules)
    else None
  )
  try:
    # A likely typo is said by the plan made next (its headline).
    with _missing_axes.reported_elsewhere():
      if lenient is not None:
        with _logical.logical_axis_rules(lenient):
          model = _init.build_abstract(factory)
      else:
        model = _init.build_abstract(factory)
  except _errors.NotAModelError as e:
    raise BadInputError(f'TARGET {target!r}: {e}') from e
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


def initialize_dtensor() -> Any:
  from flax_dtensor import dtensor

  dtensor.initialize()
  return dtensor


def check_served_inputs(
  abstract: Any, method: str, specs: Sequence[InputSpec]
) -> None:
  """Traces `method` of the abstract model on the inputs, before any write.

  The inputs have the polymorphic shapes the SavedModel will have, and the
  arguments given as ``NAME:none`` are None. Nothing is computed.

  Raises:
    BadInputError: If the model has no such method, the inputs do not fit
      its positional parameters, or it fails on inputs of these shapes and
      dtypes (e.g. a forgotten batch dimension, or ``?`` dimensions that
      must be equal); the message shows the shapes given and the error.
    ExportError: If the method's result holds something other than arrays
      and None.
  """
  import jax
  from flax import nnx

  from flax_dtensor import _errors, _text
  from flax_dtensor.dtensor._serving import _saved_model, _signature

  if not callable(getattr(abstract, method, None)):
    raise BadInputError(
      f'--method {method!r}: the model ({type(abstract).__name__}) has no '
      'such method. Pass --method NAME of a method that takes the inputs.'
    )
  given = ', '.join(s.text() for s in specs)
  where = f'{type(abstract).__name__}.{method}'
  parameters = _signature.parameters(abstract, method)
  if parameters is not None and not parameters.fits(len(specs)):
    raise BadInputError(
      f'--input-shape {given} gives '
      f'{_text.count(len(specs), "argument")}, but '
      f'{parameters.method} {parameters.takes()}. Pass one --input-shape '
      'per positional parameter, in order, and NAME:none for an argument '
      'passed as None (e.g. --input-shape cache:none).'
    )
  scope = jax.export.SymbolicScope()
  examples = []
  for index, s in enumerate(specs):
    if s.dims is None:
      continue
    text = s.polymorphic_shape(index)
    try:
      shape = (
        s.dims if text is None else jax.export.symbolic_shape(text, scope=scope)
      )
    except ValueError as e:  # A name JAX reads otherwise, e.g. max.
      raise BadInputError(
        f'Malformed --input-shape {s.text()}: JAX cannot read its dimensions '
        f'{text} ({_signature.summary(e)}). Name polymorphic dimensions with '
        'other names, e.g. b, t.'
      ) from e
    examples.append(jax.ShapeDtypeStruct(shape, jax.numpy.dtype(s.dtype)))
  slots = []
  for s in specs:
    slots.append(None if s.dims is None else sum(x is not None for x in slots))

  def call(model: Any, *arrays: Any) -> Any:
    arguments = [None if i is None else arrays[i] for i in slots]
    return _signature.named_outputs(getattr(model, method)(*arguments), where)

  # The exported function gets the variables as plain arrays, on no mesh.
  graphdef, state = nnx.split(abstract)
  plain = nnx.merge(
    graphdef,
    jax.tree.map(
      lambda a: (
        jax.ShapeDtypeStruct(a.shape, a.dtype)
        if isinstance(a, jax.ShapeDtypeStruct | jax.Array)
        else a
      ),
      state,
    ),
  )
  try:
    _saved_model.traced_where_served(
      lambda: nnx.eval_shape(call, plain, *examples),
      lambda: nnx.eval_shape(call, abstract, *examples),
    )
  except _errors.FlaxDTensorError:
    raise
  except Exception as e:
    own = _signature.own_symbols([s.dims for s in specs])
    if own and _signature.names_a_symbol(e, own):
      examples_text = [
        ' '.join(
          f'--input-shape {s.text(dims)}'
          for s, dims in zip(specs, suggested, strict=True)
        )
        for suggested in _signature.suggested_dims([s.dims for s in specs])
      ]
      which = [
        f'{examples_text[0]} if all are one length (e.g. a sequence length)',
        *(f'{t} if those at the same position are' for t in examples_text[1:]),
      ]
      symbols = ', '.join(
        s.text(_signature.symbolic_dims(s.dims, index))
        for index, s in enumerate(specs)
        if s.dims is not None and None in s.dims[1:]
      )
      raise BadInputError(
        f'--input-shape {given}: tracing {where} fails where its '
        f'polymorphic dimensions meet ({_signature.summary(e)}). Each ? '
        f'dimension is a size of its own (to JAX: {symbols}), which JAX '
        'cannot know to equal another: name the dimensions that are always '
        f'equal alike, e.g. {", or ".join(which)}.'
      ) from e
    if re.search(r'of type:? (AxisType\.)?Auto', str(e)):
      raise BadInputError(
        f'{where} is written for Explicit mesh axes (it says where results '
        "go, with out_sharding= or jax.sharding.reshard), but the mesh's "
        f'axes are Auto: JAX refuses it ({_signature.summary(e)}). Pass '
        '--axis-types explicit (every axis, as jax.make_mesh gives), or '
        'NAME=explicit for the axes it names.'
      ) from e

    def shown(index: int, change: tuple[int, int] | None) -> str:
      # As the user wrote it, with the size at one position changed.
      name, dims, *dtype = specs[index].text().split(':')
      written = dims.split(',')
      if change is not None:
        written[change[0]] = str(change[1])
      return ':'.join([name, ','.join(written), *dtype])

    raise BadInputError(
      _signature.unfit_message(
        f'--input-shape {given}',
        where,
        e,
        [s.dims for s in specs],
        [s.name for s in specs],
        shown,
        'Pass one --input-shape per positional input, in order, with the '
        'batch dimension first (e.g. x:1,128:int32).',
      )
    ) from e


def traced_inputs(texts: Sequence[str], target: str) -> list[Any] | None:
  """The abstract inputs ``plan --suggest`` traces the forward on: each
  ``--input-shape`` (sizes only), or for the demo model its own; None for
  another TARGET without any.

  Raises:
    BadInputError: If an entry is malformed or has a dimension that is not
      a size.
  """
  if not texts:
    if target != DEMO_TARGET:
      return None
    from flax_dtensor.demo import model

    return model.example_inputs()
  import jax

  out = []
  for text in texts:
    spec = parse_input_shape(text, static_batch=True)
    if spec.dims is None:
      out.append(None)
      continue
    if not all(isinstance(d, int) for d in spec.dims):
      raise BadInputError(
        f'--input-shape {text!r}: tracing the forward for --suggest needs '
        'sizes, not named or ? dimensions. Pass sizes, e.g. '
        'tokens:16,128:int32.'
      )
    out.append(jax.ShapeDtypeStruct(spec.dims, jax.numpy.dtype(spec.dtype)))
  return out


_UNITS = {'': 1, 'B': 1, 'KIB': 2**10, 'MIB': 2**20, 'GIB': 2**30, 'TIB': 2**40}


def parse_size(text: str, flag: str, *, minimum: int = 0) -> int:
  """Bytes from '16GiB', '512 MiB' or '1000' (IEC units), at least `minimum`.

  Raises:
    BadInputError: If the text is not a size, or is below `minimum`: one
      wording for every such value (``0``, ``-5KiB``, ``lots``).
  """
  m = re.fullmatch(r'\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*', text)
  unit = m.group(2).upper() if m else None
  size = None if m is None or unit not in _UNITS else m.group(1)
  if size is None or int(float(size) * _UNITS[unit]) < minimum:
    least = f' of at least {minimum} byte{"s" * (minimum != 1)}' * (minimum > 0)
    raise BadInputError(
      f'Malformed {flag} {text!r}: expected a size{least} in bytes, or with '
      'an IEC unit (KiB, MiB, GiB, TiB), e.g. 16GiB.'
    )
  return int(float(size) * _UNITS[unit])
