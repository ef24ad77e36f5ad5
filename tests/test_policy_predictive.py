"""mori's time scheduler: offload at tool start, predictive promotion (Tokencake 4)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.policy import PolicyConfig, make_policy
from router.policy.engine import MoriEngine
from router.policy.types import Hint, MoveReason, Placement, ReplicaCapacity, Status, Tier

GPU0, CPU0 = Placement(Tier.GPU, "r0"), Placement(Tier.CPU, "r0")
WAIT = Placement(Tier.WAITING)
LOAD = 0.001  # s per token one way: 600 tokens load in 0.6 s


def make(gpu: int = 1000, cpu: int = 2000, replicas: int = 1, **cfg) -> MoriEngine:
    """The predictive moves alone: mori's priced displacement, aging and overload rules are
    switched off (their rules have their own tests), so each move here is a prediction's."""
    cfg = {"load_s_per_token": LOAD, "predict_lead_s": 0.5, "predict_grace_s": 2.0} | cfg
    cfg = {"displace_margin": 1e9, "aging_s": 0.0, "max_step_wait_s": 0.0} | cfg
    policy = make_policy("mori", PolicyConfig(**cfg))
    assert isinstance(policy, MoriEngine)
    for i in range(replicas):
        policy.add_replica(f"r{i}", ReplicaCapacity(gpu, cpu))
    return policy


def step(policy, pid: str, start: float, tokens: int, reason_s: float = 1.0) -> float:
    policy.on_request(pid, start, tokens)
    assert policy.route(pid) is not None, f"{pid} was not admitted at {start}"
    policy.on_response(pid, start + reason_s, tokens)
    return start + reason_s


def where(policy, pid: str) -> Placement:
    return policy.programs[pid].placement


def by_reason(moves, reason: MoveReason) -> list[str]:
    return [m.program_id for m in moves if m.reason is reason]


def crowded(policy, a_tool: str = "Bash:pytest") -> list:
    """a (600) and c (300) on GPU, b (400) held at the gate; a starts `a_tool` at t=2."""
    step(policy, "c", 0.0, 300, reason_s=1.9)
    policy.on_request("a", 0.5, 600)
    policy.on_request("b", 1.0, 400)
    assert where(policy, "b") == WAIT and policy.programs["b"].pending
    policy.on_response("a", 2.0, 600)
    return policy.on_tool_start("a", 2.0, a_tool, agent="main")


# offload at tool start (Algorithm 1) -------------------------------------------------------
def test_long_tool_with_demand_offloads_and_admits_the_gate():
    policy = make()
    moves = crowded(policy)  # cold start: pytest ~30 s >> 2 x 0.6 s transfer
    assert by_reason(moves, MoveReason.OFFLOAD_TOOL) == ["a"]
    assert where(policy, "a") == CPU0
    assert where(policy, "b") == GPU0 and policy.route("b") == "r0"
    assert policy.hint_updates()["r0"]["a"] is Hint.IDLE


def test_no_offload_when_the_host_copy_would_not_survive():
    """HiCache backs every GPU block up to host and keeps those backups: with 1000 host
    tokens and 900 on the GPU tier, `a`'s 600 tokens cannot stay on host, so an offload
    would be a recompute in disguise (the CPU tier's own budget would still take it)."""
    policy = make(cpu=1000)
    assert crowded(policy) == []
    assert where(policy, "a") == GPU0 and policy.programs["b"].pending


def test_short_tool_is_not_offloaded():
    policy = make()
    assert crowded(policy, a_tool="Read") == []  # 0.5 s < 1.2 s of transfers
    assert where(policy, "a") == GPU0 and policy.programs["b"].pending


def test_offload_cost_above_benefit_is_refused():
    policy = make(load_s_per_token=0.02)  # transfers 2 x 12 s; window 6 s x value 0.5 < 24 s
    assert crowded(policy) == []
    benefit, cost = policy.timed.offload_benefit(policy.programs["a"], 30.0)
    assert benefit < cost == pytest.approx(24.0)
    assert where(policy, "a") == GPU0


