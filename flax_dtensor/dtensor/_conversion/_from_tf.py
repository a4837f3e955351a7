"""The way back in memory: TF variables into a sharded NNX model or state.

`from_tf_module` matches TF variables to the target's variables by exact
NNX path (`_names`) and checks them as a restore checks a checkpoint
(`_target`). It reads each DTensor's local components (`dtensor.unpack`),
whose global slices follow from the DTensor layout by mesh position, and
places the slices the target's sharding needs (`_pieces.assemble`). In a
multi-process run, JAX moves what another process holds.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypeVar

import jax
import numpy as np

from flax_dtensor import _errors, _output
from flax_dtensor._placement import _sources
from flax_dtensor._rules import _meshes
from flax_dtensor.dtensor import _tf
from flax_dtensor.dtensor._conversion import (
  _convert,
  _names,
  _target,
)
from flax_dtensor.dtensor._layout import _arrays, _layouts, _pieces, _topology

A = TypeVar('A')
Index = _pieces.Index

_EXPECTED_SOURCE = (
  'Expected a tf.Module from to_tf_module (or a SavedModel of '
  'save_saved_model loaded by tf.saved_model.load), a dict of TF variables '
  "keyed by NNX path (('layers', 0, 'kernel') or 'layers/0/kernel'), or a "
  'list of TF variables named by NNX path'
)
_TF_NAME_SUFFIX = re.compile(r':\d+$')


def _key_path(key: Any, where: str) -> _names.Path:
  """The NNX path a dict key or variable name stands for."""
  if isinstance(key, str):
    path = _names.parse_path(key)
  elif isinstance(key, tuple) and key:
    path = key
  else:
    raise _errors.ExportError(
      f'{_EXPECTED_SOURCE}; got {where} {key!r} ({type(key).__name__}). '
      "Key each variable by its NNX path: a tuple of keys or a '/'-joined "
      'str.'
    )
  for part in path:
    _names.component(part)  # Raises on keys that are neither str nor int.
  return path


def variables_of(
  source: Any,
) -> tuple[dict[_names.Path, Any], _sources.Source]:
  """The TF variables (or tensors) of `source` by NNX path, and its name."""
  tf = _tf.tf()
  if isinstance(source, Mapping):
    what = _sources.Source(
      'The dict of TF variables', 'TF variables', 'exported'
    )
    pairs = [(_key_path(k, 'the key'), k, v) for k, v in source.items()]
  elif isinstance(source, list | tuple):
    what = _sources.Source(
      'The list of TF variables', 'TF variables', 'exported'
    )
    pairs = []
    for v in source:
      if not isinstance(v, tf.Variable):
        raise _errors.ExportError(
          f'{_EXPECTED_SOURCE}; got a list holding {type(v).__name__} '
          f'{v!r:.100}. Put only TF variables in the list, or pass a dict '
          'keyed by NNX path.'
        )
      name = _TF_NAME_SUFFIX.sub('', v.name)
      pairs.append((_key_path(name, 'a variable named'), v.name, v))
  elif (holder := state_holder(source)) is not None:
    what = _sources.Source('The tf.Module', 'a tf.Module', 'exported')
    flat = _convert.flat_variables(holder)
    pairs = [(p, _names.path_text(p), v) for p, v in flat.items()]
  else:
    raise _errors.ExportError(
      f'{_EXPECTED_SOURCE}; got {type(source).__name__}: {source!r:.100}.'
    )
  out: dict[_names.Path, Any] = {}
  keys: dict[_names.Path, Any] = {}
  for path, key, value in pairs:
    name = _names.path_text(path)
    if path in out:
      raise _errors.ExportError(
        f'{what.name} holds two TF variables for the NNX path {name!r}: '
        f'{keys[path]!r} and {key!r}. Expected one per path; keep one.'
      )
    if not isinstance(value, tf.Variable | tf.Tensor):
      raise _errors.ExportError(
        f'Expected a TF variable or tensor for the NNX path {name!r}, got '
        f'{type(value).__name__}: {value!r:.100}.'
      )
    out[path], keys[path] = value, key
  return out, what


def state_holder(source: Any) -> Any:
  """The object holding the `state` variables: `source` itself, or the one
  object under it that does (a TF user's wrapper, ``wrapper.base =
  loaded``); None if no object does.

  Raises:
    ExportError: If several objects under `source` hold one.
  """
  if hasattr(source, _names.STATE_ATTRIBUTE):
    return source
  if not callable(getattr(source, '_trackable_children', None)):
    return None
  found: dict[int, tuple[str, Any]] = {}
  seen = {id(source)}
  queue: list[tuple[str, Any]] = [('', source)]
  while queue:
    where, node = queue.pop(0)
    try:
      children = node._trackable_children()
    except Exception:  # pragma: no cover - a trackable TF cannot list.
      continue
    for name, child in sorted(children.items()):
      path = f'{where}.{name}' if where else name
      if id(child) in seen or isinstance(child, _tf.tf().Variable):
        continue
      seen.add(id(child))
      if hasattr(child, _names.STATE_ATTRIBUTE) and not isinstance(
        child, Mapping
      ):
        found.setdefault(id(child), (path, child))
      else:
        queue.append((path, child))
  if len(found) > 1:
    paths = sorted(p for p, _ in found.values())
    raise _errors.ExportError(
      f'{type(source).__name__} holds {len(paths)} objects with a '
      f'`{_names.STATE_ATTRIBUTE}` of exported variables: '
      f'{", ".join(paths)}. Expected one; pass the one to restore from '
      f'(e.g. `from_tf_module(source.{paths[0]}, target)`).'
    )
  return next(iter(found.values()))[1] if found else None


def _held(value: Any) -> _sources.Held:
  shape = tuple(value.shape.as_list())
  dtype = np.dtype(value.dtype.as_numpy_dtype)
  return _sources.Held(shape, dtype, dtype)


def _is_dtensor(t: Any) -> bool:
  return _topology.is_initialized() and bool(_tf.dtensor().is_dtensor(t))


def _host_pieces(
  t: Any, shape: tuple[int, ...]
) -> tuple[dict[Index, np.ndarray], dict[jax.Device, tuple[Index, np.ndarray]]]:
  """This process's slices of a tensor on the host, without copies.

  Returns the slices by global index, and by the JAX device each DTensor
  component lives on. A DTensor's local components (in the order of its
  mesh's local devices, as `dtensor.unpack` gives them) each hold the
  global slice their mesh position implies, and each lives on one TF
  logical CPU device, which stands for one local JAX device. A plain
  tensor holds everything.
  """
  if not _is_dtensor(t):
    whole = tuple((0, n) for n in shape)
    return {whole: _arrays.tensor_numpy(t)}, {}
  dtensor = _tf.dtensor()
  dmesh = dtensor.fetch_layout(t).mesh
  indices = _layouts.component_indices(
    dmesh, list(dtensor.fetch_layout(t).sharding_specs), shape
  )
  pieces: dict[Index, np.ndarray] = {}
  own: dict[jax.Device, tuple[Index, np.ndarray]] = {}
  for index, device, component in zip(
    indices, dmesh.local_devices(), dtensor.unpack(t), strict=True
  ):
    data = _arrays.tensor_numpy(component)
    pieces.setdefault(index, data)  # Replicas hold the same values.
    own[_layouts.local_jax_device(device)] = (index, data)
  return pieces, own


def _placed_on_host(
  t: Any, shape: tuple[int, ...], sharding: jax.sharding.Sharding
) -> jax.Array:
  """The tensor's values placed as `sharding` says, via host slices."""
  pieces, own = _host_pieces(t, shape)
  return _pieces.assemble(pieces, shape, sharding, own=own)


