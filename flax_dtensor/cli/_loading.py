"""What commands load: rules files, optimizers, model factories, devices.

Each loader raises `BadInputError` naming the flag or TARGET, what arrived
and how to fix it. JAX, Flax and TensorFlow are imported inside the
functions, so ``--help`` stays fast and devices can be set up before JAX
starts.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import pathlib
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from flax_dtensor.cli import _options
from flax_dtensor.cli._command import BadInputError, one_line

_DEVICE_COUNT_FLAG = '--xla_force_host_platform_device_count'


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
  example = f'e.g. {_options.DEMO_TARGET} or path/to/models.py:make_model'
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
  from flax_dtensor._placement import _abstract_build
  from flax_dtensor._rules import _context, _logical, _missing_axes

  _install.ensure_installed()  # Before the factory builds anything.

  # Built with unmentioned names replicated, so that a name the rules lack
  # is reported by the plan the caller makes next, with the variable's path
  # (creation does not know it yet).
  rules = _context.get_logical_axis_rules()
  lenient = (
    rules.replace(unknown='replicate')
    if isinstance(rules, _logical.LogicalRules)
    else None
  )
  try:
    # A likely typo is said by the plan made next (its headline).
    with _missing_axes.reported_elsewhere():
      if lenient is not None:
        with _context.logical_axis_rules(lenient):
          model = _abstract_build.build_abstract(factory)
      else:
        model = _abstract_build.build_abstract(factory)
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