def test_no_demand_no_offload():
    policy = make()
    step(policy, "a", 0.0, 600)
    assert policy.on_tool_start("a", 1.0, "Task", agent="main") == []  # 90 s, nobody waits
    assert where(policy, "a") == GPU0


def test_demand_that_would_not_fit_anyway_is_no_benefit():
    policy = make(gpu=1000)
    step(policy, "c", 0.0, 300)
    step(policy, "a", 0.5, 100)
    policy.on_request("b", 2.0, 950)  # needs 950: freeing a (100) leaves 700
    assert policy.on_tool_start("a", 2.0, "Task") == []
    assert policy.timed.offload_benefit(policy.programs["a"], 90.0)[0] == 0.0


def test_client_hint_moves_the_decision():
    policy = make()
    step(policy, "c", 0.0, 300)
    policy.on_request("a", 0.5, 600)
    policy.on_request("b", 1.0, 400)
    policy.on_response("a", 2.0, 600)
    policy.forecast.predictor.hint_alpha = 1.0
    assert policy.on_tool_start("a", 2.0, "Bash:pytest", predict_s=0.2) == []  # client: 0.2 s
    assert where(policy, "a") == GPU0


# predictive promotion ------------------------------------------------------------------
def _offloaded(policy) -> float:
    """a offloaded at t=2 with a predicted end at 32 (cold pytest 30 s); b gone at t=4."""
    crowded(policy)
    policy.on_response("b", 3.0, 400)
    policy.end("b", 4.0)
    assert policy.tiers.free(GPU0) == 700
    return policy.forecast.calls["a"].predicted_end_s


def test_promotion_ahead_of_predicted_end_loads_the_kv_back():
    policy = make()
    predicted_end = _offloaded(policy)
    assert predicted_end == pytest.approx(32.0)
    wake = policy.next_wakeup(5.0)
    assert wake == pytest.approx(predicted_end - 600 * LOAD - 0.5)  # lead >= load-back time
    assert by_reason(policy.tick(wake - 0.1), MoveReason.PROMOTE_PREDICTED) == []
    policy.hint_updates()
    moves = policy.tick(wake)
    assert by_reason(moves, MoveReason.PROMOTE_PREDICTED) == ["a"]
    assert policy.hint_updates()["r0"]["a"] is Hint.BUSY  # the engine loads it back now
    policy.on_request("a", predicted_end, 600)
    assert policy.route("a") == "r0"  # no gate wait at all
    assert policy.timed.outcomes["back_after_predicted_promotion"] == 1


def test_no_predictive_promotion_without_free_room():
    policy = make()
    crowded(policy)  # b (400) holds the room a would need
    assert where(policy, "b") == GPU0
    moves = policy.tick(31.0)
    assert by_reason(moves, MoveReason.PROMOTE_PREDICTED) == []
    assert where(policy, "a") == CPU0 and where(policy, "b") == GPU0  # nobody displaced
    wake = policy.next_wakeup(31.0)
    assert wake is None or wake > 31.0  # a due promotion never asks for a busy loop
    policy.on_response("b", 31.2, 400)
    moves = policy.end("b", 31.5)  # room freed: the due prediction takes it at once
    assert by_reason(moves, MoveReason.PROMOTE_PREDICTED) == ["a"]


def test_predictive_promotion_leaves_room_to_requests_at_the_gate():
    policy = make()
    _offloaded(policy)
    policy.on_request("d", 29.0, 800)  # does not fit 700 free: still it has priority
    assert policy.programs["d"].pending
    step(policy, "e", 29.1, 650)  # takes the room: d still held, 50 free
    assert by_reason(policy.tick(31.0), MoveReason.PROMOTE_PREDICTED) == []


