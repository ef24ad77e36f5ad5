"""MORI vs the Rust SGLang gateways (`smg`, `sglang-router`, from PyPI) vs no router, in one run.

    python bench/router_vs_gateway.py                 # pinned phases + all-cores phase
    python bench/router_vs_gateway.py --clients       # upstream client candidates
    python bench/router_vs_gateway.py --servers       # server-path candidates

One near-zero-cost stub engine streams 4 tokens per request. Pinned phases: the load
generator and the stub share core 0, the router under test runs alone on core 1
(`taskset`); for 1, 50 and 200 closed-loop streams the three targets (direct, MORI,
gateway) are measured in turn, and the whole sweep is repeated (`--reps`), so slow
drift of the shared machine hits all three alike. Router CPU per request is the user +
system time of the router's processes (MORI: the owner and every worker) from /proc over
the measured window, divided by the requests served. The all-cores phase pins nothing
and gives MORI its default worker count: req/s side by side.

Two gateways, each in its own venv, never in the project's, started as bench/gateways.py
says (which also says how to install them): `smg` 1.13 (the SGLang Model Gateway's current
name; `--smg-python`) and `sglang-router` 0.3.2 (its earlier name; `--gateway-python`). A
gateway whose python is missing is left out. Both run with `--policy round_robin`: one
stub engine leaves nothing to route, and round robin is each gateway's cheapest path.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.gateways import (  # noqa: E402
    GATEWAY_PYTHON,
    PYTHONS,
    SMG_PYTHON,
    gateway_argv,
    wait_serving,  # noqa: E402
)
from bench.router_overhead import StubEngine, cpu_seconds, in_processes, tree_cpu  # noqa: E402
from router.wire.upstream import Upstream  # noqa: E402
from tests.servers import free_port, mori, stop  # noqa: E402

PATH = b"/v1/chat/completions"
BODY = {
    "model": "default",
    "messages": [{"role": "user", "content": "bench: say hi"}],
    "max_tokens": 4,
    "stream": True,
}


# --- load -------------------------------------------------------------------------------
async def _load(base: str, streams: int, seconds: float, warmup: float, tag: str) -> list:
    """Closed-loop streams on the thin client: [first-chunk seconds, completed after the
    warm-up, errors, completed in all, head seconds]."""
    client = Upstream(5.0, 30.0)
    firsts: list[float] = []
    heads: list[float] = []
    done = errors = total = 0
    begin = time.perf_counter()
    record_from, stop_at = begin + warmup, begin + warmup + seconds
    headers = [(b"content-type", b"application/json")]

    async def loop(i: int) -> None:
        nonlocal done, errors, total
        body = json.dumps({**BODY, "program_id": f"{tag}-{i}"}).encode()
        while (started := time.perf_counter()) < stop_at:
            try:
                response = await client.request(base, b"POST", PATH, body, headers)
                head = time.perf_counter() - started
                first = None
                async for _ in response:
                    if first is None:
                        first = time.perf_counter() - started
                response.close()
            except Exception:
                errors += 1
                await asyncio.sleep(0.01)
                continue
            total += 1
            if started >= record_from:
                done += 1
                firsts.append(first or 0.0)
                heads.append(head)

    await asyncio.gather(*(loop(i) for i in range(streams)))
    client.close()
    return [firsts, done, errors, total, heads]


def _load_process(args: tuple) -> list:
    import uvloop

    return uvloop.run(_load(*args))


def run_load(base: str, streams: int, seconds: float, warmup: float, procs: int) -> dict:
    results = in_processes(_load_process, base, streams, procs, seconds, warmup)
    firsts = sorted(f for r in results for f in r[0])
    heads = [h for r in results for h in r[4]]
    done = sum(r[1] for r in results)
    if not firsts:
        return {"rps": 0.0, "p50": float("nan"), "p99": float("nan"), "done": 0, "errors": 0,
                "done_all": 0}  # fmt: skip
    return {
        "done_all": sum(r[3] for r in results),
        "rps": done / seconds,
        "p50": 1000 * statistics.median(firsts),
        "head50": 1000 * statistics.median(heads),
        "p99": 1000 * firsts[min(len(firsts) - 1, int(0.99 * len(firsts)))],
        "done": done,
        "errors": sum(r[2] for r in results),
    }


# --- processes ----------------------------------------------------------------------------
@contextlib.contextmanager
def server(argv: list[str], port: int, cpus: str | None, health: str = "/health") -> Iterator:
    pin = ["taskset", "-c", cpus] if cpus else []
    proc = subprocess.Popen(
        [*pin, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{argv[:4]} exited with {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}{health}", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        else:
            raise TimeoutError(f"{argv[:4]} not up")
        yield proc
    finally:
        stop(proc)


def targets(args: argparse.Namespace, stub: str, workers: list[int]) -> dict:
    """argv and port of each router under test: MORI with each worker count, the gateway."""
    out = {}
    for count in workers:
        port = free_port()
        argv = [
            *mori("serve", "--replicas", stub, "--port", str(port), "--host", "127.0.0.1"),
            "--log-level", "warning", "--set", f"workers={count}",
        ]  # fmt: skip
        out["mori" if count == workers[0] else f"mori-{count}w"] = (argv, port)
    pythons = {"smg": args.smg_python, "sglang-router": args.gateway_python}
    for name, python in pythons.items():
        if not python.exists():
            print(f"{name}: no {python}, left out")
            continue
        gw_port = free_port()
        argv = gateway_argv(name, [stub], gw_port, free_port(), "round_robin", python)
        out[name] = (argv, gw_port)
    return out


def measure(args: argparse.Namespace, phases: list[tuple[int, int]], cpus: dict, workers: list):
    """rows[(streams, target)] -> list of per-repetition results."""
    stub_port = free_port()
    stub = f"http://127.0.0.1:{stub_port}"
    stub_argv = [sys.executable, __file__, "--stub-port", str(stub_port)]
    rows: dict[tuple[int, str], list[dict]] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(server(stub_argv, stub_port, cpus["stub"], "/health"))
        running = {"direct": (None, stub)}
        for name, (argv, port) in targets(args, stub, workers).items():
            proc = stack.enter_context(server(argv, port, cpus["router"]))
            running[name] = (proc, f"http://127.0.0.1:{port}")
            if name in PYTHONS:
                wait_serving(running[name][1])
        for rep in range(args.reps):
            for streams, procs in phases:
                for name, (proc, base) in running.items():
                    before = tree_cpu(proc.pid) if proc else 0.0
                    own_before = cpu_seconds(proc.pid) if proc else 0.0
                    result = _pinned_load(base, streams, args, procs, cpus["client"])
                    if proc:
                        used = tree_cpu(proc.pid) - before
                        result["cpu_ms"] = 1000 * used / max(1, result["done_all"])
                        own = cpu_seconds(proc.pid) - own_before  # MORI: the policy owner
                        result["owner_ms"] = 1000 * own / max(1, result["done_all"])
                    rows.setdefault((streams, name), []).append(result)
                    print(f"rep {rep + 1} {streams:>3} streams {name:>13}: {_brief(result)}")
    return rows


def _pinned_load(base: str, streams: int, args, procs: int, cpus: str | None) -> dict:
    """Run the load in a child pinned like the stub; CPU is counted over warm-up too."""
    pin = ["taskset", "-c", cpus] if cpus else []
    out = subprocess.run(
        [*pin, sys.executable, __file__, "--load", base, str(streams), str(args.seconds),
         str(args.warmup), str(procs)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def _brief(r: dict) -> str:
    cpu = f", router CPU {r['cpu_ms']:.3f} ms/req" if "cpu_ms" in r else ""
    return f"{r['rps']:.0f} req/s, first byte p50 {r['p50']:.2f} ms p99 {r['p99']:.2f} ms{cpu}"


# --- report -------------------------------------------------------------------------------
def median_of(results: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in results)


def report(rows: dict, title: str, console: Console) -> None:
    table = Table(title=title)
    cols = ["streams", "target", "req/s", "1st chunk p50", "p99", "added p50", "added p99"]
    for col in (*cols, "added head p50", "router CPU ms/req", "errors"):
        table.add_column(col, justify="right")
    for streams in sorted({s for s, _ in rows}):
        direct = rows.get((streams, "direct"))
        for name in dict.fromkeys(n for s, n in rows if s == streams):
            results = rows[(streams, name)]
            p50, p99 = median_of(results, "p50"), median_of(results, "p99")
            added = ("", "", "")
            if direct and name != "direct":
                added = (
                    f"{p50 - median_of(direct, 'p50'):+.2f}",
                    f"{p99 - median_of(direct, 'p99'):+.2f}",
                    f"{median_of(results, 'head50') - median_of(direct, 'head50'):+.2f}",
                )
            cpu = f"{median_of(results, 'cpu_ms'):.3f}" if "cpu_ms" in results[0] else ""
            table.add_row(
                str(streams), name, f"{median_of(results, 'rps'):.0f}", f"{p50:.2f}",
                f"{p99:.2f}", *added, cpu, str(sum(r["errors"] for r in results)),
            )  # fmt: skip
    console.print(table)
    for (streams, name), m in rows.items():
        for gateway in PYTHONS:
            g, d = rows.get((streams, gateway)), rows.get((streams, "direct"))
            if name.startswith("mori") and g and d:
                console.print(_ratios(streams, name, gateway, m, g, d))


def _ratios(streams: int, name: str, gateway: str, m: list, g: list, d: list) -> str:
    """One line of MORI's figures over a gateway's, measured side by side."""
    parts = [f"{streams} streams: {name}/{gateway}"]
    if "cpu_ms" in m[0]:
        ratios = [a["cpu_ms"] / b["cpu_ms"] for a, b in zip(m, g, strict=True)]
        parts.append(f"CPU per request {statistics.median(ratios):.2f}x")
        parts.append(f"(owner process {median_of(m, 'owner_ms'):.3f} ms of it)")
    added_m = median_of(m, "p50") - median_of(d, "p50")
    added_g = median_of(g, "p50") - median_of(d, "p50")
    parts.append(f"added first chunk p50 {added_m:+.2f} vs {added_g:+.2f} ms")
    head_m = median_of(m, "head50") - median_of(d, "head50")
    head_g = median_of(g, "head50") - median_of(d, "head50")
    parts.append(f"added head p50 {head_m:+.2f} vs {head_g:+.2f} ms")
    parts.append(f"req/s {median_of(m, 'rps') / max(1e-9, median_of(g, 'rps')):.2f}x")
    return ", ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--streams", default="1,50,200")
    parser.add_argument("--gateway-python", type=Path, default=GATEWAY_PYTHON)
    parser.add_argument("--smg-python", type=Path, default=SMG_PYTHON)
    parser.add_argument("--skip-pinned", action="store_true")
    parser.add_argument("--skip-all-cores", action="store_true")
    parser.add_argument("--clients", action="store_true", help="compare upstream clients")
    parser.add_argument("--servers", action="store_true", help="compare server paths")
    parser.add_argument("--probes", action="store_true", help="with --servers: HTTP probes")
    args = parser.parse_args()
    console = Console(width=120)
    if args.clients or args.servers:
        from bench.data_path_candidates import compare

        compare(args.clients, args.servers, args.reps, console, args.probes)
        return 0
    cores = len(os.sched_getaffinity(0))
    load = os.getloadavg()
    console.print(
        f"{platform.processor() or platform.machine()}, {cores} cores, "
        f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at start"
    )
    streams = [int(s) for s in args.streams.split(",")]
    if not args.skip_pinned:
        phases = [(s, 1) for s in streams]
        cpus = {"stub": "0", "client": "0", "router": "1"}
        rows = measure(args, phases, cpus, workers=[1])
        report(rows, "pinned: client + stub on core 0, router on core 1 (MORI: 1 worker)", console)
    if not args.skip_all_cores:
        phases = [(max(streams), cores)]
        cpus = {"stub": None, "client": None, "router": None}
        rows = measure(args, phases, cpus, workers=[cores, 1])
        title = f"all cores: nothing pinned, MORI with {cores} workers (mori) and with 1"
        report(rows, title, console)
    load = os.getloadavg()
    console.print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the end")
    return 0


def _stub(port: int) -> None:
    async def serve() -> None:
        loop = asyncio.get_running_loop()
        srv = await loop.create_server(StubEngine, "127.0.0.1", port, backlog=4096)
        await srv.serve_forever()

    import uvloop

    uvloop.run(serve())


if __name__ == "__main__":
    if sys.argv[1:2] == ["--stub-port"]:
        _stub(int(sys.argv[2]))
    elif sys.argv[1:2] == ["--load"]:
        base, streams, seconds, warmup, procs = sys.argv[2:7]
        result = run_load(base, int(streams), float(seconds), float(warmup), int(procs))
        print(json.dumps(result))
    else:
        sys.exit(main())
