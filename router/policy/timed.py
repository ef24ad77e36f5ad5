"""Timed actions: Tokencake's time scheduler (§4), moves driven by a tool call's forecast.

Two moves, measured to pay on the real Claude Code sample (+16 to +37 % output tok/s at
50-80 programs, token scale 0.5) and to cost nothing measurable elsewhere
(docs/policy.md):

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
  request that comes earlier is promoted the normal way. A prediction that was too short
  holds GPU room while the program still acts: that is bounded, since at predicted end +
  `predict_grace_s` the program loses its protection (it ranks least idle meanwhile:
  demoted last, never swapped out) and, if the gate wants the room, goes back to CPU.

The forecast needs finer timing than the tick: `wakeups` says when the shell should call
`tick` next; between full periods the engine's tick only runs these checks.
"""

from __future__ import annotations

from collections import Counter

from router.policy.forecast import Forecast, ToolCall
from router.policy.ordering import Idleness
from router.policy.program import Program
from router.policy.stages import Ledger
from router.policy.types import Move, MoveReason, Placement, Status, Tier

EPS = 1e-9
PROTECTED = -1.0  # a protected program's rank: below every idleness (those are in [0, 1])


class TimeScheduler:
    """Offload at tool start, predictive promotion and the protection it gives."""

    def __init__(self, engine: Ledger) -> None:
        self.engine = engine
        self.forecast: Forecast = engine.forecast  # the calls it acts on
        self.protected_until: dict[str, float] = {}  # predicted-promoted: safe from demotion
        # What the predictions did, for reports: offloads, predicted promotions, and how
        # offloaded programs came back (already on GPU, or before their promotion).
        self.outcomes: Counter[str] = Counter()

    def protect(self, idleness: Idleness) -> Idleness:
        """Protected (predicted-promoted, not yet overdue) programs rank least idle: they
        are demoted last and never displaced by a swap, until their protection expires."""
        protected = self.protected_until

        def ranked(p: Program) -> float:
            return PROTECTED if p.program_id in protected else idleness(p)

        return ranked

    # cost model --------------------------------------------------------------------
    def load_s(self, p: Program) -> float:
        """One-way GPU<->host copy time of the program's KV."""
        return self.engine.config.load_s_per_token * p.context_tokens

    def promote_at(self, p: Program) -> float | None:
        """When a CPU program of an ongoing call should start loading back."""
        call = self.forecast.calls.get(p.program_id)
        if call is None or call.promote_tried or call.ended_s is not None:
            return None
        return call.predicted_end_s - self.load_s(p) - self.engine.config.predict_lead_s

    def offload_benefit(self, p: Program, predicted_s: float) -> tuple[float, float]:
        """(benefit, cost) in seconds of Algorithm 1 for offloading `p` now.

        As in Tokencake, waiting work only counts if its step can finish inside the
        window (`expected_step_s`): freeing room for a step that outlasts the tool call
        just swaps two programs back and forth. And the window must last a tick: MORI's
        tiers are sticky, so the room comes back to `p` only through a rebalance; for
        shorter calls the measured effect was churn (docs/prediction.md)."""
        engine = self.engine
        cost = 2.0 * self.load_s(p)
        window = predicted_s - cost
        if window < engine.config.tick_s or p.context_tokens <= 0:
            return 0.0, cost
        replica = p.placement.replica
        free = max(0, engine.tiers.free(Placement(Tier.GPU, replica)))
        room = free + p.context_tokens
        filled = 0
        demand = (q for q in self.gated_demand(replica) if self.expected_step_s(q) <= window)
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
        return self.engine.step_s

    def gated_demand(self, replica: str | None) -> list[Program]:
        """Programs whose request waits at the gate and could run on `replica` (steps in
        flight, and starts at the door)."""
        cpu = Placement(Tier.CPU, replica)
        return [
            q
            for q in self.engine.every_held()
            if q.placement == cpu or q.placement.tier is Tier.WAITING
        ]

    # events --------------------------------------------------------------------------
    def tool_started(self, p: Program, now: float) -> list[Move]:
        """Offload ACTING `p` at the start of its call if Algorithm 1 says it pays."""
        engine = self.engine
        self.protected_until.pop(p.program_id, None)
        if p.placement.tier is not Tier.GPU or p.demote_after_step is not None:
            return []
        benefit, cost = self.offload_benefit(p, self.forecast.calls[p.program_id].predicted_s)
        cpu = Placement(Tier.CPU, p.placement.replica)
        # The room it frees is for requests at the gate whose KV is then written to host
        # anew: an offload whose copy would not survive that is a recompute in disguise.
        if benefit <= cost or not self.forecast.victim_keeps_copy(p, fresh=True):
            return []
        self.outcomes["offload_at_tool_start"] += 1
        return [engine.move(p, cpu, MoveReason.OFFLOAD_TOOL, now), *engine.promote(now)]

    def tool_ended(self, program_id: str, now: float) -> list[Move]:
        """The call finished early or on time: learn from it, load the KV back if room."""
        engine = self.engine
        call = self.forecast.calls.get(program_id)
        p = engine.programs.get(program_id)
        if call is None or p is None or call.ended_s is not None:
            return []
        self.forecast.observe_call(program_id, now)
        if p.placement.tier is not Tier.CPU:  # on GPU already, or its KV is gone (WAITING)
            return []
        gpu = Placement(Tier.GPU, p.placement.replica)
        if not self._room_for(p, gpu):
            return []
        return [engine.move(p, gpu, MoveReason.PROMOTE_CPU, now)]

    def request_came(self, program_id: str, p: Program | None) -> None:
        """How a program came back from a tool call; it is no longer protected."""
        call = self.forecast.calls.get(program_id)
        if call is not None and p is not None:
            self._count_return(call, p)
        self.forget(program_id)

    def forget(self, program_id: str) -> None:
        """`program_id` is no longer protected (it came back, or it ended)."""
        self.protected_until.pop(program_id, None)

    def wakeups(self, now: float) -> list[float | None]:
        """When a protection expires or a CPU program's promotion falls due."""
        times: list[float | None] = list(self.protected_until.values())
        for pid in self.forecast.calls:
            p = self.engine.programs.get(pid)
            if p is not None and p.placement.tier is Tier.CPU:
                times.append(self.promote_at(p))
        return times

    def describe(self, program_id: str, now: float) -> dict[str, float | None]:
        """The forecast of the tool call the program is in: its predicted duration, and
        seconds left until its predicted end (negative: overdue; None once ended)."""
        call = self.forecast.calls.get(program_id)
        ended = call is None or call.ended_s is not None
        return {
            "predicted_tool_s": None if call is None else round(call.predicted_s, 3),
            "predicted_tool_end_s": None if ended else round(call.predicted_end_s - now, 3),  # type: ignore[union-attr]
        }

    # predictive moves -------------------------------------------------------------
    def _room_for(self, p: Program, gpu: Placement) -> bool:
        """Free room on `gpu` for `p` while no request that could run there waits at the
        gate. Room a waiting request does not fit yet is room gathering for it (or for
        the displacement that makes it fit): a prediction that takes it first, as when
        only requests that fit counted, delayed the gate's steps behind a bet and cost
        the README's demo cell 2-3 % (simulated, 12 seeds)."""
        tiers = self.engine.tiers
        if not tiers.healthy.get(gpu.replica, False):  # type: ignore[arg-type]
            return False
        if p.context_tokens > tiers.free(gpu):
            return False
        return not self.gated_demand(gpu.replica)

    def predictive_promotions(self, now: float) -> list[Move]:
        engine, calls = self.engine, self.forecast.calls
        due = []
        for pid in list(calls):
            p = engine.programs.get(pid)
            if p is None or p.placement.tier is not Tier.CPU or p.pending:
                continue
            at = self.promote_at(p)
            if at is not None and now + EPS >= at:
                due.append((calls[pid].predicted_end_s, p))
        moves = []
        for predicted_end, p in sorted(due, key=lambda e: e[0]):  # soonest back first
            gpu = Placement(Tier.GPU, p.placement.replica)
            if self._room_for(p, gpu):
                calls[p.program_id].promote_tried = True
                self.protected_until[p.program_id] = predicted_end + engine.config.predict_grace_s
                self.outcomes["predicted_promotion"] += 1
                moves.append(engine.move(p, gpu, MoveReason.PROMOTE_PREDICTED, now))
        return moves

    def expire_protection(self, now: float) -> list[Move]:
        """A predicted-promoted program still acting past predicted end + grace was
        mispredicted: it loses its protection and yields the room if the gate wants it."""
        engine = self.engine
        moves = []
        for pid, until in list(self.protected_until.items()):
            if now + EPS < until:
                continue
            del self.protected_until[pid]
            p = engine.programs.get(pid)
            if p is None or p.placement.tier is not Tier.GPU or p.status is not Status.ACTING:
                continue
            if self.gated_demand(p.placement.replica):
                self.outcomes["overdue_demotion"] += 1
                moves.append(engine.demote(p, p.placement.replica, now))  # type: ignore[arg-type]
        return moves + (engine.promote(now) if moves else [])

    def _count_return(self, call: ToolCall, p: Program) -> None:
        """How a program came back from a tool call: still on CPU (its request waits for a
        load-back), or already on GPU thanks to a predictive promotion."""
        if p.placement.tier is Tier.CPU:
            self.outcomes["back_while_on_cpu"] += 1
        elif call.promote_tried:
            self.outcomes["back_after_predicted_promotion"] += 1