def test_no_predictive_promotion_into_room_a_held_request_is_gathering():
    """d (800) waits for r0 and does not fit the 700 free tokens yet: that room is gathering
    for it, so the due prediction of a (600) must not take it (and put d behind a bet)."""
    policy = make()
    _offloaded(policy)
    policy.on_request("d", 29.0, 800)
    assert policy.programs["d"].pending and policy.tiers.free(GPU0) == 700
    assert by_reason(policy.tick(31.0), MoveReason.PROMOTE_PREDICTED) == []
    assert where(policy, "a") == CPU0


def test_early_return_falls_back_to_normal_promotion():
    policy = make()
    _offloaded(policy)
    moves = policy.on_request("a", 6.0, 600)  # back after 4 s, prediction said 30 s
    assert by_reason(moves, MoveReason.ADMIT) == ["a"] and policy.route("a") == "r0"
    assert policy.timed.outcomes == {"offload_at_tool_start": 1, "back_while_on_cpu": 1}
    stats = policy.forecast.predictor.error_stats()["shell_long"]
    assert stats.n == 1 and stats.abs_p50_s == pytest.approx(26.0)
    assert policy.next_wakeup(6.0) is None


def test_tool_end_loads_back_at_once_and_feeds_the_predictor():
    policy = make()
    _offloaded(policy)
    moves = policy.on_tool_end("a", 10.0)
    assert by_reason(moves, MoveReason.PROMOTE_CPU) == ["a"]
    assert policy.forecast.predictor.predict("main", "Bash:pytest") == pytest.approx(8.0)
    policy.on_request("a", 10.5, 600)
    assert policy.route("a") == "r0"
    assert policy.forecast.predictor.error_stats()["shell_long"].n == 1  # scored once, not twice


def test_tool_end_of_a_program_whose_kv_is_gone_only_feeds_the_predictor():
    """A program drained to WAITING during its tool call has no replica to load back to:
    the client's tool end is learnt from and moves nothing (it raised ValueError: a 500
    from `POST /v1/programs/{id}/tool_end`)."""
    policy = make()
    step(policy, "a", 0.0, 600)
    policy.on_tool_start("a", 1.0, "Bash:pytest", "main")
    policy.set_healthy("r0", False, 2.0)
    policy.set_healthy("r0", True, 2.5)
    assert where(policy, "a") == WAIT
    assert policy.on_tool_end("a", 9.0) == []
    assert policy.forecast.predictor.predict("main", "Bash:pytest") == pytest.approx(8.0)


def test_tool_end_of_a_program_whose_kv_is_gone_moves_nothing():
    """A CPU-tier program whose host copy the engine dropped is WAITING (reconcile): its
    tool's end has nothing to load back (it raised, a 500 on the router's tool_end)."""
    policy = make()
    _offloaded(policy)
    policy.tiers.place(policy.programs["a"], WAIT)
    assert policy.on_tool_end("a", 10.0) == []
    assert policy.programs["a"].placement == WAIT


def test_misprediction_holds_room_only_until_grace_ends():
    policy = make()
    predicted_end = _offloaded(policy)
    policy.tick(policy.next_wakeup(5.0))
    assert where(policy, "a") == GPU0 and policy.programs["a"].status is Status.ACTING
    policy.on_request("d", 32.5, 400)  # 100 free; a is overdue but protected: d waits
    assert policy.programs["d"].pending
    assert by_reason(policy.tick(predicted_end + 1.9), MoveReason.DEMOTE) == []
    assert policy.next_wakeup(predicted_end + 1.9) == pytest.approx(predicted_end + 2.0)
    moves = policy.tick(predicted_end + 2.0)
    assert by_reason(moves, MoveReason.DEMOTE) == ["a"] and where(policy, "a") == CPU0
    assert where(policy, "d") == GPU0
    assert policy.forecast.calls["a"].promote_tried  # one predictive promotion per tool call
    assert by_reason(policy.tick(predicted_end + 3.0), MoveReason.PROMOTE_PREDICTED) == []


def test_overdue_prediction_without_demand_keeps_its_room():
    policy = make()
    predicted_end = _offloaded(policy)
    policy.tick(policy.next_wakeup(5.0))
    assert by_reason(policy.tick(predicted_end + 5.0), MoveReason.DEMOTE) == []
    assert where(policy, "a") == GPU0


