"""MORI against the real SGLang Model Gateway (`smg` 1.13), live, on the demo's cell.

    python bench/gateway_replay.py                       # mori, smg (ours), smg-gateway; 2 reps
    python bench/gateway_replay.py --reps 1 --duration 45 --write out/gw.md

Each policy gets fresh emulated replicas (`mori emulate`, the demo's budgets) and is driven
by the same closed-loop `mori replay` of the committed generated corpus: `mori` and `smg`
(our imitation of the gateway's cache-aware routing) through `mori serve`, `smg-gateway`
through the gateway process itself (`--policy cache_aware`, installed as bench/gateways.py
says), with its replicas evicting plain LRU and no host tier, as SGLang without MORI's
patch. Runs are interleaved (A B C A B C ...), repetition i with seed `--seed` + i; it
prints each run, the means, and MORI's ratio to each of the others.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from datetime import date
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.gateways import SMG_PYTHON, gateway_argv, wait_serving  # noqa: E402
from router.demo import Stack, free_port, pick_trace, start_stack  # noqa: E402
from router.replay.client import Replay, ReplayConfig  # noqa: E402
from router.replay.records import RunResult  # noqa: E402
from router.replay.trace import load_trace  # noqa: E402

GATEWAY = "smg-gateway"


def one_run(args: argparse.Namespace, policy: str, corpus, token_scale: float) -> RunResult:
    with tempfile.TemporaryDirectory(prefix="mori-gw-") as logs:
        stack = Stack(Path(logs), Console(stderr=True))
        try:
            endpoint = start_stack(args, "smg" if policy == GATEWAY else policy, stack)
            if policy == GATEWAY:  # the same replicas, behind the gateway process instead
                replicas = [url for name, url in stack.urls.items() if name != "router"]
                port = free_port()
                argv = gateway_argv("smg", replicas, port, free_port(), python=args.smg_python)
                endpoint = f"http://127.0.0.1:{port}"
                stack.start_command("gateway", argv, endpoint)
                wait_serving(endpoint)
            config = ReplayConfig(
                endpoint=endpoint,
                concurrency=args.concurrency,
                duration_s=args.duration,
                time_scale=args.time_scale,
                token_scale=token_scale,
                seed=args.seed,
                policy_label=policy,
                cpu_ratio=args.host_tokens / args.gpu_tokens,
            )
            return asyncio.run(Replay(corpus, config).run())
        finally:
            stack.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policies", default=f"mori,smg,{GATEWAY}")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--duration", type=float, default=45.0, help="wall seconds per run")
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--time-scale", type=float, default=5.0)
    p.add_argument("--gpu-tokens", type=int, default=16000)
    p.add_argument("--host-tokens", type=int, default=32000)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--trace")
    p.add_argument("--token-scale", type=float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smg-python", type=Path, default=SMG_PYTHON)
    p.add_argument("--write", type=Path, help="append the results as Markdown")
    args = p.parse_args(argv)
    if not args.smg_python.exists():
        p.error(f"no gateway at {args.smg_python}: see bench/gateways.py to install it")
    console = Console()
    trace, token_scale = pick_trace(args.trace, args.token_scale)
    corpus = load_trace(trace)
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    load = os.getloadavg()[0]
    runs: dict[str, list[RunResult]] = {policy: [] for policy in policies}
    base_seed = args.seed
    for rep in range(args.reps):
        args.seed = base_seed + rep
        for policy in policies:
            result = one_run(args, policy, corpus, token_scale)
            runs[policy].append(result)
            console.print(
                f"rep {rep + 1} seed {args.seed} {policy}: {result.output_tok_s:.1f} tok/s, "
                f"TTFT {result.ttft_mean_s:.2f} / p99 {result.ttft_p99_s:.1f} s, "
                f"miss {result.miss:.0%}"
            )
    lines = [
        f"## {date.today().isoformat()} - live, {args.replicas} emulated replicas",
        "",
        f"`python bench/gateway_replay.py {' '.join(argv or sys.argv[1:])}` "
        f"(1-min load at start {load:.1f}; {trace.name} x{token_scale:g}, "
        f"{args.concurrency} programs, {args.duration:g} s wall x{args.time_scale:g})",
        "",
        "| policy | out tok/s per rep | mean | TTFT mean s | TTFT p99 s | miss |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for policy, results in runs.items():
        tput = [r.output_tok_s for r in results]
        lines.append(
            f"| {policy} | {', '.join(f'{x:.1f}' for x in tput)} | {statistics.fmean(tput):.1f}"
            f" | {_mean(results, 'ttft_mean_s'):.2f} | {_mean(results, 'ttft_p99_s'):.1f}"
            f" | {_mean(results, 'miss'):.0%} |"
        )
    if "mori" in runs:
        for other in (p for p in policies if p != "mori"):
            paired = zip(runs["mori"], runs[other], strict=True)
            pairs = [a.output_tok_s / b.output_tok_s for a, b in paired]
            lines.append(
                f"- mori / {other}: output tok/s {statistics.fmean(pairs):.2f}x "
                f"({min(pairs):.2f}-{max(pairs):.2f} over reps)"
            )
    console.print("\n".join(lines), markup=False)
    if args.write:
        with args.write.open("a") as fh:
            fh.write("\n".join(lines) + "\n\n")
    return 0


def _mean(results: list[RunResult], key: str) -> float:
    return statistics.fmean(getattr(r, key) for r in results)


if __name__ == "__main__":
    raise SystemExit(main())
