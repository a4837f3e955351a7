"""Hypothesis profiles: the suite's quick one, and a thorough one.

``default`` (every run): 100 examples a property, derandomized (the same
examples on every host and every run), no deadline (a busy machine is not
a bug). ``thorough``: each property's full count, random examples, for a
run that hunts for bugs rather than guards against them:

    HYPOTHESIS_PROFILE=thorough python -m pytest tests/rules tests/hook
    python -m pytest --hypothesis-profile=thorough tests/rules tests/hook

A property test writes its thorough count as ``max_examples=examples(N)``:
N under ``thorough``, at most the profile's count otherwise. Tests whose
count is part of what they check (a survey that must reach every outcome,
a planted bug that must be caught) keep a fixed count.
"""

from __future__ import annotations

import os

import hypothesis

DEFAULT = 'default'
THOROUGH = 'thorough'

hypothesis.settings.register_profile(
  DEFAULT, max_examples=100, derandomize=True, deadline=None
)
hypothesis.settings.register_profile(
  THOROUGH, max_examples=5000, derandomize=False, deadline=None
)


def load() -> None:
  """Loads $HYPOTHESIS_PROFILE (default: ``default``); ``--hypothesis-
  profile`` on pytest's command line, read after this, wins."""
  hypothesis.settings.load_profile(
    os.environ.get('HYPOTHESIS_PROFILE', DEFAULT)
  )


def examples(thorough: int) -> int:
  """`thorough` examples under the thorough profile; fewer in the suite's."""
  return min(thorough, hypothesis.settings().max_examples)
