"""``flax-dtensor plan``: where every variable of a model would go."""

from __future__ import annotations

import pathlib
import sys
from typing import Annotated

import typer

from flax_dtensor.cli import _command, _loading, _options, _parsing, _served


def plan(
  target: Annotated[
    str,
    typer.Argument(
      metavar='TARGET',
      help=(
        'package.module:factory (or path/to/file.py:factory), a callable '
        f'returning an NNX module, e.g. {_options.DEMO_TARGET}.'
      ),
      show_default=False,
    ),
  ],
  mesh: _options.MeshOption = _options.DEFAULT_MESH,
  rules: _options.RulesOption = None,
  mesh_axis_names: _options.MeshAxisNamesOption = False,
  axis_types: _options.AxisTypesOption = 'auto',
  missing_mesh_axes: Annotated[
    str | None,
    _options.valued(
      '--missing-mesh-axes', 'fallback|error', _options.MISSING_MESH_AXES_HELP
    ),
  ] = None,
  optimizer: Annotated[
    str | None,
    _options.valued('--optimizer', 'NAME', _options.OPTIMIZER_HELP),
  ] = None,
  json_output: Annotated[
    bool, typer.Option('--json', help='Print the plan as JSON.')
  ] = False,
  summary: Annotated[
    bool,
    typer.Option(
      '--summary',
      help=(
        'Only the totals per device against the ideal, the largest '
        'replicated variables and the fallbacks, one line per reason.'
      ),
    ),
  ] = False,
  diff: Annotated[
    pathlib.Path | None,
    _options.valued(
      '--diff',
      'LAYOUT.json',
      (
        'Compare with a golden layout written by --json: print what moved, '
        'what changed size per device and which fallbacks changed. Exit 0 '
        'when nothing changed, 1 when something did (a CI check).'
      ),
    ),
  ] = None,
  check: Annotated[
    bool,
    typer.Option(
      '--check',
      help=(
        'Lint the rules against the model and the mesh: unused and shadowed '
        'rules, unknown mesh axes, large replicated variables, a budget. '
        'Exit 1 on findings (with --json, the findings as JSON).'
      ),
    ),
  ] = False,
  allow: Annotated[
    list[str] | None,
    _options.valued(
      '--allow',
      'CODE',
      'With --check: a finding code not to report (repeatable).',
    ),
  ] = None,
  budget: Annotated[
    str | None,
    _options.valued(
      '--budget',
      'SIZE',
      (
        'Bytes per device not to exceed, e.g. 16GiB: with --check, a '
        'finding above it; with --suggest, shard further until it fits '
        '(exit 1 when nothing does).'
      ),
    ),
  ] = None,
  min_bytes: Annotated[
    str | None,
    _options.valued(
      '--min-bytes',
      'SIZE',
      (
        'With --check: report replicated variables from this size on '
        '(default 1MiB). With --suggest: replicate smaller ones (default '
        '64KiB).'
      ),
    ),
  ] = None,
  suggest: Annotated[
    bool,
    typer.Option(
      '--suggest',
      help=(
        'Propose the rules (fdt.suggest_rules): logical rules for the '
        "names the model's annotations carry (and, traced on --input-shape, "
        'the names its forward constrains activations with); for variables '
        'without them, a '
        'preset recognised from the paths (Hugging Face, Gemma or GPT-2 '
        'names), else the largest dimension on the fsdp-like axis and the '
        'next on the model axis; print why for every variable, then the '
        'plan under them.'
      ),
    ),
  ] = False,
  input_shape: Annotated[
    list[str] | None,
    _options.valued(
      '--input-shape',
      'NAME:DIMS:DTYPE',
      (
        'With --suggest: a positional input of the forward, e.g. '
        'tokens:16,128:int32 (repeat for each, in order; NAME:none passes '
        'None). The forward is traced on them (nothing is computed) and the '
        'logical names it constrains activations with (such as batch) get '
        f'rules too. For {_options.DEMO_TARGET}, its own inputs by default.'
      ),
    ),
  ] = None,
  method: Annotated[
    str,
    typer.Option(
      metavar='NAME', help='With --input-shape: the method they are for.'
    ),
  ] = '__call__',
  write: Annotated[
    pathlib.Path | None,
    _options.valued(
      '--write',
      'RULES.yaml',
      (
        'With --suggest: write the proposed rules to this YAML file, to '
        'edit and pass to --rules.'
      ),
    ),
  ] = None,
  show: Annotated[
    str | None,
    _options.valued(
      '--show',
      'PATH',
      (
        'Draw which device holds which block of the variable at PATH '
        '(e.g. layers/0/mlp/up/kernel), for any number of dimensions.'
      ),
    ),
  ] = None,
  expand: Annotated[
    bool,
    typer.Option(
      '--expand',
      help=(
        'One row per variable. By default variables alike but for an '
        'integer in the path (same shape, dtype, spec and reasons) share '
        'a row, the integers as a range, e.g. 0..23, and a count.'
      ),
    ),
  ] = False,
  html_file: Annotated[
    pathlib.Path | None,
    _options.valued(
      '--html',
      'FILE',
      (
        'Also write one self-contained HTML page: the bytes per device as '
        'a chart (with --budget as a line), the mesh coloured by load, '
        'and the plan.'
      ),
    ),
  ] = None,
  debug: _command.DebugOption = False,
) -> None:
  """Show where every variable of a model would go, without allocating it.

  The model is built abstractly (nnx.eval_shape) on an abstract mesh: no
  device and no parameter memory is needed. The header compares the bytes
  per device with the ideal (total / device count); the table lists each
  variable's shape, dtype, logical axes, PartitionSpec and bytes per device,
  and the fallbacks taken follow, grouped by reason. Paths are never cut:
  in a narrow terminal (or COLUMNS when piped) each variable takes two lines.
  With --suggest, the rules are proposed for the model (see the path rules
  page), within --budget, and the plan follows them.
  """
  with _command.handle_errors(debug):
    golden_text = None
    if diff is not None:
      try:
        golden_text = diff.read_text()
      except OSError as e:
        raise _command.BadInputError(
          f'--diff {str(diff)!r}: cannot read the golden layout '
          f'({e.strerror or e}). Write one with `flax-dtensor plan TARGET '
          '--json > LAYOUT.json`.'
        ) from e
    if suggest and (rules is not None or mesh_axis_names):
      raise _command.BadInputError(
        '--suggest proposes the rules, and --rules (or --mesh-axis-names) '
        'gives them: pass one. To check a suggestion, --write it and pass '
        'that file to --rules.'
      )
    if write is not None and not suggest:
      raise _command.BadInputError(
        f'--write {str(write)!r} writes the rules --suggest proposes: add '
        '--suggest.'
      )
    if input_shape and not suggest:
      raise _command.BadInputError(
        '--input-shape gives the inputs --suggest traces the forward on: add '
        '--suggest.'
      )
    traced_on = _served.traced_inputs(input_shape or [], target)
    axes = _parsing.parse_mesh(mesh)
    types = _parsing.parse_axis_types(axis_types, axes)
    budget_ = None
    if budget is not None:  # One wording for 0, -5KiB and lots.
      budget_ = _parsing.parse_size(budget, '--budget', minimum=1)
    min_bytes_ = None
    if min_bytes is not None:
      min_bytes_ = _parsing.parse_size(min_bytes, '--min-bytes')
    if suggest:
      from flax_dtensor._rules import _logical

      rules_ = _logical.LogicalRules([], unknown='replicate')
    else:
      rules_ = _loading.with_missing_mesh_axes(
        _loading.load_rules(
          rules, mesh_axes=[n for n, _ in axes] if mesh_axis_names else None
        ),
        missing_mesh_axes,
      )
      note = _options.demo_rules_note(rules, mesh_axis_names, target)
      if note is not None:  # Above the plan; JSON on stdout stays JSON.
        _command.console(stderr=json_output).print(
          note, highlight=False, markup=False
        )
    tx = None if optimizer is None else _loading.load_optimizer(optimizer)
    import jax

    import flax_dtensor as fdt

    mesh_ = _loading.abstract_mesh(axes, types)
    # The user's code may print; --json keeps stdout for the JSON alone.
    with _command.user_prints_to_stderr(json_output):
      factory = _loading.load_target(target)
      with (
        jax.sharding.use_abstract_mesh(mesh_),
        fdt.logical_axis_rules(rules_),
      ):
        model = _loading.build_abstract(factory, target)
    suggestion = None
    if suggest:
      suggestion = fdt.suggest_rules(
        model,
        mesh_,
        budget=budget_,
        optimizer=tx,
        inputs=traced_on,
        method=method,
        **({} if min_bytes_ is None else {'min_bytes': min_bytes_}),
      )
      rules_ = suggestion.rules
      if write is not None:
        suggestion.write(write)
      if not json_output:  # The plan's source column says why, below.
        lines = suggestion.summary().splitlines()
        if write is not None:
          lines.append(f'Wrote the rules to {str(write)!r}.')
        _command.console().print(
          '\n'.join(lines) + '\n', highlight=False, markup=False
        )
    with jax.sharding.use_abstract_mesh(mesh_), fdt.logical_axis_rules(rules_):
      result = fdt.plan(model, mesh=mesh_, rules=rules_, optimizer=tx)
    if html_file is not None:
      from flax_dtensor import _text

      page = result.to_html(budget=budget_, expand=expand)
      try:
        html_file.write_text(page, encoding='utf-8')
      except OSError as e:
        raise _command.BadInputError(
          f'--html {str(html_file)!r}: cannot write the page '
          f'({e.strerror or e}). Pass a file in a directory you can write.'
        ) from e
      console = _command.console(stderr=True)
      message = (
        f'Wrote the plan as HTML to {str(html_file)!r} '
        f'({_text.human_bytes(len(page.encode()))}).'
      )
      # A long path breaks only after a '/', never inside a name.
      console.print(
        '\n'.join(_text.wrap_words(message, console.width)),
        highlight=False,
        markup=False,
        no_wrap=True,
        overflow='ignore',
      )
    if check:
      report = fdt.check(
        model,
        rules_,
        mesh_,
        min_bytes=2**20 if min_bytes_ is None else min_bytes_,
        budget=budget_,
        allow=allow or (),
      )
      if json_output:
        sys.stdout.write(report.to_json(indent=2) + '\n')
      else:
        console = _command.console()
        console.print(
          report.render(console.width), highlight=False, markup=False
        )
      _command.exit_findings(report)
    elif golden_text is not None:
      from flax_dtensor._planning import _plan

      golden = _plan.plan_from_json(golden_text, f'--diff {str(diff)!r}')
      changes = result.diff(golden)
      _command.console().print(str(changes), highlight=False, markup=False)
      _command.exit_findings(changes)
    elif json_output:
      sys.stdout.write(result.to_json(indent=2) + '\n')
    elif show is not None:
      if show not in {e.path for e in result.entries}:
        close = result.closest_paths(show)
        hint = (
          f'Did you mean {", ".join(map(repr, close))}?'
          if close
          else 'No path is spelled like it.'
        )
        raise _command.BadInputError(
          f'--show expected the path of a variable of {target}; got '
          f'{show!r}, which is none of its {len(result.entries)}. {hint} '
          f'`flax-dtensor plan {target}` lists them.'
        )
      console = _command.console()
      console.print(
        result.show(show).render(console.width), highlight=False, markup=False
      )
    else:
      _command.console().print(
        result.summary() if summary else result.table(expand=expand),
        highlight=False,
      )
    if suggestion is not None and suggestion.fits is False:
      _command.exit_findings(True)
