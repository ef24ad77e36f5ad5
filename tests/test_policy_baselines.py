"""What distinguishes each baseline (SMG cache_aware, ThunderAgent TR, TR + host tier)."""

from __future__ import annotations

from router.policy import PolicyConfig, make_policy
from router.policy.baselines import TA_PROGRAM_OVERHEAD as OH
from router.policy.types import EngineMode, MoveReason, Placement, ReplicaCapacity, Segment, Tier
from tests.test_policy_mori import GPU0, WAIT, by_reason, make, shrink, step, where


# smg ------------------------------------------------------------------------------------------
def test_smg_is_ungated_hintless_lru():
    policy = make("smg")
    assert not policy.gated and not policy.sends_hints
    assert policy.engine_mode == EngineMode("lru", host_tier=False)
    assert make("smg", smg_offload=True).engine_mode == EngineMode("lru", host_tier=True)


def test_smg_routes_everything_at_once_without_budget():
    policy = make("smg", gpu=1000)
    for i in range(3):
        policy.on_request(f"p{i}", 0.0, 800)
        assert policy.route(f"p{i}") == "r0"
    assert policy.tiers.used(GPU0) == 2400
    for i in range(3):
        policy.on_response(f"p{i}", 1.0, 900)
    assert policy.tick(5.0) == [] and policy.tick(10.0) == []


def _loaded_r0(in_flight: int):
    """x's prefix lives on r0, which has `in_flight` running requests; r1 is idle."""
    policy = make("smg", replicas=2)
    policy.set_healthy("r1", False, 0.0)
    step(policy, "x", 0.0, 100)
    for i in range(in_flight):
        policy.on_request(f"busy{i}", 1.0, 100)
    policy.set_healthy("r1", True, 1.0)
    return policy


def test_smg_keeps_prefix_affinity_while_balanced():
    policy = _loaded_r0(in_flight=64)
    policy.on_request("x", 2.0, 200)
    assert policy.route("x") == "r0"
    policy.on_request("fresh", 2.0, 200)  # no prefix anywhere: least loaded
    assert policy.route("fresh") == "r1"


def test_smg_escapes_affinity_on_load_imbalance():
    policy = _loaded_r0(in_flight=70)  # 70 - 0 > 64 and 70 > 1.5 * 0
    policy.on_request("x", 2.0, 200)
    assert policy.route("x") == "r1"


def test_smg_load_counts_fall_with_responses_and_ends():
    policy = _loaded_r0(in_flight=70)
    for i in range(10):
        policy.on_response(f"busy{i}", 2.0, 100)
    policy.end("busy10", 2.0)
    policy.on_request("x", 3.0, 200)  # 59 running on r0: balanced again
    assert policy.route("x") == "r0"


def test_smg_never_routes_to_an_unhealthy_replica():
    policy = make("smg", replicas=2)
    step(policy, "x", 0.0, 100)
    home = where(policy, "x").replica
    policy.set_healthy(home, False, 2.0)
    policy.on_request("x", 3.0, 100)
    assert policy.route("x") not in (None, home)
    policy.set_healthy("r0", False, 4.0)
    policy.set_healthy("r1", False, 4.0)
    policy.on_request("y", 5.0, 100)
    assert policy.route("y") is None
    policy.set_healthy("r1", True, 6.0)
    assert policy.route("y") == "r1"


# ThunderAgent -----------------------------------------------------------------------------------
def test_ta_engine_modes():
    ta, tao = make("ta"), make("ta+o")
    assert ta.gated and not ta.sends_hints and not tao.sends_hints
    assert ta.engine_mode == EngineMode("lru", host_tier=False)
    assert tao.engine_mode == EngineMode("lru", host_tier=True)


def test_ta_charges_100_tokens_per_program():
    policy = make("ta", gpu=1000)
    policy.on_request("a", 0.0, 900)
    assert policy.route("a") == "r0"  # 900 + 100 fits exactly
    policy.on_request("b", 0.0, 1)
    assert policy.route("b") is None
    mori = make("mori", gpu=1000)
    mori.on_request("a", 0.0, 900)
    mori.on_request("b", 0.0, 1)
    assert mori.route("b") == "r0"


def test_ta_admits_new_only_when_nobody_is_queued():
    policy = make("ta", gpu=1000)
    policy.on_request("a", 0.0, 500)
    policy.on_request("big", 0.0, 600)  # does not fit: queued
    policy.on_request("small", 0.0, 100)  # would fit, but big is ahead
    assert policy.route("big") is None and policy.route("small") is None


