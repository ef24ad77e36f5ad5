"""mori under overload: the wait bound of a program in flight, and the door starts wait at.

A program in flight (it has run a step) has its next step held at most about
`max_step_wait_s`: once held half of it, the step goes first, in place of programs in tool
calls, or its replica keeps its room for it. A start (a first request) waits at the door,
in the order it first asked, and is let in only where no step in flight waits and the
programs in flight leave load to spare; a start the door does not expect to let in
before the gate's timeout is told to come back, and keeps its place.
"""

from __future__ import annotations

import random

from router.policy import PolicyConfig, make_policy
from router.policy.engine import MoriEngine
from router.policy.overload import URGENT_SHARE
from router.policy.types import (
    WAITING,
    AgentHints,
    MoveReason,
    Placement,
    ReplicaCapacity,
    Status,
    Tier,
)

GPU0, CPU0 = Placement(Tier.GPU, "r0"), Placement(Tier.CPU, "r0")
BOUND = 60.0
URGENT = URGENT_SHARE * BOUND


def make(gpu: int = 1000, cpu: int = 0, **cfg) -> MoriEngine:
    """mori on one replica, its other ways to move programs off (priced displacement,
    aging, offload at tool start) held back, so what moves here is the overload rules'."""
    knobs = {
        "max_step_wait_s": BOUND,
        "door_load": 100.0,  # the load test sets its own
        "displace_margin": 1e9,
        "aging_s": 0.0,
        "hysteresis": 1.0,
        "tick_s": 1.0,
    }
    policy = make_policy("mori", PolicyConfig(**(knobs | cfg)))
    assert isinstance(policy, MoriEngine)
    policy.add_replica("r0", ReplicaCapacity(gpu, cpu))
    return policy


def run_step(policy: MoriEngine, pid: str, t: float, tokens: int, answered: float = 1.0) -> float:
    policy.on_request(pid, t, tokens)
    assert policy.route(pid) == "r0", f"{pid} was not let in at {t}"
    policy.on_response(pid, t + answered, tokens)
    return t + answered


def evicted_and_back(policy: MoriEngine, t: float) -> None:
    """`a` (600) ran a step and lost its room; `x` (500) is in a tool call on the GPU; at
    t `a` asks again and waits (500 free)."""
    run_step(policy, "a", 0.0, 600)
    policy.move(policy.programs["a"], WAITING, MoveReason.DEMOTE, 1.5)
    run_step(policy, "x", 2.0, 500)
    policy.on_tool_start("x", 3.0, "pytest")
    policy.on_request("a", t, 600)
    assert policy.route("a") is None


def test_a_start_waits_while_a_step_in_flight_waits_on_its_replica():
    policy = make()
    evicted_and_back(policy, 4.0)
    policy.on_request("n", 5.0, 300)  # fits the 500 free tokens
    assert policy.route("n") is None
    assert policy.describe("n", 5.0)["start_queue_position"] == 0
    # without the overload rules the start takes the room
    free = make(max_step_wait_s=0.0)
    evicted_and_back(free, 4.0)
    free.on_request("n", 5.0, 300)
    assert free.route("n") == "r0"


def test_a_held_step_in_flight_goes_first_once_half_its_bound_has_passed():
    policy = make()
    evicted_and_back(policy, 4.0)
    policy.tick(4.0 + URGENT - 1.0)
    assert policy.route("a") is None  # not yet: nothing would displace `x`
    moves = policy.tick(4.0 + URGENT)
    assert policy.route("a") == "r0"
    assert [(m.program_id, m.reason) for m in moves if m.reason is MoveReason.DEMOTE] == [
        ("x", MoveReason.DEMOTE)
    ]


def test_the_policy_asks_to_be_woken_when_a_held_step_becomes_urgent():
    policy = make(tick_s=1000.0)
    evicted_and_back(policy, 4.0)
    assert policy.next_wakeup(5.0) == 4.0 + URGENT


