"""Live replay vs simulation: do `mori sim` and a live run agree on which policy wins?

For each policy (default mori and ta+o) this starts the demo stack (2 `mori emulate`
replicas with small KV budgets + `mori serve`), replays the same trace for `--duration`
trace seconds (compressed by `--time-scale`), then simulates the same cells with
`router.sim.simulator` (same cost-model preset and budgets, same concurrency, token scale
and seed). It prints output tok/s and TTFT side by side, the mori / ta+o ratios of both,
and whether the live ratio points the same way as the simulated one.

    python bench/live_vs_sim.py                       # 300 trace s per policy, x5 speed
    python bench/live_vs_sim.py --duration 600 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from router.demo import Stack, pick_trace, start_stack
from router.replay.client import Replay, ReplayConfig
from router.replay.records import RunResult
from router.replay.trace import load_trace
from router.sim.presets import PRESETS, get_preset
from router.sim.simulator import SimConfig, simulate

EMULATOR_PRESET = "h100-8b"  # what `mori emulate` uses by default


def small_preset(gpu_tokens: int) -> str:
    """Register the emulator's preset with the demo's GPU KV budget for the simulator:
    the same timing coefficients, only the static memory share changes."""
    base = get_preset(EMULATOR_PRESET)
    hbm = base.gpu.hbm_bytes * base.tp
    fraction = (gpu_tokens * base.kv_bytes_per_token + base.model.weight_bytes) / hbm
    name = f"{EMULATOR_PRESET}-kv{gpu_tokens}"
    preset = dataclasses.replace(base, name=name, mem_fraction_static=fraction)
    assert abs(preset.gpu_kv_tokens - gpu_tokens) <= 1, preset.gpu_kv_tokens
    PRESETS[name] = preset
    return name


def live_cell(args: argparse.Namespace, policy: str, corpus, token_scale: float) -> RunResult:
    with tempfile.TemporaryDirectory(prefix="mori-bench-") as logs:
        stack = Stack(Path(logs), Console(stderr=True))
        try:
            router = start_stack(args, policy, stack)
            config = ReplayConfig(
                endpoint=router,
                concurrency=args.concurrency,
                duration_s=args.duration / args.time_scale,
                time_scale=args.time_scale,
                token_scale=token_scale,
                seed=args.seed,
                policy_label=policy,
                cpu_ratio=args.host_tokens / args.gpu_tokens,
            )
            run = Replay(corpus, config)
            result = asyncio.run(run.run())
            result.extra["errors"] = len(run.progress.errors)
            return result
        finally:
            stack.stop()


def sim_cell(args, policy: str, corpus, token_scale: float, preset: str) -> RunResult:
    config = SimConfig(
        policy=policy,
        preset=preset,
        replicas=args.replicas,
        concurrency=args.concurrency,
        cpu_ratio=args.host_tokens / args.gpu_tokens,
        duration_s=args.duration,
        token_scale=token_scale,
        seed=args.seed,
    )
    return simulate(corpus, config)


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace")
    p.add_argument("--token-scale", type=float)
    p.add_argument("--policies", default="mori,ta+o", help="first / second is the ratio")
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--duration", type=float, default=300.0, help="trace seconds per cell")
    p.add_argument("--time-scale", type=float, default=5.0)
    p.add_argument("--gpu-tokens", type=int, default=16000)
    p.add_argument("--host-tokens", type=int, default=32000)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", help="write every cell as JSON")
    args = p.parse_args()
    console = Console()
    trace, token_scale = pick_trace(args.trace, args.token_scale)
    corpus = load_trace(trace)
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    preset = small_preset(args.gpu_tokens)
    live, sim = {}, {}
    for policy in policies:
        started = time.monotonic()
        live[policy] = live_cell(args, policy, corpus, token_scale)
        console.log(f"live {policy}: {time.monotonic() - started:.0f} s wall")
        sim[policy] = sim_cell(args, policy, corpus, token_scale, preset)
    table = Table(
        title=f"live vs sim: {trace.name}, tokens x{token_scale:g}, "
        f"{args.concurrency} programs, {args.duration:g} trace s, x{args.time_scale:g}"
    )
    for col in (
        "policy",
        "live tok/s",
        "sim tok/s",
        "live TTFT",
        "sim TTFT",
        "live hit dev/host",
        "sim hit dev/host",
    ):
        table.add_column(col, justify="right")
    for policy in policies:
        lv, sm = live[policy], sim[policy]
        table.add_row(
            policy,
            f"{lv.output_tok_s:.1f}",
            f"{sm.output_tok_s:.1f}",
            f"{lv.ttft_mean_s:.2f}",
            f"{sm.ttft_mean_s:.2f}",
            f"{lv.hit_device:.0%}/{lv.hit_host:.0%}",
            f"{sm.hit_device:.0%}/{sm.hit_host:.0%}",
        )
    console.print(table)
    agree = True
    if len(policies) >= 2:
        a, b = policies[:2]
        for metric, better in (("output_tok_s", "higher"), ("ttft_mean_s", "lower")):
            lr = ratio(getattr(live[a], metric), getattr(live[b], metric))
            sr = ratio(getattr(sim[a], metric), getattr(sim[b], metric))
            same = (lr - 1) * (sr - 1) > 0 or lr == sr == 1
            agree &= same
            console.print(
                f"{metric} {a}/{b}: live {lr:.2f}x, sim {sr:.2f}x ({better} is better) -> "
                + ("[green]same direction[/green]" if same else "[red]directions differ[/red]")
            )
    if args.json_out:
        doc = {
            "args": vars(args) | {"trace": str(trace), "token_scale": token_scale},
            "live": {k: v.to_dict() for k, v in live.items()},
            "sim": {k: v.to_dict() for k, v in sim.items()},
        }
        Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
