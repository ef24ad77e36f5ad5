"""The data path's parts, measured one at a time: upstream clients and server paths.

    python bench/router_vs_gateway.py --clients    # httpx (tuned) / aiohttp / thin client
    python bench/router_vs_gateway.py --servers    # uvicorn + httptools + uvloop / lean server

Clients: each candidate runs in its own process against the stub engine (another process)
with 50 concurrent streamed requests; the figure is the client process's CPU per request.
httpx is "tuned" as the router used it: a pre-built request straight into one
`AsyncHTTPTransport` per stream (a shared pool scans every connection per request).
aiohttp is taken from `--aiohttp-python` (default ~/.cache/mori-clients, a venv with aiohttp
installed beside the project's packages) and skipped when absent.
Servers: each candidate serves the stub's streamed answer, as the router's front end
would; the load is the thin client in another process; the figure is the server
process's CPU per request. Candidates alternate, `--reps` times.
"""

from __future__ import annotations

import asyncio
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
from bench.router_overhead import STUB_SSE, cpu_seconds  # noqa: E402
from tests.servers import free_port  # noqa: E402

AIOHTTP_PYTHON = Path.home() / ".cache/mori-clients/bin/python"
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
ANSWER_HEADERS = [(b"content-type", b"text/event-stream")]


async def _asgi_app(scope, receive, send) -> None:  # noqa: ANN001 - the ASGI signature
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": ANSWER_HEADERS})
    await send({"type": "http.response.body", "body": STUB_SSE, "more_body": False})


def _serve_uvicorn(port: int) -> None:
    import uvicorn

    uvicorn.run(
        _asgi_app, port=port, loop="uvloop", http="httptools", log_level="error", access_log=False
    )


def _serve_lean(port: int) -> None:
    import socket

    import uvloop

    from router.wire.server import Server

    async def handler(request) -> None:  # noqa: ANN001
        await request.body(1 << 20, 30.0)
        request.conn.start(200, ANSWER_HEADERS)
        request.conn.end(STUB_SSE)

    async def main() -> None:
        sock = socket.create_server(("127.0.0.1", port), backlog=4096)
        await Server(handler, 1 << 20).start(sock)
        await asyncio.Event().wait()

    uvloop.run(main())


SERVERS = {"uvicorn + httptools + uvloop (ASGI)": _serve_uvicorn, "lean server": _serve_lean}


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
    python = str(AIOHTTP_PYTHON) if name == "aiohttp" else sys.executable
    if name == "aiohttp" and not AIOHTTP_PYTHON.exists():
        return None
    proc = _run(["--client", name, base], python)
    out, _ = proc.communicate()
    done, cpu = json.loads(out)
    return 1000 * cpu / max(1, done)


def _server_row(name: str) -> float:
    port = free_port()
    proc = _run(["--server", name, str(port)])
    try:
        _wait_port(port)
        load = _run(["--client", "thin client", f"http://127.0.0.1:{port}"])
        before = cpu_seconds(proc.pid)
        out, _ = load.communicate()
        done, _ = json.loads(out)
        return 1000 * (cpu_seconds(proc.pid) - before) / max(1, done)
    finally:
        proc.kill()
        proc.wait()


def compare(clients: bool, servers: bool, reps: int, console: Console) -> None:
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
                for name in SERVERS:
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
    load = os.getloadavg()
    console.print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


if __name__ == "__main__":
    if sys.argv[1] == "--client":
        import uvloop

        started = time.process_time()
        count = uvloop.run(CLIENTS[sys.argv[2]](sys.argv[3]))
        print(json.dumps([count, time.process_time() - started]))
    elif sys.argv[1] == "--server":
        SERVERS[sys.argv[2]](int(sys.argv[3]))
