"""Lazy public namespaces: a name's module is imported on its first use.

`flax_dtensor` and `flax_dtensor.dtensor` each list their public names once,
in the stub beside their ``__init__.py`` (``__init__.pyi``), one line a name:
``from flax_dtensor._placement._trees import shard_tree as shard_tree``.
Type checkers and IDEs read that stub (PEP 561: a stub wins over the
``.py``), and `namespace` parses it once per process into the table
{name: module} that gives the package its ``__all__``, ``__dir__`` and its
PEP 562 ``__getattr__``. One file, read by both, so what type checkers see
and what ``getattr`` hands out cannot differ, and a name is added in one
place. (The alternative, a table in ``__init__.py`` beside an
``if TYPE_CHECKING:`` block of the same imports, spells each name three
times and needs a test to keep the two in step.) The parse uses `ast`,
which the command line (through its libraries) and JAX import anyway.

The first name used installs the Flax hook (`_hook._install.ensure_installed`; not
for the exception classes, which an ``except`` clause must reach even where
the hook refuses the installed Flax), then imports only its own module, so
`import flax_dtensor` stays cheap and imports neither JAX nor TensorFlow.
"""

from __future__ import annotations

import ast
import importlib
import os
from collections.abc import Callable, MutableMapping
from typing import Any

ERRORS_MODULE = '_errors'
"""The module of a namespace's exception classes: handed out hook-free."""


def public_names(stub: str, package: str) -> dict[str, str]:
  """{public name: its module, relative to `package`}, from a stub's text.

  Each top-level ``from PACKAGE.MODULE import NAME as NAME`` is one name;
  other statements (``__version__: str``) are not names of the table.

  Raises:
    ImportError: If an import of the stub re-exports under another name, or
      from outside `package` (the stub then says something the lazy
      namespace cannot hand out).
  """
  names = {}
  for node in ast.parse(stub).body:
    if not isinstance(node, ast.ImportFrom):
      continue
    module = node.module or ''
    where = f'line {node.lineno}: {ast.unparse(node)!r}'
    if node.level or not module.startswith(package + '.'):
      raise ImportError(
        f'Expected the stub of {package!r} to import from {package}.*, got '
        f'{where}. Name the defining module absolutely.'
      )
    for alias in node.names:
      if alias.asname != alias.name:
        raise ImportError(
          f'Expected the stub of {package!r} to re-export each name as '
          f'itself (`import NAME as NAME`), got {where}.'
        )
      names[alias.name] = module.removeprefix(package + '.')
  return names


def namespace(
  package: str, init_file: str, globals_: MutableMapping[str, Any]
) -> tuple[tuple[str, ...], Callable[[str], Any], Callable[[], list[str]]]:
  """``(__all__, __getattr__, __dir__)`` of `package`, from its stub.

  Args:
    package: The package's ``__name__``.
    init_file: Its ``__file__``; the stub is the ``.pyi`` beside it.
    globals_: The package's ``globals()``, where a name is kept once loaded
      (and the table, as ``_MODULES``, for the architecture test).
  """
  with open(os.path.splitext(init_file)[0] + '.pyi', encoding='utf-8') as f:
    modules = public_names(f.read(), package)
  all_ = tuple(sorted(modules))
  extra = tuple(n for n in ('__version__',) if n in globals_)
  listed = sorted((*all_, *extra))

  def __getattr__(name: str) -> Any:
    """Imports a public name on first use, the Flax hook installed first."""
    module = modules.get(name)
    if module is None:
      raise AttributeError(f'module {package!r} has no attribute {name!r}')
    if module != ERRORS_MODULE:  # Errors need no Flax: `except` always works.
      from flax_dtensor._hook import _install

      _install.ensure_installed()
    value = getattr(importlib.import_module(f'{package}.{module}'), name)
    globals_[name] = value
    return value

  def __dir__() -> list[str]:
    return list(listed)

  globals_['_MODULES'] = modules
  return all_, __getattr__, __dir__
