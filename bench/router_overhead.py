"""Router overhead: the same streamed chat load sent straight to an emulated replica and
through `mori serve`, side by side.

    python bench/router_overhead.py --concurrency 200 --seconds 10

Targets (MORI router, 2 cores): added latency p50 <= 1 ms, p99 <= 5 ms, >= 1500 req/s.
The emulator runs at a high time scale so engine time is negligible; the load comes from
`--workers` processes, each running `concurrency / workers` closed-loop streams (one
program per stream). A one-stream phase shows the per-request overhead without queueing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.servers import free_port, mori, spawn  # noqa: E402

TARGETS = {"p50_ms": 1.0, "p99_ms": 5.0, "rps": 1500.0}

STUB_SSE = b"".join(
    b'data: {"id":"s","object":"chat.completion.chunk","created":0,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"hi "},"finish_reason":null}]}\n\n'
    for _ in range(4)
) + (
    b'data: {"id":"s","object":"chat.completion.chunk","created":0,"model":"m","choices":[],'
    b'"usage":{"prompt_tokens":9,"completion_tokens":4,"total_tokens":13}}\n\ndata: [DONE]\n\n'
)


class StubEngine(asyncio.Protocol):
    """A near-zero-cost SGLang stand-in (keep-alive HTTP/1.1, fixed answers), so the
    router's own cost is what the comparison shows."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            head, rest = self.buffer.split(b"\r\n\r\n", 1)
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(rest) < length:
                return
            self.buffer = rest[length:]
            self._answer(head.split(b" ", 2)[1])

    delay_s = 0.0  # mean engine time per inference answer (--engine-delay-ms)

    def _answer(self, path: bytes) -> None:
        if path.startswith(b"/v1/") and path != b"/v1/models":
            body, ctype = b"%x\r\n%s\r\n0\r\n\r\n" % (len(STUB_SSE), STUB_SSE), b"text/event-stream"
            head = b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n"
            answer = head % ctype + body
            if self.delay_s:
                # uniform +-50%: equal delays would march 200 streams in lock-step bursts
                delay = self.delay_s * random.uniform(0.5, 1.5)
                asyncio.get_running_loop().call_later(delay, self.transport.write, answer)
            else:
                self.transport.write(answer)  # type: ignore[attr-defined]
            return
        body = b'{"max_total_num_tokens": 10000000, "hicache_host_tokens": 20000000}'
        if path == b"/v1/models":  # a gateway learns its workers' model here
            body = b'{"object": "list", "data": [{"id": "stub", "object": "model"}]}'
        elif path.startswith(b"/mori/hints"):
            body = b'{"epoch": 0, "stale": false, "residency": {}}'
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        self.transport.write(head % len(body) + body)  # type: ignore[attr-defined]


def run_stub(port: int, delay_ms: float) -> None:
    StubEngine.delay_s = delay_ms / 1000

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(StubEngine, "127.0.0.1", port, backlog=4096)
        await server.serve_forever()

    asyncio.run(serve())


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, float]:
    """One streamed request: (time to first byte, time to last byte) in seconds."""
    started = time.perf_counter()
    first = None
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for _ in r.aiter_raw():
            if first is None:
                first = time.perf_counter() - started
    return first or 0.0, time.perf_counter() - started


async def _worker_main(base: str, streams: int, seconds: float, warmup: float, tag: str) -> list:
    url = base + "/v1/chat/completions"
    samples: list[tuple[float, float]] = []
    errors = done = 0
    begin = time.perf_counter()
    record_from, stop_at = begin + warmup, begin + warmup + seconds

    async def loop(i: int) -> None:
        # One client per stream: httpcore scans its whole pool on every request.
        async with httpx.AsyncClient(timeout=30) as client:
            nonlocal errors, done
            body = {
                "model": "default",
                "messages": [{"role": "user", "content": f"bench {tag} {i}: say hi"}],
                "max_tokens": 4,
                "stream": True,
                "program_id": f"{tag}-{i}",
            }
            while (now := time.perf_counter()) < stop_at:
                try:
                    sample = await _stream(client, url, body)
                except httpx.HTTPError:
                    errors += 1
                    continue
                done += 1
                if now >= record_from:
                    samples.append(sample)

    await asyncio.gather(*(loop(i) for i in range(streams)))
    return [samples, errors, done]


def _worker(args: tuple) -> list:
    return asyncio.run(_worker_main(*args))


