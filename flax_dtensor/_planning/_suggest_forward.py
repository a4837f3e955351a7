"""The forward of a model for `suggest_rules`: the logical names its
activations are constrained with, found by tracing it abstractly on the
inputs given (`forward_names`), and the targets of those no variable has
(`forward_targets`: a batch name on the fsdp-like axis).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import AbstractMesh

from flax_dtensor import _errors
from flax_dtensor._rules import (
  _context,
  _logical,
  _missing_axes,
  _resolution,
)


def batch_like(name: str) -> bool:
  """Whether a logical name is a batch dimension's ('batch',
  'activation_batch', 'batch_size')."""
  return 'batch' in name.lower()


def forward_targets(name: str, roles: dict[str, str | None]) -> tuple[Any, ...]:
  """A name only the forward uses: a batch name on the fsdp-like axis (data
  parallelism), then None; any other name None."""
  if batch_like(name) and roles['fsdp'] is not None:
    return (roles['fsdp'], None)
  return (None,)


def as_inputs(inputs: Any) -> tuple[Any, ...]:
  """`inputs` as abstract arguments: ``jax.ShapeDtypeStruct`` for anything
  with a shape and a dtype (nothing is computed), None kept.

  Raises:
    LogicalRulesError: For anything else.
  """
  items = (inputs,) if hasattr(inputs, 'shape') else inputs
  if not isinstance(items, tuple | list):
    raise _errors.LogicalRulesError(
      '`inputs` must be the positional arguments of the forward: a list of '
      'jax.ShapeDtypeStruct (or arrays, or None), e.g. '
      '[jax.ShapeDtypeStruct((16, 128), jnp.int32)]; got '
      f'{type(inputs).__name__} {inputs!r:.80}.'
    )
  out = []
  for i, x in enumerate(items):
    if x is None:
      out.append(None)
    elif hasattr(x, 'shape') and hasattr(x, 'dtype'):
      out.append(jax.ShapeDtypeStruct(tuple(x.shape), x.dtype))
    else:
      raise _errors.LogicalRulesError(
        f'`inputs[{i}]` must be a jax.ShapeDtypeStruct, an array or None '
        f'(an argument of the forward); got {type(x).__name__} {x!r:.80}.'
      )
  return tuple(out)


def inputs_text(inputs: Sequence[Any]) -> str:
  """'int32[16,128]' for the inputs' shapes and dtypes."""
  return ', '.join(
    'None' if x is None else f'{x.dtype}[{",".join(str(d) for d in x.shape)}]'
    for x in inputs
  )


def forward_names(
  model: Any, inputs: Sequence[Any], method: str, mesh: Any
) -> list[str]:
  """The logical names `method` of the abstract `model` resolves (its
  activations' ``with_logical_constraint``), in order: traced on `inputs`
  under a mesh and lenient rules, nothing computed.

  Raises:
    LogicalRulesError: If `model` is no module or has no such method, or
      tracing it on the inputs fails (the message gives the inputs and the
      error).
  """
  if not isinstance(model, nnx.Module):
    raise _errors.LogicalRulesError(
      "`inputs` are for tracing a model's forward; got "
      f'{type(model).__name__}, which has none. Pass the model (or its '
      'factory), or leave `inputs` out.'
    )
  forward = getattr(model, method, None)
  if not callable(forward):
    raise _errors.LogicalRulesError(
      f'`method` must name a method of the model that takes `inputs`; '
      f'{type(model).__name__} has no method {method!r}.'
    )
  abstract = mesh if isinstance(mesh, AbstractMesh) else mesh.abstract_mesh
  lenient = _logical.LogicalRules([], unknown='replicate')

  def call(m: Any, *xs: Any) -> Any:
    return getattr(m, method)(*xs)

  try:
    with (
      jax.sharding.use_abstract_mesh(abstract),
      _context.logical_axis_rules(lenient),
      _missing_axes.reported_elsewhere(),
      _resolution.recorded() as found,
    ):
      nnx.eval_shape(call, model, *inputs)
  except _errors.FlaxDTensorError:
    raise
  except Exception as e:
    raise _errors.LogicalRulesError(
      f'Tracing {type(model).__name__}.{method} on the inputs given '
      f'({inputs_text(inputs)}) failed with {type(e).__name__}: '
      f'{" ".join(str(e).split())[:300]}. Pass `inputs` as the forward '
      'takes them: one jax.ShapeDtypeStruct per positional argument, in '
      'order, batch dimension first (the command line: one --input-shape '
      'NAME:DIMS:DTYPE each).'
    ) from e
  names = (n for axes, _ in found for n in axes if isinstance(n, str))
  return list(dict.fromkeys(names))


def with_forward_names(
  rules: _logical.LogicalRules,
  forward: Sequence[str],
  roles: dict[str, str | None],
) -> tuple[_logical.LogicalRules, dict[str, tuple[Any, ...]]]:
  """`rules` with rules for the names of `forward` they lack, first (in an
  activation a batch name takes the fsdp-like axis before the names the
  variables share with it), and {name: its targets} for those."""
  known = set(rules.names)
  names = {n: forward_targets(n, roles) for n in forward if n not in known}
  rules = rules.prepend([(n, t) for n, ts in names.items() for t in ts])
  return rules, names
