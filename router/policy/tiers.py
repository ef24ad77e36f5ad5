"""Tier bookkeeping: which program sits in which tier, and the tokens each tier holds.

Usage sums are kept incrementally so a fit check is O(1) even with 10 000 programs;
every placement change goes through `Tiers.place`, which keeps them exact.

Shared segments (`Program.shared`: an agent role's anchor, a round's system prompt and
scenario) are stored once per replica by the engine, so a tier counts each once however
many of its programs hold it: a tier's use is the sum of its programs' contexts less
(holders - 1) x tokens for every segment held by more than one of them. What a program
frees by leaving (`freed_by`) and needs by arriving (`need`) follow from it; a policy that
counts a victim's whole context as freed over-frees, one that counts a newcomer's whole
context as needed under-fills (safe).
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

from router.policy.program import Program
from router.policy.types import WAITING, Placement, ReplicaCapacity, Segment, Tier


class Tiers:
    """Per-replica GPU and CPU tiers plus the global WAITING tier."""

    def __init__(self) -> None:
        self.capacity: dict[str, ReplicaCapacity] = {}
        self.healthy: dict[str, bool] = {}
        self._used: dict[Placement, int] = {}
        self._members: dict[Placement, dict[str, Program]] = {WAITING: {}}
        self._holders: dict[Placement, Counter[str]] = {}  # segment chain id -> programs
        # replica -> its GPU and CPU tiers: the hot paths' look-ups, without a Placement call
        self.gpu_place: dict[str, Placement] = {}
        self.cpu_place: dict[str, Placement] = {}

    # replicas -----------------------------------------------------------------
    def add_replica(self, replica: str, capacity: ReplicaCapacity) -> None:
        self.capacity[replica] = capacity
        self.healthy[replica] = True
        self.gpu_place[replica] = Placement(Tier.GPU, replica)
        self.cpu_place[replica] = Placement(Tier.CPU, replica)
        for tier in (Tier.GPU, Tier.CPU):
            place = Placement(tier, replica)
            self._used.setdefault(place, 0)
            self._members.setdefault(place, {})

    def replicas(self, healthy_only: bool = True) -> list[str]:
        return [r for r in self.capacity if self.healthy[r] or not healthy_only]

    def gpu_free(self) -> dict[str, int]:
        """Free GPU room per healthy replica (`free` of each GPU tier, in one pass: every
        promotion pass starts from it)."""
        used, gpu = self._used, self.gpu_place
        return {
            r: cap.gpu_tokens - used.get(gpu[r], 0)
            for r, cap in self.capacity.items()
            if self.healthy[r]
        }

    # membership ----------------------------------------------------------------
    def members(self, place: Placement) -> Iterator[Program]:
        return iter(list(self._members.get(place, {}).values()))

    def count(self, place: Placement) -> int:
        return len(self._members.get(place, {}))

    def used(self, place: Placement) -> int:
        return self._used.get(place, 0)

    def budget(self, place: Placement) -> int:
        if place.tier is Tier.WAITING:
            return 2**62
        cap = self.capacity[place.replica]  # type: ignore[index]
        return cap.gpu_tokens if place.tier is Tier.GPU else cap.cpu_tokens

    def free(self, place: Placement) -> int:
        return self.budget(place) - self.used(place)

    def fits(self, place: Placement, tokens: int) -> bool:
        return place.tier is Tier.WAITING or tokens <= self.free(place)

    def place(self, program: Program, dst: Placement) -> None:
        """Move `program` to `dst`, keeping usage sums exact."""
        src = program.placement
        self._members.setdefault(src, {}).pop(program.program_id, None)
        if src.tier is not Tier.WAITING:
            self._leave(program, src)
        self._members.setdefault(dst, {})[program.program_id] = program
        if dst.tier is not Tier.WAITING:
            self._enter(program, dst)
            program.last_replica = dst.replica
        program.placement = dst

    def remove(self, program: Program) -> None:
        """Forget an ended program."""
        self.place(program, WAITING)
        self._members[WAITING].pop(program.program_id, None)

    def resize(self, program: Program, tokens: int) -> None:
        """Change a program's context size, keeping its tier's sum exact. When its shared
        segments all still fit (every step but a shrink), only the size changes: the sum
        moves by the difference, without re-counting the segments (every request does this)."""
        tokens = int(tokens)
        if _within(program.shared, tokens) is not program.shared:
            self._reaccount(program, lambda: setattr(program, "context_tokens", tokens))
            return
        if program.placement.tier is not Tier.WAITING:
            self._used[program.placement] += tokens - program.context_tokens
        program.context_tokens = tokens

    def share(self, program: Program, segments: Sequence[Segment]) -> None:
        """The leading segments of the program's context that others may hold too (chain
        order; cut where they would exceed its context), in runs (`coarsen`)."""
        runs = coarsen(segments)
        if runs != program.shared:  # a program's next prompt mostly has the same runs
            self._reaccount(program, lambda: setattr(program, "shared", runs))

    # shared segments ---------------------------------------------------------------
    def freed_by(self, program: Program) -> int:
        """Tokens its tier's use drops by if `program` leaves (its segments other members
        still hold stay)."""
        if not program.shared:  # most programs: nothing another could hold
            return program.context_tokens
        holders = self._holders.get(program.placement)
        if holders is None:
            return program.context_tokens
        kept = sum(s.tokens for s in program.shared if holders[s.chain] > 1)
        return program.context_tokens - kept

    def need(self, program: Program, place: Placement) -> int:
        """Tokens `place`'s use grows by if `program` joins it (segments held there count
        once); its own context if it is there already."""
        holders = self._holders.get(place)
        if program.placement == place or holders is None:
            return program.context_tokens
        return program.context_tokens - sum(s.tokens for s in program.shared if holders[s.chain])

    def least_need(self, program: Program) -> int:
        """The least `need` of `program` anywhere: its context less every shared segment
        (a pass skips a held request that fits in no room at that)."""
        if not program.shared:
            return program.context_tokens
        return program.context_tokens - sum(s.tokens for s in program.shared)

    def enough(self, victims: Iterable[Program], tokens: int) -> list[Program]:
        """The first `victims` (in order) whose leaving frees `tokens`, or [] if all of
        them would not (a partial move would be churn for nothing)."""
        chosen, freed = [], 0
        for q in victims:
            if freed >= tokens:
                break
            chosen.append(q)
            freed += self.freed_by(q)
        return chosen if freed >= tokens else []

    def holders(self, place: Placement, chain: str) -> int:
        """How many programs of `place` hold the segment `chain`."""
        holders = self._holders.get(place)
        return holders[chain] if holders is not None else 0

    def _reaccount(self, program: Program, change) -> None:
        """Apply `change` to the program with its tier's sums taken out and put back."""
        place = program.placement
        placed = place.tier is not Tier.WAITING
        if placed:
            self._leave(program, place)
        change()
        program.shared = _within(program.shared, program.context_tokens)
        if placed:
            self._enter(program, place)

    def _holders_at(self, place: Placement) -> Counter[str]:
        """The place's segment holders (not `setdefault`: that built a Counter per call)."""
        holders = self._holders.get(place)
        if holders is None:
            holders = self._holders[place] = Counter()
        return holders

    def _enter(self, program: Program, place: Placement) -> None:
        holders = self._holders_at(place)
        used = program.context_tokens
        for s in program.shared:
            holders[s.chain] += 1
            if holders[s.chain] > 1:
                used -= s.tokens
        self._used[place] = self._used.get(place, 0) + used

    def _leave(self, program: Program, place: Placement) -> None:
        holders = self._holders_at(place)
        freed = program.context_tokens
        for s in program.shared:
            holders[s.chain] -= 1
            if holders[s.chain] > 0:
                freed -= s.tokens
            else:
                del holders[s.chain]
        self._used[place] -= freed