def test_an_urgent_step_keeps_its_replicas_room_while_steps_run():
    """The GPU is full of running steps: nothing can be displaced, so room that frees goes to
    the urgent step, not to a smaller request that fits it first."""
    policy = make()
    run_step(policy, "a", 0.0, 600)
    policy.move(policy.programs["a"], WAITING, MoveReason.DEMOTE, 1.5)
    for pid, t in (("r1", 2.0), ("r2", 2.0)):
        run_step(policy, pid, t, 450)
        policy.on_request(pid, t + 1.5, 450)  # reasoning again: 900 of 1000 used
    run_step(policy, "s", 3.0, 50)
    policy.on_request("s", 4.0, 50)  # reasoning as well
    policy.on_request("a", 5.0, 600)
    policy.tick(5.0 + URGENT)
    assert policy.route("a") is None and policy.wait_bound.held_for == {"r0": "a"}
    policy.on_request("late", 5.0 + URGENT + 1, 40)  # a start that fits the 50 free
    assert policy.route("late") is None
    policy.on_response("s", 5.0 + URGENT + 2, 50)  # 50 free and `s` in a tool call: 100
    assert policy.route("late") is None and policy.route("a") is None
    policy.on_response("r1", 5.0 + URGENT + 3, 450)  # r1 in a tool call too: 550 < 600
    assert policy.route("a") is None
    policy.on_response("r2", 5.0 + URGENT + 4, 450)  # enough programs in tool calls now
    assert policy.route("a") == "r0"
    assert policy.route("late") == "r0"  # nothing in flight waits: the door opens


def test_starts_are_let_in_in_the_order_they_first_asked():
    """Two starts wait behind a step in flight; the second fits better but the first asked
    first. The first is told to come back; when it does, it keeps its place."""
    policy = make()
    evicted_and_back(policy, 4.0)
    policy.on_request("first", 5.0, 400)
    policy.on_request("second", 6.0, 100)
    policy.cancel("first", 7.0)  # told to come back (or it gave up)
    policy.on_request("first", 8.0, 400)
    assert policy.describe("first", 8.0)["start_queue_position"] == 0
    assert policy.describe("second", 8.0)["start_queue_position"] == 1
    policy.end("x", 9.0)  # room for `a`, then 400 left: the door opens
    assert policy.route("a") == "r0"
    assert policy.route("first") == "r0"
    assert policy.route("second") is None  # 0 left


def _door_pacing_every_100_s(**cfg) -> MoriEngine:
    """The door has let a start in every 100 s; a program in flight now holds the replica,
    and starts w0, w1, w2 wait in that order."""
    policy = make(gpu=10_000, gate_timeout_s=300.0, **cfg)
    t = 0.0
    for i in range(3):
        run_step(policy, f"p{i}", t, 9_000)
        policy.end(f"p{i}", t + 1.0)
        t += 100.0
    run_step(policy, "busy", t, 9_000)
    policy.on_request("busy", t + 2.0, 9_000)
    for i in range(3):
        policy.on_request(f"w{i}", t + 3.0 + i, 5_000)
    return policy


def test_a_start_that_would_outwait_the_gate_is_told_to_come_back():
    """Held up to the gate timeout (`start_hold_s` 240): w0 expects 100 s and waits; w2,
    with two ahead, expects 300 s, past 0.8 x the 300 s timeout, and is refused at once
    with about that to wait."""
    policy = _door_pacing_every_100_s(start_hold_s=240.0)
    assert policy.refusal("w0") is None
    retry = policy.refusal("w2")
    assert retry is not None and 200.0 <= retry <= 300.0


def test_a_start_is_held_no_longer_than_start_hold_s():
    """The default hold (30 s): w0's 100 s expected wait is too long to hold; it is told to
    come back then, and keeps its place when it does."""
    policy = _door_pacing_every_100_s()
    retry = policy.refusal("w0")
    assert retry is not None and 90.0 <= retry <= 110.0
    policy.cancel("w0", 400.0)  # the shell answers 429
    policy.on_request("w0", 450.0, 5_000)
    assert policy.describe("w0", 450.0)["start_queue_position"] == 0


