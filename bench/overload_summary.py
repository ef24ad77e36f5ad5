"""mori against the baselines per cell of a policy-matrix JSON, failed steps counted.

    python bench/overload_summary.py bench/results/2026-11-28-policy-matrix-single.json \
        --before bench/results/2026-11-27-policy-matrix-single.json

For each cell (deployment x corpus x programs x CPU ratio, mean over seeds) it prints mori's
output tok/s; the best baseline's (smg, ta, ta+o, continuum, mori-paper) with its failed
steps, and mori's ratio to it; the best baseline *without* failed steps and the ratio to
that one (a policy that fails steps is not serving the load: the SDKs gave up on them);
mori's ratio to the best baseline in the `--before` file, if given (the issue's "no cell
falls more than 1 %"); mori's failed steps, its in-flight TTFT p99 against smg's, its TTFT
max against the gate timeout, and its start wait p99. Markdown, to paste into a record.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

BASELINES = ("smg", "ta", "ta+o", "continuum", "mori-paper")
TIE = 1.05  # in-flight TTFT p99 within 5 % of smg's is a tie
GATE_S = 300.0


def cells(path: Path) -> dict[tuple, dict[str, dict[str, float]]]:
    """cell -> policy -> metric means over seeds (unswept runs only)."""
    by: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for row in json.loads(path.read_text()):
        if row.get("settings"):
            continue
        key = (row["deployment"], row["corpus"], row["programs"], row["cpu_ratio"])
        by[key][row["policy"]].append(row)
    return {
        key: {
            policy: {
                m: statistics.fmean(r.get(m, 0.0) or 0.0 for r in rows)
                for m, v in rows[0].items()
                if isinstance(v, int | float)
            }
            for policy, rows in policies.items()
        }
        for key, policies in by.items()
    }


def best(cell: dict[str, dict[str, float]], clean: bool = False) -> str | None:
    names = [b for b in BASELINES if b in cell and not (clean and cell[b]["failed_steps"])]
    return max(names, key=lambda b: cell[b]["output_tok_s"]) if names else None


def ratio(cell: dict, name: str | None) -> float | None:
    if name is None:
        return None
    return cell["mori"]["output_tok_s"] / max(cell[name]["output_tok_s"], 1e-9)


def rows(now: dict, before: dict | None) -> list[str]:
    head = [
        "deployment", "corpus", "programs", "cpu", "mori tok/s", "best baseline (failed)",
        "mori/best", "best without failures", "mori/that", "mori/best before", "mori failed",
        "in-flight p99 mori / smg", "TTFT max", "start wait p99",
    ]  # fmt: skip
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in sorted(now):
        cell = now[key]
        if "mori" not in cell:
            continue
        m, top, clean = cell["mori"], best(cell), best(cell, clean=True)
        prior = before.get(key) if before else None
        was = f"{ratio(prior, best(prior)):.3f}" if prior and "mori" in prior else "-"
        smg = cell.get("smg", {}).get("ttft_p99_inflight_s")
        tail = "-"
        if smg is not None:
            ok = m["ttft_p99_inflight_s"] <= TIE * max(smg, 1.0)
            tail = f"{m['ttft_p99_inflight_s']:.0f} / {smg:.0f}" + ("" if ok else " MISS")
        out.append(
            "| "
            + " | ".join(
                [
                    key[0],
                    key[1],
                    str(key[2]),
                    f"{key[3]:g}",
                    f"{m['output_tok_s']:.1f}",
                    f"{top} {cell[top]['output_tok_s']:.1f} ({cell[top]['failed_steps']:.0f})"
                    if top
                    else "-",
                    f"{ratio(cell, top):.3f}" if top else "-",
                    f"{clean} {cell[clean]['output_tok_s']:.1f}" if clean else "-",
                    f"{ratio(cell, clean):.3f}" if clean else "-",
                    was,
                    f"{m['failed_steps']:.0f}",
                    tail,
                    f"{m['ttft_max_s']:.0f}" + ("" if m["ttft_max_s"] < GATE_S else " MISS"),
                    f"{m['start_wait_p99_s']:.0f}",
                ]
            )  # fmt: skip
            + " |"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("matrix", type=Path, help="a bench/policy_matrix.py --json file")
    parser.add_argument("--before", type=Path, help="an earlier --json file of the same cells")
    args = parser.parse_args(argv)
    before = cells(args.before) if args.before else None
    print("\n".join(rows(cells(args.matrix), before)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
