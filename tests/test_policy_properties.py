"""Invariants of every registered policy over random event sequences (hypothesis).

The driver plays the shell: it sends requests only for programs that may send one,
answers only requests in flight (with growing usage), cancels held ones, ends programs,
ticks, resizes replicas and fails / recovers them, with the clock moving forward.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.policy import PolicyConfig, make_policy, policy_names
from router.policy.base import Policy
from router.policy.baselines import ThunderAgentPolicy
from router.policy.types import WAITING, Placement, ReplicaCapacity, Status, Tier

REPLICAS = ("r0", "r1", "r2")
PROGRAMS = 10

tokens = st.integers(min_value=50, max_value=1500)
event = st.one_of(
    st.tuples(st.just("req"), st.integers(0, PROGRAMS - 1), st.integers(0, 400)),
    st.tuples(st.just("resp"), st.integers(0, PROGRAMS - 1), st.integers(0, 400)),
    st.tuples(st.just("cancel"), st.integers(0, PROGRAMS - 1)),
    st.tuples(st.just("end"), st.integers(0, PROGRAMS - 1)),
    st.tuples(st.just("tick")),
    st.tuples(st.just("cap"), st.sampled_from(REPLICAS), tokens, st.integers(0, 3000)),
    st.tuples(st.just("health"), st.sampled_from(REPLICAS), st.booleans()),
)
timed = st.tuples(st.floats(min_value=0.0, max_value=40.0), event)
scenario = st.lists(timed, min_size=1, max_size=60)


def fits_somewhere(policy: Policy, p) -> bool:
    """Whether a held program has room in a tier its policy may promote it to."""
    healthy = policy.tiers.replicas()
    if isinstance(policy, ThunderAgentPolicy):
        return any(policy.remaining(r) >= policy.cost(p) for r in healthy)
    if p.placement.tier is Tier.CPU:  # MORI: CPU programs keep their replica
        healthy = [p.placement.replica] if p.placement.replica in healthy else []
    return any(p.context_tokens <= policy.tiers.free(Placement(Tier.GPU, r)) for r in healthy)


def check_tiers(policy: Policy) -> None:
    places = [WAITING] + [Placement(t, r) for r in REPLICAS for t in (Tier.GPU, Tier.CPU)]
    seen: dict[str, Placement] = {}
    for place in places:
        members = list(policy.tiers.members(place))
        for p in members:
            assert p.program_id not in seen, f"{p.program_id} in {seen[p.program_id]} and {place}"
            assert p.placement == place and policy.programs[p.program_id] is p
            seen[p.program_id] = place
        if place is not WAITING:
            assert policy.tiers.used(place) == sum(p.context_tokens for p in members)
    assert set(seen) == set(policy.programs), "a known program is in no tier"


def check_after_tick(policy: Policy, now: float) -> None:
    for r in REPLICAS:
        gpu, cpu = Placement(Tier.GPU, r), Placement(Tier.CPU, r)
        assert policy.tiers.used(cpu) <= policy.tiers.budget(cpu)
        if policy.gated:
            in_flight_out = policy.pending_lazy_tokens(r)
            assert policy.tiers.used(gpu) - in_flight_out <= policy.tiers.budget(gpu)
    for p in policy.programs.values():
        if p.pending:
            assert not fits_somewhere(policy, p), f"{p.program_id} fits but is still held"
        idle = p.idleness(now)
        assert 0.0 <= idle <= 1.0
        if p.status is Status.ACTING and p.steps > 0:
            assert p.idleness(now + 5.0) >= idle - 1e-12


def play(policy: Policy, events) -> None:
    for r in REPLICAS:
        policy.add_replica(r, ReplicaCapacity(1500, 1500))
    now = 0.0
    for dt, (kind, *args) in events:
        now += dt
        if kind in ("req", "resp", "cancel", "end"):
            pid = f"p{args[0]}"
            p = policy.programs.get(pid)
            if kind == "req" and (p is None or p.status is Status.ACTING):
                policy.on_request(pid, now, (p.context_tokens if p else 100) + args[1])
            elif kind == "resp" and p is not None and p.status is Status.REASONING:
                policy.on_response(pid, now, p.context_tokens + args[1])
            elif kind == "cancel" and p is not None and p.status is Status.GATED:
                policy.cancel(pid, now)
            elif kind == "end":
                policy.end(pid, now)
        elif kind == "tick":
            policy.tick(now)
            check_after_tick(policy, now)
        elif kind == "cap":
            policy.set_capacity(args[0], ReplicaCapacity(args[1], args[2]))
        else:
            policy.set_healthy(args[0], args[1], now)
        check_tiers(policy)
        for pid in policy.programs:
            routed = policy.route(pid)
            assert routed is None or policy.tiers.healthy[routed], f"{pid} routed to {routed}"
    policy.tick(now + 1.0)
    check_after_tick(policy, now + 1.0)
    policy.hint_updates()


@pytest.mark.parametrize("name", policy_names())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=scenario)
def test_invariants_hold_over_random_events(name: str, events) -> None:
    # tick_s=0: every driver tick is a full rebalance (mori+predict skips it between periods)
    play(make_policy(name, PolicyConfig(lease_s=200.0, tick_s=0.0)), events)
