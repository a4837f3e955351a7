"""The architecture holds: imports run downwards, no cycles, one TF door.

The layering the docs' architecture page describes, checked on the source:
the core (``flax_dtensor/_*.py``) never imports the TensorFlow bridge, the
command line or the demo; the bridge never imports the command line; inside
the bridge, its rooms (``_layout``, ``_conversion``, ``_format``,
``_storage``, ``_checkpoints``, ``_serving``) import only
downwards and the helpers beside them import no room; only
``dtensor/_tf.py`` imports TensorFlow; the modules' imports of each other
form no cycle; and the plan's data model imports none of its views.
"""

import ast
import pathlib

import pytest

import flax_dtensor

PACKAGE = pathlib.Path(flax_dtensor.__file__).parent


def _module_name(path):
  parts = path.relative_to(PACKAGE.parent).with_suffix('').parts
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def _imports(*, type_checking=False, late=True):
  """{module: set of modules it imports (all of them, lazy ones too)}.

  Imports under `if TYPE_CHECKING:` count only with `type_checking`; those
  inside a function (late imports) only with `late`.
  """
  graph = {}
  for path in sorted(PACKAGE.rglob('*.py')):
    name = _module_name(path)
    package = name if path.name == '__init__.py' else name.rpartition('.')[0]
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      # Imports for type checking only (`if TYPE_CHECKING:`) are not run.
      if (
        not type_checking
        and isinstance(node, ast.If)
        and 'TYPE_CHECKING' in ast.unparse(node.test)
      ):
        node.body = []
      if not late and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        node.body = []
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        found.update(a.name for a in node.names)
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ''
        if node.level:
          base = '.'.join(
            package.split('.')[: len(package.split('.')) - node.level + 1]
            + ([base] if base else [])
          )
        found.add(base)
        found.update(f'{base}.{a.name}' for a in node.names)
    graph[name] = found
  # `from package import module` imports the module; the package's own
  # __init__ only in that it runs first (not an edge of the layering).
  for name, found in graph.items():
    graph[name] = {
      m
      for m in found
      if not any(
        other.startswith(m + '.') and other in graph for other in found
      )
    } | {m for m in found if m not in graph}
  return graph


GRAPH = _imports()
MODULES = set(GRAPH)


def _internal(imported):
  return {m for m in imported if m in MODULES}


def test_the_core_imports_neither_the_bridge_nor_the_cli():
  for module, imported in GRAPH.items():
    is_core = module == 'flax_dtensor' or (
      module.startswith('flax_dtensor._') and module != 'flax_dtensor.__main__'
    )
    if not is_core:
      continue
    bad = {
      m
      for m in imported
      if m.startswith(('flax_dtensor.dtensor', 'flax_dtensor.cli'))
      or m.startswith('flax_dtensor.demo')
    }
    assert not bad, (module, bad)


def test_the_bridge_does_not_import_the_cli_or_the_demo():
  for module, imported in GRAPH.items():
    if module.startswith('flax_dtensor.dtensor'):
      bad = {
        m
        for m in imported
        if m.startswith(('flax_dtensor.cli', 'flax_dtensor.demo'))
      }
      assert not bad, (module, bad)


def test_only_one_module_imports_tensorflow():
  importers = {
    module
    for module, imported in GRAPH.items()
    if any(m == 'tensorflow' or m.startswith('tensorflow.') for m in imported)
  }
  # The bridge's one door, and the demo's verify script: a program run in a
  # TF-only subprocess, held as text.
  assert importers == {'flax_dtensor.dtensor._tf'}, importers


# The plan's data model reaches its views by late imports, from inside the
# methods that render it; its module imports none of them (checked below).
PLAN = 'flax_dtensor._planning._plan'
PLAN_VIEWS = {
  'flax_dtensor._planning._plan_view',
  'flax_dtensor._planning._plan_html',
  'flax_dtensor._planning._plan_blocks',
  'flax_dtensor._planning._plan_chart',
  'flax_dtensor._planning._plan_diff',
}


