"""How pytest-xdist hands the suite to its workers: dearest work first.

pytest-xdist's `loadfile` gives each worker whole test files, in the order
they were collected (or by their number of tests). A file that costs
minutes but holds few tests then starts last, and one worker finishes
alone while the other waits. `CostFirstScheduling` (tests/conftest.py asks
for it under `--dist loadfile`, the suite's default) keeps files whole,
and gives a free worker the dearest file left, by the seconds that a
measured run recorded (`COSTS_FILE`, written by `tools/suite_profile.py
--write-costs`); a file not in it counts by its number of tests.

A file listed in `SPLIT` is handed out in parts instead, so that its cases
spread over the workers: a test at a time, or in the groups its function
names (tests of a group share their module fixtures' costly work; a worker
that runs any test of a file builds that file's module fixtures).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable

from xdist.scheduler import LoadScopeScheduling

COSTS_FILE = pathlib.Path(__file__).resolve().parent / 'costs.json'
# A test of a file not measured yet: about what an average test costs.
SECONDS_PER_UNMEASURED_TEST = 1.0


def _each_test(nodeid: str) -> str:
  return nodeid


def served_part(cell_id: str) -> str | None:
  """The part of the context matrix's SavedModel cells that cell `cell_id`
  (its test id) is in, or None for another cell. Each part shares one
  export and serving step; four parts of 12 to 20 cells (by the mesh the
  cell exports from, Explicit axes or not, and whether it is a cell of the
  whole model or of one feature), so that no worker holds all 64 exports,
  and the parts even out over the workers."""
  if not cell_id.startswith('save_saved_model'):
    return None
  explicit = '-Explicit-' in cell_id or '-size_1_axes-' in cell_id
  whole = cell_id.endswith('-all')
  return (
    f'served-{"explicit" if explicit else "other"}-'
    f'{"whole" if whole else "features"}'
  )


def _served_or_not(nodeid: str) -> str:
  """The context matrix: its SavedModel cells, in their `served_part`s,
  apart from the rest."""
  cell_id = nodeid.partition('[')[2].removesuffix(']')
  part = served_part(cell_id) if '::test_cell[' in nodeid else None
  return f'{file_of(nodeid)}::{part or "rest"}'


# Files handed out in parts: {file: its part of a test's node id}.
SPLIT: dict[str, Callable[[str], str]] = {
  'tests/bridge/context_matrix_test.py': _served_or_not,
  'tests/cli/interrupt_test.py': _each_test,
  'tests/docs/docs_snippets_test.py': _each_test,
}


def load_costs(path: pathlib.Path = COSTS_FILE) -> dict[str, float]:
  """{test file, or part of a split file: seconds of a worker}, or {}
  without a readable table."""
  try:
    table = json.loads(path.read_text(encoding='utf-8'))
  except (OSError, ValueError):
    return {}
  if not isinstance(table, dict):
    return {}
  costs = {}
  for key in ('seconds_by_file', 'seconds_by_part'):
    entries = table.get(key, {})
    if isinstance(entries, dict):
      costs.update(
        (str(k), float(v))
        for k, v in entries.items()
        if isinstance(v, int | float)
      )
  return costs


def file_of(nodeid: str) -> str:
  return nodeid.split('::', 1)[0]


class CostFirstScheduling(LoadScopeScheduling):
  """`loadfile`, but the dearest file (or split-off test) goes out first."""

  def __init__(self, config, log=None):
    super().__init__(config, log)
    self._costs = load_costs()

  def _split_scope(self, nodeid: str) -> str:
    path = file_of(nodeid)
    return SPLIT[path](nodeid) if path in SPLIT else path

  def _cost(self, scope: str) -> float:
    if scope in self._costs:  # A file, or a part measured apart.
      return self._costs[scope]
    path = file_of(scope)
    if path not in self._costs:
      return len(self.workqueue[scope]) * SECONDS_PER_UNMEASURED_TEST
    if path in SPLIT:  # The file's seconds, shared by its tests.
      return self._costs[path] * len(self.workqueue[scope]) / self._tests[path]
    return self._costs[path]

  def _assign_work_unit(self, node) -> None:
    if not hasattr(self, '_tests'):  # The first call: all is queued.
      self._tests: dict[str, int] = {}
      for scope, tests in self.workqueue.items():
        path = file_of(scope)
        self._tests[path] = self._tests.get(path, 0) + len(tests)
    dearest = max(self.workqueue, key=self._cost)
    self.workqueue.move_to_end(dearest, last=False)
    super()._assign_work_unit(node)
