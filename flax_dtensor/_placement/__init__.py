"""Placement: arrays on the mesh where the rules say, as they are created.

`_variables` walks NNX variables and answers "where does this variable
go" (`spec_of_variable`) for every API; `_placing` places arrays by mesh
axis type; `_hook` routes Flax's creation and queries through the rules;
`_creation` and `_creation_order` compute variables in their shards;
`_init` builds a model in shards (`fdt.init`), and `_replay` builds it
again in one compiled call; `_trees` places plain
pytrees; `_orbax` restores Orbax checkpoints onto a mesh; `_sources`
checks what a restore's source holds, and `_parts` which part of it holds
the model.
"""