RUN_MASK = 0xF  # a run ends at a segment whose chain id's CRC-32 is 0 here: ~16 segments a run
SINGLE = 8  # the first segments are runs of their own (tools, system prompt, scenario...)


def coarsen(segments: Sequence[Segment]) -> tuple[Segment, ...]:
    """Consecutive segments merged into runs, for accounting in O(runs) per move: a run is
    named by the chain id of its last segment (so equal runs are an equal prefix) and ends
    where the content says (a segment whose chain id's CRC-32 is 0 under `RUN_MASK`: the same
    boundaries in every prompt that shares the prefix), after each of the first `SINGLE`
    segments (the tools, system prompt and scenario a prompt starts with are what is shared
    most), and at the end. A prefix two programs share is counted once up to its last run
    boundary."""
    runs: list[Segment] = []
    tokens = 0
    for i, s in enumerate(segments):
        tokens += s.tokens
        last = i == len(segments) - 1
        if i < SINGLE or last or zlib.crc32(s.chain.encode()) & RUN_MASK == 0:
            runs.append(Segment(s.chain, s.content, tokens))
            tokens = 0
    return tuple(runs)


def _within(segments: tuple[Segment, ...], tokens: int) -> tuple[Segment, ...]:
    """The leading segments that fit in `tokens` (a context never holds less than its
    shared prefix: an estimate that says so is cut)."""
    total = 0
    for i, s in enumerate(segments):
        total += s.tokens
        if total > tokens:
            return segments[:i]
    return segments
