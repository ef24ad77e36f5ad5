"""`continuum`: Continuum / CacheTTL (arXiv 2511.02230, v6 method) as a router policy.

Continuum keeps ("pins") a program's KV on the GPU through a tool call for a time-to-live
chosen by a cost-benefit model, and schedules waiting requests program-first-come-first-
served. Built from the paper's v6 text (Algorithm 1, sections 4-5); docs/policy.md lists
where the paper is silent and what was chosen. Mapped onto the tiers:

* GPU(r) holds running and pinned programs; an unpinned program goes to WAITING with an
  `inactive` hint (evictable but still cached, as vLLM's freed prefix blocks; with the host
  tier on its KV stays in host DRAM, as LMCache keeps it).
* **TTL** (section 4.1-4.2): tau* = argmax over tau in {0} U {observed durations} of
  P(tau, f) x B - tau, with P the empirical CDF of tool f's past durations and
  B = T x eta + Prefill-Reload(r): T the mean gate wait of recent follow-ups whose program
  had lost its pin (sliding window, starts at 0), eta = -Corr(k, N - k) over finished
  programs' turns (1 until known), Prefill-Reload the reload (host tier on) or recompute
  price of the context, from the replica's measured prices. Cold start: with <= K = 100
  durations seen in all, Exp(1)-distributed durations and eta = 1, whose optimum is
  ln(B) (0 when B <= 1 s); a tool with <= K records uses all tools' history.
* **Pin** after a step that ends in a tool call (TTL > 10 ms); a step with no tool call is
  not pinned. A pin expires when its TTL has passed and its program has no request
  waiting (then it is held until that request is admitted).
* **Schedule** (every event and tick): per replica, waiting requests ordered (pinned
  program first, then program arrival: the program's first request); the head is admitted
  if its context fits, else pins of other programs are released, latest program arrival
  first, until it fits; if it still does not fit the queue waits (head-of-line, as
  Algorithm 1). Programs stick to their replica; a new one goes where most room is free.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque

from router.policy.base import Capabilities, Policy, PolicyConfig
from router.policy.program import Program
from router.policy.types import (
    WAITING,
    EngineMode,
    Move,
    MoveReason,
    Placement,
    Status,
    Tier,
    ToolStart,
)

K_COLD = 100  # tool records before the empirical CDF is trusted (section 4.2)
MIN_TTL_S = 0.01  # shorter TTLs are not pinned (the authors' code)
WINDOW = 100  # follow-up gate waits averaged into T; tool records kept per tool
_EPS = 1e-9


class ContinuumPolicy(Policy):
    """TTL pinning through tool calls plus program-level FCFS (Continuum v6)."""

    name = "continuum"
    capabilities = Capabilities(wakeups=True)  # its pins end on a clock (`next_wakeup`)

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self.pins: dict[str, float] = {}  # program on GPU between steps -> pin deadline
        self._durations: dict[str, deque[float]] = {}  # tool -> recent durations
        self._all: deque[float] = deque(maxlen=WINDOW * 10)
        self._seen = 0  # tool records ever observed (cold start counts all of them)
        self._tool: dict[str, str] = {}  # program -> tool of its current call
        self._finished_at: dict[str, float] = {}  # program -> end of its last step
        self._unpinned_wait: dict[str, float] = {}  # held follow-ups that had lost the pin
        self.waits: deque[float] = deque(maxlen=WINDOW)  # T's window
        self._turns = [0.0] * 6  # n, sum x, sum y, sum xx, sum yy, sum xy of (k, N-k)

    @property
    def engine_mode(self) -> EngineMode:
        """Pinned and running KV is evicted last, unpinned KV first (typed ranks), and the
        host tier keeps a copy (Continuum evaluates with LMCache DRAM offload)."""
        return EngineMode(eviction="typed", host_tier=True)

    # the cost model --------------------------------------------------------------------------
    @property
    def eta(self) -> float:
        """Memoryfulness: -Corr(k, N - k) over finished programs' turns; 1 until known."""
        n, sx, sy, sxx, syy, sxy = self._turns
        if n < 2:
            return 1.0
        vx, vy = n * sxx - sx * sx, n * syy - sy * sy
        if vx <= _EPS or vy <= _EPS:
            return 1.0
        return max(-1.0, min(1.0, -(n * sxy - sx * sy) / math.sqrt(vx * vy)))

    def ttl_s(self, p: Program, tool: str) -> float:
        """tau* for `p`'s call of `tool` (section 4.1, equation 2)."""
        prices = self.prices[p.last_replica]  # type: ignore[index]
        tokens = p.context_tokens
        reload = prices.reload_s(tokens) if self.engine_mode.host_tier else None
        back = reload if reload is not None else prices.recompute_s(tokens)
        queue = sum(self.waits) / len(self.waits) if self.waits else 0.0
        if self._seen <= K_COLD:  # Exp(1) durations (1 s: trace seconds), eta = 1
            k = self.config.time_scale
            benefit = (queue + back) * k
            return math.log(benefit) / k if benefit > 1.0 else 0.0
        own = self._durations.get(tool, ())
        history = sorted(own if len(own) > K_COLD else self._all)
        benefit = queue * self.eta + back
        best_tau, best = 0.0, 0.0
        for i, tau in enumerate(history):  # ascending: ties keep the shorter TTL
            value = bisect_right(history, tau, lo=i) / len(history) * benefit - tau
            if value > best:
                best_tau, best = tau, value
        return best_tau

    # events ------------------------------------------------------------------------------------
    def on_request(
        self, program_id: str, now: float, context_tokens: int | None = None
    ) -> list[Move]:
        p = self.programs.get(program_id)
        tool = self._tool.pop(program_id, None)
        if p is not None and tool is not None and program_id in self._finished_at:
            self._record(tool, now - self._finished_at[program_id])
        if p is not None and p.steps > 0 and program_id not in self.pins:
            self._unpinned_wait[program_id] = now
        return super().on_request(program_id, now, context_tokens)

    def _tool_started(self, program_id: str, now: float, call: ToolStart) -> list[Move]:
        """The step ended in a tool call: pin for tau*, or release now."""
        p = self.programs.get(program_id)
        if p is None or program_id not in self.pins or p.status is not Status.ACTING:
            return []
        self._tool[program_id] = call.tool
        ttl = self.ttl_s(p, call.tool)
        if ttl > MIN_TTL_S / self.config.time_scale:
            self.pins[program_id] = now + ttl
            return []
        return self._unpin(p, now) + self._schedule(now)

    def cancel(self, program_id: str, now: float) -> list[Move]:
        """A head that gave up no longer blocks the requests behind it."""
        self._unpinned_wait.pop(program_id, None)
        return super().cancel(program_id, now) + self._schedule(now)

    def end(self, program_id: str, now: float, reason: MoveReason = MoveReason.END) -> list[Move]:
        p = self.programs.get(program_id)
        if p is not None and p.steps > 0:
            self._count_turns(p.steps)
        for table in (self.pins, self._tool, self._finished_at, self._unpinned_wait):
            table.pop(program_id, None)
        # its room, or its place at the head of a queue, is free now
        return super().end(program_id, now, reason) + self._schedule(now)

    def next_wakeup(self, now: float) -> float | None:
        """The next pin to expire, while requests wait for room (the shell ticks then)."""
        if not self.every_held():
            return None
        future = [t for t in self.pins.values() if t > now + _EPS]
        return min(future) if future else None

    def _admit(self, p: Program, now: float) -> list[Move]:
        return self._schedule(now)

    def _after_response(self, p: Program, now: float) -> list[Move]:
        """A finished step keeps its room until `on_tool_start` (called right after, with
        the tool its answer ends in) prices the pin; a step with no tool call has a pin
        that expires now, so the next schedule after this instant releases it."""
        self._finished_at[p.program_id] = now
        if p.placement.tier is Tier.GPU:
            self.pins[p.program_id] = now
        return self._schedule(now)  # room a lazy demotion freed; this pin is not released

    def _start(self, p: Program, now: float) -> None:
        since = self._unpinned_wait.pop(p.program_id, None)
        if since is not None:
            self.waits.append(now - since)
        self.pins.pop(p.program_id, None)  # the pin is consumed by the running request
        super()._start(p, now)

    def _rebalance(self, now: float) -> list[Move]:
        """A tick: a GPU tier over its budget (the replica reported less room) releases pins,
        latest program arrival first, then marks running programs to leave after their
        step; then the usual schedule."""
        moves: list[Move] = []
        for replica in self.tiers.replicas():
            gpu = Placement(Tier.GPU, replica)
            self._clear_marks(replica)
            excess = self.tiers.used(gpu) - self.tiers.budget(gpu)
            for p in sorted(self.tiers.members(gpu), key=lambda q: q.created_s, reverse=True):
                if excess <= 0:
                    break
                if p.status is Status.ACTING and not p.pending:
                    excess -= self.tiers.freed_by(p)
                    moves += self._unpin(p, now)
                elif p.status is Status.REASONING:
                    excess -= self.tiers.freed_by(p)
                    self._mark_lazy(p, WAITING)
        return moves + self._schedule(now)

    def set_healthy(self, replica: str, healthy: bool, now: float) -> list[Move]:
        """A drained replica's held requests take their turn elsewhere at once."""
        moves = super().set_healthy(replica, healthy, now)
        return moves if healthy else moves + self._schedule(now)

    # scheduling --------------------------------------------------------------------------------
    def _schedule(self, now: float) -> list[Move]:
        moves: list[Move] = []
        held = self.every_held()
        waiting = {p.program_id for p in held}
        for pid, deadline in list(self.pins.items()):
            p = self.programs[pid]
            if now > deadline + _EPS and pid not in waiting:
                moves += self._unpin(p, now)
        for p in held:
            if p.placement.tier is Tier.GPU and p.pending:  # still pinned: straight in
                self.release(p, now)
        blocked: set[str] = set()  # replicas whose queue head does not fit
        for p in sorted(held, key=lambda q: (q.program_id not in self.pins, q.created_s)):
            if not p.pending or p.placement.tier is Tier.GPU:
                continue
            replica = self._replica_of(p, blocked)
            if replica is None or replica in blocked:
                continue  # behind its replica's head
            admitted, released = self._admit_head(p, replica, now)
            moves += released
            if not admitted:
                blocked.add(replica)  # head-of-line (Algorithm 1)
        return moves

    def _admit_head(self, p: Program, replica: str, now: float) -> tuple[bool, list[Move]]:
        """Admit the head of `replica`'s queue, releasing pins of later-arrived programs
        for it as needed; whether it got in, and the moves (released pins stay released)."""
        gpu = Placement(Tier.GPU, replica)
        moves: list[Move] = []
        if not self.tiers.fits(gpu, p.context_tokens):
            victims = sorted(
                (q for q in self.tiers.members(gpu) if q.program_id in self.pins),
                key=lambda q: q.created_s,
                reverse=True,
            )
            for v in victims:
                if self.tiers.fits(gpu, p.context_tokens):
                    break
                deciding = self._finished_at.get(v.program_id) == now  # TTL not priced yet
                if v.status is Status.ACTING and not v.pending and not deciding:
                    moves += self._unpin(v, now)
        if not self.tiers.fits(gpu, p.context_tokens):
            return False, moves
        reason = MoveReason.PROMOTE_WAITING if p.steps > 0 else MoveReason.PROMOTE_NEW
        return True, [*moves, self.move(p, gpu, reason, now)]

    def _replica_of(self, p: Program, blocked: set[str]) -> str | None:
        """Sticky: the program's replica while healthy; a new one, at its turn, goes to the
        unblocked replica with the most free room."""
        healthy = self.tiers.replicas()
        if p.last_replica in healthy:
            return p.last_replica
        open_ = [r for r in healthy if r not in blocked]
        if not open_:
            return None
        return max(open_, key=lambda r: self.tiers.free(Placement(Tier.GPU, r)))

    def _unpin(self, p: Program, now: float) -> list[Move]:
        self.pins.pop(p.program_id, None)
        if p.placement.tier is not Tier.GPU or p.status is not Status.ACTING:
            return []
        return [self.move(p, WAITING, MoveReason.DEMOTE, now)]

    # statistics --------------------------------------------------------------------------------
    def _record(self, tool: str, duration_s: float) -> None:
        duration_s = max(0.0, duration_s)
        history = self._durations.get(tool)
        if history is None:
            history = self._durations[tool] = deque(maxlen=WINDOW * 10)
            while len(self._durations) > 4096:  # client-named keys: bounded memory
                del self._durations[next(iter(self._durations))]
        history.append(duration_s)
        self._all.append(duration_s)
        self._seen += 1

    def _count_turns(self, turns: int) -> None:
        """Add the pairs (k, N - k), k = 1..N, of a program of N turns to eta's sums."""
        n = float(turns)
        s1 = n * (n + 1) / 2  # sum of k
        s2 = n * (n + 1) * (2 * n + 1) / 6  # sum of k^2
        sums = (n, s1, n * n - s1, s2, n * n * n - 2 * n * s1 + s2, n * s1 - s2)
        self._turns = [a + b for a, b in zip(self._turns, sums, strict=True)]
