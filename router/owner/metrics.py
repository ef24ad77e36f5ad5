"""Prometheus metrics of the live router: exactly the names in docs/metrics.md.

Each router owns its own registry, so several routers (tests, benchmarks) can live in
one process without clashing on the global default registry.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from router.policy.base import Policy
from router.policy.types import Move, Placement, Tier
from router.protocol.accounting import Usage
from router.protocol.identity import SESSION_HEADERS

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
START_BUCKETS = (1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)  # a start may wait long
FRACTION_BUCKETS = tuple(i / 10 for i in range(1, 11))
# connect: a connection to it failed; failed: a request failed at the transport level and
# the health probe failed; failures: `outlier_failures` requests in a row failed that way;
# stalled: silent with requests in flight and the probe failed; health: `health_failures`
# failed health checks in a row
EJECTION_REASONS = ("connect", "failed", "failures", "stalled", "health")
HIT_SOURCES = ("device", "host", "miss")


class RouterMetrics:
    """The metric objects, plus helpers that keep the gauges in step with the policy."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._tally: dict[tuple[Counter, tuple[str, ...]], float] = {}
        # per histogram series: [sum, count in bucket 0, bucket 1, ...] (not cumulative)
        self._observed: dict[tuple[Histogram, tuple[str, ...]], list[float]] = {}
        r = self.registry = CollectorRegistry()
        self.programs = Gauge("mori_programs", "programs per tier", ["replica", "tier"], registry=r)
        self.tier_tokens = Gauge(
            "mori_tier_tokens", "context tokens held per tier", ["replica", "tier"], registry=r
        )
        self.tier_budget = Gauge(
            "mori_tier_budget_tokens", "token budget of the tier", ["replica", "tier"], registry=r
        )
        self.shared_tokens = Gauge(
            "mori_shared_tokens",
            "tokens of shared segments a tier counts once although several programs hold them",
            ["replica", "tier"],
            registry=r,
        )
        self.round_trip = Gauge(
            "mori_replica_round_trip_seconds",
            "median time a step spends between the gate and the replica, both ways, outside "
            "the engine (what the door's load discounts; 0 before the first streamed answer)",
            ["replica"],
            registry=r,
        )
        self.rounds = Gauge(
            "mori_rounds", "All-Gather rounds with two or more programs in them now", registry=r
        )
        self.round_programs = Gauge("mori_round_programs", "programs in those rounds", registry=r)
        self.idleness = Histogram(
            "mori_program_idleness",
            "idleness of live programs, observed each tick",
            buckets=FRACTION_BUCKETS,
            registry=r,
        )
        self.moves = Counter(
            "mori_moves",
            "tier moves by kind and reason",
            ["src_tier", "dst_tier", "reason"],
            registry=r,
        )
        self.warmups = Counter(
            "mori_warmups",
            "CacheSage warm-up requests by replica and outcome",
            ["replica", "outcome"],
            registry=r,
        )
        self.gate_wait = Histogram(
            "mori_gate_wait_seconds",
            "time a request was held by the gate",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.hint_ack_wait = Histogram(
            "mori_hint_ack_wait_seconds",
            "time a promoted request waited for its busy hint to be acknowledged",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.gate_waiting = Gauge("mori_gate_waiting", "requests held by the gate now", registry=r)
        self.gate_timeouts = Counter(
            "mori_gate_timeouts", "gated requests answered 503", registry=r
        )
        self.ttft = Histogram(
            "mori_ttft_seconds",
            "arrival at the router to first token",
            ["replica"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.step_ttft = Histogram(
            "mori_step_ttft_seconds",
            "TTFT of the attempt served, by kind of step: 'inflight' (a program that has run a "
            "step: the wait bound's), 'start' (its first step)",
            ["kind"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.start_wait = Histogram(
            "mori_start_wait_seconds",
            "a program's first attempt to its first token (the door's wait and refusals in)",
            buckets=START_BUCKETS,
            registry=r,
        )
        self.starts_deferred = Counter(
            "mori_starts_deferred",
            "starts answered 429 + Retry-After at the door (not expected in within the gate "
            "timeout)",
            registry=r,
        )
        self.latency = Histogram(
            "mori_request_latency_seconds",
            "arrival to last byte",
            ["replica"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "mori_requests", "requests by outcome", ["replica", "outcome"], registry=r
        )
        self.output_tokens = Counter(
            "mori_output_tokens", "completion tokens served", ["replica"], registry=r
        )
        self.prompt_tokens = Counter(
            "mori_prompt_tokens", "prompt tokens served", ["replica"], registry=r
        )
        self.prompt_cache_tokens = Counter(
            "mori_prompt_cache_tokens",
            "prompt tokens by where the engine found them",
            ["replica", "source"],
            registry=r,
        )
        self.identity_ignored = Counter(
            "mori_identity_ignored",
            "session headers ignored as unusable identities (not a label), by header",
            ["header"],
            registry=r,
        )
        for _, header in SESSION_HEADERS:  # every series from the start, at 0
            self.identity_ignored.labels(header)
        self.hint_pushes = Counter(
            "mori_hint_pushes", "hint batches pushed", ["replica", "result"], registry=r
        )
        self.hint_unsupported = Counter(
            "mori_hint_unsupported",
            "pushes to a replica without /mori/hints",
            ["replica"],
            registry=r,
        )
        self.reconciled = Counter(
            "mori_reconciled_programs",
            "programs whose tier was corrected from the engines' residency",
            ["kind"],
            registry=r,
        )
        for kind in ("adopted", "lost"):
            self.reconciled.labels(kind)
        self.replica_healthy = Gauge(
            "mori_replica_healthy", "1 healthy, 0 drained", ["replica"], registry=r
        )
        self.ejections = Counter(
            "mori_replica_ejections",
            "replicas taken out of service, by cause",
            ["replica", "reason"],
            registry=r,
        )
        self.active = Gauge(
            "mori_router_active",
            "1 while this router steers the replicas, 0 while it stands by",
            registry=r,
        )
        self.takeovers = Counter(
            "mori_takeovers", "times this router became the active one", registry=r
        )
        self.takeover_seconds = Histogram(
            "mori_takeover_seconds",
            "residency read, fencing epoch and full hint sync of one takeover",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.step_downs = Counter(
            "mori_step_downs",
            "times a replica refused this router's hint batch (another router took over)",
            registry=r,
        )
        self.loop_lag = Histogram(
            "mori_event_loop_lag_seconds",
            "how late the router's event loop ran a timer (sampled every 0.25 s)",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1),
            registry=r,
        )
        self.tick_seconds = Histogram(
            "mori_tick_seconds",
            "time spent in one policy tick",
            buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1),
            registry=r,
        )

    def count(self, family: Counter, *labels: str, amount: float = 1) -> None:
        """`family.labels(*labels).inc(amount)`, tallied and applied at the next scrape
        (`render`): the request path counts six series per request, and a tally costs a
        sixth of an `inc` (which looks the child up and takes its lock)."""
        key = (family, labels)
        self._tally[key] = self._tally.get(key, 0) + amount

    def observe(self, family: Histogram, value: float, *labels: str) -> None:
        """`family.labels(*labels).observe(value)`, tallied like `count`: a bisect and two
        additions, where the client's `observe` takes a lock for the sum and another for
        the bucket (three per request)."""
        key = (family, labels)
        tally = self._observed.get(key)
        if tally is None:
            tally = self._observed[key] = [0.0] * (len(family._upper_bounds) + 1)
        tally[0] += value
        tally[1 + bisect_left(family._upper_bounds, value)] += 1  # first bound >= value

    def flush(self) -> None:
        """Apply the tallied counts and observations (before anyone reads the metrics)."""
        tally, self._tally = self._tally, {}
        for (family, labels), amount in tally.items():
            self.child(family, *labels).inc(amount)
        observed, self._observed = self._observed, {}
        for (family, labels), (total, *buckets) in observed.items():
            child = self.child(family, *labels) if labels else family
            child._sum.inc(total)
            for bucket, n in zip(child._buckets, buckets, strict=True):
                if n:
                    bucket.inc(n)

    def child(self, family: Counter | Histogram, *labels: str) -> Any:
        """`family.labels(*labels)`, looked up once (the request path records several)."""
        key = (id(family), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = family.labels(*labels)
        return child

    def add_replica(self, replica: str) -> None:
        """Create every per-replica series at zero, so dashboards and alerts see them at once."""
        self.replica_healthy.labels(replica).set(1)
        for result in ("ok", "error", "unsupported", "stale"):
            self.hint_pushes.labels(replica, result)
        self.hint_unsupported.labels(replica)
        for reason in EJECTION_REASONS:
            self.ejections.labels(replica, reason)
        for outcome in (
            "ok", "error", "timeout", "ended", "client_disconnect", "retried", "deferred"
        ):  # fmt: skip
            self.requests.labels(replica, outcome)
        for family in (self.output_tokens, self.prompt_tokens, self.ttft, self.latency):
            family.labels(replica)
        for source in HIT_SOURCES:
            self.prompt_cache_tokens.labels(replica, source)
        self.warmups.labels(replica, "ok")

    def record_hits(self, replica: str, usage: Usage) -> None:
        """Count one call's prompt tokens by where the engine found them."""
        hits = usage.hits()
        if hits is None:
            return
        for source, tokens in zip(HIT_SOURCES, hits, strict=True):  # CacheHits' order
            self.count(self.prompt_cache_tokens, replica, source, amount=tokens)

    def record_moves(self, moves: list[Move]) -> None:
        for m in moves:
            self.moves.labels(m.src.tier.value, m.dst.tier.value, m.reason.value).inc()

    def refresh_tiers(self, policy: Policy) -> None:
        """Set the per-tier gauges from the policy's bookkeeping (each tick and each scrape:
        gauges are idempotent, so scraping more often changes nothing)."""
        tiers = policy.tiers
        for replica in tiers.capacity:
            for tier in (Tier.GPU, Tier.CPU):
                place = Placement(tier, replica)
                self.programs.labels(replica, tier.value).set(tiers.count(place))
                self.tier_tokens.labels(replica, tier.value).set(tiers.used(place))
                self.tier_budget.labels(replica, tier.value).set(tiers.budget(place))
                held = sum(p.context_tokens for p in tiers.members(place))
                self.shared_tokens.labels(replica, tier.value).set(held - tiers.used(place))
            self.replica_healthy.labels(replica).set(1 if tiers.healthy[replica] else 0)
            prices = policy.prices.get(replica)
            self.round_trip.labels(replica).set(prices.round_trip_s if prices else 0.0)
        live = policy.rounds.live()
        self.rounds.set(len(live))
        self.round_programs.set(sum(len(pids) for pids in live.values()))
        waiting = Placement(Tier.WAITING)
        self.programs.labels("-", Tier.WAITING.value).set(tiers.count(waiting))
        self.tier_tokens.labels("-", Tier.WAITING.value).set(
            sum(p.context_tokens for p in tiers.members(waiting))
        )

    def observe_idleness(self, policy: Policy, now: float) -> None:
        """One idleness sample per live program per tick: only the tick calls this, so the
        histogram's counts do not depend on how often Prometheus scrapes."""
        for p in policy.programs.values():
            self.idleness.observe(p.idleness(now))

    def render(self) -> bytes:
        self.flush()
        return generate_latest(self.registry)
