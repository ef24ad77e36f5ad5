"""How much of MORI's simulated gain rests on each price of the cost model.

For each preset, MORI's output tok/s over smg's (the gain) is simulated with every price
as it is, then with one price moved at a time: the estimated prices of the GPU presets
x0.5 and x2 (`--move`), or a calibrated preset's measured engine terms set to what GPU
kernels do (`--counterfactual`: the prefix attention an extend recomputes, the host loads
taking turns with compute, the per-forward and per-request overheads). The table says
which price the gain swings with most.

    python bench/price_sensitivity.py                      # the GPU presets, x0.5 and x2
    python bench/price_sensitivity.py --presets h100-8b --concurrency 80 --cpu-ratio 2
    python bench/price_sensitivity.py --counterfactual --smg-offload \\
        --presets bench/results/2026-11-28-cpu-512x8.json \\
        --trace traces/generated-claude-code-32k.jsonl --token-scale 0.1 --concurrency 10 \\
        --cpu-ratio 2 --gpu-tokens 4096 --tick-s 1 --duration 600 --seeds 0 1 2 3

Simulated on the virtual clock (`mori sim`'s simulator): deterministic per seed, so it may
run beside timed work under `nice`.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from functools import cache
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from router.presets import (  # noqa: E402
    Preset,
    get_preset,
    write_preset,  # noqa: E402
)
from router.replay.trace import TraceProgram, load_trace  # noqa: E402
from router.sim.simulator import SimConfig, simulate  # noqa: E402

Move = Callable[[Preset, float], Preset]
# estimated price -> how it moves by a factor (the rate or the overhead itself)
ESTIMATES: dict[str, Move] = {
    "flops_s (mfu)": lambda p, k: dataclasses.replace(p, mfu=p.mfu * k),
    "bytes_s (bw_eff)": lambda p, k: dataclasses.replace(p, bw_eff=p.bw_eff * k),
    "pcie_bytes_s": lambda p, k: dataclasses.replace(
        p, gpu=dataclasses.replace(p.gpu, pcie_bytes_s=p.gpu.pcie_bytes_s * k)
    ),
    "step_overhead_s": lambda p, k: dataclasses.replace(p, step_overhead_s=p.step_overhead_s * k),
    "seq_overhead_s": lambda p, k: dataclasses.replace(p, seq_overhead_s=p.seq_overhead_s * k),
    "attn_eff": lambda p, k: dataclasses.replace(p, attn_eff=p.attn_eff * k),
}
# a measured engine term -> the preset with it as GPU kernels have it
COUNTERFACTUALS: dict[str, Callable[[Preset], Preset]] = {
    "prefix_attention -> 0": lambda p: dataclasses.replace(p, prefix_attention=0.0),
    "load_serial -> 0": lambda p: dataclasses.replace(p, load_serial=0.0),
    "prefill_overhead_s -> 0": lambda p: dataclasses.replace(p, prefill_overhead_s=0.0),
    "seq_overhead_s -> 0": lambda p: dataclasses.replace(p, seq_overhead_s=0.0),
    "step_overhead_s -> 0": lambda p: dataclasses.replace(p, step_overhead_s=0.0),
    "kv_read_eff -> 1": lambda p: dataclasses.replace(p, kv_read_eff=1.0),
    "all six": lambda p: dataclasses.replace(
        p,
        prefix_attention=0.0,
        load_serial=0.0,
        prefill_overhead_s=0.0,
        seq_overhead_s=0.0,
        step_overhead_s=0.0,
        kv_read_eff=1.0,
    ),  # fmt: skip
}


@cache
def _corpus(trace: str) -> list[TraceProgram]:
    return load_trace(trace)


def _tok_s(trace: str, config: SimConfig) -> float:
    return simulate(_corpus(trace), config).output_tok_s


def variants(preset: Preset, counterfactual: bool) -> dict[str, dict[str, Preset]]:
    """row -> column -> preset: x0.5 / x1 / x2 of each estimate, or as-is / GPU-like of
    each measured term."""
    if counterfactual:
        return {
            row: {"as measured": preset, "as on a GPU": move(preset)}
            for row, move in COUNTERFACTUALS.items()
        }
    return {
        row: {"x0.5": move(preset, 0.5), "x1": preset, "x2": move(preset, 2.0)}
        for row, move in ESTIMATES.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="h100-8b,h200-30b-moe,b200-70b-tp2")
    parser.add_argument("--counterfactual", action="store_true", help="measured terms -> GPU-like")
    parser.add_argument("--trace", default="traces/generated-claude-code.jsonl")
    parser.add_argument("--token-scale", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--cpu-ratio", type=float, default=1.0)
    parser.add_argument("--gpu-tokens", type=int, help="device KV budget (default: the preset's)")
    parser.add_argument("--tick-s", type=float, default=5.0)
    parser.add_argument("--duration", type=float, default=1800.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument(
        "--smg-offload",
        action="store_true",
        help="smg's engine keeps a host tier (the real-engine A/B's); default: MORI's baseline",
    )
    args = parser.parse_args(argv)
    console = Console(width=120)
    with (
        tempfile.TemporaryDirectory(prefix="mori-sens-") as tmp,
        ProcessPoolExecutor(args.jobs) as pool,
    ):
        for name in args.presets.split(","):
            base = get_preset(name)
            grid = variants(base, args.counterfactual)
            runs = {}  # (preset, seed, policy) -> future: a preset in several rows runs once
            for preset in {p for columns in grid.values() for p in columns.values()}:
                path = write_preset(Path(tmp) / f"{len(runs)}-{name.replace('/', '_')}", preset)
                for seed in args.seeds:
                    for policy in ("mori", "smg"):
                        config = SimConfig(
                            policy=policy, preset=str(path), concurrency=args.concurrency,
                            cpu_ratio=args.cpu_ratio, duration_s=args.duration,
                            token_scale=args.token_scale, seed=seed, gpu_tokens=args.gpu_tokens,
                            policy_config={"tick_s": args.tick_s, "smg_offload": args.smg_offload},
                        )  # fmt: skip
                        runs[preset, seed, policy] = pool.submit(_tok_s, args.trace, config)
            columns = list(next(iter(grid.values())))
            table = Table(title=f"{name}: mori / smg output tok/s ({len(args.seeds)} seeds)")
            for head in ("price", *columns, "swing"):
                table.add_column(head, justify="left" if head == "price" else "right")
            for row in grid:
                gains = [
                    statistics.fmean(
                        runs[p, s, "mori"].result() / runs[p, s, "smg"].result() for s in args.seeds
                    )
                    for p in grid[row].values()
                ]
                table.add_row(row, *(f"{g:.3f}" for g in gains), f"{max(gains) - min(gains):.3f}")
            console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