def test_ta_admits_on_least_active_tokens_backend():
    policy = make("ta", replicas=2, gpu=1000)
    shrink(policy, 5000, 0, "r0")  # r0 has far more room ...
    policy.on_request("a", 0.0, 300)
    assert policy.route("a") == "r0"
    policy.on_request("b", 0.0, 200)  # ... but r1 has fewer active tokens
    assert policy.route("b") == "r1"


def test_ta_pauses_acting_smallest_first_and_has_no_cpu_tier():
    policy = make("ta", gpu=2000, cpu=10_000)
    step(policy, "big", 0.0, 700)
    step(policy, "small", 8.0, 200)  # the less idle one: MORI would keep it
    step(policy, "mid", 8.0, 400)
    shrink(policy, 1200, 10_000)  # 1300 tokens + 3 x 100: free 400, small (300) is not enough
    moves = policy.tick(10.0)
    assert [(m.program_id, m.dst, m.reason) for m in moves] == [
        ("small", WAIT, MoveReason.PAUSE),
        ("mid", WAIT, MoveReason.PAUSE),
    ]
    assert all(p.placement.tier is not Tier.CPU for p in policy.programs.values())


def test_ta_marks_reasoning_lazily_counting_marked_tokens():
    policy = make("ta", gpu=3000)
    for pid, tokens in (("a", 400), ("b", 300), ("c", 500)):
        policy.on_request(pid, 0.0, tokens)
    shrink(policy, 1000, 0)  # 1500 used: one small victim (300 + 100) is not enough, two are
    assert policy.tick(1.0) == []
    assert {p for p, q in policy.programs.items() if q.demote_after_step} == {"a", "b"}
    assert policy.pending_lazy_tokens("r0") == 700
    moves = policy.on_response("b", 2.0, 300)
    assert [(m.program_id, m.dst, m.reason) for m in moves] == [("b", WAIT, MoveReason.DEMOTE_LAZY)]


def test_ta_resumes_returning_before_new_smallest_first_best_fit():
    policy = make("ta", replicas=2, gpu=0)
    shrink(policy, 3000, 0, "r0")
    step(policy, "ret", 0.0, 900)
    shrink(policy, 0, 0, "r0")
    policy.tick(2.0)
    assert where(policy, "ret") == WAIT
    for pid, tokens in (("n_big", 900), ("n_small", 400), ("n_mid", 500)):
        policy.on_request(pid, 3.0, tokens)
    policy.on_request("ret", 3.0, 900)
    shrink(policy, 1100, 0, "r0")
    shrink(policy, 1000, 0, "r1")  # total 2100: ret (1000) + n_small (500) + n_mid (600)
    moves = policy.tick(5.0)
    placed = {m.program_id: m.dst.replica for m in moves}
    assert by_reason(moves, MoveReason.RESUME) == ["ret", "n_mid", "n_small"]  # largest first
    assert placed == {"ret": "r1", "n_mid": "r0", "n_small": "r0"}  # ret takes the tightest
    assert policy.route("n_big") is None


def test_ta_resume_waits_for_the_tick_after_a_lazy_pause():
    policy = make("ta", gpu=3000)
    policy.on_request("a", 0.0, 900)
    shrink(policy, 500, 0)
    policy.tick(1.0)
    policy.on_request("n", 2.0, 300)
    assert policy.route("n") is None
    policy.on_response("a", 3.0, 900)  # paused: room for n, but TA resumes on its tick
    assert policy.route("n") is None
    policy.tick(5.0)
    assert policy.route("n") == "r0"
    assert where(policy, "n") == Placement(Tier.GPU, "r0")


def test_ta_resume_counts_a_segment_the_replica_holds_once():
    """`c` holds a 300-token segment on r0; `a` and `b` share it, so each needs 100 new
    tokens there. After `hog` ends, one resume pass must place both: costing each at its
    whole context (400 + 100 overhead) would leave `b` held though it fits."""
    policy = make_policy("ta", PolicyConfig(tick_s=0.0))
    policy.add_replica("r0", ReplicaCapacity(1000 + 3 * OH, 0))
    shared = Segment("s", "scenario", 300)
    for pid, tokens in (("c", 400), ("hog", 600 + OH), ("a", 400), ("b", 400)):
        if pid != "hog":
            policy.on_prompt(pid, (shared,))
        policy.on_request(pid, 0.0, tokens)
    assert policy.route("a") is None and policy.route("b") is None
    policy.end("hog", 1.0)
    policy.tick(1.0)
    assert policy.route("a") == "r0" and policy.route("b") == "r0"
