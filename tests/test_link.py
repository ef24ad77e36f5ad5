"""The worker-owner link on a real socketpair: what a worker reports reaches the owner
within a few loop turns, with no timer in between (the owner acts on a step's end)."""

from __future__ import annotations

import asyncio
import socket

from router.plane.worker import OwnerLink
from router.protocol.link import ATTEMPT, Link, Outcome, connect

TURNS = 5  # loop turns the report may take: a flush, a read, and slack


async def _pair() -> tuple[OwnerLink, list[tuple]]:
    worker_sock, owner_sock = socket.socketpair()
    received: list[tuple] = []
    await connect(owner_sock, Link(received.append, lambda: None))
    worker_end = OwnerLink(None)
    await connect(worker_sock, worker_end.link)  # type: ignore[arg-type]
    return worker_end, received


async def _turns_until(received: list[tuple]) -> int | None:
    for turn in range(1, TURNS + 1):
        await asyncio.sleep(0)
        if received:
            return turn
    return None


def test_a_served_steps_report_reaches_the_owner_within_loop_turns() -> None:
    async def main() -> tuple[int | None, list[tuple]]:
        worker_end, received = await _pair()
        worker_end.report(7, Outcome(verdict=True))
        turns = await _turns_until(received)
        worker_end.link.close()
        return turns, received

    turns, received = asyncio.run(main())
    assert turns is not None, f"no report after {TURNS} loop turns"
    kind, seq, outcome = received[0]
    assert (kind, seq, outcome.verdict) == (ATTEMPT, 7, True)


def test_messages_of_one_turn_arrive_together_in_order() -> None:
    async def main() -> list[tuple]:
        worker_end, received = await _pair()
        for seq in range(3):
            worker_end.report(seq, Outcome(status="ok" if seq else "error"))
        await _turns_until(received)
        worker_end.link.close()
        return received

    received = asyncio.run(main())
    assert [(m[1], m[2].status) for m in received] == [(0, "error"), (1, "ok"), (2, "ok")]
