"""Fails the docs build when a public name is not documented.

Every name in ``flax_dtensor.__all__`` and ``flax_dtensor.dtensor.__all__``
must be documented (an autodoc entry, e.g. ``.. autofunction::``, registered
in Sphinx's Python domain as ``flax_dtensor.NAME`` or
``flax_dtensor.dtensor.NAME``) and must have a docstring. The check runs
once the whole project has been read, and reports every missing name as a
warning (``-W`` makes the build fail) or, with ``coverage_check_raise =
True``, raises.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from sphinx.application import Sphinx
from sphinx.errors import ExtensionError
from sphinx.util import logging

logger = logging.getLogger(__name__)

PUBLIC_MODULES = ('flax_dtensor', 'flax_dtensor.dtensor')


def missing_names(documented: set[str]) -> list[str]:
  """Returns the public names that are undocumented or lack a docstring."""
  problems = []
  for module_name in PUBLIC_MODULES:
    module = importlib.import_module(module_name)
    for name in module.__all__:
      full = f'{module_name}.{name}'
      if full not in documented:
        problems.append(f'{full} is not in the API reference')
        continue
      obj = getattr(module, name)
      if not (inspect.getdoc(obj) or '').strip():
        problems.append(f'{full} has no docstring')
  return problems


def _check(app: Sphinx, env: Any) -> None:
  del env
  domain = app.env.get_domain('py')
  documented = {name for name, *_ in domain.get_objects()}
  problems = missing_names(documented)
  if not problems:
    logger.info('coverage_check: every public name is documented')
    return
  if app.config.coverage_check_raise:
    raise ExtensionError(
      'Undocumented public names: ' + '; '.join(problems) + '. Add them to '
      'docs/api/.'
    )
  for problem in problems:
    logger.warning(
      'coverage_check: %s; add it to docs/api/.',
      problem,
      type='coverage_check',
    )


def setup(app: Sphinx) -> dict[str, Any]:
  app.add_config_value('coverage_check_raise', False, 'env')
  app.connect('env-check-consistency', _check)
  return {'parallel_read_safe': True, 'parallel_write_safe': True}
