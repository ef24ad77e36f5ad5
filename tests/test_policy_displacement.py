"""`mori-priced` (the default's base): priced, work-conserving displacement, aging, host room.

The paper's rules it keeps are tested in test_policy_mori.py (against `mori-paper`).
"""

from __future__ import annotations

import pytest

from router.policy import PolicyConfig, make_policy
from router.policy.engine import MoriEngine
from router.policy.ordering import held_class
from router.policy.predictor import MIN_DIST_SAMPLES
from router.policy.types import (
    AgentHints,
    MoveReason,
    Placement,
    ReplicaCapacity,
    Status,
    Tier,
)

GPU0, CPU0 = Placement(Tier.GPU, "r0"), Placement(Tier.CPU, "r0")
GPU1 = Placement(Tier.GPU, "r1")
WAIT = Placement(Tier.WAITING)


def make(gpu: int = 1000, cpu: int = 2000, replicas: int = 1, **cfg) -> MoriEngine:
    cfg = {"load_s_per_token": 1e-4, "prefill_s_per_token": 1e-3, "aging_s": 0.0} | cfg
    policy = make_policy("mori-priced", PolicyConfig(**cfg))
    assert isinstance(policy, MoriEngine)
    for i in range(replicas):
        policy.add_replica(f"r{i}", ReplicaCapacity(gpu, cpu))
    return policy


def acting(policy: MoriEngine, pid: str, start: float, tokens: int, tool: str | None = None):
    """A program admitted at `start`, answered 1 s later, now in `tool` (unknown if None)."""
    policy.on_request(pid, start, tokens)
    assert policy.route(pid) is not None, f"{pid} was not admitted at {start}"
    policy.on_response(pid, start + 1.0, tokens)
    if tool is not None:
        policy.on_tool_start(pid, start + 1.0, tool)


def teach(policy: MoriEngine, tool: str, duration_s: float) -> None:
    for _ in range(MIN_DIST_SAMPLES):
        policy.forecast.predictor.observe(None, tool, duration_s)


def where(policy: MoriEngine, pid: str) -> Placement:
    return policy.programs[pid].placement


def test_abandoned_programs_make_room_for_a_new_one_at_once():
    """GPU full of programs in tool calls (cold start: 5 s expected) and a new request: the
    move costs a 0.08 s reload, so the new program is admitted on arrival."""
    policy = make()
    acting(policy, "a", 0.0, 800)
    policy.on_request("n", 2.0, 400)
    assert policy.route("n") == "r0"
    assert where(policy, "a") == CPU0


def test_no_displacement_when_the_move_does_not_pay():
    """No host room: the victim would be recomputed (800 x 1e-2 = 8 s), more than the 5 s it
    is expected to stay away, so the new request waits."""
    policy = make(cpu=0, prefill_s_per_token=1e-2)
    acting(policy, "a", 0.0, 800)
    policy.on_request("n", 2.0, 400)
    assert policy.route("n") is None and where(policy, "a") == GPU0
    policy.tick(5.0)
    assert policy.route("n") is None


def test_recent_return_waits_raise_the_bar_for_a_recompute():
    """Programs moved off the GPU have waited 100 s at the gate lately: moving one more,
    to be recomputed (no host room), for an expected 5 s away does not pay."""
    policy = make(cpu=0)
    policy.forecast.return_wait_s = 100.0
    acting(policy, "a", 0.0, 800)  # recompute alone: 0.8 s
    policy.on_request("n", 2.0, 400)
    assert policy.route("n") is None


def test_return_waits_do_not_count_when_the_kv_stays_on_host():
    policy = make()
    policy.forecast.return_wait_s = 100.0
    acting(policy, "a", 0.0, 800)
    policy.on_request("n", 2.0, 400)
    assert policy.route("n") == "r0" and where(policy, "a") == CPU0


def test_a_recompute_is_priced_per_step_it_stalls():
    """Recomputing a (1.2 s of prefill) pauses the 4 steps running beside it: 6 s of
    stalled steps against an expected 5 s away does not pay; alone it would."""
    policy = make(gpu=2000, cpu=0)
    acting(policy, "a", 0.0, 1200)
    for i in range(4):
        policy.on_request(f"r{i}", 1.5, 100)  # running steps
    policy.on_request("n", 2.0, 800)
    assert policy.route("n") is None
    alone = make(gpu=2000, cpu=0)
    acting(alone, "a", 0.0, 1200)
    alone.on_request("n", 2.0, 1000)
    assert alone.route("n") == "r0" and where(alone, "a") == WAIT


