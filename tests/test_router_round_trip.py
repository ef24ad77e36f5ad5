"""The round trip to a replica, as the door discounts it: a streamed step's time from the
gate letting it in to its answer at the router, less the engine's own time for it. An
engine that reports its own time (`sglext.engine_times`, the emulator) is believed, so the
HTTP path both ways counts as the hop it is; else the data plane's timing of the engine
leg stands in (the hop then counts only the owner's side)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from router.protocol.accounting import ENGINE_TIMES_FLAG, Usage, openai_usage
from tests.router_harness import ScriptedReplica, chat, client, router, serve

STREAM_S = 0.3  # the replica's answer takes this long on the wire
ENGINE_S = 0.05  # ... of which it says this much was its engine's own


class SlowWire(ScriptedReplica):
    """An answer that takes STREAM_S to stream; with `report`, its sglext says the engine
    spent ENGINE_S of it (on a clock at x2, as an emulator at --time-scale 2 reports)."""

    def __init__(self, report: bool) -> None:
        super().__init__()
        self.report = report
        self.asked: list[bool] = []

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        self.asked.append(body.get(ENGINE_TIMES_FLAG) is True)

        async def events():
            delta = {"index": 0, "delta": {"content": "x"}, "finish_reason": None}
            yield "data: " + json.dumps({"id": body["rid"], "choices": [delta]}) + "\n\n"
            await asyncio.sleep(STREAM_S)
            if self.report:
                times = {"arrived": 10.0, "first": 10.02, "done": 10.0 + 2 * ENGINE_S}
                ext = {"sglext": {"engine_times": {**times, "time_scale": 2.0}}}
                yield "data: " + json.dumps({"id": body["rid"], "choices": [], **ext}) + "\n\n"
            usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
            yield "data: " + json.dumps({"id": body["rid"], "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def _round_trip(base: str, url: str) -> float | None:
    deadline = time.monotonic() + 5  # an attempt's report may trail the answer by ms
    while time.monotonic() < deadline:
        reps = httpx.get(base + "/v1/replicas").json()["data"]
        trip = next(r.get("prices", {}).get("round_trip_s") for r in reps if r["url"] == url)
        if trip is not None:
            return trip
        time.sleep(0.05)
    return None


@pytest.mark.parametrize("report", [True, False])
def test_the_round_trip_takes_off_the_engines_own_time_where_it_reports_one(report):
    replica = SlowWire(report)
    with serve(replica) as url, router([url]) as base:
        c = client(base)
        for i in range(3):
            stream = c.chat.completions.create(**chat(f"trip-{i}", "hello"), stream=True)
            assert [chunk for chunk in stream]
        trip = _round_trip(base, url)
        for i in range(3):
            httpx.post(f"{base}/v1/programs/trip-{i}/end").raise_for_status()
    assert replica.asked == [True] * 3  # every request asks for the engine's times
    assert trip is not None
    if report:  # the wire's time less the engine's: ~0.25 s
        assert STREAM_S - ENGINE_S - 0.05 < trip < STREAM_S
    else:  # the wire's time is the engine leg: only the owner's side is left
        assert trip < 0.05


@pytest.mark.parametrize(
    ("times", "engine_s"),
    [
        ({"arrived": 3.0, "first": 3.5, "done": 5.0, "time_scale": 5.0}, 0.4),
        ({"arrived": 3.0, "done": 5.0}, None),  # no time scale: not an engine clock we read
        ({"arrived": 3.0, "done": 5.0, "time_scale": 0}, None),
        ({"arrived": 5.0, "done": 3.0, "time_scale": 1.0}, None),  # ends before it arrived
        ({"arrived": True, "done": 5.0, "time_scale": 1.0}, None),
        ({"arrived": "3", "done": 5.0, "time_scale": 1.0}, None),
    ],
)
def test_engine_times_are_read_only_when_whole(times, engine_s):
    usage = Usage()
    openai_usage({"choices": [], "sglext": {"engine_times": times}}, usage)
    assert usage.engine_s == (pytest.approx(engine_s) if engine_s is not None else None)
