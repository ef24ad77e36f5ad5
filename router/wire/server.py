"""The data plane's HTTP/1.1 server: asyncio protocols and httptools, no ASGI layer.

The proxy endpoints are the router's hot path, and an ASGI server costs more per request
than the proxying itself (a scope dict, a task, receive/send message dicts and flow-control
wrappers per request; uvicorn and starlette were 11 % of the router's CPU before the
client was replaced, and the larger share after). Here a request is parsed by httptools
as its bytes arrive, one handler task serves it, and an answer's head and first chunk go
out in one write (so no small segment waits for a delayed ACK; uvloop sets TCP_NODELAY).

What a production front end must do is done here: keep-alive and pipelining (answered in
order), `Expect: 100-continue`, HTTP/1.0 clients (a streamed answer is close-delimited,
never chunked), `HEAD` (the head of the answer a `GET` would get, no body), a bound on the
request head, a declared body over the limit refused before it is read, malformed HTTP
answered with a JSON `400`, slow clients back-pressured, and a client that hangs up has
its handler cancelled (`Request.gone` tells it why). Three timeouts bound what a client
may hold (`Timeouts`): a request head must arrive within `header_s` of its first byte (or
of the connection's start; `408`), a kept-alive connection with no request in progress is
closed after `idle_s`, and the handler bounds the body (`Request.body`). A connection
closed before the client's request was read whole is closed lingering, as nginx and
Apache do: our side is shut, and what the client still sends is read and dropped until it
closes or goes quiet, so a client that writes its whole (refused) body before reading gets
the answer, not a reset. One sweep per server enforces the deadlines, so the hot path
pays two clock reads per request and no timer.
"""

from __future__ import annotations

import asyncio
import collections
import http
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httptools

from router.wire.errors import error_body

log = logging.getLogger("mori.server")

MAX_HEAD_BYTES = 64 * 1024  # request line + headers
LINGER_QUIET_S = 2.0  # a lingering close ends when the client sends nothing for this long
LINGER_MAX_S = 30.0  # ... or after this long in all (nginx's lingering_time)


@dataclass(frozen=True)
class Timeouts:
    """What a client may hold: a request head arriving (`header_s`, from its first byte, or
    from the connection's start for the first request) and an idle kept-alive connection
    (`idle_s`). The body's deadline is the handler's (`Request.body`)."""

    header_s: float = 10.0
    idle_s: float = 15.0

    @property
    def sweep_s(self) -> float:
        """How often the deadlines are checked: a quarter of the shorter, within 50 ms..1 s."""
        return min(1.0, max(0.05, min(self.header_s, self.idle_s) / 4))


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
        return self.content()

    def content(self) -> bytes:
        """The body bytes received so far (all of it once `complete`)."""
        return b"".join(self.chunks) if len(self.chunks) != 1 else self.chunks[0]

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class BodyTooLarge(Exception):
    """The request body is larger than the limit the handler gave."""


Handler = Callable[[Request], Awaitable[None]]