def in_processes(job, base: str, streams: int, procs: int, seconds: float, warmup: float) -> list:
    """`streams` closed loops split over `procs` spawned processes (one: this process);
    `job((base, streams, seconds, warmup, tag))` runs each share; their results."""
    procs = max(1, min(procs, streams))
    shares = [streams // procs + (i < streams % procs) for i in range(procs)]
    jobs = [(base, n, seconds, warmup, f"s{streams}p{i}") for i, n in enumerate(shares)]
    if procs == 1:
        return [job(jobs[0])]
    with mp.get_context("spawn").Pool(procs) as pool:
        return pool.map(job, jobs)


def run_load(base: str, concurrency: int, workers: int, seconds: float, warmup: float) -> dict:
    results = in_processes(_worker, base, concurrency, workers, seconds, warmup)
    samples = [s for r in results for s in r[0]]
    errors = sum(r[1] for r in results)
    done = sum(r[2] for r in results)
    latencies = sorted(s[1] for s in samples)
    if not latencies:
        return {"rps": 0.0, "p50_ms": float("nan"), "p99_ms": float("nan"), "ttft_ms": 0.0,
                "errors": errors, "n": 0, "done": done}  # fmt: skip
    return {
        "rps": len(latencies) / seconds,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "ttft_ms": 1000 * statistics.median(s[0] for s in samples),
        "errors": errors,
        "n": len(latencies),
        "done": done,
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far, all its threads (robust to other load)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """A process's child processes (none once it is gone)."""
    with contextlib.suppress(OSError):
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


def tree_cpu(pid: int) -> float:
    """CPU seconds of a process and its children (MORI's owner and workers)."""
    return cpu_seconds(pid) + sum(tree_cpu(child) for child in children(pid))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--workers", type=int, default=2, help="load generator processes")
    parser.add_argument("--time-scale", default="1000", help="emulator speed-up")
    parser.add_argument(
        "--engine",
        choices=("stub", "emulator"),
        default="stub",
        help="stub: near-zero-cost engine (isolates the router); emulator: `mori emulate`",
    )
    parser.add_argument("--policy", default="mori")
    parser.add_argument(
        "--engine-delay-ms",
        type=float,
        default=0.0,
        help="stub engine time per answer (mean; uniform +-50%%): with 200 streams at 250 ms "
        "the offered load (~800 req/s) stays under the router's capacity, so 'added' is "
        "overhead, not saturation queueing",
    )
    args = parser.parse_args()

    console = Console(width=140)
    emu_port, router_port = free_port(), free_port()
    emu = f"http://127.0.0.1:{emu_port}"
    env = {"MORI_LOG_LEVEL": "warning", "MORI_TICK_S": "5"}
    if args.engine == "stub":
        engine = [sys.executable, __file__, "--stub-port", str(emu_port), str(args.engine_delay_ms)]
    else:
        engine = mori("emulate", "--port", str(emu_port), "--time-scale", args.time_scale)
    with (
        spawn(engine, emu_port, health_path="/health"),
        spawn(
            mori("serve", "--replicas", emu, "--port", str(router_port), "--policy", args.policy),
            router_port,
            env=env,
        ) as router_proc,
    ):
        base = f"http://127.0.0.1:{router_port}"
        rows = []
        for label, concurrency, workers in (
            ("1 stream", 1, 1),
            (f"{args.concurrency} streams", args.concurrency, args.workers),
        ):
            direct = run_load(emu, concurrency, workers, args.seconds, args.warmup)
            before = cpu_seconds(router_proc.pid)
            routed = run_load(base, concurrency, workers, args.seconds, args.warmup)
            routed["cpu_ms"] = (
                1000 * (cpu_seconds(router_proc.pid) - before) / max(1, routed["done"])
            )
            rows.append((label, direct, routed))

    engine_name = args.engine
    if args.engine_delay_ms:
        engine_name += f", {args.engine_delay_ms:g} ms per answer"
    title = f"router overhead vs {engine_name} ({os.cpu_count()} cores, {platform.machine()})"
    table = Table(title=title)
    columns = ("load", "path", "req/s", "p50 ms", "p99 ms", "TTFT p50 ms", "router CPU ms/req")
    for col in (*columns, "errors"):
        table.add_column(col, justify="right")
    for label, direct, routed in rows:
        for path, r in (("direct", direct), ("router", routed)):
            table.add_row(
                label, path, f"{r['rps']:.0f}", f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}",
                f"{r['ttft_ms']:.2f}", f"{r['cpu_ms']:.3f}" if "cpu_ms" in r else "",
                str(r["errors"]),
            )  # fmt: skip
        table.add_row(
            label,
            "added",
            f"{routed['rps'] / direct['rps']:.2f}x" if direct["rps"] else "-",
            f"{routed['p50_ms'] - direct['p50_ms']:+.2f}",
            f"{routed['p99_ms'] - direct['p99_ms']:+.2f}",
            f"{routed['ttft_ms'] - direct['ttft_ms']:+.2f}",
            f"max {1000 / routed['cpu_ms']:.0f} req/s/core" if routed.get("cpu_ms") else "",
            "",
        )
    console.print(table)
    single, loaded = rows[0], rows[1]
    console.print(
        f"targets: added p50 <= {TARGETS['p50_ms']} ms "
        f"(1 stream: {single[2]['p50_ms'] - single[1]['p50_ms']:+.2f} ms), "
        f"added p99 <= {TARGETS['p99_ms']} ms "
        f"(1 stream: {single[2]['p99_ms'] - single[1]['p99_ms']:+.2f} ms), "
        f">= {TARGETS['rps']:.0f} req/s (router at {args.concurrency} streams: "
        f"{loaded[2]['rps']:.0f})"
    )
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--stub-port"]:
        run_stub(int(sys.argv[2]), float(sys.argv[3]))
    sys.exit(main())
