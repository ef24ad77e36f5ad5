"""mori against mori-priced (mori without its time scheduler): does tool-time prediction pay?

Runs the discrete-event simulator (`router.sim.simulator`) for both policies on the same
corpus, concurrency, CPU ratio and seed, prints them side by side with ratios, then the
predictor's error distribution per tool kind and what the predictions did (offloads at
tool start, predictive promotions, how offloaded programs came back).

Goal (issue "Tool-call-aware prediction"): >= 1.1x output tok/s or <= 0.8x mean TTFT,
without losing on the other (a loss here: worse than 0.98x tok/s or 1.02x TTFT).

    python3 bench/predict_compare.py                       # the default matrix
    python3 bench/predict_compare.py --corpus traces/claude-code-sample.jsonl:0.15 \\
        --concurrency 50,80 --cpu-ratio 1,2 --seeds 3 --duration 3600 --json out.json

`--corpus PATH[:TOKEN_SCALE]` may repeat; the real Claude Code sample needs a scale so
its largest contexts (490k tokens) fit one H100 + 8B replica (452k KV tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from statistics import fmean

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project first: bench/kernels.py must not shadow `kernels`
from router.policy.engine import MoriEngine  # noqa: E402
from router.replay.trace import load_trace  # noqa: E402
from router.sim.simulator import SimConfig, Simulation  # noqa: E402

DEFAULT_CORPORA = [
    "traces/generated-claude-code-32k.jsonl:1.0",
    "traces/generated-claude-code.jsonl:0.5",
    "traces/claude-code-sample.jsonl:0.15",
]
POLICIES = ("mori-priced", "mori")
GOAL_TOK, GOAL_TTFT, LOSS_TOK, LOSS_TTFT = 1.1, 0.8, 0.98, 1.02


def _csv(kind):
    return lambda text: [kind(v) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", action="append", help="PATH[:TOKEN_SCALE] (repeatable)")
    ap.add_argument("--preset", default="h100-8b")
    ap.add_argument("--concurrency", type=_csv(int), default=[50, 80])
    ap.add_argument("--cpu-ratio", type=_csv(float), default=[1.0, 2.0])
    ap.add_argument("--seeds", type=int, default=3, help="seeds per cell (corpus order, jitter)")
    ap.add_argument("--duration", type=float, default=3600.0, help="virtual seconds per run")
    ap.add_argument("--jobs", type=int, default=2, help="parallel processes")
    ap.add_argument("--json", dest="json_out", help="write every run and the summary here")
    return ap.parse_args(argv)


def run_one(path: str, config: SimConfig) -> dict:
    """One simulated run; with the time scheduler also the predictor's errors and what
    the predictions did."""
    sim = Simulation(load_trace(path), config)
    result = sim.run()
    out = {"corpus": path, "config": asdict(config), "result": result.to_dict()}
    policy = sim.policy
    if isinstance(policy, MoriEngine) and policy.timed is not None:
        errors = policy.timed.forecast.predictor.error_stats()
        out["errors"] = {k: asdict(v) for k, v in errors.items()}
        out["outcomes"] = dict(policy.timed.outcomes)
    return out


def cells(args: argparse.Namespace) -> list[tuple[str, SimConfig]]:
    jobs = []
    for spec in args.corpus or DEFAULT_CORPORA:
        path, _, scale = spec.partition(":")
        if not Path(path).is_file():
            raise SystemExit(f"predict_compare: no corpus at {path}")
        for ratio in args.cpu_ratio:
            for conc in args.concurrency:
                for seed in range(args.seeds):
                    for policy in POLICIES:
                        config = SimConfig(
                            policy=policy,
                            preset=args.preset,
                            concurrency=conc,
                            cpu_ratio=ratio,
                            duration_s=args.duration,
                            token_scale=float(scale or 1.0),
                            seed=seed,
                        )
                        jobs.append((path, config))
    return jobs


def verdict(tok: float, ttft: float) -> str:
    hit = (tok >= GOAL_TOK and ttft <= LOSS_TTFT) or (ttft <= GOAL_TTFT and tok >= LOSS_TOK)
    if hit:
        return "[green]hit[/green]"
    if tok < LOSS_TOK or ttft > LOSS_TTFT:
        return "[red]loss[/red]"
    return "[yellow]even[/yellow]"


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (corpus, concurrency, CPU ratio): means over seeds, ratios of the means."""
    groups: dict[tuple, dict[str, list[dict]]] = {}
    for run in runs:
        c = run["config"]
        key = (run["corpus"], c["token_scale"], c["concurrency"], c["cpu_ratio"])
        groups.setdefault(key, {}).setdefault(c["policy"], []).append(run)
    rows = []
    for (corpus, scale, conc, ratio), by_policy in sorted(groups.items()):
        row = {"corpus": Path(corpus).name, "scale": scale, "conc": conc, "cpu": ratio}
        for policy in POLICIES:
            results = [r["result"] for r in by_policy.get(policy, [])]
            for metric in ("output_tok_s", "ttft_mean_s", "ttft_p99_s", "moves"):
                row[f"{policy}:{metric}"] = fmean(r[metric] for r in results)
        per_seed = sorted(
            zip(by_policy["mori-priced"], by_policy["mori"], strict=True),
            key=lambda pair: pair[0]["config"]["seed"],
        )
        row["seed_ttft_ratios"] = [
            b["result"]["ttft_mean_s"] / max(a["result"]["ttft_mean_s"], 1e-9) for a, b in per_seed
        ]
        row["tok_ratio"] = row["mori:output_tok_s"] / max(row["mori-priced:output_tok_s"], 1e-9)
        row["ttft_ratio"] = row["mori:ttft_mean_s"] / max(row["mori-priced:ttft_mean_s"], 1e-9)
        outcomes: Counter[str] = Counter()
        for run in by_policy["mori"]:
            outcomes.update(run.get("outcomes", {}))
        row["outcomes"] = dict(outcomes)
        rows.append(row)
    return rows


