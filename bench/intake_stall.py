"""How long a large request body freezes the router's event loop, worker process vs inline.

A client polls `GET /health` (served by the same event loop as everything else) every
5 ms while another sends large bodies of many small JSON objects (the slowest kind to
decode and re-encode). The worst and p99 /health latency during the run show how long
other requests were held; printed side by side for the two modes of one build:
`worker_parse_bytes` 256 KiB (default: large bodies parsed in a worker process) and
`worker_parse_bytes` huge (everything parsed inline, the behaviour before issue 9).

    python bench/intake_stall.py --mib 8 --bodies 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.router_harness import emulator, router  # noqa: E402


def big_body(mib: float) -> bytes:
    items = [{"k": i} for i in range(int(mib * (1 << 20) / 10))]  # ~10 bytes per item
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    return json.dumps({**body, "program_id": "big", "extra": items}).encode()


def measure(base: str, body: bytes, bodies: int) -> dict[str, float]:
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=30) as c:
            while not done.is_set():
                started = time.perf_counter()
                c.get(base + "/health")
                latencies.append(time.perf_counter() - started)
                time.sleep(0.005)

    poller = threading.Thread(target=poll)
    poller.start()
    took = []
    with httpx.Client(timeout=120) as c:
        for _ in range(bodies):
            started = time.perf_counter()
            r = c.post(base + "/v1/chat/completions", content=body)
            took.append(time.perf_counter() - started)
            assert r.status_code == 200, r.text[:200]
    done.set()
    poller.join()
    latencies.sort()
    return {
        "health_max_ms": latencies[-1] * 1000,
        "health_p99_ms": latencies[int(0.99 * (len(latencies) - 1))] * 1000,
        "big_request_s": statistics.median(took),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=8.0, help="body size")
    parser.add_argument("--bodies", type=int, default=5, help="large bodies per mode")
    args = parser.parse_args()
    body = big_body(args.mib)
    modes = {"worker process": 256 * 1024, "inline": 1 << 40}
    results = {}
    with emulator("--time-scale", "50", "--gpu-tokens", "10000000") as (url, _):
        for name, threshold in modes.items():
            settings = {"worker_parse_bytes": threshold, "max_body_bytes": 64 << 20}
            settings.update(gate_timeout_s=120.0, request_timeout_s=120.0)
            spec = [{"url": url, "gpu_tokens": 10_000_000, "cpu_tokens": 0}]
            with router(spec, **settings) as base:
                measure(base, body, 1)  # warm-up (starts the worker process)
                results[name] = measure(base, body, args.bodies)
    print(f"body {len(body) / (1 << 20):.1f} MiB of small objects, {args.bodies} per mode")
    print(f"{'mode':<16}{'/health max ms':>16}{'/health p99 ms':>16}{'big request s':>15}")
    for name, r in results.items():
        print(
            f"{name:<16}{r['health_max_ms']:>16.1f}{r['health_p99_ms']:>16.1f}"
            f"{r['big_request_s']:>15.2f}"
        )
    worker, inline = results["worker process"], results["inline"]
    print(f"inline / worker, /health max: {inline['health_max_ms'] / worker['health_max_ms']:.1f}x")


if __name__ == "__main__":
    main()
