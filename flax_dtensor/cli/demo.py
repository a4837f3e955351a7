"""``flax-dtensor demo``: parses its flags and runs `flax_dtensor.demo.run`."""

from __future__ import annotations

import math
import pathlib
from typing import Annotated

import typer

from flax_dtensor.cli import _command, _inputs

DEFAULT_OUT = 'flax_dtensor_out'


def demo(
  steps: Annotated[
    int, typer.Option(min=1, metavar='N', help='Training steps.')
  ] = 300,
  mesh: _inputs.MeshOption = _inputs.DEFAULT_MESH,
  rules: _inputs.RulesOption = None,
  out: Annotated[
    pathlib.Path,
    typer.Option(
      metavar='DIR',
      help=(
        'Output directory: created, or an earlier output replaced as a '
        'whole (never a mix of two runs).'
      ),
    ),
  ] = pathlib.Path(DEFAULT_OUT),
  seed: Annotated[
    int, typer.Option(metavar='N', help='Seed of init and data.')
  ] = 0,
  batch_size: Annotated[
    int, typer.Option(min=1, metavar='N', help='Sequences per step.')
  ] = 16,
  cpu_devices: Annotated[
    int | None,
    typer.Option(
      min=1,
      metavar='N',
      help=_inputs.CPU_DEVICES_HELP + ' Default: the size of --mesh.',
    ),
  ] = None,
  quiet: Annotated[
    bool,
    typer.Option(
      '--quiet',
      '-q',
      help=(
        "No progress: neither the training's (a line every few seconds "
        "when piped) nor the writes' (a line as each starts)."
      ),
    ),
  ] = False,
  debug: _command.DebugOption = False,
) -> None:
  """Train a small Transformer LM on a sharded mesh and export it to TF.

  On virtual CPU devices: builds the demo model with its params sharded by
  the rules, trains it with optax on the shipped corpus, prints the plan,
  writes an Orbax checkpoint, a DTensor checkpoint and a SavedModel, then
  loads the SavedModel in a fresh TensorFlow-only process and compares its
  logits on held-out text with JAX's.
  """
  with _command.handle_errors(debug):
    axes = _inputs.parse_mesh(mesh)
    rules_ = _inputs.load_rules(rules)
    _inputs.configure_cpu_devices(cpu_devices or math.prod(s for _, s in axes))
    _inputs.check_out(out, overwrite=True, flag=False)
    mesh_ = _inputs.make_mesh(axes, mesh)
    _inputs.initialize_dtensor()  # Before any other TF operation.
    from flax_dtensor.demo import run, train

    run.run(
      mesh=mesh_,
      rules=rules_,
      rules_text=(
        pathlib.Path(rules).read_text() if rules else train.rules_text()
      ),
      out=out,
      steps=steps,
      seed=seed,
      batch_size=batch_size,
      console=_command.console(),
      progress=not quiet,
    )
