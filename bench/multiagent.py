"""Multi-agent workloads: smg (LRU), mori and mori+cachesage under cache pressure (issue 10).

For every workload preset (traces/presets/multiagent-*.yaml: four six-agent supervisor
workloads and the 12-agent chain) and seed, generates the corpus (50 tasks, that seed),
simulates every policy of the scenario (configs/sim/multiagent.yaml: H100 + 8B, device KV
cut to 48k tokens) with that seed, and prints per workload the mean over seeds of the
prompt-token hit rate (device + host), mean TTFT and output tok/s, then the ratios the
issue sets as targets, measured side by side:

    against smg:  hit rate >= +13 pp, mean TTFT <= 0.88x, output tok/s >= 1.06x
    and mori+cachesage >= mori on all three

    python3 bench/multiagent.py                                  # the table (3 seeds)
    python3 bench/multiagent.py --workloads chain,gsm8k --seeds 1 --duration 1200
    python3 bench/multiagent.py --json bench/results/...json     # every run + summary
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from statistics import fmean, pstdev
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project first: bench/kernels.py must not shadow `kernels`
from router.replay.generate import PRESET_DIR  # noqa: E402
from router.replay.generators import generate, load_preset  # noqa: E402
from router.sim.cli import load_scenario  # noqa: E402
from router.sim.simulator import SimConfig, simulate  # noqa: E402

TASKS = 50  # CacheSage's traces: 50 tasks per workload
HIT_PP, TTFT_X, TOK_X = 13.0, 0.88, 1.06
BASE, OURS, MORI = "smg", "mori+cachesage", "mori"


def _csv(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workloads = sorted(p.stem.removeprefix("multiagent-") for p in PRESET_DIR.glob("multiagent-*"))
    ap.add_argument("--scenario", default="configs/sim/multiagent.yaml")
    ap.add_argument("--workloads", type=_csv, default=workloads, help="e.g. gsm8k,chain")
    ap.add_argument("--policies", type=_csv, help="default: the scenario's")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (corpus and run)")
    ap.add_argument("--duration", type=float, help="virtual seconds per run (scenario's)")
    ap.add_argument("--jobs", type=int, default=2, help="parallel processes")
    ap.add_argument("--json", dest="json_out", help="write every run and the summary here")
    return ap.parse_args(argv)


def run_one(
    job: tuple[str, int, SimConfig], family: str = "multiagent", tasks: int = TASKS
) -> dict:
    """One simulation of preset `{family}-{workload}`'s corpus of `tasks` tasks."""
    workload, seed, config = job
    corpus = list(generate(load_preset(f"{family}-{workload}"), tasks, seed))
    row = simulate(corpus, config).to_dict()
    row.update(workload=workload, seed=seed, hit=1.0 - row["miss"])
    return row


def jobs(args: argparse.Namespace) -> list[tuple[str, int, SimConfig]]:
    sc = load_scenario(args.scenario)
    out = []
    for workload in args.workloads:
        for seed in range(args.seeds):
            for policy in args.policies or sc.policies:
                config = SimConfig(
                    policy=policy,
                    preset=sc.preset,
                    replicas=sc.replicas,
                    concurrency=sc.concurrency[0],
                    cpu_ratio=sc.cpu_ratio[0],
                    duration_s=args.duration or sc.duration_s,
                    seed=seed,
                    start_jitter_s=sc.start_jitter_s,
                    policy_config=dict(sc.policy),
                    gpu_tokens=sc.gpu_tokens,
                )
                out.append((workload, seed, config))
    return out


def summarize(rows: list[dict]) -> list[dict]:
    """Per (workload, policy): means and spreads over seeds, and the ratios per seed."""
    out = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == workload]
        by = {(r["policy"], r["seed"]): r for r in mine}  # one run per policy and seed
        for policy in dict.fromkeys(r["policy"] for r in mine):
            runs = [r for r in mine if r["policy"] == policy]
            entry = {"workload": workload, "policy": policy, "seeds": len(runs)}
            for key in ("hit", "hit_host", "ttft_mean_s", "ttft_p99_s", "output_tok_s"):
                values = [r[key] for r in runs]
                entry[key], entry[key + "_sd"] = fmean(values), pstdev(values)
            refs = [BASE] if policy == MORI else [BASE, MORI]
            for ref in refs if policy != BASE else []:
                pairs = [(r, by.get((ref, r["seed"]))) for r in runs]
                entry.update(_ratios([(r, b) for r, b in pairs if b is not None], ref))
            out.append(entry)
    return out


