"""A small, obviously correct reference of the two rules semantics.

Written plainly from the concepts page, independent of the package's code,
so that property tests can compare the package against it.
"""

import math


class Invalid(Exception):
  """The semantics say this resolution is an error."""


def axes_of(target):
  if target is None:
    return ()
  return (target,) if isinstance(target, str) else tuple(target)


def flax_dtensor(axes, shape, rules, sizes, *, unknown='error', strict=False):
  """flax_dtensor's semantics: priority, fallbacks, mesh and shape checks.

  Args:
    axes: One logical name (or None) per dimension.
    shape: The dims, or None (no divisibility check).
    rules: (name, target) pairs; a target is a str, a tuple or None.
    sizes: {mesh axis: size}, or None (no existence check).
    unknown: 'error' or 'replicate'.
    strict: Raise when every candidate of a dimension was skipped.
  """
  names = [a for a in axes if a is not None]
  if len(names) != len(set(names)):
    raise Invalid('repeated name')
  mentioned = {n for n, _ in rules}
  if unknown == 'error' and any(a not in mentioned for a in names):
    raise Invalid('unknown name')
  targets = [None] * len(axes)
  done = [a is None for a in axes]
  skipped = [False] * len(axes)
  for name, target in rules:
    if name not in axes or done[axes.index(name)]:
      continue
    pos = axes.index(name)
    taken = {m for i, t in enumerate(targets) if done[i] for m in axes_of(t)}
    wanted = axes_of(target)
    if any(m in taken for m in wanted):
      skipped[pos] = True
      continue
    if sizes is not None:
      if any(m not in sizes for m in wanted):
        skipped[pos] = True
        continue
      if shape is not None and shape[pos] % math.prod(sizes[m] for m in wanted):
        skipped[pos] = True
        continue
    targets[pos], done[pos] = target, True
  if strict and any(s and not d for s, d in zip(skipped, done, strict=True)):
    raise Invalid('strict: no candidate fits')
  return tuple(targets)


def flax(axes, shape, context, local, sizes):
  """Flax NNX's semantics: a dict, last write wins, names pass through."""
  table = dict(context)
  for name, target in local:
    if name in table and table[name] != target:
      raise Invalid('inconsistent rules')
    table[name] = target
  targets = tuple(table.get(a, a) if a is not None else None for a in axes)
  used = [m for t in targets for m in axes_of(t)]
  if len(used) != len(set(used)) or any(m not in sizes for m in used):
    raise Invalid('bad mesh axes')
  for t, n in zip(targets, shape, strict=True):
    if n % math.prod(sizes[m] for m in axes_of(t)):
      raise Invalid('not divisible')
  return targets
