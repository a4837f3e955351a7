"""SavedModels: an NNX model served by TensorFlow without JAX.

Which method each signature key serves, and the TF functions around it
(`_signatures`); the inputs a forward pass takes (`_inputs`) and what it
returns (`_signature`); the forward traced where JAX runs it (`_tracing`), and why
a trace on those inputs failed, in the caller's words (`_input_checks`);
the forward pass serialized for TF's StableHLO reader (`_serialization`),
and `save_saved_model` (`_saved_model`), which writes them with the
variables and a manifest, then TF's reusable-SavedModel lists
(`_conventions`); a second export of a model with new weights, written
without a new trace (`_reexport`); and the written SavedModel served in a
TF-only process against JAX (`_verify`).

May import: `dtensor._checkpoints`, `dtensor._storage`, `dtensor._format`,
`dtensor._conversion`, `dtensor._layout`, the bridge's top-level helpers and
the package's core.
"""
