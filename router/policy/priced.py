"""MORI, work-conserving (`mori-priced`): priced displacement on top of the paper's tiers.

The default policy `mori` (router.policy.mori) is this plus Tokencake's time scheduler;
this class alone is registered for the ablation (`mori-paper` -> `mori-priced` -> `mori`).

The paper's gate reserves a GPU-tier program's whole context through its tool calls, and
only a budget overflow or a clearly busier class-1/2 request displaces it. On real agent
traces that leaves the engine idle behind a full gate: GPU tiers full of programs in long
tool calls (or abandoned), new programs unable to displace anyone, returning programs
that were idle for long "too idle" to displace either (docs/policy.md has the numbers).

This policy keeps the paper's tiers, classes, BFD placement and typed hints, and adds one
priced rule: a held request of any class that does not fit may move ACTING programs off
its replica's GPU tier when the move pays,

    expected remaining idle time  >=  displace_margin x cost of bringing it back,

where the expected remaining idle time is the mean residual life of the program's current
tool call given how long it has lasted (`router.policy.residual`, per tool key, learned
online), and the cost is the reload over PCIe when the program's KV fits the replica's
host tier, else its recompute (prefill), both priced per replica from the engine's own
answers (`router.policy.prices`). Victims go farthest expected return first (Belady's
choice). Requests held past `aging_s` go first and may move any ACTING program.
"""

from __future__ import annotations

import contextlib
import heapq
from bisect import insort
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import count
from typing import Any

from router.policy.base import PolicyConfig
from router.policy.mori_paper import Classes, Idleness, MoriPaperPolicy
from router.policy.predictor import DurationPredictor
from router.policy.program import Program
from router.policy.types import WAITING, Move, MoveReason, Placement, Status, Tier

UNKNOWN_TOOL = "unknown"  # a gap whose tool the router was not told
RETURN_WAIT_ALPHA = 0.1  # weight of the newest return wait in `return_wait_s`
EVENT_CANDIDATES = 8  # held requests (by priority) that may displace on an event
REFRESH_PROGRAMS = 1000  # GPU programs whose expected idle time a tick re-ranks (at least
# one replica's): victim pools are kept between ticks, programs joining them on the way


@dataclass(slots=True)
class ToolCall:
    """The tool call a program is in: what it is and when it is expected to end."""

    tool: str
    agent: str | None
    start_s: float
    predicted_s: float
    ended_s: float | None = None  # the client said it finished (on_tool_end)
    promote_tried: bool = False  # mori's predictive promotion done (one per call)

    @property
    def predicted_end_s(self) -> float:
        return self.start_s + self.predicted_s