def test_return_wait_is_learned_from_programs_that_lost_their_room():
    policy = make()
    acting(policy, "a", 0.0, 800)
    policy.on_request("n", 2.0, 400)  # a goes to CPU; n reasons until it ends
    policy.on_request("a", 4.0, 820)  # back from its call: 600 free, n cannot move
    assert policy.route("a") is None and where(policy, "a") == CPU0
    policy.end("n", 10.0)  # room: a goes back after 6 s at the gate
    assert policy.route("a") == "r0"
    assert policy.forecast.return_wait_s == pytest.approx(0.1 * 6.0)


def test_victims_are_taken_farthest_expected_return_first():
    """Four ACTING programs whose orders all differ: expected return (the rule) picks m;
    least recently active picks l, first come picks f, the reversed rule picks r."""
    policy = make(gpu=1000, cpu=4000)
    teach(policy, "Edit", 20.0)
    teach(policy, "Bash:pytest", 60.0)
    teach(policy, "Read", 0.5)
    teach(policy, "Glob", 5.0)
    acting(policy, "f", -50.0, 250, "Glob")  # first to arrive; call restarted below
    policy.on_request("f", 16.0, 250)
    policy.on_response("f", 17.0, 250)
    policy.on_tool_start("f", 17.0, "Glob")  # expected back in ~3 s at t=19
    acting(policy, "l", -1.0, 250, "Edit")  # least recently active; ~1 s left at t=19
    acting(policy, "m", 14.0, 250, "Bash:pytest")  # ~56 s left at t=19
    acting(policy, "r", 17.9, 250, "Read")  # ~0.4 s left at t=19
    left = {pid: policy.forecast.expected_idle_s(policy.programs[pid], 19.0) for pid in "flmr"}
    assert left["m"] > left["f"] > left["l"] > left["r"]
    policy.on_request("n", 19.0, 250)
    assert policy.route("n") == "r0"
    assert [pid for pid in "flmr" if where(policy, pid) != GPU0] == ["m"]


def test_a_cpu_program_displaces_on_its_own_replica():
    policy = make(gpu=1000, cpu=4000, replicas=2)
    acting(policy, "c", 0.0, 600)
    policy.set_capacity("r0", ReplicaCapacity(0, 4000))
    policy.tick(2.0)  # c demoted to CPU(r0)
    policy.set_capacity("r0", ReplicaCapacity(1000, 4000))
    acting(policy, "a", 3.0, 900)
    assert where(policy, "a") == GPU0 or where(policy, "a") == GPU1
    if where(policy, "a") == GPU1:  # make r0 the replica a sits on
        pytest.skip("a landed on r1")  # pragma: no cover (BFD puts a on r0: most room)
    policy.on_request("c", 6.0, 600)
    assert policy.route("c") == "r0" and where(policy, "a") != GPU0


def test_aged_request_displaces_even_when_the_move_does_not_pay():
    policy = make(cpu=0, prefill_s_per_token=1e-2, aging_s=30.0)
    acting(policy, "a", 0.0, 800)
    policy.on_request("n", 2.0, 400)
    assert policy.route("n") is None
    policy.tick(31.0)
    assert policy.route("n") is None  # held 29 s
    moves = policy.tick(32.0)
    assert policy.route("n") == "r0" and where(policy, "a") == WAIT
    assert [m.reason for m in moves] == [MoveReason.DEMOTE, MoveReason.PROMOTE_NEW]


def test_aging_is_on_by_default():
    assert make_policy("mori").aging_s > 0
    assert make_policy("mori-paper").aging_s == 0


def test_reasoning_programs_are_never_displaced():
    policy = make(aging_s=1.0)
    policy.on_request("a", 0.0, 800)  # REASONING
    policy.on_request("n", 0.5, 400)
    policy.tick(10.0)
    assert policy.route("n") is None and policy.programs["a"].status is Status.REASONING


def test_host_room_leaves_out_the_gpu_tier_backups():
    """HiCache keeps a host copy of every GPU block: with host = GPU and the GPU tier full
    there is no host room left, yet a program demoted off that GPU keeps the copy it has
    (the host holds the same blocks before and after), so it goes to CPU, not WAITING."""
    policy = make(gpu=1000, cpu=1000)
    acting(policy, "a", 0.0, 500)
    acting(policy, "b", 0.5, 500)
    assert policy.forecast.host_room("r0") == 0
    policy.set_capacity("r0", ReplicaCapacity(500, 1000))
    policy.tick(3.0)
    assert sorted(map(str, (where(policy, "a"), where(policy, "b")))) == sorted(
        map(str, (CPU0, GPU0))
    )


