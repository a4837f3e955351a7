"""Planning: what goes where and why, before or after anything is placed.

`_plan_build` builds a `ShardingPlan` (`_plan`: the data model and its
JSON form). Its views: `_plan_view` renders it for a terminal, `_plan_html`
for Jupyter, `_plan_blocks` draws the blocks each device holds,
`_plan_chart` its memory as pictures; `_plan_diff` compares two plans.

`_check` lints rules against a model: its findings about the rules are
`_check_rules`', those about the variables `_check_model`'s, the report
`_check_report`'s. `_memory` counts a training step's bytes per device.

`_suggest` proposes rules for a model, composing `_suggest_roles` (the
mesh axes' roles and each logical name's targets), `_suggest_search` (the
rules of the variables without logical names, from the `_presets` or the
generic proposal, for a budget) and `_suggest_forward` (the names only the
forward uses).
"""
