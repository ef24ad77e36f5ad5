"""A wake-up of an asyncio loop at a deadline, within a fraction of a millisecond.

asyncio sleeps in its selector, and `selectors.EpollSelector` rounds every timeout up to
the next whole millisecond: a task that sleeps until a deadline wakes 0-1 ms after it
(0.8 ms on the mean, measured on the project's 2-core VM). The emulated replica answers at
its engine's event times through such a sleep, so every answer left ~0.8 ms late: at the
demo's x5 time scale 4 ms of trace time a step, a router-engine hop no engine has, which
the live stack paid against `mori sim` (bench/results/2026-12-04-emulator-alarm.md).

A thread's timed wait (`threading.Condition.wait`) is precise to tens of microseconds, and
`call_soon_threadsafe` wakes the loop at once through its self-pipe. One thread per alarm,
asleep between deadlines.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable


class Alarm:
    """Calls `ring` on `loop`'s thread once `time.monotonic()` reaches the deadline set
    last (`set`); a deadline set anew replaces the one before, rung or not."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ring: Callable[[], None]) -> None:
        self._loop = loop
        self._ring = ring
        self._changed = threading.Condition()
        self._deadline: float | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="mori-alarm", daemon=True)
        self._thread.start()

    def set(self, deadline: float | None) -> None:
        """Ring at `deadline` (monotonic seconds; now or past: at once); None: not at all."""
        with self._changed:
            self._deadline = deadline
            self._changed.notify()

    def close(self) -> None:
        """Stop the thread; no ring is posted after this returns."""
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._thread.join()

    def _watch(self) -> None:
        with self._changed:
            while not self._closed:
                if self._deadline is None:
                    self._changed.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._changed.wait(left)
                    continue
                self._deadline = None
                self._loop.call_soon_threadsafe(self._ring)