class PricedPolicy(MoriPaperPolicy):
    """MORI with priced, work-conserving displacement and aging on."""

    name = "mori-priced"
    default_aging_s = 1800.0  # chosen by the sweep in docs/policy.md ("Aging")
    CPU_MAY_LEAVE_HOME = True  # ... once its wait pays for a recompute elsewhere

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self.predictor = DurationPredictor(self.config.ewma_alpha, self.config.hint_alpha)
        self.calls: dict[str, ToolCall] = {}  # program -> the tool call it is in
        self._evicted_since: dict[str, float] = {}  # held requests of programs off the GPU
        self._queue = _Queue()
        self._victims = _Victims(self)
        self._refresh_next = 0  # the replica whose victim pool a tick re-ranks next
        self.return_wait_s = 0.0  # EWMA of those requests' gate waits (Continuum's T)
        self._home_only = False  # a packing pass offering each replica's room to its own
        self._waited_for: set[str | None] = set()  # replicas whose own programs still wait

    # tool calls ----------------------------------------------------------------------
    def on_tool_start(
        self,
        program_id: str,
        now: float,
        tool: str,
        agent: str | None = None,
        predict_s: float | None = None,
    ) -> list[Move]:
        moves = super().on_tool_start(program_id, now, tool, agent, predict_s)
        p = self.programs.get(program_id)
        if p is not None and p.status is Status.ACTING:
            predicted = self.predictor.predict(agent, tool, predict_s)
            self.calls[program_id] = ToolCall(tool, agent, p.interval_start, predicted)
        return moves

    def on_request(
        self, program_id: str, now: float, context_tokens: int | None = None
    ) -> list[Move]:
        """The gap that just closed is one more observed tool duration."""
        p = self.programs.get(program_id)
        if p is not None and p.steps > 0 and p.status is Status.ACTING:
            self.observe_call(program_id, now)
            if p.placement.tier is not Tier.GPU:
                self._evicted_since[program_id] = now
        self.calls.pop(program_id, None)
        return super().on_request(program_id, now, context_tokens)

    def observe_call(self, program_id: str, now: float) -> None:
        """The tool call of an ACTING program ended now (its next request came, or the
        client said so): feed its duration to the predictor, once."""
        p = self.programs[program_id]
        call = self.calls.get(program_id)
        if call is None:
            self.predictor.observe(None, UNKNOWN_TOOL, now - p.interval_start)
        elif call.ended_s is None:
            call.ended_s = now
            self.predictor.observe(call.agent, call.tool, now - call.start_s, call.predicted_s)

    def _start(self, p: Program, now: float) -> None:
        """A returning program that had lost its GPU room waited this long at the gate:
        what the next program moved off the GPU should expect to wait when it returns."""
        since = self._evicted_since.pop(p.program_id, None)
        if since is not None:
            a = RETURN_WAIT_ALPHA
            self.return_wait_s = a * (now - since) + (1 - a) * self.return_wait_s
        super()._start(p, now)

    def cancel(self, program_id: str, now: float) -> list[Move]:
        self._evicted_since.pop(program_id, None)
        return super().cancel(program_id, now)

    def end(self, program_id: str, now: float, reason: MoveReason = MoveReason.END) -> list[Move]:
        self.calls.pop(program_id, None)
        self._evicted_since.pop(program_id, None)
        return super().end(program_id, now, reason)

    def host_room(self, replica: str) -> int:
        """Host DRAM tokens a CPU-tier program can really use on `replica`.

        HiCache writes every finished request through to host and never evicts the host
        copy of a block still on the GPU, so GPU-tier programs' backups hold host room
        the CPU tier cannot have: at a CPU ratio of 1 a full GPU tier leaves the CPU tier
        almost nothing, and a program "offloaded" there loses its host copy and recomputes.
        """
        cpu, gpu = Placement(Tier.CPU, replica), Placement(Tier.GPU, replica)
        return self.tiers.budget(cpu) - self.tiers.used(cpu) - self.tiers.used(gpu)

    def keeps_host_copy(self, p: Program, replica: str, room: int | None = None) -> bool:
        """Whether `p` keeps a host copy of its KV on `replica`'s CPU tier.

        A program on that replica's GPU tier has its copy there already (write-through)
        and `host_room` counts it: moving it to CPU changes no host usage, so it keeps
        the copy unless the host is over budget. Demanding its size in free host room on
        top, as before, counted it twice: victims on a full host were priced as
        recomputes, went to WAITING (whose host copies go first) and recomputed 40 % of
        their prompts on return (the README's demo cell, simulated). `room`: the replica's
        `host_room`, when the caller has it."""
        room = self.host_room(replica) if room is None else room
        if p.placement == Placement(Tier.GPU, replica):
            return room >= 0
        return p.context_tokens <= room

    def victim_keeps_copy(self, q: Program, fresh: bool, room: int | None = None) -> bool:
        """Whether ACTING `q`, moved off its GPU tier to make room for a request, keeps its
        host copy. A request whose KV is in that replica's host tier brings no new host
        blocks (`keeps_host_copy`); one whose KV is written to host anew (`fresh`) takes
        about the room q frees, so q keeps its copy only if the host has that much free.
        `room`: the replica's `host_room`, when the caller has it (a victim pool asks for
        hundreds of programs of one replica)."""
        replica: str = q.placement.replica  # type: ignore[assignment]
        if fresh:
            return q.context_tokens <= (self.host_room(replica) if room is None else room)
        return self.keeps_host_copy(q, replica, room)

    def _fit_or_waiting(self, dst: Placement, p: Program) -> Placement:
        if dst.tier is Tier.CPU and not self.keeps_host_copy(p, dst.replica):  # type: ignore[arg-type]
            return WAITING
        return dst

    # replica affinity -------------------------------------------------------------------
    def _replicas_for(self, p: Program, free: dict[str, int], now: float) -> list[str]:
        """A returning program goes back to its own replica (where its KV, device or host
        copy, may still be), and to another one only once moving there pays
        (`_leave_for`); a new program, or one whose replica is gone, goes where each
        program would have the most room (`_spread_order`)."""
        home = p.last_replica
        if home not in free:
            return self._spread_order(free)
        if self._home_only:
            return [home]
        others = sorted(
            (r for r in free if r != home and r not in self._waited_for),
            key=free.__getitem__,
            reverse=True,
        )
        return [home, *(r for r in others if self._leave_for(p, r, now))]

    def _spread_order(self, free: dict[str, int]) -> list[str]:
        """Where a program with no replica goes: most free room per program first, counting
        the newcomer (`spread_order`). Free room alone is a snapshot that a task's last
        steps or one large idle program distort, and affinity then keeps the placement for
        the program's whole life (All-Gather, one task in flight: by room, a new task's 8
        agents all went where the last task's stragglers had just left, and one replica did
        75 % of the work); the programs a replica runs are its load to come. Per program
        of room, a replica with ten times the KV still takes about ten times the programs."""
        return spread_order(free, {r: self.tiers.count(Placement(Tier.GPU, r)) for r in free})

    def _pack_waiting(
        self, ranked: list[Program], free: dict[str, int], now: float, moves: list[Move]
    ) -> list[Program]:
        """Free room goes to each replica's own returning programs and to new ones first;
        what is left over then to programs of other replicas whose move pays (work
        conservation without taking a replica's room from its own programs)."""
        with self._at_home():
            left = super()._pack_waiting(ranked, free, now, moves)
        if not left:
            return left
        self._waited_for = {q.last_replica for q in left}
        try:
            return super()._pack_waiting(left, free, now, moves)
        finally:
            self._waited_for = set()

    def _swap_replicas(self, p: Program, free: dict[str, int], now: float) -> list[str]:
        """The paper's idleness swaps, on a returning program's own replica only: moving
        others off a replica to make room for a program whose KV is elsewhere pays twice."""
        if p.last_replica in free:
            return [p.last_replica]  # type: ignore[list-item]
        return super()._swap_replicas(p, free, now)

    @contextlib.contextmanager
    def _at_home(self) -> Iterator[None]:
        """While inside, `_replicas_for` offers a returning program its own replica only."""
        self._home_only = True
        try:
            yield
        finally:
            self._home_only = False

    def _may_leave_home(self, p: Program, now: float) -> bool:
        """A CPU-tier request may be placed elsewhere once moving to some replica pays."""
        return any(self._leave_for(p, r, now) for r in self.tiers.replicas())

    def _leave_for(self, p: Program, replica: str, now: float) -> bool:
        """Ski rental: a held request waits for its own replica until its wait reaches
        `home_wait` x what placing it on `replica` instead costs: its whole context
        prefilled again there, stalling every step running on that replica while it lasts
        (the copy it leaves at home is garbage). Break-even (1.0) is 2-competitive against
        knowing when room would come back home. Moving for less is what made 50-90 % of
        programs change replica (the paper: under 3 %) and threw their caches away."""
        if replica == p.last_replica or replica not in self.prices:
            return False
        return now - p.last_active_s >= self.config.home_wait * self.recompute_cost_s(p, replica)

    def recompute_cost_s(self, p: Program, replica: str) -> float:
        """Seconds prefilling `p`'s whole context on `replica` costs: once for `p` and once
        for every step running there, which the prefill batch stalls meanwhile."""
        return self.prices[replica].recompute_s(p.context_tokens) * (1 + self.reasoning_on(replica))

    def expected_idle_s(self, p: Program, now: float) -> float:
        """Expected seconds until an ACTING program's next request."""
        return self.predictor.remaining_s(*self._current_call(p, now))

    def expected_idle_many(self, programs: list[Program], now: float) -> list[float]:
        """`expected_idle_s` of each of `programs` (ACTING) at once (`residuals`)."""
        return self.residuals(programs, [0.0] * len(programs), now)[0]

    def residuals(
        self, programs: list[Program], more_s: list[float], now: float
    ) -> tuple[list[float], list[float | None]]:
        """`DurationPredictor.residual` of the tool call each of `programs` (ACTING) is
        in, `more_s` apart: a tool's calls priced together, in numpy."""
        calls: dict[tuple[str | None, str], list[int]] = defaultdict(list)
        elapsed = []
        for i, p in enumerate(programs):
            agent, tool, since = self._current_call(p, now)
            calls[agent, tool].append(i)
            elapsed.append(since)
        idle, stays = [0.0] * len(programs), [None] * len(programs)
        for (agent, tool), at in calls.items():
            got = self.predictor.residual_many(
                agent, tool, [elapsed[i] for i in at], [more_s[i] for i in at]
            )
            for i, left, p in zip(at, *got, strict=True):
                idle[i], stays[i] = left, p
        return idle, stays

    def _current_call(self, p: Program, now: float) -> tuple[str | None, str, float]:
        """(agent, tool, elapsed s) of the tool call ACTING `p` is in: an unknown tool since
        its step ended when the client did not say."""
        call = self.calls.get(p.program_id)
        if call is None:
            return None, UNKNOWN_TOOL, now - p.interval_start
        return call.agent, call.tool, now - call.start_s

    def idle_if_move_pays(self, p: Program, cost_s: float, now: float) -> float | None:
        """ACTING `p`'s expected idle seconds (`expected_idle_s`) if moving it off its GPU
        tier pays, else None. It pays if `p` stays away at least `cost_s` with probability
        `displace_confidence` or more, by its tool's learned duration distribution; without
        one (cold start), if its mean residual covers it. Agent tool times are heavy-tailed,
        so the mean residual is carried by rare long calls: moved on it, most victims came
        back well before it (3 replicas, real sample: median 9.8 s away against 27.8 s
        expected) and paid their recompute for nothing."""
        idle, stays = self.predictor.residual(*self._current_call(p, now), cost_s)
        return self._if_pays(idle, stays, cost_s)

    def idles_if_moves_pay(
        self, programs: list[Program], costs_s: list[float], now: float
    ) -> list[float | None]:
        """`idle_if_move_pays` of each of `programs` at once (`residuals`: a victim pool)."""
        idle, stays = self.residuals(programs, costs_s, now)
        return [self._if_pays(*args) for args in zip(idle, stays, costs_s, strict=True)]

    def _if_pays(self, idle: float, stays: float | None, cost_s: float) -> float | None:
        """`idle` if a move costing `cost_s` pays (`idle_if_move_pays`), else None."""
        pays = idle >= cost_s if stays is None else stays >= self.config.displace_confidence
        return idle if pays else None

    def move_cost_s(self, p: Program, kept_on_host: bool) -> float:
        """What moving `p` off its GPU tier costs, in seconds.

        Kept on host: the reload over PCIe, which overlaps the engine's work. The wait `p`
        may meet at the gate when it returns is matched by the wait the admitted request
        no longer has, and the room works now instead of idling: not a cost.

        Not kept: the recompute, which stalls every step running on the replica while it
        lasts (a prefill batch pauses decoding), so it counts once per running step and
        once for `p`; plus the gate wait programs moved off the GPU met lately, since
        under saturation such a move only trades one program's wait for another's and
        pays a prefill for it (generated corpus, 80 programs, CPU ratio 1: 245 tok/s
        without the two terms against 316 with them)."""
        replica: str = p.placement.replica  # type: ignore[assignment]
        if kept_on_host:
            return self.prices[replica].reload_s(p.context_tokens)
        return self.recompute_cost_s(p, replica) + self.return_wait_s

    def describe(self, program_id: str, now: float) -> dict[str, Any] | None:
        view = super().describe(program_id, now)
        p = self.programs.get(program_id)
        if view is not None and p is not None and p.status is Status.ACTING and p.steps > 0:
            view["expected_idle_s"] = round(self.expected_idle_s(p, now), 3)
        return view

    # promotion ----------------------------------------------------------------------------
    def _rebalance(self, now: float) -> list[Move]:
        """A tick: re-ranked victim pools and a compacted queue, then the usual rebalance,
        whose priced pass gives every held request its turn in priority order.

        Expected idle times grow as tool calls go on, so pools are re-ranked, replica by
        replica in turn, about `REFRESH_PROGRAMS` programs a tick (all of them on small
        deployments): a tick stays within its budget at 10 000 programs."""
        replicas = self.tiers.replicas()
        ranked = 0
        for _ in range(len(replicas)):
            if ranked >= REFRESH_PROGRAMS:
                break
            replica = replicas[self._refresh_next % len(replicas)]
            self._refresh_next += 1
            self._victims.refresh(replica, now)
            ranked += self.tiers.count(Placement(Tier.GPU, replica))
        self._queue.rebuild(self._held_programs(), self._rank(now))
        return super()._rebalance(now)

    def _admit(self, p: Program, now: float) -> list[Move]:
        if p.placement.tier is not Tier.GPU:
            self._queue.push(p, self._rank(now))
        return super()._admit(p, now)

    def _after_response(self, p: Program, now: float) -> list[Move]:
        """A program that just went ACTING on a GPU tier may be moved for a held request."""
        if p.placement.tier is Tier.GPU and p.status is Status.ACTING:
            self._victims.add(p, now)
        return super()._after_response(p, now)

    def _promote(self, now: float, displace: bool = False) -> list[Move]:
        """The paper's pass (into free room; at a tick also its idleness swaps), then
        priced displacement for what is left; room a displacement frees beyond its request
        goes to the gate at once. A paper pass that moved nothing leaves its room map as a
        fresh one would be, and the priced pass takes it (`_free_room`)."""
        moves: list[Move] = []
        paper_displace = displace
        while self._held and self.tiers.replicas():
            free = self._free_room(now)
            paper = super()._promote_into(free, now, paper_displace)
            priced = self._displace_priced(now, displace, None if paper else free)
            moves += paper + priced
            if not priced:
                break
            paper_displace = False
        return moves

    def _displace_priced(
        self, now: float, at_tick: bool, free: dict[str, int] | None
    ) -> list[Move]:
        """At a tick every held request, aged ones first; on an event only the first
        `EVENT_CANDIDATES` by priority (an event must stay cheap at 10 000 programs).
        `free`: the room map (`_free_room`) when the caller has it as it is now."""
        replicas = self.tiers.replicas()
        if not self._held or not replicas:
            return []
        if at_tick:
            candidates = self._priority_order(self._held_programs(), now)
        else:
            candidates = self._queue.top(EVENT_CANDIDATES, self._rank(now))
        if not candidates:
            return []
        free = self._free_room(now) if free is None else free
        moves: list[Move] = []
        # The most a replica can offer a request (free room + its movable programs); a
        # request larger than that on every target costs nothing to pass over.
        room: dict[tuple[str, str], int] = {}
        for p in candidates:
            if not p.pending:
                continue
            aged = at_tick and self.aging_s > 0 and now - p.last_active_s >= self.aging_s
            if p.last_replica is not None:  # only at home: never moves others to move it
                targets = [p.last_replica] if p.last_replica in free else []
            else:
                targets = sorted(free, key=free.__getitem__, reverse=True)
            for r in targets:
                needed = p.context_tokens - free[r]  # type: ignore[index]
                key = (r, _pool_kind(p, r, aged))  # type: ignore[arg-type]
                if key not in room:
                    room[key] = self._victims.room(*key, now)
                if needed > room[key]:
                    continue
                victims = self._victims.take(*key, needed, now)
                if victims:
                    moves += self._swap_in(p, r, victims, free, now)  # type: ignore[arg-type]
                    room[key] -= sum(v.context_tokens for v in victims)
                    break
        return moves

    def _rank(self, now: float) -> Callable[[Program], tuple]:
        """The promotion order of a held request: the paper's classes (CPU with a request,
        returning, new); within a class the client's priority first (agent hints), then
        within 1 and 2 the most GPU activity per token of room (`_activity_density`),
        within 3 smallest first. Fixed while a request is held (a held program's idleness
        does not move)."""
        density = self._activity_density(self._ranking(now))

        def rank(p: Program) -> tuple:
            held_class = _held_class(p)
            if held_class < 2:
                return (held_class, -p.priority, density(p), 0)
            return (2, -p.priority, p.context_tokens, 0)

        return rank

    def _order_classes(self, classes: Classes, idleness: Idleness, now: float) -> None:
        """Classes 1 and 2 by activity density (`_rank`), class 3 smallest first."""
        super()._order_classes(classes, idleness, now)
        density = self._activity_density(idleness)
        classes[0].sort(key=density)
        classes[1].sort(key=density)

    @staticmethod
    def _activity_density(idleness: Idleness) -> Callable[[Program], float]:
        """Sort key: the share of its time a program computes (1 - idleness) per token of
        GPU room it takes, highest first. GPU room is a knapsack: the paper's least idle
        first fills it with the busiest programs whatever their size, so one large busy
        program keeps out several small ones that together compute more; smallest first
        ignores how much each uses the room. The greedy value-per-weight order beat both
        (bench/results/2026-11-24-policy-matrix.md)."""
        return lambda p: -(1.0 - idleness(p)) / max(1, p.context_tokens)

    def _priority_order(self, held: list[Program], now: float) -> list[Program]:
        """Aged requests first (oldest first), then by `_rank`."""
        cutoff = now - self.aging_s if self.aging_s > 0 else float("-inf")
        aged = [p for p in held if p.last_active_s <= cutoff]
        rest = sorted((p for p in held if p.last_active_s > cutoff), key=self._rank(now))
        return aged + rest

    def _swap_in(
        self, p: Program, replica: str, victims: list[Program], free: dict[str, int], now: float
    ) -> list[Move]:
        reason = (
            MoveReason.PROMOTE_CPU
            if p.placement.tier is Tier.CPU
            else MoveReason.PROMOTE_WAITING
            if p.steps > 0
            else MoveReason.PROMOTE_NEW
        )
        gpu = Placement(Tier.GPU, replica)
        before = self.tiers.used(gpu)  # the change, not a sum: shared segments count once
        moves = [self._move(p, gpu, reason, now)]
        cpu = Placement(Tier.CPU, replica)
        for v in victims:
            moves.insert(-1, self._move(v, self._fit_or_waiting(cpu, v), MoveReason.DEMOTE, now))
        free[replica] -= self.tiers.used(gpu) - before
        return moves


