"""The ladder's rows: a row whose stages need one it leaves out is refused when written, and
the rows the table accepts run the golden load (a check, not a proof: that load does not
reach an urgent step in flight, where a row without the time scheduler would stop).

A stage reads others of its engine (the wait bound prices urgent victims with the forecast,
keeps predicted-promoted programs for last with the time scheduler, places starts by the
placement's spread); before the check, a row without one of them built and then failed
with an AttributeError inside a pass, minutes into a run (an overloaded simulated hour,
when the first step in flight turned urgent).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from router.policy import REGISTRY, make_policy
from router.policy import ladder as L
from router.policy.engine import MoriEngine
from tests.policy_golden import Driver

OPTIONAL = {
    "forecast": L.Forecast,
    "priced": L.PricedDisplacement,
    "waiver": L.BandWaiver,
    "timed": L.TimeScheduler,
    "wait_bound": L.WaitBound,
    "space": L.SpaceScheduler,
    "handover": L.HandOver,
    "gangs": L.Gangs,
}
ORDERINGS = (L.IdlenessOrder, L.ActivityDensity, L._hybrid)
PLACEMENTS = (L.LastReplicaFirst, L.HomeFirst)


def accepted_rows() -> list[L.Rung]:
    """Every combination of the ladder's stages the table accepts."""
    rows = []
    for ordering, placement in itertools.product(ORDERINGS, PLACEMENTS):
        for on in itertools.product((False, True), repeat=len(OPTIONAL)):
            stages = {k: (v if b else None) for (k, v), b in zip(OPTIONAL.items(), on, strict=True)}
            try:
                rows.append(L.Rung("row", ordering, placement, **stages))
            except ValueError:
                continue
    return rows


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"timed": None}, "its wait_bound stage needs a timed stage"),
        ({"priced": None}, "its wait_bound stage needs a priced stage"),
        ({"forecast": None}, "needs a forecast stage"),
        ({"ordering": L.IdlenessOrder}, "priced stage needs the ordering stage to offer 'rank'"),
        ({"placement": L.LastReplicaFirst}, "needs the placement stage to offer 'spread'"),
    ],
)
def test_a_row_that_leaves_out_what_a_stage_needs_is_refused_naming_both(
    change: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        replace(L.MORI, **change)


def test_a_hybrid_ordering_without_the_space_scheduler_is_refused() -> None:
    with pytest.raises(ValueError, match="ordering stage needs a space stage"):
        replace(L.MORI_SPACE, space=None)


def test_every_registered_mori_policy_is_a_row_of_the_ladder() -> None:
    rows = [name for name in REGISTRY if name.startswith("mori")]
    assert len(rows) == 7
    for name in rows:
        assert isinstance(make_policy(name), MoriEngine)


def test_every_row_the_table_accepts_runs_the_golden_load() -> None:
    """20 of the accepted rows (all 284 ran on 2026-12-02): the few without a forecast and
    a seeded sample of the rest, each stage on in some and off in others, on the golden load
    of three replicas: faults, budget changes, rounds, apps, gate timeouts."""
    rows = accepted_rows()
    assert len(rows) > 200  # the table refuses only what a stage needs
    bare = [r for r in rows if r.forecast is None]
    rest = [r for r in rows if r.forecast is not None]
    sample = bare + random.Random(0).sample(rest, 20 - len(bare))
    for stage in OPTIONAL:
        assert {getattr(r, stage) is None for r in sample} == {True, False}, stage
    for rung in sample:
        lines = Driver(rung, 3).run()
        assert len(lines) >= 2500, rung
