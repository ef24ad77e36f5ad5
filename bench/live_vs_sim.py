"""Live replay vs simulation, over time: where do `mori sim` and the live stack part ways?

For each policy (default mori and smg) this starts the demo stack (2 `mori emulate`
replicas with small KV budgets + `mori serve`), replays the same trace for `--duration`
trace seconds (compressed by `--time-scale`), then simulates the same cell with
`router.sim.simulator` (same cost-model preset and budgets, same concurrency, token scale
and seed). Both runs are sampled every `--sample` trace seconds into a timeline
(`router.replay.timeline`): per replica the GPU/CPU tiers as the router books them and
what the engine holds and queues (and its mean queue wait), requests held at the gate by
class, moves by reason, and the share of acting programs whose tool call the policy knows.
It prints the end-of-run figures side by side, then every timeline metric's time mean
live vs simulated, flags metrics more than `--tolerance` apart, and writes JSON and a
plot, so the next divergence is found in minutes rather than days.

    python bench/live_vs_sim.py                                  # mori, smg: 300 trace s, x5
    python bench/live_vs_sim.py --policies mori --duration 225 --concurrency 24 \
        --json out/lvs.json --plot out/lvs.png

Exit status 1 when the first policy's live output tok/s is more than `--tolerance` from
its simulation.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.markup import escape
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project first: bench/kernels.py must not shadow `kernels`
from router.demo import Stack, pick_trace, start_stack  # noqa: E402
from router.policy.types import Placement, Tier  # noqa: E402
from router.presets import PRESETS, get_preset  # noqa: E402
from router.replay.client import Replay, ReplayConfig  # noqa: E402
from router.replay.records import RunResult  # noqa: E402
from router.replay.timeline import Sample, compare, sample, series  # noqa: E402
from router.replay.trace import load_trace  # noqa: E402
from router.sim.simulator import SimConfig, Simulation, simulate  # noqa: E402

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


def live_cell(
    args: argparse.Namespace, policy: str, corpus, token_scale: float
) -> tuple[RunResult, list[Sample]]:
    with tempfile.TemporaryDirectory(prefix="mori-bench-") as logs:
        stack = Stack(Path(logs), Console(stderr=True))
        try:
            router = start_stack(args, policy, stack)
            replicas = [url for name, url in stack.urls.items() if name != "router"]
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
            result, timeline = asyncio.run(_sampled(run, router, replicas, args))
            result.extra["errors"] = len(run.progress.errors)
            return result, timeline
        finally:
            stack.stop()


async def _sampled(
    run: Replay, router: str, replicas: list[str], args: argparse.Namespace
) -> tuple[RunResult, list[Sample]]:
    """The replay, with the live state sampled every `--sample` trace seconds meanwhile."""
    timeline: list[Sample] = []

    async def sampler() -> None:
        async with httpx.AsyncClient(timeout=5.0) as client:
            started = time.monotonic()
            while True:
                await asyncio.sleep(args.sample / args.time_scale)
                t = (time.monotonic() - started) * args.time_scale
                timeline.append(await _live_sample(client, router, replicas, t))

    task = asyncio.create_task(sampler())
    try:
        result = await run.run()
    finally:
        task.cancel()
    return result, timeline


async def _live_sample(
    client: httpx.AsyncClient, router: str, replicas: list[str], t: float
) -> Sample:
    """The router's program views and move counts, each replica's own usage."""
    programs = (await client.get(router + "/v1/programs")).json()["data"]
    metrics = (await client.get(router + "/metrics")).text
    moves: Counter[str] = Counter()  # by reason, whatever the tiers (labels src, dst)
    tiers: dict[tuple[str, str], int] = {}
    for family in text_string_to_metric_families(metrics):
        for s in family.samples:
            if s.name == "mori_moves_total":
                moves[s.labels["reason"]] += int(s.value)
            elif s.name == "mori_tier_tokens":
                tiers[(s.labels["replica"], s.labels["tier"])] = int(s.value)
    engines = {}
    for url in replicas:
        info = (await client.get(url + "/get_server_info")).json()
        engines[url] = info["mori_usage"]
    return sample(t, tiers, programs, engines, moves)


def sim_cell(
    args, policy: str, corpus, token_scale: float, preset: str
) -> tuple[RunResult, list[Sample]]:
    config = SimConfig(
        policy=policy,
        preset=preset,
        replicas=args.replicas,
        concurrency=args.concurrency,
        cpu_ratio=args.host_tokens / args.gpu_tokens,
        duration_s=args.duration,
        token_scale=token_scale,
        seed=args.seed,
        hop_s=args.hop_s,
    )
    timeline: list[Sample] = []
    due = [args.sample]

    def probe(sim: Simulation) -> None:
        if sim.now + 1e-9 < due[0]:
            return
        due[0] += args.sample
        now = sim.now
        views = [sim.policy.describe(pid, now) for pid in list(sim.policy.programs)]
        engines = {
            name: engine.usage() | {k: engine.stats[k] for k in ("admitted", "queue_wait_s")}
            for name, engine in sim.engines.items()
        }
        timeline.append(sample(now, _tiers(sim), [v for v in views if v], engines, sim.moves))

    return simulate(corpus, config, probe=probe), timeline


def _tiers(sim: Simulation) -> dict[tuple[str, str], int]:
    """The tokens the simulated policy's tiers book, as the router exports them."""
    tiers = sim.policy.tiers
    return {
        (name, tier.value): tiers.used(Placement(tier, name))
        for name in sim.engines
        for tier in (Tier.GPU, Tier.CPU)
    }


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace")
    p.add_argument("--token-scale", type=float)
    p.add_argument("--policies", default="mori,smg", help="first / second is the ratio")
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--duration", type=float, default=225.0, help="trace seconds per cell")
    p.add_argument("--time-scale", type=float, default=5.0)
    p.add_argument("--gpu-tokens", type=int, default=16000)
    p.add_argument("--host-tokens", type=int, default=32000)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--hop-s",
        type=float,
        default=0.0,
        help="the simulated router <-> engine latency, one way, trace seconds (the live "
        "stack's wall latency x --time-scale; docs/simulator.md, 'The hop')",
    )
    p.add_argument("--sample", type=float, default=5.0, help="trace seconds between samples")
    p.add_argument("--tolerance", type=float, default=0.10, help="live/sim gap to flag")
    p.add_argument("--json", dest="json_out", help="write every cell and timeline as JSON")
    p.add_argument("--plot", help="write the timelines as a PNG")
    args = p.parse_args()
    console = Console()
    trace, token_scale = pick_trace(args.trace, args.token_scale)
    corpus = load_trace(trace)
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    preset = small_preset(args.gpu_tokens)
    live, sim, timelines = {}, {}, {}
    for policy in policies:
        started = time.monotonic()
        live[policy], live_tl = live_cell(args, policy, corpus, token_scale)
        console.log(f"live {policy}: {time.monotonic() - started:.0f} s wall")
        sim[policy], sim_tl = sim_cell(args, policy, corpus, token_scale, preset)
        timelines[policy] = (live_tl, sim_tl)
    console.print(_summary(args, trace, token_scale, policies, live, sim))
    for policy in policies:
        console.print(_timeline_table(policy, *timelines[policy], args.tolerance))
    _ratios(console, policies, live, sim)
    if args.json_out:
        doc = {
            "args": vars(args) | {"trace": str(trace), "token_scale": token_scale},
            "live": {k: v.to_dict() for k, v in live.items()},
            "sim": {k: v.to_dict() for k, v in sim.items()},
            "timelines": {
                k: {"live": [s.to_dict() for s in a], "sim": [s.to_dict() for s in b]}
                for k, (a, b) in timelines.items()
            },
        }
        Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
    if args.plot:
        _plot(timelines, Path(args.plot))
    first = policies[0]
    gap = abs(ratio(live[first].output_tok_s, sim[first].output_tok_s) - 1)
    return 0 if gap <= args.tolerance else 1


