"""The gate: holds a request until its program is placed on a GPU tier.

Two waits, both bounded by one deadline: a program's requests take turns (the policy
allows one in flight per program), then the turn-holder waits for `route()` to name a
replica. Each waiter sleeps on its own `asyncio.Event`; after every batch of moves the
router sets them all (`wake_all`) and each re-asks `route()`.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable


class GateTimeout(Exception):
    """The request was not let through before its deadline."""


class ProgramEnded(Exception):
    """The program was ended while its request was held: nothing will place it now."""


class Gate:
    """Per-program turn-taking and promotion wake-ups. Owns no policy state."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        # program -> requests queued behind the one in flight (FIFO); absent: turn free
        self._turns: dict[str, collections.deque[asyncio.Future[None]]] = {}
        self._events: dict[str, asyncio.Event] = {}
        self._ended: set[str] = set()  # held programs ended while waiting
        self.waiting = 0  # requests blocked in `until_routed`

    def enter(self, program_id: str) -> bool:
        """Take the program's turn if it is free (most requests: then nothing awaits);
        False: another request of the program holds it, `wait_turn`."""
        if program_id in self._turns:
            return False
        self._turns[program_id] = collections.deque()
        return True

    async def wait_turn(self, program_id: str, deadline: float) -> None:
        """Queue for the program's turn (first come, first served) until the deadline."""
        waiters = self._turns.get(program_id)
        if waiters is None:  # freed since `enter` was refused
            self._turns[program_id] = collections.deque()
            return
        future = asyncio.get_running_loop().create_future()
        waiters.append(future)
        try:
            await self._bounded(lambda: future, deadline)
        except BaseException:
            if future.done() and not future.cancelled():  # handed the turn as it left
                self.leave(program_id)
            elif future in waiters:
                waiters.remove(future)
            raise

    def leave(self, program_id: str) -> None:
        """End the turn: the next queued request has it, or it is free."""
        waiters = self._turns[program_id]
        while waiters:
            future = waiters.popleft()
            if not future.done():
                future.set_result(None)
                return
        del self._turns[program_id]

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