def test_protected_program_is_demoted_last():
    policy = make(predict_grace_s=10.0)
    predicted_end = _offloaded(policy)
    policy.tick(policy.next_wakeup(5.0))  # a full tick: the next one is due 5 s later
    a, c = policy.programs["a"], policy.programs["c"]
    t = predicted_end + 4.0
    assert a.idleness(t) > c.idleness(t)  # MORI alone would demote a
    policy.set_capacity("r0", ReplicaCapacity(700, 1000))
    moves = policy.tick(t)
    assert by_reason(moves, MoveReason.DEMOTE) == ["c"] and where(policy, "a") == GPU0


def test_predictor_learns_from_the_gaps():
    policy = make()
    t = 0.0
    for _ in range(12):
        t = step(policy, "a", t, 200)
        policy.on_tool_start("a", t, "Bash:weird", agent="main")
        t += 3.0
    assert policy.forecast.predictor.predict("main", "Bash:weird") == pytest.approx(3.0, rel=1e-3)


def test_extra_wakeups_do_not_speed_up_moris_rebalance():
    policy = make(tick_s=5.0)
    policy.tick(0.0)
    policy.on_request("a", 0.1, 2000)  # too big for any tier: held
    calls = []
    policy._rebalance = lambda now: calls.append(now) or []
    for t in (1.0, 2.0, 4.9, 5.0, 6.0, 10.0):
        policy.tick(t)
    assert calls == [5.0, 10.0]


# the invariants MORI keeps hold here too -------------------------------------------------
EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["request", "response", "tool", "tool_end", "tick", "end"]),
        st.sampled_from(["p0", "p1", "p2", "p3", "p4", "p5"]),
        st.integers(50, 700),
        st.sampled_from(["Read", "Bash:pytest", "Task", "human", "unknown"]),
        st.floats(0.0, 20.0),
    ),
    max_size=60,
)


def _check_invariants(policy: MoriEngine) -> None:
    seen: dict[str, int] = {}
    for r in policy.tiers.replicas(healthy_only=False):
        for tier in (Tier.GPU, Tier.CPU):
            place = Placement(tier, r)
            members = list(policy.tiers.members(place))
            assert policy.tiers.used(place) == sum(p.context_tokens for p in members)
            used = policy.tiers.used(place)
            if tier is Tier.GPU:
                used -= policy.pending_lazy_tokens(r)
            assert used <= policy.tiers.budget(place), f"{place} over budget"
            for p in members:
                seen[p.program_id] = seen.get(p.program_id, 0) + 1
    for p in policy.tiers.members(WAIT):
        seen[p.program_id] = seen.get(p.program_id, 0) + 1
    assert seen == dict.fromkeys(policy.programs, 1)  # every program in exactly one tier


@settings(max_examples=150, deadline=None)
@given(events=EVENTS)
def test_budgets_and_one_tier_per_program_hold(events):
    policy = make(gpu=1500, cpu=1200, replicas=2, tick_s=5.0)
    now = 0.0
    for kind, pid, tokens, tool, dt in events:
        now += dt
        p = policy.programs.get(pid)
        if kind == "request" and (p is None or p.status is Status.ACTING):
            policy.on_request(pid, now, tokens)
        elif kind == "response" and p is not None and p.status is Status.REASONING:
            policy.on_response(pid, now, tokens)
            policy.on_tool_start(pid, now, tool, agent="main")
        elif kind == "tool_end" and p is not None:
            policy.on_tool_end(pid, now)
        elif kind == "end" and p is not None:
            policy.end(pid, now)
        moves = policy.tick(now) if kind == "tick" else []
        for m in moves:
            if m.reason is MoveReason.PROMOTE_PREDICTED:
                assert policy.tiers.used(m.dst) <= policy.tiers.budget(m.dst)
        if kind == "tick":
            _check_invariants(policy)
        wake = policy.next_wakeup(now)
        assert wake is None or wake >= now