class Connection(asyncio.Protocol):
    """One client connection: parses requests, runs one handler at a time, writes answers."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.handler = server.handler
        self.limit = server.limit  # largest body a request may declare
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
        # deadlines (Server.sweep): since when the connection waits for the client
        self.waiting_since = self.loop.time()
        self.fresh = True  # no request yet: the head deadline runs from the start
        self.in_head = False  # a request head is arriving
        self.unread = False  # bytes the parser refused: the input has no boundary to resume at
        self.lingering = False  # closed on our side, reading what the client still sends
        self.linger_from = 0.0
        # the answer being written
        self.pending_head = b""
        self.chunked = False
        self.bodiless = False  # the answer to a HEAD request: its head only
        self.close_after = False
        self.started = False  # the answer's head is written (or waits for its first chunk)

    # asyncio.Protocol ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            self.waiting_since = self.loop.time()
            return
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
        self.server.connections.discard(self)
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
        self.in_head = True
        self.fresh = False
        if self.active is None:  # the head deadline runs from its first byte
            self.waiting_since = self.loop.time()

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
        self.in_head = False
        request.method = self.parser.get_method()
        request.http10 = self.parser.get_http_version() == "1.0"
        # HTTP/1.0: one request per connection (its streamed answers end with the close)
        request.keep_alive = self.parser.should_keep_alive() and not request.http10
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
        self.bodiless = request.method == b"HEAD"
        self.started = False
        self._resume_reading()
        self.task = self.loop.create_task(self._serve(request))
        self.server.tasks.add(self.task)
        self.task.add_done_callback(self.server.tasks.discard)

    async def _serve(self, request: Request) -> None:
        try:
            await self.handler(request)
        except asyncio.CancelledError:
            if not request.gone:
                raise
            return
        except Exception:  # the handler's own bug: answer 500 if still possible
            log.exception("request handler failed")
            if not self.started and not self.closed:
                body = error_body(500, "internal router error", code="internal_error")
                self.send(500, [(b"content-type", b"application/json")], body)
            self.close_after = True
        self._finish(request)

    def want_body(self, request: Request) -> None:
        """An `Expect: 100-continue` client waits for this before sending its body."""
        expect = request.header(b"expect")
        if expect is not None and expect.lower() == b"100-continue" and self.transport:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _finish(self, request: Request) -> None:
        self.active = self.task = None
        if self.unread or not request.complete:  # answered before its body was read
            self.linger()
        elif self.close_after:
            self.close()
        else:
            self.waiting_since = self.loop.time()
            self._next()

    def _refuse(self, status: int, message: str, code: str = "malformed_http") -> None:
        """Bad input: answered with a JSON error, then the connection is closed (lingering).
        Bad bytes after a complete request (a body longer than declared, a broken
        pipelined request) wait for that request's answer; bad bytes inside a request's
        head or body end its handler and are its answer."""
        self._pause_reading()
        self.queue.clear()
        self.unread = True
        active = self.active
        if active is not None and active.complete:
            self.close_after = True
            return
        if active is not None and self.task is not None:
            active.gone = True  # its handler ends quietly; this is its answer
            self.task.cancel()
        if not self.started and not self.closed and self.transport is not None:
            body = error_body(status, message, code=code)
            headers = [(b"content-type", b"application/json")]
            head, _ = _head(status, headers, False, True, len(body))
            self.transport.write(head + body)
        self.linger()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def linger(self) -> None:
        """Close while the client may still be sending: shut our side (the answer is
        flushed first), then read and drop what comes until the client closes or the
        sweep finds it quiet; closing at once would answer its bytes with a reset, which
        can destroy our answer before the client reads it."""
        if self.closed or self.transport is None:
            return
        self.closed = self.lingering = True
        self.linger_from = self.waiting_since = self.loop.time()
        self.reading_paused = False
        self.transport.resume_reading()
        try:
            self.transport.write_eof()
        except (NotImplementedError, RuntimeError):  # a transport without half-close
            self.transport.close()

    def check(self, now: float, timeouts: Timeouts) -> None:
        """Enforce the deadlines (called by the server's sweep)."""
        if self.lingering:
            if now - self.waiting_since >= LINGER_QUIET_S or now - self.linger_from >= LINGER_MAX_S:
                self.transport.close()  # type: ignore[union-attr]
        elif self.active is not None or self.closed:
            return  # a handler runs: its own deadlines hold (body, engine silence)
        elif self.in_head:
            if now - self.waiting_since >= timeouts.header_s:
                message = f"request head not received within {timeouts.header_s:g} s"
                self._refuse(408, message, code="header_timeout")
        elif now - self.waiting_since >= (timeouts.header_s if self.fresh else timeouts.idle_s):
            self.close()  # nothing sent, or an idle keep-alive: closed without a word

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
        """Begin a streamed answer: chunked; to an HTTP/1.0 client, close-delimited (its
        end is the connection's). The head is sent with the first chunk."""
        request = self.active
        assert request is not None
        self.started = True
        self._closing(request)
        stream = not request.http10
        self.pending_head, self.chunked = _head(status, headers, stream, self.close_after, None)

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

    def _closing(self, request: Request) -> None:
        """An answer to a request whose body is not read whole ends the connection: say so."""
        if not request.complete:
            self.close_after = True

    def _write(self, data: bytes) -> None:
        if self.closed or self.transport is None:
            return
        if self.bodiless:
            data = b""
        if self.pending_head:
            data, self.pending_head = self.pending_head + data, b""
        if data:
            self.transport.write(data)

    def send(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A whole answer with a content-length, in one write (a HEAD: the head alone)."""
        if self.closed or self.transport is None:
            return
        self.pending_head, self.started = b"", True
        if self.active is not None:
            self._closing(self.active)
        head, _ = _head(status, headers, False, self.close_after, len(body))
        self.transport.write(head if self.bodiless else head + body)

    async def drain(self) -> None:
        """Wait while the client reads slower than the answer is written."""
        if self.writable is not None:
            await self.writable


class Server:
    """Serves `handler` on a listening socket; `stop()` lets running requests finish."""

    def __init__(self, handler: Handler, limit: int, timeouts: Timeouts | None = None) -> None:
        self.handler, self.limit = handler, limit
        self.timeouts = timeouts or Timeouts()
        self.tasks: set[asyncio.Task] = set()
        self.connections: set[Connection] = set()
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task | None = None

    async def start(self, sock: object) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Connection(self), sock=sock, backlog=4096)
        self._sweeper = loop.create_task(self._sweep())

    async def _sweep(self) -> None:
        """Every `sweep_s`: close what overstayed its deadline (one pass, no timer per
        request)."""
        loop, timeouts = asyncio.get_running_loop(), self.timeouts
        while True:
            await asyncio.sleep(timeouts.sweep_s)
            now = loop.time()
            for conn in list(self.connections):
                conn.check(now, timeouts)

    async def stop(self, grace_s: float) -> None:
        if self._server is not None:
            self._server.close()
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=grace_s)
        for task in list(self.tasks):
            task.cancel()
        if self._sweeper is not None:
            self._sweeper.cancel()


_REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}


def _head(
    status: int,
    headers: list[tuple[bytes, bytes]],
    stream: bool,
    close: bool,
    length: int | None,
) -> tuple[bytes, bool]:
    """The status line and headers (and whether the body is chunked: a stream of unknown
    length; without `stream`, one of unknown length is close-delimited)."""
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
