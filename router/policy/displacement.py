"""Displacement: who makes room for a held request that does not fit.

Two stages, each with its victim pool (ACTING GPU programs of a replica, best victim
first, taken in order):

* `IdlenessPool` (MORI 4.3.1, every rung): at a tick, a class-1/2 request may swap out
  ACTING programs of its target replica that are more idle than it by at least
  `hysteresis`; an aged request any ACTING program. Built per pass; with token prefix
  sums, "the fewest most-idle victims freeing `needed`" is one bisection.
* `PricedDisplacement` (`mori-priced` and above): a held request of any class may move
  ACTING programs off its own replica's GPU tier when the move pays (`router.policy.
  forecast`: expected remaining idle time against the reload or recompute), farthest
  expected return first (Belady's choice). At a tick every held request in priority order,
  aged ones first; on an event only the first `EVENT_CANDIDATES`, from a queue kept by
  priority, so an event stays cheap at 10 000 programs. Its pools are kept between ticks
  and re-ranked in turns, by the tick itself where requests were taking from them.

Either way the request and its victims move in one swap (`Ledger.swap_in`).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Callable, Container, Iterable
from itertools import accumulate, count

from router.policy.ordering import Idleness, held_class
from router.policy.program import Program
from router.policy.stages import Ledger
from router.policy.types import Move, Placement, Status, Tier

EVENT_CANDIDATES = 8  # held requests (by priority) that may displace on an event
REFRESH_PROGRAMS = 1000  # GPU programs whose expected idle time a tick re-ranks (at least
# one replica's): victim pools are kept between ticks, programs joining them on the way
AGED, RELOAD, FRESH = "aged", "reload", "fresh"  # priced pools, by what the request needs
# a priced pool's entry: (-expected idle, seq, program, start of its tool call, its context)
_Entry = tuple[float, int, Program, float, int]
_Held = tuple[tuple, int, Program, float]  # a held request's entry: (rank, seq, program, arrival)


def in_tool_calls(programs: Iterable[Program]) -> list[Program]:
    """The programs of `programs` in a tool call (ACTING and not marked to leave after
    their step): the ones a move may take off the GPU."""
    return [q for q in programs if q.status is Status.ACTING and q.demote_after_step is None]


class IdlenessPool:
    """ACTING GPU programs per replica, most idle first, built on first use in a pass.

    `idleness`: the pass's ranking (`Ledger.ranking`), for the requests' thresholds; a
    pool ranks its programs with `Ledger.ranking_many`, the same values at once."""

    def __init__(self, engine: Ledger, idleness: Idleness, now: float) -> None:
        self._engine = engine
        self._idleness = idleness
        self._now = now
        self._hysteresis = engine.config.hysteresis
        self._pools: dict[str, tuple[list[Program], list[float], list[int]]] = {}
        self._start: dict[str, int] = {}  # victims before this index were taken already

    def _pool(self, replica: str) -> tuple[list[Program], list[float], list[int]]:
        pool = self._pools.get(replica)
        if pool is None:
            tiers = self._engine.tiers
            gpu = Placement(Tier.GPU, replica)
            acting = [q for q in tiers.members(gpu) if q.status is Status.ACTING]
            idleness = self._engine.ranking_many(acting, self._now)
            order = sorted(range(len(acting)), key=idleness.__getitem__, reverse=True)  # stable
            ranked = [acting[i] for i in order]
            prefix = [0, *accumulate(map(tiers.freed_by, ranked))]
            pool = self._pools[replica] = (ranked, [idleness[i] for i in order], prefix)
            self._start[replica] = 0
        return pool

    def threshold(self, p: Program) -> float:
        """The idleness a victim needs for `p` to swap it out (the hysteresis bar)."""
        return self._idleness(p) + self._hysteresis

    def may_swap(self, p: Program, replicas: list[str]) -> bool:
        """Whether a victim still available on any of `replicas` clears `p`'s threshold.
        One above 1 clears none (idleness is at most 1), and no pool is ranked for it:
        most held requests at a tick are idle enough for that."""
        threshold = self.threshold(p)
        return threshold <= 1.0 and threshold <= self.most_idle(replicas)

    def most_idle(self, replicas: list[str]) -> float:
        """The highest idleness of a victim still available on any of `replicas`."""
        best = -1.0
        for r in replicas:
            _, idleness, _ = self._pool(r)
            start = self._start[r]
            if start < len(idleness) and idleness[start] > best:
                best = idleness[start]
        return best

    def take(self, replica: str, p: Program, needed: int, aged: bool = False) -> list[Program]:
        """Victims freeing `needed` tokens, each >= hysteresis more idle than `p` (any
        ACTING program when `aged`); [] if they cannot free enough (a partial swap would be
        churn for nothing)."""
        threshold = -1.0 if aged else self.threshold(p)
        if threshold > 1.0 or needed <= 0:
            return []
        programs, idleness, prefix = self._pool(replica)
        start = self._start[replica]
        end = bisect_left(prefix, prefix[start] + needed, lo=start)
        if end >= len(prefix) or idleness[end - 1] < threshold:
            return []
        self._start[replica] = end
        return programs[start:end]


def pool_kind(p: Program, replica: str, aged: bool) -> str:
    """Which victims a held request may move on `replica`: an aged one any ACTING program;
    else those whose move pays, priced by whether they keep their host copy, which depends
    on whether the request's KV is in that replica's host tier (`RELOAD`) or is written to
    host anew (`FRESH`; `Forecast.victim_keeps_copy`)."""
    if aged:
        return AGED
    return RELOAD if p.placement.tier is Tier.CPU and p.placement.replica == replica else FRESH


class PricedDisplacement:
    """The priced pass, its victim pools and the queue of held requests by priority."""

    def __init__(self, engine: Ledger) -> None:
        self.engine = engine
        self.victims = PricedPool(engine)
        self.queue = HeldQueue()
        self._refresh_next = 0  # the replica whose victim pools a tick re-ranks next

    def refresh(self, now: float) -> None:
        """A tick: re-ranked victim pools and a compacted queue. Expected idle times grow
        as tool calls go on, so pools are re-ranked, replica by replica in turn, about
        `REFRESH_PROGRAMS` programs a tick (all of them on small deployments): a tick
        stays within its budget at 10 000 programs."""
        engine = self.engine
        replicas = engine.tiers.replicas()
        ranked = 0
        for _ in range(len(replicas)):
            if ranked >= REFRESH_PROGRAMS:
                break
            replica = replicas[self._refresh_next % len(replicas)]
            self._refresh_next += 1
            self.victims.refresh(replica)
            ranked += engine.tiers.count(Placement(Tier.GPU, replica))
        held = [p for p in engine.held_programs() if p.placement.tier is not Tier.GPU]
        self.queue.rebuild(held, engine.ordering.rank_many(held, now))  # type: ignore[attr-defined]

    def tick_end(self, now: float) -> None:
        """The pools `refresh` dropped that requests were taking from, ranked again now
        (`PricedPool.rank_dropped`)."""
        self.victims.rank_dropped(now)

    def held(self, p: Program, now: float) -> None:
        """A request arrived off the GPU: it joins the queue."""
        if p.placement.tier is not Tier.GPU:
            self.queue.push(p, self.engine.ordering.rank(now))  # type: ignore[attr-defined]

    def displace(self, now: float, at_tick: bool, free: dict[str, int] | None) -> list[Move]:
        """Held requests take room from programs whose move pays, on their own replica (a
        new one on the roomiest first); `free`: the room map (`free_room`) when the caller
        has it as it is now."""
        engine = self.engine
        replicas = engine.tiers.replicas()
        if not engine.has_held() or not replicas:
            return []
        if at_tick:
            candidates = self.priority_order(engine.held_programs(), now)
        else:  # the rank is only built if an entry must be ranked again
            candidates = self.queue.top(EVENT_CANDIDATES, lambda: engine.ordering.rank(now))  # type: ignore[attr-defined]
        if not candidates:
            return []
        free = engine.free_room(now) if free is None else free
        moves: list[Move] = []
        aging_s = engine.aging_s
        # The most a replica can offer a request (free room + its movable programs); a
        # request larger than that on every target costs nothing to pass over.
        room: dict[tuple[str, str], int] = {}
        for p in candidates:
            if not p.pending:
                continue
            aged = at_tick and aging_s > 0 and now - p.last_active_s >= aging_s
            if p.last_replica is not None:  # only at home: never moves others to move it
                targets = [p.last_replica] if p.last_replica in free else []
            else:
                targets = sorted(free, key=free.__getitem__, reverse=True)
            for r in targets:
                needed = p.context_tokens - free[r]  # type: ignore[index]
                key = (r, pool_kind(p, r, aged))  # type: ignore[arg-type]
                if key not in room:
                    room[key] = self.victims.room(*key, now)
                if needed > room[key]:
                    continue
                victims = self.victims.take(*key, needed, now)
                if victims:
                    moves += engine.swap_in(p, r, victims, free, now)  # type: ignore[arg-type]
                    room[key] -= sum(v.context_tokens for v in victims)
                    break
        return moves

    def priority_order(self, held: list[Program], now: float) -> list[Program]:
        """Aged requests first (oldest first), then by the rung's rank."""
        aging_s = self.engine.aging_s
        cutoff = now - aging_s if aging_s > 0 else float("-inf")
        aged = [p for p in held if p.last_active_s <= cutoff]
        rest = [p for p in held if p.last_active_s > cutoff]
        ranks = self.engine.ordering.rank_many(rest, now)  # type: ignore[attr-defined]
        return aged + [rest[i] for i in sorted(range(len(rest)), key=ranks.__getitem__)]