def _placed_by_jax(
  t: Any,
  sharding: jax.sharding.Sharding,
  mesh: jax.sharding.Mesh | None,
) -> jax.Array:
  """A DTensor over several processes placed as `sharding` says.

  Its components become the shards of a JAX array with the same layout
  (`dtensor_to_array`, zero-copy), which JAX moves collectively: every
  process takes this path for the same variables, in the same order.
  """
  dmesh = _tf.dtensor().fetch_layout(t).mesh
  source_mesh = None if _layouts.lookup(dmesh) is not None else mesh
  array = _arrays.dtensor_to_array(t, mesh=source_mesh)
  if array.sharding == sharding:
    return array
  return jax.device_put(array, sharding)


@_target.takes_restore_options
def from_tf_module(
  tf_module_or_dvariables: Any,
  target: A,
  options: _target.RestoreOptions,
) -> A:
  """Returns TF variables as a sharded NNX model or state, in memory.

  The way back from `to_tf_module`, with nothing written to disk: after
  TensorFlow changed the variables (an optimizer step, an `assign_add`),
  their values come back into an NNX model, sharded by the rules, as
  `restore_checkpoint` does from a checkpoint. Variables are matched by
  their exact NNX path: the paths `to_tf_module` gave them, the keys of a
  dict, or the names of the variables in a list.

  Each process reads its own DTensor components (`dtensor.unpack`): no
  host gathers the model. The global slice a component holds follows from
  its DTensor layout and mesh position, so any DTensor mesh works, one
  built by TF users too. Where a target shard is exactly a component (the
  target keeps the DTensor layout), the JAX shard is that buffer, without
  a copy; other layouts cost one copy of the slices each device needs. In
  a multi-process run, JAX moves the slices other processes hold (a
  collective: every process must call this together).

  The target's shardings follow the same rules as `restore_checkpoint`'s:
  a variable annotated with logical axes is placed by the rules in effect
  (`rules`, or the context's) on the mesh that applies (`mesh`, or the
  current one), whatever the DTensor layout; any other variable keeps its
  value's own sharding. TensorFlow copies a variable's buffer before it
  next writes to it while JAX holds that buffer, so later TF updates never
  change the returned arrays.

  Args:
    tf_module_or_dvariables: A `tf.Module` from `to_tf_module` (or a
      SavedModel of `save_saved_model`, loaded by `tf.saved_model.load`);
      a dict of TF variables (or tensors) keyed by NNX path, a tuple of
      keys or a '/'-joined str (digit parts are list indices); or a list of
      TF variables whose names are NNX paths ('layers/0/kernel'). DTensor
      variables (`dtensor.DVariable`) and plain TF variables both work.
    target: An NNX module (concrete, or abstract from `nnx.eval_shape`),
      which is updated in place and returned; or an `nnx.State`, for which a
      new `nnx.State` of the restored variables is returned.
    include: NNX filter of the target's variables to restore (default:
      every variable; each must have a TF variable).
    exclude: NNX filter of variables to leave alone (default: RNG state).
    mesh: The concrete mesh for abstract shardings and for variables
      resolved by the rules; default the current mesh (`jax.set_mesh`).
    rules: Logical-axis rules for annotated variables; default the rules in
      effect.
    allow_extra: Ignore TF variables the target lacks.
    convert_dtypes: Cast each variable to the target's dtype when they
      differ, as `jax.Array.astype` does (this can round, saturate or
      overflow values).
    rng_seed: Seed for RNG state left out in an abstract target (each key
      folds the seed with its path).
    progress: Show a progress bar; None shows one from 16 variables when
      stderr is a terminal.

  Returns:
    `target` itself (a module, filled in), or a new `nnx.State`.

  Raises:
    NotAModelError: If `target` is not an NNX module or state.
    ExportError: If `tf_module_or_dvariables` is none of the above, two of
      its variables have one NNX path, it lacks a selected variable, holds
      one the target lacks (unless `allow_extra`), or one with another
      shape or dtype; or if an abstract target would keep abstract
      variables, or an abstract sharding has no concrete mesh.
    UnknownLogicalAxisError: If the rules do not mention a logical axis of
      an annotated variable.
    ShardingResolutionError: If an annotated variable's logical axes cannot
      be resolved by the rules.

  Example:
    >>> tf_module = to_tf_module(model)  # doctest: +SKIP
    >>> kernel = flat_variables(tf_module)['head/kernel']  # doctest: +SKIP
    >>> kernel.assign(kernel.read_value() * 2)  # doctest: +SKIP
    >>> with jax.set_mesh(mesh):  # doctest: +SKIP
    ...   model = from_tf_module(tf_module, model)
  """
  variables, source = variables_of(tf_module_or_dvariables)
  return place(variables, source, target, options)


