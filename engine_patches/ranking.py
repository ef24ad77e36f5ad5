"""Type ranking: how a program's hint orders eviction victims and batch admission (MORI 4.3.2).

Both tiers evict inactive, then idle, then busy; a higher rank means "kept longer". The paper
evicts busy before idle on the host, on the grounds that a busy program's blocks are on device
anyway; but HiCache's host eviction only ever sees host-only nodes (`evict_host` skips nodes still
on device), so a busy program's host victim is its only copy, the one its busy hint is loading
back. Measured in the simulator: the paper's host order is ~1% slower (docs/policy.md).
A radix node shared by several programs takes its most protective type on that tier, so a shared
prefix (system prompt) is never evicted because one of its users went idle.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableSequence
from enum import StrEnum
from typing import TypeVar

from router.policy.types import Hint

T = TypeVar("T")

# A program the engine has no hint for yet just sent a request: treat it as busy until told.
DEFAULT_HINT = Hint.BUSY


class CacheTier(StrEnum):
    """The two HiCache tiers a radix node's KV can sit on."""

    DEVICE = "device"
    HOST = "host"


_TYPE_ORDER: dict[Hint, int] = {Hint.INACTIVE: 0, Hint.IDLE: 1, Hint.BUSY: 2}
_KEEP_RANK: dict[CacheTier, dict[Hint, int]] = {
    CacheTier.DEVICE: _TYPE_ORDER,
    CacheTier.HOST: _TYPE_ORDER,  # not the paper's inactive-busy-idle: see the module docstring
}

# Batch admission: busy first, then idle, then inactive (lower goes first).
_ADMIT_RANK: dict[Hint, int] = {Hint.BUSY: 0, Hint.IDLE: 1, Hint.INACTIVE: 2}


def keep_rank(tier: CacheTier, hints: Iterable[Hint]) -> int:
    """Rank of a node on `tier` given its programs' hints: the most protective one wins.

    A node no program touched (no session id) counts as DEFAULT_HINT.
    """
    ranks = _KEEP_RANK[tier]
    return max((ranks[h] for h in hints), default=ranks[DEFAULT_HINT])


def victim_key(tier: CacheTier, hints: Iterable[Hint], last_access: float) -> tuple[int, float]:
    """Eviction heap key, smallest evicted first: type rank, then LRU within a type."""
    return keep_rank(tier, hints), last_access


def admit_rank(hint: Hint | None) -> int:
    """Admission rank of a waiting request (lower enters the batch first)."""
    return _ADMIT_RANK[hint or DEFAULT_HINT]


def busy_first(queue: MutableSequence[T], hint_of: Callable[[T], Hint | None]) -> None:
    """Stable in-place re-sort: busy requests first, the engine's own order kept within a type."""
    queue.sort(key=lambda item: admit_rank(hint_of(item)))