def test_no_start_is_let_in_past_the_load_the_programs_in_flight_bring():
    """Programs in flight that reason all the time and fill the GPU tier's room: the door
    stays shut to a start that would fit the free room, and opens when one ends."""
    policy = make(gpu=800, door_load=1.0)
    for pid in ("a", "b"):
        policy.on_request(pid, 0.0, 100)  # a start's life counts 3x its prompt: 300 each
    assert policy.route("a") == "r0" and policy.route("b") == "r0"
    policy.on_request("c", 0.5, 100)  # 600 of 800 busy: still under, let in
    assert policy.route("c") == "r0"
    policy.on_request("d", 0.6, 100)  # 900 > 800: waits, though 500 tokens are free
    assert policy.route("d") is None
    policy.on_response("a", 1.0, 100)
    policy.end("a", 1.0)
    assert policy.route("d") == "r0"


def test_a_step_in_flight_is_held_no_longer_than_its_bound_under_random_load():
    """Twelve programs with 200-300-token steps on a 1000-token GPU, short tool calls,
    ticks every second: steps in flight do wait, but none past the bound (plus a tick)."""
    rng = random.Random(7)
    policy = make(gpu=1000, tick_s=1.0, door_load=1.0)
    held: dict[str, tuple[float, bool]] = {}  # program -> (asked at, in flight)
    waits: list[float] = []
    t = 0.0
    while t < 600.0:
        t += 0.25
        for pid in (f"p{i}" for i in range(12)):
            p = policy.programs.get(pid)
            if p is None or (p.status is Status.ACTING and not p.pending):
                if rng.random() < 0.3:
                    policy.on_request(pid, t, 200 + rng.randrange(100))
                    held[pid] = (t, p is not None and p.steps > 0)
            elif p.status is Status.REASONING and rng.random() < 0.4:
                policy.on_response(pid, t, p.context_tokens)
        if t % 1.0 == 0:
            policy.tick(t)
        for pid, (since, in_flight) in list(held.items()):
            if not policy.programs[pid].pending:
                if in_flight:
                    waits.append(t - since)
                del held[pid]
    assert max(waits) > 1.0, "no step in flight ever waited: the load is too light"
    assert max(waits) <= BOUND + 1.0


def test_a_higher_priority_start_is_let_in_first():
    """Two starts wait behind a step in flight; when the door opens, the one with the
    client's higher `priority` goes first though it asked later."""
    policy = make()
    evicted_and_back(policy, 4.0)
    policy.on_request("early", 5.0, 400)
    policy.on_prompt("urgent-task", (), hints=AgentHints(priority=5))
    policy.on_request("urgent-task", 6.0, 400)
    policy.end("x", 9.0)  # room for `a`, then 400 left: one start
    assert policy.route("urgent-task") == "r0"
    assert policy.route("early") is None


def three_running_then_a_start(cpu: int, at: float, **cfg) -> MoriEngine:
    """`a`, `b`, `c` (100 tokens each, 300 at life size) reason on an 800-token GPU:
    900 of busy load against door_load x 800; `d` (100, fits the free room) asks at 0.6
    and waits; the engine ticks every 10 s until `at`. The door's floor is off unless
    `cfg` sets it (1.2 x 800 would let `d` in at once where the host holds them all)."""
    policy = make(gpu=800, cpu=cpu, door_load=1.0, **({"door_gain_min": 1.0} | cfg))
    for pid, t in (("a", 0.0), ("b", 0.0), ("c", 0.5)):
        policy.on_request(pid, t, 100)
        assert policy.route(pid) == "r0"
    policy.on_request("d", 0.6, 100)
    assert policy.route("d") is None
    for t in range(10, int(at) + 1, 10):
        policy.tick(float(t))
    return policy


