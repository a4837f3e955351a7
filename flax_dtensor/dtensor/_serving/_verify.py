"""A written SavedModel checked against JAX: its outputs and its speed.

`verify_saved_model` serves the SavedModel in a fresh process that has
TensorFlow and no JAX (`serve_in_tf`, bounded by a timeout), runs the same
signatures as JAX here (each method, with its TF pre- and post-processing
in eager TF around it), and compares them output by output, in a
`VerificationReport`.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import rich.box
import rich.console
import rich.text
from flax import nnx

from flax_dtensor import _errors, _text
from flax_dtensor.dtensor import _tf
from flax_dtensor.dtensor._format import _paths
from flax_dtensor.dtensor._serving import (
  _saved_model,
  _signature,
  _signatures,
)

TIMEOUT_SECONDS = 300
CALLS = 10
# The tolerances of `np.allclose` for float outputs, by dtype, unless
# `rtol`/`atol` say otherwise. Outputs of other dtypes must be equal.
DEFAULT_TOLERANCES = {
  'float64': (1e-5, 1e-6),
  'float32': (1e-5, 1e-6),
  'float16': (1e-2, 1e-3),
  'bfloat16': (2e-2, 1e-2),
}
# Float dtypes not in `DEFAULT_TOLERANCES` (float8 and the like).
LOW_PRECISION = (1e-1, 1e-1)

# Runs in a fresh interpreter that imports TensorFlow and NumPy only. JAX is
# blocked: TF would otherwise import it when installed (tensorflow.lite
# tries `from jax import jit`), and the SavedModel must not need it. It
# loads the SavedModel, calls each signature once (TF traces it), then
# `calls` times, timed, and saves the first call's outputs.
SCRIPT = """\
import json, os, statistics, sys, time
for blocked in ('jax', 'jaxlib', 'flax', 'flax_dtensor'):
  sys.modules[blocked] = None  # `import jax` now raises ImportError.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
import numpy as np
import tensorflow as tf
job = json.load(open(sys.argv[1]))
start = time.perf_counter()
loaded = tf.saved_model.load(job['directory'])
report = {'load_seconds': time.perf_counter() - start, 'signatures': {}}
for key, feed in job['feeds'].items():
  serve = loaded.signatures[key]
  args = {name: tf.constant(np.load(path)) for name, path in feed.items()}
  start = time.perf_counter()
  outputs = {k: t.numpy() for k, t in serve(**args).items()}
  first = time.perf_counter() - start
  seconds = []
  for _ in range(job['calls']):
    start = time.perf_counter()
    {k: t.numpy() for k, t in serve(**args).items()}
    seconds.append(time.perf_counter() - start)
  files = {}
  for i, (name, value) in enumerate(sorted(outputs.items())):
    if value.dtype == object:  # Strings: saved as bytes, not pickled.
      value = value.astype(bytes)
    files[name] = os.path.join(job['out'], f'{key}.{i}.npy')
    np.save(files[name], value)
  report['signatures'][key] = {
    'first_seconds': first,
    'seconds': statistics.median(seconds) if seconds else None,
    'outputs': files,
  }
report['tensorflow'] = tf.__version__
report['jax_imported'] = any(
  sys.modules.get(m) is not None for m in ('jax', 'jaxlib', 'flax'))
