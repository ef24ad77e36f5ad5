"""A thin HTTP/1.1 client on the event loop's own transports: the router's one client.

Every call the router makes (inference to the engines, health, capacity, hints, aborts,
and a data-plane worker's relay to the policy owner) goes through `Upstream`. It exists
because the general clients cost more than the bytes they move: with httpx, 47 % of the
router's CPU per streamed request was the client stack (httpcore, anyio, h11), and
`bench/router_vs_gateway.py --clients` measures the candidates side by side. Here a
request is one `write`, the answer is parsed by httptools (llhttp, in C) as it arrives,
and a streamed body is handed over chunk by chunk without a task or a queue per request.
One timer per request bounds the engine's silence.

Failures are typed for the outlier books: `ConnectFailed` (refused, connect timeout: the
replica's fault), `Broken` (reset, protocol error, cut-off answer, silence past the
timeout: maybe the request's), `InvalidRequest` (a request that cannot be written).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import socket
import ssl
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httptools

HIGH_WATER = 1 << 20  # buffered answer bytes before the engine connection is paused
MAX_IDLE = 512  # idle keep-alive connections kept per origin


class UpstreamError(Exception):
    """A request that got no complete answer."""


class ConnectFailed(UpstreamError):
    """No connection could be made (refused, unreachable, connect timeout)."""


class Broken(UpstreamError):
    """The connection failed after it was made: reset, bad HTTP, cut off, or silent."""


class Closed(Broken):
    """The engine closed the connection (EOF or reset), not the router: only this may be a
    kept-alive connection that the engine closed just as it was reused."""


class InvalidRequest(UpstreamError):
    """The request itself cannot be written (a header with a line break)."""


class Origin:
    """Where requests go: scheme, host and port of a base URL, and its idle connections."""

    def __init__(self, base: str) -> None:
        parts = urlsplit(base)
        self.tls = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/").encode()
        self.host_header = parts.netloc.encode()
        self.idle: collections.deque[Connection] = collections.deque()


class Response:
    """An answer whose head has arrived; iterate it (`async for chunk in response`) or
    `read()` it, then `close()` it (the connection is reused only if the body was read)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.complete = False
        self.keep_alive = False  # read at its head (the parser forgets it once complete)
        self.error: UpstreamError | None = None
        self.waiter: asyncio.Future[None] | None = None

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def __aiter__(self) -> Response:
        return self

    async def __anext__(self) -> bytes:
        while not self.chunks:
            if self.error is not None:
                raise self.error
            if self.complete:
                raise StopAsyncIteration
            self.waiter = self._conn.loop.create_future()
            await self.waiter
        chunk = self.chunks.popleft()
        self.buffered -= len(chunk)
        if self._conn.paused and self.buffered < HIGH_WATER // 2:
            self._conn.resume()
        return chunk

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self])

    def close(self) -> None:
        self._conn.release(self)


