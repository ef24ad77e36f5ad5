"""MORI's tier rules (MORI 4.3.1), one test per rule, driven through the public API."""

from __future__ import annotations

from router.policy import PolicyConfig, make_policy
from router.policy.base import Policy
from router.policy.types import Hint, MoveReason, Placement, ReplicaCapacity, Status, Tier

GPU0, CPU0 = Placement(Tier.GPU, "r0"), Placement(Tier.CPU, "r0")
GPU1 = Placement(Tier.GPU, "r1")
WAIT = Placement(Tier.WAITING)


def make(
    name: str = "mori-paper", replicas: int = 1, gpu: int = 1000, cpu: int = 1000, **cfg
) -> Policy:
    """A policy over `replicas` of `gpu`/`cpu` tokens; mori's overload rules (the door and
    the wait bound, tests/test_policy_overload.py) off unless asked for: these tests are
    about its other rules, on replicas a few programs fill."""
    policy = make_policy(name, PolicyConfig(**{"max_step_wait_s": 0.0, **cfg}))
    for i in range(replicas):
        policy.add_replica(f"r{i}", ReplicaCapacity(gpu, cpu))
    return policy


def step(policy: Policy, pid: str, start: float, tokens: int, reason_s: float = 1.0) -> float:
    """One request admitted at once and answered `reason_s` later; returns the answer time."""
    policy.on_request(pid, start, tokens)
    assert policy.route(pid) is not None, f"{pid} was not admitted at {start}"
    policy.on_response(pid, start + reason_s, tokens)
    return start + reason_s


def shrink(policy: Policy, gpu: int, cpu: int, replica: str = "r0") -> None:
    policy.set_capacity(replica, ReplicaCapacity(gpu, cpu))


def where(policy: Policy, pid: str) -> Placement:
    return policy.programs[pid].placement


def by_reason(moves, reason: MoveReason) -> list[str]:
    return [m.program_id for m in moves if m.reason is reason]


# demotion ---------------------------------------------------------------------------------
def _three_on_gpu(policy: Policy) -> None:
    """a idle since 1, b idle since 9 (less idle), c reasoning since 9.5."""
    step(policy, "a", 0.0, 300)
    step(policy, "b", 8.0, 300)
    policy.on_request("c", 9.5, 300)
    assert policy.route("c") == "r0"


def _four_orders(policy: Policy) -> None:
    """Four ACTING programs of 300 tokens whose orders all differ at t=10:
    most idle first c (0.8), d (0.5), b (0.09), a (0.01); least recently active first b,
    c, a, d; first come first a, b, c, d; least idle first a, b, d, c."""
    policy.on_request("a", -200.0, 300)  # a long step: came first, barely idle
    policy.on_request("b", -100.0, 300)
    policy.on_response("b", 0.0, 300)  # silent the longest, yet mostly reasoning
    policy.on_request("c", 5.0, 300)
    policy.on_response("c", 6.0, 300)  # 1 s reasoning, 4 s acting: the most idle
    policy.on_response("a", 7.0, 300)
    policy.on_request("d", 8.0, 300)
    policy.on_response("d", 9.0, 300)
    assert {p: round(policy.programs[p].idleness(10.0), 2) for p in "abcd"} == {
        "a": 0.01,
        "b": 0.09,
        "c": 0.8,
        "d": 0.5,
    }


def test_demotion_takes_most_idle_acting_first_not_lru_fifo_or_reversed():
    policy = make(gpu=2000)
    _four_orders(policy)
    shrink(policy, 900, 1000)  # one victim
    assert by_reason(policy.tick(10.0), MoveReason.DEMOTE) == ["c"]  # LRU: b; FIFO, reversed: a
    shrink(policy, 300, 1000)  # two more
    assert by_reason(policy.tick(10.0), MoveReason.DEMOTE) == ["d", "b"]
    assert where(policy, "a") == GPU0


def test_demotion_takes_acting_before_reasoning():
    policy = make()
    _three_on_gpu(policy)
    shrink(policy, 300, 1000)
    moves = policy.tick(10.0)
    assert by_reason(moves, MoveReason.DEMOTE) == ["a", "b"]
    assert where(policy, "c") == GPU0 and policy.programs["c"].demote_after_step is None