def _summary(args, trace, token_scale, policies, live, sim) -> Table:
    table = Table(
        title=f"live vs sim: {trace.name}, tokens x{token_scale:g}, {args.concurrency} "
        f"programs, {args.duration:g} trace s, x{args.time_scale:g}, seed {args.seed}"
    )
    columns = ("policy", "live tok/s", "sim tok/s", "live/sim", "live TTFT s", "sim TTFT s")
    for col in (*columns, "live hit dev/host", "sim hit dev/host", "live churn", "sim churn"):
        table.add_column(col, justify="right")
    for policy in policies:
        lv, sm = live[policy], sim[policy]
        table.add_row(
            policy,
            f"{lv.output_tok_s:.1f}",
            f"{sm.output_tok_s:.1f}",
            f"{ratio(lv.output_tok_s, sm.output_tok_s):.2f}",
            f"{lv.ttft_mean_s:.2f}",
            f"{sm.ttft_mean_s:.2f}",
            f"{lv.hit_device:.0%}/{lv.hit_host:.0%}",
            f"{sm.hit_device:.0%}/{sm.hit_host:.0%}",
            f"{lv.churn:.0%}",
            f"{sm.churn:.0%}",
        )
    return table


def _timeline_table(policy: str, live: list[Sample], sim: list[Sample], tol: float) -> Table:
    """Every timeline metric's time mean, live beside simulated; gaps over `tol` in red
    (a metric near zero on both sides is not flagged)."""
    table = Table(title=f"{policy}: timeline means ({len(live)} live, {len(sim)} sim samples)")
    for col in ("metric", "live", "sim", "live/sim"):
        table.add_column(col, justify="right")
    for row in compare(live, sim):
        small = max(abs(row.live), abs(row.sim)) < 1.0
        off = not small and (row.sim == 0 or abs(row.ratio - 1) > tol)
        style = "red" if off else None
        table.add_row(
            escape(row.metric),
            f"{row.live:.2f}",
            f"{row.sim:.2f}",
            "-" if row.sim == 0 else f"{row.ratio:.2f}",
            style=style,
        )
    return table


