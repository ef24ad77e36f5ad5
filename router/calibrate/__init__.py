"""`mori calibrate`: time a live replica with a fixed probe schedule and fit the replica
cost model's prices to it (probes.py: the schedule and the timing; fit.py: the least
squares, with the cost model itself as the forward model; cli.py: the command).

May import: `router.sim` (the cost model it fits is the simulator's), `router.presets`
(what it writes), `router.protocol` (the usage fields an engine answers with) and
`router.policy` (the hint types it sends); nothing of the live router's shell.
"""
