"""JAX arrays and TF layouts, in memory: the bridge's lowest room.

What a sharded JAX array is in TensorFlow DTensor and back: the DTensor
topology and TF's devices (`_topology`), meshes and layouts (`_layouts`),
zero-copy packing (`_arrays`), dtypes (`_dtypes`), global slices
(`_index`, without JAX) and host pieces placed by a sharding (`_pieces`).

May import: the package's core (`flax_dtensor._rules`, `_placement`,
`_errors`, `_output`, `_text`) and the bridge's top-level helpers
(`dtensor._errors`, `_tf`, `_tf_errors`, `_processes`); no other room.
"""
