"""Replica affinity and promotion order of `mori-priced` (the default `mori` builds on it).

A program's KV lives on one replica, so a returning program goes back there and moves
elsewhere only once waiting at home has cost more than recomputing its context on the
other replica; a replica's free room goes to its own programs before other replicas'.
Within a class, held requests go by GPU activity per token of room, not by idleness alone.
Replicas have no host room here (CPU budget 0): a program off the GPU is recomputed.
"""

from __future__ import annotations

import pytest

from router.policy import PolicyConfig, make_policy
from router.policy.engine import MoriEngine
from router.policy.types import WAITING, MoveReason, Placement, ReplicaCapacity, Status, Tier

RECOMPUTE_S_PER_TOKEN = 1e-3


def make(replicas: int = 2, policy: str = "mori-priced", **cfg) -> MoriEngine:
    cfg = {
        "load_s_per_token": 1e-4,
        "prefill_s_per_token": RECOMPUTE_S_PER_TOKEN,
        "aging_s": 0.0,
        "displace_margin": 1e9,  # no priced displacement: free room only, unless a test says
        "max_step_wait_s": 0.0,  # mori's overload rules have their own tests
    } | cfg
    made = make_policy(policy, PolicyConfig(**cfg))
    assert isinstance(made, MoriEngine)
    for i in range(replicas):
        made.add_replica(f"r{i}", ReplicaCapacity(1000, 0))
    return made


def step(policy: MoriEngine, pid: str, t: float, tokens: int, answered: float = 1.0) -> str:
    """A request of `pid` at t that is routed at once and answered `answered` s later."""
    policy.on_request(pid, t, tokens)
    replica = policy.route(pid)
    assert replica is not None, f"{pid} was not routed at {t}"
    policy.on_response(pid, t + answered, tokens)
    return replica


def evict(policy: MoriEngine, pid: str, t: float) -> None:
    """Take an ACTING program off its GPU tier, as a demotion does (no host room: WAITING)."""
    policy.move(policy.programs[pid], WAITING, MoveReason.DEMOTE, t)


def settle_a_on_r0(policy: MoriEngine) -> None:
    """`a` (600 tokens) ran on r0, which `full` (1000) then filled: a waits with home r0."""
    policy.set_healthy("r1", False, 0.0)  # a's first step lands on r0
    assert step(policy, "a", 0.0, 600) == "r0"
    evict(policy, "a", 1.5)
    assert step(policy, "full", 1.6, 1000) == "r0"
    policy.set_healthy("r1", True, 2.0)


def test_a_returning_program_waits_for_its_own_replica_while_another_has_room():
    policy = make(home_wait=1.0)
    settle_a_on_r0(policy)
    policy.on_request("a", 3.0, 600)
    policy.tick(3.5)
    assert policy.route("a") is None, "moved to r1 before its wait paid for a recompute there"


def test_it_moves_once_its_wait_costs_more_than_the_recompute_elsewhere():
    """Break-even: 600 tokens x 1e-3 s/token x (1 + the one step running on r1) = 1.2 s."""
    policy = make(home_wait=1.0)
    settle_a_on_r0(policy)
    policy.on_request("b", 2.5, 100)  # a step running on r1 while `a` waits
    assert policy.route("b") == "r1"
    policy.on_request("a", 3.0, 600)
    policy.tick(4.1)
    assert policy.route("a") is None  # waited 1.1 s
    policy.tick(4.3)
    assert policy.route("a") == "r1"


def test_home_wait_zero_places_it_where_room_is_at_once():
    policy = make(home_wait=0.0)
    settle_a_on_r0(policy)
    policy.on_request("a", 3.0, 600)
    assert policy.route("a") == "r1"