def test_the_door_opens_wider_while_steps_run_unheld_and_the_host_holds_every_program():
    """After calm (no step in flight held) the door lets in past `door_load`, up to
    `door_gain_max` times it, where the host tier holds every program at life size; not
    where it does not (a parked program would lose its host copy and recompute), and not
    with the gain off."""
    roomy = three_running_then_a_start(cpu=4000, at=300.0)
    assert roomy.route("d") == "r0"
    assert roomy.wait_bound.spare("r0", 300.0) < roomy.config.door_load * 800  # bounded
    no_host = three_running_then_a_start(cpu=800, at=300.0)  # 0.8 x 800 < 4 x 300
    assert no_host.route("d") is None
    fixed = three_running_then_a_start(cpu=4000, at=300.0, door_gain_max=1.0)
    assert fixed.route("d") is None
    early = three_running_then_a_start(cpu=4000, at=30.0)  # calm for 30 s: gain ~1.1
    assert early.route("d") is None


def test_where_the_host_holds_every_program_the_door_starts_at_its_floor():
    """`door_gain_min` (1.2): with no calm yet, a start is let in past `door_load` up to
    1.2 x it where the host tier holds every program at life size (a parked one keeps its
    host copy: letting one more in costs reloads); not where the host does not hold them,
    and not with the floor at 1 or with the gain off (`door_gain_max` 1: a fixed door)."""

    def d_at_once(cpu: int, **cfg) -> str | None:
        policy = make(gpu=800, cpu=cpu, door_load=1.0, **cfg)
        for pid, t in (("a", 0.0), ("b", 0.0), ("c", 0.5)):  # 900 of load against 800
            policy.on_request(pid, t, 100)
        policy.on_request("d", 0.6, 100)
        return policy.route("d")

    assert d_at_once(cpu=4000) == "r0"  # 900 < 1.2 x 800, and 0.8 x 4000 holds them
    assert d_at_once(cpu=800) is None  # 0.8 x 800 < 4 x 300: a parked one would recompute
    assert d_at_once(cpu=4000, door_gain_min=1.0) is None
    assert d_at_once(cpu=4000, door_gain_max=1.0) is None
    assert d_at_once(cpu=4000, door_gain_min=1.1) is None  # 900 > 1.1 x 800 = 880


def calm_until_200(**cfg) -> MoriEngine:
    """`a` (600 tokens) ran a step and was parked off the GPU, `x` (500) is in a tool call
    on it; ticks every 10 s until 190 with no step held: the door's gain has grown (its
    floor off: what moves here is the gain alone)."""
    policy = make(gpu=1000, cpu=100_000, door_load=5.0, **({"door_gain_min": 1.0} | cfg))
    run_step(policy, "a", 0.0, 600)
    policy.move(policy.programs["a"], WAITING, MoveReason.DEMOTE, 1.5)
    run_step(policy, "x", 2.0, 500)
    policy.on_tool_start("x", 3.0, "pytest")
    for t in range(10, 200, 10):
        policy.tick(float(t))
    return policy


def test_a_held_step_in_flight_closes_the_wider_door_again():
    """The gain grown over 200 s of calm falls back towards 1 while a step in flight is
    held on the replica: the door is then as wide as with the gain off."""
    gained, fixed = calm_until_200(), calm_until_200(door_gain_max=1.0)
    assert gained.wait_bound.spare("r0", 199.0) > fixed.wait_bound.spare("r0", 199.0) + 300
    for policy in (gained, fixed):
        policy.on_request("a", 200.0, 600)  # 500 free: held until urgent at 230
        assert policy.route("a") is None
        for t in range(201, 229):
            policy.tick(float(t))
        assert policy.route("a") is None
    gap = gained.wait_bound.spare("r0", 228.0) - fixed.wait_bound.spare("r0", 228.0)
    assert 0.0 <= gap < 10.0


