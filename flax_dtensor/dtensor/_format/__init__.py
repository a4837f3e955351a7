"""The checkpoint format: what an export holds on disk, without JAX or TF.

The manifest that describes and checks an export (`_manifest`), its shards
a grid of global slices (`_grid`), and the paths an export may name,
confined to it (`_paths`).

May import: `dtensor._layout`, `dtensor._conversion`, the bridge's
top-level helpers and the package's core; never `_storage`, `_checkpoints`
nor `_serving`.
"""
