"""The data path's parts, measured one at a time: upstream clients and HTTP servers.

    python bench/router_vs_gateway.py --clients    # httpx (tuned) / aiohttp / thin client
    python bench/router_vs_gateway.py --servers    # lean server / uvicorn / granian / aiohttp
    python bench/router_vs_gateway.py --servers --probes   # + each server's HTTP behaviour

Clients: each candidate runs in its own process against the stub engine (another process)
with 50 concurrent streamed requests; the figure is the client process's CPU per request.
httpx is "tuned" as the router used it: a pre-built request straight into one
`AsyncHTTPTransport` per stream (a shared pool scans every connection per request).
Servers: each candidate serves the stub's streamed answer, as the router's front end
would; the load is the thin client in another process; the figure is the server's CPU per
request (all its processes and threads). Candidates alternate, `--reps` times.
Probes (`--probes`): what a front end must get right out of the box, on raw sockets read
by h11: HEAD (no body), an HTTP/1.0 client's stream, a slow head and an idle kept-alive
connection (closed, and after how long), and a 413 to a client that writes its whole
oversize body before it reads (the answer, not a reset).

aiohttp and granian come from `--candidates-python` (default ~/.cache/mori-candidates, a
venv made with --system-site-packages, so it sees the project's packages:
`python -m venv --system-site-packages ~/.cache/mori-candidates &&
~/.cache/mori-candidates/bin/pip install aiohttp 'granian==2.8.*'`); candidates that
need it are skipped when it is absent.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.router_overhead import STUB_SSE, children, tree_cpu  # noqa: E402
from tests.servers import free_port  # noqa: E402

CANDIDATES_PYTHON = Path.home() / ".cache/mori-candidates/bin/python"
STREAMS, SECONDS = 50, 4.0
BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()


# --- clients --------------------------------------------------------------------------------
async def _drive(one, seconds: float) -> int:
    """STREAMS closed loops of `one(i)` for `seconds`; requests completed."""
    done = 0
    stop_at = time.perf_counter() + seconds

    async def loop(i: int) -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await one(i)
            done += 1

    await asyncio.gather(*(loop(i) for i in range(STREAMS)))
    return done


async def _thin(base: str) -> int:
    from router.wire.upstream import Upstream

    client = Upstream(5.0, 30.0)
    headers = [(b"content-type", b"application/json")]

    async def one(i: int) -> None:
        response = await client.request(base, b"POST", b"/v1/chat/completions", BODY, headers)
        async for _ in response:
            pass
        response.close()

    return await _drive(one, SECONDS)


async def _httpx(base: str) -> int:
    import httpx

    url = httpx.URL(base + "/v1/chat/completions")
    pools = [httpx.AsyncHTTPTransport() for _ in range(STREAMS)]
    ext = {"timeout": httpx.Timeout(30.0).as_dict()}

    async def one(i: int) -> None:
        request = httpx.Request(
            "POST", url, content=BODY, headers={"content-type": "application/json"}, extensions=ext
        )
        response = await pools[i].handle_async_request(request)
        async for _ in response.aiter_raw():
            pass
        await response.aclose()

    return await _drive(one, SECONDS)


async def _aiohttp(base: str) -> int:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(i: int) -> None:
            async with session.post(base + "/v1/chat/completions", data=BODY) as response:
                async for _ in response.content.iter_any():
                    pass

        return await _drive(one, SECONDS)


CLIENTS = {"httpx (tuned)": _httpx, "aiohttp": _aiohttp, "thin client": _thin}


# --- servers --------------------------------------------------------------------------------
# Each candidate serves what the router's front end serves: a streamed answer (the stub's SSE)
# to a POSTed body, and a 413 without reading a body declared over LIMIT. Settings are each
# server's defaults, with the timeouts it offers set as the router sets its own.
ANSWER_HEADERS = [(b"content-type", b"text/event-stream")]
LIMIT = 1 << 20


def _too_large(headers) -> bool:  # noqa: ANN001 - (name, value) pairs, bytes or str
    for name, value in headers:
        if name.lower() in (b"content-length", "content-length"):
            return int(value) > LIMIT
    return False


async def _asgi_app(scope, receive, send) -> None:  # noqa: ANN001 - the ASGI signature
    if scope["type"] != "http":
        return
    if _too_large(scope["headers"]):
        await send({"type": "http.response.start", "status": 413, "headers": []})
        await send({"type": "http.response.body", "body": b"too large"})
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": ANSWER_HEADERS})
    await send({"type": "http.response.body", "body": STUB_SSE, "more_body": False})


async def _rsgi_app(scope, proto) -> None:  # noqa: ANN001 - the RSGI signature
    if _too_large(scope.headers.items()):
        proto.response_bytes(413, [], b"too large")
        return
    await proto()
    stream = proto.response_stream(200, [("content-type", "text/event-stream")])
    await stream.send_bytes(STUB_SSE)


def _serve_uvicorn(port: int) -> None:
    import uvicorn

    uvicorn.run(
        _asgi_app, port=port, loop="uvloop", http="httptools", log_level="error", access_log=False
    )


def _serve_granian(port: int, interface: str) -> None:
    from granian import Granian
    from granian.constants import HTTPModes, Interfaces, Loops
    from granian.http import HTTP1Settings

    target = "_asgi_app" if interface == "asgi" else "_rsgi_app"
    Granian(
        f"bench.data_path_candidates:{target}", address="127.0.0.1", port=port,
        interface=Interfaces(interface), workers=1, runtime_threads=1, loop=Loops.uvloop,
        http=HTTPModes.http1, http1_settings=HTTP1Settings(header_read_timeout=10_000),
        log_enabled=False, backlog=4096, working_dir=ROOT,
    ).serve()  # fmt: skip


def _serve_aiohttp(port: int) -> None:
    import uvloop
    from aiohttp import web

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        if (request.content_length or 0) > LIMIT:
            return web.Response(status=413, body=b"too large")
        await request.read()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(STUB_SSE)
        await response.write_eof()
        return response

    async def main() -> None:
        server = web.Server(handler, keepalive_timeout=15.0)
        runner = web.ServerRunner(server, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=4096).start()
        await asyncio.Event().wait()

    uvloop.run(main())


def _serve_lean(port: int) -> None:
    import socket

    import uvloop

    from router.wire.server import Server

    async def handler(request) -> None:  # noqa: ANN001
        declared = request.header(b"content-length")
        if declared is not None and int(declared) > LIMIT:
            request.conn.send(413, [], b"too large")
            return
        await request.body(LIMIT, 30.0)
        request.conn.start(200, ANSWER_HEADERS)
        request.conn.end(STUB_SSE)

    async def main() -> None:
        sock = socket.create_server(("127.0.0.1", port), backlog=4096)
        await Server(handler, LIMIT).start(sock)  # default Timeouts: 10 s head, 15 s idle
        await asyncio.Event().wait()

    uvloop.run(main())


SERVERS = {  # name -> (serve(port), needs the candidates' venv)
    "lean server (router/wire/server.py)": (_serve_lean, False),
    "uvicorn + httptools + uvloop (ASGI)": (_serve_uvicorn, False),
    "granian 2.8 RSGI": (functools.partial(_serve_granian, interface="rsgi"), True),
    "granian 2.8 ASGI": (functools.partial(_serve_granian, interface="asgi"), True),
    "aiohttp 3 low-level server": (_serve_aiohttp, True),
}


# --- HTTP probes: what a production front end must get right on its own -----------------------
PROBE_CAP_S = 40.0  # a connection still open after this is reported as held


def _h11_answer(sock, method: str = "POST", to_close: bool = True) -> tuple[int, bytes, bytes]:  # noqa: ANN001
    """(status, body, bytes after it until the close: none read unless `to_close`) as h11,
    strict, reads them."""
    import h11

    parser = h11.Connection(h11.CLIENT)
    parser.send(h11.Request(method=method, target="/", headers=[("host", "x")]))
    parser.send(h11.EndOfMessage())
    status, body = 0, b""
    while True:
        event = parser.next_event()
        if event is h11.NEED_DATA:
            parser.receive_data(sock.recv(65536))
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            break
    rest = b""
    with contextlib.suppress(OSError):
        while to_close and (chunk := sock.recv(65536)):
            rest += chunk
    return status, body, rest


def _connect(port: int):  # noqa: ANN202
    import socket

    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(PROBE_CAP_S)
    return sock


def _closed_after(sock) -> str:  # noqa: ANN001
    started = time.monotonic()
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return f"held > {PROBE_CAP_S:g} s"
    except OSError:
        pass
    return f"closed after {time.monotonic() - started:.1f} s"


def _probe_head(port: int) -> str:
    with _connect(port) as sock:
        sock.sendall(b"HEAD / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        status, body, rest = _h11_answer(sock, "HEAD")
    return "ok" if status == 200 and not body and not rest else f"{status}, {len(rest)} bytes"


def _probe_http10(port: int) -> str:
    with _connect(port) as sock:
        sock.sendall(b"POST / HTTP/1.0\r\ncontent-length: 2\r\n\r\n{}")
        status, body, rest = _h11_answer(sock)
    return "ok" if status == 200 and body == STUB_SSE and not rest else f"{status} {body[:40]!r}"


def _probe_slow_head(port: int) -> str:
    with _connect(port) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\n")
        return _closed_after(sock)


def _probe_idle(port: int) -> str:
    with _connect(port) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
        status, _, _ = _h11_answer(sock, to_close=False)
        return _closed_after(sock) if status == 200 else f"{status}"


def _probe_oversize(port: int) -> str:
    body = b"x" * (16 * LIMIT)
    with _connect(port) as sock:
        try:
            sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body))
            sock.sendall(body)
            status, _, _ = _h11_answer(sock)
        except OSError as e:
            return f"reset ({type(e).__name__})"
    return "ok" if status == 413 else f"{status}"


PROBES = {
    "HEAD": _probe_head,
    "HTTP/1.0 stream": _probe_http10,
    "slow head": _probe_slow_head,
    "idle keep-alive": _probe_idle,
    "413, body sent whole first": _probe_oversize,
}


def probe(port: int) -> dict[str, str]:
    """Every probe at once (the slow ones wait for the server's timeouts)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(PROBES)) as pool:
        futures = {name: pool.submit(fn, port) for name, fn in PROBES.items()}
        out = {}
        for name, future in futures.items():
            try:
                out[name] = future.result()
            except Exception as e:  # a probe that breaks is a finding, not a crash
                out[name] = f"failed: {type(e).__name__}: {e}"
    return out


# --- driver ---------------------------------------------------------------------------------
def _run(args: list[str], python: str = sys.executable) -> subprocess.Popen:
    return subprocess.Popen(
        [python, __file__, *args], stdout=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


def _wait_port(port: int) -> None:
    import socket

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"port {port} not listening")


def _client_row(name: str, base: str) -> float | None:
    python = str(CANDIDATES_PYTHON) if name == "aiohttp" else sys.executable
    if name == "aiohttp" and not CANDIDATES_PYTHON.exists():
        return None
    proc = _run(["--client", name, base], python)
    out, _ = proc.communicate()
    done, cpu = json.loads(out)
    return 1000 * cpu / max(1, done)


@contextlib.contextmanager
def _server(name: str):  # noqa: ANN202
    """A candidate server on a free port: (port, its process)."""
    port = free_port()
    python = str(CANDIDATES_PYTHON) if SERVERS[name][1] else sys.executable
    proc = _run(["--server", name, str(port)], python)
    try:
        _wait_port(port)
        yield port, proc
    finally:
        for child in children(proc.pid):  # granian's worker process (before it is orphaned)
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, 9)
        proc.kill()
        proc.wait()


