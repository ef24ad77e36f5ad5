"""Tokencake's space scheduler (§5), an engine stage: `mori+space` (`mori` with it) and
`mori-priced+space` (`mori-priced` with it).

`mori` already carries Tokencake's *time* scheduler (offload at tool start when the
window pays, predictive load-back: `router.policy.timed`), so `mori+space` is Tokencake's
two schedulers together; `mori-priced+space` is the space scheduler without the time
scheduler. Both add the *space* scheduler for multi-agent applications whose agents form
a graph (`router.policy.app_graph`: registered through `POST /v1/apps` or a trace's
`graph`, else inferred from hand-overs). Three parts:

* **Hybrid priority** (§5.2) of a held request of agent type t (an app's role):

      static  = w_static x depth(t) x out_degree(t)       (out-degree 0 counts as 1)
      dynamic = wait x ln(tokens / wait)                   (0 before any wait)

  depth counts roles from a source (a source is 1), so later stages of an app go first
  and an app under way finishes before new ones start theirs. The paper's formula is
  used as written: for the token counts and waits seen here (thousands of tokens, seconds
  to minutes) it grows with the wait (older requests first) and, as written, rises with
  the request's size, not falls as the paper's text says. MORI's promotion pass offers
  room in this order within each of its classes, priced displacement picks its
  candidates in it, and the engine admits busy requests in static-priority order.

* **Critical agents and the reserved pool** (§5.1, Algorithm 2), at every tick: the live
  agent types are scored (static priority + the largest dynamic priority among their held
  requests) and the top `critical_ratio` of them are critical. Per replica, the pool's
  share of the GPU budget grows by `reserve_step` while the GPU tier is at least
  `gpu_usage_high` full and shrinks below `gpu_usage_low` (at most `reserve_max`); the
  pool is split among the critical types by (usage share + score share) / 2, usage being
  each type's GPU-tier tokens on the replica (an EWMA over ticks).

* **Promotions respect it**: the part of a type's reservation its own programs do not
  use is closed to every other promotion (it is added to MORI's promotion reserve). Held
  requests of critical types go first, into the free room plus their own reservation; if
  other programs sit in it, ACTING programs of non-critical types on that replica are
  moved off the GPU (CPU tier, else WAITING) to give it back, lowest priority and
  farthest return first, never more than the reservation's unused part. The engine is
  told the critical types (`PushPriorities`), so within one hint type it evicts their KV
  last.

Without apps (requests that name no `app_id`) nothing here acts: every priority is 0, no
type is critical, no room is reserved, and the policy is `mori`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from router.policy.app_graph import AppGraphs, Shape, check_edges
from router.policy.placement import affine_first
from router.policy.program import Program
from router.policy.runtime import AgentEvent, EventKind, PushPriorities
from router.policy.stages import Ledger
from router.policy.types import Move, Placement, Status, Tier


def static_priority(shape: Shape | None, w_static: float) -> float:
    """w_static x depth x out-degree (a sink's 0 out-degree counts as 1); 0 off-graph."""
    if shape is None:
        return 0.0
    return w_static * shape.depth * max(1, shape.out_degree)


def dynamic_priority(wait_s: float, tokens: int) -> float:
    """Tokencake's wait x ln(tokens / wait); 0 before the request has waited."""
    if wait_s <= 0:
        return 0.0
    return wait_s * math.log(max(1, tokens) / wait_s)


@dataclass
class Partition:
    """One replica's reserved pool (Algorithm 2)."""

    ratio: float = 0.0  # pool share of the GPU budget
    usage: dict[str, float] = field(default_factory=dict)  # type -> GPU tokens (EWMA)
    reserve: dict[str, int] = field(default_factory=dict)  # critical type -> tokens


class SpaceScheduler:
    """Tokencake's space scheduler, a stage of the engine (see the module docstring)."""

    def __init__(self, engine: Ledger) -> None:
        self.engine = engine
        self.graphs = AppGraphs()
        self.partitions: dict[str, Partition] = {}
        self.critical: frozenset[str] = frozenset()
        self._pushed_critical: frozenset[str] = frozenset()
        # app programs the engines were not told of yet, in arrival order (a set would order
        # the pushes by string hash)
        self._unpushed: dict[str, None] = {}
        self.critical_promotions = 0

    # the shells' hooks ----------------------------------------------------------------
    def register_app(self, app: str, edges: object) -> dict[str, Shape]:
        """An application's graph (what `POST /v1/apps` carries); ValueError if invalid."""
        return self.graphs.register(app, check_edges(edges))

    def observe(self, event: AgentEvent) -> None:
        """A request's app, role and task, before `on_request` (see the shells)."""
        if event.kind is EventKind.REQUEST:
            self.graphs.observe_request(
                event.program_id, event.agent, event.app, event.session, event.parent
            )
            if self.graphs.agent_type(event.program_id) is not None:
                self._unpushed[event.program_id] = None

    def runtime_actions(self, now: float) -> list[PushPriorities]:
        """Tell the engines the static priority and type of newly placed app programs, and
        the critical types when they change."""
        if not self._unpushed and self.critical == self._pushed_critical:
            return []
        programs = self.engine.programs
        per: dict[str, tuple[dict[str, float], dict[str, str]]] = defaultdict(lambda: ({}, {}))
        for pid in list(self._unpushed):
            p = programs.get(pid)
            replica = None if p is None else p.placement.replica or p.last_replica
            kind = self.graphs.agent_type(pid)
            if p is None or kind is None:
                self._unpushed.pop(pid, None)
            elif replica is not None:
                per[replica][0][pid] = self.static(pid)
                per[replica][1][pid] = kind
                self._unpushed.pop(pid, None)
        changed = self.critical != self._pushed_critical
        self._pushed_critical = self.critical
        replicas = self.engine.tiers.replicas() if changed else list(per)
        return [
            PushPriorities(r, per[r][0], per[r][1], self.critical if changed else None)
            for r in replicas
        ]

    # priorities -------------------------------------------------------------------------
    def static(self, program_id: str) -> float:
        return static_priority(self.graphs.shape(program_id), self.engine.config.w_static)

    def priority(self, p: Program, now: float) -> float:
        """Hybrid priority of `p`'s held request (0 for programs of no app)."""
        if self.graphs.agent_type(p.program_id) is None:
            return 0.0
        # Tokencake's formula reads a wait in seconds: trace seconds
        wait = (now - p.last_active_s) * self.engine.config.time_scale if p.pending else 0.0
        return self.static(p.program_id) + dynamic_priority(wait, p.context_tokens)

    # the reserved pool --------------------------------------------------------------------
    def _usage_by_type(self, replica: str) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for p in self.engine.tiers.members(Placement(Tier.GPU, replica)):
            kind = self.graphs.agent_type(p.program_id)
            if kind is not None:
                out[kind] += p.context_tokens
        return out

    def unused_reserve(self, replica: str, but: str | None = None) -> int:
        """Reserved tokens on `replica` that their types' own programs do not use (of every
        critical type but `but`): no ordinary promotion takes room held for a critical
        agent type (the engine adds it to its promotion reserve)."""
        part = self.partitions.get(replica)
        if part is None or not part.reserve:
            return 0
        used = self._usage_by_type(replica)
        return sum(max(0, n - used.get(t, 0)) for t, n in part.reserve.items() if t != but)

    def update_partitions(self, now: float) -> None:
        """Algorithm 2 (every tick): critical types, then per replica the pool's size and
        split."""
        cfg, tiers = self.engine.config, self.engine.tiers
        scores = self._type_scores(now)
        k = min(len(scores), math.ceil(cfg.critical_ratio * len(scores)))
        ranked = sorted(scores, key=lambda t: (-scores[t], t))
        self.critical = frozenset(ranked[:k])
        total_score = sum(scores[t] for t in self.critical) or 1.0
        for r in tiers.replicas():
            part = self.partitions.setdefault(r, Partition())
            budget = tiers.budget(Placement(Tier.GPU, r))
            used = self._usage_by_type(r)
            a = cfg.ewma_alpha
            for t in set(part.usage) | set(used):
                part.usage[t] = a * used.get(t, 0) + (1 - a) * part.usage.get(t, 0.0)
                if part.usage[t] < 1 and t not in used:
                    del part.usage[t]
            if not self.critical:
                part.ratio, part.reserve = 0.0, {}
                continue
            pressure = tiers.used(Placement(Tier.GPU, r)) / budget if budget else 0.0
            if pressure >= cfg.gpu_usage_high:
                part.ratio = min(cfg.reserve_max, part.ratio + cfg.reserve_step)
            elif pressure <= cfg.gpu_usage_low:
                part.ratio = max(0.0, part.ratio - cfg.reserve_step)
            pool = budget * part.ratio
            part.reserve = {
                t: int(pool * (part.usage.get(t, 0.0) / budget + scores[t] / total_score) / 2)
                for t in self.critical
            }

    def _type_scores(self, now: float) -> dict[str, float]:
        """Live agent types: static priority plus their most urgent held request's wait
        term."""
        scores: dict[str, float] = {}
        for p in self.engine.programs.values():
            kind = self.graphs.agent_type(p.program_id)
            if kind is None:
                continue
            score = self.priority(p, now)
            if score > scores.get(kind, -math.inf):
                scores[kind] = score
        return scores

    # promotion ------------------------------------------------------------------------
    def promote(self, now: float, displace: bool = False) -> list[Move]:
        """Critical agents first, then the engine's promotion."""
        engine = self.engine
        moves = self._promote_critical(now)
        batch = engine.promote_held(now, displace)
        while any(self._took_own_reserve(m) for m in batch):
            # the engine's pass holds each replica's reserve fixed while it packs; a
            # critical program it placed now fills its type's reservation, and the part it
            # used is shared room again for the requests still held
            moves += batch
            batch = engine.promote_held(now)
        return moves + batch

    def _took_own_reserve(self, move: Move) -> bool:
        """A program moved onto a GPU where its own type holds a reservation."""
        part = self.partitions.get(move.dst.replica or "")
        kind = self.graphs.agent_type(move.program_id)
        return move.to_gpu and part is not None and part.reserve.get(kind or "", 0) > 0

    def _promote_critical(self, now: float) -> list[Move]:
        """Held requests of critical types that the shared room cannot take, highest
        priority first, into their own reservation, reclaiming it from non-critical ACTING
        programs if needed (what fits the shared room goes through the engine's pass)."""
        if not self.critical:
            return []
        held = [
            p
            for p in self.engine.every_held()  # starts at the door too: the room is theirs
            if p.placement.tier is not Tier.GPU
            and self.graphs.agent_type(p.program_id) in self.critical
        ]
        moves: list[Move] = []
        for p in sorted(held, key=lambda p: -self.priority(p, now)):
            for r in self._targets(p):
                placed = self._place_critical(p, r, now)
                if placed:
                    moves += placed
                    self.critical_promotions += 1
                    break
        return moves

    def _targets(self, p: Program) -> list[str]:
        tiers = self.engine.tiers
        if p.placement.tier is Tier.CPU:
            return [p.placement.replica] if tiers.healthy.get(p.placement.replica) else []  # type: ignore[arg-type,list-item]
        return affine_first(p, {r: tiers.free(Placement(Tier.GPU, r)) for r in tiers.replicas()})

    def _place_critical(self, p: Program, replica: str, now: float) -> list[Move]:
        engine = self.engine
        kind = self.graphs.agent_type(p.program_id)
        gpu = Placement(Tier.GPU, replica)
        others = self.unused_reserve(replica, but=kind)
        own = self.unused_reserve(replica) - others
        room = engine.tiers.free(gpu) - engine.growth_band(replica) - others
        shared = room - own
        if own <= 0 or p.context_tokens <= shared:
            return []  # no reservation to use, or the engine's pass places it
        if p.context_tokens > max(0, shared) + own:
            return []  # more than the shared room and its reservation together
        victims: list[Program] = []
        if p.context_tokens > room:  # others sit in its reservation: they give it back
            victims = self._reclaim(replica, p.context_tokens - room, now)
            if not victims:
                return []
        return engine.swap_in(p, replica, victims, {replica: room}, now)

    def _reclaim(self, replica: str, need: int, now: float) -> list[Program]:
        """Non-critical ACTING programs of GPU(replica) freeing `need` tokens, lowest
        static priority and farthest expected return first; [] if they cannot."""
        engine = self.engine
        protected = engine.timed.protected_until if engine.timed else {}
        pool = [
            q
            for q in engine.tiers.members(Placement(Tier.GPU, replica))
            if q.status is Status.ACTING
            and q.demote_after_step is None
            and q.program_id not in protected
            and self.graphs.agent_type(q.program_id) not in self.critical
        ]
        expected_idle_s = engine.forecast.expected_idle_s  # type: ignore[union-attr]
        pool.sort(key=lambda q: (self.static(q.program_id), -expected_idle_s(q, now)))
        return engine.tiers.enough(pool, need)

    # program events ---------------------------------------------------------------------
    def forget(self, program_id: str) -> None:
        self.graphs.forget(program_id)
        self._unpushed.pop(program_id, None)

    def describe(self, p: Program, view: dict[str, Any], now: float) -> None:
        """The program's app graph position, priorities and whether it is critical."""
        kind = self.graphs.agent_type(p.program_id)
        shape = self.graphs.shape(p.program_id)
        view["agent_type"] = kind
        view["depth"] = shape.depth if shape else None
        view["out_degree"] = shape.out_degree if shape else None
        view["priority"] = round(self.priority(p, now), 3)
        view["critical"] = kind in self.critical if kind else False

    def space_view(self) -> dict[str, Any]:
        """The critical types and each replica's pool (for the admin API)."""
        return {
            "critical": sorted(self.critical),
            "critical_promotions": self.critical_promotions,
            "replicas": {
                r: {"reserve_ratio": round(part.ratio, 4), "reserve_tokens": dict(part.reserve)}
                for r, part in self.partitions.items()
            },
        }
