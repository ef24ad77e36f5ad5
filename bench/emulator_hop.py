"""The hop an emulated replica adds to each step: the wall time a step takes, as a client
sees it, beyond the engine's own time for the request, split into its two legs.

    python bench/emulator_hop.py                                    # this tree
    python bench/emulator_hop.py --trees /tmp/parent . --rounds 3   # A/B, interleaved

`mori emulate` answers on its engine's clock (`ReplicaEngine`, x `--time-scale`); whatever
wall time a step takes beyond the engine's (the HTTP path both ways, the driver waking
after the engine's event) is a hop no engine has, and at the demo's x5 it counts five times
over in trace time: the live stack's loss against `mori sim` (docs/simulator.md, "The
hop"). Per step: `in`, from sending the request to the engine's arrival; `out`, from the
engine's end to the stream's `[DONE]`; `total`, the step's wall time less its engine time
(arrived to done, `mori_engine_times`, / the time scale). The legs need the engine clock's
origin (`clock_origin_s` in `/get_server_info`; a tree without it gives `total` only).
Closed-loop streaming clients (httpx, one process; the replica in another), short tool
sleeps between steps. A tree is a checkout (or a `git archive` of one) holding `router/`;
its `mori emulate` is what runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from router.demo import free_port  # noqa: E402
from router.protocol.accounting import CACHE_DETAILS_FLAG, ENGINE_TIMES_FLAG  # noqa: E402

sys.path.insert(1, str(Path(__file__).resolve().parent))
from tick_bench import machine, percentile  # noqa: E402

Leg = tuple[float, float | None, float | None]  # wall ms a step: total, in, out


def start(tree: Path, port: int, time_scale: float) -> subprocess.Popen:
    """The tree's `mori emulate` on `port`, once it answers /health."""
    argv = [sys.executable, "-m", "router.cli", "emulate", "--port", str(port)]
    argv += ["--time-scale", str(time_scale), "--gpu-tokens", "16000", "--log-level", "warning"]
    proc = subprocess.Popen(argv, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"mori emulate in {tree} exited: {proc.stderr.read().decode()[-400:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"mori emulate in {tree} did not come up in 60 s")


async def _agent(
    client: httpx.AsyncClient, k: int, steps: int, scale: float, origin: float | None
) -> list[Leg]:
    """One closed-loop program: `steps` streamed steps; each step's wall ms beyond the
    engine's time: (total, in, out), the legs None without the clock's origin."""
    rng, extra = random.Random(k), []
    context = "x" * 4 * rng.randint(500, 3000)
    for step in range(steps + 1):  # the first warms the path (imports, connections)
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": context}],
            "max_tokens": rng.randint(20, 300),
            "stream": True,
            "user": f"p{k}",
            CACHE_DETAILS_FLAG: True,
            ENGINE_TIMES_FLAG: True,
        }
        sent, times = time.monotonic(), None
        async with client.stream("POST", "/v1/chat/completions", json=body) as answer:
            async for line in answer.aiter_lines():
                if line.startswith("data: {") and "engine_times" in line:
                    times = json.loads(line[6:]).get("sglext", {}).get("engine_times")
                if line == "data: [DONE]":
                    break
        ended = time.monotonic()
        if times and step > 0:
            total = 1000 * ((ended - sent) - (times["done"] - times["arrived"]) / scale)
            if origin is None:
                extra.append((total, None, None))
            else:
                arrived, done = (origin + times[key] / scale for key in ("arrived", "done"))
                extra.append((total, 1000 * (arrived - sent), 1000 * (ended - done)))
        context += "y" * 4 * rng.randint(100, 600)
        await asyncio.sleep(rng.uniform(0.02, 0.3))
    return extra


async def measure(port: int, programs: int, steps: int, scale: float) -> list[Leg]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
        origin = (await client.get("/get_server_info")).json().get("clock_origin_s")
        runs = await asyncio.gather(
            *(_agent(client, k, steps, scale, origin) for k in range(programs))
        )
    return [ms for run in runs for ms in run]


def summary(samples: list[float]) -> dict[str, float]:
    return {
        "n": len(samples),
        "mean": statistics.fmean(samples),
        "p50": percentile(samples, 0.5),
        "p90": percentile(samples, 0.9),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", type=Path, default=[Path(".")])
    parser.add_argument("--rounds", type=int, default=1, help="runs of each tree, interleaved")
    parser.add_argument("--programs", type=int, default=12)
    parser.add_argument("--steps", type=int, default=15, help="steps measured per program and run")
    parser.add_argument("--time-scale", type=float, default=5.0)
    args = parser.parse_args(argv)
    if any(not (t / "router").is_dir() for t in args.trees):
        parser.error("each of --trees must hold router/ (a checkout or a git archive of one)")
    got: dict[Path, list[Leg]] = {t: [] for t in args.trees}
    for _ in range(args.rounds):
        for tree in args.trees:
            port = free_port()
            proc = start(tree, port, args.time_scale)
            try:
                got[tree] += asyncio.run(measure(port, args.programs, args.steps, args.time_scale))
            finally:
                proc.terminate()
                proc.wait(10)
    print(f"{date.today().isoformat()}, {machine()}, x{args.time_scale}, {args.programs} programs")
    print("wall ms a step takes beyond its engine time: total, and its legs (send -> engine")
    print("arrival, engine done -> [DONE])")
    first = None
    for tree, samples in got.items():
        for i, leg in enumerate(("total", "in", "out")):
            values = [s[i] for s in samples if s[i] is not None]
            if not values:
                continue
            s = summary(values)
            first = first or s
            ratio = f"  mean / first tree's {s['mean'] / first['mean']:.2f}" if i == 0 else ""
            print(
                f"  {str(tree):24} {leg:5} n {s['n']:4}  mean {s['mean']:6.3f}  "
                f"p50 {s['p50']:6.3f}  p90 {s['p90']:6.3f}{ratio}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
