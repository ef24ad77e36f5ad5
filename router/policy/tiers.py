"""Tier bookkeeping: which program sits in which tier, and the tokens each tier holds.

Usage sums are kept incrementally so a fit check is O(1) even with 10 000 programs;
every placement change goes through `Tiers.place`, which keeps them exact.
"""

from __future__ import annotations

from collections.abc import Iterator

from router.policy.program import Program
from router.policy.types import WAITING, Placement, ReplicaCapacity, Tier


class Tiers:
    """Per-replica GPU and CPU tiers plus the global WAITING tier."""

    def __init__(self) -> None:
        self.capacity: dict[str, ReplicaCapacity] = {}
        self.healthy: dict[str, bool] = {}
        self._used: dict[Placement, int] = {}
        self._members: dict[Placement, dict[str, Program]] = {WAITING: {}}

    # replicas -----------------------------------------------------------------
    def add_replica(self, replica: str, capacity: ReplicaCapacity) -> None:
        self.capacity[replica] = capacity
        self.healthy[replica] = True
        for tier in (Tier.GPU, Tier.CPU):
            place = Placement(tier, replica)
            self._used.setdefault(place, 0)
            self._members.setdefault(place, {})

    def replicas(self, healthy_only: bool = True) -> list[str]:
        return [r for r in self.capacity if self.healthy[r] or not healthy_only]

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
            self._used[src] -= program.context_tokens
        self._members.setdefault(dst, {})[program.program_id] = program
        if dst.tier is not Tier.WAITING:
            self._used[dst] = self._used.get(dst, 0) + program.context_tokens
            program.last_replica = dst.replica
        program.placement = dst

    def remove(self, program: Program) -> None:
        """Forget an ended program."""
        self.place(program, WAITING)
        self._members[WAITING].pop(program.program_id, None)

    def resize(self, program: Program, tokens: int) -> None:
        """Change a program's context size, keeping its tier's sum exact."""
        if program.placement.tier is not Tier.WAITING:
            self._used[program.placement] += int(tokens) - program.context_tokens
        program.context_tokens = int(tokens)
