"""The gate's turns: one request per program at a time, first come first served, and no
turn lost or leaked when a queued request times out or is cancelled."""

from __future__ import annotations

import asyncio

import pytest

from router.owner.gate import Gate, GateTimeout


def _run(coro):
    return asyncio.run(coro)


def test_a_free_turn_is_taken_without_waiting_and_freed_on_leave():
    gate = Gate(lambda: 0.0)
    assert gate.enter("p")
    assert not gate.enter("p")  # held: a second request must queue
    assert gate.enter("q")  # another program's turn is its own
    gate.leave("p")
    gate.leave("q")
    assert gate.turns == 0


def test_queued_requests_get_the_turn_in_arrival_order():
    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        gate, order = Gate(loop.time), []
        assert gate.enter("p")

        async def request(name: str) -> None:
            await gate.wait_turn("p", loop.time() + 5)
            order.append(name)
            await asyncio.sleep(0.01)
            gate.leave("p")

        tasks = [asyncio.create_task(request(n)) for n in "abc"]
        await asyncio.sleep(0.01)
        gate.leave("p")
        await asyncio.gather(*tasks)
        assert gate.turns == 0
        return order

    assert _run(main()) == ["a", "b", "c"]


def test_a_queued_request_that_times_out_leaves_the_queue():
    async def main() -> None:
        loop = asyncio.get_running_loop()
        gate = Gate(loop.time)
        assert gate.enter("p")
        with pytest.raises(GateTimeout):
            await gate.wait_turn("p", loop.time() + 0.02)
        gate.leave("p")
        assert gate.turns == 0
        assert gate.enter("p")  # free again, nobody is left queued for it

    _run(main())


def test_a_request_cancelled_just_after_it_was_handed_the_turn_passes_it_on():
    async def main() -> None:
        loop = asyncio.get_running_loop()
        gate = Gate(loop.time)
        assert gate.enter("p")
        first = asyncio.create_task(gate.wait_turn("p", loop.time() + 5))
        second = asyncio.create_task(gate.wait_turn("p", loop.time() + 5))
        await asyncio.sleep(0)
        gate.leave("p")  # hands the turn to `first`...
        first.cancel()  # ...which is cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.wait_for(second, 1.0)  # the turn reached the next in line
        gate.leave("p")
        assert gate.turns == 0

    _run(main())
