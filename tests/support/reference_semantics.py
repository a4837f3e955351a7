"""A small, obviously correct reference of the two rules semantics.

Written plainly from the concepts page, independent of the package's code,
so that property tests can compare the package against it.
"""

import math
import re


class Invalid(Exception):
  """The semantics say this resolution is an error."""


def axes_of(target):
  if target is None:
    return ()
  return (target,) if isinstance(target, str) else tuple(target)


def flax_dtensor(axes, shape, rules, sizes, *, unknown='error', strict=False):
  """flax_dtensor's semantics: priority, fallbacks, mesh and shape checks.

  Args:
    axes: One logical name (or None) per dimension; fewer: the rest None.
    shape: The dims, or None (no divisibility check).
    rules: (name, target) pairs; a target is a str, a tuple or None.
    sizes: {mesh axis: size}, or None (no existence check).
    unknown: 'error' or 'replicate'.
    strict: Raise when every candidate of a dimension was skipped.
  """
  axes = _padded(axes, shape)
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


def _padded(axes, shape):
  """Fewer names than dimensions: the missing trailing ones are None (as a
  PartitionSpec reads them); more is an error."""
  if shape is None:
    return tuple(axes)
  if len(axes) > len(shape):
    raise Invalid('more logical names than dimensions')
  return tuple(axes) + (None,) * (len(shape) - len(axes))


def flax(axes, shape, context, local, sizes):
  """Flax NNX's semantics: a dict, last write wins, names pass through."""
  axes = _padded(axes, shape)
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


def path_rule_placement(
  path,
  kind,
  annotation,
  shape,
  itemsize,
  path_rules,
  logical_rules,
  sizes,
  *,
  min_size=0,
  min_bytes=0,
  unknown='error',
):
  """Path rules, as the path rules page states them.

  Args:
    path: The '/'-joined path.
    kind: The variable's type name ('Param', 'BatchStat', ...), or None for
      a plain array.
    annotation: Its logical axes, or None.
    shape: Its shape.
    itemsize: Bytes per element.
    path_rules: (pattern, target, type name or None, override) tuples; a
      target is ('logical', entries, leading), ('mesh', entries, leading)
      or ('replicate',).
    logical_rules: (name, target) pairs.
    sizes: {mesh axis: size}.
    min_size: Path rules leave arrays of fewer elements alone.
    min_bytes: Path rules leave arrays of fewer bytes alone.
    unknown: The logical rules' option for names no rule mentions.

  Returns:
    (source, targets): source is 'annotation', the index of the path rule,
    or None (nothing covers it; targets None too).
  """
  rule = None
  small = (
    len(shape) == 0
    or math.prod(shape) < min_size
    or math.prod(shape) * itemsize < min_bytes
  )
  if not small:
    for k, (pattern, target, type_name, override) in enumerate(path_rules):
      # A type filter matches that type; 'Variable' (the base) every type.
      if type_name is not None and kind is None:
        continue
      if type_name not in (None, 'Variable', kind):
        continue
      if re.search(pattern, path):
        rule = (k, target, override)
        break
  if rule is not None and (annotation is None or rule[2]):
    k, target, _ = rule
    if target[0] == 'replicate':
      return k, (None,) * len(shape)
    _, entries, leading = target
    if len(entries) > len(shape) or (not leading and len(entries) < len(shape)):
      raise Invalid('the target does not fit the rank')
    entries = (None,) * (len(shape) - len(entries)) + tuple(entries)
    if target[0] == 'logical':
      return k, flax_dtensor(
        entries, shape, logical_rules, sizes, unknown=unknown
      )
    out, taken = [], set()
    for entry, n in zip(entries, shape, strict=True):
      wanted = axes_of(entry)
      fits = (
        all(m in sizes for m in wanted)
        and not any(m in taken for m in wanted)
        and n % math.prod(sizes[m] for m in wanted) == 0
      )
      out.append(entry if fits else None)
      if fits:
        taken.update(wanted)
    return k, tuple(out)
  if annotation is not None:
    return 'annotation', flax_dtensor(
      annotation, shape, logical_rules, sizes, unknown=unknown
    )
  return None, None
