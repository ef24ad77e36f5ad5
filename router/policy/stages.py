"""What a stage may ask of the engine: the ledger and the steps of its sequence.

Stages (`ordering`, `placement`, `displacement`, `reservation`, `forecast`, `timed`,
`overload`, `space`, `cachesage`, `tokendance`) are handed the engine
(`router.policy.engine.MoriEngine`) and see it through this interface, so no stage
imports the engine and the engine reads as the one place the sequence is written. The
other stages of a rung are reached through it too (`forecast`, `timed`, ...: None where
the rung has no such stage); they are typed loosely here, since naming their classes
would make every stage import every other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from router.policy.base import PolicyConfig
from router.policy.prices import ReplicaPrices
from router.policy.program import Program
from router.policy.rounds import Rounds
from router.policy.tiers import Tiers
from router.policy.types import Move, MoveReason, Placement, Tier

Free = dict[str, int]  # replica -> GPU room a pass may still fill
Targets = Callable[[Program, Free, float], Iterable[str]]  # walked until one fits
Idleness = Callable[[Program], float]
Act = Callable[[Program], Move | None]  # what is done to a program shed from a tier


def promotion_reason(p: Program) -> MoveReason:
    """The class a held request is promoted from: its CPU tier, returning, or new."""
    if p.placement.tier is Tier.CPU:
        return MoveReason.PROMOTE_CPU
    return MoveReason.PROMOTE_WAITING if p.steps > 0 else MoveReason.PROMOTE_NEW


def admitted(moves: list[Move], p: Program) -> list[Move]:
    """`moves` with `p`'s own promotion marked as its admission (it came with the event)."""
    pid, admit = p.program_id, MoveReason.ADMIT  # a Move built, not `replace`d: 5x cheaper
    return [Move(pid, m.src, m.dst, admit) if m.program_id == pid else m for m in moves]


class Ledger(Protocol):
    """The engine as its stages see it."""

    config: PolicyConfig
    tiers: Tiers
    programs: dict[str, Program]
    prices: dict[str, ReplicaPrices]
    rounds: Rounds
    step_s: float  # EWMA of a step's engine time
    # the rung's other stages (None where it has none)
    forecast: Any
    ordering: Any
    placement: Any
    priced: Any
    timed: Any
    wait_bound: Any
    space: Any

    @property
    def aging_s(self) -> float: ...

    # the ledger
    def every_held(self) -> list[Program]: ...
    def held_programs(self) -> list[Program]: ...
    def has_held(self) -> bool: ...
    def growth_band(self, replica: str) -> int: ...
    def promotion_reserve(self, replica: str) -> int: ...
    def reasoning_on(self, replica: str) -> int: ...
    def pending_lazy_tokens(self, replica: str) -> int: ...
    def ranking(self, now: float) -> Idleness: ...
    def ranking_many(self, programs: list[Program], now: float) -> list[float]: ...
    def fit_or_waiting(self, dst: Placement, p: Program) -> Placement: ...
    def demote(self, p: Program, replica: str, now: float) -> Move: ...
    def shed(
        self, programs: Iterable[Program], excess: int, now: float, act: Act
    ) -> tuple[list[Move], int]: ...

    # the steps of the sequence
    def move(self, p: Program, dst: Placement, reason: MoveReason, now: float) -> Move: ...
    def release(self, p: Program, now: float) -> None: ...
    def admit_one(self, p: Program, now: float) -> list[Move]: ...
    def promote(self, now: float, displace: bool = False) -> list[Move]: ...
    def promote_held(self, now: float, displace: bool = False) -> list[Move]: ...
    def free_room(self, now: float) -> Free: ...
    def best_fit(
        self, ranked: list[Program], free: Free, now: float, moves: list[Move], targets: Targets
    ) -> list[Program]: ...
    def swap_in(
        self, p: Program, replica: str, victims: list[Program], free: Free, now: float
    ) -> list[Move]: ...
