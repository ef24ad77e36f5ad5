"""Program state and windowed idleness (MORI 4.1-4.2).

Idleness = acting / (acting + reasoning) over the last W reasoning-acting cycles,
the ongoing interval included, so a long tool call raises it while it runs. Time a
request spends held by the gate is excluded from both terms: it measures the
scheduler, not the program.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from router.policy.types import WAITING, Placement, Segment, Status


@dataclass(slots=True)
class Program:
    """Everything the policy knows about one program. Mutated only by the policy."""

    program_id: str
    created_s: float
    window: int = 4
    context_tokens: int = 0
    status: Status = Status.ACTING
    placement: Placement = WAITING
    last_replica: str | None = None  # replica holding its most recently computed KV
    steps: int = 0  # completed steps; 0 means "new"
    pending: bool = False  # a request is held by the gate
    interval_start: float = 0.0  # start of the ongoing REASONING or ACTING interval
    last_active_s: float = 0.0  # last request or response, for the idle lease
    demote_after_step: Placement | None = None  # lazy demotion target
    reasoning_s: float = 0.0  # reasoning time of the cycle in progress
    cycles: deque[tuple[float, float]] = field(default_factory=deque)  # (reasoning, acting)
    # leading spans of its context other programs may hold too (an anchor, a round's shared
    # prompt): the tiers count each once per placement (`Tiers.share`)
    shared: tuple[Segment, ...] = ()
    # its current request's agent hints (router.policy.types.AgentHints)
    priority: int = 0  # higher goes first within its promotion class
    osl: int | None = None  # expected output tokens: the growth its step reserves
    # (reasoning, acting) summed over all cycles, and over those still in the window while
    # a cycle is ongoing; None when `cycles` changed. Ranking 10 000 programs per tick
    # needs idleness in O(1), not O(W).
    _sums: tuple[float, float, float, float] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError("idleness window must be >= 1 cycle")
        self.cycles = deque(self.cycles, maxlen=self.window)
        self.interval_start = self.created_s
        self.last_active_s = self.created_s

    @property
    def is_new(self) -> bool:
        return self.steps == 0

    def idleness(self, now: float) -> float:
        """Share of recent time spent acting, in [0, 1]; 0 for a program with no history."""
        sums = self._sums if self._sums is not None else self._window_sums()
        if self.status is Status.GATED:
            reasoning, acting = sums[0], sums[1]
        else:
            reasoning, acting = sums[2], sums[3]
            elapsed = now - self.interval_start
            elapsed = elapsed if elapsed > 0.0 else 0.0
            if self.status is Status.REASONING:
                reasoning += elapsed
            elif self.steps > 0:  # a new program has not started acting yet
                reasoning += self.reasoning_s
                acting += elapsed
        total = reasoning + acting
        return acting / total if total > 0 else 0.0

    def engine_share(self, now: float, round_trip_s: float) -> float:
        """Share of recent time the engine ran this program: its reasoning share less
        `round_trip_s` per step of the window. The router counts a step from the gate
        letting it in to the answer coming back; a replica a round trip away ran it that
        much less (1 - idleness with none; a program with no history counts whole)."""
        busy = 1.0 - self.idleness(now)
        if round_trip_s <= 0.0 or self.steps == 0:
            return busy
        sums = self._sums if self._sums is not None else self._window_sums()
        steps = min(len(self.cycles), self.window - 1) + 1  # the window's, this one's too
        mean = (sums[2] + self.reasoning_s) / steps
        return busy * max(0.0, 1.0 - round_trip_s / mean) if mean > 0.0 else busy

    def _window_sums(self) -> tuple[float, float, float, float]:
        """Cycle sums; the oldest cycle leaves the window while a new one is under way."""
        all_r = sum(r for r, _ in self.cycles)
        all_a = sum(a for _, a in self.cycles)
        if len(self.cycles) == self.window:
            tail = list(self.cycles)[1:]
            sums = (all_r, all_a, sum(r for r, _ in tail), sum(a for _, a in tail))
        else:
            sums = (all_r, all_a, all_r, all_a)
        self._sums = sums
        return sums

    def arrive(self, now: float) -> None:
        """A request arrived: close the acting interval; the gate holds it for now.

        Context sizes are changed through `Tiers.resize`, which keeps tier sums exact.
        """
        if self.steps > 0 and self.status is Status.ACTING:
            self.cycles.append((self.reasoning_s, max(0.0, now - self.interval_start)))
            self._sums = None
        self.status = Status.GATED
        self.pending = True
        self.last_active_s = now

    def start_reasoning(self, now: float) -> None:
        """The gate let the request through: gated time ends here, reasoning starts."""
        self.status = Status.REASONING
        self.pending = False
        self.interval_start = now

    def finish_step(self, now: float) -> None:
        """The engine answered: the program is acting (in a tool call) from now."""
        self.reasoning_s = max(0.0, now - self.interval_start)
        self.status = Status.ACTING
        self.interval_start = now
        self.last_active_s = now
        self.steps += 1

    def cancel_request(self, now: float) -> None:
        """A gated request gave up (timeout, client gone): back to acting, gate time excluded."""
        if self.status is not Status.GATED:
            return
        self.pending = False
        self.status = Status.ACTING
        acted = 0.0
        if self.steps > 0 and self.cycles:
            self.reasoning_s, acted = self.cycles.pop()
            self._sums = None
        self.interval_start = now - acted