def _ratios(pairs: list[tuple[dict, dict]], ref: str) -> dict:
    """Mean over seeds of the per-seed differences against `ref` (same seed, same corpus)."""
    if not pairs:
        return {}
    return {
        f"hit_pp_vs_{ref}": fmean(100 * (r["hit"] - b["hit"]) for r, b in pairs),
        f"ttft_x_vs_{ref}": fmean(r["ttft_mean_s"] / b["ttft_mean_s"] for r, b in pairs),
        f"tok_x_vs_{ref}": fmean(r["output_tok_s"] / b["output_tok_s"] for r, b in pairs),
    }


def _mark(ok: bool) -> str:
    return "[green]yes[/green]" if ok else "[red]no[/red]"


def table(summary: list[dict], title: str) -> Table:
    t = Table(title=title, header_style="bold")
    for col in ("workload", "policy", "hit rate", "host", "TTFT mean s", "TTFT p99 s", "out tok/s"):
        t.add_column(col, justify="left" if col in ("workload", "policy") else "right")
    for col in ("vs smg: hit", "TTFT", "tok/s", "targets", "vs mori: hit", "TTFT", "tok/s"):
        t.add_column(col, justify="right")
    for e in summary:
        cells = [
            e["workload"],
            e["policy"],
            f"{100 * e['hit']:.1f}% ±{100 * e['hit_sd']:.1f}",
            f"{100 * e['hit_host']:.1f}%",
            f"{e['ttft_mean_s']:.2f} ±{e['ttft_mean_s_sd']:.2f}",
            f"{e['ttft_p99_s']:.1f}",
            f"{e['output_tok_s']:.1f} ±{e['output_tok_s_sd']:.1f}",
        ]
        if "hit_pp_vs_smg" in e:
            ok = (
                e["hit_pp_vs_smg"] >= HIT_PP
                and e["ttft_x_vs_smg"] <= TTFT_X
                and e["tok_x_vs_smg"] >= TOK_X
            )
            cells += [
                f"{e['hit_pp_vs_smg']:+.1f} pp",
                f"{e['ttft_x_vs_smg']:.2f}x",
                f"{e['tok_x_vs_smg']:.2f}x",
                _mark(ok),
            ]
        else:
            cells += ["", "", "", ""]
        if "hit_pp_vs_mori" in e:
            cells += [
                f"{e['hit_pp_vs_mori']:+.1f} pp",
                f"{e['ttft_x_vs_mori']:.2f}x",
                f"{e['tok_x_vs_mori']:.2f}x",
            ]
        else:
            cells += ["", "", ""]
        t.add_row(*cells)
    return t


def run_all(todo: list, run: Callable[[Any], dict], workers: int, console: Console) -> list[dict]:
    """`run` on every job in `workers` processes, in order, with a progress bar."""
    rows = []
    columns = ("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn())
    with (
        Progress(*columns, TimeElapsedColumn(), console=console) as progress,
        ProcessPoolExecutor(max_workers=workers) as pool,
    ):
        task = progress.add_task("simulating", total=len(todo))
        for row in pool.map(run, todo):
            rows.append(row)
            progress.advance(task)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=200)
    rows = run_all(jobs(args), run_one, args.jobs, console)
    summary = summarize(rows)
    sc = load_scenario(args.scenario)
    title = (
        f"{sc.preset}, GPU KV {sc.gpu_tokens:,} tokens, CPU ratio {sc.cpu_ratio[0]:g}, "
        f"{sc.concurrency[0]} tasks, {args.duration or sc.duration_s:g} s, {args.seeds} seeds"
    )
    console.print(table(summary, title))
    walls = [r["sim_wall_s"] for r in rows]
    console.print(f"sim wall per run: mean {fmean(walls):.1f} s, max {max(walls):.1f} s")
    if args.json_out:
        doc = {"scenario": args.scenario, "title": title, "summary": summary, "runs": rows}
        Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        console.print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
