"""The way back from TensorFlow's files: variables TF changed, by NNX path.

`restore_from_tf` reads a SavedModel or a ``tf.train.Checkpoint`` that a
TF process wrote after changing the variables of a `save_saved_model`
export (or, in memory, the loaded object itself, as `from_tf_module`).
TF keys each variable by the first path to it it finds (``base/`` of a
wrapper, ``model/`` of a checkpoint, ``variables/3`` of a list), so the
keys alone do not say the NNX path: the checkpoint's object graph
(``_CHECKPOINTABLE_OBJECT_GRAPH``) is walked from its root to the object
holding the variables under ``state``, whose children are the NNX path's
components (`_names`). The tensors then go where `from_tf_module` puts
them (`_from_tf.place`).
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

from flax_dtensor import _errors
from flax_dtensor._placement import _sources
from flax_dtensor.dtensor import _tf, _tf_errors
from flax_dtensor.dtensor._checkpoints import _restore
from flax_dtensor.dtensor._conversion import _from_tf, _names, _target
from flax_dtensor.dtensor._format import _paths

A = TypeVar('A')

_VALUE = 'VARIABLE_VALUE'
_FIX = (
  'Pass a SavedModel directory, a directory holding a tf.train.Checkpoint '
  "(and TF's `checkpoint` file), or a checkpoint prefix, written by TF "
  'from a SavedModel of save_saved_model.'
)


def _object_graph(reader: Any, prefix: str) -> Any:
  """The checkpoint's `TrackableObjectGraph` proto."""
  from google.protobuf import message

  protos = _tf.internal('tensorflow.core.protobuf.trackable_object_graph_pb2')
  if not reader.has_tensor(_names.OBJECT_GRAPH_KEY):
    raise _errors.MalformedExportError(
      f'The TF checkpoint {prefix!r} has no object graph '
      f'({_names.OBJECT_GRAPH_KEY}): expected one written by TF 2 '
      '(`tf.saved_model.save`, `tf.train.Checkpoint`), which records where '
      f'each variable lives. {_FIX}'
    )
  graph = protos.TrackableObjectGraph()
  try:
    graph.ParseFromString(reader.get_tensor(_names.OBJECT_GRAPH_KEY))
  except message.DecodeError as e:
    raise _errors.MalformedExportError(
      f'The object graph of the TF checkpoint {prefix!r} does not parse '
      f'({e}): expected a TrackableObjectGraph. The checkpoint is damaged: '
      'write it again from TensorFlow.'
    ) from e
  if not graph.nodes:
    raise _errors.MalformedExportError(
      f'The object graph of the TF checkpoint {prefix!r} is empty: expected '
      f'at least its root object. {_FIX}'
    )
  return graph


def _node(graph: Any, node_id: int, prefix: str) -> Any:
  if not 0 <= node_id < len(graph.nodes):
    raise _errors.MalformedExportError(
      f'The object graph of the TF checkpoint {prefix!r} names the object '
      f'{node_id}, but holds {len(graph.nodes)}: the checkpoint is damaged. '
      'Write it again from TensorFlow.'
    )
  return graph.nodes[node_id]


def _state_nodes(graph: Any, prefix: str) -> dict[str, int]:
  """{'model/state': node id} of each object reached through a `state`
  child, by the first path to it (breadth first, children in order)."""
  found: dict[int, str] = {}
  seen = {0}
  queue: list[tuple[str, int]] = [('', 0)]
  while queue:
    where, node_id = queue.pop(0)
    for child in _node(graph, node_id, prefix).children:
      path = f'{where}/{child.local_name}' if where else child.local_name
      if child.local_name == _names.STATE_ATTRIBUTE:
        found.setdefault(child.node_id, path)
      elif child.node_id not in seen:
        seen.add(child.node_id)
        queue.append((path, child.node_id))
  return {path: node_id for node_id, path in found.items()}


def _choose(states: dict[str, int], prefix: str) -> int:
  """The node of the only `state` subtree; an error for none or several."""
  if not states:
    raise _errors.MalformedExportError(
      f'The TF checkpoint {prefix!r} holds no object with a '
      f'`{_names.STATE_ATTRIBUTE}` of variables: expected a SavedModel of '
      'save_saved_model, or what TF saved of one (loaded, wrapped or put in '
      f'a tf.train.Checkpoint). {_FIX}'
    )
  if len(states) > 1:
    first = sorted(states)[0].rpartition('/')[0]
    raise _errors.ExportError(
      f'The TF checkpoint {prefix!r} holds {len(states)} objects with a '
      f'`{_names.STATE_ATTRIBUTE}` of variables, under {_listing(states)}: '
      'expected one. Save only the one to restore (e.g. '
      f'`tf.train.Checkpoint(model=wrapper.{first.replace("/", ".")})`), '
      'or load it and pass that object to from_tf_module.'
    )
  (node_id,) = states.values()
  return node_id


