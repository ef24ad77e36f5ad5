"""Overload: a wait bound for programs in flight, and starts as the valve (`mori`).

Under more programs than the replicas hold someone has to wait; this stage decides who.
A program served once has a bound on how long its next step may be held
(`max_step_wait_s`): once it has waited `URGENT_SHARE` of it, it goes onto its own replica
before anything else, into free room or in place of programs in tool calls, or its
replica's room is kept for it until running steps end. A program's first request waits at
the door (`router.policy.door`) and is let in only where no step in flight waits and the
programs in flight leave load to spare (more, up to `door_gain_max`, while they stay
unheld and the host tier holds them all, and never less than `door_gain_min` there); one
not expected in before the gate times it out is told at once to come back.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator

from router.policy.displacement import AGED, FRESH
from router.policy.door import Door
from router.policy.program import Program
from router.policy.stages import Ledger, admitted
from router.policy.types import Move, MoveReason, Placement, Tier

URGENT_SHARE = 0.5  # a held step in flight goes first after this share of max_step_wait_s
# a program's life-mean context per token of its first prompt, before ...: the real Claude
# Code sample's median is 3.1 (generated corpora 3.5-3.7); 4 kept too few programs running
# in runs shorter than a life (bench/results/2026-11-28-overload.md "The growth prior")
GROWTH_PRIOR = 3.0
LIFE_SAMPLES = 5  # ... this many programs ended and their own mean is known
LIFE_ALPHA = 0.05  # weight of the newest ended program in the mean context of a life
# the door's gain (`door_gain_max`; bench/results/2026-11-29-door-gain.md): a held step in
# flight that waited this share of the bound strains its replica (0.6 s of 120: at 1.2 s,
# once a swap's hints were applied freeing first, the 2-replica 32k cell's in-flight p99
# passed smg's again, 40.0 s against 36.1; bench/results/2026-12-02-strain.md)
STRAIN_SHARE = 0.005
GAIN_RISE_S = 300.0  # ... the gain rises by 1 over this much calm (trace seconds)
GAIN_FALL_S = 5.0  # ... and falls e-fold over this much strain
# ... and opens past door_load only while the replica's programs at life size fit this
# share of its host tier (1.0 lost 2.3 % in a Claude cell)
HOST_FIT = 0.8


class WaitBound:
    """The door, the held steps in flight and the room kept for urgent ones."""

    def __init__(self, engine: Ledger) -> None:
        self.engine = engine
        self.door = Door()  # starts waiting to be let in
        # held requests of programs in flight (served once), oldest arrival first
        self._inflight_held: OrderedDict[str, Program] = OrderedDict()
        # ... and per replica the step was served on (its gain's strain: `_strained`)
        self._held_on: dict[str, OrderedDict[str, Program]] = {}
        self.held_for: dict[str, str] = {}  # replica -> the urgent program it keeps room for
        self._first_context: dict[str, int] = {}  # program -> its first prompt (tokens)
        self._context_sum: dict[str, int] = {}  # program -> its contexts after each step
        self._life_context = 0.0  # mean context over a program's steps, programs that ended
        self._lives = 0  # programs that ended after a step
        self.load: dict[str, float] | None = None  # replica -> busy tokens (`loads`)
        self._size: dict[str, float] = {}  # replica -> its programs' KV at life size (`loads`)
        self._load_of: dict[str, tuple[str, float, float]] = {}  # program -> what it adds there
        self._gain: dict[str, float] = {}  # replica -> the door's opening over door_load
        self._gain_at: float | None = None  # when the gains were last brought up to date
        self._topped = False  # every replica's gain is at `door_gain_max`

    @property
    def on(self) -> bool:
        """Whether steps in flight have a wait bound (and starts wait at the door)."""
        return self.engine.config.max_step_wait_s > 0

    # arrivals -------------------------------------------------------------------------
    def admit_start(self, p: Program, now: float) -> list[Move]:
        """A start waits at the door; the passes run, then the door's refusals."""
        self._first_context.setdefault(p.program_id, p.context_tokens)
        self.door.enter(p)
        moves = self.engine.promote(now)
        self.update_refusals(now)
        return admitted(moves, p)

    def update_refusals(self, now: float) -> None:
        """The door marks the starts it will not hold before the gate times them out."""
        config = self.engine.config
        self.door.update_refusals(now, config.gate_timeout_s, config.start_hold_s)

    def step_held(self, p: Program) -> None:
        """A step in flight joins the held ones in arrival order."""
        self._inflight_held.pop(p.program_id, None)
        self._inflight_held[p.program_id] = p
        replica: str = p.last_replica  # type: ignore[assignment]
        on = self._held_on.setdefault(replica, OrderedDict())
        on.pop(p.program_id, None)
        self._oldest_on(replica)  # released entries at the front go: the index stays short
        on[p.program_id] = p

    def closes(self, p: Program | None) -> bool:
        """Whether `p`'s held step keeps its replica closed to the door's starts."""
        return self.on and p is not None and p.pending and p.program_id in self._inflight_held

    def waiting_in_flight(self) -> Iterator[Program]:
        """Held requests of programs in flight, oldest first (the index is cleaned as it is
        read: released, cancelled and ended entries drop out at the front)."""
        index, programs = self._inflight_held, self.engine.programs
        while index:
            p = next(iter(index.values()))
            if p.pending and p.program_id in programs:
                break
            index.popitem(last=False)
        return (p for p in index.values() if p.pending)

    def urgent(self, now: float) -> list[Program]:
        """Held steps in flight that have waited `URGENT_SHARE` of the bound, oldest first."""
        due = now - URGENT_SHARE * self.engine.config.max_step_wait_s
        out = []
        for p in self.waiting_in_flight():
            if p.last_active_s > due:
                break
            out.append(p)
        return out

    def wakeup(self) -> float | None:
        """When the oldest held step in flight becomes urgent."""
        oldest = next(self.waiting_in_flight(), None)
        if oldest is None:
            return None
        return oldest.last_active_s + URGENT_SHARE * self.engine.config.max_step_wait_s

    # urgent steps ----------------------------------------------------------------------
    def serve_urgent(self, now: float) -> list[Move]:
        """Each urgent step goes onto its own replica now: into free room (the growth
        band does not hold against it), else in place of programs in tool calls, farthest
        expected return first, whatever their idleness (priced as any move: they keep
        their host copy where it survives). Where programs in tool calls do not hold
        enough, the replica's room is kept for it (`held_for`) until running steps end:
        nothing else is placed there meanwhile, so its wait is bounded by a step."""
        engine, tiers = self.engine, self.engine.tiers
        self.held_for.clear()
        urgent = self.urgent(now)
        if not urgent:  # most passes: nothing has waited that long
            return []
        moves: list[Move] = []
        healthy = set(tiers.replicas())
        for p in urgent:
            home = p.last_replica
            if home not in healthy or home in self.held_for:
                continue
            gpu = Placement(Tier.GPU, home)
            missing = tiers.need(p, gpu) - tiers.free(gpu)
            victims = self._urgent_victims(home, missing, now) if missing > 0 else []
            if missing > 0 and not victims:
                self.held_for[home] = p.program_id  # type: ignore[index]
                continue
            engine.timed.outcomes["urgent_placed"] += 1  # type: ignore[union-attr]
            moves += engine.swap_in(p, home, victims, {home: 0}, now)  # type: ignore[arg-type]
        return moves

    def _urgent_victims(self, replica: str, needed: int, now: float) -> list[Program]:
        """Programs in tool calls on GPU(replica) whose leaving frees `needed`, farthest
        expected return first (predicted-promoted ones last), or [] if they cannot: the
        priced pass's pool of any program in a tool call (`AGED`), kept as the others are
        (ranked by the first urgent step after a tick refreshed its replica, a program
        joining when its step ends), so an urgent step no longer prices its replica's ~300
        programs in tool calls at its own time (half an event while steps were urgent)."""
        engine = self.engine
        protected = engine.timed.protected_until  # type: ignore[union-attr]
        return engine.priced.victims.take(replica, AGED, needed, now, last=protected)  # type: ignore[union-attr]

    # the door --------------------------------------------------------------------------
    def let_in(self, now: float) -> list[Move]:
        """Starts at the door, in the order they first asked (a client's `priority` first),
        onto replicas where no step in flight waits and the programs in flight leave load
        to spare (`spare`): into free room, where each program would have the most (as any
        new program), else in place of programs in tool calls whose move pays."""
        engine = self.engine
        self._update_gains(now)  # every pass, so it sees the strain while no start waits
        starts = self.door.held()
        if not starts:
            return []
        starts.sort(key=lambda p: -p.priority)  # stable: door order among equals
        closed = {r for r in self._held_on if self._oldest_on(r) is not None}
        replicas = engine.tiers.replicas()
        if self.loads(now).keys() != set(replicas):  # a replica came or went since the sum
            self.load = None  # summed afresh by `spare`
        open_ = {r for r in replicas if r not in closed and self.spare(r, now) > 0}
        free = {r: room for r, room in engine.free_room(now).items() if r in open_}
        moves: list[Move] = []
        for p in starts:
            if not free:
                break
            placed = self._place_start(p, free, now)
            if placed:
                r: str = placed[-1].dst.replica  # type: ignore[assignment]
                self._count_load(p, r, now)
                if self.spare(r, now) <= 0:
                    del free[r]
                moves += placed
        return moves

    def spare(self, replica: str, now: float) -> float:
        """The busy load the door may still let in on `replica`: `door_load` x its GPU
        room less what its programs in flight bring (`loads`), opened to its gain (never
        below `door_gain_min`) while the host tier holds every program of it at life size.
        HiCache writes each program's KV through to host, so past the host's room a program
        parked in a tool call loses its copy and recomputes on return: opened at a CPU
        ratio of 1 the door doubled the prefilled tokens and lost 5-12 %; at 2 it gained up
        to 4 %, and its floor another 0.5-2 % where the gain was strained
        (bench/results/2026-12-02-host-door.md)."""
        config = self.engine.config
        load = self.loads(now).get(replica, 0.0)  # a replica new since the sum: none yet
        door = config.door_load * self._room(replica)
        floor = min(config.door_gain_min, config.door_gain_max)
        gain = max(self._gain.get(replica, 1.0), floor)
        if gain <= 1.0:
            return door - load
        host_tokens = self.engine.tiers.capacity[replica].cpu_tokens
        host = HOST_FIT * host_tokens - self._size.get(replica, 0.0)
        return max(door - load, min(gain * door - load, host))

    def _update_gains(self, now: float) -> None:
        """Each replica's gain, brought up to `now`: it rises while no step in flight held
        there has waited STRAIN_SHARE of the bound and falls fast once one has, so the
        door stops widening as soon as returning steps queue, before the bound must swap."""
        top = self.engine.config.door_gain_max
        if top <= 1.0:
            return
        elapsed = 0.0 if self._gain_at is None else now - self._gain_at
        self._gain_at = now
        if elapsed <= 0.0:  # a second pass at the same time: nothing to bring up
            return
        gains, replicas = self._gain, self.engine.tiers.capacity  # a drained one's too
        since = now - STRAIN_SHARE * self.engine.config.max_step_wait_s
        strained = self._strained(since) if self._inflight_held else set()
        if not strained and self._topped and len(gains) == len(replicas):  # none removed
            return  # most passes under a steady load: every gain at its top, no strain
        trace_s = elapsed * self.engine.config.time_scale
        rise, fall = trace_s / GAIN_RISE_S, math.exp(-trace_s / GAIN_FALL_S)
        topped = not strained
        for r in replicas:
            gain = gains.get(r, 1.0)
            if r in strained:
                gains[r] = max(1.0, gain * fall) if gain > 1.0 else 1.0
            elif gain < top:
                gains[r] = gain = min(top, gain + rise)
                topped = topped and gain >= top
        self._topped = topped

    def _strained(self, since: float) -> set[str]:
        """Replicas whose oldest held step in flight asked before `since`: one look per
        replica (the ~600 held steps of a loaded engine, read per pass, cost +9 % an
        event)."""
        strained = set()
        for replica in self._held_on:
            oldest = self._oldest_on(replica)
            if oldest is not None and oldest.last_active_s < since:
                strained.add(replica)
        return strained

    def _oldest_on(self, replica: str) -> Program | None:
        """The oldest held step in flight served on `replica`; released, moved and ended
        entries drop out at the front as it is read."""
        index, programs = self._held_on[replica], self.engine.programs
        while index:
            p = next(iter(index.values()))
            if p.pending and programs.get(p.program_id) is p and p.last_replica == replica:
                return p
            index.popitem(last=False)
        return None

    def _place_start(self, p: Program, free: dict[str, int], now: float) -> list[Move]:
        engine = self.engine
        order = engine.placement.spread(free)  # type: ignore[attr-defined]
        for r in order:
            gpu = Placement(Tier.GPU, r)
            need = engine.tiers.need(p, gpu)
            if need <= free[r]:
                free[r] -= need
                return [engine.move(p, gpu, MoveReason.PROMOTE_NEW, now)]
        victims_of = engine.priced.victims  # type: ignore[union-attr]
        for r in order:  # its whole context: a segment it would share may leave with a victim
            missing = p.context_tokens - free[r]
            victims = victims_of.take(r, FRESH, missing, now)
            if victims:
                return engine.swap_in(p, r, victims, free, now)
        return []

    def loads(self, now: float) -> dict[str, float]:
        """The GPU room the programs in flight keep busy on each replica, on average, in
        tokens: each one's KV over its life (`_footprint`) times the share of its time the
        engine runs it (`Program.engine_share`: 1 - idleness less the measured round trip
        to the replica per step; a program without history counts whole). While it
        stays below the room there is, returning steps find room; past it they queue, and
        the queue is what the wait bound has to break by swapping. Summed over every
        program at a full tick (O(programs)); between ticks a program's share is counted
        again at its step's end, a start let in adds its own and an ended program takes
        its own away, so an event costs O(1)."""
        engine = self.engine
        if self.load is None:
            self.load = dict.fromkeys(engine.tiers.replicas(), 0.0)
            self._size = dict.fromkeys(self.load, 0.0)
            self._load_of = {}
            for p in engine.programs.values():
                if p.last_replica in self.load:  # None at the door
                    self._count_load(p, p.last_replica, now)  # type: ignore[arg-type]
        return self.load

    def _count_load(self, p: Program, replica: str, now: float) -> None:
        """Count `p`'s busy share and life size on `replica` in place of what it added
        before (at a step's end its idleness is its cycles' without the call just begun:
        its usual share)."""
        self._uncount_load(p.program_id)
        footprint = self._footprint(p)
        prices = self.engine.prices.get(replica)
        share = footprint * p.engine_share(now, prices.round_trip_s if prices else 0.0)
        self._load_of[p.program_id] = (replica, share, footprint)
        if self.load is not None and replica in self.load:
            self.load[replica] += share
            self._size[replica] += footprint

    def _uncount_load(self, program_id: str) -> None:
        counted = self._load_of.pop(program_id, None)
        if counted is not None and self.load is not None and counted[0] in self.load:
            self.load[counted[0]] -= counted[1]
            self._size[counted[0]] -= counted[2]

    def _room(self, replica: str) -> int:
        return max(1, self.engine.tiers.budget(Placement(Tier.GPU, replica)))

    def _footprint(self, p: Program) -> float:
        """The KV `p` holds over its life: an agent's context grows every step (3-4x its
        first prompt over a coding task), so a program counts at least what programs that
        ended held on average (`GROWTH_PRIOR` x its prompt until `LIFE_SAMPLES` ended)."""
        if self._lives >= LIFE_SAMPLES:
            return max(p.context_tokens, self._life_context)
        first = self._first_context.get(p.program_id, p.context_tokens)
        return max(p.context_tokens, GROWTH_PRIOR * first)

    # steps and ends ------------------------------------------------------------------------
    def step_ended(self, p: Program, now: float) -> None:
        """The step's context joins its life mean, and its load share is counted again
        (before the gate's pass, which lets starts in against the load as it is now)."""
        self._context_sum[p.program_id] = self._context_sum.get(p.program_id, 0) + p.context_tokens
        if self.load is not None and p.last_replica is not None:
            self._count_load(p, p.last_replica, now)

    def forget(self, p: Program | None, program_id: str) -> None:
        """`program_id` ended: it leaves the door and the held, and its life is a sample."""
        self.door.forget(program_id)
        self._inflight_held.pop(program_id, None)
        if p is not None:
            self._observe_life(p)
        self._uncount_load(program_id)

    def _observe_life(self, p: Program) -> None:
        """`p` ended: the mean context of its steps is one more sample of a life's."""
        total = self._context_sum.pop(p.program_id, 0)
        self._first_context.pop(p.program_id, None)
        if p.steps <= 0 or total <= 0:
            return
        mean = total / p.steps
        self._lives += 1
        weight = max(LIFE_ALPHA, 1.0 / self._lives)  # a plain mean over the first ones
        self._life_context += weight * (mean - self._life_context)
