"""The hook into Flax: variable creation and pspec queries follow our rules.

Flax places an annotated variable at creation with
``flax.core.spmd.shard_value``, and answers ``nnx.get_partition_spec`` (and
``get_named_sharding``, ``as_abstract``, ``eval_shape``) with
``flax.nnx.spmd.get_var_pspec``. `_install.install` wraps both, once, and
two more: ``with_metadata`` (behind ``nnx.with_partitioning``), so that an
annotated initializer computes only its shards (`_creation`), and
``Variable.set_value``. The wrappers take any arguments and defer to Flax
unless our rules are in effect or our build (`building`) runs; `HOOKED`
lists each wrapped function and every place Flax holds it.
`ensure_installed` installs them and proves (`check_routing`) that Flax
still calls them, once per process, before the first public name of
flax_dtensor is handed out (see the package's ``__getattr__``). Two more
wrappers serve path rules: ``get_partition_spec`` lends ``get_var_pspec``
each variable's path, and the module metaclass's call places, when the
outermost ``nnx.Module`` constructor returns, the variables path rules
cover; that one goes in when the first `LogicalRules` is made
(`_route_modules`), so a process that makes no rules of ours builds its
modules at Flax's cost.

Here: the wrappers (`_wrappers`), and the table of what they wrap, the
install and the proof that Flax calls them (`_install`). Its switches,
which our builds set, are `_placement._switches`; nothing in the core
imports this room but the namespace that installs it.
"""
