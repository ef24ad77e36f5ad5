"""MORI against the plain gateway on the real engine: a patched SGLang replica on CPU.

    python bench/real_engine_ab.py                      # mori, ta+o, smg; 2 runs each, 120 s
    python bench/real_engine_ab.py --runs 1 --duration 60 --policies mori,smg
    python bench/real_engine_ab.py --write bench/results/2026-11-23-real-engine-ab.md

One SGLang replica (the newest supported line from scripts/install_sglang_cpu.sh, or
MORI_SGLANG_VERSION) started by `mori-sglang` on the tiny random-weight test model, with a
small device pool (`--max-total-tokens`, default 6144) and a host tier twice that, so a few
programs overflow it. For each run and policy, interleaved (run 1: mori, ta+o, smg; run
2: ...), a fresh engine, `mori serve --policy P` (tick 1 s) and a closed-loop `mori replay`
of the generated 32k corpus at token scale 0.1 through it. Each row: output tok/s, TTFT
mean / p99, the device / host / miss split of prompt tokens (from SGLang's own cache
report), and the mean number of requests running in the engine (SGLang's
`sglang:num_running_reqs`, sampled every second). Then `mori`'s ratio to each baseline.

On CPU a miss is cheap (the tiny model prefills fast) and an idle engine is not: the
policy's prices, learned from the engine's own timings, decide how much it gates.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.servers import free_port, mori, spawn  # noqa: E402
from tests.sglang.server import build_tiny_model, installed_version, patched_servers  # noqa: E402

TRACE = ROOT / "traces/generated-claude-code-32k.jsonl"
METRICS = ("output_tok_s", "ttft_mean_s", "ttft_p99_s", "hit_device", "hit_host", "miss")


def running_sampler(url: str, stop: threading.Event, out: list[float]) -> None:
    """Sample the engine's running-request gauge every second until `stop`."""
    while not stop.wait(1.0):
        with contextlib.suppress(httpx.HTTPError, ValueError):
            text = httpx.get(url + "/metrics", timeout=2.0).text
            values = [
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("sglang:num_running_reqs")
            ]
            if values:
                out.append(sum(values))


def one_run(args: argparse.Namespace, policy: str, model: Path, work: Path) -> dict:
    """A fresh engine, a router with `policy`, and the replay; returns the replay's row."""
    flags = ["--max-total-tokens", str(args.max_total_tokens), "--hicache-ratio", "2"]
    flags += ["--enable-metrics"]
    with patched_servers(1, model, work, flags) as (engine,):
        port = free_port()
        serve = mori(
            "serve", "--replicas", engine.url, "--port", str(port), "--policy", policy,
            "--set", f"tick_s={args.tick_s}", "--log-level", "warning",
        )  # fmt: skip
        with spawn(serve, port):
            samples: list[float] = []
            stop = threading.Event()
            sampler = threading.Thread(target=running_sampler, args=(engine.url, stop, samples))
            sampler.start()
            out = work / f"{policy}.json"
            try:
                replay = mori(
                    "replay", str(TRACE), "--endpoint", f"http://127.0.0.1:{port}",
                    "--token-scale", str(args.token_scale), "--concurrency",
                    str(args.concurrency), "--duration", str(args.duration),
                    "--seed", str(args.seed), "--json", str(out),
                )  # fmt: skip
                done = subprocess.run(
                    replay, capture_output=True, text=True, timeout=args.duration + 300
                )
                if done.returncode != 0:
                    raise RuntimeError(f"replay failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
            finally:
                stop.set()
                sampler.join()
    row = json.loads(out.read_text())["results"][0]
    return {
        **{m: row[m] for m in METRICS},
        "running_mean": statistics.fmean(samples) if samples else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="mori,ta+o,smg")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--duration", type=float, default=120.0, help="wall seconds per run")
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--token-scale", type=float, default=0.1)
    parser.add_argument("--max-total-tokens", type=int, default=6144)
    parser.add_argument("--tick-s", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write", type=Path, help="append the table to this markdown file")
    args = parser.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    console = Console(width=120)
    rows: dict[str, list[dict]] = {p: [] for p in policies}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="mori-ab-") as tmp:
        work = Path(tmp)
        model = build_tiny_model(work / "tiny")
        for run in range(args.runs):
            for policy in policies:
                started = time.monotonic()
                rows[policy].append(one_run(args, policy, model, work))
                console.print(
                    f"run {run + 1} {policy}: {rows[policy][-1]['output_tok_s']:.1f} tok/s "
                    f"({time.monotonic() - started:.0f} s)"
                )
    table = Table(title=f"real SGLang {installed_version()} on CPU, {args.runs} runs each")
    heads = ["policy", "out tok/s", "TTFT mean / p99 s", "device / host / miss %", "running"]
    for h in heads:
        table.add_column(h, justify="left" if h == "policy" else "right")
    md = ["| " + " | ".join(heads) + " |", "|---|" + "---:|" * (len(heads) - 1)]
    for policy, runs in rows.items():
        cells = [
            ", ".join(f"{r['output_tok_s']:.1f}" for r in runs),
            ", ".join(f"{r['ttft_mean_s']:.2f} / {r['ttft_p99_s']:.1f}" for r in runs),
            ", ".join(
                f"{100 * r['hit_device']:.1f} / {100 * r['hit_host']:.1f} / {100 * r['miss']:.1f}"
                for r in runs
            ),
            f"{statistics.fmean(r['running_mean'] for r in runs):.2f}",
        ]
        table.add_row(policy, *cells)
        md.append("| " + " | ".join([policy, *cells]) + " |")
    console.print(table)

    def mean(policy: str, key: str) -> float:
        return statistics.fmean(r[key] for r in rows[policy])

    ratios = []
    if "mori" in rows:
        for other in (p for p in policies if p != "mori"):
            tput = mean("mori", "output_tok_s") / max(mean(other, "output_tok_s"), 1e-9)
            misses = mean("mori", "miss") / max(mean(other, "miss"), 1e-9)
            ratios.append(f"mori / {other}: output tok/s {tput:.2f}x, misses {misses:.2f}x")
    for line in ratios:
        console.print(line)
    if args.write:
        command = " ".join(["python bench/real_engine_ab.py", *(argv or sys.argv[1:])])
        head = [
            f"## {date.today().isoformat()} - real SGLang {installed_version()} on CPU",
            "",
            f"`{command}` (1-min load average at start: {load:.1f}; shared 2-vCPU machine)",
            "",
        ]
        with args.write.open("a") as fh:
            fh.write("\n".join(head + md + [""] + [f"- {r}" for r in ratios] + [""]) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
