"""TF's reusable-SavedModel attributes, added to a written SavedModel.

TF's convention (tensorflow.org/hub/reusable_saved_models) has a loaded
SavedModel list its ``variables``, ``trainable_variables`` and
``regularization_losses``. Lists on the root would change every
variable's checkpoint key: TF keys a variable by the shortest path its
breadth-first walk finds, and ``variables/0`` is shorter than
``state/layers/0/kernel``, which `checkpoint_key` promises. So the root is
saved with ``state`` alone and `add_lists` then adds the three lists to
the SavedModel's object graph (``saved_model.pb``) as nodes referring to
the variables' own nodes: TF loads them as lists of the very variables
``state`` holds, and the checkpoint keeps its keys. The fingerprint is
written again for the new graph.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from flax_dtensor.dtensor import _tf
from flax_dtensor.dtensor._conversion import _names, _selection

LISTS = ('variables', 'trainable_variables', 'regularization_losses')
# How TF's object graph names a list (`ListWrapper`).
_LIST_IDENTIFIER = 'trackable_list_wrapper'


def _variable_nodes(graph: Any) -> dict[str, tuple[int, bool]]:
  """Checkpoint key -> (node id, trainable) of every variable under state."""
  root = graph.nodes[0]
  state = [c.node_id for c in root.children if c.local_name == 'state']
  found: dict[str, tuple[int, bool]] = {}
  stack = [(i, ('state',)) for i in state]
  while stack:
    i, path = stack.pop()
    node = graph.nodes[i]
    if node.WhichOneof('kind') == 'variable':
      key = '/'.join(map(_names.escape, path)) + _names.ATTRIBUTES_SUFFIX
      found.setdefault(key, (i, bool(node.variable.trainable)))
      continue
    stack.extend((c.node_id, (*path, c.local_name)) for c in node.children)
  return found


def add_lists(directory: str, entries: Sequence[_selection.Entry]) -> None:
  """Adds `LISTS` to the root of the SavedModel in `directory`.

  The variables are listed in the order of `entries` (NNX path order).
  """
  saved_model_pb2 = _tf.internal('tensorflow.core.protobuf.saved_model_pb2')
  path = os.path.join(directory, 'saved_model.pb')
  proto = saved_model_pb2.SavedModel()
  with open(path, 'rb') as f:
    proto.ParseFromString(f.read())
  (meta,) = proto.meta_graphs
  graph = meta.object_graph_def
  root = graph.nodes[0]
  # Internal invariants: no signature takes these names
  # (`_signatures.RESERVED`), and TF keyed every variable under `state`
  # (the root holds nothing shorter to reach it by).
  nodes = _variable_nodes(graph)
  assert not {c.local_name for c in root.children} & set(LISTS)
  assert all(e.key in nodes for e in entries), sorted(nodes)
  ids = [nodes[e.key] for e in entries]
  lists = {
    'variables': [i for i, _ in ids],
    'trainable_variables': [i for i, trainable in ids if trainable],
    'regularization_losses': [],
  }
  for name in LISTS:
    node = graph.nodes.add()
    node.user_object.identifier = _LIST_IDENTIFIER
    node.user_object.version.producer = 1
    node.user_object.version.min_consumer = 1
    for k, i in enumerate(lists[name]):
      node.children.add(node_id=i, local_name=str(k))
    root.children.add(node_id=len(graph.nodes) - 1, local_name=name)
  with open(path, 'wb') as f:
    f.write(proto.SerializeToString())
  fingerprinting = _tf.internal(
    'tensorflow.python.saved_model.fingerprinting_utils'
  )
  fingerprinting.write_fingerprint(directory)
