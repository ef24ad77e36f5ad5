"""Placement: which replicas a held request may take room on, in the order tried.

The engine (`router.policy.engine`) packs held WAITING requests by Best-Fit-Decreasing
(`Ledger.best_fit`) and swaps on replicas; the rung's placement says where each
request may go. Two stages:

* `LastReplicaFirst` (MORI 4.3.1): the program's last replica, whose host tier may still
  hold its KV, then the one with the most room; a CPU-tier request only ever goes back to
  its own replica.
* `HomeFirst` (ski rental): a returning program goes back to its own replica and to
  another only once its wait there has paid for a recompute elsewhere (`home_wait`), and
  the free room of a replica goes to its own programs and new ones before programs of
  other replicas; a new program goes where each program would have the most room.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

from router.policy.program import Program
from router.policy.stages import Free, Ledger
from router.policy.types import Move, Placement, Tier


class Placing(Protocol):
    """Where held requests may take room."""

    def replicas_for(self, p: Program, free: Free, now: float) -> Iterable[str]:
        """Replicas a held WAITING (or home-leaving CPU) request may go to, in order (an
        iterable the caller walks until one fits, changing `free` only then)."""

    def swap_replicas(self, p: Program, free: Free, now: float) -> list[str]:
        """Replicas an idleness swap may make room on for `p`, in order."""

    def may_leave_home(self, p: Program, now: float) -> bool:
        """Whether a held CPU-tier request may go to another replica than its own."""

    def reach(self, free: Free) -> Free:
        """Per replica r, the most room a held CPU-tier request of r may be offered (a
        bound for the fast path; `may_leave_home` decides per request)."""

    def pack(self, ranked: list[Program], free: Free, now: float, moves: list[Move]) -> list:
        """Place `ranked` WAITING requests into `free`; return those left, ranked."""


def affine_first(p: Program, free: Free) -> list[str]:
    """Replicas to try for a WAITING program: its last one first, then the roomiest."""
    order = sorted(free, key=free.__getitem__, reverse=True)
    return [p.last_replica, *order] if p.last_replica in free else order


def spread_order(free: Free, programs: dict[str, int]) -> list[str]:
    """Replicas by the free room each of their programs would have with one more (most
    first), then by free room."""
    return sorted(free, key=lambda r: (-free[r] / (programs[r] + 1), -free[r]))


class LastReplicaFirst:
    """The paper's placement."""

    def __init__(self, engine: Ledger) -> None:
        self.engine = engine

    def replicas_for(self, p: Program, free: Free, now: float) -> list[str]:
        return affine_first(p, free)

    def swap_replicas(self, p: Program, free: Free, now: float) -> list[str]:
        return affine_first(p, free)

    def may_leave_home(self, p: Program, now: float) -> bool:
        return False

    def reach(self, free: Free) -> Free:
        return free  # its own replica's room only

    def pack(self, ranked: list[Program], free: Free, now: float, moves: list[Move]) -> list:
        return self.engine.best_fit(ranked, free, now, moves, self.replicas_for)


class HomeFirst:
    """Affinity with ski rental, and room offered to each replica's own programs first."""

    def __init__(self, engine: Ledger) -> None:
        self.engine = engine

    def replicas_for(
        self, p: Program, free: Free, now: float, waited_for: frozenset = frozenset()
    ) -> Iterable[str]:
        """A returning program goes back to its own replica (where its KV, device or host
        copy, may still be), and to another one only once moving there pays
        (`leave_for`); a new program, or one whose replica is gone, goes where each
        program would have the most room (`spread`). `waited_for`: replicas whose own
        programs still wait, closed to others'."""
        home = p.last_replica
        if home not in free:
            return self.spread(free)
        return self._home_then_paying(p, home, free, now, waited_for)

    def _home_then_paying(
        self, p: Program, home: str, free: Free, now: float, waited_for: frozenset
    ) -> Iterator[str]:
        """Home, then the other replicas, roomiest first, where leaving home pays: lazily,
        since most requests fit at home and pricing a recompute on every other replica was
        a tenth of an event (the caller stops at the first that fits, and changes `free`
        only then)."""
        yield home
        if now <= p.last_active_s and p.context_tokens > 0 < self.engine.config.home_wait:
            return  # it has not waited, and a recompute elsewhere costs more than nothing
            # (a price is positive: the settings require it, the trackers step by factors)
        others = sorted(
            (r for r in free if r != home and r not in waited_for),
            key=free.__getitem__,
            reverse=True,
        )
        yield from (r for r in others if self.leave_for(p, r, now))

    def home_only(self, p: Program, free: Free, now: float) -> list[str]:
        """A returning program's own replica alone (a new one's: `spread`)."""
        home = p.last_replica
        return [home] if home in free else self.spread(free)  # type: ignore[list-item]

    def swap_replicas(self, p: Program, free: Free, now: float) -> list[str]:
        """The paper's idleness swaps, on a returning program's own replica only: moving
        others off a replica to make room for a program whose KV is elsewhere pays twice."""
        return self.home_only(p, free, now)

    def spread(self, free: Free) -> list[str]:
        """Where a program with no replica goes: most free room per program first, counting
        the newcomer (`spread_order`). Free room alone is a snapshot that a task's last
        steps or one large idle program distort, and affinity then keeps the placement for
        the program's whole life (All-Gather, one task in flight: by room, a new task's 8
        agents all went where the last task's stragglers had just left, and one replica did
        75 % of the work); the programs a replica runs are its load to come. Per program
        of room, a replica with ten times the KV still takes about ten times the programs."""
        tiers = self.engine.tiers
        return spread_order(free, {r: tiers.count(Placement(Tier.GPU, r)) for r in free})

    def pack(self, ranked: list[Program], free: Free, now: float, moves: list[Move]) -> list:
        """Free room goes to each replica's own returning programs and to new ones first;
        what is left over then to programs of other replicas whose move pays (work
        conservation without taking a replica's room from its own programs)."""
        engine = self.engine
        left = engine.best_fit(ranked, free, now, moves, self.home_only)
        if not left:
            return left
        waited_for = frozenset(q.last_replica for q in left)
        return engine.best_fit(
            left, free, now, moves, lambda p, f, t: self.replicas_for(p, f, t, waited_for)
        )

    def reach(self, free: Free) -> Free:
        widest = max(free.values())  # the widest: it may leave home once that pays
        return dict.fromkeys(free, widest)

    def may_leave_home(self, p: Program, now: float) -> bool:
        """A CPU-tier request may be placed elsewhere once moving to some replica pays."""
        return any(self.leave_for(p, r, now) for r in self.engine.tiers.replicas())

    def leave_for(self, p: Program, replica: str, now: float) -> bool:
        """Ski rental: a held request waits for its own replica until its wait reaches
        `home_wait` x what placing it on `replica` instead costs: its whole context
        prefilled again there, stalling every step running on that replica while it lasts
        (the copy it leaves at home is garbage). Break-even (1.0) is 2-competitive against
        knowing when room would come back home. Moving for less is what made 50-90 % of
        programs change replica (the paper: under 3 %) and threw their caches away."""
        engine = self.engine
        if replica == p.last_replica or replica not in engine.prices:
            return False
        cost = engine.forecast.recompute_cost_s(p, replica)  # type: ignore[union-attr]
        return now - p.last_active_s >= engine.config.home_wait * cost
