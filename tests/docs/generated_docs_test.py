"""The docs' generated parts are committed as the code gives them.

The troubleshooting tables and the command line's ``--help`` texts are
Markdown in the pages (so they read whole on GitHub and in a clone, not
only in the Sphinx build), between markers that `tools/generate_docs.py`
fills; a change to a command's options or to the bad-input matrix without
a rerun of it fails here.
"""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _generator():
  spec = importlib.util.spec_from_file_location(
    'generate_docs', ROOT / 'tools' / 'generate_docs.py'
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_generated_regions_match_the_code():
  generate_docs = _generator()
  pages = {p.name for p in generate_docs.pages()}
  assert pages == {'cli.md', 'troubleshooting.md'}
  assert generate_docs.stale() == [], 'run: python tools/generate_docs.py'


def test_the_pages_hold_the_text_not_a_directive():
  cli = (ROOT / 'docs' / 'cli.md').read_text()
  for command in ('demo', 'plan', 'export', 'inspect'):
    assert f'Usage: flax-dtensor {command} [OPTIONS]' in cli, command
  page = (ROOT / 'docs' / 'troubleshooting.md').read_text()
  assert '## fdt.NotAModelError' in page
  assert '| `fdt.init` |' in page or '| `flax_dtensor' in page
  assert '```{' not in cli + page  # No directive left to render.


def test_the_troubleshooting_tables_read_what_varies_as_words():
  r"""A message pattern's `\d+` reads N and its `\S+` '…', never `d+`."""
  generate_docs = _generator()
  assert generate_docs._pattern(r'(uid \d+\) for \d+ s .*bound') == (
    '(uid N) for N s … bound'
  )
  assert generate_docs._pattern(r'ckpt\.data-\S+ bytes 0\.\.\d+ changed') == (
    'ckpt.data-… bytes 0..N changed'
  )
  assert generate_docs._pattern(r"'/\S+/out' failed \(its part\)\.") == (
    "'/…/out' failed (its part)."
  )
  page = (ROOT / 'docs' / 'troubleshooting.md').read_text()
  for mangled in ('uid d+', 'for d+ s', 'ckpt.data-S+', "'/S+/out'", '\\'):
    assert mangled not in page, mangled
  assert '(this process (uid N) may not write in it' in page
  assert "Writing '/…/out' failed" in page
