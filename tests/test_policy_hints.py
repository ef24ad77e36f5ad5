"""Agent hints in the policy: a request's `priority` orders held requests within their
promotion class, and its `osl` is the growth its step reserves."""

from __future__ import annotations

import pytest

from router.policy.types import AgentHints, MoveReason
from tests.test_policy_mori import make, shrink, step

MORI_FAMILY = ("mori-paper", "mori-priced", "mori", "mori+space")


def _two_returning(policy, hints: dict[str, AgentHints]) -> None:
    """`idle` and `busy` (400 tokens each) back from WAITING with a request at t=10: by
    idleness `busy` goes first (test_least_idle_first_within_a_class)."""
    step(policy, "idle", 0.0, 400)
    step(policy, "busy", 8.0, 400)
    shrink(policy, 0, 0)
    policy.tick(10.0)  # both to WAITING
    for pid in ("idle", "busy"):
        policy.on_prompt(pid, (), None, hints.get(pid, AgentHints()))
        policy.on_request(pid, 10.0, 400)


@pytest.mark.parametrize("name", MORI_FAMILY)
def test_priority_reorders_held_requests_of_one_class(name):
    for hints, first in (({}, "busy"), ({"idle": AgentHints(priority=3)}, "idle")):
        policy = make(name, cpu=0)
        _two_returning(policy, hints)
        shrink(policy, 500, 0)  # room for one of them
        moves = policy.tick(15.0)  # mori's next full tick (tick_s 5 after t=10)
        assert [m.program_id for m in moves] == [first], hints


@pytest.mark.parametrize("name", MORI_FAMILY)
def test_priority_never_jumps_a_class_or_an_aged_request(name):
    policy = make(name, cpu=0, aging_s=5.0)
    step(policy, "old", 0.0, 400)
    shrink(policy, 0, 0)
    policy.tick(1.0)
    policy.on_request("old", 2.0, 400)  # class 2 (returning), held from t=2
    policy.on_prompt("new", (), None, AgentHints(priority=100))
    policy.on_request("new", 5.0, 400)  # class 3, however high its priority
    shrink(policy, 500, 0)
    assert [m.program_id for m in policy.tick(6.0)] == ["old"]  # not aged yet
    policy = make(name, cpu=0, aging_s=5.0)
    step(policy, "busy", 0.0, 400)
    shrink(policy, 0, 0)
    policy.tick(10.0)
    policy.on_request("aged", 10.0, 400)  # class 3, held from t=10: aged at t=15
    policy.on_prompt("busy", (), None, AgentHints(priority=100))
    policy.on_request("busy", 14.0, 400)  # class 2 and high priority, but not aged
    shrink(policy, 500, 0)
    assert [m.program_id for m in policy.tick(15.0)] == ["aged"]


def test_a_requests_hints_are_its_own():
    """The next request without hints is back to priority 0 and the learned growth."""
    policy = make()
    policy.on_prompt("a", (), None, AgentHints(priority=7, osl=30))
    policy.on_request("a", 0.0, 100)
    assert (policy.programs["a"].priority, policy.programs["a"].osl) == (7, 30)
    policy.on_response("a", 1.0, 130)
    policy.on_request("a", 2.0, 140)
    assert (policy.programs["a"].priority, policy.programs["a"].osl) == (0, None)


@pytest.mark.parametrize("osl, admitted", [(None, False), (50, True), (250, False)])
def test_osl_is_the_growth_a_running_step_reserves(osl, admitted):
    """`a` grew by 200 tokens in its last step and is reasoning again (550 of 1000
    tokens): the band reserves that 200, or the `osl` its request announced instead."""
    policy = make()
    step(policy, "a", 0.0, 300)
    policy.on_request("a", 1.5, 400)
    policy.on_response("a", 2.5, 500)  # last step: 300 -> 500
    policy.on_prompt("a", (), None, AgentHints(osl=osl))
    policy.on_request("a", 3.0, 550)
    assert policy.promotion_reserve("r0") == (200 if osl is None else osl)
    moves = policy.on_request("n", 3.1, 400)  # 450 free: fits a reserve of 50, not 200
    assert (policy.route("n") == "r0") is admitted
    assert [m.reason for m in moves] == ([MoveReason.ADMIT] if admitted else [])
