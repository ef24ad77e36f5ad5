"""`mori calibrate`: time a live replica with a fixed probe schedule and fit the replica
cost model's prices to it (probes.py: the schedule and the timing; fit.py: the least
squares, with the cost model itself as the forward model; cli.py: the command)."""
