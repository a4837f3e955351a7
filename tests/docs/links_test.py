"""The pages' links open where a reader follows them: on GitHub as well.

A link in README.md or a docs page to a file of the repository must name a
committed file, relative to the page (as GitHub resolves it), never a build
artefact: `docs/notebooks/` is the docs build's copy of `notebooks/`, which
GitHub does not hold. A page links a notebook's MyST pair
(``../notebooks/NAME.md``, as the README does), and the docs build links
the notebook's page instead (docs/conf.py).
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / 'docs'
# What the docs build writes, which the repository does not hold.
ARTEFACTS = (DOCS / 'notebooks', DOCS / '_build', DOCS / '_generated')
LINK = re.compile(r'\]\(([^)\s]+)\)')
PAGES = [ROOT / 'README.md', *sorted(DOCS.glob('*.md'))]


def _local_links(page: pathlib.Path) -> list[str]:
  return [
    target.split('#')[0]
    for target in LINK.findall(page.read_text())
    if '://' not in target
    and not target.startswith(('#', 'mailto:'))
    and target.split('#')[0]
  ]


@pytest.mark.parametrize('page', PAGES, ids=lambda p: p.name)
def test_every_local_link_names_a_committed_file(page):
  for target in _local_links(page):
    path = (page.parent / target).resolve()
    assert not any(path.is_relative_to(a) for a in ARTEFACTS), (
      f'{page.name} links {target}, a build artefact GitHub does not hold'
    )
    assert path.exists(), f'{page.name} links {target}, which does not exist'


def test_the_readme_and_the_guide_link_the_same_notebooks():
  def notebooks(page):
    return {
      (page.parent / t).resolve()
      for t in _local_links(page)
      if 'notebooks/' in t
    }

  guide = notebooks(DOCS / 'getting_started.md')
  assert guide and guide == notebooks(ROOT / 'README.md')
