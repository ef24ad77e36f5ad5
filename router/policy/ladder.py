"""The ablation ladder as data: each MORI policy is the engine with one row of stages.

| policy | ordering | placement | priced + forecast | band waiver | timed | wait bound | other |
|---|---|---|---|---|---|---|---|
| `mori-paper` | idleness | last replica first | - | - | - | - | aging off |
| `mori-priced` | activity density | home first (ski rental) | yes | - | - | - | |
| `mori` | activity density | home first | yes | yes | yes | yes | |
| `mori+space` | hybrid priority | home first | yes | yes | yes | yes | space scheduler |
| `mori-priced+space` | hybrid priority | home first | yes | - | - | - | space scheduler |
| `mori+cachesage` | activity density | home first | yes | yes | yes | yes | hand-over room |
| `mori+tokendance` | activity density | home first | yes | yes | yes | - (rounds) | gangs |

Every rung keeps the paper's passes (`router.policy.engine`); the stages are described in
their own files. TokenDance's rounds are their own valve (a round's agents are let in
together, and a round that waited long makes others yield at round boundaries), so the
wait bound and the door are not applied on top.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.policy.base import PolicyConfig
from router.policy.cachesage import HandOver
from router.policy.displacement import PricedDisplacement
from router.policy.engine import MoriEngine
from router.policy.forecast import Forecast
from router.policy.ordering import ActivityDensity, HybridPriority, IdlenessOrder
from router.policy.overload import WaitBound
from router.policy.placement import HomeFirst, LastReplicaFirst
from router.policy.reservation import BandWaiver
from router.policy.space import SpaceScheduler
from router.policy.timed import TimeScheduler
from router.policy.tokendance import Gangs

Stage = Callable[[MoriEngine], Any]


def _hybrid(engine: MoriEngine) -> HybridPriority:
    return HybridPriority(engine, ActivityDensity(engine))


@dataclass(frozen=True)
class Rung:
    """One MORI policy: its name and the stages the engine runs for it (None: not this
    rung's). A stage is built with the engine, in the order of the fields."""

    name: str
    ordering: Stage
    placement: Stage
    aging_s: float = 1800.0  # chosen by the sweep in docs/policy.md ("Aging")
    forecast: Stage | None = Forecast
    priced: Stage | None = PricedDisplacement
    waiver: Stage | None = BandWaiver
    timed: Stage | None = TimeScheduler
    wait_bound: Stage | None = WaitBound
    space: Stage | None = None
    handover: Stage | None = None
    gangs: Stage | None = None

    def __call__(self, config: PolicyConfig | None = None) -> MoriEngine:
        return MoriEngine(self, config)


_PRICED: dict[str, Any] = {"waiver": None, "timed": None, "wait_bound": None}  # no time scheduler

MORI_PAPER = Rung(
    "mori-paper",
    IdlenessOrder,
    LastReplicaFirst,
    aging_s=0.0,  # the paper has no aging; `aging_s` turns ours on
    forecast=None,
    priced=None,
    waiver=None,
    timed=None,
    wait_bound=None,
)
MORI_PRICED = Rung("mori-priced", ActivityDensity, HomeFirst, **_PRICED)
MORI = Rung("mori", ActivityDensity, HomeFirst)
MORI_SPACE = Rung("mori+space", _hybrid, HomeFirst, space=SpaceScheduler)
MORI_PRICED_SPACE = Rung("mori-priced+space", _hybrid, HomeFirst, space=SpaceScheduler, **_PRICED)
MORI_CACHESAGE = Rung("mori+cachesage", ActivityDensity, HomeFirst, handover=HandOver)
MORI_TOKENDANCE = Rung("mori+tokendance", ActivityDensity, HomeFirst, wait_bound=None, gangs=Gangs)
