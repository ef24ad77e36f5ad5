"""The gate: holds a request until its program is placed on a GPU tier.

Two waits, both bounded by one deadline: a program's requests take turns (the policy
allows one in flight per program), then the turn-holder waits for `route()` to name a
replica. Each waiter sleeps on its own `asyncio.Event`; after every batch of moves the
router sets them all (`wake_all`) and each re-asks `route()`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class GateTimeout(Exception):
    """The request was not let through before its deadline."""


class ProgramEnded(Exception):
    """The program was ended while its request was held: nothing will place it now."""


class Gate:
    """Per-program turn-taking and promotion wake-ups. Owns no policy state."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._turns: dict[str, tuple[asyncio.Lock, int]] = {}
        self._events: dict[str, asyncio.Event] = {}
        self._ended: set[str] = set()  # held programs ended while waiting
        self.waiting = 0  # requests blocked in `until_routed`

    def turn(self, program_id: str, deadline: float) -> _Turn:
        """Serialise requests of one program (`async with gate.turn(...)`); the lock is
        dropped when nobody uses it."""
        return _Turn(self, program_id, deadline)

    async def until_routed(
        self, program_id: str, route: Callable[[], str | None], deadline: float
    ) -> str:
        """Wait until `route()` names a replica; re-checked on every `wake_all`."""
        replica = route()
        if replica is not None:
            return replica
        event = self._events.setdefault(program_id, asyncio.Event())
        self.waiting += 1
        try:
            while (replica := route()) is None:
                if program_id in self._ended:
                    raise ProgramEnded
                event.clear()
                await self._bounded(event.wait, deadline)
            return replica
        finally:
            self.waiting -= 1
            self._events.pop(program_id, None)
            self._ended.discard(program_id)

    def end(self, program_id: str) -> None:
        """The program ended: its held request (if any) stops waiting at once."""
        event = self._events.get(program_id)
        if event is not None:
            self._ended.add(program_id)
            event.set()

    def wake_all(self) -> None:
        """Let every held request re-check `route()` (called after every batch of moves)."""
        for event in self._events.values():
            event.set()

    @property
    def turns(self) -> int:
        """Programs with a request in flight or queued (leak check for tests)."""
        return len(self._turns)

    async def _bounded(self, wait: Callable[[], Awaitable[object]], deadline: float) -> None:
        """Await `wait()` until the deadline; a timeout cancels it cleanly (no lock leaks)."""
        remaining = deadline - self._clock()
        if remaining <= 0:
            raise GateTimeout
        try:
            async with asyncio.timeout(remaining):
                await wait()
        except TimeoutError:
            raise GateTimeout from None


class _Turn:
    """One request's turn on its program (a class, not a generator: it is on every request)."""

    __slots__ = ("gate", "program_id", "deadline", "lock")

    def __init__(self, gate: Gate, program_id: str, deadline: float) -> None:
        self.gate, self.program_id, self.deadline = gate, program_id, deadline

    async def __aenter__(self) -> None:
        turns = self.gate._turns
        lock, users = turns.get(self.program_id, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        turns[self.program_id] = (lock, users + 1)
        self.lock = lock
        try:
            if lock.locked():
                await self.gate._bounded(lock.acquire, self.deadline)
            else:
                await lock.acquire()  # uncontended: no timer needed
        except BaseException:
            self._leave()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self.lock.release()
        self._leave()

    def _leave(self) -> None:
        turns = self.gate._turns
        lock, users = turns[self.program_id]
        if users <= 1:
            del turns[self.program_id]
        else:
            turns[self.program_id] = (lock, users - 1)
