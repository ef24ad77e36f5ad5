"""The HTTP server's contract with its handler: a handler's own bug is a logged 500 (with
a JSON body) that closes the connection; the server keeps serving other connections."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator

import h11

from router.wire.server import Request, Server


async def _handler(request: Request) -> None:
    if request.path == b"/bug":
        raise RuntimeError("a bug in the handler")
    request.conn.send(200, [(b"content-type", b"text/plain")], b"ok")


@contextlib.asynccontextmanager
async def _serving() -> AsyncIterator[int]:
    """A `Server` of `_handler` on a free port for the block; yields the port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    server = Server(_handler, 1 << 20)
    await server.start(sock)
    try:
        yield sock.getsockname()[1]
    finally:
        await server.stop(1.0)
        sock.close()


async def _exchange(port: int, target: str, close: bool) -> tuple[h11.Response, bytes, bool]:
    """One GET through h11 (a strict client): the response, its body, and (`close`)
    whether the server closed the connection after it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    client = h11.Connection(h11.CLIENT)
    writer.write(client.send(h11.Request(method="GET", target=target, headers=[("host", "x")])))
    writer.write(client.send(h11.EndOfMessage()))
    response, body = None, b""
    while True:
        event = client.next_event()
        if event is h11.NEED_DATA:
            client.receive_data(await asyncio.wait_for(reader.read(65536), 5))
        elif isinstance(event, h11.Response):
            response = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            break
    closed = close and await asyncio.wait_for(reader.read(1), 5) == b""
    writer.close()
    return response, body, closed


def test_a_handler_bug_is_a_logged_500_and_the_server_goes_on(caplog):
    async def main() -> None:
        async with _serving() as port:
            with caplog.at_level(logging.ERROR, logger="mori.server"):
                response, body, closed = await _exchange(port, "/bug", close=True)
            assert response.status_code == 500 and b"internal_error" in body and closed
            assert "request handler failed" in caplog.text
            assert "a bug in the handler" in caplog.text
            response, body, _ = await _exchange(port, "/fine", close=False)
            assert response.status_code == 200 and body == b"ok"

    asyncio.run(main())


def test_pipelined_requests_on_a_kept_alive_connection_are_answered_in_order():
    async def main() -> None:
        async with _serving() as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            request = b"GET /fine HTTP/1.1\r\nhost: x\r\n\r\n"
            writer.write(request * 3)  # pipelined: answered in order, one at a time
            data = b""
            while data.count(b"HTTP/1.1 200") < 3:
                data += await asyncio.wait_for(reader.read(65536), 5)
            writer.close()

    asyncio.run(main())
