"""An NNX state and TF variables, in memory: the conversion.

NNX paths and checkpoint keys (`_names`), which variables an export holds
(`_selection`), the target a restore fills (`_target`), one DTensor mesh for
many layouts (`_single_mesh`), a state to TF variables (`_convert`:
`to_tf_module`) and TF variables back into NNX (`_from_tf`: `from_tf_module`).

May import: `dtensor._layout`, the bridge's top-level helpers and the
package's core; never `_format`, `_storage`, `_checkpoints` nor `_serving`.
"""
