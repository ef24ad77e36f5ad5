"""`mori`, the default policy: MORI's tiers, made work-conserving, with Tokencake's time scheduler.

Three layers, each registered for the ablation in every report:

* `mori-paper` (router.policy.mori_paper): MORI 4.3.1 as the paper states it;
* `mori-priced` (router.policy.priced): held requests of every class may move ACTING
  programs off the GPU when the move pays (expected remaining tool time against the
  measured reload/recompute price and recent return waits), aging on;
* `mori` (here): plus two moves driven by a forecast of each tool call's duration
  (`router.policy.predictor`), Tokencake section 4, measured to pay on the real Claude
  Code sample (+16 to +37 % output tok/s at 50-80 programs, token scale 0.5) and to cost
  nothing measurable elsewhere (docs/policy.md):

* **Offload at tool start** (Tokencake Algorithm 1): when a GPU program starts a tool
  call, its KV is moved to its replica's CPU tier (`OFFLOAD_TOOL`, hint idle) only if
  the benefit beats the transfer cost:

      benefit = (T_fc - T_transfer) * value,   T_transfer = 2 * load_s_per_token * context

  where `value` in [0, 1] is the share of the freed tokens that requests waiting at the
  gate (whose step fits in the window) would fill right now, and the window must be at
  least `tick_s`. No waiting demand, no offload: an idle GPU copy costs nothing when
  nobody wants the room.

* **Predictive promotion**: shortly before a CPU program's predicted tool end (lead =
  load-back time + `predict_lead_s`) it is moved back to its GPU tier
  (`PROMOTE_PREDICTED`, hint busy, so the engine loads it back before the request comes),
  but only into free room nobody at the gate could use, never by displacing anyone. A
  request that comes earlier is promoted the normal MORI way. A prediction that was too
  short holds GPU room while the program still acts: that is bounded, since at
  predicted end + `predict_grace_s` the program loses its protection and, if the gate
  wants the room, goes back to CPU.

The forecast needs finer timing than MORI's tick: `next_wakeup(now)` says when the
shell should call `tick` next; between full periods `tick` only runs the predictive
checks, so MORI's own rebalance keeps its `tick_s` cadence.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from router.policy.base import PolicyConfig
from router.policy.door import Door
from router.policy.mori_paper import Idleness
from router.policy.priced import FRESH, PricedPolicy, ToolCall, in_tool_calls
from router.policy.program import Program
from router.policy.types import Move, MoveReason, Placement, Status, Tier

_EPS = 1e-9
DEFAULT_STEP_S = 2.0  # step time assumed before any step was seen
URGENT_SHARE = 0.5  # a held step in flight goes first after this share of max_step_wait_s
# a program's life-mean context per token of its first prompt, before ...: the real Claude
# Code sample's median is 3.1 (generated corpora 3.5-3.7); 4 kept too few programs running
# in runs shorter than a life (bench/results/2026-11-28-overload.md "The growth prior")
GROWTH_PRIOR = 3.0
LIFE_SAMPLES = 5  # ... this many programs ended and their own mean is known
LIFE_ALPHA = 0.05  # weight of the newest ended program in the mean context of a life


class MoriPolicy(PricedPolicy):
    """Work-conserving MORI plus tool-duration prediction: benefit-gated offload at tool
    start and predictive promotion (the default policy)."""

    name = "mori"

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self.protected_until: dict[str, float] = {}  # predicted-promoted: safe from demotion
        self._next_rebalance_s = float("-inf")
        self.step_s = DEFAULT_STEP_S  # EWMA of observed reasoning (engine) time per step
        # What the predictions did, for reports: offloads, predicted promotions, and how
        # offloaded programs came back (already on GPU, or before their promotion).
        self.outcomes: Counter[str] = Counter()
        self.door = Door()  # starts waiting to be let in (router.policy.door)
        # held requests of programs in flight (served once), oldest arrival first
        self._inflight_held: OrderedDict[str, Program] = OrderedDict()
        self._held_for: dict[str, str] = {}  # replica -> the urgent program it keeps room for
        self._first_context: dict[str, int] = {}  # program -> its first prompt (tokens)
        self._context_sum: dict[str, int] = {}  # program -> its contexts after each step
        self._life_context = 0.0  # mean context over a program's steps, programs that ended
        self._lives = 0  # programs that ended after a step
        self._load: dict[str, float] | None = None  # replica -> busy tokens (`_loads`)
        self._load_of: dict[str, tuple[str, float]] = {}  # program -> what it adds there

    # overload: the wait bound and the door ------------------------------------------
    @property
    def bounded(self) -> bool:
        """Whether steps in flight have a wait bound (and starts wait at the door)."""
        return self.config.max_step_wait_s > 0

    def refusal(self, program_id: str) -> float | None:
        return self.door.refused.get(program_id)

    def _admit(self, p: Program, now: float) -> list[Move]:
        """A start waits at the door; a step in flight joins the held in arrival order."""
        if not self.bounded:
            return super()._admit(p, now)
        if p.steps == 0 and p.last_replica is None:
            self._first_context.setdefault(p.program_id, p.context_tokens)
            self.door.enter(p)
            moves = self._promote(now)
            self.door.update_refusals(now, self.config.gate_timeout_s, self.config.start_hold_s)
            return [
                replace(m, reason=MoveReason.ADMIT) if m.program_id == p.program_id else m
                for m in moves
            ]
        self._inflight_held.pop(p.program_id, None)
        self._inflight_held[p.program_id] = p
        return super()._admit(p, now)

    def _held_programs(self) -> list[Program]:
        """MORI's passes see the steps in flight; starts are the door's (`_let_in`)."""
        held = super()._held_programs()
        return [p for p in held if p.program_id not in self.door] if self.door else held

    def _waiting_in_flight(self) -> Iterator[Program]:
        """Held requests of programs in flight, oldest first (the index is cleaned as it is
        read: released, cancelled and ended entries drop out at the front)."""
        index = self._inflight_held
        while index:
            p = next(iter(index.values()))
            if p.pending and p.program_id in self.programs:
                break
            index.popitem(last=False)
        return (p for p in index.values() if p.pending)

    def _urgent(self, now: float) -> list[Program]:
        """Held steps in flight that have waited `URGENT_SHARE` of the bound, oldest first."""
        due = now - URGENT_SHARE * self.config.max_step_wait_s
        out = []
        for p in self._waiting_in_flight():
            if p.last_active_s > due:
                break
            out.append(p)
        return out

    def _promote(self, now: float, displace: bool = False) -> list[Move]:
        """Urgent steps in flight first, then MORI's passes, then the door."""
        if not self.bounded:
            return super()._promote(now, displace)
        moves = self._serve_urgent(now)
        moves += super()._promote(now, displace)
        return moves + self._let_in(now)

    def _serve_urgent(self, now: float) -> list[Move]:
        """Each urgent step goes onto its own replica now: into free room (the growth
        band does not hold against it), else in place of programs in tool calls, farthest
        expected return first, whatever their idleness (priced as any move: they keep
        their host copy where it survives). Where programs in tool calls do not hold
        enough, the replica's room is kept for it (`leave_free`) until running steps end:
        nothing else is placed there meanwhile, so its wait is bounded by a step."""
        self._held_for.clear()
        moves: list[Move] = []
        healthy = set(self.tiers.replicas())
        ranked: dict[str, list[Program]] = {}  # per replica, sorted once a pass
        for p in self._urgent(now):
            home = p.last_replica
            if home not in healthy or home in self._held_for:
                continue
            gpu = Placement(Tier.GPU, home)
            missing = self.tiers.need(p, gpu) - self.tiers.free(gpu)
            victims = self._urgent_victims(home, missing, now, ranked) if missing > 0 else []
            if missing > 0 and not victims:
                self._held_for[home] = p.program_id  # type: ignore[index]
                continue
            self.outcomes["urgent_placed"] += 1
            moves += self._swap_in(p, home, victims, {home: 0}, now)  # type: ignore[arg-type]
        return moves

    def _urgent_victims(
        self, replica: str, needed: int, now: float, ranked: dict[str, list[Program]]
    ) -> list[Program]:
        """Programs in tool calls on GPU(replica) whose leaving frees `needed`, farthest
        expected return first (predicted-promoted ones last), or [] if they cannot.

        Sorted once per pass and replica (`ranked`; a tick serves ~20 urgent steps, and
        pricing a replica's ~300 programs in tool calls was half its time): within a pass
        nothing predicts, protects or ends a call, so a later urgent step of the replica
        finds the same order among the programs its swaps left there."""
        gpu = Placement(Tier.GPU, replica)
        if replica not in ranked:
            acting = in_tool_calls(self.tiers.members(gpu))
            idle = self.expected_idle_many(acting, now)
            order = sorted(
                range(len(acting)),
                key=lambda i: (acting[i].program_id in self.protected_until, -idle[i]),
            )
            ranked[replica] = [acting[i] for i in order]
        left = [q for q in in_tool_calls(ranked[replica]) if q.placement == gpu]
        return self.tiers.enough(left, needed)

    def _let_in(self, now: float) -> list[Move]:
        """Starts at the door, in the order they first asked (a client's `priority` first),
        onto replicas where no step in
        flight waits and the programs in flight leave load to spare (`_load`): into free
        room, where each program would have the most (as any new program), else in place
        of programs in tool calls whose move pays."""
        starts = sorted(self.door.held(), key=lambda p: -p.priority)  # stable: door order
        if not starts:
            return []
        closed = {p.last_replica for p in self._waiting_in_flight()}
        replicas = self.tiers.replicas()
        loads = self._loads(now)
        if loads.keys() != set(replicas):  # a replica came or went since the sum
            self._load = None
            loads = self._loads(now)
        spare = {
            r: self.config.door_load * self._room(r) - loads[r] for r in replicas if r not in closed
        }
        free = {
            r: self.tiers.free(Placement(Tier.GPU, r)) - self.leave_free(r, now)
            for r in spare
            if spare[r] > 0
        }
        moves: list[Move] = []
        for p in starts:
            if not free:
                break
            placed = self._place_start(p, free, now)
            if placed:
                r: str = placed[-1].dst.replica  # type: ignore[assignment]
                spare[r] -= self._count_load(p, r, now)
                if spare[r] <= 0:
                    del free[r]
                moves += placed
        return moves

    def _loads(self, now: float) -> dict[str, float]:
        """The GPU room the programs in flight keep busy on each replica, on average, in
        tokens: each one's KV over its life (`_footprint`) times the share of its time it
        spends reasoning (1 - idleness; a program without history counts whole). While it
        stays below the room there is, returning steps find room; past it they queue, and
        the queue is what the wait bound has to break by swapping. Summed over every
        program at a full tick (O(programs)); between ticks a program's share is counted
        again at its step's end, a start let in adds its own and an ended program takes
        its own away, so an event costs O(1)."""
        if self._load is None:
            self._load = dict.fromkeys(self.tiers.replicas(), 0.0)
            self._load_of = {}
            for p in self.programs.values():
                if p.last_replica in self._load:  # None at the door
                    self._count_load(p, p.last_replica, now)  # type: ignore[arg-type]
        return self._load

    def _count_load(self, p: Program, replica: str, now: float) -> float:
        """Count `p`'s busy share on `replica` in place of what it added before (at a step's
        end its idleness is its cycles' without the call just begun: its usual share)."""
        self._uncount_load(p.program_id)
        share = self._footprint(p) * (1.0 - p.idleness(now))
        self._load_of[p.program_id] = (replica, share)
        if self._load is not None and replica in self._load:
            self._load[replica] += share
        return share

    def _uncount_load(self, program_id: str) -> None:
        counted = self._load_of.pop(program_id, None)
        if counted is not None and self._load is not None and counted[0] in self._load:
            self._load[counted[0]] -= counted[1]

    def _room(self, replica: str) -> int:
        return max(1, self.tiers.budget(Placement(Tier.GPU, replica)))

    def _footprint(self, p: Program) -> float:
        """The KV `p` holds over its life: an agent's context grows every step (3-4x its
        first prompt over a coding task), so a program counts at least what programs that
        ended held on average (`GROWTH_PRIOR` x its prompt until `LIFE_SAMPLES` ended)."""
        if self._lives >= LIFE_SAMPLES:
            return max(p.context_tokens, self._life_context)
        first = self._first_context.get(p.program_id, p.context_tokens)
        return max(p.context_tokens, GROWTH_PRIOR * first)

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

    def _place_start(self, p: Program, free: dict[str, int], now: float) -> list[Move]:
        order = self._spread_order(free)
        for r in order:
            gpu = Placement(Tier.GPU, r)
            need = self.tiers.need(p, gpu)
            if need <= free[r]:
                free[r] -= need
                return [self._move(p, gpu, MoveReason.PROMOTE_NEW, now)]
        for r in order:  # its whole context: a segment it would share may leave with a victim
            missing = p.context_tokens - free[r]
            victims = self._victims.take(r, FRESH, missing, now)
            if victims:
                return self._swap_in(p, r, victims, free, now)
        return []

    # cost model --------------------------------------------------------------------
    def load_s(self, p: Program) -> float:
        """One-way GPU<->host copy time of the program's KV."""
        return self.config.load_s_per_token * p.context_tokens

    def promote_at(self, p: Program) -> float | None:
        """When a CPU program of an ongoing call should start loading back."""
        call = self.calls.get(p.program_id)
        if call is None or call.promote_tried or call.ended_s is not None:
            return None
        return call.predicted_end_s - self.load_s(p) - self.config.predict_lead_s

    def offload_benefit(self, p: Program, predicted_s: float) -> tuple[float, float]:
        """(benefit, cost) in seconds of Algorithm 1 for offloading `p` now.

        As in Tokencake, waiting work only counts if its step can finish inside the
        window (`expected_step_s`): freeing room for a step that outlasts the tool call
        just swaps two programs back and forth. And the window must last a tick: MORI's
        tiers are sticky, so the room comes back to `p` only through a rebalance; for
        shorter calls the measured effect was churn (docs/prediction.md)."""
        cost = 2.0 * self.load_s(p)
        window = predicted_s - cost
        if window < self.config.tick_s or p.context_tokens <= 0:
            return 0.0, cost
        replica = p.placement.replica
        free = max(0, self.tiers.free(Placement(Tier.GPU, replica)))
        room = free + p.context_tokens
        filled = 0
        demand = (q for q in self._gated_demand(replica) if self.expected_step_s(q) <= window)
        for tokens in sorted(q.context_tokens for q in demand):
            if filled + tokens > room:
                break
            filled += tokens
        value = min(1.0, max(0, filled - free) / p.context_tokens)
        return window * value, cost

    def expected_step_s(self, q: Program) -> float:
        """How long q's next step should take: its recent mean, else the fleet's EWMA."""
        if q.cycles:
            return sum(r for r, _ in q.cycles) / len(q.cycles)
        return self.step_s

    def _gated_demand(self, replica: str | None) -> list[Program]:
        """Programs whose request waits at the gate and could run on `replica` (steps in
        flight, and starts at the door)."""
        cpu = Placement(Tier.CPU, replica)
        return [
            q for q in self._every_held() if q.placement == cpu or q.placement.tier is Tier.WAITING
        ]

    def _ranking(self, now: float) -> Idleness:
        """Protected (predicted-promoted, not yet overdue) programs rank least idle: they
        are demoted last and never displaced by a swap, until their protection expires."""
        base = super()._ranking(now)

        def idleness(p: Program) -> float:
            return -1.0 if p.program_id in self.protected_until else base(p)

        return idleness

    # events --------------------------------------------------------------------------
    def on_tool_start(
        self,
        program_id: str,
        now: float,
        tool: str,
        agent: str | None = None,
        predict_s: float | None = None,
    ) -> list[Move]:
        super().on_tool_start(program_id, now, tool, agent, predict_s)
        p = self.programs.get(program_id)
        if p is None or p.status is not Status.ACTING:
            return []
        self.protected_until.pop(program_id, None)
        if p.placement.tier is not Tier.GPU or p.demote_after_step is not None:
            return []
        benefit, cost = self.offload_benefit(p, self.calls[program_id].predicted_s)
        cpu = Placement(Tier.CPU, p.placement.replica)
        # The room it frees is for requests at the gate whose KV is then written to host
        # anew: an offload whose copy would not survive that is a recompute in disguise.
        if benefit <= cost or not self.victim_keeps_copy(p, fresh=True):
            return []
        self.outcomes["offload_at_tool_start"] += 1
        return [self._move(p, cpu, MoveReason.OFFLOAD_TOOL, now)] + self._promote(now)

    def on_tool_end(self, program_id: str, now: float) -> list[Move]:
        """The call finished early or on time: learn from it, load the KV back if room."""
        call = self.calls.get(program_id)
        p = self.programs.get(program_id)
        if call is None or p is None or call.ended_s is not None:
            return []
        self.observe_call(program_id, now)
        if p.placement.tier is not Tier.CPU:  # on GPU already, or its KV is gone (WAITING)
            return []
        gpu = Placement(Tier.GPU, p.placement.replica)
        if not self._room_for(p, gpu):
            return []
        return [self._move(p, gpu, MoveReason.PROMOTE_CPU, now)]

    def on_request(
        self, program_id: str, now: float, context_tokens: int | None = None
    ) -> list[Move]:
        call = self.calls.get(program_id)
        p = self.programs.get(program_id)
        if call is not None and p is not None:
            self._count_return(call, p)
        self.protected_until.pop(program_id, None)
        return super().on_request(program_id, now, context_tokens)

    def cancel(self, program_id: str, now: float) -> list[Move]:
        """A held step that gave up no longer keeps its replica closed to the door's starts:
        they are let in now, not at the next event."""
        p = self.programs.get(program_id)
        closing = self.bounded and p is not None and p.pending and program_id in self._inflight_held
        moves = super().cancel(program_id, now)
        return moves + self._let_in(now) if closing else moves

    def end(self, program_id: str, now: float, reason: MoveReason = MoveReason.END) -> list[Move]:
        self.protected_until.pop(program_id, None)
        self.door.forget(program_id)
        self._inflight_held.pop(program_id, None)
        p = self.programs.get(program_id)
        if p is not None:
            self._observe_life(p)
        self._uncount_load(program_id)
        moves = super().end(program_id, now, reason)
        return moves + self._predictive_promotions(now) if moves else moves

    def _after_response(self, p: Program, now: float) -> list[Move]:
        """Room a step freed goes to the gate first (MORI), then to due predictions. The
        step's own figures (its context for the life mean, its load share, the step time)
        are counted first: the gate's pass lets starts in against the load as it is now."""
        self._context_sum[p.program_id] = self._context_sum.get(p.program_id, 0) + p.context_tokens
        if self._load is not None and p.last_replica is not None:
            self._count_load(p, p.last_replica, now)
        a = self.config.ewma_alpha
        self.step_s = a * p.reasoning_s + (1 - a) * self.step_s
        return super()._after_response(p, now) + self._predictive_promotions(now)

    def tick(self, now: float) -> list[Move]:
        """A full MORI tick every `tick_s`; extra wake-ups run only the predictive checks."""
        moves: list[Move] = []
        if now + _EPS >= self._next_rebalance_s:
            self._next_rebalance_s = now + self.config.tick_s
            self._load = None  # summed afresh at the next door pass (`_loads`)
            moves += super().tick(now)
            if self.bounded:
                self.door.update_refusals(now, self.config.gate_timeout_s, self.config.start_hold_s)
        elif self.bounded and self._urgent(now):
            moves += self._promote(now)
        return moves + self._expire_protection(now) + self._predictive_promotions(now)

    def next_wakeup(self, now: float) -> float | None:
        """The earliest time after `now` a predictive check has work (None: none); the
        shell calls `tick` then. Due promotions that found no room are retried when room
        frees (after a response or an end) and at later ticks, never in a busy loop."""
        times = list(self.protected_until.values())
        if self.bounded:  # when the oldest held step in flight becomes urgent
            oldest = next(self._waiting_in_flight(), None)
            if oldest is not None:
                times.append(oldest.last_active_s + URGENT_SHARE * self.config.max_step_wait_s)
        for pid in self.calls:
            p = self.programs.get(pid)
            if p is not None and p.placement.tier is Tier.CPU:
                times.append(self.promote_at(p))
        future = [t for t in times if t is not None and t > now + _EPS]
        return min(future) if future else None

    def describe(self, program_id: str, now: float) -> dict[str, Any] | None:
        """Adds the forecast of the tool call the program is in: its predicted duration,
        and seconds left until its predicted end (negative: overdue; None once ended)."""
        view = super().describe(program_id, now)
        if view is None:
            return None
        call = self.calls.get(program_id)
        view["predicted_tool_s"] = None if call is None else round(call.predicted_s, 3)
        ended = call is None or call.ended_s is not None
        view["predicted_tool_end_s"] = None if ended else round(call.predicted_end_s - now, 3)
        view["start_queue_position"] = self.door.position(program_id)
        return view

    # growth band ----------------------------------------------------------------------
    def leave_free(self, replica: str, now: float) -> int:
        """The reserve, less the part of the growth band that programs in tool calls would
        absorb: on a replica running at most `band_waiver_steps` steps, growth that GPU
        programs expected to stay in their tool call for longer than a step could make
        room for by leaving (the overflow demotion a step end would then make).

        The band keeps step ends from overflowing a brim-full tier (`promotion_reserve`).
        An overflow is cheap when its victim is idle for longer than the step that caused
        it, and the room the band holds is dear when few steps share the engine: one more
        program in a batch of two adds half again, in a batch of twenty, a twentieth, while
        step ends, each a possible overflow, come twenty at a time. Measured (simulated,
        docs/policy.md "The growth band gives way"): the README's demo cell (two steps per
        replica) 0.984 -> 1.007x Continuum over 12 seeds; the Claude Code sample +2 to +6 %
        at 50-80 programs; the generated corpora, which run 10-40 steps per replica, within
        0.3 %. Without the step limit those lost up to 2 %; without the idleness test the
        Claude sample gained about half as much."""
        if replica in self._held_for:  # kept for an urgent step in flight
            return self.tiers.budget(Placement(Tier.GPU, replica)) + 1
        reserve = self.promotion_reserve(replica)
        growth = self.growth_band(replica)
        if growth <= 0 or self.reasoning_on(replica) > self.config.band_waiver_steps:
            return reserve
        return reserve - self._absorbable(replica, growth, now)

    def _absorbable(self, replica: str, up_to: int, now: float) -> int:
        """GPU(replica) room, up to `up_to`, held by ACTING programs an overflow demotion
        may take: unprotected, unmarked, and expected idle for longer than a step."""
        room = 0
        for q in self.tiers.members(Placement(Tier.GPU, replica)):
            if room >= up_to:
                break
            if (
                q.status is Status.ACTING
                and q.program_id not in self.protected_until
                and q.demote_after_step is None
                and self.expected_idle_s(q, now) >= self.step_s
            ):
                room += self.tiers.freed_by(q)
        return min(room, up_to)

    # predictive moves -------------------------------------------------------------
    def _room_for(self, p: Program, gpu: Placement) -> bool:
        """Free room on `gpu` for `p` while no request that could run there waits at the
        gate. Room a waiting request does not fit yet is room gathering for it (or for
        the displacement that makes it fit): a prediction that takes it first, as when
        only requests that fit counted, delayed the gate's steps behind a bet and cost
        the README's demo cell 2-3 % (simulated, 12 seeds)."""
        if not self.tiers.healthy.get(gpu.replica, False):  # type: ignore[arg-type]
            return False
        if p.context_tokens > self.tiers.free(gpu):
            return False
        return not self._gated_demand(gpu.replica)

    def _predictive_promotions(self, now: float) -> list[Move]:
        due = []
        for pid in list(self.calls):
            p = self.programs.get(pid)
            if p is None or p.placement.tier is not Tier.CPU or p.pending:
                continue
            at = self.promote_at(p)
            if at is not None and now + _EPS >= at:
                due.append((self.calls[pid].predicted_end_s, p))
        moves = []
        for predicted_end, p in sorted(due, key=lambda e: e[0]):  # soonest back first
            gpu = Placement(Tier.GPU, p.placement.replica)
            if self._room_for(p, gpu):
                self.calls[p.program_id].promote_tried = True
                self.protected_until[p.program_id] = predicted_end + self.config.predict_grace_s
                self.outcomes["predicted_promotion"] += 1
                moves.append(self._move(p, gpu, MoveReason.PROMOTE_PREDICTED, now))
        return moves

    def _expire_protection(self, now: float) -> list[Move]:
        """A predicted-promoted program still acting past predicted end + grace was
        mispredicted: it loses its protection and yields the room if the gate wants it."""
        moves = []
        for pid, until in list(self.protected_until.items()):
            if now + _EPS < until:
                continue
            del self.protected_until[pid]
            p = self.programs.get(pid)
            if p is None or p.placement.tier is not Tier.GPU or p.status is not Status.ACTING:
                continue
            if self._gated_demand(p.placement.replica):
                cpu = self._fit_or_waiting(Placement(Tier.CPU, p.placement.replica), p)
                self.outcomes["overdue_demotion"] += 1
                moves.append(self._move(p, cpu, MoveReason.DEMOTE, now))
        return moves + (self._promote(now) if moves else [])

    def _count_return(self, call: ToolCall, p: Program) -> None:
        """How a program came back from a tool call: still on CPU (its request waits for a
        load-back), or already on GPU thanks to a predictive promotion."""
        if p.placement.tier is Tier.CPU:
            self.outcomes["back_while_on_cpu"] += 1
        elif call.promote_tried:
            self.outcomes["back_after_predicted_promotion"] += 1
