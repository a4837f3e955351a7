"""The switches of the Flax hook, per thread: what our own builds tell it.

`init` and `plan` build a model inside `building` (with `following` and
`strictly_in_shards` for `init`'s passes); the hook (`flax_dtensor._hook`)
reads `state` at each call it wraps, and nothing here imports it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from jax.sharding import Mesh

from flax_dtensor._placement import _creation_order


class State(threading.local):
  """Per-thread switches of the hook."""

  building: bool = False  # Inside `init`'s and `plan`'s builds.
  # Inside `init`'s abstract pass: the traced outputs of the initializers
  # `_creation.create` would compute in their shards on `mesh`.
  in_shards: list[Any] | None = None
  mesh: Mesh | None = None
  strict: bool = False  # Inside `init`'s eager build (see `in_shards`).
  probe: list[str] | None = None  # `check_routing` records calls here.
  # Inside an `nnx.Module` constructor called under path rules: how deep.
  depth: int = 0
  # Inside `nnx.get_partition_spec` under path rules: {id(variable): path}.
  paths: dict[int, str] | None = None
  # Inside an abstract build under path rules: module constructions, in
  # order (`_creation_order`).
  recording: _creation_order.Recording | None = None
  # Inside a concrete build under path rules: the abstract build's records
  # it follows.
  order: _creation_order.Order | None = None


state = State()


@contextlib.contextmanager
def building(
  in_shards: list[Any] | None = None,
  mesh: Mesh | None = None,
  recording: _creation_order.Recording | None = None,
) -> Iterator[None]:
  """Within the block, a model is built by flax_dtensor (`init`, `plan`).

  Created variables stay where their value is (the build places or plans
  every variable itself, by `_spec.spec_of_variable`), and tracing
  stays linear in the number of variables (see `_set_value`). With
  `in_shards`, the build is `init`'s abstract pass: the outputs of annotated
  initializers that an eager build on `mesh` computes in their shards are
  appended to it. With `recording`, every module construction is recorded
  in order (see `_creation_order`).
  """
  old = (state.building, state.in_shards, state.mesh, state.recording)
  state.building, state.in_shards, state.mesh = True, in_shards, mesh
  state.recording = recording
  try:
    yield
  finally:
    (state.building, state.in_shards, state.mesh, state.recording) = old


@contextlib.contextmanager
def following(order: _creation_order.Order | None) -> Iterator[None]:
  """Within the block, module constructions follow `order`."""
  old = state.order
  state.order = order
  try:
    yield
  finally:
    state.order = old


@contextlib.contextmanager
def strictly_in_shards() -> Iterator[None]:
  """Within the block, an annotated initializer that would compute its
  whole value raises `_creation.NotInShards` before it runs (`init`'s eager
  build, which its abstract pass predicted to need none)."""
  old = state.strict
  state.strict = True
  try:
    yield
  finally:
    state.strict = old