def _find_cycle(graph, *, late_views=False):
  """Raises AssertionError naming a cycle of `graph`'s internal imports.

  With `late_views`, the plan's late imports of its views are no edges.
  """
  edges = {
    m: _internal(imported) - {m} - {'flax_dtensor'}
    for m, imported in graph.items()
  }
  if late_views and PLAN in edges:
    edges[PLAN] -= PLAN_VIEWS
  # A package's __init__ importing its own modules is re-exporting, not a
  # cycle: drop the edges from packages to their children.
  for m in edges:
    if (PACKAGE.parent / m.replace('.', '/') / '__init__.py').exists():
      edges[m] = {c for c in edges[m] if not c.startswith(m + '.')}
  done, active = set(), []

  def visit(node):
    if node in active:
      cycle = [*active[active.index(node) :], node]
      raise AssertionError(' -> '.join(cycle))
    if node in done:
      return
    active.append(node)
    for child in sorted(edges.get(node, ())):
      visit(child)
    active.pop()
    done.add(node)

  for node in sorted(edges):
    visit(node)


def test_no_import_cycles():
  _find_cycle(GRAPH, late_views=True)


def test_the_plan_imports_none_of_its_views():
  """The plan's data model imports no view, not even for type checking:
  its views and its diff import it, and it reaches them by a late import
  inside a method. Counting `TYPE_CHECKING` imports too, the planning
  modules form no cycle."""
  graph = _imports(type_checking=True, late=False)
  assert not _internal(graph[PLAN]) & PLAN_VIEWS, graph[PLAN]
  for view in PLAN_VIEWS:
    assert PLAN in graph[view], view
  planning = {
    m: imported
    for m, imported in graph.items()
    if m.startswith('flax_dtensor._planning')
  }
  _find_cycle(planning)


def test_the_cycle_check_catches_a_cycle():
  """A cycle through the plan's model and a view fails the check, unless it
  is the model's late import of the view."""
  view = 'flax_dtensor._planning._plan_view'
  graph = {PLAN: {view}, view: {PLAN}}
  with pytest.raises(AssertionError, match=r'_plan -> .*_plan_view -> .*_plan'):
    _find_cycle(graph)
  _find_cycle(graph, late_views=True)


def _lazy_namespace(init: pathlib.Path, package: str = ''):
  """(the stub's names, module-level imports) of a lazy package: its
  ``__init__.pyi`` read as type checkers read it, {name: module relative to
  `package`}, and the modules its ``__init__.py`` imports."""
  typed = {}
  stub = init.with_suffix('.pyi')
  if stub.exists():
    for node in ast.parse(stub.read_text()).body:
      if isinstance(node, ast.ImportFrom):
        for alias in node.names:
          assert alias.asname == alias.name, ast.unparse(node)
          typed[alias.name] = node.module.removeprefix(package + '.')
  eager = set()
  for node in ast.parse(init.read_text()).body:
    if isinstance(node, ast.Import):
      eager.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      eager.update(f'{node.module}.{a.name}' for a in node.names)
  return typed, eager


def test_the_namespaces_are_lazy_and_say_what_they_hand_out():
  """`import flax_dtensor` and `import flax_dtensor.dtensor` run no import
  of the package's modules (nor of JAX or Flax); what type checkers see
  (the stub's imports) is what `__getattr__` hands out."""
  import flax_dtensor.dtensor as bridge

  for package in (flax_dtensor, bridge):
    init = pathlib.Path(package.__file__)
    typed, eager = _lazy_namespace(init, package.__name__)
    assert eager <= {'flax_dtensor._lazy'}, (init, eager)
    assert typed == package._MODULES, init
    assert set(typed) == set(package.__all__), init
  # The one module they import imports only the standard library.
  _, eager = _lazy_namespace(
    pathlib.Path(flax_dtensor.__file__).parent / '_lazy.py'
  )
  assert {m.partition('.')[0] for m in eager} <= {
    '__future__',
    'ast',
    'collections',
    'importlib',
    'os',
    'typing',
  }, eager