def _listing(states: dict[str, int]) -> str:
  return ', '.join(
    repr(p.rpartition('/')[0] or '(the root)') for p in sorted(states)
  )


def _variable_keys(
  graph: Any, root: int, prefix: str
) -> dict[_names.Path, str]:
  """{NNX path: checkpoint key} of every variable under the node `root`."""
  out: dict[_names.Path, str] = {}
  stack: list[tuple[_names.Path, int, frozenset[int]]] = [
    ((), root, frozenset([root]))
  ]
  while stack:
    path, node_id, above = stack.pop()
    node = _node(graph, node_id, prefix)
    value = [a for a in node.attributes if a.name == _VALUE]
    if value:
      out[path] = value[0].checkpoint_key
      continue
    for child in node.children:
      if child.node_id in above:
        raise _errors.MalformedExportError(
          f'The object graph of the TF checkpoint {prefix!r} loops at '
          f'{_names.path_text((*path, child.local_name))!r}: expected a tree '
          'of dicts of variables under `state`. Write it again from '
          'TensorFlow.'
        )
      stack.append(
        (
          (*path, _names.key_of(child.local_name)),
          child.node_id,
          above | {child.node_id},
        )
      )
  return out


def _prefix_of(path: str) -> str:
  """The TF checkpoint prefix that `path` names, confined to it."""
  if not os.path.isdir(path) and not os.path.exists(path + '.index'):
    raise _errors.ExportNotFoundError(
      f'{path!r} does not exist (nor {path + ".index"!r}). {_FIX}'
    )
  if os.path.isdir(path):
    saved_model = os.path.join(path, 'variables', 'variables')
    if os.path.exists(saved_model + '.index'):
      return saved_model
    indexes = sorted(n for n in os.listdir(path) if n.endswith('.index'))
    if indexes and not os.path.exists(os.path.join(path, 'checkpoint')):
      prefixes = [os.path.join(path, n.removesuffix('.index')) for n in indexes]
      raise _errors.ExportNotFoundError(
        f'{path!r} holds the TF checkpoint prefix'
        f'{"es" * (len(prefixes) > 1)} {", ".join(map(repr, prefixes))} but '
        'no TF `checkpoint` file naming one (`tf.train.Checkpoint.write` '
        'writes none; `.save` does). Pass the prefix itself, e.g. '
        f'restore_from_tf({prefixes[0]!r}, model).'
      )
  prefix, _ = _restore.locate(path)
  if os.path.isdir(path):
    escape = _paths.escape_problem(path, os.path.relpath(prefix, path))
    if escape is not None:  # pragma: no cover - `locate` refuses it first.
      raise _errors.MalformedExportError(
        f'The checkpoint of {path!r} is at {prefix!r}, and {escape}.'
      )
  return prefix


def paths_of_keys(reader: Any, prefix: str) -> dict[str, _names.Path]:
  """{checkpoint key: NNX path} of the variables under the one `state` of
  a TF checkpoint's object graph (what TF saved of an export, whatever
  keys it chose); empty if it has no object graph or not one such `state`.
  """
  try:
    graph = _object_graph(reader, prefix)
    node_id = _choose(_state_nodes(graph, prefix), prefix)
    keys = _variable_keys(graph, node_id, prefix)
  except _errors.ExportError:
    return {}
  return {k: p for p, k in keys.items()}


def read_tf_variables(path: str) -> tuple[dict[_names.Path, Any], str]:
  """The tensors of a TF checkpoint by NNX path, and its prefix."""
  tf = _tf.tf()
  prefix = _prefix_of(path)
  with _tf_errors.translated(
    'Reading the TF checkpoint',
    prefix,
    'The checkpoint is damaged or not a TF checkpoint: write it again from '
    'TensorFlow.',
    tf_kind=_errors.DamagedExportError,
  ):
    reader = tf.train.load_checkpoint(prefix)
    graph = _object_graph(reader, prefix)
    node_id = _choose(_state_nodes(graph, prefix), prefix)
    keys = _variable_keys(graph, node_id, prefix)
    stored = reader.get_variable_to_shape_map()
    missing = sorted(
      _names.path_text(p) for p, k in keys.items() if k not in stored
    )
    if missing:
      raise _errors.MalformedExportError(
        f'The object graph of the TF checkpoint {prefix!r} names '
        f'{len(missing)} variable(s) it holds no value for: '
        f'{", ".join(missing)}. The checkpoint is damaged: write it again '
        'from TensorFlow.'
      )
    tensors = {p: tf.constant(reader.get_tensor(k)) for p, k in keys.items()}
  return tensors, prefix


