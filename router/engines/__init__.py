"""The router's view of its engine replicas, as every router process holds it.

`replicas` (one `Replica` per engine on one `Upstream`: capacity, health, hint batches,
residency, aborts) and `outliers` (the books of passive outlier detection: the attempts in
flight that a worker watches, the failure streaks and ejections that the owner keeps).

May import: `router.wire`, `router.policy` (types), `router.config`. Never `plane` or
`owner`, which both use it.
"""
