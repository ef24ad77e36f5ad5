"""MORI's placement policy (MORI 4.3.1): idleness-ranked tiers with sticky moves.

Per replica r a GPU(r) and a CPU(r) tier, one global WAITING tier. Every rule here is
a rule of the paper; the choices the paper leaves open are explained in docs/policy.md.

* Demotion (tick, or a GPU tier over budget after a step): ACTING victims before
  REASONING ones, most idle first. A REASONING victim is only marked and moves after its
  step (`Program.demote_after_step`), but its tokens count as freed at once, so one
  overflow marks exactly the victims it needs. Victims go to CPU(r) if it fits, else
  WAITING.
* CPU overflow: the most idle CPU programs fall to WAITING.
* Promotion into free room, by class: (1) CPU programs with a request (they keep their
  replica), (2) returning WAITING programs with a request, (3) new programs, smallest
  first; least idle first within a class. WAITING promotions are packed by size
  decreasing onto the program's last replica when it fits, else the replica with the
  most room.
* Growth reserve (ours; see docs/policy.md): promotions leave free, per replica, the
  last-step context growth of its REASONING programs, so their steps' growth does not
  overflow a brim-full tier and force a demotion (and a promotion back) per step.
* Stickiness: nothing moves without a capacity violation, or a phase mismatch: a
  class-1/2 request that does not fit may displace ACTING GPU programs of its target
  replica that are more idle than it by at least `hysteresis`.
* Immediate admission: an arrival runs the same promotion pass (without displacement),
  so a request that fits never waits for a tick, and never jumps a higher class.
* Aging (our addition, not in the paper; `aging_s`, 0 turns it off): a request held at
  the gate for `aging_s` goes before every class, oldest first, and at a tick may swap
  out ACTING programs whatever their idleness, so no program starves behind busier ones.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import replace
from itertools import count

from router.policy.base import Policy, PolicyConfig
from router.policy.program import Program
from router.policy.types import WAITING, Move, MoveReason, Placement, Status, Tier

Idleness = Callable[[Program], float]
Classes = tuple[list[Program], list[Program], list[Program]]  # on CPU, returning, new


def _memo_idleness(now: float) -> Idleness:
    """Idleness at `now`, computed once per program per pass (a pass ranks many times)."""
    cache: dict[str, float] = {}

    def idleness(p: Program) -> float:
        value = cache.get(p.program_id)
        if value is None:
            value = cache[p.program_id] = p.idleness(now)
        return value

    return idleness


class MoriPaperPolicy(Policy):
    """Idleness-driven GPU/CPU/WAITING tiering as the paper states it (`mori-paper`, the
    first step of the ablation; the default policy is `mori`, router.policy.mori)."""

    name = "mori-paper"
    default_aging_s = 0.0  # the paper has no aging; `aging_s` turns ours on
    CPU_MAY_LEAVE_HOME = False  # a CPU-tier request only ever goes back to its own replica

    @property
    def aging_s(self) -> float:
        """How long a held request waits before it goes first (0: never)."""
        configured = self.config.aging_s
        return self.default_aging_s if configured is None else configured

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self._context_after: dict[str, int] = {}  # context after each program's last step
        self._growth: dict[str, int] = {}  # context growth of its last step (tokens)
        # REASONING GPU programs per replica, kept incrementally (every event's pass asks):
        # their number and their growth summed (promotion_reserve)
        self._reserved: dict[str, tuple[str, int]] = {}  # program -> (replica, tokens)
        self._reserve: dict[str, int] = {}
        self._reasoning: dict[str, int] = {}
        self._smallest = _SmallestHeld()

    def promotion_reserve(self, replica: str) -> int:
        """Room promotions leave free on GPU(replica): the last-step growth of its
        REASONING programs, i.e. what the tier will grow by when their steps end.

        Agent contexts grow every step (tool result + output). A tier packed to the brim
        overflows at the next step end, and the demotion that fixes a ~1k-token overflow
        moves a whole ~50k-token program, whose room the gate refills at once: one swap
        per step (generated corpus, 80 programs: ~580 demotions/h, most victims back
        within 1 s, 17% of prompt tokens recomputed). Demotion still triggers only above
        the budget, so the reserve is a band between the promotion and the demotion
        watermarks. ACTING programs reserve nothing: most idle ones are the victims, and
        reserving for them held GPU room empty on the idle-heavy Claude Code sample.
        """
        return self.growth_band(replica)

    def growth_band(self, replica: str) -> int:
        """The last-step growth of GPU(replica)'s REASONING programs, summed (the part of
        `promotion_reserve` that is MORI's; other policies add reservations of their own)."""
        return self._reserve.get(replica, 0)

    def leave_free(self, replica: str, now: float) -> int:
        """Room a promotion pass leaves free on GPU(replica) at `now`: the reserve (a hook:
        `mori` waives the part of the growth band that idle programs would absorb)."""
        return self.promotion_reserve(replica)

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
            growth = self._step_growth(p)
            self._reserved[p.program_id] = (replica, growth)
            self._reserve[replica] = self._reserve.get(replica, 0) + growth
            self._reasoning[replica] = self._reasoning.get(replica, 0) + 1

    def _step_growth(self, p: Program) -> int:
        """The growth `p`'s running step reserves: the output length its request announced
        (agent hint `osl`), else the growth of its last step."""
        return p.osl if p.osl is not None else self._growth.get(p.program_id, 0)

    def _move(self, p: Program, dst: Placement, reason: MoveReason, now: float) -> Move:
        move = super()._move(p, dst, reason, now)
        self._sync_reserve(p)
        if p.pending:  # a held request changed where it can be promoted to
            self._smallest.push(p)
        return move

    def _start(self, p: Program, now: float) -> None:
        super()._start(p, now)
        self._sync_reserve(p)

    # events ---------------------------------------------------------------------------
    def _admit(self, p: Program, now: float) -> list[Move]:
        if p.placement.tier is Tier.GPU:
            self._release(p, now)
            # its new prompt may share more with the tier than its last (Tiers.share): room
            # a held request can use at once (the fast path answers in O(replicas) if none)
            return self._promote(now)
        self._smallest.push(p)
        return [
            replace(m, reason=MoveReason.ADMIT) if m.program_id == p.program_id else m
            for m in self._promote(now)
        ]

    def _after_response(self, p: Program, now: float) -> list[Move]:
        """A step ended: its context may have grown past the budget, and a lazy demotion
        may have freed room that waiting requests can use right away."""
        before = self._context_after.get(p.program_id)
        self._context_after[p.program_id] = p.context_tokens
        if before is not None:
            self._growth[p.program_id] = max(0, p.context_tokens - before)
        self._sync_reserve(p)  # acting now: no longer reserving
        moves = self._demote(p.placement.replica, now) if p.placement.tier is Tier.GPU else []
        return moves + self._promote(now)

    def end(self, program_id: str, now: float, reason: MoveReason = MoveReason.END) -> list[Move]:
        """An ended program's room goes to the gate at once, not at the next tick. The pass
        runs even when the end freed nothing: time has passed, and a held request may have
        waited long enough to leave its replica (`mori`'s ski rental) since the last one."""
        p = self.programs.get(program_id)
        moves = super().end(program_id, now, reason)
        if p is not None:
            self._sync_reserve(p)  # forgotten: its share goes
        self._context_after.pop(program_id, None)
        self._growth.pop(program_id, None)
        return moves + self._promote(now) if p is not None else moves

    def set_healthy(self, replica: str, healthy: bool, now: float) -> list[Move]:
        """A drained replica's held requests are re-placed on healthy replicas at once."""
        moves = super().set_healthy(replica, healthy, now)
        return moves if healthy else moves + self._promote(now)

    def _rebalance(self, now: float) -> list[Move]:
        moves: list[Move] = []
        for r in self.tiers.replicas():
            moves += self._demote(r, now)
            moves += self._cpu_overflow(r, now)
        return moves + self._promote(now, displace=True)

    def _ranking(self, now: float) -> Idleness:
        """The idleness that ranks victims and candidates in one pass (a hook: mori
        ranks programs it promoted ahead of a predicted tool end as least idle)."""
        return _memo_idleness(now)

    # demotion -------------------------------------------------------------------------
    def _demote(self, replica: str | None, now: float) -> list[Move]:
        """Bring GPU(replica) back within budget, counting lazily demoted tokens as freed.

        Marks are recomputed from scratch each time: a mark that is no longer needed
        (room came back before the step ended) is dropped, which is the sticky choice.
        """
        if replica is None:
            return []
        gpu = Placement(Tier.GPU, replica)
        excess = self.tiers.used(gpu) - self.tiers.budget(gpu)
        self._clear_marks(replica)
        if excess <= 0:
            return []
        idleness = self._ranking(now)
        members = list(self.tiers.members(gpu))
        acting = sorted(
            (p for p in members if p.status is Status.ACTING), key=idleness, reverse=True
        )
        cpu = Placement(Tier.CPU, replica)
        moves = []
        for p in acting:
            if excess <= 0:
                break
            excess -= self.tiers.freed_by(p)
            moves.append(self._move(p, self._fit_or_waiting(cpu, p), MoveReason.DEMOTE, now))
        reasoning = sorted(
            (p for p in members if p.status is Status.REASONING), key=idleness, reverse=True
        )
        for p in reasoning:
            if excess <= 0:
                break
            excess -= self.tiers.freed_by(p)
            self._mark_lazy(p, cpu)
        return moves

    def _cpu_overflow(self, replica: str, now: float) -> list[Move]:
        """CPU(replica) over budget (capacity shrank): most idle programs go to WAITING."""
        cpu = Placement(Tier.CPU, replica)
        excess = self.tiers.used(cpu) - self.tiers.budget(cpu)
        if excess <= 0:
            return []
        moves = []
        for p in sorted(self.tiers.members(cpu), key=self._ranking(now), reverse=True):
            if excess <= 0:
                break
            excess -= self.tiers.freed_by(p)
            moves.append(self._move(p, WAITING, MoveReason.CPU_OVERFLOW, now))
        return moves

    # promotion ------------------------------------------------------------------------
    def _promote(self, now: float, displace: bool = False) -> list[Move]:
        """Promote held requests into free GPU room, class by class (MORI 4.3.1).

        `displace` (tick only) lets a class-1/2 request that does not fit swap out clearly
        more idle ACTING programs; arrivals and responses never move anyone else.
        """
        if not self._held or not self.tiers.replicas():
            return []
        return self._promote_into(self._free_room(now), now, displace)

    def _free_room(self, now: float) -> dict[str, int]:
        """GPU room per replica a promotion pass may fill: free room less what the pass
        leaves free (`leave_free`). Only a move changes it within an event, so a pass that
        moved nothing hands its map on (`PricedPolicy._promote`): `leave_free` prices idle
        programs per replica and is an event's dearest set-up while a request is held."""
        return {
            r: self.tiers.free(Placement(Tier.GPU, r)) - self.leave_free(r, now)
            for r in self.tiers.replicas()
        }

    def _promote_into(self, free: dict[str, int], now: float, displace: bool) -> list[Move]:
        """The pass of `_promote` into `free` (`_free_room`, updated as it places)."""
        if not displace and not self._smallest.any_fits(free, self.CPU_MAY_LEAVE_HOME):
            return []  # fast path (every event): no held request fits anywhere
        held = self._held_programs()
        if displace:
            self._smallest.rebuild(held)  # drop the entries of requests that left
        else:  # only candidates that fit are ranked
            widest = max(free.values())
            held = [p for p in held if self._may_fit(p, free, widest, now)]
            if not held:
                return []
        idleness = self._ranking(now)
        victims = _VictimPool(self, idleness, self.config.hysteresis)
        moves: list[Move] = []
        held, swaps = self._promote_aged(held, free, victims, now, displace, moves)
        on_cpu, returning, new = [], [], []
        for p in held:
            if p.placement.tier is Tier.CPU and not self._may_leave_home(p, now):
                if p.placement.replica in free:
                    on_cpu.append(p)
            elif p.steps > 0:
                returning.append(p)
            else:
                new.append(p)
        self._order_classes((on_cpu, returning, new), idleness, now)
        for group in (on_cpu, returning, new):  # the client's priority first (agent hints);
            group.sort(key=_by_priority)  # stable: the policy's order among equals
        for p in on_cpu:
            if not self._place_cpu(p, free, now, moves) and displace:
                r = p.placement.replica
                swap = self._displace(p, r, free, victims, MoveReason.PROMOTE_CPU, now)
                swaps += bool(swap)
                moves += swap
        unplaced = self._pack_waiting(returning + new, free, now, moves)
        if displace:
            packed = len(moves)
            self._swap_returning([p for p in unplaced if p.steps > 0], free, victims, now, moves)
            swaps += len(moves) > packed
        if swaps:  # a swap may free more than it took, also where earlier requests wait
            moves += self._promote(now)
        return moves

    def _order_classes(self, classes: Classes, idleness: Idleness, now: float) -> None:
        """Sort each class in place into the order a pass offers it room (a hook: the
        space scheduler puts its hybrid priority first): least idle first in classes 1
        and 2, smallest first in class 3."""
        on_cpu, returning, new = classes
        on_cpu.sort(key=idleness)
        returning.sort(key=idleness)
        new.sort(key=lambda p: (p.context_tokens, idleness(p)))

    def _promote_aged(
        self,
        held: list[Program],
        free: dict[str, int],
        victims: _VictimPool,
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
            place = self._place_cpu if on_cpu else self._place_waiting
            if not place(p, free, now, moves) and displace:
                reason = MoveReason.PROMOTE_CPU if on_cpu else MoveReason.PROMOTE_WAITING
                if not on_cpu and p.steps == 0:
                    reason = MoveReason.PROMOTE_NEW
                tries = [p.placement.replica] if on_cpu else _affine_first(p, free)
                for r in tries:
                    swap = self._displace(p, r, free, victims, reason, now, aged=True)
                    if swap:
                        swaps += 1
                        moves += swap
                        break
        return [p for p in held if p.pending], swaps

    def _pack_waiting(
        self, ranked: list[Program], free: dict[str, int], now: float, moves: list[Move]
    ) -> list[Program]:
        """Best-Fit-Decreasing of WAITING requests; returns those left unplaced (ranked).

        Selection follows priority (`ranked`): a prefix-like pick of what fits in the total
        free room. The picked set is then placed largest first; a backfill pass in priority
        order places whatever fragmentation left out, so after a pass no held request
        that fits anywhere is left behind.
        """
        total = sum(max(0, f) for f in free.values())
        picked = []
        for p in ranked:
            if p.context_tokens <= total:
                total -= p.context_tokens
                picked.append(p)
        placed: set[str] = set()
        for p in sorted(picked, key=lambda p: p.context_tokens, reverse=True):
            if self._place_waiting(p, free, now, moves):
                placed.add(p.program_id)
        left = []
        for p in ranked:
            if p.program_id not in placed and not self._place_waiting(p, free, now, moves):
                left.append(p)
        return left

    def _place_cpu(self, p: Program, free: dict[str, int], now: float, moves: list[Move]) -> bool:
        """Back onto its own replica's GPU tier if it fits there (the KV is in its host tier)."""
        r = p.placement.replica
        need = self.tiers.need(p, Placement(Tier.GPU, r))  # shared segments held there: once
        if need > free[r]:
            return False
        free[r] -= need
        moves.append(self._move(p, Placement(Tier.GPU, r), MoveReason.PROMOTE_CPU, now))
        return True

    def _place_waiting(
        self, p: Program, free: dict[str, int], now: float, moves: list[Move]
    ) -> bool:
        """The first of its target replicas it fits on (`_replicas_for`: the paper's last
        replica, whose host tier may still hold the KV, then the one with most room); what it
        needs there counts the shared segments the replica holds already once (Tiers.need)."""
        for r in self._replicas_for(p, free, now):
            need = self.tiers.need(p, Placement(Tier.GPU, r))
            if need <= free[r]:
                free[r] -= need
                reason = MoveReason.PROMOTE_WAITING if p.steps > 0 else MoveReason.PROMOTE_NEW
                moves.append(self._move(p, Placement(Tier.GPU, r), reason, now))
                return True
        return False

    def _swap_returning(
        self,
        ranked: list[Program],
        free: dict[str, int],
        victims: _VictimPool,
        now: float,
        moves: list[Move],
    ) -> None:
        """Class-2 swaps, least idle first, on the last replica first, then the roomiest.

        Thresholds only rise along `ranked`, so the first request that clears no
        replica's most idle victim ends the search for all that follow.
        """
        order = sorted(free, key=free.__getitem__, reverse=True)
        for p in ranked:
            if victims.threshold(p) > victims.most_idle(order):
                return
            for r in self._swap_replicas(p, free, now):
                swap = self._displace(p, r, free, victims, MoveReason.PROMOTE_WAITING, now)
                if swap:
                    moves += swap
                    order.sort(key=free.__getitem__, reverse=True)
                    break

    def _replicas_for(self, p: Program, free: dict[str, int], now: float) -> list[str]:
        """Replicas a held WAITING (or home-leaving CPU) request may be placed on, in the
        order tried (a hook: `mori-priced` keeps a returning program on its own replica)."""
        return _affine_first(p, free)

    def _swap_replicas(self, p: Program, free: dict[str, int], now: float) -> list[str]:
        """Replicas a class-2 swap may make room on for `p`, in the order tried (a hook:
        `mori-priced` swaps only on the program's own replica)."""
        return self._replicas_for(p, free, now)

    def _may_leave_home(self, p: Program, now: float) -> bool:
        """Whether a held CPU-tier request may be placed on another replica than the one
        holding its KV (the paper: never; a hook for `mori-priced`, which then sets
        `CPU_MAY_LEAVE_HOME`)."""
        return False

    def _may_fit(self, p: Program, free: dict[str, int], widest: int, now: float) -> bool:
        """Whether a held request fits room a promotion pass may give it: a WAITING one the
        widest; a CPU-tier one its own replica's, or, once it may leave home, the widest
        (cheap tests first: whether it may leave prices a recompute per replica)."""
        if p.placement.tier is not Tier.CPU:
            return p.context_tokens <= widest
        if p.context_tokens <= free.get(p.placement.replica, -1):  # type: ignore[arg-type]
            return True
        return (
            self.CPU_MAY_LEAVE_HOME and p.context_tokens <= widest and self._may_leave_home(p, now)
        )

    def _displace(
        self,
        p: Program,
        replica: str,
        free: dict[str, int],
        victims: _VictimPool,
        reason: MoveReason,
        now: float,
        aged: bool = False,
    ) -> list[Move]:
        """Phase mismatch: swap `p` in for clearly more idle ACTING programs, or do nothing
        (an aged request swaps out the most idle ACTING ones, with no hysteresis bar)."""
        chosen = victims.take(replica, p, p.context_tokens - free[replica], aged)
        if not chosen:
            return []
        gpu = Placement(Tier.GPU, replica)
        before = self.tiers.used(gpu)  # the change, not a sum: shared segments count once
        moves = [self._move(p, gpu, reason, now)]
        cpu = Placement(Tier.CPU, replica)
        for v in chosen:  # after p left CPU(replica), so its room is usable by victims
            moves.insert(-1, self._move(v, self._fit_or_waiting(cpu, v), MoveReason.DEMOTE, now))
        free[replica] -= self.tiers.used(gpu) - before
        return moves


def _by_priority(p: Program) -> int:
    """Sort key: the request's agent-hint priority, highest first."""
    return -p.priority


def _affine_first(p: Program, free: dict[str, int]) -> list[str]:
    """Replicas to try for a WAITING program: its last one first, then the roomiest."""
    order = sorted(free, key=free.__getitem__, reverse=True)
    return [p.last_replica, *order] if p.last_replica in free else order


class _VictimPool:
    """ACTING GPU programs per replica, most idle first, built on first use in a pass.

    With token prefix sums, "the fewest most-idle victims freeing `needed` tokens, all
    clearing the hysteresis bar" is one bisection, so hundreds of held requests can each
    try every replica in a tick.
    """

    def __init__(self, policy: MoriPaperPolicy, idleness: Idleness, hysteresis: float) -> None:
        self._policy = policy
        self._idleness = idleness
        self._hysteresis = hysteresis
        self._pools: dict[str, tuple[list[Program], list[float], list[int]]] = {}
        self._start: dict[str, int] = {}  # victims before this index were taken already

    def _pool(self, replica: str) -> tuple[list[Program], list[float], list[int]]:
        pool = self._pools.get(replica)
        if pool is None:
            gpu = Placement(Tier.GPU, replica)
            ranked = sorted(
                (
                    (self._idleness(q), q)
                    for q in self._policy.tiers.members(gpu)
                    if q.status is Status.ACTING
                ),
                key=lambda e: e[0],
                reverse=True,
            )
            prefix = [0]
            for _, q in ranked:
                prefix.append(prefix[-1] + self._policy.tiers.freed_by(q))
            pool = self._pools[replica] = ([q for _, q in ranked], [i for i, _ in ranked], prefix)
            self._start[replica] = 0
        return pool

    def threshold(self, p: Program) -> float:
        """The idleness a victim needs for `p` to swap it out (the hysteresis bar)."""
        return self._idleness(p) + self._hysteresis

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


class _SmallestHeld:
    """The smallest held request per place a promotion may take it from (WAITING: onto any
    replica; CPU(r): onto r), so an event tells in O(replicas) whether any held request
    fits, instead of scanning every held request (10 000 programs: ~1 500 held).

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
        self._heaps = {}
        for p in held:
            self.push(p)

    def smallest(self, key: str | None) -> int | None:
        heap = self._heaps.get(key)
        while heap:
            tokens, _, p = heap[0]
            fresh = p.pending and tokens == p.context_tokens and self._key(p) == key
            if fresh and p.placement.tier is not Tier.GPU:
                return tokens
            heapq.heappop(heap)
        return None

    def any_fits(self, free: dict[str, int], cpu_anywhere: bool = False) -> bool:
        """Whether some held request may fit: WAITING ones in the widest room, CPU(r) ones
        in r's (in the widest too with `cpu_anywhere`: they may leave home after a wait,
        which the full pass checks)."""
        widest = max(free.values())
        waiting = self.smallest(None)
        if waiting is not None and waiting <= widest:
            return True
        return any(
            (c := self.smallest(r)) is not None and c <= (widest if cpu_anywhere else f)
            for r, f in free.items()
        )