def place(
  variables: Mapping[_names.Path, Any],
  source: _sources.Source,
  target: A,
  options: _target.RestoreOptions,
) -> A:
  """TF variables or tensors by NNX path into `target`, checked and placed.

  What `from_tf_module` does once it has the variables; `source` names them
  in its messages (`restore_from_tf` reads them from TF's files).
  """
  entries = options.entries(target)
  held = {p: _held(v) for p, v in variables.items()}
  extra = _sources.check_extra(target, held, source, options.allow_extra)
  kinds = _sources.check_held(
    entries, held, source, options.convert_dtypes, extra=extra
  )
  shardings = _target.target_shardings(
    entries, options.mesh, options.rules_in_effect()
  )
  show = _convert.show_progress(options.progress, len(entries))
  several = jax.process_count() > 1
  # A DTensor mesh not built here is looked up in this mesh's axes.
  context = _meshes.mesh_for(mesh=options.mesh)
  jax_mesh = context if isinstance(context, jax.sharding.Mesh) else None
  tf = _tf.tf()
  arrays = []
  with _output.progress(
    show=show, total=len(entries), description='flax_dtensor: from TF'
  ) as advance:
    for e, h, sharding in zip(entries, kinds, shardings, strict=True):
      value = variables[e.path]
      if isinstance(value, tf.Variable):
        value = value.read_value()
      if several and _is_dtensor(value):
        try:
          array = _placed_by_jax(value, sharding, jax_mesh)
        except _errors.DTensorError as err:
          raise _errors.ExportError(
            f'Cannot read the TF variable for {e.name!r}: {err}'
          ) from err
      else:
        array = _placed_on_host(value, e.shape, sharding)
      arrays.append(_target.as_target(array, e, h.saved))
      advance(1)
  return _target.fill(target, entries, arrays, options.rng_seed)
