"""The policy's vocabulary (DESIGN.md "Core concepts"): tiers, placements, moves, hints.

These are plain immutable values so the same decisions can be replayed by the live
router, the simulator and the tests without any I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Tier(StrEnum):
    """Where a program's KV cache is meant to live."""

    GPU = "gpu"  # per replica: KV in HBM, requests forwarded at once
    CPU = "cpu"  # per replica: KV in host DRAM, requests gated until promoted
    WAITING = "waiting"  # global: KV discarded, a promotion recomputes it


class Status(StrEnum):
    """Instantaneous status of a program (MORI 4.1).

    GATED is neither reasoning nor acting: a request is held by the gate, and that
    time counts toward no idleness term.
    """

    REASONING = "reasoning"
    ACTING = "acting"
    GATED = "gated"


class Hint(StrEnum):
    """Typed offload hint pushed to the engine for each program on a replica."""

    BUSY = "busy"  # GPU tier: keep on device, load back from host
    IDLE = "idle"  # CPU tier: drop the device copy, keep the host copy
    INACTIVE = "inactive"  # WAITING or ended: first to go on both tiers


def freeing_first(hints: Mapping[str, str]) -> list[tuple[str, Hint]]:
    """A batch's hints in the order an engine applies them: the busy ones last, so that a
    swap's load-back (the program let in) finds the device room its offload (the program
    let out) just freed, instead of failing for want of it and loading with the request;
    by program id within each group, the same order on every tensor-parallel rank."""
    return sorted(
        ((p, Hint(h)) for p, h in hints.items()), key=lambda ph: (ph[1] is Hint.BUSY, ph[0])
    )


class MoveReason(StrEnum):
    """Why a program changed tier; a label on the moves metric."""

    ADMIT = "admit"  # a request found room on arrival
    PROMOTE_CPU = "promote_cpu"  # class 1: CPU program with a pending request
    PROMOTE_WAITING = "promote_waiting"  # class 2: returning WAITING program
    PROMOTE_NEW = "promote_new"  # class 3: new program, smallest first
    PROMOTE_PREDICTED = "promote_predicted"  # ahead of a predicted tool end
    DEMOTE = "demote"  # GPU over budget, or swapped out by a busier program
    DEMOTE_LAZY = "demote_lazy"  # REASONING victim moved after its step
    OFFLOAD_TOOL = "offload_tool"  # offloaded at a tool call's start (benefit > cost)
    CPU_OVERFLOW = "cpu_overflow"  # CPU tier over budget: pushed to WAITING
    PAUSE = "pause"  # baseline pause (ThunderAgent): KV left to the engine
    RESUME = "resume"  # baseline resume
    DRAIN = "drain"  # replica failed: its programs go to WAITING
    END = "end"  # explicit end
    LEASE = "lease"  # idle lease expired


class Placement:
    """A tier plus the replica that holds it (None for WAITING).

    Immutable and interned: `Placement(tier, replica)` returns the one instance for that
    pair, so equality is identity and the policy's per-event dictionary lookups by
    placement hash and compare in C (constructing and hashing a dataclass per lookup was
    a tenth of the policy's cost per request)."""

    __slots__ = ("tier", "replica")
    _interned: dict[str | None, dict[Tier, Placement]] = {}

    tier: Tier
    replica: str | None

    def __new__(cls, tier: Tier, replica: str | None = None) -> Placement:
        by_tier = cls._interned.get(replica)
        if by_tier is not None and (place := by_tier.get(tier)) is not None:
            return place
        tier = Tier(tier)  # a tier may come by its value ("gpu"), as config and hints name it
        if (tier is Tier.WAITING) != (replica is None):
            raise ValueError(f"{tier.value} placement needs replica iff not WAITING")
        place = object.__new__(cls)
        object.__setattr__(place, "tier", tier)
        object.__setattr__(place, "replica", replica)
        cls._interned.setdefault(replica, {})[place.tier] = place
        return place

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Placement is immutable: cannot set {name}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Placement is immutable: cannot delete {name}")

    def __reduce__(self) -> tuple:
        return (Placement, (self.tier, self.replica))  # unpickled through the intern table

    def __repr__(self) -> str:
        return f"Placement(tier={self.tier!r}, replica={self.replica!r})"

    def __str__(self) -> str:
        return self.tier.value if self.replica is None else f"{self.tier.value}({self.replica})"


WAITING = Placement(Tier.WAITING)


@dataclass(frozen=True, slots=True)
class Move:
    """One program changing tier, with the reason (for metrics, logs and tests)."""

    program_id: str
    src: Placement
    dst: Placement
    reason: MoveReason

    @property
    def to_gpu(self) -> bool:
        return self.dst.tier is Tier.GPU and self.src.tier is not Tier.GPU


@dataclass(frozen=True, slots=True)
class EngineMode:
    """What the engine does under a policy: the simulator and emulator obey it.

    eviction: "lru" (stock SGLang) or "typed" (the MORI engine patch, ordered by hint).
    host_tier: whether HiCache's host DRAM tier is on.
    """

    eviction: str = "typed"
    host_tier: bool = True


@dataclass(frozen=True, slots=True)
class Segment:
    """A span of a prompt that an engine stores once per replica however many programs'
    contexts hold it (TokenDance's round-aware segments, exact mode).

    chain: id of the prompt up to and including this span: equal ids mean an identical
    prefix, the only sharing an engine's prefix cache does exactly (SGLang's radix tree).
    content: id of the span's own text: equal ids at different chains are the same blocks
    at different offsets (an All-Gather round's gathered outputs), which only approximate
    reuse could share.
    """

    chain: str
    content: str
    tokens: int


@dataclass(frozen=True, slots=True)
class ToolStart:
    """A tool call a program starts: the tool, the agent role running it, and the
    duration the client predicts for it (Tokencake's `predict_time`), if it says."""

    tool: str
    agent: str | None = None
    predict_s: float | None = None


@dataclass(frozen=True, slots=True)
class ReplicaCapacity:
    """Token budgets of one replica's two tiers."""

    gpu_tokens: int
    cpu_tokens: int


@dataclass(frozen=True, slots=True)
class AgentHints:
    """What a request says about itself (Dynamo's `nvext.agent_hints`, or MORI's headers).

    priority: among held requests of one promotion class, higher goes first (never ahead
    of a request the policy has aged into going first).
    osl: the output tokens the step is expected to produce: the growth its context will
    need, reserved instead of the program's last-step growth (None: not given).
    """

    priority: int = 0
    osl: int | None = None


NO_HINTS = AgentHints()
