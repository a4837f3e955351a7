"""JAX arrays and TF layouts: the bridge's lowest room.

What a sharded JAX array is in TensorFlow DTensor and back, in memory:
the DTensor topology (`_topology`), meshes and layouts (`_layouts`),
zero-copy packing (`_arrays`), dtypes (`_dtypes`), NNX paths and checkpoint
keys (`_names`), which variables an export holds (`_selection`), the target
a restore fills (`_target`), global slices (`_index`, without JAX) and
host pieces placed by a sharding (`_pieces`),
a state to TF variables (`_convert`), one DTensor mesh for many layouts
(`_single_mesh`) and TF variables back into NNX (`_from_tf`).

May import: the package's core (`flax_dtensor._rules`, `_placement`,
`_errors`, `_output`, `_text`) and the bridge's top-level helpers
(`dtensor._errors`, `_tf`, `_tf_errors`, `_peers`); never `_files` nor
`_serving`.
"""
