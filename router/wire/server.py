"""The data plane's HTTP/1.1 server: asyncio protocols and httptools, no ASGI layer.

The proxy endpoints are the router's hot path, and an ASGI server costs more per request
than the proxying itself (a scope dict, a task, receive/send message dicts and flow-control
wrappers per request; uvicorn and starlette were 11 % of the router's CPU before the
client was replaced, and the larger share after). Here a request is parsed by httptools
as its bytes arrive, one handler task serves it, and an answer's head and first chunk go
out in one write (so no small segment waits for a delayed ACK; uvloop sets TCP_NODELAY).

What a production front end must do is done here: keep-alive and pipelining (answered in
order), `Expect: 100-continue`, HTTP/1.0 clients, a bound on the request head, a declared
body over the limit refused before it is read, malformed HTTP answered with a JSON `400`
and the connection closed, slow clients back-pressured, and a client that hangs up has its
handler cancelled (`Request.gone` tells it why).
"""

from __future__ import annotations

import asyncio
import collections
import http
from collections.abc import Awaitable, Callable

import httptools

from router.wire.errors import error_body

MAX_HEAD_BYTES = 64 * 1024  # request line + headers


class Request:
    """One request as parsed: method, target, lower-cased headers, and its body as it comes."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.method = b""
        self.target = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = True
        self.http10 = False
        self.chunks: list[bytes] = []
        self.size = 0
        self.complete = False
        self.gone = False  # the client hung up (the handler is being cancelled)
        self.waiter: asyncio.Future[None] | None = None

    @property
    def path(self) -> bytes:
        return self.target.split(b"?", 1)[0]

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def body(self, limit: int, timeout_s: float) -> bytes:
        """The whole body. Raises BodyTooLarge past `limit` (the rest is not kept) and
        TimeoutError when it is not complete within `timeout_s`."""
        if self.size > limit:
            raise BodyTooLarge
        if not self.complete:
            self.conn.want_body(self)
            async with asyncio.timeout(timeout_s):
                while not self.complete:
                    if self.size > limit:
                        raise BodyTooLarge
                    self.waiter = asyncio.get_running_loop().create_future()
                    await self.waiter
        if self.size > limit:
            raise BodyTooLarge
        return b"".join(self.chunks) if len(self.chunks) != 1 else self.chunks[0]

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class BodyTooLarge(Exception):
    """The request body is larger than the limit the handler gave."""


Handler = Callable[[Request], Awaitable[None]]


class Connection(asyncio.Protocol):
    """One client connection: parses requests, runs one handler at a time, writes answers."""

    def __init__(self, handler: Handler, limit: int, tasks: set[asyncio.Task]) -> None:
        self.handler = handler
        self.limit = limit  # largest body a request may declare
        self.tasks = tasks  # the server's running handlers (for a graceful stop)
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.parsing: Request | None = None  # the request whose bytes are arriving
        self.queue: collections.deque[Request] = collections.deque()  # pipelined
        self.active: Request | None = None
        self.task: asyncio.Task | None = None
        self.head_bytes = 0
        self.closed = False
        self.reading_paused = False
        self.writable: asyncio.Future[None] | None = None  # set while the client is slow
        # the answer being written
        self.pending_head = b""
        self.chunked = False
        self.close_after = False
        self.started = False  # the answer's head is written (or waits for its first chunk)

    # asyncio.Protocol ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not supported")
        except httptools.HttpParserError:
            if self.head_bytes > MAX_HEAD_BYTES:
                self._refuse(431, "request head too large")
            else:
                self._refuse(400, "malformed HTTP request")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        if self.active is not None and self.task is not None and not self.task.done():
            self.active.gone = True
            self.task.cancel()

    def pause_writing(self) -> None:
        self.writable = self.loop.create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.writable = None

    # httptools callbacks -----------------------------------------------------------
    def on_message_begin(self) -> None:
        self.parsing = Request(self)

    def on_url(self, url: bytes) -> None:
        assert self.parsing is not None
        self._count_head(len(url))
        self.parsing.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.parsing is not None
        self._count_head(len(name) + len(value))
        self.parsing.headers.append((name.lower(), value))

    def _count_head(self, size: int) -> None:
        self.head_bytes += size
        if self.head_bytes > MAX_HEAD_BYTES:
            raise ValueError("request head too large")  # feed_data raises a parser error

    def on_headers_complete(self) -> None:
        request = self.parsing
        assert request is not None
        self.head_bytes = 0
        request.method = self.parser.get_method()
        request.keep_alive = self.parser.should_keep_alive()
        request.http10 = self.parser.get_http_version() == "1.0"
        self.queue.append(request)
        if self.active is None:
            self._next()
        elif len(self.queue) > 1:
            self._pause_reading()  # pipelined requests wait; do not buffer without bound

    def on_body(self, body: bytes) -> None:
        request = self.parsing
        assert request is not None
        request.size += len(body)
        if request.size <= self.limit:
            request.chunks.append(body)
        request._wake()

    def on_message_complete(self) -> None:
        request = self.parsing
        assert request is not None
        request.complete = True
        request._wake()

    # requests ------------------------------------------------------------------------
    def _next(self) -> None:
        if not self.queue or self.closed:
            return
        self.active = request = self.queue.popleft()
        self.close_after = not request.keep_alive
        self.started = False
        self._resume_reading()
        self.task = self.loop.create_task(self._serve(request))
        self.tasks.add(self.task)
        self.task.add_done_callback(self.tasks.discard)

    async def _serve(self, request: Request) -> None:
        try:
            await self.handler(request)
        except asyncio.CancelledError:
            if not request.gone:
                raise
            return
        except Exception:  # the handler's own bug: answer 500 if still possible
            if not self.started and not self.closed:
                body = error_body(500, "internal router error", code="internal_error")
                self.send(500, [(b"content-type", b"application/json")], body)
            self.close_after = True
        if not request.complete:  # answered before its body was read: cannot resync
            self.close_after = True
        self._finish()

    def want_body(self, request: Request) -> None:
        """An `Expect: 100-continue` client waits for this before sending its body."""
        expect = request.header(b"expect")
        if expect is not None and expect.lower() == b"100-continue" and self.transport:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _finish(self) -> None:
        self.active = self.task = None
        if self.close_after:
            self.close()
        else:
            self._next()

    def _refuse(self, status: int, message: str) -> None:
        """Malformed input: answered with a JSON error, then the connection is closed.
        Bad bytes after a complete request (a body longer than declared, a broken
        pipelined request) wait for that request's answer; bad bytes inside a request's
        head or body end its handler and are its answer."""
        self._pause_reading()
        self.queue.clear()
        active = self.active
        if active is not None and active.complete:
            self.close_after = True
            return
        if active is not None and self.task is not None:
            active.gone = True  # its handler ends quietly; this is its answer
            self.task.cancel()
        if not self.started and not self.closed and self.transport is not None:
            body = error_body(status, message, code="malformed_http")
            headers = [(b"content-type", b"application/json")]
            head, _ = _head(status, headers, False, True, len(body))
            self.transport.write(head + body)
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.reading_paused and self.transport is not None and not self.closed:
            self.reading_paused = False
            self.transport.resume_reading()

    # answering -----------------------------------------------------------------------
    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Begin a streamed answer (chunked; HTTP/1.0: raw, then close). The head is sent
        with the first chunk."""
        request = self.active
        assert request is not None
        if request.http10:
            self.close_after = True
        self.started = True
        self.pending_head, self.chunked = _head(status, headers, True, self.close_after, None)
        self.chunked = self.chunked and not request.http10

    def write(self, data: bytes) -> None:
        """One chunk of a streamed answer (with the head, if not yet sent)."""
        if data and self.chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        self._write(data)

    def end(self, data: bytes = b"") -> None:
        """The last chunk of a streamed answer."""
        if self.chunked:
            data = (b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data)) if data else b"0\r\n\r\n"
        self._write(data)

    def _write(self, data: bytes) -> None:
        if self.closed or self.transport is None:
            return
        if self.pending_head:
            data, self.pending_head = self.pending_head + data, b""
        if data:
            self.transport.write(data)

    def send(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A whole answer with a content-length, in one write."""
        if self.closed or self.transport is None:
            return
        self.pending_head, self.started = b"", True
        head, _ = _head(status, headers, False, self.close_after, len(body))
        self.transport.write(head + body)

    async def drain(self) -> None:
        """Wait while the client reads slower than the answer is written."""
        if self.writable is not None:
            await self.writable


class Server:
    """Serves `handler` on a listening socket; `stop()` lets running requests finish."""

    def __init__(self, handler: Handler, limit: int) -> None:
        self.handler, self.limit = handler, limit
        self.tasks: set[asyncio.Task] = set()
        self._server: asyncio.Server | None = None

    async def start(self, sock: object) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: Connection(self.handler, self.limit, self.tasks), sock=sock, backlog=4096
        )

    async def stop(self, grace_s: float) -> None:
        if self._server is not None:
            self._server.close()
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=grace_s)
        for task in list(self.tasks):
            task.cancel()


_REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}


def _head(
    status: int,
    headers: list[tuple[bytes, bytes]],
    stream: bool,
    close: bool,
    length: int | None,
) -> tuple[bytes, bool]:
    """The status line and headers (and whether the body is chunked)."""
    reason = _REASONS.get(status, b"Status")
    lines = [b"HTTP/1.1 %d %b" % (status, reason)]
    lines.extend(name + b": " + value for name, value in headers)
    if length is not None:
        lines.append(b"content-length: %d" % length)
    elif stream:
        lines.append(b"transfer-encoding: chunked")
    if close:
        lines.append(b"connection: close")
    lines.append(b"\r\n")
    return b"\r\n".join(lines), length is None and stream
