"""The systems MORI is compared against, behind the same `Policy` interface.

* `SmgPolicy` ("smg"): SGLang Model Gateway's `cache_aware` routing. No program
  awareness: every request is forwarded at once, to the replica holding the program's
  prefix unless load is imbalanced; the engine queues and evicts (plain LRU) on its own.
* `ThunderAgentPolicy` ("ta"): ThunderAgent's "TR" scheduler (peers.md 1.5): program-aware
  pause/resume inside the GPU budget, no CPU tier; a paused program's KV is left to the
  engine's LRU.
* `ThunderAgentOffloadPolicy` ("ta+o"): the same, with the engine's HiCache host tier on
  under its own (uncoordinated) LRU.

Each baseline implements its system's intended behaviour, not its known bugs (see
docs/policy.md): a baseline is never weakened.
"""

from __future__ import annotations

from collections import Counter
from typing import ClassVar

from router.policy.base import Policy, PolicyConfig
from router.policy.program import Program
from router.policy.types import WAITING, EngineMode, Move, MoveReason, Placement, Status, Tier

# SMG cache_aware defaults (--balance-abs-threshold, --balance-rel-threshold)
SMG_BALANCE_ABS = 64
SMG_BALANCE_REL = 1.5
# ThunderAgent charges every program on a backend this many tokens on top of its context
TA_PROGRAM_OVERHEAD = 100


class SmgPolicy(Policy):
    """Prefix-affinity routing with SMG's load-imbalance escape; no gate, no budget."""

    name = "smg"
    gated = False
    sends_hints = False

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self._running: Counter[str] = Counter()  # requests in flight per replica
        self._routed: dict[str, str] = {}  # program -> replica of its request in flight

    @property
    def engine_mode(self) -> EngineMode:
        return EngineMode(eviction="lru", host_tier=self.config.smg_offload)

    def choose_replica(self, p: Program) -> str | None:
        """SMG cache_aware: the prefix's replica (the program's last one) unless the
        running-request counts are imbalanced (abs > 64 and max > 1.5 x min), then the
        least loaded healthy replica."""
        loads = {r: self._running[r] for r in self.tiers.replicas()}
        if not loads:
            return None
        lo, hi = min(loads.values()), max(loads.values())
        imbalanced = hi - lo > SMG_BALANCE_ABS and hi > lo * SMG_BALANCE_REL
        if not imbalanced and p.last_replica in loads:
            return p.last_replica
        return min(loads, key=loads.__getitem__)

    def _admit(self, p: Program, now: float) -> list[Move]:
        replica = self.choose_replica(p)
        if replica is None:  # no healthy replica: held until one comes back
            return []
        self._routed[p.program_id] = replica
        self._running[replica] += 1
        gpu = Placement(Tier.GPU, replica)
        if p.placement == gpu:
            self.release(p, now)
            return []
        return [self.move(p, gpu, MoveReason.ADMIT, now)]

    def _after_response(self, p: Program, now: float) -> list[Move]:
        self._finish(p.program_id)
        return []

    def end(self, program_id: str, now: float, reason: MoveReason = MoveReason.END) -> list[Move]:
        self._finish(program_id)
        return super().end(program_id, now, reason)

    def _finish(self, program_id: str) -> None:
        replica = self._routed.pop(program_id, None)
        if replica is not None:
            self._running[replica] -= 1

    def _rebalance(self, now: float) -> list[Move]:
        """No moves; only requests held while no replica was healthy are routed now."""
        moves: list[Move] = []
        for p in self.every_held():
            moves += self._admit(p, now)
        return moves


