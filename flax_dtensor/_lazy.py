"""Lazy public namespaces: a name's module is imported on its first use.

`flax_dtensor` and `flax_dtensor.dtensor` map each public name to the
private module defining it (PEP 562). The first name used installs the
Flax hook (`_hook.ensure_installed`; not for the exception classes, which
an ``except`` clause must reach even where the hook refuses the installed
Flax), then imports only its own module, so
`import flax_dtensor` stays cheap and imports neither JAX's heavy parts nor
TensorFlow.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any


def module_getattr(
  package: str, modules: Mapping[str, str], namespace: MutableMapping[str, Any]
) -> Callable[[str], Any]:
  """The `__getattr__` of `package`, whose public names `modules` maps.

  Args:
    package: The package's `__name__`.
    modules: Each public name to the submodule (relative) that defines it.
    namespace: The package's `globals()`, where a name is kept once loaded.
  """

  def __getattr__(name: str) -> Any:
    """Imports a public name on first use, the Flax hook installed first."""
    module = modules.get(name)
    if module is None:
      raise AttributeError(f'module {package!r} has no attribute {name!r}')
    if module != '_errors':  # Errors need no Flax: `except` always works.
      from flax_dtensor._placement import _hook

      _hook.ensure_installed()
    value = getattr(importlib.import_module(f'{package}.{module}'), name)
    namespace[name] = value
    return value

  return __getattr__
