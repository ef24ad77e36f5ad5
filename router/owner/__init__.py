"""The policy owner: the one process that holds the router's state and decides.

`process` (`mori serve`'s main: starts the workers, the admin server and the loops),
`controller` (the imperative shell around the pure policy: clock, loops, moves ->
hints), `exchange` (one request's life as the owner sees it: turn, gate, attempts,
prices), `gate` (holds a request until its program is on a GPU tier), `reconcile` (the
tiers checked against the engines' residency), `leadership` (active/standby: takeover
epochs that fence an earlier active), `metrics` (Prometheus) and `api` (the
admin API, program and tool endpoints, /health, /metrics).

May import: every shell package below it (`plane`, to run a worker in its own process;
`protocol`, `engines`, `wire`), `router.config` and the pure `router.policy`. Nothing
imports it but the entry points (`router.serve`).
"""