def test_free_room_goes_to_the_replicas_own_program_before_another_replicas():
    """r1 frees 600 tokens while `a` (home r0, free to leave, the busier one) and `d` (home
    r1) wait: d gets r1's room, a keeps waiting for r0."""
    policy = make(home_wait=0.0)
    settle_a_on_r0(policy)
    assert step(policy, "d", 2.0, 600, answered=0.5) == "r1"
    evict(policy, "d", 2.6)
    assert step(policy, "hog", 2.7, 1000) == "r1"
    policy.on_request("d", 5.0, 600)  # idle 2.4 of 2.9 s
    policy.on_request("a", 5.0, 600)  # idle 2.0 of 3.0 s: ranks first
    assert policy.route("a") is None and policy.route("d") is None
    policy.end("hog", 6.0)
    assert policy.route("d") == "r1"
    assert policy.route("a") is None


def test_a_returning_program_displaces_only_on_its_own_replica():
    """Priced displacement on: the programs on r1 have idled a minute (moving them would
    pay), but `a` belongs to r0: it may take free room elsewhere, never move others there."""
    policy = make(home_wait=0.0, displace_margin=1.0)
    settle_a_on_r0(policy)
    assert step(policy, "e", 2.1, 1000) == "r1"
    policy.on_request("full", 2.9, 1000)  # r0's program is in a long step: nothing to move
    assert policy.route("full") == "r0"
    policy.on_request("a", 3.0, 600)
    policy.tick(60.0)
    assert policy.programs["e"].status is Status.ACTING
    assert policy.programs["e"].placement.replica == "r1"
    assert policy.route("a") is None


@pytest.mark.parametrize("name", ["mori-priced", "mori"])
def test_busier_per_token_programs_are_promoted_first(name):
    """600 tokens free up for two returning programs: `big` (600 tokens, idle 1 of 2 s) and
    `small` (300 tokens, idle 1.5 of 2.5 s). Least idle first would take big; small
    computes more per token of room (0.4 / 300 > 0.5 / 600) and goes first."""
    policy = make(replicas=1, policy=name)
    step(policy, "big", 0.0, 600)
    step(policy, "small", 0.0, 300)
    evict(policy, "big", 1.1)
    evict(policy, "small", 1.1)
    step(policy, "h1", 1.2, 400)
    step(policy, "h2", 1.2, 600)
    policy.on_request("big", 2.0, 600)
    policy.on_request("small", 2.5, 300)
    assert policy.route("big") is None and policy.route("small") is None
    policy.end("h2", 3.0)
    assert policy.route("small") == "r0"
    assert policy.route("big") is None


def settle_on(policy: MoriEngine, pid: str, replica: str, tokens: int, t: float) -> None:
    """`pid` ran one step and is in a tool call on `replica`'s GPU tier."""
    step(policy, pid, t, tokens)
    gpu = Placement(Tier.GPU, replica)
    if policy.programs[pid].placement != gpu:
        policy.move(policy.programs[pid], gpu, MoveReason.PROMOTE_WAITING, t + 1)


@pytest.mark.parametrize("policy_name", ["mori-priced", "mori"])
def test_new_programs_spread_by_room_per_program_not_by_free_room_alone(policy_name):
    """r1 holds three programs (a task's last steps), r0 one, with more free room; four
    new programs arrive at once. By free room alone all four go to r0 and stay there for
    life (affinity); by the room each program would have, the fourth goes to r1."""
    policy = make(policy=policy_name)
    for pid, replica in (("a", "r0"), ("b", "r1"), ("c", "r1"), ("d", "r1")):
        settle_on(policy, pid, replica, 100, 0.0)
    placed = []
    for i in range(4):  # r0: 900 free for 1 + 1 (450), r1: 700 for 3 + 1 (175)
        policy.on_request(f"n{i}", 5.0, 50)
        placed.append(policy.route(f"n{i}"))
    assert placed == ["r0", "r0", "r0", "r1"]


def test_a_replica_with_ten_times_the_room_takes_about_ten_times_the_new_programs():
    """By free room alone the large replica takes all eleven, by count a third."""
    policy = make()
    policy.add_replica("big", ReplicaCapacity(10_000, 0))
    placed = []
    for i in range(11):
        policy.on_request(f"n{i}", 0.0, 10)
        placed.append(policy.route(f"n{i}"))
    assert 8 <= placed.count("big") <= 10, placed
