"""The emulated replica's alarm on a real event loop: it rings once at its deadline,
never before, a deadline set anew replaces the last, and it wakes the loop closer to the
deadline than asyncio's own sleep, which rounds up to the next millisecond."""

from __future__ import annotations

import asyncio
import statistics
import time

from router.sim.alarm import Alarm

SAMPLES = 30


async def _rings(deadlines: list[float | None], wait_s: float) -> list[float]:
    """Set each of `deadlines` in turn; the monotonic times the alarm rang within `wait_s`."""
    rang: list[float] = []
    alarm = Alarm(asyncio.get_running_loop(), lambda: rang.append(time.monotonic()))
    try:
        for deadline in deadlines:
            alarm.set(deadline)
        await asyncio.sleep(wait_s)
    finally:
        alarm.close()
    return rang


def test_it_rings_once_at_its_deadline_never_before() -> None:
    async def main() -> tuple[float, list[float]]:
        deadline = time.monotonic() + 0.02
        return deadline, await _rings([deadline], 0.1)

    deadline, rang = asyncio.run(main())
    assert len(rang) == 1
    assert deadline <= rang[0] < deadline + 0.05


def test_a_deadline_set_anew_replaces_the_last() -> None:
    async def main() -> tuple[float, list[float], list[float]]:
        later = time.monotonic() + 0.06
        moved = await _rings([time.monotonic() + 0.01, later], 0.12)
        cancelled = await _rings([time.monotonic() + 0.01, None], 0.05)
        return later, moved, cancelled

    later, moved, cancelled = asyncio.run(main())
    assert len(moved) == 1 and moved[0] >= later  # not at the first deadline
    assert cancelled == []


def test_a_past_deadline_rings_at_once_and_close_stops_the_thread() -> None:
    async def main() -> tuple[list[float], Alarm, list[float]]:
        rang: list[float] = []
        alarm = Alarm(asyncio.get_running_loop(), lambda: rang.append(time.monotonic()))
        alarm.set(time.monotonic() - 1.0)
        await asyncio.sleep(0.02)
        alarm.set(time.monotonic() + 0.01)
        alarm.close()
        after: list[float] = []
        await asyncio.sleep(0.03)
        after.extend(rang[1:])
        return rang, alarm, after

    rang, alarm, after = asyncio.run(main())
    assert len(rang) == 1
    assert after == []  # the deadline set before close never rang
    assert not alarm._thread.is_alive()


def test_it_wakes_the_loop_closer_to_the_deadline_than_asyncio_sleep() -> None:
    """Side by side on one loop, deadlines between whole milliseconds: asyncio's selector
    rounds each sleep up (0-1 ms late), the alarm's thread does not."""

    async def main() -> tuple[list[float], list[float]]:
        loop = asyncio.get_running_loop()
        woke = asyncio.Event()
        alarm = Alarm(loop, woke.set)
        by_alarm, by_sleep = [], []
        try:
            for k in range(SAMPLES):
                delay = 0.0013 + 0.0007 * (k % 10) / 10
                deadline = time.monotonic() + delay
                woke.clear()
                alarm.set(deadline)
                await woke.wait()
                by_alarm.append(time.monotonic() - deadline)
                deadline = time.monotonic() + delay
                await asyncio.sleep(delay)
                by_sleep.append(time.monotonic() - deadline)
        finally:
            alarm.close()
        return by_alarm, by_sleep

    by_alarm, by_sleep = asyncio.run(main())
    assert min(by_alarm) >= 0.0
    assert statistics.median(by_alarm) < statistics.median(by_sleep), (by_alarm, by_sleep)
