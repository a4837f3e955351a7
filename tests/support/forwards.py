"""A model's method, jitted, that leaves the model as it was.

A test's reference output from an eager call compiles every op it runs (a
served model's forward: 100 and more compiles); `nnx.jit` of it compiles
once a shape, but writes the model's state back from its outputs, whose
shardings may be spelled otherwise (`P('model', None)` for `P('model',)`),
and a module fixture is then no longer what its tests read. Here the
state goes in, only the method's result comes out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx


def jitted(model: nnx.Module, method: str = '__call__') -> Callable[..., Any]:
  """`getattr(model, method)`, jitted over the model's current state;
  the model is not changed (nor its RNG streams, nor its batch stats)."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def call(state, *args):
    return getattr(nnx.merge(graphdef, state), method)(*args)

  return functools.partial(call, state)
