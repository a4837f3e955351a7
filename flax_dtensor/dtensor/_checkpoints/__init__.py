"""Checkpoint operations: the public steps users call.

`save_checkpoint` (`_checkpoint`), `restore_checkpoint` (`_restore`), a
training run's checkpoints by step (`_manager`: `CheckpointManager`; the
state and metrics files beside the steps, `_step_files`), one
part of a step that holds the model beside other state, restored into the
model (`_part_restore`: ``export --part``), and an Orbax checkpoint read
into a model (`_orbax`: ``export`` of an Orbax step), and what TF
saved of an export read back by NNX path (`_from_tf_files`).

May import: `dtensor._layout`, `dtensor._conversion`, `dtensor._format`,
`dtensor._storage`, the bridge's top-level helpers and the package's core;
never `_serving`.
"""