def test_reasoning_victim_is_demoted_lazily_and_counted_as_freed():
    policy = make()
    step(policy, "c", 0.0, 300)  # c: one cycle with a long tool call -> more idle
    policy.on_request("c", 9.0, 300)
    policy.on_request("d", 9.5, 300)  # d: new, idleness 0
    shrink(policy, 300, 1000)
    assert policy.tick(10.0) == []  # nothing moves mid-step
    assert policy.programs["c"].demote_after_step == CPU0
    assert policy.programs["d"].demote_after_step is None  # one victim frees enough
    assert policy.pending_lazy_tokens("r0") == 300
    policy.tick(11.0)  # re-ticking does not over-mark
    assert policy.programs["d"].demote_after_step is None
    moves = policy.on_response("c", 12.0, 300)
    assert [(m.program_id, m.dst, m.reason) for m in moves] == [("c", CPU0, MoveReason.DEMOTE_LAZY)]
    assert policy.tiers.used(GPU0) == 300


def test_lazy_mark_is_dropped_when_room_comes_back():
    policy = make()
    policy.on_request("c", 0.0, 600)
    policy.on_request("d", 0.0, 300)
    shrink(policy, 600, 1000)
    policy.tick(1.0)
    assert policy.pending_lazy_tokens("r0") == 600  # c and d tie at idleness 0: c first
    shrink(policy, 1000, 1000)
    policy.tick(2.0)
    assert policy.pending_lazy_tokens("r0") == 0
    assert policy.on_response("c", 3.0, 600) == [] and where(policy, "c") == GPU0


def test_demoted_go_to_cpu_if_it_fits_else_waiting():
    policy = make()
    _three_on_gpu(policy)
    shrink(policy, 300, 300)
    moves = policy.tick(10.0)
    assert [(m.program_id, m.dst) for m in moves] == [("a", CPU0), ("b", WAIT)]


def test_context_growth_past_budget_demotes_after_the_step():
    policy = make()
    step(policy, "a", 0.0, 500)
    policy.on_request("b", 5.0, 400)
    moves = policy.on_response("b", 6.0, 700)  # b grew: 1200 > 1000
    assert [(m.program_id, m.dst, m.reason) for m in moves] == [("a", CPU0, MoveReason.DEMOTE)]


def test_cpu_overflow_pushes_most_idle_to_waiting_not_lru_fifo_or_reversed():
    policy = make(gpu=2000, cpu=2000)
    _four_orders(policy)
    shrink(policy, 0, 2000)
    policy.tick(10.0)  # all four to CPU
    assert {where(policy, p) for p in "abcd"} == {CPU0}
    shrink(policy, 0, 600)
    moves = policy.tick(10.0)
    assert by_reason(moves, MoveReason.CPU_OVERFLOW) == ["c", "d"]


# promotion -----------------------------------------------------------------------------------
def _one_of_each_class(policy: Policy) -> None:
    """c on CPU, w in WAITING (returning), n new; all three gated, arriving n, w, c."""
    step(policy, "c", 0.0, 400)  # more idle at t=3: demoted first, gets the CPU room
    step(policy, "w", 1.0, 400)
    shrink(policy, 0, 400)
    policy.tick(3.0)
    assert where(policy, "c") == CPU0 and where(policy, "w") == WAIT
    for pid in ("n", "w", "c"):
        policy.on_request(pid, 4.0, 400)
    assert all(policy.route(pid) is None for pid in "nwc")


def test_promotion_classes_in_order_cpu_then_returning_then_new():
    for room, promoted in ((400, ["c"]), (800, ["c", "w"]), (1200, ["c", "w", "n"])):
        policy = make()
        _one_of_each_class(policy)
        shrink(policy, room, 400)
        moves = policy.tick(5.0)
        assert [m.program_id for m in moves] == promoted
        assert [m.reason for m in moves] == [
            MoveReason.PROMOTE_CPU,
            MoveReason.PROMOTE_WAITING,
            MoveReason.PROMOTE_NEW,
        ][: len(promoted)]
        assert all(policy.route(pid) == "r0" for pid in promoted)


def test_new_programs_smallest_first():
    policy = make(gpu=0)
    for pid, tokens in (("big", 500), ("small", 300), ("mid", 400)):
        policy.on_request(pid, 0.0, tokens)
    shrink(policy, 750, 1000)
    assert [m.program_id for m in policy.tick(1.0)] == ["mid", "small"]  # placed largest first
    assert policy.route("big") is None