print(json.dumps(report))
"""


# The report
# ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OutputComparison:
  """One output of a signature: TensorFlow's against JAX's.

  Attributes:
    name: The output's name in the signature ('output_0', 'logits').
    shape: Its shape in JAX (None if JAX lacks it).
    dtype: Its dtype in JAX ('float32'), or TF's if JAX lacks it.
    max_abs_diff: The largest absolute difference between TF's and JAX's
      values (0.0 for equal strings, inf for unequal ones, and where a
      value is NaN on one side only, or they cannot be compared: see
      `problem`).
    max_abs_reference: The largest absolute value of JAX's, for scale (nan
      for strings).
    mismatches: How many elements differ beyond the tolerance (all of them
      when they cannot be compared).
    rtol: The relative tolerance used (0.0: must be equal).
    atol: The absolute tolerance used (0.0: must be equal).
    problem: Why the values could not be compared (the output is missing on
      one side, or has another shape), else None.
  """

  name: str
  shape: tuple[int, ...] | None
  dtype: str
  max_abs_diff: float
  max_abs_reference: float
  mismatches: int
  rtol: float
  atol: float
  problem: str | None = None

  @property
  def ok(self) -> bool:
    """Whether TF's values are JAX's, within the tolerance."""
    return self.problem is None and self.mismatches == 0


@dataclasses.dataclass(frozen=True)
class SignatureComparison:
  """One signature of the SavedModel, served by TF and run by JAX.

  The latencies are wall-clock seconds in each process: the median of
  `VerificationReport.calls` calls on the same inputs, after a first call
  (timed apart: it compiles in JAX, and traces in TF), each until its
  outputs are NumPy arrays. JAX's is the reference's whole call: its TF
  preprocess, the method under `jax.jit`, its TF postprocess. TF's is the
  signature's call on the loaded SavedModel.

  Attributes:
    key: The signature key ('serving_default').
    outputs: Each output, by name.
    jax_seconds: JAX's median latency.
    tf_seconds: TF's median latency.
    jax_first_seconds: JAX's first call (with compilation).
    tf_first_seconds: TF's first call (with tracing).
  """

  key: str
  outputs: tuple[OutputComparison, ...]
  jax_seconds: float
  tf_seconds: float
  jax_first_seconds: float
  tf_first_seconds: float

  @property
  def ok(self) -> bool:
    """Whether every output is within the tolerance."""
    return all(o.ok for o in self.outputs)

  @property
  def max_abs_diff(self) -> float:
    """The largest `OutputComparison.max_abs_diff` of the signature."""
    return max((o.max_abs_diff for o in self.outputs), default=0.0)

  def differing(self) -> tuple[str, ...]:
    """The names of the outputs beyond the tolerance."""
    return tuple(o.name for o in self.outputs if not o.ok)


@dataclasses.dataclass(frozen=True)
class VerificationReport:
  """A SavedModel served by plain TensorFlow, compared with JAX.

  Returned by `verify_saved_model`. `str()` of it is a table, one row per
  output; in rich (``rich.print(report)``) and Jupyter it is that table.

  Attributes:
    directory: The SavedModel directory.
    signatures: Each signature verified, in the order given.
    calls: The number of timed calls of each signature, in each process.
    tf_load_seconds: How long ``tf.saved_model.load`` took in the serving
      process (TF's import not included).
    tensorflow: The serving process's TensorFlow version.
    jax_imported: Whether JAX was imported in the serving process when it
      was done. JAX is blocked there, so a SavedModel that needs it fails to
      serve instead: always False in a report.
  """

  directory: str
  signatures: tuple[SignatureComparison, ...]
  calls: int
  tf_load_seconds: float
  tensorflow: str
  jax_imported: bool

  @property
  def ok(self) -> bool:
    """Whether every output of every signature is within the tolerance."""
    return all(s.ok for s in self.signatures)

  @property
  def max_abs_diff(self) -> float:
    """The largest absolute difference over every output."""
    return max((s.max_abs_diff for s in self.signatures), default=0.0)

  def signature(self, key: str) -> SignatureComparison:
    """The comparison of the signature `key`."""
    for s in self.signatures:
      if s.key == key:
        return s
    raise KeyError(key)

  def differing(self) -> dict[str, tuple[str, ...]]:
    """The outputs beyond the tolerance, by signature key (only those
    with some)."""
    return {s.key: s.differing() for s in self.signatures if not s.ok}

  def _rows(self) -> Iterator[list[str]]:
    for s in self.signatures:
      for o in s.outputs:
        shape = '' if o.shape is None else ','.join(map(str, o.shape))
        yield [
          s.key,
          o.name,
          f'{o.dtype}[{shape}]',
          f'{o.max_abs_diff:.2e}',
          f'{o.max_abs_reference:.2e}',
          'ok' if o.ok else o.problem or f'{o.mismatches} differ',
        ]

  def _latencies(self) -> Iterator[list[str]]:
    for s in self.signatures:
      yield [
        s.key,
        f'{s.jax_seconds * 1e3:.2f}',
        f'{s.tf_seconds * 1e3:.2f}',
        f'{s.jax_first_seconds:.2f}',
        f'{s.tf_first_seconds:.2f}',
      ]

  def _tolerances(self) -> str:
    found = {
      o.dtype: 'equal' if o.rtol == o.atol == 0 else f'{o.rtol:g}/{o.atol:g}'
      for s in self.signatures
      for o in s.outputs
    }
    return ', '.join(f'{dtype} {tol}' for dtype, tol in found.items())

  def _headline(self) -> str:
    verdict = (
      'every output within tolerance'
      if self.ok
      else 'outputs beyond tolerance: ' + _differing_text(self.differing())
    )
    return (
      f'SavedModel {self.directory} served by TF {self.tensorflow} without '
      f'JAX: {verdict}.'
    )

  def __rich_console__(
    self, console: rich.console.Console, options: rich.console.ConsoleOptions
  ) -> Iterator[Any]:
    width = options.max_width
    yield rich.text.Text(self._headline())
    yield _text.table_or_stacked(
      _COLUMNS,
      self._rows(),
      width,
      right=('max |diff|', 'max |JAX|'),
      box=rich.box.SIMPLE_HEAD,
    )
    yield rich.text.Text(f'Tolerance (rtol/atol): {self._tolerances()}.')
    yield rich.text.Text(
      f'Latency: the median of {self.calls} calls after a first one (which '
      f'compiles in JAX and traces in TF); TF loaded it in '
      f'{self.tf_load_seconds:.2f} s.'
    )
    yield _text.table_or_stacked(
      _LATENCY_COLUMNS,
      self._latencies(),
      width,
      right=_LATENCY_COLUMNS[1:],
      box=rich.box.SIMPLE_HEAD,
    )

  def render(self, width: int | None = None) -> str:
    """The report as text, at most `width` columns (the terminal's)."""
    buffer = io.StringIO()
    width = width or _text.terminal_width()
    _text.console(buffer, width).print(self, highlight=False)
    return '\n'.join(line.rstrip() for line in buffer.getvalue().splitlines())

  def __str__(self) -> str:
    return self.render()

  __repr__ = __str__


_COLUMNS = (
  'signature',
  'output',
  'array',
  'max |diff|',
  'max |JAX|',
  'verdict',
)
_LATENCY_COLUMNS = ('signature', 'JAX ms', 'TF ms', 'JAX 1st s', 'TF 1st s')


def _differing_text(differing: Mapping[str, Sequence[str]]) -> str:
  return '; '.join(
    f'{key!r} ({", ".join(map(repr, names))})'
    for key, names in differing.items()
  )


# Verifying
# ------------------------------------------------------------------------------


def verify_saved_model(
  module: Any,
  directory: str | os.PathLike[str],
  inputs: Mapping[str, Any],
  *,
  signatures: Mapping[str, _signatures.ServingSignature] | None = None,
  input_signature: Sequence[Any] | None = None,
  method: str = '__call__',
  polymorphic_shapes: Sequence[str | None] | None = None,
  rtol: float | None = None,
  atol: float | None = None,
  calls: int = CALLS,
  timeout: float = TIMEOUT_SECONDS,
  check: bool = False,
) -> VerificationReport:
  """Serves a written SavedModel in plain TensorFlow and compares it with JAX.

  The SavedModel in `directory` is loaded and called in a fresh Python
  process that imports TensorFlow and NumPy only (importing JAX is blocked
  there), on `inputs`, for each signature. Here, the same signatures run
  as JAX: the module's method on the same inputs, under `jax.jit`, without
  changing the module (a signature with a TF `preprocess`/`postprocess`
  runs ``postprocess(method(preprocess(inputs)))``, with TF eager around
  JAX). Each output is compared: its largest absolute difference, and
  whether ``np.allclose(tf, jax, rtol, atol)`` holds (float outputs; those
  of other dtypes, strings included, must be equal). Each side is timed:
  see `SignatureComparison`.

  Pass the arguments `save_saved_model` was given (`signatures`, or
  `input_signature` with `method` and `polymorphic_shapes`), and call it
  where `save_saved_model` was called (the same mesh context). The report
  is returned whatever the differences, unless `check`; its ``ok`` says
  whether all are within the tolerance.

  Args:
    module: The NNX module the SavedModel was exported from.
    directory: The SavedModel directory `save_saved_model` wrote.
    inputs: For each signature key, the signature's inputs to serve:
      NumPy arrays, in the order of its input specs (those of its
      `input_signature` that are not None), as a sequence; a dict by input
      name; or the array alone for a signature of one input.
    signatures: The `signatures` of `save_saved_model`, a dict of keys to
      `ServingSignature` (give this or `input_signature`).
    input_signature: The `input_signature` of `save_saved_model`, served as
      'serving_default'.
    method: The method served with `input_signature`.
    polymorphic_shapes: The `polymorphic_shapes` of `save_saved_model`.
    rtol: The relative tolerance for float outputs. Default: by dtype,
      `DEFAULT_TOLERANCES` (1e-5 for float32).
    atol: The absolute tolerance for float outputs. Default: by dtype (1e-6
      for float32).
    calls: How many timed calls of each signature, after a first one, in
      each process (the latencies are their median).
    timeout: Seconds the TensorFlow process may take (its import, the load
      and every call) before it is stopped.
    check: Raise, naming every differing signature and output, when any
      output is beyond the tolerance.

  Returns:
    The `VerificationReport`.

  Raises:
    ExportNotFoundError: If `directory` holds no SavedModel.
    DamagedExportError: If its saved_model.pb cannot be parsed.
    ExportError: If `signatures`/`input_signature` are malformed (as for
      `save_saved_model`), name a key the SavedModel lacks or inputs other
      than those it was saved with; if `inputs` lacks a signature's key or
      has one of no signature, gives a signature the wrong number of
      inputs, or one of the wrong shape or dtype; if `rtol`, `atol`,
      `calls` or `timeout` are out of range; if the TensorFlow process
      fails or takes longer than `timeout`; and with `check`, if any output
      is beyond the tolerance.

  Example:
    >>> report = verify_saved_model(  # doctest: +SKIP
    ...   model, '/tmp/sm', {'serving_default': [x]},
    ...   input_signature=[tf.TensorSpec([None, 16], tf.float32)])
    >>> report.ok, report.max_abs_diff  # doctest: +SKIP
    (True, 4.8e-07)
  """
  directory = _paths.local(directory, 'SavedModel directory')
  _check_numbers(rtol=rtol, atol=atol, calls=calls, timeout=timeout)
  keyed = _signatures.resolved(
    input_signature, method, polymorphic_shapes, signatures
  )
  if not os.path.isfile(os.path.join(directory, 'saved_model.pb')):
    raise _errors.ExportNotFoundError(
      f'Expected a SavedModel in {directory!r}, found no saved_model.pb '
      'there. Pass the directory save_saved_model wrote.'
    )
  try:
    written = _saved_model.written_signatures(directory)
  except Exception as e:  # A protobuf DecodeError, a bad MetaGraph count.
    raise _errors.DamagedExportError(
      f'Expected a readable SavedModel in {directory!r}, got a '
      f'saved_model.pb that TensorFlow cannot parse ({_signature.summary(e)})'
      '. Export it again with save_saved_model.'
    ) from e
  feeds = _feeds(module, directory, keyed, written, inputs)
  served = serve_in_tf(
    directory,
    {
      key: dict(zip(f.names, f.arrays, strict=True)) for key, f in feeds.items()
    },
    calls=calls,
    timeout=timeout,
  )
  compared = []
  for key, feed in feeds.items():
    reference, first, seconds = _reference(module, feed, calls)
    outputs = _compare(reference, served.outputs[key], rtol, atol)
    tf_seconds = served.seconds[key]
    assert tf_seconds is not None  # `calls` is at least 1.
    compared.append(
      SignatureComparison(
        key,
        outputs,
        jax_seconds=seconds,
        tf_seconds=tf_seconds,
        jax_first_seconds=first,
        tf_first_seconds=served.first_seconds[key],
      )
    )
  report = VerificationReport(
    directory,
    tuple(compared),
    calls,
    served.load_seconds,
    served.tensorflow,
    served.jax_imported,
  )
  if check and not report.ok:
    raise _errors.ExportError(
      f'Expected the SavedModel in {directory!r} to serve what JAX computes, '
      f'got outputs beyond the tolerance: {_differing_text(report.differing())}'
      f'. The largest difference is {report.max_abs_diff:.3g}.\n{report}\n'
      'Check that the SavedModel was exported from this module (re-export '
      'it), in the mode you serve (e.g. nnx.view(model, deterministic=True)), '
      'or pass a larger `rtol=`/`atol=` for a lower precision.'
    )
  return report


def _check_numbers(**values: Any) -> None:
  for name, value in values.items():
    if name in ('rtol', 'atol') and value is None:
      continue
    whole = name == 'calls'
    kinds = (int,) if whole else (int, float)
    if (
      isinstance(value, bool)
      or not isinstance(value, kinds)
      or not math.isfinite(value)
      or value < (1 if whole else 0)
      or (name == 'timeout' and value == 0)
    ):
      what = 'a positive int' if whole else 'a non-negative number'
      if name == 'timeout':
        what = 'a positive number of seconds'
      raise _errors.ExportError(
        f'Expected `{name}` to be {what}, got {value!r}.'
      )


@dataclasses.dataclass(frozen=True)
class _Feed:
  """One signature's inputs: by name for TF, by position for JAX."""

  key: str
  prepared: Any  # The signature, as `save_saved_model` prepares it.
  names: tuple[str, ...]
  arrays: tuple[np.ndarray, ...]


def _feeds(
  module: Any,
  directory: str,
  keyed: Mapping[str, _signatures.ServingSignature],
  written: Mapping[str, Any],
  inputs: Any,
) -> dict[str, _Feed]:
  """Each signature's inputs, checked against the written SavedModel."""
  if not isinstance(inputs, Mapping):
    raise _errors.ExportError(
      'Expected `inputs` to be a dict of signature keys to the inputs to '
      f'serve, got {type(inputs).__name__}: {inputs!r:.80}. Write e.g. '
      "inputs={'serving_default': [x]}."
    )
  missing = [k for k in keyed if k not in written]
  if missing:
    raise _errors.ExportError(
      f'Expected the signatures to verify to be those of the SavedModel in '
      f'{directory!r}, which has {sorted(written)}; got {missing}, which it '
      'lacks. Pass the `signatures` it was saved with.'
    )
  unknown = [k for k in inputs if k not in keyed]
  lacking = [k for k in keyed if k not in inputs]
  if unknown or lacking:
    raise _errors.ExportError(
      f'Expected `inputs` to give the inputs of each signature verified, '
      f'{list(keyed)}, and no other; got keys {list(inputs)}'
      + (f', without {lacking}' if lacking else '')
      + (f', with {unknown}, of no signature' if unknown else '')
      + '. Give one entry per signature key.'
    )
  feeds = {}
  for key, signature in keyed.items():
    prepared = _saved_model._prepared(module, key, signature)
    specs = written[key].inputs
    names = tuple(s.name for s in prepared.specs)
    if sorted(names) != sorted(specs):
      raise _errors.ExportError(
        f'Expected the signature {key!r} to take the inputs the SavedModel '
        f'in {directory!r} was saved with, {sorted(specs)}; got {list(names)}.'
        ' Pass the `signatures` (or `input_signature`) it was saved with.'
      )
    arrays = _arrays(key, inputs[key], names)
    for name, array in zip(names, arrays, strict=True):
      _check_fits(key, name, array, specs[name])
    feeds[key] = _Feed(key, prepared, names, arrays)
  return feeds


def _arrays(key: str, given: Any, names: Sequence[str]) -> tuple[Any, ...]:
  """A signature's inputs as NumPy arrays, in the order of `names`."""
  where = f'`inputs[{key!r}]`'
  if isinstance(given, Mapping):
    if sorted(given) != sorted(names):
      raise _errors.ExportError(
        f'Expected {where} to give the inputs {list(names)} by name, got '
        f'{list(given)}.'
      )
    given = [given[n] for n in names]
  elif isinstance(given, list | tuple):
    given = list(given)
  else:
    given = [given]
  if len(given) != len(names):
    raise _errors.ExportError(
      f'Expected {where} to hold one array per input of the signature, '
      f'{list(names)} ({len(names)}), got {len(given)}. Give them in that '
      'order, or as a dict by name.'
    )
  return tuple(_numpy(a) for a in given)


def _numpy(value: Any) -> np.ndarray:
  array = np.asarray(jax.device_get(value))
  if array.dtype.kind == 'U':  # TF's strings are bytes.
    return np.char.encode(array, 'utf-8')
  if array.dtype == object:
    flat = [x.encode() if isinstance(x, str) else x for x in array.flat]
    return np.array(flat, dtype=bytes).reshape(array.shape)
  return array


def _check_fits(key: str, name: str, array: np.ndarray, spec: Any) -> None:
  """Refuses an input of a shape or dtype the signature does not take."""
  dims = spec.shape
  dtype = 'string' if array.dtype.kind == 'S' else array.dtype.name
  fits = dims is None or (
    len(dims) == array.ndim
    and all(d is None or d == n for d, n in zip(dims, array.shape, strict=True))
  )
  if not fits or dtype != spec.dtype:
    shown = None if dims is None else list(dims)
    raise _errors.ExportError(
      f'Expected the input {name!r} of `inputs[{key!r}]` to be a {spec.dtype} '
      f'array of shape {shown} (None: any size), as the SavedModel takes it; '
      f'got {dtype}{list(array.shape)}. Pass an array of that shape'
      + (f', e.g. x.astype(np.{spec.dtype}).' if dtype != spec.dtype else '.')
    )


# The JAX reference
# ------------------------------------------------------------------------------


def _reference(
  module: Any, feed: _Feed, calls: int
) -> tuple[dict[str, np.ndarray], float, float]:
  """JAX's outputs of a signature, its first call's and its median seconds.

  The method runs on a merged copy of the module's state under `jax.jit`,
  so the module is not changed (RNG state and batch statistics are read,
  as the SavedModel reads them, never updated).
  """
  prepared = feed.prepared
  name = prepared.signature.method
  where = f'{type(module).__name__}.{name}'
  graphdef, state = nnx.split(module)

  @jax.jit
  def forward(state: Any, *arrays: Any) -> Any:
    merged = nnx.merge(graphdef, state)
    return getattr(merged, name)(*prepared.inputs.arguments(arrays))

  def call() -> dict[str, np.ndarray]:
    arrays: Sequence[Any] = feed.arrays
    if prepared.preprocess is not None:
      tf = _tf.tf()
      returned = prepared.preprocess(*(tf.constant(a) for a in arrays))
      if not isinstance(returned, list | tuple):
        returned = [returned]
      arrays = [t.numpy() for t in returned if t is not None]
    result = jax.block_until_ready(forward(state, *arrays))
    if prepared.postprocess is None:
      named = _signature.named_outputs(result, where)
    else:
      tf = _tf.tf()
      result = jax.tree.map(lambda x: tf.constant(np.asarray(x)), result)
      named = _signature.named_outputs(
        prepared.postprocess(result),
        where,
        arrays=(tf.Tensor, *_signature.ARRAYS),
      )
    return {k: _output_numpy(v) for k, v in named.items()}

  try:
    outputs, first = _timed(call)
  except Exception as e:  # JAX refuses to run the forward here.
    raise _errors.ExportError(
      f'JAX failed to run {where} for signature {feed.key!r}, the reference '
      f'the SavedModel is compared with ({_signature.summary(e)}). The '
      'export traced it on a one-device serving mesh; here it runs on the '
      "module's own mesh, as training does. Expected the method to run "
      'under jax.jit on these inputs where the model lives: call '
      'verify_saved_model where the forward runs (e.g. inside '
      '`with jax.set_mesh(mesh):`), or fix the forward for this mesh (on '
      'Explicit axes, a contraction of sharded dimensions needs '
      '`out_sharding=`).'
    ) from e
  seconds = [_timed(call)[1] for _ in range(calls)]
  return outputs, first, statistics.median(seconds)


def _output_numpy(value: Any) -> np.ndarray:
  numpy = getattr(value, 'numpy', None)
  array = np.asarray(numpy() if callable(numpy) else jax.device_get(value))
  return array.astype(bytes) if array.dtype == object else array


def _timed(call: Callable[[], Any]) -> tuple[Any, float]:
  start = time.perf_counter()
  result = call()
  return result, time.perf_counter() - start


# The comparison
# ------------------------------------------------------------------------------


def _is_float(dtype: np.dtype) -> bool:
  """Whether values of `dtype` are compared within a tolerance (floats and
  complex numbers, ml_dtypes' bfloat16 and float8 included)."""
  return np.issubdtype(dtype, np.inexact) or 'float' in dtype.name


def _tolerance(
  dtype: np.dtype, rtol: float | None, atol: float | None
) -> tuple[float, float]:
  if not _is_float(dtype):
    return 0.0, 0.0
  default = DEFAULT_TOLERANCES.get(dtype.name, LOW_PRECISION)
  if np.issubdtype(dtype, np.complexfloating):
    default = DEFAULT_TOLERANCES['float32']
  return (
    default[0] if rtol is None else float(rtol),
    default[1] if atol is None else float(atol),
  )


def _compare(
  reference: Mapping[str, np.ndarray],
  served: Mapping[str, np.ndarray],
  rtol: float | None,
  atol: float | None,
) -> tuple[OutputComparison, ...]:
  """Each output of a signature, by name: JAX's and TF's."""
  return tuple(
    _compare_one(name, reference.get(name), served.get(name), rtol, atol)
    for name in sorted({*reference, *served})
  )


def _compare_one(
  name: str,
  want: np.ndarray | None,
  got: np.ndarray | None,
  rtol: float | None,
  atol: float | None,
) -> OutputComparison:
  base = want if want is not None else got
  assert base is not None
  r, a = _tolerance(base.dtype, rtol, atol)
  problem = None
  if want is None:
    problem = 'missing in JAX'
  elif got is None:
    problem = 'missing in TF'
  elif want.shape != got.shape:
    problem = f'TF shape {list(got.shape)}'
  elif (want.dtype.kind == 'S') != (got.dtype.kind == 'S'):
    problem = f'TF dtype {got.dtype.name}'
  shape = None if want is None else tuple(want.shape)
  dtype = 'string' if base.dtype.kind == 'S' else base.dtype.name
  if problem is not None:
    return OutputComparison(
      name, shape, dtype, math.inf, math.nan, base.size, r, a, problem
    )
  assert want is not None and got is not None
  if want.dtype.kind == 'S':
    unequal = int(np.sum(want != got))
    diff = math.inf if unequal else 0.0
    return OutputComparison(name, shape, dtype, diff, math.nan, unequal, r, a)
  wide = (
    np.complex128
    if np.issubdtype(want.dtype, np.complexfloating)
    else (np.float64)
  )
  w, g = want.astype(wide), got.astype(wide)
  nan = np.isnan(w) | np.isnan(g)
  same_nan = np.isnan(w) & np.isnan(g)  # NaN on both sides is equal.
  error = np.where(nan, 0.0, np.abs(g - w))
  beyond = (error > a + r * np.abs(w)) | (nan & ~same_nan)
  diff = float(np.max(error)) if error.size else 0.0
  if np.any(nan & ~same_nan):
    diff = math.inf
  finite = np.abs(w[~np.isnan(w)])
  return OutputComparison(
    name,
    shape,
    dtype,
    diff,
    float(np.max(finite)) if finite.size else 0.0,
    int(np.sum(beyond)),
    r,
    a,
  )


# Serving in TensorFlow
# ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Served:
  """What the TensorFlow process served, and how long it took.

  Attributes:
    outputs: Each signature's outputs, by name (NumPy; strings as bytes).
    first_seconds: Each signature's first call.
    seconds: Each signature's median call (of `calls`; None for none).
    load_seconds: ``tf.saved_model.load``.
    tensorflow: TF's version there.
    jax_imported: Whether JAX was imported there (it is blocked).
  """

  outputs: dict[str, dict[str, np.ndarray]]
  first_seconds: dict[str, float]
  seconds: dict[str, float | None]
  load_seconds: float
  tensorflow: str
  jax_imported: bool


def serve_in_tf(
  directory: str | os.PathLike[str],
  feeds: Mapping[str, Mapping[str, np.ndarray]],
  *,
  calls: int = CALLS,
  timeout: float = TIMEOUT_SECONDS,
) -> Served:
  """Serves a SavedModel in a fresh TensorFlow process without JAX.

  Each signature of `feeds` (key -> input name -> NumPy array) is called
  once, then `calls` times (0 or more), timed. The process sees no GPU when JAX runs on the
  CPU here (the SavedModel then serves the CPU alone); otherwise TF's GPU
  memory grows as needed, beside JAX's.

  Raises:
    ExportError: If the process fails, or takes longer than `timeout`.
  """
  directory = os.fspath(directory)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
  if jax.default_backend() == 'cpu':
    env['CUDA_VISIBLE_DEVICES'] = '-1'
  else:
    env.setdefault('TF_FORCE_GPU_ALLOW_GROWTH', 'true')
  with tempfile.TemporaryDirectory(prefix='flax_dtensor_verify_') as tmp:
    files: dict[str, dict[str, str]] = {}
    for i, (key, feed) in enumerate(feeds.items()):
      files[key] = {}
      for j, (name, array) in enumerate(feed.items()):
        path = os.path.join(tmp, f'in.{i}.{j}.npy')
        np.save(path, np.asarray(array), allow_pickle=False)
        files[key][name] = path
    job = os.path.join(tmp, 'job.json')
    with open(job, 'w') as f:
      json.dump(
        {'directory': directory, 'feeds': files, 'calls': calls, 'out': tmp},
        f,
      )
    what = f'Serving the SavedModel in {directory!r} in a fresh TF process'
    try:
      proc = subprocess.run(
        [sys.executable, '-c', SCRIPT, job],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
        check=False,
      )
    except subprocess.TimeoutExpired as e:
      raise _errors.ExportError(
        f'{what} took longer than timeout={timeout:g} s; it was stopped. '
        'Pass a larger `timeout=` (TensorFlow imports in ~5-10 s, then loads '
        'and calls each signature), or fewer `calls=`.'
      ) from e
    if proc.returncode != 0:
      lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
      raise _errors.ExportError(
        f'{what} failed (exit status {proc.returncode}): '
        + ('\n'.join(lines[-3:]) or '(no output)')
        + '\nCheck that TensorFlow (pip install "flax-dtensor[tf]") loads it '
        'alone: tf.saved_model.load(directory).signatures[key](**inputs).'
      )
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    signatures = report['signatures']
    return Served(
      outputs={
        key: {name: np.load(path) for name, path in s['outputs'].items()}
        for key, s in signatures.items()
      },
      first_seconds={k: s['first_seconds'] for k, s in signatures.items()},
      seconds={k: s['seconds'] for k, s in signatures.items()},
      load_seconds=report['load_seconds'],
      tensorflow=report['tensorflow'],
      jax_imported=report['jax_imported'],
    )