# The layers, lowest first: a module imports only from its own layer or
# below (outside `if TYPE_CHECKING:`). Below them all, the package's own
# utilities (`_errors`, `_compat`, `_interrupts`, `_output`, `_text`).
# The demo sits below the command line that runs it; the command line's
# output folder (`cli._run_folder`), which the demo writes too, sits below
# the demo (importing it runs `cli/__init__.py`, which imports nothing). Above them all, the lazy namespaces
# (the packages' `__init__` and `_lazy`, which installs the hook when a name
# is first used).
NAMESPACE = {'flax_dtensor', 'flax_dtensor._lazy'}
LAYERS = (
  ('flax_dtensor._rules',),
  ('flax_dtensor._placement',),
  ('flax_dtensor._hook',),
  ('flax_dtensor._planning',),
  ('flax_dtensor.dtensor',),
  ('flax_dtensor.cli._run_folder',),
  ('flax_dtensor.demo',),
  ('flax_dtensor.cli', 'flax_dtensor.__main__'),
)
UTILITIES = {
  'flax_dtensor._errors',
  'flax_dtensor._compat',
  'flax_dtensor._interrupts',
  'flax_dtensor._output',
  'flax_dtensor._text',
}


def _layer(module):
  if module in UTILITIES:
    return -1
  for i, prefixes in enumerate(LAYERS):
    if any(module == p or module.startswith(p + '.') for p in prefixes):
      return i
  return None


def test_every_module_is_in_a_layer():
  loose = {m for m in MODULES if m not in NAMESPACE and _layer(m) is None}
  assert not loose, loose


def test_imports_run_downwards_through_the_layers():
  upward = []
  for module, imported in GRAPH.items():
    if module in NAMESPACE:
      continue
    for target in _internal(imported) - NAMESPACE:
      if _layer(target) > _layer(module):
        upward.append(f'{module} -> {target}')
  assert not upward, upward


def test_the_root_holds_few_modules():
  """The core's modules live in its three families; the root keeps the
  namespace and the utilities everything uses."""
  root = {
    p.stem
    for p in PACKAGE.glob('*.py')
    if p.stem not in ('__init__', '__main__')
  }
  assert root == {m.rpartition('.')[2] for m in UTILITIES | {'_lazy'}}, root


# The bridge's rooms, lowest first: a module of one imports the bridge only
# from its own room or those below, and from the helpers beside them (the
# processes, the one TF door, the errors), which import no room.
BRIDGE = 'flax_dtensor.dtensor'
BRIDGE_HELPERS = {
  f'{BRIDGE}._errors',
  f'{BRIDGE}._processes',
  f'{BRIDGE}._tf',
  f'{BRIDGE}._tf_errors',
}
BRIDGE_ROOMS = tuple(
  f'{BRIDGE}.{room}'
  for room in (
    '_layout',  # JAX arrays and TF layouts, in memory
    '_conversion',  # an NNX state and TF variables
    '_format',  # what an export holds on disk
    '_storage',  # bytes to disk and back, atomically
    '_checkpoints',  # the save, restore and manager users call
    '_serving',  # SavedModels
  )
)


def _room(module):
  """The index of the bridge's room `module` is in; -1 for a helper."""
  if module in BRIDGE_HELPERS:
    return -1
  for i, room in enumerate(BRIDGE_ROOMS):
    if module == room or module.startswith(room + '.'):
      return i
  return None