class Connection(asyncio.Protocol):
    """One keep-alive connection; parses answers with httptools as bytes arrive."""

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.head: asyncio.Future[Response] | None = None
        self.got_bytes = False  # of the current answer (a reused connection may be stale)
        self.paused = False
        self.closed = False
        self.last_data = 0.0  # loop time of the last byte (or of the request's write)
        self.limit = 0.0  # the silence the current request may see
        self.watchdog: asyncio.TimerHandle | None = None

    # asyncio.Protocol ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self.last_data = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.fail(Broken(f"bad HTTP from the engine: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closed:  # closed by us: whoever did it has told the request
            return
        self.closed = True
        if self.head is not None or (self.response is not None and not self.response.complete):
            self.fail(Closed(f"connection closed by the engine ({exc or 'EOF'})"))

    # httptools callbacks -----------------------------------------------------------
    def on_message_begin(self) -> None:
        self.response = Response(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        response.status = self.parser.get_status_code()
        response.keep_alive = self.parser.should_keep_alive()
        if self.head is not None and not self.head.done():
            self.head.set_result(response)

    def on_body(self, body: bytes) -> None:
        response = self.response
        assert response is not None
        response.chunks.append(body)
        response.buffered += len(body)
        if response.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        _wake(response.waiter)

    def on_message_complete(self) -> None:
        response = self.response
        assert response is not None
        response.complete = True
        self._stop_watchdog()
        _wake(response.waiter)

    # the request ---------------------------------------------------------------------
    def fail(self, error: UpstreamError) -> None:
        """End the current request with `error` (its reader raises it) and the connection."""
        self._stop_watchdog()
        if self.head is not None and not self.head.done():
            self.head.set_exception(error)
        elif self.response is not None and not self.response.complete:
            self.response.error = error
            _wake(self.response.waiter)
        self.abort()

    def _watch(self) -> None:
        """One timer per request bounds the engine's silence (head and body alike)."""
        self.watchdog = None
        if self.loop.time() - self.last_data >= self.limit:
            self.fail(Broken(f"no byte from the engine for {self.limit:g} s"))
        else:
            self.watchdog = self.loop.call_at(self.last_data + self.limit, self._watch)

    def _stop_watchdog(self) -> None:
        if self.watchdog is not None:
            self.watchdog.cancel()
            self.watchdog = None

    def resume(self) -> None:
        self.paused = False
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def release(self, response: Response) -> None:
        """Back to the idle list if the answer was read whole and keep-alive, else closed."""
        if response is not self.response:
            return
        reusable = response.complete and response.keep_alive and not self.closed
        self._stop_watchdog()
        self.response = self.head = None
        if reusable and len(self.origin.idle) < MAX_IDLE:
            self.origin.idle.append(self)
        else:
            self.abort()

    def send(self, data: bytes, limit: float) -> asyncio.Future[Response]:
        """Write the request; the future is the answer's head (a plain future, not a
        coroutine: one frame less for every wake-up of the request's task)."""
        head = self.head = self.loop.create_future()
        self.response, self.got_bytes = None, False
        self.limit, self.last_data = limit, self.loop.time()
        self.watchdog = self.loop.call_at(self.last_data + limit, self._watch)
        assert self.transport is not None
        self.transport.write(data)
        return head


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class Upstream:
    """Keep-alive connection pools per origin, and the calls the router makes."""

    def __init__(self, connect_timeout_s: float, timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.timeout_s = timeout_s
        self._origins: dict[str, Origin] = {}
        self._tls: ssl.SSLContext | None = None

    def origin(self, base: str) -> Origin:
        origin = self._origins.get(base)
        if origin is None:
            origin = self._origins[base] = Origin(base)
        return origin

    async def request(
        self,
        base: str,
        method: bytes,
        path: bytes,
        body: bytes = b"",
        headers: list[tuple[bytes, bytes]] | None = None,
        timeout_s: float | None = None,
        on_connection: Callable[[Connection], object] | None = None,
    ) -> Response:
        """Send one request; returns when the answer's head arrived. The caller reads and
        closes the response. `timeout_s` bounds the silence of the engine (default: the
        client's), connecting is bounded by the connect timeout. `on_connection` is handed
        the connection before the request is written (`Connection.fail` ends it early)."""
        origin = self.origin(base)
        data = _head(origin, method, path, body, headers) + body
        limit = self.timeout_s if timeout_s is None else timeout_s
        while True:
            conn = self._idle(origin)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(origin)
            if on_connection is not None:
                on_connection(conn)
            try:
                return await conn.send(data, limit)
            except Closed:
                # a keep-alive connection the engine closed just as it was reused: the
                # request never reached it, so a fresh connection may carry it once (a
                # cut or a timeout of the router's own is final: the replica is at fault)
                if reused and not conn.got_bytes:
                    continue
                raise
            except BaseException:
                conn.abort()
                raise

    def _idle(self, origin: Origin) -> Connection | None:
        """A kept-alive connection to reuse: the most recent, least likely to be closed."""
        while origin.idle:
            conn = origin.idle.pop()
            if not conn.closed:
                return conn
        return None

    async def _connect(self, origin: Origin) -> Connection:
        loop = asyncio.get_running_loop()
        tls = self._tls_context() if origin.tls else None
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: Connection(origin), origin.host, origin.port, ssl=tls
                )
        except TimeoutError:
            raise ConnectFailed(f"connect to {origin.host}:{origin.port} timed out") from None
        except OSError as e:
            raise ConnectFailed(f"connect to {origin.host}:{origin.port} failed: {e}") from None
        sock = conn.transport.get_extra_info("socket") if conn.transport else None
        if sock is not None:  # a small request must never wait for an ACK
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    async def call(
        self, base: str, method: bytes, path: bytes, body: bytes = b"", timeout_s: float = 5.0
    ) -> tuple[int, bytes]:
        """A small control call read whole within `timeout_s`: (status, body)."""
        headers = [(b"content-type", b"application/json")] if body else None
        try:
            async with asyncio.timeout(timeout_s):
                response = await self.request(base, method, path, body, headers, timeout_s)
                try:
                    return response.status, await response.read()
                finally:
                    response.close()
        except TimeoutError:
            raise Broken(f"{method.decode()} {path.decode()} timed out") from None

    async def call_json(
        self, base: str, method: bytes, path: bytes, doc: Any = None, timeout_s: float = 5.0
    ) -> tuple[int, Any]:
        """A control call with a JSON body and answer; the answer is None if not JSON."""
        body = b"" if doc is None else json.dumps(doc, separators=(",", ":")).encode()
        status, content = await self.call(base, method, path, body, timeout_s)
        try:
            return status, json.loads(content)
        except ValueError:
            return status, None

    def close(self) -> None:
        for origin in self._origins.values():
            while origin.idle:
                origin.idle.pop().abort()


def _head(
    origin: Origin,
    method: bytes,
    path: bytes,
    body: bytes,
    headers: list[tuple[bytes, bytes]] | None,
) -> bytes:
    lines = [
        method + b" " + origin.prefix + path + b" HTTP/1.1",
        b"host: " + origin.host_header,
        b"content-length: " + str(len(body)).encode(),
    ]
    for name, value in headers or ():
        if b"\r" in value or b"\n" in value or b"\r" in name or b"\n" in name:
            raise InvalidRequest(f"header {name!r} has a line break")
        lines.append(name + b": " + value)
    lines.append(b"\r\n")
    return b"\r\n".join(lines)