def test_least_idle_first_within_a_class():
    policy = make(cpu=0)
    step(policy, "idle", 0.0, 400)
    step(policy, "busy", 8.0, 400)
    shrink(policy, 0, 0)
    policy.tick(10.0)  # both to WAITING
    policy.on_request("idle", 10.0, 400)  # idleness 9/10
    policy.on_request("busy", 10.0, 400)  # idleness 1/2
    shrink(policy, 500, 0)
    moves = policy.tick(11.0)
    assert [m.program_id for m in moves] == ["busy"]


def test_waiting_promotions_best_fit_decreasing():
    policy = make(replicas=2, gpu=0)
    for pid, tokens in (("c", 400), ("a", 500), ("b", 600)):
        policy.on_request(pid, 0.0, tokens)
    shrink(policy, 1000, 0, "r0")
    shrink(policy, 500, 0, "r1")
    moves = policy.tick(1.0)
    assert [(m.program_id, m.dst.replica) for m in moves] == [("b", "r0"), ("a", "r1"), ("c", "r0")]


def test_waiting_promotion_prefers_last_replica_when_it_fits():
    policy = make(replicas=2, cpu=0)
    step(policy, "w", 0.0, 400)
    policy.on_request("x", 0.0, 400)  # r0: less loaded -> second program lands on r1
    assert where(policy, "w").replica != where(policy, "x").replica
    last = where(policy, "w").replica
    shrink(policy, 0, 0, last)
    policy.tick(2.0)
    assert where(policy, "w") == WAIT
    shrink(policy, 500, 0, last)  # the other replica keeps more room (600 free)
    policy.on_request("w", 3.0, 400)
    assert policy.route("w") == last


def test_backfill_places_what_best_fit_decreasing_left_room_for():
    policy = make(replicas=2, cpu=0)
    for start, pid, tokens in ((0.0, "c", 300), (1.0, "b", 350), (2.0, "a", 350)):
        step(policy, pid, start, tokens)
    for r in ("r0", "r1"):
        shrink(policy, 0, 0, r)
    policy.tick(4.0)
    for pid in ("a", "b", "c", "d"):  # returning a < b < c by idleness, then new d
        policy.on_request(pid, 5.0, policy.programs[pid].context_tokens if pid != "d" else 150)
    for r in ("r0", "r1"):
        shrink(policy, 500, 0, r)
    moves = policy.tick(6.0)  # a, b, c fill the total room, but c does not fit in a bin
    assert [(m.program_id, m.reason) for m in moves] == [
        ("a", MoveReason.PROMOTE_WAITING),
        ("b", MoveReason.PROMOTE_WAITING),
        ("d", MoveReason.PROMOTE_NEW),
    ]
    assert policy.route("c") is None


def test_cpu_promotion_keeps_its_replica():
    policy = make(replicas=2)
    step(policy, "c", 0.0, 400)
    home = where(policy, "c").replica
    shrink(policy, 0, 1000, home)
    policy.tick(2.0)
    assert where(policy, "c") == Placement(Tier.CPU, home)
    policy.on_request("c", 3.0, 400)  # the other replica is empty, home has no room
    assert policy.route("c") is None
    policy.tick(4.0)
    assert where(policy, "c").tier is Tier.CPU
    shrink(policy, 500, 1000, home)
    moves = policy.tick(5.0)
    assert [(m.program_id, m.dst, m.reason) for m in moves] == [
        ("c", Placement(Tier.GPU, home), MoveReason.PROMOTE_CPU)
    ]
    assert policy.route("c") == home


def test_held_cpu_program_of_a_failed_replica_is_replaced_at_once():
    policy = make(replicas=2)
    step(policy, "c", 0.0, 400)
    home = where(policy, "c").replica
    other = "r1" if home == "r0" else "r0"
    shrink(policy, 0, 1000, home)
    policy.tick(2.0)
    policy.on_request("c", 3.0, 400)
    assert policy.route("c") is None  # affinity: waits for its replica
    moves = policy.set_healthy(home, False, 4.0)
    assert [(m.program_id, m.reason) for m in moves] == [
        ("c", MoveReason.DRAIN),
        ("c", MoveReason.PROMOTE_WAITING),
    ]
    assert policy.route("c") == other


# stickiness -----------------------------------------------------------------------------------
def _swap_scene(policy: Policy) -> None:
    """v fills r0's GPU and starts a tool call at 3.2; p (busy: 1 s steps, 0.1 s tools) is
    drained from r1 and asks again at 3.3, with no room anywhere."""
    t = s = 0.0
    for _ in range(3):
        t = step(policy, "v", t, 1000) + 0.1
        s = step(policy, "p", s, 500) + 0.1
    assert where(policy, "p") == GPU1 and where(policy, "v") == GPU0
    policy.set_healthy("r1", False, s)
    policy.on_request("p", s, 500)
    assert policy.route("p") is None


