"""The door: where a program's first request waits until the programs in flight leave room.

Under more programs than the replicas hold, someone has to wait; what a policy chooses is
who. A program in flight (served once: its context is built, its user is watching) should
not: its next step has a bound (`PolicyConfig.max_step_wait_s`). A program that has not
started loses nothing by waiting before it starts (no context to recompute, no step cut
in half), and an orchestrator told to come back can back off or scale out. So starts are
the valve: they wait here in the order they first asked, and are let in only where no
program in flight is waiting (`router.policy.overload`); a start that cannot be let in before the
gate would time it out is refused at once, with when to come back (`refusals`), and
keeps its place: its first attempt still orders it when it returns.

Pure bookkeeping (no I/O, times passed in): which programs are at the door, in what
order, how fast the door has been letting them in, and what a start at a given place
should expect to wait.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from router.policy.program import Program

START_DEFERRED = "start_deferred"  # the error code a refused start is answered with
ERROR_CODE_HEADER = "x-mori-error"  # ... also as a header: Anthropic's error body has no code
RATE_SAMPLES = 32  # recent admissions the door's pace is measured over
REFUSE_AT = 0.8  # refuse a start expected to wait past this share of the gate timeout


class Door:
    """Programs that have asked to start and not started yet, oldest first attempt first."""

    def __init__(self) -> None:
        self._queue: OrderedDict[str, Program] = OrderedDict()  # held or told to come back
        self._admitted: deque[float] = deque(maxlen=RATE_SAMPLES)  # admission times
        self.refused: dict[str, float] = {}  # held start -> Retry-After (s) to answer with

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, program_id: str) -> bool:
        return program_id in self._queue

    def enter(self, p: Program) -> None:
        """A start asked (again): it keeps the place of its first attempt."""
        self._queue.setdefault(p.program_id, p)
        self.refused.pop(p.program_id, None)

    def forget(self, program_id: str) -> None:
        """Ended (or its lease expired) before it started."""
        self._queue.pop(program_id, None)
        self.refused.pop(program_id, None)

    def held(self) -> list[Program]:
        """Starts whose request is at the gate now, in door order. Starts placed since
        (by the policy's door, or by any pass that places a held request) leave the door
        here, each one more sample of its pace (its step began when it was let in)."""
        if not self._queue:  # every event asks; most find no start at the door
            return []
        placed = [p for p in self._queue.values() if p.last_replica is not None]
        for p in placed:
            del self._queue[p.program_id]
            self.refused.pop(p.program_id, None)
            self._admitted.append(p.interval_start)
        return [p for p in self._queue.values() if p.pending]

    def position(self, program_id: str) -> int | None:
        """How many starts are ahead of this one (held or away); None: not at the door."""
        for i, pid in enumerate(self._queue):
            if pid == program_id:
                return i
        return None

    def interval_s(self, now: float) -> float | None:
        """Seconds between admissions lately; None before two were seen. A door that has
        let nobody in for longer than that is measured by the time since its last one."""
        if len(self._admitted) < 2:
            return None
        mean = (self._admitted[-1] - self._admitted[0]) / (len(self._admitted) - 1)
        return max(mean, now - self._admitted[-1])

    def expected_wait_s(self, position: int, now: float) -> float | None:
        """What a start with `position` others ahead should expect to wait from now."""
        interval = self.interval_s(now)
        return None if interval is None else (position + 1) * interval

    def update_refusals(self, now: float, timeout_s: float, hold_s: float) -> None:
        """Mark the held starts the door will not hold: those whose wait so far plus the
        wait expected at their place passes `hold_s` or `REFUSE_AT` x `timeout_s` (the
        gate would time them out), and any held that long already. Each is told to come
        back when its turn is expected (`refused`, in seconds)."""
        budget = min(hold_s, REFUSE_AT * timeout_s)
        for position, (pid, p) in enumerate(self._queue.items()):
            if not p.pending or pid in self.refused:
                continue
            waited = now - p.last_active_s
            expected = self.expected_wait_s(position, now)
            if waited >= budget or (expected is not None and waited + expected > budget):
                ahead = expected if expected is not None else timeout_s
                self.refused[pid] = min(timeout_s, max(1.0, ahead))
