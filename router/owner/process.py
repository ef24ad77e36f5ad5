"""The policy owner: the one process that holds the router's state, and its workers.

`mori serve` runs here. The owner keeps everything a placement decision reads or writes
in one place (the policy's programs and tiers, the gate and turns, hints, health, the
outlier streaks, the metrics) and serves the admin API on a private loopback port. The
public port is served by `workers` data planes (router/plane/worker.py) sharing one listening
socket: one in the owner's own process, whose decisions are direct calls, and
`workers - 1` processes, whose requests each cost one decision round trip on a
socketpair (`GO` -> `ROUTE`, then `ATTEMPT`); the bytes never pass through the owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import uvicorn

from router.config import RouterConfig
from router.owner.api import create_app
from router.owner.controller import Router
from router.owner.exchange import Exchange
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

log = logging.getLogger("mori.owner")

STOP_GRACE_S = 10.0


class WorkerLink:
    """The owner's end of one worker's link: runs an `Exchange` per request it sends."""

    def __init__(self, router: Router, on_lost: Any, link: LocalLink | None = None) -> None:
        self.router = router
        self.link: Link | LocalLink = link or Link(self.on_message, self._lost)
        self._on_lost = on_lost
        self._tasks: dict[int, asyncio.Task] = {}
        self._attempts: dict[int, asyncio.Future[Outcome]] = {}

    def tell(self, url: str, why: str | None) -> None:
        """A replica was drained (why) or rejoined (None)."""
        self.link.send((REJOINED, url) if why is None else (DRAINED, url, why))

    def on_message(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == GO:
            seq = message[1]
            task = asyncio.get_running_loop().create_task(self._serve(seq, message[2]))
            self._tasks[seq] = task
        elif kind == ATTEMPT:
            future = self._attempts.pop(message[1], None)
            if future is not None and not future.done():
                future.set_result(message[2])
        elif kind == CANCEL:
            task = self._tasks.get(message[1])
            if task is not None:
                task.cancel()
        elif kind == SILENT:
            self.router.on_silent(message[1])

    async def _serve(self, seq: int, ticket: Ticket) -> None:
        exchange = Exchange(self.router, ticket, functools.partial(self._forward, seq))
        try:
            error = await exchange.run()
        except asyncio.CancelledError:  # the client left (CANCEL) or the worker is gone
            return
        finally:
            self._tasks.pop(seq, None)
        if error is not None:
            self.link.send((ERROR, seq, error))

    async def _forward(self, seq: int, url: str) -> Outcome:
        future = self._attempts[seq] = asyncio.get_running_loop().create_future()
        self.link.send((ROUTE, seq, url))
        try:
            return await future
        finally:
            self._attempts.pop(seq, None)

    def _lost(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        self._on_lost(self)


class Workers:
    """Starts the data-plane workers on the public socket, restarts one that dies."""

    def __init__(self, router: Router, config: RouterConfig, listen: socket.socket) -> None:
        self.router, self.config, self.listen = router, config, listen
        self.admin_url = ""
        self.procs: dict[WorkerLink, subprocess.Popen] = {}
        self.stopping = False

    async def start(self, count: int, admin_url: str) -> None:
        self.admin_url = admin_url
        self.router.listeners.append(self._tell)
        for _ in range(count):
            await self._spawn()

    async def _spawn(self) -> None:
        ours, theirs = socket.socketpair()
        fds = (self.listen.fileno(), theirs.fileno())
        proc = subprocess.Popen(
            [sys.executable, "-m", "router.plane.worker", *map(str, fds)], pass_fds=fds
        )
        theirs.close()
        link = WorkerLink(self.router, self._lost)
        await connect(ours, link.link)
        # the config object as is: validating a dump again would scale its timers twice
        link.link.send((HELLO, self.config, self.admin_url, self.router.wants_anchors))
        self.procs[link] = proc

    def _tell(self, url: str, why: str | None) -> None:
        for link in self.procs:
            link.tell(url, why)

    def _lost(self, link: WorkerLink) -> None:
        proc = self.procs.pop(link, None)
        if self.stopping or proc is None:
            return
        self.router.spawn(self._respawn(proc))

    async def _respawn(self, proc: subprocess.Popen) -> None:
        await asyncio.get_running_loop().run_in_executor(None, proc.wait)
        if self.stopping:  # a SIGTERM to the process group reached the worker first
            return
        log.error("data-plane worker %d exited (%s); starting another", proc.pid, proc.returncode)
        await asyncio.sleep(0.5)  # a worker that dies at start must not spin
        if not self.stopping:
            await self._spawn()

    async def stop(self) -> None:
        """SIGTERM every worker (each finishes its requests first), then wait for them."""
        self.stopping = True
        procs = list(self.procs.values())
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        for proc in procs:
            try:
                await asyncio.wait_for(loop.run_in_executor(None, proc.wait), STOP_GRACE_S + 2)
            except TimeoutError:
                proc.kill()


class _AdminServer(uvicorn.Server):
    """uvicorn for the admin API, with the owner handling the signals (workers first)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def listen_socket(host: str, port: int) -> socket.socket:
    """The public listening socket, shared by every worker."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(4096)
    sock.set_inheritable(True)
    return sock


def worker_count(config: RouterConfig) -> int:
    return config.workers or len(os.sched_getaffinity(0))


async def serve(config: RouterConfig) -> None:
    """Run the router until SIGTERM/SIGINT: owner, admin API, workers."""
    app = create_app(config)
    router: Router = app.state.router
    listen = listen_socket(config.host, config.port)
    admin = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    admin.bind(("127.0.0.1", 0))
    admin_url = f"http://127.0.0.1:{admin.getsockname()[1]}"
    server = _AdminServer(
        uvicorn.Config(
            app,
            log_level=config.log_level,
            access_log=False,
            timeout_graceful_shutdown=STOP_GRACE_S,
            lifespan="on",
        )
    )
    workers = Workers(router, config, listen)
    stop = asyncio.Event()

    def on_signal() -> None:  # workers get the signal too: none of them is restarted now
        workers.stopping = True
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    admin_task = asyncio.create_task(server.serve(sockets=[admin]))
    while not server.started and not admin_task.done():
        await asyncio.sleep(0.02)
    if server.started:
        count = worker_count(config)
        log.info(
            "router on %s:%d: %d data-plane worker(s), policy %s",
            config.host,
            config.port,
            count,
            config.policy,
        )
        await workers.start(count - 1, admin_url)
        local = asyncio.create_task(_in_process_worker(router, config, admin_url, listen, stop))
        await asyncio.wait([local, admin_task], return_when="FIRST_COMPLETED")
        on_signal()
        await asyncio.gather(local, workers.stop())  # both finish their requests
    listen.close()
    server.should_exit = True
    await admin_task


async def _in_process_worker(
    router: Router, config: RouterConfig, admin_url: str, listen: socket.socket, stop: Any
) -> None:
    """One of the data-plane workers runs in the owner's process and event loop, its link
    two direct calls: its requests cost no round trip, and on a machine of N cores the
    router is N processes, not N + 1 (`workers: 1` is one process)."""
    from router.plane.worker import OwnerLink, Worker

    to_worker, to_owner = LocalLink(), LocalLink()
    owner_end = WorkerLink(router, lambda _: None, to_worker)
    worker_end = OwnerLink(None, to_owner)
    to_worker.deliver, to_owner.deliver = worker_end.on_message, owner_end.on_message
    worker = worker_end.worker = Worker(
        config, admin_url, worker_end, router.upstream, router.wants_anchors
    )
    router.listeners.append(owner_end.tell)
    await worker.run(listen, stop)
