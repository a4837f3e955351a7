"""Rules: what a logical axis or a path becomes on a mesh.

`_logical` holds `LogicalRules` (the rule set and its options), `_yaml` its
YAML forms, `_context` the thread-local context that sets rules (and which
rules apply, `rules_in_effect`), `_first_made` what waits for the first
rules made, `_path_rules` the path rules, `_missing_axes` what rules say of
axes a mesh lacks, `_meshes` which mesh applies, `_resolution` how logical
axes become a PartitionSpec against a mesh and a shape, `_spec` the spec
each variable gets (`spec_of_variable`, which every API asks), and
`_partition_specs` a PartitionSpec's axes and text. Nothing here places an
array.
"""


def _rebuild(pairs, unknown, strict):
  """Unpickles rules pickled by flax_dtensor 0.1.0, by this name."""
  from flax_dtensor._rules import _logical

  return _logical.LogicalRules(pairs, unknown=unknown, strict=strict)
