"""Running text wrapped for a terminal, paths never cut inside a name."""

import re

from hypothesis import given, settings
from hypothesis import strategies as st
from support import profiles

from flax_dtensor import _text

NAME = st.text('abcxyz_.', min_size=1, max_size=24)
PATH = st.lists(NAME, min_size=1, max_size=6).map(lambda xs: '/' + '/'.join(xs))
WORD = st.one_of(NAME, PATH)


def _rejoined(lines: list[str]) -> list[str]:
  """The words again: a line ending in '/' goes on on the next one."""
  return re.sub(r'/\n *', '/', '\n'.join(lines)).split()


@settings(max_examples=profiles.examples(2000), deadline=None)
@given(
  words=st.lists(WORD, max_size=12),
  width=st.integers(8, 100),
  hanging=st.integers(0, 6),
)
def test_wrapped_words_fit_and_lose_nothing(words, width, hanging):
  lines = _text.wrap_words(' '.join(words), width, hanging=hanging)
  assert _rejoined(lines) == words
  for i, line in enumerate(lines):
    if i:
      assert line.startswith(' ' * hanging), lines
    # Over the width only for one name longer than the line, kept whole.
    if len(line) > width:
      assert re.fullmatch(r'[^/ ]*/?', line.strip()), (width, lines)


def test_a_long_first_path_keeps_its_hanging_lines_within_the_width():
  lines = _text.wrap_words('/aaaa/bbbb/cccc and more', 10, hanging=4)
  assert lines == ['/aaaa/', '    bbbb/', '    cccc', '    and', '    more']
  assert max(map(len, lines)) <= 10
