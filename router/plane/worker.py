"""A data-plane worker process: serves the router's port and relays bytes.

`mori serve` runs one policy owner and N of these (`workers`, default: the machine's
cores), all accepting on one listening socket. A worker parses requests, asks the owner
where each goes (router/protocol/link.py), forwards and relays (router/plane/relay.py), and
passes every other endpoint (admin API, /health, /metrics) to the owner's HTTP server
unchanged. It keeps no policy state: what it knows of the replicas is which ones the owner drained.

    python -m router.plane.worker LISTEN_FD LINK_FD    (started by router/owner/process.py)
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Coroutine
from typing import Any

from router.config import RouterConfig
from router.engines.outliers import Attempts
from router.engines.replicas import make_replicas, make_upstream
from router.plane.relay import JSON, KIND_OF_PATH, Relay, RelayKit, read_body
from router.protocol.auth import Auth
from router.protocol.intake import Intake
from router.protocol.link import (
    ATTEMPT,
    CANCEL,
    DRAINED,
    ERROR,
    GO,
    HELLO,
    REJOINED,
    ROUTE,
    SILENT,
    Link,
    LocalLink,
    Outcome,
    Ticket,
    connect,
)
from router.wire.errors import ApiError
from router.wire.server import Request, Server, Timeouts
from router.wire.upstream import Upstream, UpstreamError

log = logging.getLogger("mori.worker")

HOP_HEADERS = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"host"}
HOP_HEADERS |= {b"expect", b"upgrade", b"te", b"trailer", b"proxy-connection"}
STOP_GRACE_S = 10.0


class OwnerLink:
    """The worker's end of the link: one pending instruction per request in flight."""

    def __init__(self, worker: Worker | None, link: LocalLink | None = None) -> None:
        self.worker = worker  # None until the owner's HELLO configured it
        self.link: Link | LocalLink = link or Link(self.on_message, self._on_lost)
        self.hello: asyncio.Future[tuple[Any, ...]] = asyncio.get_running_loop().create_future()
        self.lost = asyncio.Event()
        self._seq = 0
        self._waiting: dict[int, asyncio.Future[tuple[int, Any]]] = {}

    def open(self, ticket: Ticket) -> int:
        self._seq += 1
        self.link.send((GO, self._seq, ticket))
        return self._seq

    async def next(self, seq: int) -> tuple[int, Any]:
        """The owner's next word on the request: (ROUTE, url) or (ERROR, ApiError)."""
        if self.link.closed:
            raise ApiError(503, "the router is shutting down", code="unavailable")
        future = self._waiting[seq] = asyncio.get_running_loop().create_future()
        return await future

    def report(self, seq: int, outcome: Outcome) -> None:
        """An attempt's outcome (a retry's request waits for the owner's next word)."""
        self.link.send((ATTEMPT, seq, outcome))

    def cancel(self, seq: int) -> None:
        self.link.send((CANCEL, seq))

    def forget(self, seq: int) -> None:
        self._waiting.pop(seq, None)

    def on_message(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        assert self.worker is not None or kind == HELLO
        if kind in (ROUTE, ERROR):
            future = self._waiting.pop(message[1], None)
            if future is not None and not future.done():  # else the client already left
                future.set_result((kind, message[2]))
        elif kind == DRAINED:
            self.worker.on_drained(message[1], message[2])
        elif kind == REJOINED:
            self.worker.drained.discard(message[1])
        elif kind == HELLO and not self.hello.done():
            self.hello.set_result(message)

    def _on_lost(self) -> None:
        for future in self._waiting.values():
            if not future.done():
                future.set_result((ERROR, ApiError(503, "the router is shutting down")))
        self._waiting.clear()
        self.lost.set()


class Worker:
    """What one data-plane process serves with."""

    def __init__(
        self,
        config: RouterConfig,
        admin_url: str,
        link: OwnerLink,
        upstream: Upstream,
        anchors: bool = False,
    ) -> None:
        self.config = config
        self.admin_url = admin_url
        self.link = link
        self.upstream = upstream
        self.replicas = make_replicas(config, self.upstream)
        self.auth = Auth(config)
        self.intake = Intake(config.worker_parse_bytes)
        self.attempts = Attempts(time.monotonic, config.stall_s)
        self.drained: set[str] = set()
        self._background: set[asyncio.Task] = set()
        self.kit = RelayKit(  # what each request's relay reads
            link=link,
            auth=self.auth,
            intake=self.intake,
            attempts=self.attempts,
            upstream=upstream,
            replicas=self.replicas,
            spawn=self.spawn,
            max_body_bytes=config.max_body_bytes,
            body_timeout_s=config.body_timeout_s,
            anchors=anchors,  # tickets carry request anchors (the owner's policy warms them)
        )

    def handle(self, request: Request) -> Awaitable[None]:
        """The request's handler coroutine, returned rather than awaited here: every
        resumption of a request's task passes through each coroutine frame it is nested
        in, so the dispatch adds none."""
        kind = KIND_OF_PATH.get(request.path)
        if kind is None:
            return self._to_owner(request)
        if request.method == b"POST":
            return Relay(self.kit, request, kind).run()
        return self._not_allowed(request, kind)

    async def _not_allowed(self, request: Request, kind: str) -> None:
        error = ApiError(405, f"{request.path.decode()} takes POST", code="method_not_allowed")
        anthropic = kind == "messages"
        request.conn.send(405, [JSON, (b"allow", b"POST")], error.body(anthropic))

    async def _to_owner(self, request: Request) -> None:
        """Every other endpoint is the owner's: relay the request and its answer as they
        are (a HEAD goes as a GET, whose body the server leaves out: the owner's routes
        answer GET, and a HEAD's answer must be the head of that)."""
        conn = request.conn
        try:
            body = await read_body(request, self.config.max_body_bytes, self.config.body_timeout_s)
        except ApiError as e:
            conn.send(e.status, [JSON], e.body(request.path.startswith(b"/v1/messages")))
            return
        headers = [(k, v) for k, v in request.headers if k not in HOP_HEADERS]
        method = b"GET" if request.method == b"HEAD" else request.method
        try:
            response = await self.upstream.request(
                self.admin_url, method, request.target, body, headers
            )
            try:
                content = await response.read()
            finally:
                response.close()
        except UpstreamError:
            error = ApiError(503, "the router is not ready", code="unavailable")
            conn.send(503, [JSON], error.body())
            return
        answer = [(k, v) for k, v in response.headers if k not in HOP_HEADERS]
        conn.send(response.status, answer, content)

    # outliers --------------------------------------------------------------------------
    def on_drained(self, url: str, why: str) -> None:
        self.drained.add(url)
        self.attempts.cut_silent(url, why)

    async def watch(self) -> None:
        """Every stall_s / 4: silent requests on a drained replica are cut; silence on a
        serving one is reported to the owner, which probes the replica."""
        while True:
            await asyncio.sleep(self.config.stall_s / 4)
            for url in self.attempts.silent():
                if url in self.drained:
                    self.attempts.cut_silent(url, "replica drained and silent")
                else:
                    self.link.link.send((SILENT, url))

    def spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        """A fire-and-forget job (an engine abort) that must outlive its request."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def run(self, listen: socket.socket, stop: asyncio.Event) -> None:
        """Serve the listening socket until `stop` (or the owner is gone), then let the
        requests in flight finish."""
        timeouts = Timeouts(self.config.header_timeout_s, self.config.keepalive_timeout_s)
        server = Server(self.handle, self.config.max_body_bytes, timeouts)
        await server.start(listen)
        _tune_gc()
        watch = asyncio.create_task(self.watch())
        stopped, lost = asyncio.create_task(stop.wait()), asyncio.create_task(self.link.lost.wait())
        await asyncio.wait([stopped, lost], return_when="FIRST_COMPLETED")
        await server.stop(STOP_GRACE_S)
        for task in (watch, stopped, lost):
            task.cancel()
        if self._background:
            await asyncio.wait(self._background, timeout=2.0)
        self.intake.close()


GC_YOUNG = 10_000  # allocations between young collections (CPython's default: 700)


def _tune_gc() -> None:
    """The cyclic collector, for a server: what starting made (modules, config, policy,
    metrics) lives as long as the process, so it is frozen out of the collector's reach
    (a full pass walked it: ~20 ms each); and a young collection waits for more
    allocations than the few thousand objects the requests in flight hold (at the default,
    most young passes found only those alive). Under load the collector took ~4 % of the
    CPU, now ~0.3 % (bench/router_vs_gateway.py, 50 streams)."""
    gc.freeze()
    gc.set_threshold(GC_YOUNG)


async def serve(listen_fd: int, link_fd: int) -> None:
    """A worker process: configured by the owner's HELLO, stopped by SIGTERM/SIGINT."""
    owner = OwnerLink(None)
    await connect(socket.socket(fileno=link_fd), owner.link)  # type: ignore[arg-type]
    _, config, admin_url, anchors = await owner.hello
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    upstream = make_upstream(config)
    worker = owner.worker = Worker(config, admin_url, owner, upstream, anchors)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await worker.run(socket.socket(fileno=listen_fd), stop)
    upstream.close()
    owner.link.close()


def main() -> None:
    listen_fd, link_fd = int(sys.argv[1]), int(sys.argv[2])
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        asyncio.run(serve(listen_fd, link_fd))
        return
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve(listen_fd, link_fd))


if __name__ == "__main__":
    main()
