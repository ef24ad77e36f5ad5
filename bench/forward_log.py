"""Where a live engine's time went, forward by forward, against a preset's prices.

    python bench/forward_log.py out/ab/4096-smg-*/smg.forwards \\
        --preset-file bench/results/2026-11-29-cpu-512x8.json

Reads the per-forward timings `MORI_FORWARD_LOG` makes the patched engine write
(engine_patches/forward_log.py; `bench/real_engine_ab.py` starts every engine with it and
`--keep` keeps the logs) and prices every forward with the cost model of the preset
(`router.calibrate.forwards.priced_s`). It prints, per log, the time in forwards measured
against priced (by kind, and decode by batch size) and the time between forwards, which the
scheduler spends (scheduling, host loads, streaming results) or idles, and which the model
prices only inside its fitted terms (a calibration times its probes over HTTP, gaps
included).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from router.calibrate.forwards import Forward, priced_s, read_forwards  # noqa: E402
from router.presets import read_preset  # noqa: E402
from router.sim.model import CostModel  # noqa: E402

GAP_EDGES = (0.005, 0.05)  # s: the scheduler's turnaround / longer / idle
BATCHES = ((1, 1), (2, 3), (4, 7), (8, 15), (16, 1 << 30))


def summary(cost: CostModel, forwards: list[Forward]) -> dict:
    """Measured and priced seconds of prefill and decode forwards, decode by batch size, and
    the gaps between forwards in three bands."""
    rows: dict[str, list[float]] = {}
    for f in forwards:
        kinds = ["decode"] if f.decode else ["prefill"]
        kinds += [f"  decode, {a}-{b if b < 1 << 30 else ''} seqs" for a, b in BATCHES
                  if f.decode and a <= f.reqs <= b]  # fmt: skip
        price = priced_s(cost, f)
        for kind in kinds:
            row = rows.setdefault(kind, [0, 0.0, 0.0])
            row[0] += 1
            row[1] += f.took_s
            row[2] += price
    gaps = [b.start_s - a.start_s - a.took_s for a, b in zip(forwards, forwards[1:], strict=False)]
    low, high = GAP_EDGES
    bands = {
        f"< {low * 1e3:g} ms": [g for g in gaps if g < low],
        f"{low * 1e3:g}-{high * 1e3:g} ms": [g for g in gaps if low <= g < high],
        f">= {high * 1e3:g} ms": [g for g in gaps if g >= high],
    }
    span = forwards[-1].start_s + forwards[-1].took_s - forwards[0].start_s
    return {"span_s": span, "forwards": rows, "gaps": bands}


def show(console: Console, name: str, s: dict) -> None:
    table = Table(title=f"{name}: {s['span_s']:.1f} s from the first forward to the last")
    for col in ("", "count", "measured s", "priced s", "measured / priced", "share of span"):
        table.add_column(col, justify="right")
    span = s["span_s"]
    for label, (n, took, price) in s["forwards"].items():
        ratio = f"{took / price:.2f}" if price else "-"
        table.add_row(label, str(n), f"{took:.2f}", f"{price:.2f}", ratio, f"{took / span:.0%}")
    for label, gaps in s["gaps"].items():
        mean = f"mean {statistics.fmean(gaps) * 1e3:.1f} ms" if gaps else ""
        table.add_row(f"between forwards, {label}", str(len(gaps)), f"{sum(gaps):.2f}", "-",
                      mean, f"{sum(gaps) / span:.0%}")  # fmt: skip
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "logs", nargs="+", type=Path, help="MORI_FORWARD_LOG paths (or their PATH.<pid> files)"
    )
    parser.add_argument("--preset-file", type=Path, required=True, help="the prices to judge by")
    parser.add_argument("--json", type=Path, help="write the summaries here")
    args = parser.parse_args(argv)
    try:  # a wrong path or file is a usage error in one line, not a traceback
        cost = CostModel(read_preset(args.preset_file))
        logs = [(path, read_forwards(path)) for path in args.logs]
    except (OSError, ValueError, KeyError, TypeError) as e:
        parser.error(str(e))
    console = Console(width=140)
    out = {}
    for path, forwards in logs:
        if not forwards:
            console.print(f"{path}: no forwards")
            continue
        out[str(path)] = s = summary(cost, forwards)
        show(console, str(path), s)
    if args.json:
        for s in out.values():
            s["gaps"] = {k: sum(v) for k, v in s["gaps"].items()}
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