def comparison_table(rows: list[dict], title: str) -> Table:
    table = Table(title=title)
    for col in ("corpus", "conc", "cpu", "tok/s priced", "tok/s mori", "ratio"):
        table.add_column(col, justify="right" if col != "corpus" else "left")
    for col in (
        "TTFT priced",
        "TTFT mori",
        "ratio",
        "per seed",
        "p99 priced",
        "p99 mori",
        "verdict",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"{r['corpus']} x{r['scale']:g}",
            str(r["conc"]),
            f"{r['cpu']:g}",
            f"{r['mori-priced:output_tok_s']:.1f}",
            f"{r['mori:output_tok_s']:.1f}",
            f"{r['tok_ratio']:.3f}x",
            f"{r['mori-priced:ttft_mean_s']:.2f} s",
            f"{r['mori:ttft_mean_s']:.2f} s",
            f"{r['ttft_ratio']:.3f}x",
            " ".join(f"{x:.2f}" for x in r["seed_ttft_ratios"]),
            f"{r['mori-priced:ttft_p99_s']:.1f}",
            f"{r['mori:ttft_p99_s']:.1f}",
            verdict(r["tok_ratio"], r["ttft_ratio"]),
        )
    return table


def outcomes_table(rows: list[dict]) -> Table:
    keys = sorted({k for r in rows for k in r["outcomes"]})
    table = Table(title="what the predictions did (sum over seeds)")
    for col in ("corpus", "conc", "cpu", "moves priced", "moves mori", *keys):
        table.add_column(col, justify="right" if col != "corpus" else "left")
    for r in rows:
        table.add_row(
            f"{r['corpus']} x{r['scale']:g}",
            str(r["conc"]),
            f"{r['cpu']:g}",
            f"{r['mori-priced:moves']:.0f}",
            f"{r['mori:moves']:.0f}",
            *(str(r["outcomes"].get(k, 0)) for k in keys),
        )
    return table


def error_table(runs: list[dict]) -> Table:
    """Per corpus and tool kind: sample-weighted means of the runs' error percentiles."""
    acc: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        for kind, stats in run.get("errors", {}).items():
            acc.setdefault((Path(run["corpus"]).name, kind), []).append(stats)
    table = Table(title="predictor error per tool kind (mori runs, weighted by calls)")
    cols = ("corpus", "kind", "calls", "mean actual", "mean pred", "|err| p50", "|err| p90")
    for col in (*cols, "rel p50", "rel p90"):
        table.add_column(col, justify="right" if col not in ("corpus", "kind") else "left")
    for (corpus, kind), stats in sorted(acc.items()):
        n = sum(s["n"] for s in stats)

        def w(field: str, stats=stats, n=n) -> float:
            return sum(s[field] * s["n"] for s in stats) / n

        table.add_row(
            corpus,
            kind,
            str(n),
            f"{w('mean_actual_s'):.2f} s",
            f"{w('mean_predicted_s'):.2f} s",
            f"{w('abs_p50_s'):.2f} s",
            f"{w('abs_p90_s'):.2f} s",
            f"{w('rel_p50'):.2f}",
            f"{w('rel_p90'):.2f}",
        )
    return table


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=200)
    jobs = cells(args)
    runs: list[dict] = []
    columns = ("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("simulating", total=len(jobs))
        with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for run in pool.map(run_one, *zip(*jobs, strict=True)):
                runs.append(run)
                progress.advance(task)
    rows = summarize(runs)
    title = f"mori vs mori-priced, {args.preset}, {args.duration:g} s, {args.seeds} seeds"
    console.print(comparison_table(rows, title))
    console.print(outcomes_table(rows))
    console.print(error_table(runs))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"rows": rows, "runs": runs}, indent=1))
        console.print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
