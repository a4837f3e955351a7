"""Tracing a SavedModel's forward pass where JAX runs it, or saying why not.

`traced` traces the served function first under a `serving_mesh` (the
mesh's axes, each of size 1, on one device: every polymorphic size traces
there), else as the caller has it, tracing again where JAX itself asks
(a bare constraint with no mesh in context, a polymorphic dimension split
over an Explicit axis); what still fails is put in our words
(`_input_checks`). `check_served` traces an abstract model's method where
the export would, before any work, and refuses what it would (the command
line's check).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax
import jax
import numpy as np
from flax import nnx

from flax_dtensor import _errors
from flax_dtensor._rules import _meshes
from flax_dtensor.dtensor._serving import _input_checks, _inputs, _signature


@contextlib.contextmanager
def mesh_set(mesh: jax.sharding.Mesh | None) -> Iterator[None]:
  """`jax.set_mesh(mesh)` within the block; nothing if `mesh` is None."""
  if mesh is None:
    yield
    return
  with jax.set_mesh(mesh):
    yield


@dataclasses.dataclass(frozen=True)
class Traced:
  """The served function, traced: what `traced` found works."""

  function: Any  # The `tf.function` to save.
  concrete: Any  # Its concrete function.
  inputs: _inputs.Inputs  # The inputs it was traced for.
  mesh: jax.sharding.Mesh | None  # The mesh it was traced under, if set.
  # Why the serving mesh could not be used, when there was one.
  refused_serving_mesh: str | None = None


@dataclasses.dataclass(frozen=True)
class Forward:
  """What `traced` traces: the served `tf.function` for given inputs
  (`serving`), the method's name in messages, and the mesh the model's
  variables are on (None if not one)."""

  serving: Callable[[_inputs.Inputs], Any]
  where: str
  mesh: jax.sharding.Mesh | None
  # Whether TF differentiates it: jax2tf exports the gradient of a forward
  # traced on Explicit axes with no devices to run on (jax 0.10 and 0.12),
  # so such a forward is traced on Auto axes first.
  differentiable: bool = False


# The most times the served function is traced on the caller's mesh: once,
# once more under the model's mesh, and once per symbol made a multiple of
# a mesh axis's size.
_MOST_TRACES = 8


def serving_mesh(mesh: Any, *, auto: bool = False) -> jax.sharding.Mesh | None:
  """The mesh a SavedModel's forward is traced under, for `mesh`'s axes.

  TensorFlow serves a SavedModel on one device, whatever mesh it was
  trained on: a mesh's sizes matter to the exported function only where
  JAX checks, while tracing, that a dimension divides over an Explicit
  axis (``reshard``, ``out_sharding=``), which a polymorphic batch cannot
  pass. This copy has `mesh`'s axis names and types, each axis of size 1,
  on one device: a forward written for `mesh` with bare `PartitionSpec`s
  traces there for every size, as JAX runs it on one device. None when
  `mesh` (concrete or abstract) has no Explicit axis: JAX checks nothing
  then, and the forward is traced as the caller has it. With `auto`, every
  axis of the copy is Auto (a differentiable forward's, `Forward`).
  """
  if mesh is None or jax.sharding.AxisType.Explicit not in mesh.axis_types:
    return None
  devices = np.array(jax.local_devices()[:1]).reshape((1,) * len(mesh.shape))
  types = (
    (jax.sharding.AxisType.Auto,) * len(mesh.axis_types)
    if auto
    else tuple(mesh.axis_types)
  )
  return jax.sharding.Mesh(devices, mesh.axis_names, axis_types=types)


def check_served(
  module: Any,
  method: str,
  inputs: _inputs.Inputs,
  examples: Sequence[jax.ShapeDtypeStruct],
) -> None:
  """Traces `method` of the abstract `module` on abstract inputs, before
  any work, where `save_saved_model` traces it (`_traced_where_served`):
  refuses what the export would, and only that, in the caller's words
  (`inputs.wording`). Nothing is computed.

  `examples` are the inputs of `inputs.specs`, in order, with their
  polymorphic shapes (``jax.export.symbolic_shape``).

  Raises:
    ExportError: If tracing fails: where polymorphic dimensions of their
      own meet, where a forward written for Explicit mesh axes meets Auto
      ones, or otherwise (the inputs do not fit the method, with JAX's
      error); or if the result holds something other than arrays and None.
  """
  where = f'{type(module).__name__}.{method}'

  def call(model: Any, *arrays: Any) -> Any:
    result = getattr(model, method)(*inputs.arguments(arrays))
    return _signature.named_outputs(result, where)

  # The exported function gets the variables as plain arrays, on no mesh.
  graphdef, state = nnx.split(module)
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
    _traced_where_served(
      lambda: nnx.eval_shape(call, plain, *examples),
      lambda: nnx.eval_shape(call, module, *examples),
    )
  except _errors.FlaxDTensorError:
    raise
  except Exception as e:
    raise (
      _input_checks.shapes_error(inputs, e, where)
      or _input_checks.auto_axes_error(inputs, e, where)
      or _input_checks.unfit_error(inputs, e, where, any_error=True)
    ) from e


def _traced_where_served(
  on_serving_mesh: Callable[[], Any], in_context: Callable[[], Any]
) -> Any:
  """A trace of the forward where `save_saved_model` traces it: under the
  `serving_mesh` of the mesh in context (when it has an Explicit axis),
  with the variables as plain arrays (`on_serving_mesh`), as the exported
  function receives them; else, or if it fails there, as the caller has
  it (`in_context`).
  """
  served_on = serving_mesh(_meshes.current_mesh())
  if served_on is not None:
    try:
      with jax.set_mesh(served_on):
        return on_serving_mesh()
    except Exception:  # As `traced` does: traced again in the context.
      pass
  return in_context()


def traced(forward: Forward, inputs: _inputs.Inputs) -> Traced:
  """The serving function of `serving(inputs)`, traced as JAX runs it.

  On a mesh with Explicit axes (the caller's, else the one the model's
  variables are on, `forward.mesh`), first under its `serving_mesh`, where
  every size of a polymorphic dimension traces. If the forward does not trace
  there (it names the mesh itself, say ``NamedSharding(mesh, ...)``), and
  on any other mesh, it is traced as the caller has it, by
  `_traced_in_context`.
  """
  context = _meshes.current_mesh()
  served_on = serving_mesh(
    context if context is not None else forward.mesh,
    auto=forward.differentiable,
  )
  if served_on is None:
    return _traced_in_context(forward, inputs)
  function = forward.serving(inputs)
  try:
    with jax.set_mesh(served_on):
      concrete = function.get_concrete_function()
    return Traced(function, concrete, inputs, served_on)
  except Exception as e:  # Traced again as the caller has it, below.
    refused = _signature.summary(e)
  in_context = _traced_in_context(forward, inputs)
  return dataclasses.replace(in_context, refused_serving_mesh=refused)


def _traced_in_context(forward: Forward, inputs: _inputs.Inputs) -> Traced:
  """The serving function traced as the caller's context has it.

  With two exceptions that JAX itself asks for, each traced again:

  - a forward that constrains its activations with bare `PartitionSpec`s
    (``jax.lax.with_sharding_constraint(x, P('data'))``, ``reshard``,
    ``out_sharding=P(...)``) needs a mesh in context, and when none is set
    it is traced under the model's `mesh` (the one every exported variable
    is laid out on). Only then: a mesh in context changes what JAX writes;
  - a forward that splits a polymorphic dimension over an Explicit mesh
    axis of `n` devices needs it to be a multiple of `n`: its symbol is
    made one (`_input_checks.narrowed`), as JAX itself runs such a forward
    only for such sizes; the caller warns.

  A failure where polymorphic dimensions of their own meet
  (`_input_checks.shapes_error`), where a dimension cannot be made to
  divide (`_input_checks.divisibility_error`), where a forward written for
  Explicit axes meets Auto ones (`_input_checks.auto_axes_error`), where an
  input has a size the forward cannot take (`_input_checks.unfit_error`),
  where the forward changes the model (training mode), or a bare constraint
  with no mesh anywhere, is put in our words.
  """
  trace_mesh = None
  for attempt in range(_MOST_TRACES):
    function = forward.serving(inputs)
    try:
      with mesh_set(trace_mesh):
        concrete = function.get_concrete_function()
      return Traced(function, concrete, inputs, trace_mesh)
    except _errors.FlaxDTensorError:
      raise
    except Exception as e:
      last = attempt == _MOST_TRACES - 1
      needs_mesh = any(words in str(e) for words in _NEEDS_MESH)
      if needs_mesh and trace_mesh is None and not last:
        if forward.mesh is not None and _meshes.current_mesh() is None:
          trace_mesh = forward.mesh
          continue
      if needs_mesh:
        raise _errors.ExportError(
          f'Tracing {forward.where} for the SavedModel failed: it '
          'constrains a sharding with a bare PartitionSpec, which needs a '
          'mesh in context, and none is set, nor are the exported variables '
          f'laid out on one ({e}). Export inside `with jax.set_mesh(mesh):`, '
          'with the mesh the forward pass constrains over.'
        ) from e
      mutated = _MUTATED.search(str(e))
      if isinstance(e, flax.errors.TraceContextError) and mutated:
        raise _errors.ExportError(
          f'Tracing {forward.where} for the SavedModel failed: it changes '
          f"the model's {mutated[1]} (Flax: {_signature.summary(e)}), as a "
          'model in training mode does: Dropout draws from its nnx.Rngs, '
          'BatchNorm updates its statistics. A served function cannot '
          'change the model: export it in inference mode, '
          '`save_saved_model(nnx.view(model, deterministic=True, '
          'use_running_average=True), ...)` (the arguments its layers take).'
        ) from e
      found = _input_checks.narrowing(e)
      more = None if found is None else _input_checks.narrowed(inputs, found)
      if more is not None and not last:
        inputs = more
        continue
      error = (
        _input_checks.shapes_error(inputs, e, forward.where)
        or _input_checks.divisibility_error(inputs, e, forward.where)
        or _input_checks.auto_axes_error(inputs, e, forward.where)
        or _input_checks.unfit_error(inputs, e, forward.where)
      )
      if error is None:
        raise
      raise error from e
  raise AssertionError('unreachable: the last attempt returns or raises')


# Flax's refusal to change a variable of the model from inside the trace.
_MUTATED = re.compile(r'Cannot mutate (\w+) from a different trace level')
# JAX's words when a bare PartitionSpec meets no mesh: in
# `with_sharding_constraint`, and in `reshard` (Explicit axes).
_NEEDS_MESH = (
  'requires a non-empty mesh in context',
  'Using PartitionSpec when you are not under a mesh context',
)