def _server_row(name: str) -> float:
    with _server(name) as (port, proc):
        load = _run(["--client", "thin client", f"http://127.0.0.1:{port}"])
        before = tree_cpu(proc.pid)
        out, _ = load.communicate()
        done, _ = json.loads(out)
        return 1000 * (tree_cpu(proc.pid) - before) / max(1, done)


def _available(name: str) -> bool:
    return not SERVERS[name][1] or CANDIDATES_PYTHON.exists()


def compare(clients: bool, servers: bool, reps: int, console: Console, probes: bool = False):
    results: dict[str, list[float]] = {}
    stub = None
    if clients:
        port = free_port()
        stub = subprocess.Popen(
            [sys.executable, str(ROOT / "bench/router_vs_gateway.py"), "--stub-port", str(port)]
        )
        _wait_port(port)
    try:
        for _ in range(reps):
            if clients:
                for name in CLIENTS:
                    ms = _client_row(name, f"http://127.0.0.1:{port}")
                    if ms is not None:
                        results.setdefault(f"client: {name}", []).append(ms)
            if servers:
                for name in filter(_available, SERVERS):
                    results.setdefault(f"server: {name}", []).append(_server_row(name))
    finally:
        if stub is not None:
            stub.kill()
    table = Table(title=f"data path candidates ({STREAMS} streams, {reps} reps, median)")
    for col in ("candidate", "CPU ms per request", "runs"):
        table.add_column(col, justify="right")
    for name, values in results.items():
        runs = " ".join(f"{v:.3f}" for v in values)
        table.add_row(name, f"{statistics.median(values):.3f}", runs)
    console.print(table)
    if servers and probes:
        table = Table(title="HTTP out of the box (raw sockets, answers read by h11)")
        for col in ("server", *PROBES):
            table.add_column(col)
        for name in filter(_available, SERVERS):
            with _server(name) as (port, _):
                table.add_row(name, *probe(port).values())
        console.print(table)
    load = os.getloadavg()
    console.print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="One candidate in its own process, as `python bench/router_vs_gateway.py "
        "--clients` / `--servers` start it (run those for the comparison)."
    )
    parser.add_argument("--client", nargs=2, metavar=("NAME", "URL"), help="drive the stub")
    parser.add_argument("--server", nargs=2, metavar=("NAME", "PORT"), help="serve the stub")
    args = parser.parse_args()
    if args.client:
        import uvloop

        started = time.process_time()
        count = uvloop.run(CLIENTS[args.client[0]](args.client[1]))
        print(json.dumps([count, time.process_time() - started]))
    elif args.server:
        SERVERS[args.server[0]][0](int(args.server[1]))
    else:
        parser.error("name --client or --server")
