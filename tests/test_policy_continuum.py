"""`continuum`: TTL pins priced by Continuum's cost model, program-level FCFS, head-of-line."""

from __future__ import annotations

import math

import pytest

from router.policy import PolicyConfig, make_policy
from router.policy.continuum import K_COLD, ContinuumPolicy
from router.policy.types import Hint, MoveReason, Placement, ReplicaCapacity, Tier

GPU0 = Placement(Tier.GPU, "r0")
WAIT = Placement(Tier.WAITING)
RELOAD = 1e-3  # s per token from host: a 2000-token context reloads in 2 s


def make(gpu: int = 1000, replicas: int = 1, **cfg) -> ContinuumPolicy:
    cfg = {"load_s_per_token": RELOAD, "prefill_s_per_token": 1e-2} | cfg
    policy = make_policy("continuum", PolicyConfig(**cfg))
    assert isinstance(policy, ContinuumPolicy)
    for i in range(replicas):
        policy.add_replica(f"r{i}", ReplicaCapacity(gpu, gpu))
    return policy


def finish(policy: ContinuumPolicy, pid: str, start: float, tokens: int, tool: str | None):
    """One step: admitted at `start`, answered 1 s later, then its tool call (if any)."""
    policy.on_request(pid, start, tokens)
    assert policy.route(pid) == "r0", f"{pid} not admitted at {start}"
    moves = policy.on_response(pid, start + 1.0, tokens)
    if tool is not None:
        moves += policy.on_tool_start(pid, start + 1.0, tool)
    return moves


def test_cold_start_ttl_is_log_of_the_benefit():
    """Before K tool records: Exp(1) durations and eta = 1 give tau* = ln(B), B = T + reload."""
    policy = make(gpu=10_000)
    finish(policy, "a", 0.0, 2000, "Bash")
    assert policy.pins["a"] == pytest.approx(1.0 + math.log(2000 * RELOAD))
    finish(policy, "b", 0.0, 500, "Bash")  # B = 0.5 s < 1 s: not worth pinning
    assert "b" not in policy.pins and policy.programs["b"].placement == WAIT


def test_ttl_from_the_empirical_cdf_once_warm():
    """tau* = argmax P(tau) x B - tau over observed durations: with 90 % of calls at 1 s and
    10 % at 100 s and B = 2 s, pinning for 1 s wins (0.9 x 2 - 1 > 0; 100 s never pays)."""
    policy = make(gpu=10_000)
    for i in range(K_COLD + 1):
        policy._record("Bash", 100.0 if i % 10 == 0 else 1.0)
    finish(policy, "a", 0.0, 2000, "Bash")
    assert policy.pins["a"] == pytest.approx(1.0 + 1.0)


def test_long_tools_are_not_pinned_once_history_says_so():
    policy = make(gpu=10_000)
    for _ in range(K_COLD + 1):
        policy._record("Bash:pytest", 300.0)
    finish(policy, "a", 0.0, 2000, "Bash:pytest")
    assert "a" not in policy.pins and policy.programs["a"].placement == WAIT


def test_a_step_without_tool_call_is_not_pinned():
    policy = make()
    finish(policy, "a", 0.0, 300, None)
    assert policy.programs["a"].placement == GPU0  # decided at the next schedule
    policy.tick(1.5)
    assert policy.programs["a"].placement == WAIT
    assert policy.hint_updates()["r0"]["a"] is Hint.INACTIVE


def test_pin_expires_after_its_ttl_unless_the_program_is_waiting():
    policy = make(gpu=10_000)
    finish(policy, "a", 0.0, 3000, "Bash")  # ttl ln(3) ~ 1.1 s
    deadline = policy.pins["a"]
    policy.tick(deadline - 0.01)
    assert policy.programs["a"].placement == GPU0
    policy.tick(deadline + 0.01)
    assert policy.programs["a"].placement == WAIT


def test_pinned_program_returns_straight_to_the_engine():
    policy = make(gpu=10_000)
    finish(policy, "a", 0.0, 3000, "Bash")
    policy.on_request("a", 1.5, 3100)
    assert policy.route("a") == "r0" and "a" not in policy.pins  # the pin is consumed


def test_program_level_fcfs_and_head_of_line_blocking():
    """Waiting requests go by program arrival; a head that does not fit blocks the rest."""
    policy = make(gpu=1000)
    policy.on_request("run", 0.0, 600)  # REASONING: cannot be moved
    policy.on_request("big", 1.0, 500)  # arrived first among the waiting: the head
    policy.on_request("small", 2.0, 100)  # fits, but waits behind the head
    assert policy.route("big") is None and policy.route("small") is None
    policy.on_response("run", 3.0, 600)
    moves = policy.on_tool_start("run", 3.0, "Bash")  # B = 0.6 s: not pinned, room frees
    assert [m.program_id for m in moves if m.dst == GPU0] == ["big", "small"]


def test_memory_pressure_releases_pins_latest_program_arrival_first():
    policy = make(gpu=10_000)
    finish(policy, "early", 0.0, 3000, "Bash")
    finish(policy, "late", 0.5, 3000, "Bash")
    finish(policy, "later", 0.8, 3000, "Bash")
    policy.on_request("new", 2.0, 2000)  # 1000 free: one pin must go
    assert policy.route("new") == "r0"
    placed = {pid: policy.programs[pid].placement for pid in ("early", "late", "later")}
    assert placed == {"early": GPU0, "late": GPU0, "later": WAIT}


def test_queue_wait_of_unpinned_followups_raises_the_benefit():
    policy = make(gpu=10_000)
    policy.waits.extend([4.0, 6.0])  # T = 5 s
    finish(policy, "a", 0.0, 500, "Bash")  # B = 5 + 0.5
    assert policy.pins["a"] == pytest.approx(1.0 + math.log(5.5))


def test_eta_from_finished_programs_turns():
    policy = make()
    assert policy.eta == 1.0
    for turns in (3, 3, 3):  # equal turn counts: fully memoryful
        policy._count_turns(turns)
    assert policy.eta == pytest.approx(1.0)
    policy._turns = [0.0] * 6
    for turns in (1, 2, 4, 8, 16, 32):  # widely varying counts: less memoryful
        policy._count_turns(turns)
    assert 0.0 < policy.eta < 0.9


def test_ended_program_forgets_its_pin_and_records_turns():
    policy = make(gpu=10_000)
    finish(policy, "a", 0.0, 3000, "Bash")
    moves = policy.end("a", 1.5)
    assert [m.reason for m in moves] == [MoveReason.END] and "a" not in policy.pins
    assert policy._turns[0] == 1
