"""The flax-dtensor demo: a small Transformer LM, its corpus and rules.

``flax-dtensor demo`` trains it on a (2, 4) ``('data', 'model')`` mesh and
exports it to TensorFlow DTensor. The pieces are importable on their own:

* `flax_dtensor.demo.model`: the model and ``make_model``, the CLI's default
  ``TARGET``.
* `flax_dtensor.demo.data`: the shipped public-domain corpus, byte tokens and
  batches.
* `flax_dtensor.demo.train`: the default rules, the optimizer and the
  ``nnx.jit`` train step.
"""