def test_a_victim_swapped_for_a_cpu_program_keeps_its_host_copy():
    """Host = GPU, both full: x on the CPU tier returns and displaces a. x's KV comes back
    from host and a's stays there: the host holds the same blocks, so a goes to CPU and is
    priced as a reload. Asking a's size in free host room on top counted a twice: it went
    to WAITING, its host copy first to go (the demo cell recomputed 40 % of such prompts)."""
    policy = make(gpu=1000, cpu=1500)
    acting(policy, "x", 0.0, 500)
    acting(policy, "a", 0.5, 500)
    acting(policy, "b", 0.6, 500)  # x (least recently active) moved to CPU for b
    assert where(policy, "x") == CPU0 and policy.forecast.host_room("r0") == 0
    policy.on_request("x", 60.0, 500)
    assert where(policy, "x") == GPU0 and policy.route("x") == "r0"
    assert CPU0 in (where(policy, "a"), where(policy, "b"))
    assert WAIT not in (where(policy, "a"), where(policy, "b"))


def test_a_victim_swapped_for_a_program_without_a_host_copy_loses_its_own():
    """The same, but the newcomer n has no host copy: its KV is written through to a full
    host, so the victim's copy does not survive and it goes to WAITING."""
    policy = make(gpu=1000, cpu=1000)
    acting(policy, "a", 0.0, 500)
    acting(policy, "b", 0.5, 500)
    policy.on_request("n", 60.0, 500)
    assert where(policy, "n") == GPU0
    assert WAIT in (where(policy, "a"), where(policy, "b"))


def test_learned_prices_change_the_decision():
    """A replica that turns out to recompute fast makes a move pay that did not."""
    policy = make(cpu=0, prefill_s_per_token=1e-2)
    acting(policy, "a", 0.0, 800)
    for _ in range(200):  # measured: 2000 tokens prefilled in 0.2 s
        policy.observe_step("r0", 2000, 0, 0, 0.2)
    policy.on_request("n", 2.0, 400)
    assert policy.route("n") == "r0"


def test_describe_shows_the_expected_idle_time():
    policy = make()
    acting(policy, "a", 0.0, 300, "Bash:pytest")
    assert policy.describe("a", 2.0)["expected_idle_s"] == pytest.approx(30.0)


def teach_mixed(policy: MoriEngine, tool: str) -> None:
    """Calls of `tool`: 4 in 5 take 1 s, 1 in 5 takes 200 s (mean residual at 0 s: 40.8 s)."""
    for _ in range(4 * MIN_DIST_SAMPLES):
        policy.forecast.predictor.observe(None, tool, 1.0)
    for _ in range(MIN_DIST_SAMPLES):
        policy.forecast.predictor.observe(None, tool, 200.0)


@pytest.mark.parametrize(("confidence", "moved"), [(0.3, False), (0.1, True)])
def test_a_victim_that_usually_comes_back_soon_is_not_moved(confidence, moved):
    """No host room: moving `a` costs an 8 s recompute. Its tool's mean residual (~40 s)
    covers that, but 4 calls in 5 end within a second: at confidence 0.3 it stays; at 0.1
    (the long calls alone make it pay) it goes."""
    policy = make(cpu=0, prefill_s_per_token=1e-2, displace_confidence=confidence)
    teach_mixed(policy, "bash")
    acting(policy, "a", 0.0, 800, tool="bash")
    assert policy.forecast.expected_idle_s(policy.programs["a"], 1.0) > 30.0
    policy.on_request("n", 1.05, 400)
    assert (policy.route("n") == "r0") is moved
    assert (where(policy, "a") == GPU0) is not moved


def test_victims_are_ranked_only_when_a_request_waits():
    """While nothing waits at the gate, neither a tick nor a step's end ranks the GPU's
    ACTING programs as victims (the request path's cost, 50 programs: 37 -> 19 us per
    request); a request that must displace ranks them then, with the time it does so."""
    policy = make(gpu=3000)
    ranked: list[str] = []
    priced = policy.forecast.residuals
    policy.forecast.residuals = lambda programs, more, now: (
        ranked.extend(p.program_id for p in programs) or priced(programs, more, now)
    )
    acting(policy, "a", 0.0, 1000)
    policy.tick(5.0)
    acting(policy, "b", 6.0, 1000)
    policy.tick(10.0)
    acting(policy, "c", 11.0, 1000)
    assert ranked == []
    policy.on_request("n", 20.0, 1000)  # the tier is full: someone must move for it
    assert policy.route("n") == "r0"
    assert sorted(set(ranked)) == ["a", "b", "c"]