def spread_order(free: dict[str, int], programs: dict[str, int]) -> list[str]:
    """Replicas by the free room each of their programs would have with one more (most
    first), then by free room."""
    return sorted(free, key=lambda r: (-free[r] / (programs[r] + 1), -free[r]))


AGED, RELOAD, FRESH = "aged", "reload", "fresh"  # victim pools, by what the request needs
# a victim pool's entry: (-expected idle, seq, program, start of its tool call, its context)
_Entry = tuple[float, int, Program, float, int]


def in_tool_calls(programs: Iterable[Program]) -> list[Program]:
    """The ACTING programs not marked to leave after their step: those a move may take
    off the GPU (victim pools, an urgent step's victims)."""
    return [q for q in programs if q.status is Status.ACTING and q.demote_after_step is None]


def _held_class(p: Program) -> int:
    """A held request's class, the first field of its rank (`PricedPolicy._rank`): 0 on
    CPU, 1 returning, 2 new. The queue checks it alone, without the density."""
    if p.placement.tier is Tier.CPU:
        return 0
    return 1 if p.steps > 0 else 2


def _pool_kind(p: Program, replica: str, aged: bool) -> str:
    """Which victims a held request may move on `replica`: an aged one any ACTING program;
    else those whose move pays, priced by whether they keep their host copy, which depends
    on whether the request's KV is in that replica's host tier (`RELOAD`) or is written to
    host anew (`FRESH`; `PricedPolicy.victim_keeps_copy`)."""
    if aged:
        return AGED
    return RELOAD if p.placement == Placement(Tier.CPU, replica) else FRESH


