"""The MORI policy engine: one fixed sequence per event, small stages where rungs differ.

Every MORI policy (`mori-paper`, `mori-priced`, `mori`, `mori+space`, `mori-priced+space`,
`mori+cachesage`, `mori+tokendance`) is this engine with the stages its rung of the ladder
names (`router.policy.ladder`). The engine owns the ledger (programs, tiers, held requests,
leases, hints, the growth band) and runs the same sequence on every event:

    record the fact -> (tool start: timed offload) -> demote the touched replica over
    budget -> promote: [critical agents] -> [urgent steps in flight] -> the paper's pass
    (order the held, place into free room less the reservation, idleness swaps at a
    tick) -> [priced displacement], again while a displacement freed more -> [the door's
    starts] -> [predictive promotions] -> [rounds] -> [hand-over room]

and on every tick: leases -> [partitions] -> [victim pools re-ranked] -> per replica demote
and CPU overflow -> promote with swaps and aging -> [protection expiry, predictions].

The stages in brackets are optional; each lives in a file named for what it decides:
`ordering` (the order held requests are offered room), `placement` (which replicas,
Best-Fit-Decreasing), `displacement` (who makes room: idleness swaps, priced moves),
`reservation` (room left free: the growth band's waiver), `forecast` (tool calls, their
residual life, what a move costs), `timed` (offload at tool start, predictive promotion),
`overload` (the wait bound and the door), `space` (Tokencake's critical agents),
`cachesage` (hand-over room, the runtime layer), `tokendance` (rounds as gangs).

The paper's rules (MORI 4.3.1), kept by every rung; the choices the paper leaves open are
explained in docs/policy.md:

* Demotion (tick, or a GPU tier over budget after a step): ACTING victims before
  REASONING ones, most idle first. A REASONING victim is only marked and moves after its
  step (`Program.demote_after_step`), but its tokens count as freed at once, so one
  overflow marks exactly the victims it needs. Victims go to CPU(r) if it fits, else
  WAITING. CPU overflow: the most idle CPU programs fall to WAITING.
* Promotion into free room, by class: (1) CPU programs with a request (they keep their
  replica), (2) returning WAITING programs with a request, (3) new programs; WAITING
  promotions are packed by size decreasing.
* Stickiness: nothing moves without a capacity violation, or a phase mismatch (at a tick,
  a class-1/2 request that does not fit may swap out ACTING GPU programs of its target
  replica more idle than it by at least `hysteresis`).
* Immediate admission: an arrival runs the same promotion pass (without swaps), so a
  request that fits never waits for a tick, and never jumps a higher class.
* Aging (ours; `aging_s`, 0 turns it off): a request held `aging_s` goes before every
  class, oldest first, and at a tick may swap out ACTING programs whatever their idleness.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import replace
from itertools import count
from typing import Any

from router.policy.base import Capabilities, Policy, PolicyConfig
from router.policy.displacement import IdlenessPool
from router.policy.ordering import Ordering
from router.policy.placement import Placing, affine_first
from router.policy.program import Program
from router.policy.runtime import AgentEvent
from router.policy.stages import Act, Free, Idleness, Targets, admitted, promotion_reason
from router.policy.timed import EPS, PROTECTED
from router.policy.types import WAITING, Move, MoveReason, Placement, Status, Tier, ToolStart

DEFAULT_STEP_S = 2.0  # step time assumed before any step was seen


def _memo_idleness(now: float) -> Idleness:
    """Idleness at `now`, computed once per program per pass (a pass ranks many times)."""
    cache: dict[str, float] = {}

    def idleness(p: Program) -> float:
        value = cache.get(p.program_id)
        if value is None:
            value = cache[p.program_id] = p.idleness(now)
        return value

    return idleness


class MoriEngine(Policy):
    """MORI's tiers with the stages of one rung of the ladder (module docstring)."""

    def __init__(self, rung: Any, config: PolicyConfig | None = None) -> None:
        """`rung`: a row of the ladder (`router.policy.ladder.Rung`), its stages."""
        super().__init__(config)
        self.name = rung.name  # type: ignore[misc]
        self.rung = rung
        # the growth band, kept incrementally (every event's pass asks): context after
        # each program's last step, that step's growth, and per replica the REASONING GPU
        # programs' number and growth summed
        self._context_after: dict[str, int] = {}
        self._growth: dict[str, int] = {}
        self._reserved: dict[str, tuple[str, int]] = {}  # program -> (replica, tokens)
        self._reserve: dict[str, int] = {}
        self._reasoning: dict[str, int] = {}
        self._smallest = SmallestHeld()
        # EWMA of observed reasoning (engine) time per step
        self.step_s = DEFAULT_STEP_S / self.config.time_scale
        self._next_rebalance_s = float("-inf")
        # the stages
        self.ordering: Ordering = rung.ordering(self)  # a `Ranking` where it is priced
        self.placement: Placing = rung.placement(self)
        self.forecast = rung.forecast(self) if rung.forecast else None  # before its users
        self.priced = rung.priced(self) if rung.priced else None
        self.waiver = rung.waiver(self) if rung.waiver else None
        self.timed = rung.timed(self) if rung.timed else None
        self.wait_bound = rung.wait_bound(self) if rung.wait_bound else None
        self.space = rung.space(self) if rung.space else None
        self.handover = rung.handover(self) if rung.handover else None
        self.gangs = rung.gangs(self) if rung.gangs else None
        self.capabilities = Capabilities(
            wakeups=self.timed is not None,
            observes=self.space is not None or self.handover is not None,
            acts=any((self.space, self.handover, self.gangs)),
            apps=self.space is not None,
        )

    @property
    def aging_s(self) -> float:
        """How long a held request waits before it goes first (0: never)."""
        configured = self.config.aging_s
        return self.rung.aging_s / self.config.time_scale if configured is None else configured

    @property
    def bounded(self) -> bool:
        """Whether steps in flight have a wait bound (and starts wait at the door)."""
        return self.wait_bound is not None and self.wait_bound.on

    # the growth band ------------------------------------------------------------------
    def promotion_reserve(self, replica: str) -> int:
        """Room promotions leave free on GPU(replica): the growth band
        (`router.policy.reservation`), plus room held for critical agent types."""
        band = self.growth_band(replica)
        return band + self.space.unused_reserve(replica) if self.space else band

    def growth_band(self, replica: str) -> int:
        """The last-step growth of GPU(replica)'s REASONING programs, summed."""
        return self._reserve.get(replica, 0)

    def reasoning_on(self, replica: str) -> int:
        """How many programs have a step running on `replica` (the batch a recompute
        there stalls)."""
        return self._reasoning.get(replica, 0)

    def _sync_reserve(self, p: Program) -> None:
        """Re-account `p` in its replica's REASONING count and reserve after any change
        to its status, placement or growth (idempotent)."""
        old = self._reserved.pop(p.program_id, None)
        if old is not None:
            self._reserve[old[0]] -= old[1]
            self._reasoning[old[0]] -= 1
        on_gpu = p.placement.tier is Tier.GPU and p.program_id in self.programs
        if on_gpu and p.status is Status.REASONING:
            replica: str = p.placement.replica  # type: ignore[assignment]
            growth = p.osl if p.osl is not None else self._growth.get(p.program_id, 0)
            self._reserved[p.program_id] = (replica, growth)
            self._reserve[replica] = self._reserve.get(replica, 0) + growth
            self._reasoning[replica] = self._reasoning.get(replica, 0) + 1

    def move(self, p: Program, dst: Placement, reason: MoveReason, now: float) -> Move:
        starts = dst.tier is Tier.GPU and p.pending  # `_start` re-accounts it, as below
        move = super().move(p, dst, reason, now)
        if not starts:
            self._sync_reserve(p)
        if p.pending:  # a held request changed where it can be promoted to
            self._smallest.push(p)
        return move

    def _start(self, p: Program, now: float) -> None:
        if self.forecast is not None:
            self.forecast.started(p, now)
        super()._start(p, now)
        self._sync_reserve(p)

    def fit_or_waiting(self, dst: Placement, p: Program) -> Placement:
        """A victim's CPU tier where it keeps a host copy (with a forecast: where the copy
        survives HiCache's write-through, `Forecast.keeps_host_copy`), else WAITING."""
        if self.forecast is None or dst.tier is not Tier.CPU:
            return super().fit_or_waiting(dst, p)
        keeps = self.forecast.keeps_host_copy(p, dst.replica)  # type: ignore[arg-type]
        return dst if keeps else WAITING

    def demote(self, p: Program, replica: str, now: float) -> Move:
        """`p` off GPU(replica): to its CPU tier where it keeps a host copy, else WAITING."""
        return self.move(
            p, self.fit_or_waiting(Placement(Tier.CPU, replica), p), MoveReason.DEMOTE, now
        )

    def ranking(self, now: float) -> Idleness:
        """The idleness that ranks victims and candidates in one pass (programs promoted
        ahead of a predicted tool end rank least idle: `TimeScheduler.protect`)."""
        idleness = _memo_idleness(now)
        return self.timed.protect(idleness) if self.timed else idleness

    def ranking_many(self, programs: list[Program], now: float) -> list[float]:
        """`ranking(now)` of each of `programs` at once: an idleness pool ranks every
        ACTING GPU program of a replica, and the memo and protection's wrappers, called
        per program, were a third of it. The same values: a program's idleness changes
        only with an event, never within a pass."""
        protected = self.timed.protected_until if self.timed else {}
        return [PROTECTED if q.program_id in protected else q.idleness(now) for q in programs]

    def held_programs(self) -> list[Program]:
        """The held requests the passes rank: not the starts at the door (the wait bound
        lets them in) nor the members of a round held together (the gangs place them)."""
        held = self.every_held()
        if self.wait_bound is not None and self.wait_bound.door:
            held = [p for p in held if p.program_id not in self.wait_bound.door]
        if self.gangs is not None:
            held = [p for p in held if p.program_id not in self.gangs.gang]
        return held

    def has_held(self) -> bool:
        return bool(self._held)

    # events ----------------------------------------------------------------------------
    def on_request(
        self, program_id: str, now: float, context_tokens: int | None = None
    ) -> list[Move]:
        p = self.programs.get(program_id)
        if self.timed is not None:
            self.timed.request_came(program_id, p)
        if self.forecast is not None:
            self.forecast.request_came(program_id, p, now)
        moves = super().on_request(program_id, now, context_tokens)
        return moves + self.handover.make_room(now) if self.handover else moves

    def _admit(self, p: Program, now: float) -> list[Move]:
        return self.gangs.admit(p, now) if self.gangs else self.admit_one(p, now)

    def admit_one(self, p: Program, now: float) -> list[Move]:
        """An arrival on its own: a start waits at the door (with a wait bound); anything
        else joins the held and runs the promotion pass (without swaps)."""
        if self.bounded:
            if p.steps == 0 and p.last_replica is None:
                return self.wait_bound.admit_start(p, now)  # type: ignore[union-attr]
            self.wait_bound.step_held(p)  # type: ignore[union-attr]
        if self.priced is not None:
            self.priced.held(p, now)
        if p.placement.tier is Tier.GPU:
            self.release(p, now)
            # its new prompt may share more with the tier than its last (Tiers.share): room
            # a held request can use at once (the fast path answers in O(replicas) if none)
            return self.promote(now)
        self._smallest.push(p)
        return admitted(self.promote(now), p)

    def refusal(self, program_id: str) -> float | None:
        return self.wait_bound.door.refused.get(program_id) if self.wait_bound else None

    def on_response(
        self, program_id: str, now: float, context_tokens: int | None = None
    ) -> list[Move]:
        if self.space is not None:
            self.space.graphs.observe_response(program_id)
        if self.gangs is not None:
            self.gangs.answered(program_id, now)
        return super().on_response(program_id, now, context_tokens)

    def _after_response(self, p: Program, now: float) -> list[Move]:
        """A step ended: its context may have grown past the budget, and the room it (or a
        lazy demotion) freed goes to the gate at once, then to due predictions."""
        if self.wait_bound is not None:
            self.wait_bound.step_ended(p, now)
        a = self.config.ewma_alpha
        self.step_s = a * p.reasoning_s + (1 - a) * self.step_s
        acting_on_gpu = p.placement.tier is Tier.GPU and p.status is Status.ACTING
        if self.priced is not None and acting_on_gpu:  # it may be moved for a held request
            self.priced.victims.add(p, now)
        before = self._context_after.get(p.program_id)
        self._context_after[p.program_id] = p.context_tokens
        if before is not None:
            self._growth[p.program_id] = max(0, p.context_tokens - before)
        self._sync_reserve(p)  # acting now: no longer reserving
        moves = self._demote(p.placement.replica, now) if p.placement.tier is Tier.GPU else []
        moves += self.promote(now)
        return moves + self._after_pass(now)

    def _after_pass(self, now: float) -> list[Move]:
        """What follows a step's end or a tick's rebalance: due predictions, ready rounds,
        room handed over."""
        moves = self.timed.predictive_promotions(now) if self.timed else []
        if self.gangs is not None:
            moves += self.gangs.schedule(now)
        return moves + self.handover.make_room(now) if self.handover else moves

    def _tool_started(self, program_id: str, now: float, call: ToolStart) -> list[Move]:
        """A tool call starts: it is forecast, and offloaded if that pays (`timed`)."""
        p = self.programs.get(program_id)
        if p is None or p.status is not Status.ACTING or self.forecast is None:
            return []
        self.forecast.tool_started(p, call)
        return self.timed.tool_started(p, now) if self.timed else []

    def on_tool_end(self, program_id: str, now: float) -> list[Move]:
        return self.timed.tool_ended(program_id, now) if self.timed else []

    def cancel(self, program_id: str, now: float) -> list[Move]:
        """A held request gave up; a held step in flight no longer keeps its replica closed
        to the door's starts: they are let in now, not at the next event."""
        p = self.programs.get(program_id)
        closing = self.wait_bound is not None and self.wait_bound.closes(p)
        if self.gangs is not None:
            self.gangs.gang.pop(program_id, None)
        if self.forecast is not None:
            self.forecast.gave_up(program_id)
        super().cancel(program_id, now)
        return self._let_in(now) if closing else []

    def end(self, program_id: str, now: float, reason: MoveReason = MoveReason.END) -> list[Move]:
        """An ended program's room goes to the gate at once, not at the next tick. The pass
        runs even when the end freed nothing: time has passed, and a held request may have
        waited long enough to leave its replica (ski rental) since the last one."""
        if self.handover is not None:
            self.handover.ended(program_id, now)
        if self.gangs is not None:
            self.gangs.forget(program_id)
        p = self.programs.get(program_id)
        if self.timed is not None:
            self.timed.forget(program_id)
        if self.wait_bound is not None:
            self.wait_bound.forget(p, program_id)
        if self.forecast is not None:
            self.forecast.forget(program_id)
        moves = super().end(program_id, now, reason)
        self._context_after.pop(program_id, None)
        self._growth.pop(program_id, None)
        if p is not None:
            self._sync_reserve(p)  # forgotten: its share goes
            moves += self.promote(now)
        if self.timed is not None and moves:
            moves += self.timed.predictive_promotions(now)
        if self.gangs is not None:
            moves += self.gangs.after_end(now)
        if self.space is not None:
            self.space.forget(program_id)
            moves += self.promote(now)  # the pool's share for it is free room now
        return moves

    def set_healthy(self, replica: str, healthy: bool, now: float) -> list[Move]:
        """A drained replica's held requests (and rounds) are re-placed at once."""
        moves = super().set_healthy(replica, healthy, now)
        if healthy:
            return moves
        moves += self.promote(now)
        return moves + self.gangs.schedule(now) if self.gangs else moves

    def tick(self, now: float) -> list[Move]:
        """Leases and a full rebalance every `tick_s`; with timed actions the shell also
        wakes the engine between (`next_wakeup`), and those wake-ups run only the timed
        checks (and an urgent step's pass)."""
        moves: list[Move] = []
        if self.timed is None or now + EPS >= self._next_rebalance_s:
            self._next_rebalance_s = now + self.config.tick_s
            if self.wait_bound is not None:
                self.wait_bound.load = None  # summed afresh at the next door pass
            moves += super().tick(now)
            if self.bounded:
                self.wait_bound.update_refusals(now)  # type: ignore[union-attr]
        elif self.bounded and self.wait_bound.urgent(now):  # type: ignore[union-attr]
            moves += self.promote(now)
        if self.timed is not None:
            moves += self.timed.expire_protection(now)
        return moves + self._after_pass(now)

    def next_wakeup(self, now: float) -> float | None:
        """The earliest time after `now` a timed check has work (None: none). Due
        promotions that found no room are retried when room frees and at later ticks,
        never in a busy loop."""
        times = self.timed.wakeups(now) if self.timed else []
        if self.bounded:
            times.append(self.wait_bound.wakeup())  # type: ignore[union-attr]
        future = [t for t in times if t is not None and t > now + EPS]
        if self.gangs is not None:
            future += self.gangs.deadlines(now)
        return min(future) if future else None

    # the shells' optional calls ----------------------------------------------------------
    def observe(self, event: AgentEvent) -> None:
        if self.space is not None:
            self.space.observe(event)
        if self.handover is not None:
            self.handover.runtime.observe(event)

    def runtime_actions(self, now: float) -> list[Any]:
        actions: list[Any] = []
        for stage in (self.space, self.handover, self.gangs):
            if stage is not None:
                actions += stage.runtime_actions(now)
        return actions

    def register_app(self, app: str, edges: object) -> dict[str, Any]:
        if self.space is None:
            return super().register_app(app, edges)
        return self.space.register_app(app, edges)

    def describe(self, program_id: str, now: float) -> dict[str, Any] | None:
        """Adds what the stages know of the program: its expected idle time and tool
        forecast, its place at the door, its app, agent or round."""
        view = super().describe(program_id, now)
        if view is None:
            return None
        p = self.programs[program_id]
        if self.forecast is not None and p.status is Status.ACTING and p.steps > 0:
            view["expected_idle_s"] = round(self.forecast.expected_idle_s(p, now), 3)
        if self.timed is not None:
            view |= self.timed.describe(program_id, now)
            door = self.wait_bound.door if self.wait_bound else None
            view["start_queue_position"] = door.position(program_id) if door else None
        for stage in (self.space, self.handover, self.gangs):
            if stage is not None:
                stage.describe(p, view, now)
        return view

    # rebalance and demotion ------------------------------------------------------------
    def _rebalance(self, now: float) -> list[Move]:
        if self.space is not None:
            self.space.update_partitions(now)
        if self.priced is not None:
            self.priced.refresh(now)
        moves: list[Move] = []
        for r in self.tiers.replicas():
            moves += self._demote(r, now)
            moves += self._cpu_overflow(r, now)
        moves += self.promote(now, displace=True)
        moves += self.gangs.schedule(now) if self.gangs else []
        if self.priced is not None:
            self.priced.tick_end(now)
        return moves

    def _demote(self, replica: str | None, now: float) -> list[Move]:
        """Bring GPU(replica) back within budget, counting lazily demoted tokens as freed
        (round members held on it go last: `Gangs.demote_held`).

        Marks are recomputed from scratch each time: a mark that is no longer needed
        (room came back before the step ended) is dropped, which is the sticky choice.
        """
        if replica is None:
            return []
        gpu = Placement(Tier.GPU, replica)
        excess = self.tiers.used(gpu) - self.tiers.budget(gpu)
        self._clear_marks(replica)
        moves: list[Move] = []
        if excess > 0:
            members = list(self.tiers.members(gpu))
            acting = [p for p in members if p.status is Status.ACTING]
            moves, excess = self.shed(acting, excess, now, lambda p: self.demote(p, replica, now))
            cpu = Placement(Tier.CPU, replica)
            reasoning = [p for p in members if p.status is Status.REASONING]
            self.shed(reasoning, excess, now, lambda p: self._mark_lazy(p, cpu))
        return moves + self.gangs.demote_held(replica, now) if self.gangs else moves

    def _cpu_overflow(self, replica: str, now: float) -> list[Move]:
        """CPU(replica) over budget (capacity shrank): most idle programs go to WAITING."""
        cpu = Placement(Tier.CPU, replica)
        excess = self.tiers.used(cpu) - self.tiers.budget(cpu)
        if excess <= 0:
            return []
        return self.shed(
            self.tiers.members(cpu),
            excess,
            now,
            lambda p: self.move(p, WAITING, MoveReason.CPU_OVERFLOW, now),
        )[0]

    def shed(
        self, programs: Iterable[Program], excess: int, now: float, act: Act
    ) -> tuple[list[Move], int]:
        """`act` on the most idle of `programs` first (`ranking` at `now`: demote, mark)
        until their leaving covers `excess` tokens, each counted after the one before has
        acted (the last holder of a shared segment frees it); returns the moves made and
        what is left of `excess`. Nothing to cover ranks nothing (a step's end sheds its
        replica's programs in tool calls first, then ranked the reasoning ones for none)."""
        moves: list[Move] = []
        if excess <= 0:
            return moves, excess
        programs = list(programs)
        idleness = self.ranking_many(programs, now)
        for i in sorted(range(len(programs)), key=idleness.__getitem__, reverse=True):
            if excess <= 0:
                break
            p = programs[i]
            excess -= self.tiers.freed_by(p)
            move = act(p)
            if move is not None:
                moves.append(move)
        return moves, excess

    # promotion ------------------------------------------------------------------------
    def promote(self, now: float, displace: bool = False) -> list[Move]:
        """Promote held requests (`displace`: at a tick, with swaps); the space scheduler's
        critical agents go first where the rung has it."""
        if self.space is not None:
            return self.space.promote(now, displace)
        return self.promote_held(now, displace)

    def promote_held(self, now: float, displace: bool = False) -> list[Move]:
        """Urgent steps in flight first (with a wait bound), then the passes, then the
        door's starts."""
        if not self.bounded:
            return self._passes(now, displace)
        moves = self.wait_bound.serve_urgent(now)  # type: ignore[union-attr]
        moves += self._passes(now, displace)
        return moves + self._let_in(now)

    def _let_in(self, now: float) -> list[Move]:
        """The door's starts; where one took the place of programs in tool calls, what the
        swap freed beyond its need goes to the held requests at once (a step in flight
        whose replica is gone may wait for any replica, so none is closed to the door)."""
        starts = self.wait_bound.let_in(now)  # type: ignore[union-attr]
        if self._held and any(not m.to_gpu for m in starts):
            starts += self.promote(now)
        return starts

    def _passes(self, now: float, displace: bool) -> list[Move]:
        """The paper's pass (into free room; at a tick also its idleness swaps), then the
        priced displacement for what is left; room a displacement frees beyond its request
        goes to the gate at once. A paper pass that moved nothing leaves its room map as a
        fresh one would be, and the priced pass takes it (`free_room` prices idle programs
        per replica and is an event's dearest set-up while a request is held)."""
        moves: list[Move] = []
        paper_displace = displace
        while self._held and self.tiers.replicas():
            free = self.free_room(now)
            paper = self._promote_into(free, now, paper_displace)
            priced = (
                self.priced.displace(now, displace, None if paper else free) if self.priced else []
            )
            moves += paper + priced
            if not priced:
                break
            paper_displace = False
        return moves

    def free_room(self, now: float) -> Free:
        """GPU room per replica a promotion pass may fill: free room less what the pass
        leaves free there: all of it on a replica kept for an urgent step in flight, else
        the reserve (`promotion_reserve`, inlined: every pass of every event asks, for
        every replica) less the part of the growth band the band waiver lets go."""
        free = self.tiers.gpu_free()
        kept = self.wait_bound.held_for if self.wait_bound is not None else ()
        bands, space, waiver = self._reserve, self.space, self.waiver
        for r in free:
            if r in kept:
                free[r] -= self.tiers.budget(self.tiers.gpu_place[r]) + 1
                continue
            band = bands.get(r, 0)
            leave = band + space.unused_reserve(r) if space else band
            if waiver is not None and band > 0:
                leave -= waiver.waived(r, band, now)
            free[r] -= leave
        return free

    def _promote_into(self, free: Free, now: float, displace: bool) -> list[Move]:
        """Promote held requests into `free`, class by class (MORI 4.3.1), updating it as
        it places. `displace` (tick only) lets a class-1/2 request that does not fit swap
        out clearly more idle ACTING programs; arrivals and responses never move anyone."""
        if not displace and not self._smallest.any_fits(free, self.placement.reach(free)):
            return []  # fast path (every event): no held request fits anywhere
        held = self.held_programs()
        if displace:
            self._smallest.rebuild(held)  # drop the entries of requests that left
        else:  # only candidates that fit are ranked
            widest = max(free.values())
            held = [p for p in held if self._may_fit(p, free, widest, now)]
            if not held:
                return []
        idleness = self.ranking(now)
        victims = IdlenessPool(self, idleness, now)
        moves: list[Move] = []
        held, swaps = self._promote_aged(held, free, victims, now, displace, moves)
        on_cpu, returning, new = [], [], []
        for p in held:
            if p.placement.tier is Tier.CPU and not self.placement.may_leave_home(p, now):
                if p.placement.replica in free:
                    on_cpu.append(p)
            elif p.steps > 0:
                returning.append(p)
            else:
                new.append(p)
        if len(on_cpu) + len(returning) + len(new) > 1:  # one request (most events): in order
            self.ordering.order_classes((on_cpu, returning, new), idleness, now)
            for group in (on_cpu, returning, new):  # the client's priority first (agent
                group.sort(key=_by_priority)  # hints); stable: the policy's order among equals
        for p in on_cpu:
            if not self._place_cpu(p, free, now, moves) and displace:
                r: str = p.placement.replica  # type: ignore[assignment]
                swap = self._swap(p, r, free, victims, MoveReason.PROMOTE_CPU, now)
                swaps += bool(swap)
                moves += swap
        unplaced = self.placement.pack(returning + new, free, now, moves)
        if displace:
            packed = len(moves)
            self._swap_returning([p for p in unplaced if p.steps > 0], free, victims, now, moves)
            swaps += len(moves) > packed
        if swaps:  # a swap may free more than it took, also where earlier requests wait
            moves += self.promote(now)
        return moves

    def _promote_aged(
        self,
        held: list[Program],
        free: Free,
        victims: IdlenessPool,
        now: float,
        displace: bool,
        moves: list[Move],
    ) -> tuple[list[Program], int]:
        """Aging: requests held `aging_s` or longer go first, oldest first (`held` is in
        arrival order); at a tick one that does not fit swaps out ACTING programs with no
        hysteresis bar. Returns the requests still to rank by class, and the swap count.

        Without it, a large returning program can wait many minutes: every room that
        opens goes to a smaller or less idle request (TTFT p99 600-2300 s in the sim).
        """
        if self.aging_s <= 0:
            return held, 0
        cutoff = now - self.aging_s
        aged = [p for p in held if p.last_active_s <= cutoff]
        if not aged:
            return held, 0
        swaps = 0
        for p in aged:
            on_cpu = p.placement.tier is Tier.CPU
            if on_cpu and p.placement.replica not in free:
                continue
            placed = (
                self._place_cpu(p, free, now, moves)
                if on_cpu
                else self._place_waiting(p, free, now, moves, self.placement.replicas_for)
            )
            if not placed and displace:
                tries = [p.placement.replica] if on_cpu else affine_first(p, free)
                for r in tries:
                    swap = self._swap(p, r, free, victims, None, now, aged=True)  # type: ignore[arg-type]
                    if swap:
                        swaps += 1
                        moves += swap
                        break
        return [p for p in held if p.pending], swaps

    def best_fit(
        self, ranked: list[Program], free: Free, now: float, moves: list[Move], targets: Targets
    ) -> list[Program]:
        """Best-Fit-Decreasing of WAITING requests onto `targets`; returns those left
        unplaced (ranked).

        Selection follows priority (`ranked`): a prefix-like pick of what fits in the total
        free room. The picked set is then placed largest first; a backfill pass in priority
        order places whatever fragmentation left out, so after a pass no held request
        that fits anywhere is left behind.
        """
        total = sum(f for f in free.values() if f > 0)
        picked = []
        for p in ranked:
            if p.context_tokens <= total:
                total -= p.context_tokens
                picked.append(p)
        placed: set[str] = set()
        for p in sorted(picked, key=lambda p: p.context_tokens, reverse=True):
            if self._place_waiting(p, free, now, moves, targets):
                placed.add(p.program_id)
        # room only shrinks as the pass places: a request whose least need is wider than
        # the widest room left fits nowhere, and is left untried
        widest = max(free.values(), default=-1)
        least_need = self.tiers.least_need
        left = []
        for p in ranked:
            if p.program_id in placed:
                continue
            if least_need(p) > widest or not self._place_waiting(p, free, now, moves, targets):
                left.append(p)
        return left

    def _place_cpu(self, p: Program, free: Free, now: float, moves: list[Move]) -> bool:
        """Back onto its own replica's GPU tier if it fits there (the KV is in its host tier)."""
        r: str = p.placement.replica  # type: ignore[assignment]
        need = self.tiers.need(p, Placement(Tier.GPU, r))  # shared segments held there: once
        if need > free[r]:
            return False
        free[r] -= need
        moves.append(self.move(p, Placement(Tier.GPU, r), MoveReason.PROMOTE_CPU, now))
        return True

    def _place_waiting(
        self, p: Program, free: Free, now: float, moves: list[Move], targets: Targets
    ) -> bool:
        """The first of its target replicas it fits on; what it needs there counts the
        shared segments the replica holds already once (Tiers.need)."""
        gpu_place = self.tiers.gpu_place
        for r in targets(p, free, now):
            need = self.tiers.need(p, gpu_place[r])
            if need <= free[r]:
                free[r] -= need
                reason = MoveReason.PROMOTE_WAITING if p.steps > 0 else MoveReason.PROMOTE_NEW
                moves.append(self.move(p, gpu_place[r], reason, now))
                return True
        return False

    def _swap_returning(
        self,
        ranked: list[Program],
        free: Free,
        victims: IdlenessPool,
        now: float,
        moves: list[Move],
    ) -> None:
        """Class-2 swaps, least idle first, on the placement's swap replicas.

        Thresholds only rise along `ranked`, so the first request that clears no
        replica's most idle victim ends the search for all that follow.
        """
        order = sorted(free, key=free.__getitem__, reverse=True)
        for p in ranked:
            if not victims.may_swap(p, order):
                return
            for r in self.placement.swap_replicas(p, free, now):
                swap = self._swap(p, r, free, victims, MoveReason.PROMOTE_WAITING, now)
                if swap:
                    moves += swap
                    order.sort(key=free.__getitem__, reverse=True)
                    break

    def _may_fit(self, p: Program, free: Free, widest: int, now: float) -> bool:
        """Whether a held request fits room a promotion pass may give it: a WAITING one the
        widest; a CPU-tier one its own replica's, or, once it may leave home, the widest
        (cheap tests first: whether it may leave prices a recompute per replica)."""
        if p.placement.tier is not Tier.CPU:
            return p.context_tokens <= widest
        if p.context_tokens <= free.get(p.placement.replica, -1):  # type: ignore[arg-type]
            return True
        return p.context_tokens <= widest and self.placement.may_leave_home(p, now)

    def _swap(
        self,
        p: Program,
        replica: str,
        free: Free,
        victims: IdlenessPool,
        reason: MoveReason | None,
        now: float,
        aged: bool = False,
    ) -> list[Move]:
        """Phase mismatch: swap `p` in for clearly more idle ACTING programs, or do nothing
        (an aged request swaps out the most idle ACTING ones, with no hysteresis bar)."""
        chosen = victims.take(replica, p, p.context_tokens - free[replica], aged)
        if not chosen:
            return []
        moves = self.swap_in(p, replica, chosen, free, now)
        if reason is not None:  # the pass's class, not where `p` comes from
            moves[-1] = replace(moves[-1], reason=reason)
        return moves

    def swap_in(
        self, p: Program, replica: str, victims: list[Program], free: Free, now: float
    ) -> list[Move]:
        """`p` onto GPU(replica) and `victims` off it (their CPU tier where they keep a
        host copy, else WAITING), in one swap, the move of `p` last; `free[replica]`
        shrinks by what the tier grew (shared segments count once)."""
        gpu = Placement(Tier.GPU, replica)
        before = self.tiers.used(gpu)  # the change, not a sum: shared segments count once
        moves = [self.move(p, gpu, promotion_reason(p), now)]
        for v in victims:  # after p left CPU(replica), so its room is usable by victims
            moves.insert(-1, self.demote(v, replica, now))
        free[replica] -= self.tiers.used(gpu) - before
        return moves


