"""Tokencake's space scheduler (`mori+space`, `mori-priced+space`): app graphs registered
or inferred, hybrid priority, the reserved pool of Algorithm 2 and what promotions do
with it, and that it idles without apps."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, example, given, settings

from router.policy import PolicyConfig, make_policy
from router.policy.app_graph import AppGraphs, check_edges, shapes
from router.policy.runtime import AgentEvent, EventKind, PushPriorities
from router.policy.space import dynamic_priority, static_priority
from router.policy.types import MoveReason, Placement, Tier
from tests.test_policy_mori import make, where
from tests.test_policy_properties import play, random_load_moves, scenario

GPU0 = Placement(Tier.GPU, "r0")


# graphs -----------------------------------------------------------------------------------
def test_shapes_are_longest_path_depth_and_out_degree():
    edges = check_edges([["plan", "search"], ["plan", "write"], ["search", "write"]])
    got = {r: (s.depth, s.out_degree) for r, s in shapes(edges).items()}
    assert got == {"plan": (1, 2), "search": (2, 1), "write": (3, 0)}


@pytest.mark.parametrize(
    ("edges", "says"),
    [
        ([["a", "b"], ["b", "c"], ["c", "a"]], "cycle"),
        ([["a", "a"]], "itself"),
        ([["a"]], "pair"),
        ("a->b", "list"),
        ([["a", 3]], "string"),
    ],
)
def test_bad_graphs_are_refused_with_the_reason(edges, says):
    with pytest.raises(ValueError, match=says):
        check_edges(edges)


def test_inference_from_subagents_and_role_hand_overs():
    g = AppGraphs()
    g.observe_request("t", "lead", "app", None, None)
    g.observe_response("t")
    g.observe_request("t.s", "search", None, None, "t")  # a subagent: its parent's role
    g.observe_response("t.s")
    g.observe_request("t.w", "write", None, None, "t")  # parent's role again: lead -> write
    g.observe_request("u", "search", "app", "t", None)  # same task, after search answered
    assert set(g.edges_of("app")) == {("lead", "search"), ("lead", "write")}
    g.observe_request("v", "lead", "app", "t", None)  # search -> lead would close a cycle
    assert ("search", "lead") not in g.edges_of("app")
    g.observe_request("x", "lead", None, None, None)  # no app: no part of any graph
    assert g.agent_type("x") is None and g.agent_type("t.s") == "app/search"


def test_registered_graph_wins_over_inference():
    g = AppGraphs()
    g.register("app", check_edges([["a", "b"]]))
    g.observe_request("p", "b", "app", None, None)
    g.observe_request("q", "c", "app", "p", None)
    assert g.edges_of("app") == (("a", "b"),)
    assert g.shape("p").depth == 2 and g.shape("q") is None


# priorities ----------------------------------------------------------------------------
def test_hybrid_priority_terms():
    assert static_priority(None, 10.0) == 0.0
    g = dict(shapes(check_edges([["a", "b"], ["a", "c"]])))
    assert static_priority(g["a"], 10.0) == 20.0  # depth 1 x out-degree 2
    assert static_priority(g["b"], 10.0) == 20.0  # depth 2 x (sink counts 1)
    assert dynamic_priority(0.0, 5000) == 0.0
    assert dynamic_priority(4.0, 4000) == pytest.approx(4.0 * math.log(1000))
    assert dynamic_priority(8.0, 4000) > dynamic_priority(4.0, 4000)  # older first


# the reserved pool -------------------------------------------------------------------------
def ask(policy, pid: str, role: str, now: float, tokens: int, app: str = "app") -> list:
    policy.observe(AgentEvent(EventKind.REQUEST, now, pid, role, app=app))
    return policy.on_request(pid, now, tokens)


def pressured(name: str = "mori+space"):
    """r0 (1000 GPU tokens) 80 % full of two ACTING `lead` programs; the app's critical
    type is `write` (deeper), and one tick under pressure reserves half the GPU. Priced
    displacement is off (margin): only the space scheduler moves anyone."""
    policy = make(
        name,
        gpu=1000,
        cpu=1000,
        critical_ratio=0.5,
        reserve_step=0.5,
        reserve_max=0.5,
        gpu_usage_high=0.8,
        displace_margin=1e9,
        w_static=1000.0,  # the graph decides which type is critical, not the waits
    )
    policy.register_app("app", [["lead", "write"]])
    for i, pid in enumerate(("l1", "l2")):
        ask(policy, pid, "lead", float(i), 400)
        assert policy.route(pid) == "r0"
        policy.on_response(pid, i + 1.0, 400)
    ask(policy, "w0", "write", 3.0, 10)  # a live `write` program makes the type known
    policy.tick(10.0)
    return policy


# ... and mori's door: p1's step grew past every replica and waits, keeping its replica
# closed to starts; once it gives up (a cancel), p3, a start at the door, goes in at once
CANCELLED_STEP_REOPENS = [
    *[("act", 0, 0)] * 22, ("act", 1, 488), ("act", 1, 0), ("act", 1, 360), ("act", 2, 100),
    ("act", 1, 12), ("tick",), ("end", 0),
]  # fmt: skip


@pytest.mark.parametrize("name", ["mori+space", "mori-priced+space"])
def test_pressure_reserves_room_for_the_critical_type(name):
    policy = pressured(name)
    assert policy.space.critical == {"app/write"}
    part = policy.space.partitions["r0"]
    assert part.ratio == 0.5 and 0 < part.reserve["app/write"] <= 500
    assert policy.space.space_view()["replicas"]["r0"]["reserve_ratio"] == 0.5


def test_ordinary_promotion_stays_out_of_the_reservation():
    policy = pressured()
    free = policy.tiers.free(GPU0)
    assert free >= 150 and policy.space.unused_reserve("r0") > free - 150
    ask(policy, "l3", "lead", 11.0, 150)  # fits the free room, not outside the reservation
    policy.tick(15.0)
    assert where(policy, "l3").tier is not Tier.GPU


def test_critical_request_takes_its_reservation_and_reclaims_it_from_non_critical():
    policy = pressured()
    room = policy.tiers.free(GPU0)
    own = policy.space.unused_reserve("r0")
    need = min(own, room + 100)  # more than the free room: others sit in its reservation
    assert need > room
    moves = ask(policy, "w1", "write", 11.0, need) + policy.tick(15.0)
    assert where(policy, "w1") == GPU0
    demoted = [m.program_id for m in moves if m.reason is MoveReason.DEMOTE]
    assert demoted and set(demoted) <= {"l1", "l2"}  # non-critical ACTING programs
    assert policy.space.critical_promotions == 1
    assert policy.describe("w1", 15.0)["critical"] is True


def test_critical_types_and_priorities_reach_the_engines():
    policy = pressured()
    actions = policy.runtime_actions(10.0)
    push = next(a for a in actions if isinstance(a, PushPriorities))
    assert push.critical == {"app/write"} and push.agents["l1"] == "app/lead"
    assert push.priorities["w0"] > push.priorities["l1"]  # deeper role first
    assert policy.runtime_actions(10.0) == []  # nothing new: nothing pushed again


# without apps: mori ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("base", "space"), [("mori", "mori+space"), ("mori-priced", "mori-priced+space")]
)
def test_without_apps_the_moves_are_the_base_policys(base, space):
    """The same random load (no app_id) through both: identical moves, in order."""
    runs = []
    for name in (base, space):
        policy = make(name, replicas=2, gpu=3000, cpu=3000)
        runs.append(random_load_moves(policy, 7))
    assert runs[0] == runs[1] and len(runs[0]) > 50


# invariants with apps under pressure ---------------------------------------------------------
# found by the search below: a replica readmitted with a request of the critical type and a
# smaller one held; the critical one fills its own reservation, after which the smaller one
# fits (by one token) in room that MORI's pass still counted as reserved
READMITTED = [
    ("tick",), ("act", 0, 219), ("act", 0, 0), ("tick",), ("act", 0, 0), ("tick",), ("tick",),
    ("tick",), ("act", 0, 0), ("act", 0, 0), ("health", "r0", False), ("tick",), ("tick",),
    *[("act", 0, 0)] * 4, ("cap", "r2", 50, 0), ("act", 2, 482), ("cap", "r1", 50, 0),
    *[("tick",)] * 8, ("act", 1, 94), ("health", "r0", True),
]  # fmt: skip


@pytest.mark.parametrize("name", ["mori+space", "mori-priced+space"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=scenario)
@example(events=[(0.0, event) for event in READMITTED])
@example(
    events=[
        *[(0.0, event) for event in CANCELLED_STEP_REOPENS],
        (1.0, ("act", 0, 100)), (0.0, ("act", 1, 0)), (0.0, ("act", 3, 0)),
        (0.0, ("cancel", 1)),
    ]
)  # fmt: skip
def test_invariants_hold_with_an_app_and_a_reserved_pool(name, events):
    """The property driver of every policy, every program a role of one app's graph and a
    pool that reserves early: tiers exact, budgets kept, no held request left where it
    fits, no route to a failed replica."""
    config = PolicyConfig(
        lease_s=200.0, tick_s=0.0, gpu_usage_high=0.3, reserve_step=0.25, reserve_max=0.5
    )
    policy = make_policy(name, config)
    policy.register_app("app", [["a", "b"], ["b", "c"], ["a", "c"]])
    on_request = policy.on_request

    def tagged(pid: str, now: float, tokens: int) -> list:
        role = "abc"[int(pid[1:]) % 3]
        policy.observe(AgentEvent(EventKind.REQUEST, now, pid, role, app="app"))
        return on_request(pid, now, tokens)

    policy.on_request = tagged
    play(policy, events)
