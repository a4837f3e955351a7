"""Rules in MaxText's YAML format: reading a document, writing one.

`read_file` reads a rules file, `parse` a document (with PyYAML's safe
loader, its complaints told in our words) into the pairs and options
`LogicalRules` takes, and `dump` writes rules back as YAML text that
`parse` reads. The rules type itself lives in `_logical`.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from flax_dtensor import _errors
from flax_dtensor._rules import _path_rules

FORMAT_MSG = (
  "Expected MaxText's format, e.g. logical_axis_rules: [['batch', 'data'], "
  "['embed', 'fsdp']]"
)


def read_file(path: str | os.PathLike[str]) -> tuple[str, str]:
  """The text of the rules file at `path`, and how messages name it.

  Raises:
    LogicalRulesError: If the file cannot be read.
  """
  source = os.fspath(path)
  try:
    text = pathlib.Path(source).read_text()
  except OSError as e:
    hint = (
      ' It looks like YAML text: use `LogicalRules.from_yaml_text`.'
      if '\n' in source or ':' in source
      else ''
    )
    raise _errors.LogicalRulesError(
      f'Cannot read rules file {source!r}: {e.strerror}. Expected the '
      f'path of a YAML file.{hint}'
    ) from e
  return text, repr(source)


def parse(text: str, source: str) -> tuple[Any, dict[str, Any]]:
  """The rules of a YAML document: its pairs (a list, or a mapping of each
  name to its one target) and the options it sets, for `LogicalRules`.

  Args:
    text: The YAML document.
    source: How messages name it (the file, or 'The YAML text').

  Raises:
    LogicalRulesError: If the text is not valid YAML or holds no rules.
  """
  document = _load(text, source)
  options: dict[str, Any] = {}
  if isinstance(document, Mapping):
    if 'missing_mesh_axes' in document:
      options['missing_mesh_axes'] = document['missing_mesh_axes']
    if 'logical_axis_rules' not in document and 'path_rules' not in document:
      raise _errors.LogicalRulesError(
        f'{source} has no `logical_axis_rules` key (keys: '
        f'{sorted(map(str, document))}). {FORMAT_MSG}, or a `path_rules` '
        'list.'
      )
    if 'path_rules' in document:
      path_rules = document['path_rules']
      if not isinstance(path_rules, list):
        raise _errors.LogicalRulesError(
          f'{source}: `path_rules` must be a list of path rules; got '
          f'{type(path_rules).__name__} {path_rules!r:.100}. '
          f'{_path_rules.PATH_RULES_FIX_MSG}'
        )
      options['path_rules'] = path_rules
      for key in ('min_size', 'min_bytes'):
        if key in document:
          options[key] = document[key]
    document = document.get('logical_axis_rules', [])
  # A list of pairs, or a mapping of each name to its one target: the
  # same two spellings `LogicalRules` takes in Python.
  if not isinstance(document, list | Mapping):
    raise _errors.LogicalRulesError(
      f'{source}: expected a list of [logical_name, target] pairs (or a '
      f'mapping of logical names to targets); got '
      f'{type(document).__name__} {document!r:.100}. {FORMAT_MSG}.'
    )
  return document, options


def _load(text: str, source: str) -> Any:
  """`text` read by PyYAML's safe loader (no object it names is made).

  Raises:
    LogicalRulesError: If it is not valid YAML, with YAML's complaint.
  """
  try:
    return yaml.safe_load(text)
  except yaml.YAMLError as e:
    raise _errors.LogicalRulesError(
      f'{source} is not valid YAML: {_problem(e)}. {FORMAT_MSG}.'
    ) from e


def dump(
  pairs: Iterable[tuple[str, Any]],
  path_rules: Iterable[_path_rules.PathRule],
  options: Mapping[str, Any],
) -> str:
  """The YAML text of rules: their pairs, path rules (one flow-style dict
  each) and the file's other `options` (those to write, in order)."""
  pairs = list(pairs)
  lines = ['logical_axis_rules:' + ('' if pairs else ' []')]
  lines += [
    f'  - [{_scalar(name)}, {_scalar(target)}]' for name, target in pairs
  ]
  path_rules = list(path_rules)
  if path_rules:
    lines.append('path_rules:')
    for rule in path_rules:
      fields = ', '.join(
        f'{key}: {_scalar(value)}' for key, value in rule.to_yaml_dict().items()
      )
      lines.append(f'  - {{{fields}}}')
  lines += [f'{key}: {_scalar(value)}' for key, value in options.items()]
  return '\n'.join(lines) + '\n'


def _scalar(value: Any) -> str:
  """`value` (a str, None, bool, int or a list/tuple of them) as YAML flow
  text, strings single-quoted."""
  if value is None:
    return 'null'
  if isinstance(value, bool):
    return 'true' if value else 'false'
  if isinstance(value, int):
    return str(value)
  if isinstance(value, str):
    return "'" + value.replace("'", "''") + "'"
  return '[' + ', '.join(_scalar(v) for v in value) + ']'


def _problem(error: yaml.YAMLError) -> str:
  """YAML's complaint on one line, with its line and column, once.

  PyYAML's own text spans several lines, quotes the offending line and marks
  the column with a caret; this keeps what and where, e.g. "line 2, column
  1: expected ',' or ']', but got '<stream end>' (while parsing a flow
  sequence started at line 1, column 22)".
  """
  problem = getattr(error, 'problem', None)
  mark = getattr(error, 'problem_mark', None)
  if not problem or mark is None:
    return ' '.join(str(error).split())
  text = f'line {mark.line + 1}, column {mark.column + 1}: {problem}'
  context = getattr(error, 'context', None)
  context_mark = getattr(error, 'context_mark', None)
  if context:
    text += f' ({context}'
    if context_mark is not None:
      text += (
        f' started at line {context_mark.line + 1}, column '
        f'{context_mark.column + 1}'
      )
    text += ')'
  return text
