"""Ordering: in what order held requests are offered GPU room.

A promotion pass (`router.policy.engine`) splits the held requests into the paper's three
classes (on a CPU tier, returning, new) and asks the rung's ordering for the order within
each (`order_classes`); the priced pass and the held-request queue rank every held request
at once (`rank`: class first, then the order within it). Three orders, each a stage:

* `Idleness` (MORI 4.3.1): least idle first in classes 1 and 2, smallest first in 3;
* `ActivityDensity`: classes 1 and 2 by the share of its time a program computes per
  token of room it takes (a knapsack's value per weight), class 3 smallest first;
* `HybridPriority` (Tokencake §5.2): an app's hybrid priority before the inner order.

The client's agent-hint priority goes before all of them (the pass sorts by it last).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from router.policy.program import Program
from router.policy.stages import Idleness, Ledger
from router.policy.types import Tier

Classes = tuple[list[Program], list[Program], list[Program]]  # on CPU, returning, new
Rank = Callable[[Program], tuple]


class Ordering(Protocol):
    """The order a pass offers room in."""

    def order_classes(self, classes: Classes, idleness: Idleness, now: float) -> None:
        """Sort each class in place into the order a pass offers it room."""


class Ranking(Ordering, Protocol):
    """... and one key across classes, for the rungs whose priced pass and queue take
    held requests in one order (`router.policy.displacement`)."""

    def rank(self, now: float) -> Rank:
        """A held request's sort key across classes (class first)."""

    def rank_many(self, programs: list[Program], now: float) -> list[tuple]:
        """`rank(now)` of each of `programs` at once (the priced pass and the queue rank
        every held request at a tick: ~500 at 10 000 programs)."""


def held_class(p: Program) -> int:
    """A held request's class, the first field of its rank: 0 on CPU, 1 returning, 2 new.
    The held-request queue checks it alone, without the rest of the rank."""
    if p.placement.tier is Tier.CPU:
        return 0
    return 1 if p.steps > 0 else 2


class IdlenessOrder:
    """The paper's order: least idle first in classes 1 and 2, smallest first in class 3."""

    def __init__(self, engine: Ledger) -> None:
        self.engine = engine

    def order_classes(self, classes: Classes, idleness: Idleness, now: float) -> None:
        on_cpu, returning, new = classes
        on_cpu.sort(key=idleness)
        returning.sort(key=idleness)
        new.sort(key=lambda p: (p.context_tokens, idleness(p)))


class ActivityDensity:
    """Classes 1 and 2 by activity density, class 3 smallest first.

    The share of its time a program computes (1 - idleness) per token of GPU room it
    takes, highest first. GPU room is a knapsack: the paper's least idle first fills it
    with the busiest programs whatever their size, so one large busy program keeps out
    several small ones that together compute more; smallest first ignores how much each
    uses the room. The greedy value-per-weight order beat both
    (bench/results/2026-11-24-policy-matrix.md)."""

    def __init__(self, engine: Ledger) -> None:
        self.engine = engine
        self._paper = IdlenessOrder(engine)

    @staticmethod
    def density(idleness: Idleness) -> Callable[[Program], float]:
        return lambda p: -(1.0 - idleness(p)) / max(1, p.context_tokens)

    def order_classes(self, classes: Classes, idleness: Idleness, now: float) -> None:
        self._paper.order_classes(classes, idleness, now)  # ties: the paper's order
        density = self.density(idleness)
        classes[0].sort(key=density)
        classes[1].sort(key=density)

    def rank(self, now: float) -> Rank:
        """Fixed while a request is held (a held program's idleness does not move)."""
        ranking = self.engine.ranking(now)
        return lambda p: _density_rank(p, ranking(p))

    def rank_many(self, programs: list[Program], now: float) -> list[tuple]:
        """The same keys, each program's idleness read once (`Ledger.ranking_many`)."""
        idleness = self.engine.ranking_many(programs, now)
        return [_density_rank(p, i) for p, i in zip(programs, idleness, strict=True)]


def _density_rank(p: Program, idleness: float) -> tuple:
    """`ActivityDensity`'s key of a held request whose idleness is `idleness` (its third
    field is `density`'s, written out: a held tick computes ~1,000 of each, and a shared
    function's call was +1.4 % of the tick's instructions)."""
    held = held_class(p)
    if held < 2:
        return (held, -p.priority, -(1.0 - idleness) / max(1, p.context_tokens), 0)
    return (2, -p.priority, p.context_tokens, 0)


class HybridPriority:
    """An app's hybrid priority (`router.policy.space`) before the inner order, within
    each class and after the client's own priority."""

    def __init__(self, engine: Ledger, inner: Ranking) -> None:
        self.engine = engine
        self.inner = inner

    def order_classes(self, classes: Classes, idleness: Idleness, now: float) -> None:
        self.inner.order_classes(classes, idleness, now)
        priority = self.engine.space.priority  # type: ignore[union-attr]
        for group in classes:
            group.sort(key=lambda p: -priority(p, now))  # stable: the inner order in ties

    def rank(self, now: float) -> Rank:
        base = self.inner.rank(now)
        priority = self.engine.space.priority  # type: ignore[union-attr]
        return lambda p: _with_priority(base(p), priority(p, now))

    def rank_many(self, programs: list[Program], now: float) -> list[tuple]:
        keys = self.inner.rank_many(programs, now)
        priority = self.engine.space.priority  # type: ignore[union-attr]
        return [_with_priority(k, priority(p, now)) for k, p in zip(keys, programs, strict=True)]


def _with_priority(key: tuple, priority: float) -> tuple:
    """An inner key with an app's hybrid priority after the client's."""
    return (*key[:2], -priority, *key[2:])
