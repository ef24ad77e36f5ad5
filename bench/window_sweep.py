"""Sweep MORI's idleness window W on the simulator and print throughput / TTFT per W.

    python3 bench/window_sweep.py                       # generated corpus, 80 programs
    python3 bench/window_sweep.py --trace traces/claude-code-sample.jsonl --token-scale 0.5

Each W runs the same cells (CPU ratios x concurrency) as a `mori sim` run would; the table
shows every W's output tok/s and mean TTFT relative to the current default (PolicyConfig).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project first: bench/kernels.py must not shadow `kernels`
from router.policy import PolicyConfig  # noqa: E402
from router.sim.cli import run_cells  # noqa: E402
from router.sim.simulator import SimConfig  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="traces/generated-claude-code.jsonl")
    ap.add_argument("--preset", default="h100-8b")
    ap.add_argument("--windows", default="2,4,8,16")
    ap.add_argument("--concurrency", default="80")
    ap.add_argument("--cpu-ratio", default="1,2")
    ap.add_argument("--duration", type=float, default=3600.0)
    ap.add_argument("--token-scale", type=float, default=1.0)
    ap.add_argument("--seeds", default="0", help="comma list; results are averaged over seeds")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    windows = [int(w) for w in args.windows.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    cells = list(
        itertools.product(
            [float(r) for r in args.cpu_ratio.split(",")],
            [int(c) for c in args.concurrency.split(",")],
        )
    )
    configs = [
        SimConfig(
            policy="mori",
            preset=args.preset,
            concurrency=conc,
            cpu_ratio=ratio,
            duration_s=args.duration,
            token_scale=args.token_scale,
            seed=seed,
            policy_config={"window": w},
        )
        for (ratio, conc), w, seed in itertools.product(cells, windows, seeds)
    ]
    console = Console(width=max(Console().width, 120))
    with console.status(f"simulating {len(configs)} runs"):
        results = run_cells(args.trace, configs, args.jobs)
    by_key: dict[tuple, list] = {}
    for r in results:
        by_key.setdefault((r.cpu_ratio, r.concurrency, r.extra["window"]), []).append(r)
    default = PolicyConfig().window
    table = Table(title=f"MORI window sweep: {args.trace}, {args.preset}, {args.duration:g} s")
    for h in ("cpu ratio", "conc", "W", "out tok/s", "TTFT mean", "TTFT p99", "miss",
              f"tok/s vs W={default}", f"TTFT vs W={default}"):  # fmt: skip
        table.add_column(h, justify="right")
    for ratio, conc in cells:
        base = _mean(by_key.get((ratio, conc, default), []))
        for w in windows:
            m = _mean(by_key[(ratio, conc, w)])
            rel = (
                (f"{m['tput'] / base['tput']:.2f}x", f"{m['ttft'] / base['ttft']:.2f}x")
                if base
                else ("-", "-")
            )
            table.add_row(
                f"{ratio:g}", str(conc), str(w), f"{m['tput']:.1f}", f"{m['ttft']:.2f}",
                f"{m['p99']:.1f}", f"{m['miss']:.0%}", *rel,
            )  # fmt: skip
    console.print(table)
    return 0


def _mean(rs: list) -> dict:
    if not rs:
        return {}
    n = len(rs)
    return {
        "tput": sum(r.output_tok_s for r in rs) / n,
        "ttft": sum(r.ttft_mean_s for r in rs) / n,
        "p99": sum(r.ttft_p99_s for r in rs) / n,
        "miss": sum(r.miss for r in rs) / n,
    }


if __name__ == "__main__":
    sys.exit(main())
