"""Presets: path rules for known naming conventions, and their recognition.

A preset is a YAML file in ``flax_dtensor/presets/``, in the ``path_rules:``
form `LogicalRules.from_yaml` reads, with a ``preset:`` header naming it
and the path components that recognise it. Its targets are logical axes
(``embed``, ``heads``, ``kv_heads``, ``mlp``, ``vocab``), mapped to a mesh
by `fdt.suggest_rules`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
from collections.abc import Iterable, Sequence
from typing import Any

import yaml

from flax_dtensor import _errors
from flax_dtensor._rules import _logical, _path_rules

GENERIC = 'generic'
"""The `style` that asks for the generic proposal, whatever the paths."""


@dataclasses.dataclass(frozen=True)
class Preset:
  """One preset file.

  Attributes:
    name: Its name (the `style` that asks for it), e.g. ``'hf_llama'``.
    description: What models it is for.
    recognise: Path components that recognise it, each a name or a tuple
      of names of which any one will do; all must appear.
    rules: Its path rules, in order.
    file: The file's name in the package.
  """

  name: str
  description: str
  recognise: tuple[tuple[str, ...], ...]
  rules: tuple[_path_rules.PathRule, ...]
  file: str

  def missing(self, components: Iterable[str]) -> list[str]:
    """The requirements `components` do not meet, as text ('q_proj',
    '(embed_tokens or lm_head)'); empty when recognised."""
    have = set(components)
    return [
      _requirement_text(names)
      for names in self.recognise
      if not have.intersection(names)
    ]

  def requirements(self) -> str:
    """'q_proj + gate_proj + (embed_tokens or lm_head)'."""
    return ' + '.join(_requirement_text(names) for names in self.recognise)


def _requirement_text(names: Sequence[str]) -> str:
  return names[0] if len(names) == 1 else f'({" or ".join(names)})'


def _read(file: str, text: str) -> Preset:
  document = yaml.safe_load(text)
  header = document['preset']
  rules = _logical.LogicalRules.from_yaml_text(text)
  return Preset(
    name=str(header['name']),
    description=str(header['description']),
    recognise=tuple(
      (item,) if isinstance(item, str) else tuple(item)
      for item in header['recognise']
    ),
    rules=rules.path_rules,
    file=file,
  )


@functools.cache
def presets() -> tuple[Preset, ...]:
  """Every preset shipped in the package, by file name."""
  folder = importlib.resources.files('flax_dtensor') / 'presets'
  return tuple(
    _read(entry.name, entry.read_text())
    for entry in sorted(folder.iterdir(), key=lambda e: e.name)
    if entry.name.endswith('.yaml')
  )


def names() -> tuple[str, ...]:
  """The presets' names, and 'generic': what `style` may be."""
  return (*(p.name for p in presets()), GENERIC)


def by_style(style: Any) -> Preset | None:
  """The preset `style` names; None for 'generic'.

  Raises:
    LogicalRulesError: If `style` names no preset.
  """
  if style == GENERIC:
    return None
  for preset in presets():
    if preset.name == style:
      return preset
  raise _errors.LogicalRulesError(
    f'`style` must be None (recognise the naming convention from the '
    f'paths) or one of {list(names())}; got {style!r}.'
  )


def recognise(paths: Iterable[str]) -> tuple[Preset | None, str]:
  """The preset whose naming convention the paths follow, and why.

  A preset is recognised when every one of its requirements names a path
  component. When several are, the one that recognises more components
  wins (then the first by name).
  """
  components = {part for path in paths for part in path.split('/')}
  found = [p for p in presets() if not p.missing(components)]
  if not found:
    looked = '; '.join(
      f'{p.name} needs {p.requirements()} (missing '
      f'{", ".join(p.missing(components))})'
      for p in presets()
    )
    return None, f'no preset recognised: {looked}'
  best = max(
    found,
    key=lambda p: sum(
      len(components.intersection(names)) for names in p.recognise
    ),
  )
  return best, (
    f'recognised {best.name} ({best.description}): the paths name '
    f'{best.requirements()}'
  )