class HeldQueue:
    """Held requests by promotion priority, so an event takes the first few in O(log n).

    A heap of (rank, seq, program, arrival); an entry is stale once its request left (or
    its program's class changed: it is pushed again with its new rank)."""

    def __init__(self) -> None:
        self._heap: list[_Held] = []
        self._seq = count()
        self._first: tuple[int, list[_Held]] | None = None  # `top`'s last answer (k, entries)

    def push(self, p: Program, rank: Callable[[Program], tuple]) -> None:
        heapq.heappush(self._heap, (rank(p), next(self._seq), p, p.last_active_s))
        self._first = None

    def rebuild(self, held: list[Program], ranks: list[tuple]) -> None:
        """The queue of `held` (none on a GPU tier), `ranks` their keys: heapified at once,
        its entries in the order pushes would number them (unique: the same pops)."""
        seq = self._seq
        self._heap = [(r, next(seq), p, p.last_active_s) for p, r in zip(held, ranks, strict=True)]
        heapq.heapify(self._heap)
        self._first = None

    def top(self, k: int, rank_now: Callable[[], Callable[[Program], tuple]]) -> list[Program]:
        """The first `k` held requests still waiting; `rank_now()`: the rank to push again
        an entry whose program moved between classes. With nothing pushed since the last
        call, that call's entries are the heap's smallest: if they all still wait in their
        classes they are the answer, without popping (a held event's priced pass asks on
        every event, ~10 % of it while ~500 requests waited)."""
        first = self._first
        if first is not None and first[0] == k and all(_waits(e) for e in first[1]):
            return [entry[2] for entry in first[1]]
        out: list[_Held] = []
        rank: Callable[[Program], tuple] | None = None
        while self._heap and len(out) < k:
            entry = heapq.heappop(self._heap)
            p = entry[2]
            if not p.pending or p.last_active_s != entry[3] or p.placement.tier is Tier.GPU:
                continue
            if held_class(p) != entry[0][0]:  # moved between classes: re-rank it
                rank = rank or rank_now()
                self.push(p, rank)
                continue
            out.append(entry)
        for entry in out:
            heapq.heappush(self._heap, entry)
        self._first = (k, out)
        return [entry[2] for entry in out]