def test_a_step_in_flight_held_under_a_second_strains_the_door():
    """The strain mark is 0.5 % of the bound (0.3 s of this module's 60): a step in flight
    held 0.45 s already brings the gain down (at 1 %, 0.6 s, it still rose; the two-replica
    32k cell's in-flight p99 then passed smg's: bench/results/2026-12-02-strain.md). The
    door's width over its twin with the gain off is what the gain adds; every tick a full
    pass."""
    gained, fixed = calm_until_200(tick_s=0.1), calm_until_200(tick_s=0.1, door_gain_max=1.0)

    def gain_adds(t: float) -> float:
        for policy in (gained, fixed):
            policy.tick(t)
            assert policy.route("a") is None
        return gained.wait_bound.spare("r0", t) - fixed.wait_bound.spare("r0", t)

    for policy in (gained, fixed):
        policy.on_request("a", 200.0, 600)  # 500 free: held
    held = gain_adds(200.0)
    calm = gain_adds(200.2)  # held 0.2 s: no strain yet, the gain rises
    assert calm > held
    assert gain_adds(200.45) < calm  # held 0.45 s: strained, the gain falls


def test_a_measured_round_trip_to_the_replica_opens_the_door_by_what_it_takes_off():
    """Two programs in flight reason 2/3 of the time as the router counts it (1 s steps, a
    1 s tool call between): 2 x 600 x 2/3 = 800 of load against a door of 720, so a start
    waits. Half of each step was the round trip to the replica (measured: the engine ran
    it 0.5 s), so the engine ran each a third of the time: 400 of load, and it is let in."""

    def start_let_in(engine_s: float | None) -> bool:
        policy = make(gpu=800, door_load=0.9, door_gain_min=1.0)
        for pid in ("a", "b"):
            for t in (0.0, 2.0):
                policy.on_request(pid, t, 200)
                if engine_s is not None:
                    policy.observe_round_trip(pid, t + 1.0, engine_s)
                policy.on_response(pid, t + 1.0, 200)
        policy.on_request("d", 3.5, 100)
        return policy.route("d") == "r0"

    assert not start_let_in(None)
    assert not start_let_in(1.0)  # all of the step at the engine: no round trip
    assert start_let_in(0.5)


def test_an_urgent_step_takes_a_program_that_went_into_its_tool_call_since_the_pool_was_ranked():
    """Urgent steps take their victims from the replica's pool of programs in tool calls,
    ranked by the first urgent step after a rebalance and kept: a program whose step ends
    after that joins it, so a later urgent step can take its place."""
    policy = make(tick_s=1000.0)
    policy.tick(0.5)  # the one full rebalance: later ticks only serve urgent steps
    for pid in ("a", "b"):
        run_step(policy, pid, 0.0, 400)
        policy.move(policy.programs[pid], WAITING, MoveReason.DEMOTE, 1.5)
    run_step(policy, "x", 2.0, 500)  # in a tool call
    policy.on_request("y", 2.5, 500)  # reasoning: not a victim yet
    assert policy.route("y") == "r0"
    policy.on_request("a", 4.0, 400)
    policy.on_request("b", 5.0, 400)
    policy.tick(4.0 + URGENT)  # a is urgent: the pool is ranked, x leaves for it
    assert policy.route("a") == "r0" and policy.route("b") is None
    assert policy.programs["x"].placement.tier is not Tier.GPU
    policy.on_response("y", 4.0 + URGENT + 0.5, 500)  # y goes into a tool call
    policy.tick(5.0 + URGENT)  # b is urgent: 100 free, y's 500 can go
    assert policy.route("b") == "r0"
    assert policy.programs["y"].placement.tier is not Tier.GPU


def test_an_urgent_step_takes_predicted_promoted_programs_last():
    """Of the programs in tool calls, those promoted ahead of a predicted tool end go last,
    whatever their expected return: an urgent step takes the others first."""
    policy = make(tick_s=1000.0)
    policy.tick(0.5)
    run_step(policy, "a", 0.0, 400)
    policy.move(policy.programs["a"], WAITING, MoveReason.DEMOTE, 1.5)
    for pid in ("far", "near"):
        run_step(policy, pid, 2.0, 500)
    policy.timed.protected_until["far"] = 1e9  # as a predictive promotion marks it
    policy.on_request("a", 4.0, 400)
    policy.tick(4.0 + URGENT)
    assert policy.route("a") == "r0"
    assert policy.programs["far"].placement == GPU0
    assert policy.programs["near"].placement.tier is not Tier.GPU
