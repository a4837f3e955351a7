"""JAX's StableHLO, serialized for the TensorFlow in this process.

A SavedModel serves its forward pass through TF's ``XlaCallModule``, which
reads a StableHLO portable artifact with TF's own, older StableHLO. JAX
writes its artifacts for a StableHLO version four weeks behind its own
(jax 0.12: 1.18), past what TF 2.21 reads (1.13.7), and the failure would
only show where the SavedModel is served. So, while a SavedModel is traced:

- the calling convention is the newest both JAX and TF's ``XlaCallModule``
  run (`calling_convention`, `export_version`);
- the StableHLO artifact targets the older of JAX's target and the version
  TF reads (`stablehlo_target`), both read from the installed libraries at
  run time;
- the checks JAX writes for polymorphic dimensions carry no sharding
  (`unconstrain_shape_checks`), so that TF can fold them for the shapes it
  serves;
- every ``XlaCallModule`` of the traced function is loaded by TF's own
  loader, the one the serving op runs (`check_readable`), before anything is
  written.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
from collections.abc import Iterator
from typing import Any

import jax

from flax_dtensor import _errors
from flax_dtensor.dtensor import _tf


class _Target(threading.local):
  active: bool = False  # Within `for_tensorflow`: modules are for TF.
  version: str | None = None  # The StableHLO version to write, or JAX's.


_target = _Target()
_install_lock = threading.Lock()


def _version_tuple(version: str) -> tuple[int, ...]:
  return tuple(int(p) for p in version.split('.'))


def tf_stablehlo_version() -> str | None:
  """The StableHLO version this TensorFlow reads, or None if TF hides it."""
  try:
    stablehlo = _tf.internal('tensorflow.compiler.mlir.stablehlo.stablehlo')
    return str(stablehlo.get_current_version())
  except (ImportError, AttributeError):
    return None


def jax_stablehlo_target() -> str | None:
  """The StableHLO version JAX writes artifacts for, or None if unknown."""
  try:
    from jax._src.lib.mlir.dialects import hlo

    return str(
      hlo.get_version_from_compatibility_requirement(
        hlo.StablehloCompatibilityRequirement.WEEK_4
      )
    )
  except (ImportError, AttributeError):
    return None


@functools.cache
def _install() -> bool:
  """Lets `for_tensorflow` shape the module JAX serializes.

  JAX's export serializes in ``jax._src.export._export._module_to_bytecode``
  for a target it picks itself (no option sets it), from a copy of the
  lowered module made for the export alone. This wraps that function, once:
  within `for_tensorflow` on this thread (`_target`), the module's shape
  checks lose their shardings (`unconstrain_shape_checks`) and it is written
  for the target chosen (`stablehlo_target`), JAX's own otherwise. False
  where JAX has moved it: JAX's module and target then apply, and
  `check_readable` still refuses what TF cannot load or serve.
  """
  try:
    from jax._src import xla_bridge
    from jax._src.export import _export
    from jax._src.lib import _jax

    original = _export._module_to_bytecode
    serialize = _jax.mlir.serialize_portable_artifact
  except (ImportError, AttributeError):
    return False

  @functools.wraps(original)
  def module_to_bytecode(module: Any) -> bytes:
    if _target.active:
      unconstrain_shape_checks(module)
    if _target.version is None:
      return original(module)
    return serialize(
      module, _target.version, xla_bridge.get_backend().serialize_with_sdy
    )

  _export._module_to_bytecode = module_to_bytecode
  return True


def target_for_tf() -> str | None:
  """The StableHLO version to write: JAX's target, or TF's if older."""
  jax_target, tf_version = jax_stablehlo_target(), tf_stablehlo_version()
  if jax_target is None or tf_version is None:
    return None
  if _version_tuple(tf_version) >= _version_tuple(jax_target):
    return None  # JAX's own choice is readable.
  return tf_version


@contextlib.contextmanager
def stablehlo_target(version: str | None) -> Iterator[None]:
  """Within the block, this thread's JAX exports are modules for TF.

  They write StableHLO `version` (None keeps JAX's choice), and their shape
  checks carry no sharding (`unconstrain_shape_checks`).
  """
  with _install_lock:
    installed = _install()
  if not installed:
    yield
    return
  old = _target.active, _target.version
  _target.active, _target.version = True, version
  try:
    yield
  finally:
    _target.active, _target.version = old


def _operations(operation: Any) -> Iterator[Any]:
  """Every operation nested in `operation`, inner ones first."""
  for region in operation.regions:
    for block in region:
      for child in list(block):
        yield from _operations(child.operation)
        yield child.operation


def unconstrain_shape_checks(module: Any) -> int:
  """Drops the shardings of 0-d integers in `module`; returns how many.

  Under a mesh with Explicit axes JAX gives every value it lowers a
  sharding, the dimension sizes its shape checks compare included
  (``sdy.sharding_constraint`` of a 0-d integer, always replicated: a 0-d
  value has no dimension to split). TF's ``XlaCallModule`` folds each check
  to a constant for the shapes it serves, and cannot fold through a
  constraint: every call then fails ('Module shape refinement failed: …
  expects static assert_what'). A constraint never changes a value, and
  these ones change no placement either, so each is replaced by its
  operand: the checks, and what they say when a shape is wrong, are kept.
  `module` is the export's own copy, about to be serialized.
  """
  from jax._src.lib.mlir import ir

  dropped = 0
  for op in list(_operations(module.operation)):
    if op.name != 'sdy.sharding_constraint' or len(op.results) != 1:
      continue
    result = op.results[0]
    tensor = result.type  # JAX's MLIR gives each type its own class.
    if not isinstance(tensor, ir.RankedTensorType) or tensor.rank != 0:
      continue
    if not isinstance(tensor.element_type, ir.IntegerType):
      continue
    if 'unreduced' in str(op.attributes['sharding']):
      continue  # Partial sums: a placement of their own, kept.
    result.replace_all_uses_with(op.operands[0])
    op.erase()
    dropped += 1
  return dropped


def _tf_max_calling_convention() -> int | None:
  """The newest jax2tf calling convention this TF's XlaCallModule runs."""
  try:
    xla = _tf.internal('tensorflow.compiler.tf2xla.python.xla')
  except ImportError:  # pragma: no cover - TF moved it.
    return None
  return int(xla.call_module_maximum_supported_version())


def calling_convention() -> int:
  """The calling convention to export with: JAX's, or older if TF needs it.

  JAX emits `jax_export_calling_convention_version` (10 in jax 0.10 and
  0.12, which TF 2.21 runs). If the installed TF only runs older versions,
  export with the newest one both support; if there is none, fail here
  rather than in the serving process.

  Raises:
    ExportError: If JAX and TF share no calling convention.
  """
  current = int(jax.config.jax_export_calling_convention_version)
  tf_max = _tf_max_calling_convention()
  if tf_max is None or current <= tf_max:
    return current
  if tf_max >= jax.export.minimum_supported_calling_convention_version:
    return tf_max
  raise _errors.ExportError(
    f'JAX {jax.__version__} exports StableHLO with calling convention '
    f'version {current} (at least '
    f'{jax.export.minimum_supported_calling_convention_version}), but the '
    f'installed TensorFlow {_tf.tf().__version__} runs versions up to '
    f'{tf_max} only: expected a common version. {_FIX}'
  )


@contextlib.contextmanager
def export_version(version: int) -> Iterator[None]:
  """Exports with calling convention `version` in this thread only.

  Neither `jax.export.export` nor `jax2tf.convert` takes the version as an
  argument: `_export_lowered` reads the option
  `jax_export_calling_convention_version`. `jax.config.update` would change
  it for every thread while the export runs; the option's own context
  manager (a thread-local value, restored on exit) changes it for this one
  only. JAX exposes it only as `jax._src.config.<option>`, as its own
  export tests use it.
  """
  if version == int(jax.config.jax_export_calling_convention_version):
    yield
    return
  from jax._src import config as jax_config

  with jax_config.jax_export_calling_convention_version(version):
    yield


@contextlib.contextmanager
def for_tensorflow() -> Iterator[None]:
  """JAX exports in this thread, within the block, run in this process's TF.

  Raises:
    ExportError: If JAX and TF share no calling convention.
  """
  with export_version(calling_convention()), stablehlo_target(target_for_tf()):
    yield


def _modules(graph_def: Any) -> list[tuple[str, bytes]]:
  """(node name, serialized module) of every ``XlaCallModule`` in a graph."""
  nodes = [*graph_def.node]
  for function in graph_def.library.function:
    nodes.extend(function.node_def)
  return [
    (n.name, n.attr['module'].s) for n in nodes if n.op == 'XlaCallModule'
  ]


def check_readable(concrete_function: Any, what: str) -> None:
  """Loads every StableHLO module of a traced function as TF serving will.

  The serving process's ``XlaCallModule`` op loads its module with TF's
  ``XlaCallModuleLoader``, which knows every dialect that op runs (Shardy's
  ``sdy`` among them: JAX writes it for an export inside ``jax.set_mesh``
  and for every sharding constraint). TF's MLIR pass
  ``tf-xla-call-module-deserialization`` runs that same loader on each
  ``XlaCallModule`` of the traced graph, without compiling or running it:
  what it loads, the served op loads. TF's Python StableHLO reader
  (``deserialize_portable_artifact_str``) is narrower (it refuses ``sdy``),
  so it is not the judge.

  Raises:
    ExportError: If TF's loader refuses a module, with what it said and,
      when the module's StableHLO is newer than this TF reads, both versions.
  """
  graph_def = concrete_function.graph.as_graph_def()
  modules = _modules(graph_def)
  if not modules:
    return
  tf = _tf.tf()
  try:
    loaded = tf.mlir.experimental.convert_function(
      concrete_function, pass_pipeline=_LOADER_PASS
    )
  except Exception as e:  # TF raises an OpError holding MLIR's diagnostics.
    cause = _LOADER_ERROR.search(str(e))
    if cause is None:
      # Not the loader's verdict (no such pass in this TF, or its graph
      # import failed): this TF cannot tell; its XlaCallModule will.
      return
    raise _errors.ExportError(
      _unloadable(what, modules, cause[1].strip())
    ) from e
  if has_constrained_shape_checks(loaded):
    raise _errors.ExportError(
      f'{what}: JAX {jax.__version__} exported the forward pass '
      f'({", ".join(name for name, _ in modules)}) under a mesh with Explicit '
      'axes, and so constrained the checks of its polymorphic input '
      'dimensions to a sharding, which flax_dtensor removes before '
      'TensorFlow sees them, but could not in this JAX release (its export '
      'no longer serializes through '
      '`jax._src.export._export._module_to_bytecode`). The installed '
      f"TensorFlow {tf.__version__}'s XlaCallModule loads such a module but "
      "cannot compile it where it serves ('Module shape refinement failed: "
      "… expects static assert_what'). Nothing was written. Give "
      '`input_signature` static shapes (no None), or use a JAX release of '
      'the compatibility page.'
    )


def has_constrained_shape_checks(loaded: str) -> bool:
  """Whether a loaded module checks a dimension through a sharding.

  JAX checks polymorphic dimensions (``shape_assertion``) on values it
  constrains to a sharding (``sdy.sharding_constraint`` of a 0-d integer)
  when it exports under a mesh with Explicit axes. TF's ``XlaCallModule``
  folds each check to a constant for the shapes it serves, and cannot
  through the constraint. `loaded` is TF's MLIR of the traced graph with
  every module loaded (`_LOADER_PASS`).
  """
  for function in loaded.split('func.func')[1:]:
    constrained = set(_CONSTRAINED_SCALAR.findall(function))
    if not constrained:
      continue
    compared = {m[1]: {m[2], m[3]} for m in _COMPARE.finditer(function)}
    for condition in _SHAPE_ASSERTION.findall(function):
      if compared.get(condition, set()) & constrained:
        return True
  return False


# A 0-d integer constrained to a sharding; a comparison; a shape check.
_CONSTRAINED_SCALAR = re.compile(
  r'^\s*(%[\w#]+) = sdy\.sharding_constraint %[\w#]+ <.*> : tensor<i\d+>$',
  re.M,
)
_COMPARE = re.compile(
  r'(%[\w#]+) = stablehlo\.compare\s+\w+,\s*(%[\w#]+),\s*(%[\w#]+)'
)
_SHAPE_ASSERTION = re.compile(r'custom_call @shape_assertion\((%[\w#]+)')


def _unloadable(what: str, modules: list[tuple[str, bytes]], cause: str) -> str:
  """Why TF's loader refused the forward pass: versions only where they are."""
  names = ', '.join(name for name, _ in modules)
  versions = [_ARTIFACT_VERSION.search(m) for _, m in modules]
  written = max(
    (v[1].decode() for v in versions if v), key=_version_tuple, default=None
  )
  reads = tf_stablehlo_version()
  head = (
    f'{what}: the installed TensorFlow {_tf.tf().__version__} cannot load '
    f'the StableHLO module that JAX {jax.__version__} wrote for the forward '
    f'pass ({names}).'
  )
  if written is None:
    why = ' It is not a StableHLO portable artifact JAX would write.'
  elif reads is not None and _version_tuple(written) > _version_tuple(reads):
    why = (
      f' JAX wrote StableHLO {written}, newer than the newest this '
      f'TensorFlow reads, {reads}.'
    )
  else:
    why = (
      f' Its StableHLO version, {written}, is one this TensorFlow reads '
      f'(up to {reads or "an unknown version"}): what it refuses is in the '
      'module itself.'
    )
  return (
    f"{head}{why} TensorFlow's XlaCallModule loader, the one that serves "
    f'the SavedModel, said: {cause.rstrip(".")}. Nothing was written. {_FIX}'
  )


# TF's MLIR pass that loads each XlaCallModule's module with the op's own
# loader (`tensorflow::XlaCallModuleLoader`).
_LOADER_PASS = 'tf-xla-call-module-deserialization'
# The loader's refusal in the pass's diagnostics: its first line.
_LOADER_ERROR = re.compile(r"error: 'tf\.XlaCallModule' op (.*)")
# The producer's version in a portable artifact's header.
_ARTIFACT_VERSION = re.compile(rb'StableHLO_v(\d+(?:\.\d+)*)')
_FIX = (
  'Install a TensorFlow that reads what this JAX writes (a newer '
  'tensorflow-cpu, or tf-nightly), or a JAX release that TF reads (see the '
  'compatibility page for the tested pairs).'
)