class _Queue:
    """Held requests by promotion priority, so an event takes the first few in O(log n).

    A heap of (rank, seq, program, arrival); an entry is stale once its request left (or
    its program's class changed: it is pushed again with its new rank)."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple, int, Program, float]] = []
        self._seq = count()

    def push(self, p: Program, rank: Callable[[Program], tuple]) -> None:
        heapq.heappush(self._heap, (rank(p), next(self._seq), p, p.last_active_s))

    def rebuild(self, held: list[Program], rank: Callable[[Program], tuple]) -> None:
        self._heap = []
        for p in held:
            if p.placement.tier is not Tier.GPU:
                self.push(p, rank)

    def top(self, k: int, rank: Callable[[Program], tuple]) -> list[Program]:
        out: list[tuple[tuple, int, Program, float]] = []
        while self._heap and len(out) < k:
            entry = heapq.heappop(self._heap)
            p = entry[2]
            if not p.pending or p.last_active_s != entry[3] or p.placement.tier is Tier.GPU:
                continue
            if _held_class(p) != entry[0][0]:  # moved between classes: re-rank it
                self.push(p, rank)
                continue
            out.append(entry)
        for entry in out:
            heapq.heappush(self._heap, entry)
        return [entry[2] for entry in out]


class _Victims:
    """ACTING GPU programs whose move pays, per replica, farthest expected return first.

    Built per replica on first use after a tick; a program that goes ACTING on a GPU tier
    between ticks is inserted (`add`), so an event never re-ranks a whole tier. Entries go
    stale when their program leaves the GPU or starts its next step; `take` skips them.
    A pool per replica and kind of request (`_pool_kind`): whether a move pays depends on
    whether the victim keeps its host copy, which depends on what the request brings;
    aged requests (ticks only) may take any ACTING program.
    """

    def __init__(self, policy: PricedPolicy) -> None:
        self._policy = policy
        self._pools: dict[tuple[str, str], list[_Entry]] = {}
        self._tokens: dict[tuple[str, str], int] = {}  # per pool: its entries' tokens
        self._seq = count()

    def _entry(self, q: Program, now: float, kind: str, room: int) -> _Entry | None:
        """(-expected idle, seq, q, start of its tool call, its context), or None if moving
        q does not pay (a reload if it keeps its host copy, else a recompute; `room`: the
        host room of q's replica)."""
        policy = self._policy
        if kind == AGED:
            return self._new_entry(q, policy.expected_idle_s(q, now))
        idle = policy.idle_if_move_pays(q, self._cost_s(q, kind, room), now)
        return self._new_entry(q, idle)

    def _cost_s(self, q: Program, kind: str, room: int) -> float:
        """What moving q must win back to pay: `displace_margin` x its reload if it keeps
        its host copy, else its recompute (`room`: its replica's host room)."""
        policy = self._policy
        kept = policy.victim_keeps_copy(q, kind == FRESH, room)
        return policy.config.displace_margin * policy.move_cost_s(q, kept_on_host=kept)

    def _new_entry(self, q: Program, idle: float | None) -> _Entry | None:
        if idle is None:
            return None
        return (-idle, next(self._seq), q, q.interval_start, q.context_tokens)

    def _pool(self, replica: str, kind: str, now: float) -> list[_Entry]:
        key = (replica, kind)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = self.rank(replica, kind, now)
            self._tokens[key] = sum(entry[4] for entry in pool)
        return pool

    def rank(self, replica: str, kind: str, now: float) -> list[_Entry]:
        """Every ACTING program of GPU(replica) whose move pays, farthest return first
        (`_entry`, the pool's programs priced together)."""
        policy = self._policy
        members = in_tool_calls(policy.tiers.members(Placement(Tier.GPU, replica)))
        if kind == AGED:
            idle: list[float | None] = list(policy.expected_idle_many(members, now))
        else:
            room = policy.host_room(replica)
            costs = [self._cost_s(q, kind, room) for q in members]
            idle = policy.idles_if_moves_pay(members, costs, now)
        entries = (self._new_entry(q, i) for q, i in zip(members, idle, strict=True))
        return sorted(e for e in entries if e)

    def refresh(self, replica: str, now: float) -> None:
        """Re-rank one replica's pools (expected idle times grow as tool calls go on) when
        next used, so while nothing waits no step's end pays for ranking its program
        (`add` finds no pool)."""
        for kind in (AGED, RELOAD, FRESH):
            self._pools.pop((replica, kind), None)

    def add(self, q: Program, now: float) -> None:
        replica: str = q.placement.replica  # type: ignore[assignment]
        room = None
        for kind in (RELOAD, FRESH):
            pool = self._pools.get((replica, kind))
            if pool is None:
                continue
            room = self._policy.host_room(replica) if room is None else room
            entry = self._entry(q, now, kind, room)
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

    def take(self, replica: str, kind: str, needed: int, now: float) -> list[Program]:
        """Victims freeing `needed` tokens on `replica`, farthest return first, or [] (a
        partial move would be churn for nothing)."""
        if needed <= 0:
            return []
        gpu, chosen, freed = Placement(Tier.GPU, replica), [], 0
        pool = self._pool(replica, kind, now)
        stale = 0
        for _, _, q, since, _ in pool:
            valid = q.placement == gpu and q.status is Status.ACTING
            if not valid or q.interval_start != since or q.demote_after_step is not None:
                stale += 1 if not chosen else 0
                continue
            chosen.append(q)
            freed += self._policy.tiers.freed_by(q)
            if freed >= needed:
                self._tokens[(replica, kind)] -= sum(entry[4] for entry in pool[:stale])
                del pool[:stale]  # the stale head is gone for good
                return chosen
        return []