def test_the_bridge_keeps_few_modules_beside_its_rooms():
  bridge = PACKAGE / 'dtensor'
  top = {p.stem for p in bridge.glob('*.py')}
  assert top == {'__init__'} | {m.rpartition('.')[2] for m in BRIDGE_HELPERS}
  assert len(top) <= 8, top
  rooms = {p.name for p in bridge.iterdir() if (p / '__init__.py').exists()}
  assert rooms == {r.rpartition('.')[2] for r in BRIDGE_ROOMS}, rooms
  loose = {
    m for m in MODULES if m.startswith(BRIDGE + '.') and _room(m) is None
  }
  assert not loose, loose


def test_each_room_says_what_it_holds_and_may_import():
  import importlib

  for i, room in enumerate(BRIDGE_ROOMS):
    doc = importlib.import_module(room).__doc__
    assert doc, room
    held = {m.rpartition('.')[2] for m in MODULES if m.startswith(room + '.')}
    assert all(f'`{m}`' in doc for m in held), (room, held)
    may = doc.partition('May import:')[2]
    assert may, room
    below = [r.rpartition('.')[2] for r in BRIDGE_ROOMS[:i]]
    assert all(f'`dtensor.{r}`' in may for r in below), (room, below)


def _bridge_imports_upward(graph):
  upward = []
  for module, imported in graph.items():
    if not module.startswith(BRIDGE + '.'):
      continue
    for target in _internal(imported):
      if not target.startswith(BRIDGE + '.') or target in BRIDGE_ROOMS:
        continue
      if _room(target) > _room(module) or (
        module in BRIDGE_HELPERS and target not in BRIDGE_HELPERS
      ):
        upward.append(f'{module} -> {target}')
  return upward


def test_the_bridge_imports_run_downwards_through_its_rooms():
  """`_layout` imports only the helpers (and the core), each room above
  it also the rooms below it; the helpers import no room."""
  assert not _bridge_imports_upward(GRAPH), _bridge_imports_upward(GRAPH)


def test_the_room_check_catches_an_upward_import():
  """The check above fails on each kind of import it forbids."""
  bad = {
    f'{BRIDGE}._layout._arrays': {f'{BRIDGE}._format._decode'},
    f'{BRIDGE}._checkpoints._restore': {f'{BRIDGE}._serving._signature'},
    f'{BRIDGE}._storage._atomic': {f'{BRIDGE}._checkpoints._manager'},
    f'{BRIDGE}._tf_errors': {f'{BRIDGE}._conversion._names'},
    f'{BRIDGE}._serving._signature': {f'{BRIDGE}._format._decode'},
  }
  assert sorted(_bridge_imports_upward(bad)) == [
    f'{BRIDGE}._checkpoints._restore -> {BRIDGE}._serving._signature',
    f'{BRIDGE}._layout._arrays -> {BRIDGE}._format._decode',
    f'{BRIDGE}._storage._atomic -> {BRIDGE}._checkpoints._manager',
    f'{BRIDGE}._tf_errors -> {BRIDGE}._conversion._names',
  ]


# The atomic layer: atomic directories, the temporaries beside them, their
# recovery, and where an export may be written.
ATOMIC_LAYER = (
  f'{BRIDGE}._storage._atomic',
  f'{BRIDGE}._storage._recovery',
  f'{BRIDGE}._storage._temporaries',
  f'{BRIDGE}._storage._writable',
)


@pytest.mark.parametrize('module', ATOMIC_LAYER)
def test_the_atomic_layer_knows_no_export_format(module):
  """The atomic layer writes directories atomically and knows nothing of
  what an export holds: the format's layer passes what it must know
  (`is_export`), so each of its modules imports no other module of its
  room but the layer's own (not the manifest, what writes or reads one)
  and nothing of serving."""
  imported = _internal(GRAPH[module])
  format_layer = {
    m
    for m in imported
    if m.startswith(
      (
        f'{BRIDGE}._format',
        f'{BRIDGE}._storage.',
        f'{BRIDGE}._checkpoints',
        f'{BRIDGE}._serving',
      )
    )
    and m not in ATOMIC_LAYER
  }
  assert not format_layer, format_layer