def _waits(entry: _Held) -> bool:
    """Whether a held request's queue entry is still its own: the request waits, off the
    GPU, in the class it was ranked in."""
    p = entry[2]
    waiting = p.pending and p.last_active_s == entry[3] and p.placement.tier is not Tier.GPU
    return waiting and held_class(p) == entry[0][0]


class PricedPool:
    """ACTING GPU programs whose move pays, per replica, farthest expected return first.

    Built per replica on first use after a tick; a program that goes ACTING on a GPU tier
    between ticks is inserted (`add`), so an event never re-ranks a whole tier. Entries go
    stale when their program leaves the GPU or starts its next step; `take` skips them.
    A pool per replica and kind of request (`pool_kind`): whether a move pays depends on
    whether the victim keeps its host copy, which depends on what the request brings;
    aged requests (ticks only) and urgent steps in flight (`router.policy.overload`) may
    take any ACTING program.
    """

    def __init__(self, engine: Ledger) -> None:
        self._engine = engine
        self._pools: dict[tuple[str, str], list[_Entry]] = {}
        self._tokens: dict[tuple[str, str], int] = {}  # per pool: its entries' tokens
        self._used: set[tuple[str, str]] = set()  # pools a request took from since ranked
        self._dropped: set[tuple[str, str]] = set()  # in use when a tick dropped them
        self._seq = count()

    def _cost_s(self, q: Program, kind: str, room: int) -> float:
        """What moving q must win back to pay: `displace_margin` x its reload if it keeps
        its host copy, else its recompute (`room`: its replica's host room)."""
        forecast = self._engine.forecast
        kept = forecast.victim_keeps_copy(q, kind == FRESH, room)  # type: ignore[union-attr]
        margin = self._engine.config.displace_margin
        return margin * forecast.move_cost_s(q, kept_on_host=kept)  # type: ignore[union-attr]

    def _new_entry(self, q: Program, idle: float | None) -> _Entry | None:
        if idle is None:
            return None
        return (-idle, next(self._seq), q, q.interval_start, q.context_tokens)

    def _pool(self, replica: str, kind: str, now: float) -> list[_Entry]:
        """The pool a request takes from (ranked now if it is not kept): it is in use."""
        key = (replica, kind)
        self._used.add(key)
        pool = self._pools.get(key)
        return self._rank_into(key, now) if pool is None else pool

    def _rank_into(self, key: tuple[str, str], now: float) -> list[_Entry]:
        pool = self._pools[key] = self.rank(*key, now)
        self._tokens[key] = sum(entry[4] for entry in pool)
        return pool

    def rank(self, replica: str, kind: str, now: float) -> list[_Entry]:
        """Every ACTING program of GPU(replica) whose move pays, farthest return first
        (the pool's programs priced together)."""
        engine = self._engine
        forecast = engine.forecast
        members = in_tool_calls(engine.tiers.members(Placement(Tier.GPU, replica)))
        if kind == AGED:
            idle: list[float | None] = list(forecast.expected_idle_many(members, now))  # type: ignore[union-attr]
        else:
            room = forecast.host_room(replica)  # type: ignore[union-attr]
            margin = engine.config.displace_margin
            moves = forecast.move_costs_s(members, replica, kind == FRESH, room)  # type: ignore[union-attr]
            costs = [margin * cost for cost in moves]
            idle = forecast.idles_if_moves_pay(members, costs, now)  # type: ignore[union-attr]
        entries = (self._new_entry(q, i) for q, i in zip(members, idle, strict=True))
        return sorted(e for e in entries if e)

    def refresh(self, replica: str) -> None:
        """Drop one replica's pools: expected idle times grow as tool calls go on. A pool
        the tick itself needs is ranked then; one that was in use is ranked again when the
        tick ends (`rank_dropped`), so no event pays for it; one nobody used stays out
        until a request needs it, so while nothing waits no step's end pays for ranking
        its program (`add` finds no pool)."""
        for kind in (AGED, RELOAD, FRESH):
            key = (replica, kind)
            if self._pools.pop(key, None) is not None and key in self._used:
                self._dropped.add(key)
            self._used.discard(key)

    def rank_dropped(self, now: float) -> None:
        """At the end of a tick: rank again the pools `refresh` dropped that a request took
        from since they were ranked, unless the tick ranked them itself (an event would
        have, at its own time). One nobody takes from is not ranked again, nor the aged
        pools: urgent steps in flight take from them between ticks, and ranked here they
        added 16 % to a held tick for what the next urgent step ranks once, at its time."""
        for key in sorted(self._dropped):
            if key not in self._pools and key[1] != AGED:
                self._rank_into(key, now)
        self._dropped.clear()

    def add(self, q: Program, now: float) -> None:
        """`q` went ACTING on its GPU tier: it joins the replica's pools where it pays (the
        aged pool, any ACTING program's, whatever it would cost)."""
        replica: str = q.placement.replica  # type: ignore[assignment]
        forecast = self._engine.forecast
        room: int | None = None
        for kind in (AGED, RELOAD, FRESH):
            pool = self._pools.get((replica, kind))
            if pool is None:
                continue
            if kind == AGED:
                idle: float | None = forecast.expected_idle_s(q, now)  # type: ignore[union-attr]
            else:
                room = forecast.host_room(replica) if room is None else room  # type: ignore[union-attr]
                idle = forecast.idle_if_move_pays(q, self._cost_s(q, kind, room), now)  # type: ignore[union-attr]
            entry = self._new_entry(q, idle)
            if entry is not None:
                insort(pool, entry)
                self._tokens[(replica, kind)] += entry[4]

    def room(self, replica: str, kind: str, now: float) -> int:
        """Tokens the pool could free on `replica`: an upper bound, its entries' contexts
        when they joined, kept as they join and leave (a program still valid to take has
        the context it joined with: it changes only with a request or a response; stale
        entries count, so `take` may still find too little)."""
        self._pool(replica, kind, now)
        return self._tokens[(replica, kind)]

    def take(
        self, replica: str, kind: str, needed: int, now: float, last: Container[str] = ()
    ) -> list[Program]:
        """Victims freeing `needed` tokens on `replica`, farthest return first (programs in
        `last` after all others), or [] (a partial move would be churn for nothing)."""
        if needed <= 0:
            return []
        gpu, freed = Placement(Tier.GPU, replica), 0
        chosen: list[Program] = []
        later: list[Program] = []
        pool = self._pool(replica, kind, now)
        stale, head = 0, True
        tiers = self._engine.tiers
        for _, _, q, since, _ in pool:
            valid = q.placement == gpu and q.status is Status.ACTING
            if not valid or q.interval_start != since or q.demote_after_step is not None:
                stale += head
                continue
            head = False
            if q.program_id in last:
                later.append(q)
                continue
            chosen.append(q)
            freed += tiers.freed_by(q)
            if freed >= needed:
                break
        for q in later if freed < needed else ():
            chosen.append(q)
            freed += tiers.freed_by(q)
            if freed >= needed:
                break
        if freed < needed:
            return []
        self._tokens[(replica, kind)] -= sum(entry[4] for entry in pool[:stale])
        del pool[:stale]  # the stale head is gone for good
        return chosen
