"""The options the commands share: their help, metavars and defaults.

Each is declared once as an ``Annotated`` type (`MeshOption`,
`RulesOption`, ...) that a command names as its parameter's type; the
texts beside them are the help the commands print.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer


def valued(flag: str, metavar: str, help: str) -> Any:
  """The `typer.Option` of ``FLAG VALUE``, whose default (None) is not
  shown."""
  return typer.Option(flag, metavar=metavar, help=help, show_default=False)


DEMO_TARGET = 'flax_dtensor.demo.model:make_model'
DEFAULT_MESH = 'data=2,model=4'
MESH_HELP = 'Mesh axes as NAME=SIZE pairs, e.g. data=2,model=4.'
MESH_METAVAR = 'NAME=SIZE,...'
RULES_METAVAR = 'RULES.yaml'
RULES_HELP = (
  "A YAML rules file in MaxText's format (a logical_axis_rules list of "
  '(name, target) pairs), and path_rules for variables without logical '
  'axes (see the path rules page). Default: the demo rules '
  '(flax_dtensor/demo/rules.yaml; plan says so in a note, first on stdout, '
  'or on stderr with --json).'
)
DEMO_RULES_NOTE = (
  "note: no --rules given, so the demo's rules apply "
  '(flax_dtensor/demo/rules.yaml).'
)
OWN_RULES_HINT = (
  " For {target}'s own rules pass --rules RULES.yaml, or --suggest to "
  'propose some.'
)


def demo_rules_note(
  rules: str | None, mesh_axis_names: bool, target: str
) -> str | None:
  """The note that the demo's rules apply (no --rules), or None."""
  if rules is not None or mesh_axis_names:
    return None
  if target == DEMO_TARGET:
    return DEMO_RULES_NOTE
  return DEMO_RULES_NOTE + OWN_RULES_HINT.format(target=target)


MESH_AXIS_NAMES_HELP = (
  "The model's annotations name mesh axes (as tunix's ShardingConfig "
  'does): each axis of --mesh is its own rule '
  '(fdt.LogicalRules.for_mesh_axes). With --rules, after the rules of the '
  'file; without, instead of the demo rules.'
)
MISSING_MESH_AXES_HELP = (
  'What a rule naming a mesh axis the mesh lacks does: fallback (the '
  'default: it is skipped, the next rule for its name applies, and one '
  "spelled like a mesh axis is a likely typo, the plan's headline) or "
  "error (exit 2 naming each such rule). Overrides the rules file's "
  'missing_mesh_axes.'
)
OPTIMIZER_HELP = (
  "Also plan the optimizer's state (under optimizer/), as fdt.plan's "
  '`optimizer=` does: the name of an optax transformation taking a '
  'learning rate, e.g. adamw, adam, sgd, lion, adafactor.'
)
CPU_DEVICES_HELP = (
  'Run on this many virtual CPU devices (sets XLA_FLAGS and '
  'jax_num_cpu_devices before JAX starts).'
)

# The options every command that builds a model takes, declared once (typer
# reads a copy of each `typer.Option` per command).
MeshOption = Annotated[str, typer.Option(metavar=MESH_METAVAR, help=MESH_HELP)]
RulesOption = Annotated[
  str | None, typer.Option(metavar=RULES_METAVAR, help=RULES_HELP)
]
MeshAxisNamesOption = Annotated[
  bool, typer.Option('--mesh-axis-names', help=MESH_AXIS_NAMES_HELP)
]
AXIS_TYPES_HELP = (
  "The mesh axes' types: auto (the default: JAX's compiler places "
  'activations, as `with_sharding_constraint` asks), explicit (as '
  '`jax.make_mesh` gives: for models whose forward says where results go, '
  '`out_sharding=`, `jax.sharding.reshard`), or NAME=TYPE pairs, e.g. '
  'data=explicit,model=auto (an axis not named is auto).'
)
AxisTypesOption = Annotated[
  str,
  typer.Option(
    '--axis-types', metavar='auto|explicit|NAME=TYPE', help=AXIS_TYPES_HELP
  ),
]
