"""Placement: arrays on the mesh where the rules say, as they are created.

`_variables` walks NNX variables; `_placing` places arrays by mesh axis
type; `_creation` and `_creation_order` compute variables in their shards;
`_switches` holds what our builds tell the Flax hook (`flax_dtensor._hook`,
which routes Flax's creation and queries through the rules); `_init`
builds a model in shards (`fdt.init`), choosing among the abstract pass of
`_abstract_build`, the traced build of `_traced` and the build on several meshes
of `_own_meshes`, each calling the factory as `_calls` says; `_init_cache`
keeps its compiled builds, and `_replay` builds it again in one compiled
call; `_trees` places plain pytrees; `_sources` checks what a restore's
source holds, and `_parts` which part of it holds the model.
"""