def _by_priority(p: Program) -> int:
    """Sort key: the request's agent-hint priority, highest first."""
    return -p.priority


class SmallestHeld:
    """The smallest held request per place a promotion may take it from (WAITING: onto any
    replica; CPU(r): onto r, or onto any where it may leave home), so an event tells in
    O(replicas) whether any held request may fit, instead of scanning every held request
    (10 000 programs: ~1 500 held).

    Heaps of (tokens, seq, program); an entry is dropped when found stale at the top (the
    request left, or its program moved or grew), and `rebuild` (at ticks) compacts them.
    """

    def __init__(self) -> None:
        self._heaps: dict[str | None, list[tuple[int, int, Program]]] = {}
        self._seq = count()

    @staticmethod
    def _key(p: Program) -> str | None:
        return p.placement.replica if p.placement.tier is Tier.CPU else None

    def push(self, p: Program) -> None:
        if p.placement.tier is not Tier.GPU:
            heapq.heappush(
                self._heaps.setdefault(self._key(p), []), (p.context_tokens, next(self._seq), p)
            )

    def rebuild(self, held: list[Program]) -> None:
        """The heaps of `held`, heapified at once (entries numbered as pushes would: the
        same tops)."""
        heaps: dict[str | None, list[tuple[int, int, Program]]] = {}
        seq = self._seq
        for p in held:
            if p.placement.tier is not Tier.GPU:
                heaps.setdefault(self._key(p), []).append((p.context_tokens, next(seq), p))
        for heap in heaps.values():
            heapq.heapify(heap)
        self._heaps = heaps

    def smallest(self, key: str | None) -> int | None:
        heap = self._heaps.get(key)
        while heap:
            tokens, _, p = heap[0]
            fresh = p.pending and tokens == p.context_tokens and self._key(p) == key
            if fresh and p.placement.tier is not Tier.GPU:
                return tokens
            heapq.heappop(heap)
        return None

    def any_fits(self, free: Free, reach: Free) -> bool:
        """Whether some held request may fit: WAITING ones in the widest room, CPU(r) ones
        in `reach[r]` (the most room the placement may offer them: r's own, or the widest
        where they may leave home after a wait, which the full pass checks)."""
        waiting = self.smallest(None)
        if waiting is not None and waiting <= max(free.values()):
            return True
        return any((c := self.smallest(r)) is not None and c <= reach[r] for r in free)
