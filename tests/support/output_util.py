"""Checks of what a command prints: it fits, and nothing is cut in a word."""

import re


def assert_fits(text: str, width: int, paths=()) -> None:
  """Every line of `text` fits `width` and none ends in spaces; each of
  `paths` is printed whole, or broken only after a '/' (its next part then
  starts the next line, after indentation or a table border)."""
  for line in text.splitlines():
    assert len(line) <= width, line
    assert line == line.rstrip(), repr(line)
  joined = re.sub(r'/\n[ │]*', '/', text)
  for path in paths:
    assert str(path) in joined, (path, text)


def unwrapped(text: str) -> str:
  """`text` on one line: paths broken after a '/' joined again, and every
  other line break and run of spaces one space."""
  return ' '.join(re.sub(r'/\n[ │]*', '/', text).split())
