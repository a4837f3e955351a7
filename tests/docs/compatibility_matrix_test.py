"""docs/compatibility.md holds exactly the context matrix's generated table."""

from support import context_matrix
from support.processes import REPO_ROOT


def test_the_page_holds_the_generated_table():
  page = (REPO_ROOT / 'docs' / 'compatibility.md').read_text()
  begin = page.index(context_matrix.TABLE_BEGIN)
  end = page.index(context_matrix.TABLE_END) + len(context_matrix.TABLE_END)
  assert page[begin:end] == context_matrix.table(), (
    'docs/compatibility.md is stale: paste context_matrix.table() between '
    'its markers'
  )
