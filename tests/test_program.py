"""Windowed idleness (MORI 4.2) on the Program record."""

import pytest

from router.policy.program import Program
from router.policy.types import Status


def cycle(p: Program, start: float, reason_s: float) -> float:
    p.arrive(start)
    p.start_reasoning(start)
    p.finish_step(start + reason_s)
    return start + reason_s


def test_new_program_is_not_idle():
    assert Program("p", created_s=0.0).idleness(100.0) == 0.0


def test_ongoing_tool_call_raises_idleness():
    p = Program("p", created_s=0.0, window=4)
    t = cycle(p, 0.0, 1.0)
    assert p.status is Status.ACTING
    early, late = p.idleness(t + 1.0), p.idleness(t + 60.0)
    assert 0.0 < early < late < 1.0


def test_gated_time_is_excluded():
    p = Program("p", created_s=0.0, window=4)
    t = cycle(p, 0.0, 2.0)  # reason 2 s
    p.arrive(t + 2.0)  # acted 2 s, then gated for 100 s
    gated = p.idleness(t + 102.0)
    assert gated == 0.5
    p.start_reasoning(t + 102.0)
    assert p.idleness(t + 102.0) == 0.5


def test_window_forgets_old_cycles():
    p = Program("p", created_s=0.0, window=2)
    t = cycle(p, 0.0, 1.0)
    p.arrive(t + 1000.0)  # one very long tool call
    p.start_reasoning(t + 1000.0)
    p.finish_step(t + 1001.0)
    t = t + 1001.0
    for _ in range(3):  # three quick cycles push it out of the window
        t = cycle(p, t + 0.1, 1.0)
    p.arrive(t + 0.1)
    assert p.idleness(t + 0.1) < 0.2


def test_cancel_restores_acting_without_gate_time():
    p = Program("p", created_s=0.0, window=4)
    t = cycle(p, 0.0, 1.0)
    p.arrive(t + 3.0)
    p.cancel_request(t + 50.0)
    assert p.status is Status.ACTING and not p.pending
    assert abs(p.idleness(t + 50.0) - 0.75) < 1e-9


def test_engine_share_takes_the_round_trip_off_each_step():
    """The share of time the engine ran a program: its reasoning share, less the round trip
    to its replica per step (the router counts it as reasoning); with no round trip it is
    1 - idleness, and a program with no history counts whole."""
    assert Program("n", created_s=0.0).engine_share(5.0, 0.5) == 1.0
    p = Program("p", created_s=0.0, window=4)
    t = cycle(p, 0.0, 1.0)  # reason 1 s, act 1 s, reason 1 s: 2/3 reasoning
    t = cycle(p, t + 1.0, 1.0)
    assert p.engine_share(t, 0.0) == 1.0 - p.idleness(t) == pytest.approx(2 / 3)
    assert p.engine_share(t, 0.25) == pytest.approx(2 / 3 * 0.75)
    assert p.engine_share(t, 2.0) == 0.0  # all of it on the wire
