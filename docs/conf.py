"""Sphinx configuration of the flax_dtensor docs.

Build (warnings are errors in CI)::

  python -m sphinx -W --keep-going -b html docs docs/_build/html
  python -m sphinx -W --keep-going -b doctest docs docs/_build/doctest

The notebooks in ``notebooks/`` are copied into ``docs/notebooks/`` and
executed by myst-nb on every build (``NB_EXECUTION_MODE=off`` skips that for
a quick local build). ``ext/coverage_check.py`` fails the build when a name
in ``flax_dtensor.__all__`` or ``flax_dtensor.dtensor.__all__`` is not
documented.
"""

import doctest
import os
import pathlib
import re
import shutil
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS / 'ext'))
sys.path.insert(0, str(ROOT))

# 8 virtual CPU devices for the doctests, before JAX starts its backend.
_FLAG = '--xla_force_host_platform_device_count=8'
if _FLAG not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = f'{os.environ.get("XLA_FLAGS", "")} {_FLAG}'.strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import jax  # noqa: E402

jax.config.update('jax_num_cpu_devices', 8)

import flax_dtensor  # noqa: E402

project = 'flax_dtensor'
author = 'flax_dtensor maintainers'
copyright = '2026, flax_dtensor maintainers'
release = flax_dtensor.__version__
version = release

extensions = [
  'sphinx.ext.autodoc',
  'sphinx.ext.autosummary',
  'sphinx.ext.napoleon',
  'sphinx.ext.doctest',
  'sphinx.ext.viewcode',
  'myst_nb',
  'coverage_check',
  'docstring_fixes',
  'benchmarks',
  'sphinxcontrib.mermaid',
]

source_suffix = {'.rst': 'restructuredtext', '.md': 'myst-nb'}
exclude_patterns = [
  '_build',
  'Thumbs.db',
  '.DS_Store',
  'ext',
  'jupyter_execute',
  '_generated',
]
root_doc = 'index'
default_role = 'py:obj'

# autodoc / autosummary / napoleon: Google-style docstrings.
autosummary_generate = False
autodoc_typehints = 'description'
autodoc_typehints_format = 'short'
autodoc_member_order = 'bysource'
autodoc_default_options = {'show-inheritance': False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # Dataclass fields once, as a field list.
napoleon_attr_annotations = True
# Type annotations name many third-party types (jax.Array, nnx.Module, TF
# types) that have no local target; intersphinx would need the network.
nitpicky = False

# myst / myst-nb.
myst_enable_extensions = ['colon_fence', 'deflist']
myst_heading_anchors = 3
nb_execution_mode = os.environ.get('NB_EXECUTION_MODE', 'force')
nb_execution_timeout = 300
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True
nb_execution_excludepatterns = []
# The architecture diagram is drawn by mermaid.js in the reader's browser.
# DOCS_MERMAID_JS points to a local copy for offline builds (screenshots).
if os.environ.get('DOCS_MERMAID_JS'):
  mermaid_use_local = os.environ['DOCS_MERMAID_JS']

# Anything a notebook prints to stderr is removed from the page and warned
# about, so the -W build fails on noise (flax_dtensor drops TF's start-up
# lines itself, on every CPU).
nb_output_stderr = 'remove-warn'

# Doctests run without the module's globals: give every example the public
# names (some examples in flax_dtensor.dtensor call them unqualified).
doctest_global_setup = """
import jax
from flax import nnx
import flax_dtensor as fdt
from flax_dtensor.dtensor import *
"""

html_theme = 'sphinx_book_theme'
html_title = 'flax_dtensor'
html_theme_options = {'show_toc_level': 2}
html_static_path = ['_static']
html_css_files = ['custom.css']

suppress_warnings = ['mystnb.unknown_mime_type']


def _copy_notebooks() -> None:
  """Copies notebooks/*.ipynb into docs/notebooks/ (a build artefact)."""
  target = DOCS / 'notebooks'
  if target.exists():
    shutil.rmtree(target)
  target.mkdir()
  for notebook in sorted((ROOT / 'notebooks').glob('*.ipynb')):
    shutil.copy2(notebook, target / notebook.name)


_copy_notebooks()


def _execute_notebooks_for_html_only(app) -> None:
  # The notebooks are executed for the HTML pages; the doctest builder only
  # needs the docstrings, not the notebooks' outputs.
  if app.builder.name != 'html':
    app.config.nb_execution_mode = 'off'


# A page links a notebook's MyST pair in the repository, as the README does
# (`../notebooks/NAME.md`, which opens on GitHub too); the docs build links
# the notebook's page (its copy, `notebooks/NAME.ipynb`) instead.
_NOTEBOOK_LINK = re.compile(r'\]\(\.\./notebooks/([\w-]+)\.md([#)])')


def notebook_links(text: str) -> str:
  """`text` with its links to notebooks' MyST pairs made links to their
  pages in the docs."""
  return _NOTEBOOK_LINK.sub(r'](notebooks/\1.ipynb\2', text)


def _link_notebook_pages(app, docname, source) -> None:
  source[0] = notebook_links(source[0])


def setup(app) -> None:
  # Before myst-nb reads its configuration (also on builder-inited).
  app.connect('builder-inited', _execute_notebooks_for_html_only, priority=1)
  app.connect('source-read', _link_notebook_pages)


# The docstring examples run under the same flags as tests/docs/doctest_test.py
# (wrapped expected output compares equal to one long line).
doctest_default_flags = (
  doctest.ELLIPSIS
  | doctest.IGNORE_EXCEPTION_DETAIL
  | doctest.DONT_ACCEPT_TRUE_FOR_1
  | doctest.NORMALIZE_WHITESPACE
)