@_target.takes_restore_options
def restore_from_tf(
  source: str | os.PathLike[str] | Any,
  target: A,
  options: _target.RestoreOptions,
) -> A:
  """Restores the variables TensorFlow saved of an export, by NNX path.

  The way back from TensorFlow's files: after a TF process changed the
  variables of a SavedModel that `save_saved_model` wrote (fine-tuning it)
  and saved them again, with `tf.saved_model.save` (of the loaded object,
  or of a module of the user's own holding it) or with
  ``tf.train.Checkpoint(model=loaded).write(prefix)`` / ``.save(prefix)``,
  their values come back into an NNX model, sharded by the rules, bit for
  bit, as `from_tf_module` brings them back from memory.

  TF re-saves a trainable export (``trainable=`` of `save_saved_model`)
  with ``tf.saved_model.save(loaded, directory,
  signatures=loaded.signatures)`` (without `signatures`, TF keeps none for
  serving) and no options: the
  gradients are saved with it, so the re-saved SavedModel trains again.
  ``options=tf.saved_model.SaveOptions(experimental_custom_gradients=False)``
  gives one that serves but no longer trains; either restores the same.

  TF keys a variable by the first path to it it finds, so the keys alone do
  not say the NNX path: the checkpoint's object graph is walked from its
  root to the object holding the variables under ``state``, and each
  variable below it is matched to the target by its exact NNX path. Each
  variable is read whole on the host, then placed as the target says.

  A SavedModel stores some dtypes widened (float16 as float32, see
  `save_saved_model`); TF's files keep no note of that, so such a variable
  is refused unless `convert_dtypes`, which narrows it back: exactly, for
  the values JAX saved, and as `jax.Array.astype` rounds for values TF
  computed in the wider dtype.

  Args:
    source: A SavedModel directory, a directory holding a ``tf.train.
      Checkpoint`` and TF's ``checkpoint`` file (whose prefix must lie
      inside it), or a checkpoint prefix; or, where TF and JAX share a
      process, the object itself: what ``tf.saved_model.load`` returned (or
      a ``tf.Module`` holding it), read in memory as `from_tf_module` does.
    target: An NNX module (concrete, or abstract from `nnx.eval_shape`),
      which is updated in place and returned; or an `nnx.State`, for which a
      new `nnx.State` of the restored variables is returned.
    include: NNX filter of the target's variables to restore (default:
      every variable; each must be in the checkpoint).
    exclude: NNX filter of variables to leave alone (default: RNG state).
    mesh: The concrete mesh for abstract shardings and for variables
      resolved by the rules; default the current mesh (`jax.set_mesh`).
    rules: Logical-axis rules for annotated variables; default the rules in
      effect.
    allow_extra: Ignore variables of the checkpoint the target lacks.
    convert_dtypes: Cast each variable to the target's dtype when they
      differ, as `jax.Array.astype` does.
    rng_seed: Seed for RNG state left out in an abstract target.
    progress: Show a progress bar; None shows one from 16 variables when
      stderr is a terminal.

  Returns:
    `target` itself (a module, filled in), or a new `nnx.State`.

  Raises:
    ExportNotFoundError: If `source` is a path that holds no TF checkpoint.
    MalformedExportError: If TF's ``checkpoint`` file names a prefix outside
      its directory, the checkpoint has no object graph or one without
      exported variables, or its graph is damaged.
    DamagedExportError: If TensorFlow cannot read the files.
    ExportError: If `source` is neither a path nor a TF object holding an
      export; if it holds several exported objects; or if it lacks a
      selected variable, holds one the target lacks, or one with another
      shape or dtype (each named). Each of the above is an ExportError too.
    NotAModelError: If `target` is not an NNX module or state.

  Example:
    >>> with jax.set_mesh(mesh):  # doctest: +SKIP
    ...   abstract = nnx.eval_shape(lambda: Model(rngs=nnx.Rngs(0)))
    ...   model = restore_from_tf('/tmp/fine_tuned', abstract)
  """
  if not isinstance(source, str | bytes | os.PathLike):
    if _from_tf.state_holder(source) is None:
      raise _errors.ExportError(
        'Expected the TF checkpoint or SavedModel as a str or os.PathLike, '
        'or a TF object holding a SavedModel of save_saved_model (what '
        f'tf.saved_model.load returned, or a module holding it), got '
        f'{type(source).__name__}: {source!r:.100}. {_FIX}'
      )
    variables, named = _from_tf.variables_of(source)
    return _from_tf.place(variables, named, target, options)
  where = _paths.local(source, 'TF checkpoint or SavedModel')
  with _tf.cpp_noise_dropped():  # A damaged file's failed op logs first.
    tensors, prefix = read_tf_variables(where)
  named = _sources.Source(
    f'The TF checkpoint {prefix!r}', 'a TF checkpoint', 'saved'
  )
  return _from_tf.place(tensors, named, target, options)
