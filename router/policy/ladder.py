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
their own files. What a stage reads of the others is declared beside the rows (`NEEDS`,
`OFFERS`), and a row that leaves a need out is refused when it is written. TokenDance's
rounds are their own valve (a round's agents are let in together, and a round that
waited long makes others yield at round boundaries), so the wait bound and the door are
not applied on top.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
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


# What a stage reads of the engine's other stages (a field of the rung), or of one of them
# ("field:ability"): a row that leaves a need out is refused when it is written, not an
# AttributeError inside some pass of a run.
NEEDS: dict[Stage, tuple[str, ...]] = {
    HomeFirst: ("forecast",),  # a recompute elsewhere, priced by the forecast
    PricedDisplacement: ("forecast", "ordering:rank"),  # victims priced; held ranked at once
    BandWaiver: ("forecast",),  # expected idle time of programs in tool calls
    TimeScheduler: ("forecast",),  # the tool calls it offloads and promotes ahead of
    WaitBound: ("forecast", "priced", "timed", "placement:spread"),  # urgent victims, starts
    SpaceScheduler: ("forecast",),
    Gangs: ("forecast",),
    _hybrid: ("space",),  # an app's hybrid priority
}
# The abilities beyond its Protocol a stage offers the others (`NEEDS`' "field:ability").
OFFERS: dict[Stage, tuple[str, ...]] = {
    ActivityDensity: ("rank",),  # a `Ranking`
    _hybrid: ("rank",),
    HomeFirst: ("spread",),  # new programs where the fewest run
}
_NOT_STAGES = ("name", "aging_s")  # the fields of a rung that are not stages


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

    def __post_init__(self) -> None:
        """Refuse a row whose stages need one it leaves out (`NEEDS`)."""
        stages = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_STAGES}
        for field, stage in stages.items():
            for need in NEEDS.get(stage, ()) if stage is not None else ():
                other, _, ability = need.partition(":")
                if stages[other] is None:
                    raise ValueError(f"{self.name}: its {field} stage needs a {other} stage")
                if ability and ability not in OFFERS.get(stages[other], ()):
                    raise ValueError(
                        f"{self.name}: its {field} stage needs the {other} stage to offer "
                        f"{ability!r}; {_name(stages[other])} does not"
                    )

    def __call__(self, config: PolicyConfig | None = None) -> MoriEngine:
        return MoriEngine(self, config)


def _name(stage: Stage) -> str:
    return getattr(stage, "__name__", repr(stage))


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