def test_a_pool_requests_take_from_is_ranked_again_by_the_tick():
    """A tick re-ranks the victim pool a request took from since it was ranked, at the
    tick's end, so the next request that must displace finds it ranked (the event path
    stays cheap at 10 000 programs); a pool nobody took from is not ranked again."""
    policy = make(gpu=4000)
    ranked_at: list[float] = []
    priced = policy.forecast.residuals
    policy.forecast.residuals = lambda programs, more, now: (
        ranked_at.append(now) or priced(programs, more, now)
    )
    for k, pid in enumerate("abcd"):
        acting(policy, pid, float(k), 1000)
    policy.on_request("n", 20.0, 1000)  # the tier is full: someone must move for it
    assert policy.route("n") == "r0" and ranked_at == [20.0]
    policy.tick(25.0)
    assert ranked_at == [20.0, 25.0]  # ranked again as the tick ends
    policy.on_request("m", 26.0, 1000)
    assert policy.route("m") == "r0" and ranked_at == [20.0, 25.0]  # taken as ranked
    policy.tick(30.0)
    policy.tick(35.0)  # nobody took from it since 30
    assert ranked_at == [20.0, 25.0, 30.0]


def test_a_move_is_priced_by_what_the_request_brings():
    """Host full (host room 0), recomputes dear (500 tokens: 10 s), reloads cheap (0.05 s).
    A new request brings no host copy: its KV is written to host anew, a victim's copy
    would not survive, the move is a recompute and does not pay, so it waits. The CPU-tier
    program x brings its copy: the victim keeps its own, the move is a reload and pays."""
    policy = make(gpu=1000, cpu=1500, prefill_s_per_token=2e-2)
    acting(policy, "x", 0.0, 500)
    acting(policy, "a", 0.5, 500)
    acting(policy, "b", 0.6, 500)  # x moved to CPU (host room was 500)
    assert where(policy, "x") == CPU0 and policy.forecast.host_room("r0") == 0
    policy.tick(1.9)  # victims are priced per tick (b's move was priced with host room)
    policy.on_request("n", 2.0, 500)
    assert policy.programs["n"].pending and where(policy, "n") == WAIT
    policy.on_request("x", 2.5, 500)
    assert where(policy, "x") == GPU0 and policy.route("x") == "r0"
    assert CPU0 in (where(policy, "a"), where(policy, "b"))
    assert policy.programs["n"].pending


@pytest.mark.parametrize("name", ["mori", "mori+space"])
def test_held_requests_ranked_at_once_rank_as_one_at_a_time(name: str):
    """The tick ranks every held request at once (`rank_many`: the queue's rebuild, the
    priced pass's order); each key must be the one `rank(now)` gives it alone, classes,
    client priorities and idleness mixed (a key off by anything reorders the queue)."""
    cfg = PolicyConfig(load_s_per_token=1e-4, max_step_wait_s=0)  # no door: starts held too
    policy = make_policy(name, cfg)
    assert isinstance(policy, MoriEngine)
    policy.add_replica("r0", ReplicaCapacity(3000, 1500))

    def ask(pid: str, now: float, tokens: int, priority: int) -> None:
        policy.on_prompt(pid, [], hints=AgentHints(priority=priority))
        policy.on_request(pid, now, tokens)

    t = 0.0
    for step in range(4):  # 14 programs on room for ~6: moved off, held, let in in turns
        for i in range(14):
            t += 0.5
            p = policy.programs.get(f"p{i}")
            if p is None or p.status is Status.ACTING:
                ask(f"p{i}", t, 300 + 97 * i + 60 * step, i % 3)
            elif p.status is Status.REASONING:
                policy.on_response(f"p{i}", t, p.context_tokens + 50)
        policy.tick(t)
    for i in range(14, 18):  # and new programs that have not run
        ask(f"p{i}", t, 400 + 50 * i, i % 2)
    held = [p for p in policy.held_programs() if p.placement.tier is not Tier.GPU]
    assert {held_class(p) for p in held} >= {1, 2}, "returning and new requests held"
    assert len({p.priority for p in held}) > 1
    assert len({p.idleness(t) for p in held if held_class(p) == 1}) > 1
    one = policy.ordering.rank(t)  # type: ignore[attr-defined]
    assert policy.ordering.rank_many(held, t) == [one(p) for p in held]  # type: ignore[attr-defined]
