"""The benchmark groups, one module each: its cases, its grids, its peer.

A group module holds the cases its measurements run (functions of a
method and the case's parameters, each returning one measurement: seconds
and the peak RSS, run in a fresh process by `measure.py`), `CASES` (the
name `measure.py` runs each by), and `full()` and `quick()` (its groups'
records, `harness.case`, for the full run and for ``--quick``). A module
may hold several groups that share its cases (`init`: `init_scaling` and
`path_rules`), and a group may run another module's case (`vs_orbax`'s
methods run in the `checkpoint` case, beside ours).

Importing a group module costs NumPy only: every case imports JAX, Flax,
TensorFlow or Orbax when it runs, and the `gpu` group's never imports
TensorFlow.
"""

from __future__ import annotations

from groups import (
  checkpoint,
  checkpoint_scale,
  cli,
  export_memory,
  from_tf,
  gpu,
  hook,
  init,
  manager,
  multiprocess,
  plan,
  saved_model,
  to_tf,
  vs_orbax,
)

MODULES = (
  manager,
  gpu,
  init,
  hook,
  plan,
  to_tf,
  checkpoint,
  from_tf,
  cli,
  vs_orbax,
  multiprocess,
  checkpoint_scale,
  export_memory,
  saved_model,
)

# The order the groups are measured in (and listed in `results.json`).
ORDER = (
  'manager',
  'manager_scale',
  'gpu',
  'init',
  'init_scaling',
  'path_rules',
  'hook',
  'plan',
  'to_tf',
  'saved_model',
  'checkpoint',
  'single_mesh',
  'from_tf',
  'cli',
  'vs_orbax',
  'multiprocess',
  'checkpoint_scale',
  'export_memory',
  'checkpoint_scaling',
)

# Every case by the name `measure.py` runs it by.
CASES = {name: fn for module in MODULES for name, fn in module.CASES.items()}


def grids(quick: bool = False) -> dict[str, list[dict]]:
  """Each group's case records, in `ORDER`: the full run's, or `--quick`'s."""
  out = {}
  for module in MODULES:
    out.update(module.quick() if quick else module.full())
  unknown = sorted(set(out) - set(ORDER))
  if unknown:
    raise ValueError(f'groups {unknown} are missing from groups.ORDER')
  return {name: out[name] for name in ORDER if name in out}
