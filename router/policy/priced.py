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

from bisect import bisect_left
from dataclasses import dataclass
from typing import Any

from router.policy.base import PolicyConfig
from router.policy.mori_paper import MoriPaperPolicy
from router.policy.predictor import DurationPredictor
from router.policy.program import Program
from router.policy.types import WAITING, Move, MoveReason, Placement, Status, Tier

UNKNOWN_TOOL = "unknown"  # a gap whose tool the router was not told
RETURN_WAIT_ALPHA = 0.1  # weight of the newest return wait in `return_wait_s`


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
    default_aging_s = 120.0

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self.predictor = DurationPredictor(self.config.ewma_alpha, self.config.hint_alpha)
        self.calls: dict[str, ToolCall] = {}  # program -> the tool call it is in
        self._evicted_since: dict[str, float] = {}  # held requests of programs off the GPU
        self.return_wait_s = 0.0  # EWMA of those requests' gate waits (Continuum's T)

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

    def _fit_or_waiting(self, dst: Placement, p: Program) -> Placement:
        if dst.tier is Tier.CPU and p.context_tokens > self.host_room(dst.replica):  # type: ignore[arg-type]
            return WAITING
        return dst

    def expected_idle_s(self, p: Program, now: float) -> float:
        """Expected seconds until an ACTING program's next request."""
        call = self.calls.get(p.program_id)
        if call is None:
            return self.predictor.remaining_s(None, UNKNOWN_TOOL, now - p.interval_start)
        return self.predictor.remaining_s(call.agent, call.tool, now - call.start_s)

    def move_cost_s(self, p: Program, dst: Placement) -> float:
        """What moving `p` off its GPU tier costs when it returns: the reload from host
        DRAM (or the recompute when its KV will not be kept on host), plus the gate wait
        that programs returning off the GPU have met lately."""
        prices = self.prices[p.placement.replica]  # type: ignore[index]
        tokens = p.context_tokens
        back = prices.reload_s(tokens) if dst.tier is Tier.CPU else prices.recompute_s(tokens)
        return back + self.return_wait_s

    def describe(self, program_id: str, now: float) -> dict[str, Any] | None:
        view = super().describe(program_id, now)
        p = self.programs.get(program_id)
        if view is not None and p is not None and p.status is Status.ACTING and p.steps > 0:
            view["expected_idle_s"] = round(self.expected_idle_s(p, now), 3)
        return view

    # promotion ----------------------------------------------------------------------------
    def _promote(self, now: float, displace: bool = False) -> list[Move]:
        """The paper's pass (into free room; at a tick also its idleness swaps), then
        priced displacement for what is left; room a displacement frees beyond its request
        goes to the gate at once."""
        moves = super()._promote(now, displace)
        while True:
            priced = self._displace_priced(now)
            if not priced:
                return moves
            moves += priced + super()._promote(now, displace=False)

    def _displace_priced(self, now: float) -> list[Move]:
        held = self._held_programs()
        replicas = self.tiers.replicas()
        if not held or not replicas:
            return []
        free = {
            r: self.tiers.free(Placement(Tier.GPU, r)) - self.promotion_reserve(r) for r in replicas
        }
        pool = _PricedPool(self, now)
        moves: list[Move] = []
        for p in self._priority_order(held, now):
            aged = self.aging_s > 0 and now - p.last_active_s >= self.aging_s
            if p.placement.tier is Tier.CPU:
                targets = [p.placement.replica] if p.placement.replica in free else []
            else:
                order = sorted(free, key=free.__getitem__, reverse=True)
                targets = [p.last_replica, *order] if p.last_replica in free else order
            for r in dict.fromkeys(targets):
                victims = pool.take(r, p.context_tokens - free[r], aged)  # type: ignore[arg-type]
                if victims:
                    moves += self._swap_in(p, r, victims, free, now)  # type: ignore[arg-type]
                    break
        return moves

    def _priority_order(self, held: list[Program], now: float) -> list[Program]:
        """Aged requests first (oldest first), then the paper's classes, each ordered as
        the promotion pass orders it."""
        idleness = self._ranking(now)
        cutoff = now - self.aging_s if self.aging_s > 0 else float("-inf")
        aged = [p for p in held if p.last_active_s <= cutoff]
        classes: tuple[list[Program], list[Program], list[Program]] = ([], [], [])
        for p in held:
            if p.last_active_s > cutoff:
                k = 0 if p.placement.tier is Tier.CPU else 1 if p.steps > 0 else 2
                classes[k].append(p)
        classes[0].sort(key=idleness)
        classes[1].sort(key=idleness)
        classes[2].sort(key=lambda p: (p.context_tokens, idleness(p)))
        return aged + classes[0] + classes[1] + classes[2]

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
        moves = [self._move(p, Placement(Tier.GPU, replica), reason, now)]
        cpu = Placement(Tier.CPU, replica)
        for v in victims:
            moves.insert(-1, self._move(v, self._fit_or_waiting(cpu, v), MoveReason.DEMOTE, now))
        free[replica] += sum(v.context_tokens for v in victims) - p.context_tokens
        return moves


class _PricedPool:
    """ACTING GPU programs whose move pays, per replica, farthest expected return first,
    with token prefix sums: "the fewest such victims freeing `needed` tokens" is one
    bisection. Aged requests may take any ACTING program (`_all`)."""

    def __init__(self, policy: PricedPolicy, now: float) -> None:
        self._policy = policy
        self._now = now
        self._pools: dict[tuple[str, bool], tuple[list[Program], list[int]]] = {}
        self._start: dict[tuple[str, bool], int] = {}
        self._taken: set[str] = set()

    def _pool(self, replica: str, any_victim: bool) -> tuple[list[Program], list[int]]:
        key = (replica, any_victim)
        pool = self._pools.get(key)
        if pool is None:
            policy, now = self._policy, self._now
            margin = policy.config.displace_margin
            cpu = Placement(Tier.CPU, replica)
            ranked = []
            for q in policy.tiers.members(Placement(Tier.GPU, replica)):
                if q.status is not Status.ACTING or q.demote_after_step is not None:
                    continue
                idle = policy.expected_idle_s(q, now)
                dst = policy._fit_or_waiting(cpu, q)
                if any_victim or idle >= margin * policy.move_cost_s(q, dst):
                    ranked.append((idle, q))
            ranked.sort(key=lambda e: e[0], reverse=True)
            prefix = [0]
            for _, q in ranked:
                prefix.append(prefix[-1] + q.context_tokens)
            pool = self._pools[key] = ([q for _, q in ranked], prefix)
            self._start[key] = 0
        return pool

    def take(self, replica: str, needed: int, aged: bool) -> list[Program]:
        """Victims freeing `needed` tokens on `replica`, or [] (a partial move would be
        churn for nothing)."""
        if needed <= 0:
            return []
        key = (replica, aged)
        programs, prefix = self._pool(replica, aged)
        start = self._start[key]
        while start < len(programs) and programs[start].program_id in self._taken:
            start += 1
        end = bisect_left(prefix, prefix[start] + needed, lo=start)
        if end >= len(prefix):
            return []
        chosen = [q for q in programs[start:end] if q.program_id not in self._taken]
        if sum(q.context_tokens for q in chosen) < needed:
            return []
        self._start[key] = end
        self._taken.update(q.program_id for q in chosen)
        return chosen
