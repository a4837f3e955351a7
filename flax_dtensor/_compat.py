"""The JAX and Flax releases flax_dtensor supports, checked at first use.

`SUPPORTED` is the range each library must be in, the same as the pins in
``pyproject.toml`` (a test keeps the two equal). `check_versions` runs once
per process, before the hook goes into Flax (`_hook._install.ensure_installed`): a
release outside the range is refused in our words, before anything of it is
wrapped. A release inside it is also probed (`_hook._install.check_routing`), so
that a change in Flax that the range did not foresee still fails loudly.
"""

from __future__ import annotations

import os
import re

from flax_dtensor import _errors

# {distribution: (lowest supported release, first release not supported)}.
SUPPORTED = {
  'jax': ('0.10.2', '0.13'),
  'flax': ('0.12.8', '0.13'),
}

# Set to 1 to try a release outside `SUPPORTED` (the routing probe still runs).
SKIP_ENV = 'FLAX_DTENSOR_SKIP_VERSION_CHECK'

_RELEASE = re.compile(r'(\d+(?:\.\d+)*)(.*)')


def release(version: str) -> tuple[tuple[int, ...], bool]:
  """('0.12.0.1', ...) -> ((0, 12, 0, 1), False); pre-releases say True.

  A development or pre-release (``0.13.0.dev20261120``, ``0.13.0rc1``)
  counts as its release for the upper bound: it is refused as 0.13 is.
  """
  match = _RELEASE.match(version.strip())
  if match is None:
    return (), False
  parts = tuple(int(p) for p in match[1].split('.'))
  return parts, bool(match[2].strip('+').split('+')[0])


def _trimmed(parts: tuple[int, ...]) -> tuple[int, ...]:
  while parts and parts[-1] == 0:
    parts = parts[:-1]
  return parts


def is_supported(name: str, version: str) -> bool:
  """Whether `version` of `name` lies in its `SUPPORTED` range."""
  low, high = (_trimmed(release(v)[0]) for v in SUPPORTED[name])
  parts, pre = release(version)
  parts = _trimmed(parts)
  if not parts:
    return False
  if pre and parts == low:  # 0.10.2rc1 comes before 0.10.2.
    return False
  return low <= parts < high


def check_versions(versions: dict[str, str]) -> None:
  """Refuses a JAX or Flax release outside `SUPPORTED`.

  Args:
    versions: Each library's installed version, e.g. ``{'jax':
      jax.__version__, 'flax': flax.__version__}``.

  Raises:
    FlaxCompatibilityError: If one lies outside its range (unless the
      environment variable ``FLAX_DTENSOR_SKIP_VERSION_CHECK=1`` is set).
  """
  if os.environ.get(SKIP_ENV) == '1':
    return
  wrong = [
    (name, found)
    for name, found in versions.items()
    if not is_supported(name, found)
  ]
  if not wrong:
    return
  found = ', '.join(f'{name} {version}' for name, version in wrong)
  wanted = ', '.join(
    f'{name}>={low},<{high}' for name, (low, high) in SUPPORTED.items()
  )
  pins = ' '.join(
    f'"{name}>={SUPPORTED[name][0]},<{SUPPORTED[name][1]}"' for name, _ in wrong
  )
  raise _errors.FlaxCompatibilityError(
    f'flax_dtensor supports {wanted}, but found {found}. Its hook wraps '
    'functions inside Flax (see docs/compatibility.md), so a release it was '
    f'not tested with could place variables wrongly without an error. '
    f'Install a supported release (pip install {pins}), or a flax_dtensor '
    f'that supports yours. To try it anyway, set {SKIP_ENV}=1 (the check '
    "that Flax still calls flax_dtensor's functions still runs)."
  )