def test_phase_mismatch_swaps_a_clearly_more_idle_program():
    policy = make(replicas=2)
    _swap_scene(policy)
    moves = policy.tick(63.2)  # v has been in its tool call for 60 s
    assert [(m.program_id, m.dst, m.reason) for m in moves] == [
        ("v", CPU0, MoveReason.DEMOTE),
        ("p", GPU0, MoveReason.PROMOTE_WAITING),
    ]
    assert policy.route("p") == "r0"


def test_cpu_program_swaps_in_on_its_replica_and_its_victim_takes_its_cpu_room():
    policy = make(gpu=1000, cpu=500)
    t = step(policy, "c", 0.0, 500)  # c: busy, 1 s steps and 0.1 s tools
    step(policy, "c", t + 0.1, 500)
    policy.on_request("c", 2.2, 500)
    policy.on_request("v", 2.5, 500)
    shrink(policy, 500, 500)
    policy.tick(3.0)  # both reasoning: c (a little more idle than new v) is marked
    assert [m.dst for m in policy.on_response("c", 3.5, 500)] == [CPU0]
    policy.on_request("c", 3.6, 500)  # held: v fills GPU(r0)
    policy.on_response("v", 4.0, 500)
    assert policy.route("c") is None
    moves = policy.tick(60.0)  # v has been in a tool call for 56 s
    assert [(m.program_id, m.dst, m.reason) for m in moves] == [
        ("v", CPU0, MoveReason.DEMOTE),
        ("c", GPU0, MoveReason.PROMOTE_CPU),
    ]


def test_room_left_over_by_a_swap_is_filled_in_the_same_tick():
    policy = make(replicas=2)
    _swap_scene(policy)
    policy.on_request("n", 3.3, 400)  # new: never swaps anyone in, but may use what is left
    moves = policy.tick(63.2)
    assert [(m.program_id, m.reason) for m in moves] == [
        ("v", MoveReason.DEMOTE),
        ("p", MoveReason.PROMOTE_WAITING),
        ("n", MoveReason.PROMOTE_NEW),
    ]


def test_hysteresis_no_churn_on_small_idleness_difference():
    policy = make(replicas=2, hysteresis=0.2)
    _swap_scene(policy)
    now = 3.5  # v is barely more idle than p
    v, p = policy.programs["v"], policy.programs["p"]
    assert 0 < v.idleness(now) - p.idleness(now) < 0.2
    assert policy.tick(now) == []
    assert where(policy, "v") == GPU0 and policy.route("p") is None


# admission ------------------------------------------------------------------------------------
def test_immediate_admission_when_room():
    policy = make()
    moves = policy.on_request("a", 0.0, 300)
    assert [(m.program_id, m.dst, m.reason) for m in moves] == [("a", GPU0, MoveReason.ADMIT)]
    assert policy.route("a") == "r0"
    policy.on_response("a", 1.0, 350)
    assert policy.on_request("a", 2.0, 350) == [] and policy.route("a") == "r0"  # released


def test_admission_never_jumps_a_higher_class():
    policy = make(cpu=0)
    step(policy, "w", 0.0, 600)
    shrink(policy, 0, 0)
    policy.tick(2.0)
    policy.on_request("w", 3.0, 600)  # returning, gated
    shrink(policy, 700, 0)  # room appears between ticks
    moves = policy.on_request("n", 4.0, 300)  # n alone would fit, but w comes first
    assert [m.program_id for m in moves] == ["w"]
    assert policy.route("n") is None and policy.route("w") == "r0"


def test_room_freed_by_a_lazy_demotion_admits_at_once():
    policy = make(gpu=1000, cpu=1000)
    policy.on_request("a", 0.0, 600)
    step(policy, "b", 0.0, 400)
    shrink(policy, 500, 1000)
    policy.tick(2.0)  # b demoted, a marked
    policy.on_request("n", 3.0, 500)
    assert policy.route("n") is None
    moves = policy.on_response("a", 4.0, 600)
    assert [(m.program_id, m.reason) for m in moves] == [
        ("a", MoveReason.DEMOTE_LAZY),
        ("n", MoveReason.PROMOTE_NEW),
    ]
    assert policy.route("n") == "r0"


