"""Which router steers the replicas: active/standby, fenced by hint epochs.

Two routers may front the same replicas, one behind the other in a proxy (HAProxy, the
standby a `backup` server: docs/deployment.md). Only the *active* one may steer the
replicas' KV. A router becomes active when the proxy sends it traffic, its first inference
request or program event (`standby: true`), or at start (`standby: false`, a router alone).
Taking over (`Router.take_over`):

1. rebuilds programs, tiers and placements from the replicas' `/mori/residency`
   (router/owner/reconcile.py) into a policy that knows nothing else, so every program
   keeps the replica that holds its KV;
2. takes the first epoch of a new *term*, above every epoch any replica reports, and
   pushes a full hint sync with it: from then on each of those replicas refuses
   (`"stale": true`) the batches of every router that took over before, however long it
   was paused or cut off, without trusting it to step down;
3. only then admits the request that triggered it.

A router whose batch is refused steps down: it pushes no more hints, answers its held
requests `503 router_standby` (the client retries through the proxy, to the active
router), lets its forwarded streams finish, and takes over again only when traffic comes
back to it.

Why traffic and not a lease: the proxy's health checks are the failure detector the
deployment already runs, and the proxy sends new requests to one server of the backend at
a time, so the router that sees a program's requests is the one that steers its KV. A lease
needs a store both routers trust (etcd, a Kubernetes Lease) or bounded clock drift; with the
replicas enforcing the epochs, safety needs neither: whoever took over last wins on every
replica it reached, and the loser learns it from its first refused batch.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from typing import Any

TERM_SHIFT = 32  # epoch = term << 32 | batch number within the term
# Two routers that take over at the same moment read the same epochs: a random step of up
# to this many terms makes them pick different terms (the higher one wins everywhere).
TERM_JITTER = 1 << 10


def epoch_above(seen: Iterable[int], jitter: int | None = None) -> int:
    """The first epoch of a new term above every epoch in `seen` (the replicas' reports;
    -1 or nothing: a replica that never applied a batch)."""
    top = max((e for e in seen if e >= 0), default=0)
    step = 1 + (secrets.randbelow(TERM_JITTER) if jitter is None else jitter)
    return ((top >> TERM_SHIFT) + step) << TERM_SHIFT


def reported_epoch(doc: Any) -> int:
    """The epoch a replica says it last applied (`/mori/residency` or a hint answer's
    `epoch`); -1 when it says none."""
    epoch = doc.get("epoch") if isinstance(doc, dict) else None
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else -1


def refused(answer: Any) -> bool:
    """Whether a replica refused a hint batch as stale: another router took over since."""
    return isinstance(answer, dict) and answer.get("stale") is True