def _ratios(console: Console, policies, live, sim) -> None:
    if len(policies) < 2:
        return
    a, b = policies[:2]
    for metric, better in (("output_tok_s", "higher"), ("ttft_mean_s", "lower")):
        lr = ratio(getattr(live[a], metric), getattr(live[b], metric))
        sr = ratio(getattr(sim[a], metric), getattr(sim[b], metric))
        same = (lr - 1) * (sr - 1) > 0 or lr == sr == 1
        console.print(
            f"{metric} {a}/{b}: live {lr:.2f}x, sim {sr:.2f}x ({better} is better) -> "
            + ("[green]same direction[/green]" if same else "[red]directions differ[/red]")
        )


def _plot(timelines: dict[str, tuple[list[Sample], list[Sample]]], path: Path) -> None:
    """One row per policy: tiers and engine device tokens, gate, engine queue wait."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("GPU tokens: router's tier (-) vs engine (:)", ("gpu_tier", "device")),
        ("held at the gate", ("held",)),
        ("engine queue wait, mean s", ("queue_wait_s",)),
    )
    fig, axes = plt.subplots(
        len(timelines), len(panels), figsize=(15, 4 * len(timelines)), squeeze=False
    )
    for row, (policy, (live, sim)) in enumerate(timelines.items()):
        for col, (title, prefixes) in enumerate(panels):
            ax = axes[row][col]
            for side, timeline, color in (("live", live, "tab:blue"), ("sim", sim, "tab:orange")):
                xs = [s.t for s in timeline]
                for key, ys in series(timeline).items():
                    if key.startswith(prefixes):
                        dotted = key.startswith(("device", "held new", "held cpu"))
                        ax.plot(xs, ys, color=color, linestyle=":" if dotted else "-",
                                label=f"{side} {key}")  # fmt: skip
            ax.set_title(f"{policy}: {title}")
            ax.set_xlabel("trace s")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