def test_end_gives_room_to_the_gate_at_once():
    policy = make()
    policy.on_request("a", 0.0, 800)
    policy.on_request("b", 0.0, 500)
    assert policy.route("b") is None
    moves = policy.end("a", 1.0)
    assert [(m.program_id, m.reason) for m in moves] == [
        ("a", MoveReason.END),
        ("b", MoveReason.PROMOTE_NEW),
    ]


# lifecycle ------------------------------------------------------------------------------------
def test_idle_lease_expires_acting_programs_only():
    policy = make(lease_s=100.0)
    step(policy, "a", 0.0, 300)
    policy.on_request("g", 0.0, 900)  # gated forever: not expired
    moves = policy.tick(102.0)
    assert (moves[0].program_id, moves[0].reason) == ("a", MoveReason.LEASE)
    assert "a" not in policy.programs and "g" in policy.programs
    assert policy.route("g") == "r0"  # a's room went to g in the same tick
    assert policy.hint_updates()["r0"]["a"] is Hint.INACTIVE


def test_end_sends_inactive_hint_and_forgets():
    policy = make(replicas=2)
    step(policy, "a", 0.0, 300)
    replica = where(policy, "a").replica
    policy.hint_updates()
    assert [m.reason for m in policy.end("a", 2.0)] == [MoveReason.END]
    assert policy.hint_updates() == {replica: {"a": Hint.INACTIVE}}
    assert "a" not in policy.programs and policy.describe("a", 2.0) is None
    assert all("a" not in h for h in policy.hints().values())


def test_end_of_a_waiting_program_still_tells_its_last_replica():
    policy = make(cpu=0)
    step(policy, "a", 0.0, 300)
    shrink(policy, 0, 0)
    policy.tick(2.0)
    policy.hint_updates()
    assert policy.end("a", 3.0) == []
    assert policy.hint_updates() == {"r0": {"a": Hint.INACTIVE}}


# replicas -------------------------------------------------------------------------------------
def test_drain_moves_everything_to_waiting_and_replaces_on_healthy_only():
    policy = make(replicas=2)
    step(policy, "a", 0.0, 300)
    step(policy, "b", 0.0, 300)
    ra = where(policy, "a").replica
    shrink(policy, 300, 1000, ra)
    policy.on_request("x", 1.5, 300)  # x lands wherever there is room
    moves = policy.set_healthy(ra, False, 2.0)
    assert all(m.reason is MoveReason.DRAIN and m.dst == WAIT for m in moves)
    assert all(p.placement.replica != ra for p in policy.programs.values())
    for t, pid in enumerate(policy.programs):
        if policy.programs[pid].status is Status.ACTING:
            policy.on_request(pid, 3.0 + t, 300)
        assert policy.route(pid) in (None, *[r for r in ("r0", "r1") if r != ra])
    policy.tick(10.0)
    assert all(policy.route(pid) != ra for pid in policy.programs)


def test_nothing_routes_when_every_replica_is_down():
    policy = make(replicas=2)
    policy.set_healthy("r0", False, 0.0)
    policy.set_healthy("r1", False, 0.0)
    policy.on_request("a", 1.0, 300)
    assert policy.route("a") is None and policy.tick(2.0) == []
    moves = policy.set_healthy("r1", True, 3.0)
    assert [(m.program_id, m.dst) for m in moves] == [("a", GPU1)]


# hints ------------------------------------------------------------------------------------------
def test_hint_updates_batch_changes_per_replica_once():
    policy = make(replicas=2)
    step(policy, "a", 0.0, 300)
    step(policy, "b", 0.0, 300)
    ra, rb = where(policy, "a").replica, where(policy, "b").replica
    assert policy.hint_updates() == {ra: {"a": Hint.BUSY}, rb: {"b": Hint.BUSY}}
    assert policy.hint_updates() == {}
    shrink(policy, 0, 1000, ra)
    policy.tick(5.0)
    assert policy.hint_updates() == {ra: {"a": Hint.IDLE}}
    assert policy.hints() == {ra: {"a": Hint.IDLE}, rb: {"b": Hint.BUSY}}