class ThunderAgentPolicy(Policy):
    """ThunderAgent TR: pause (ACTING, then REASONING lazily) when over the GPU budget,
    resume at each tick; capacity charges context + 100 tokens per program."""

    name = "ta"
    sends_hints = False
    host_tier: ClassVar[bool] = False  # the engines' HiCache host tier (`ta+o`: on)

    @property
    def engine_mode(self) -> EngineMode:
        return EngineMode(eviction="lru", host_tier=self.host_tier)

    @staticmethod
    def cost(p: Program) -> int:
        return p.context_tokens + TA_PROGRAM_OVERHEAD

    def remaining(self, replica: str) -> int:
        """ThunderAgent's `remaining_capacity()` of a backend."""
        gpu = Placement(Tier.GPU, replica)
        used = self.tiers.used(gpu) + TA_PROGRAM_OVERHEAD * self.tiers.count(gpu)
        return self.tiers.budget(gpu) - used

    def _admit(self, p: Program, now: float) -> list[Move]:
        """At once if nobody else is queued (FIFO fairness) and a backend has room; the
        backend with the fewest active tokens wins."""
        if p.placement.tier is Tier.GPU:
            self.release(p, now)
            return []
        if len(self.every_held()) > 1:
            return []
        fits = [r for r in self.tiers.replicas() if self.remaining(r) >= self.cost(p)]
        if not fits:
            return []
        replica = min(fits, key=lambda r: self.tiers.used(Placement(Tier.GPU, r)))
        return [self.move(p, Placement(Tier.GPU, replica), MoveReason.ADMIT, now)]

    def _rebalance(self, now: float) -> list[Move]:
        moves: list[Move] = []
        for replica in self.tiers.replicas():
            moves += self._pause_until_safe(replica, now)
        return moves + self._resume(now)

    def _pause_until_safe(self, replica: str, now: float) -> list[Move]:
        """Pause ACTING programs smallest first, then mark REASONING ones smallest first;
        a marked program's tokens count as freed (ThunderAgent's code forgot this and
        marked every REASONING program of an overloaded backend)."""
        self._clear_marks(replica)
        excess = -self.remaining(replica)
        if excess <= 0:
            return []
        members = sorted(self.tiers.members(Placement(Tier.GPU, replica)), key=self.cost)
        moves = []
        for p in members:
            if excess <= 0:
                break
            if p.status is Status.ACTING:
                excess -= self.tiers.freed_by(p) + TA_PROGRAM_OVERHEAD
                moves.append(self.move(p, WAITING, MoveReason.PAUSE, now))
        for p in members:
            if excess <= 0:
                break
            if p.status is Status.REASONING:
                excess -= self.tiers.freed_by(p) + TA_PROGRAM_OVERHEAD
                self._mark_lazy(p, WAITING)
        return moves

    def _resume(self, now: float) -> list[Move]:
        """Returning programs then new ones, each smallest first; take what fits in the
        total free room, then place largest first on the tightest backend (true best fit,
        as in SMG's port; ThunderAgent's Python picks the roomiest)."""
        held = self.every_held()
        free = {r: self.remaining(r) for r in self.tiers.replicas()}
        if not held or not free:
            return []
        returning = sorted((p for p in held if p.steps > 0), key=self.cost)
        new = sorted((p for p in held if p.steps == 0), key=self.cost)
        total = sum(max(0, f) for f in free.values())
        picked = []
        for p in returning + new:
            if self.cost(p) <= total:
                total -= self.cost(p)
                picked.append(p)
        moves: list[Move] = []
        for p in sorted(picked, key=self.cost, reverse=True):
            self._place_best_fit(p, free, now, moves)
        for p in returning + new:  # backfill what fragmentation left: nothing that fits waits
            if p.pending:
                self._place_best_fit(p, free, now, moves)
        return moves

    def _place_best_fit(
        self, p: Program, free: dict[str, int], now: float, moves: list[Move]
    ) -> None:
        fits = [r for r in free if free[r] >= self.cost(p)]
        if fits:
            replica = min(fits, key=lambda r: (free[r], r != p.last_replica))
            moves.append(self.move(p, Placement(Tier.GPU, replica), MoveReason.RESUME, now))
            # the tier's own count: a segment the replica holds already is not paid twice
            free[replica] = self.remaining(replica)


class ThunderAgentOffloadPolicy(ThunderAgentPolicy):
    """ThunderAgent with the engine's HiCache host tier on (its own LRU, no hints)."""

    name = "ta+o"
    host_tier = True
