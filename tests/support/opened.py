"""What Python opens: an audit hook (installed once, for good, when this
module is first imported) records the real paths opened inside
`recording`; `assert_inside` checks that they stay in a folder."""

import contextlib
import os
import sys

_recording: list[str] | None = None  # None: not recording.


def _audit(event, args):
  if _recording is not None and event == 'open' and args:
    path = args[0]
    if isinstance(path, str | bytes | os.PathLike):
      _recording.append(os.path.realpath(os.fsdecode(path)))


sys.addaudithook(_audit)


@contextlib.contextmanager
def recording():
  """Yields a list of the real paths Python opens inside the block."""
  global _recording
  _recording = paths = []
  try:
    yield paths
  finally:
    _recording = None


def is_recording() -> bool:
  return _recording is not None


def assert_inside(paths, base, root) -> None:
  """Asserts that nothing of `paths` under `base` is outside `root`."""
  top = os.path.realpath(base) + os.sep
  inside = os.path.realpath(root) + os.sep
  for path in paths:
    if path.startswith(top):
      assert path.startswith(inside), f'opened {path} outside {root}'