# aging (a MORI addition, off by default) ----------------------------------------------------
def test_aged_request_swaps_out_an_acting_program_whatever_its_idleness():
    policy = make(replicas=2, hysteresis=0.2, aging_s=0.1)
    _swap_scene(policy)  # p held since 3.3; v barely more idle than p (see hysteresis test)
    assert policy.tick(3.35) == []  # held 0.05 s: not aged yet, and v is within hysteresis
    moves = policy.tick(3.5)
    assert [(m.program_id, m.dst, m.reason) for m in moves] == [
        ("v", CPU0, MoveReason.DEMOTE),
        ("p", GPU0, MoveReason.PROMOTE_WAITING),
    ]
    assert policy.route("p") == "r0"


def test_aged_request_goes_before_a_higher_class():
    policy = make(cpu=1000, aging_s=10.0)
    step(policy, "c", 0.0, 500)
    step(policy, "w", 0.0, 500)
    shrink(policy, 0, 500)
    policy.tick(1.5)  # both demoted: one to CPU, the other (no CPU room) to WAITING
    cpu_id = next(pid for pid in "cw" if where(policy, pid) == CPU0)
    waiting_id = "w" if cpu_id == "c" else "c"
    policy.on_request(waiting_id, 2.0, 500)  # class 2, held first
    policy.on_request(cpu_id, 20.0, 500)  # class 1, held later
    shrink(policy, 500, 500)  # room for one of them
    moves = policy.tick(20.5)  # the WAITING request has waited 18.5 s >= aging_s
    assert [m.program_id for m in moves] == [waiting_id]


# growth reserve ----------------------------------------------------------------------------
def _growing(policy: Policy) -> None:
    """a grew by 200 tokens in its last step and is reasoning again (550 of 1000 tokens)."""
    step(policy, "a", 0.0, 300)
    policy.on_request("a", 1.5, 400)
    policy.on_response("a", 2.5, 500)  # last step: 300 -> 500
    policy.on_request("a", 3.0, 550)
    assert policy.route("a") == "r0"


def test_promotion_leaves_room_for_the_growth_of_reasoning_programs():
    policy = make()
    _growing(policy)
    assert policy.promotion_reserve("r0") == 200
    policy.on_request("n", 3.1, 400)  # fits the 450 free tokens, not 450 - 200
    assert policy.route("n") is None
    assert policy.tick(5.0) == [] and policy.route("n") is None


def test_acting_programs_reserve_nothing():
    policy = make()
    _growing(policy)
    policy.on_response("a", 4.0, 600)  # a acting (600): 400 free, no reserve
    assert policy.promotion_reserve("r0") == 0
    policy.on_request("n", 4.1, 400)
    assert policy.route("n") == "r0"


def _idle_beside_growth(policy: Policy, tool: str) -> None:
    """`i` (300 tokens) in a call of `tool`, and `a` reasoning again after a step that grew
    it by 200: 850 of 1200 tokens used. `ls` calls have lasted 0.1 s (a step: ~1 s)."""
    t = -20.0
    for _ in range(5):
        t = step(policy, "t", t, 100)
        policy.on_tool_start("t", t, "ls")
        t += 0.1
    policy.end("t", t)
    step(policy, "i", 0.0, 300)
    policy.on_tool_start("i", 1.0, tool)
    _growing(policy)


def test_growth_an_idle_program_would_absorb_leaves_no_band():
    """The band waits for growth a step end brings; an overflow then demotes `i`, whose
    tool call is expected to outlast a step: the request runs now, and nobody moves."""
    policy = make("mori", gpu=1200, cpu=2000)
    _idle_beside_growth(policy, "build")
    assert policy.promotion_reserve("r0") == 200
    moves = policy.on_request("n", 3.1, 300)  # fits the 350 free tokens, not 350 - 200
    assert [(m.program_id, m.reason) for m in moves] == [("n", MoveReason.ADMIT)]


def test_the_band_holds_when_the_idle_program_is_back_within_a_step():
    """The request fits only by displacing `i` (the priced move), not into the band."""
    policy = make("mori", gpu=1200, cpu=2000)
    _idle_beside_growth(policy, "ls")
    moves = policy.on_request("n", 3.1, 300)
    assert ("i", MoveReason.DEMOTE) in [(m.program_id, m.reason) for m in moves]


def test_the_band_holds_on_a_replica_running_more_steps_than_the_waiver_allows():
    """Without the waiver the request fits only by displacing `i`."""
    policy = make("mori", gpu=1200, cpu=2000, band_waiver_steps=0)
    _idle_beside_growth(policy, "build")
    moves = policy.on_request("n", 3.1, 300)
    assert ("i", MoveReason.DEMOTE) in [(m.program_id, m.reason) for m in moves]
