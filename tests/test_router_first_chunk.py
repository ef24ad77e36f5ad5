"""A streamed reply's first events reach a keep-alive client at once: no delayed-ACK stall.

With Nagle's algorithm on the router's client socket, a small write that follows another
unacknowledged one waits for the client's ACK, and a keep-alive client delays its ACK by
up to ~40 ms (Linux). The SGLang gateway stalls this way on every streamed reply (it
writes the head and the first chunk separately). The router writes an answer's head with
its first chunk and sends with TCP_NODELAY, so an event the engine sends 5 ms after the
first reaches the client about 5 ms later, request after request on one connection.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tests.router_harness import ScriptedReplica, router, serve

GAP_S = 0.005  # the engine sends its second event this long after the first
STALL_S = 0.030  # a delayed ACK holds a segment ~40 ms; anything near that is a stall


class TwoEventsThenPause(ScriptedReplica):
    """Streams two events 5 ms apart, then pauses before the end of the answer."""

    async def chat(self, request: Request) -> Response:
        body = await request.json()

        async def events():
            for text in ("a", "b"):
                delta = {"index": 0, "delta": {"content": text}, "finish_reason": None}
                yield "data: " + json.dumps({"id": body["rid"], "choices": [delta]}) + "\n\n"
                await asyncio.sleep(GAP_S)
            await asyncio.sleep(0.2)
            usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
            yield "data: " + json.dumps({"id": body["rid"], "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def _second_event_after(sock: socket.socket, program_id: str) -> float:
    """Send one streamed request on the open connection; seconds until the second event
    arrived (the rest of the answer is read too, so the connection is reusable)."""
    body = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "program_id": program_id,
        }
    ).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: router\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
    )
    started = time.perf_counter()
    sock.sendall(head + body)
    received, second = b"", None
    while not received.endswith(b"0\r\n\r\n"):
        data = sock.recv(65536)
        assert data, "the router closed a keep-alive connection"
        received += data
        if second is None and received.count(b"data: ") >= 2:
            second = time.perf_counter() - started
    assert b"data: [DONE]" in received
    assert second is not None
    return second


def test_streamed_events_are_not_held_for_an_ack():
    replica = TwoEventsThenPause()
    with serve(replica) as url, router([url]) as base:
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            waits = [_second_event_after(sock, "p-nodelay") for _ in range(6)]
    # the best of six on one connection: immune to a scheduling hiccup of a loaded
    # machine, not to a stall that happens on every reply
    assert min(waits[1:]) < GAP_S + STALL_S, [f"{w * 1000:.1f} ms" for w in waits]
