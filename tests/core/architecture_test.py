"""The architecture holds: imports run downwards, no cycles, one TF door.

The layering the docs' architecture page describes, checked on the source:
the core (``flax_dtensor/_*.py``) never imports the TensorFlow bridge, the
command line or the demo; the bridge never imports the command line; only
``dtensor/_tf.py`` imports TensorFlow; and the modules' imports of each
other form no cycle.
"""

import ast
import pathlib

import flax_dtensor

PACKAGE = pathlib.Path(flax_dtensor.__file__).parent


def _module_name(path):
  parts = path.relative_to(PACKAGE.parent).with_suffix('').parts
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def _imports():
  """{module: set of modules it imports (all of them, lazy ones too)}."""
  graph = {}
  for path in sorted(PACKAGE.rglob('*.py')):
    name = _module_name(path)
    package = name if path.name == '__init__.py' else name.rpartition('.')[0]
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      # Imports for type checking only (`if TYPE_CHECKING:`) are not run.
      if isinstance(node, ast.If) and 'TYPE_CHECKING' in ast.unparse(node.test):
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


def test_no_import_cycles():
  edges = {
    m: _internal(imported) - {m} - {'flax_dtensor'}
    for m, imported in GRAPH.items()
  }
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


def _lazy_namespace(init: pathlib.Path, package: str = ''):
  """(names imported under TYPE_CHECKING, module-level imports) of a lazy
  package's ``__init__.py``: {name: module relative to `package`}, and the
  modules it imports."""
  tree = ast.parse(init.read_text())
  typed, eager = {}, set()
  for node in tree.body:
    if isinstance(node, ast.If) and 'TYPE_CHECKING' in ast.unparse(node.test):
      for child in node.body:
        assert isinstance(child, ast.ImportFrom), ast.unparse(child)
        for alias in child.names:
          assert alias.asname == alias.name, ast.unparse(child)
          typed[alias.name] = child.module.removeprefix(package + '.')
    elif isinstance(node, ast.Import):
      eager.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      eager.update(f'{node.module}.{a.name}' for a in node.names)
  return typed, eager


def test_the_namespaces_are_lazy_and_say_what_they_hand_out():
  """`import flax_dtensor` and `import flax_dtensor.dtensor` run no import
  of the package's modules (nor of JAX or Flax); what type checkers see
  (the `TYPE_CHECKING` imports) is what `__getattr__` hands out."""
  import flax_dtensor.dtensor as bridge

  for package in (flax_dtensor, bridge):
    init = pathlib.Path(package.__file__)
    typed, eager = _lazy_namespace(init, package.__name__)
    allowed = {'__future__.annotations', 'typing.TYPE_CHECKING'}
    assert eager <= allowed | {'flax_dtensor._lazy'}, (init, eager)
    assert typed == package._MODULES, init
    assert set(typed) == set(package.__all__), init
  # The one module they import imports only the standard library.
  _, eager = _lazy_namespace(
    pathlib.Path(flax_dtensor.__file__).parent / '_lazy.py'
  )
  assert {m.partition('.')[0] for m in eager} <= {
    '__future__',
    'collections',
    'importlib',
    'typing',
  }, eager


# The layers, lowest first: a module imports only from its own layer or
# below (outside `if TYPE_CHECKING:`). Below them all, the package's own
# utilities (`_errors`, `_compat`, `_interrupts`, `_output`, `_text`).
# Above them all, the
# lazy namespaces (the packages' `__init__` and `_lazy`, which installs the
# hook when a name is first used).
NAMESPACE = {'flax_dtensor', 'flax_dtensor._lazy'}
LAYERS = (
  ('flax_dtensor._rules',),
  ('flax_dtensor._placement',),
  ('flax_dtensor._planning',),
  ('flax_dtensor.dtensor',),
  ('flax_dtensor.cli', 'flax_dtensor.demo', 'flax_dtensor.__main__'),
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


def test_the_atomic_layer_knows_no_export_format():
  """`_atomic` writes directories atomically and knows nothing of what an
  export holds: the format's layer passes what it must know (`is_export`),
  so it imports neither the manifest nor anything that writes or reads
  one."""
  format_layer = {
    'flax_dtensor.dtensor._files._manifest',
    'flax_dtensor.dtensor._files._checkpoint',
    'flax_dtensor.dtensor._files._restore',
    'flax_dtensor.dtensor._serving._saved_model',
    'flax_dtensor.dtensor._files._host_read',
    'flax_dtensor.dtensor._files._host_write',
  }
  imported = _internal(GRAPH['flax_dtensor.dtensor._files._atomic'])
  assert not imported & format_layer, imported & format_layer
