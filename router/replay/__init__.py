"""Agent traces and the clients that replay them: the workload side of every measurement.

`trace` (the format and its validation), `generate`, `multiagent`, `dag`, `generators`
and `prompts` (corpora shaped like real agents), `trace_stats` and `trace_cli`
(`mori trace`), `corpus` (closed-loop hand-out of programs), `client` and `cli`
(`mori replay`: the OpenAI SDK against any endpoint), `records` and `report` (the metrics
of MORI section 6.2, tables, CSV, JSON, plots).

May import: `router.policy` (stats, app graphs), `router.protocol.accounting` (how an
answer's usage is read). Never `sim`, `owner` or `plane`.
"""
