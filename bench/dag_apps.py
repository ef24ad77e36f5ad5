"""DAG multi-agent apps: application latency under the space scheduler (issue 11).

For both DAG presets (traces/presets/dag-code-writer.yaml, dag-deep-research.yaml) and
every seed, generates the corpus (that seed), replays it open loop in `mori sim` (tasks
arrive as a Poisson process, Tokencake §7.1, at a rate that keeps the replica near its
throughput and its KV cache full; the scenario: configs/sim/multiagent.yaml, H100 + 8B
with 48k device KV tokens) under every policy, and prints per workload the mean over seeds
of the application end-to-end latency (mean, p99), abnormal agents (an agent instance
slower than 1.5x its type's mean), output tok/s, and the ratios the issue sets as targets,
per seed against smg and against `mori` (= `mori-priced` + the time scheduler):

    mori+space: app e2e mean <= 0.7x smg and <= 0.9x mori; abnormal agents <= 0.5x mori

    python3 bench/dag_apps.py                                   # the table (3 seeds)
    python3 bench/dag_apps.py --set critical_ratio=0            # ablation: no reserved pool
    python3 bench/dag_apps.py --json bench/results/...json      # every run + summary
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from statistics import fmean

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.multiagent

from bench.multiagent import run_all, run_one  # noqa: E402
from router.sim.cli import _setting, load_scenario
from router.sim.simulator import SimConfig

TASKS = 200  # more than arrive in a run: no task repeats
RATES = {"code-writer": 0.04, "deep-research": 0.05}  # tasks/s: ~95 % of tok/s capacity
POLICIES = ["smg", "mori-priced", "mori", "mori+space", "mori-priced+space"]
E2E_SMG, E2E_MORI, ABNORMAL_MORI = 0.7, 0.9, 0.5
KEYS = ("app_e2e_mean_s", "app_e2e_p99_s", "abnormal_agents", "agents_done", "output_tok_s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="configs/sim/multiagent.yaml")
    ap.add_argument("--workloads", nargs="+", default=list(RATES), choices=list(RATES))
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (corpus and run)")
    ap.add_argument("--rate-x", type=float, default=1.0, help="scale every arrival rate")
    ap.add_argument("--duration", type=float, default=1800.0, help="arrivals span (s)")
    ap.add_argument(
        "--set", nargs="*", type=_setting, default=[], metavar="KNOB=VALUE", help="policy knobs"
    )
    ap.add_argument("--jobs", type=int, default=2, help="parallel processes")
    ap.add_argument("--json", dest="json_out", help="write every run and the summary here")
    return ap.parse_args(argv)


def jobs(args: argparse.Namespace) -> list[tuple[str, int, SimConfig]]:
    sc = load_scenario(args.scenario)
    knobs = dict(args.set)
    return [
        (
            workload,
            seed,
            SimConfig(
                policy=policy,
                preset=sc.preset,
                replicas=sc.replicas,
                cpu_ratio=sc.cpu_ratio[0],
                duration_s=args.duration,
                seed=seed,
                policy_config={**sc.policy, **knobs},
                gpu_tokens=sc.gpu_tokens,
                arrival_rate=RATES[workload] * args.rate_x,
            ),
        )
        for workload in args.workloads
        for seed in range(args.seeds)
        for policy in args.policies
    ]


def summarize(rows: list[dict]) -> list[dict]:
    """Per (workload, policy): means over seeds, and the per-seed ratios' means."""
    out = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == workload]
        by = {(r["policy"], r["seed"]): r for r in mine}
        for policy in dict.fromkeys(r["policy"] for r in mine):
            runs = [r for r in mine if r["policy"] == policy]
            entry = {"workload": workload, "policy": policy, "seeds": len(runs)}
            entry.update({k: fmean(r[k] for r in runs) for k in KEYS})
            for ref in ("smg", "mori"):
                pairs = [(r, by[ref, r["seed"]]) for r in runs if (ref, r["seed"]) in by]
                if pairs and policy != ref:
                    entry[f"e2e_x_{ref}"] = fmean(
                        r["app_e2e_mean_s"] / b["app_e2e_mean_s"] for r, b in pairs
                    )
                    entry[f"abnormal_x_{ref}"] = fmean(
                        r["abnormal_agents"] / max(1, b["abnormal_agents"]) for r, b in pairs
                    )
            out.append(entry)
    return out


def _x(entry: dict, key: str, limit: float) -> str:
    if key not in entry:
        return ""
    color = "green" if entry[key] <= limit else "red"
    return f"[{color}]{entry[key]:.2f}x[/{color}]"


def table(summary: list[dict], title: str) -> Table:
    t = Table(title=title, header_style="bold")
    heads = ["workload", "policy", "e2e mean s", "e2e p99 s", "abnormal", "agents", "tok/s"]
    heads += ["e2e vs smg", "e2e vs mori", "abnormal vs mori"]
    for col in heads:
        t.add_column(col, justify="left" if col in ("workload", "policy") else "right")
    for e in summary:
        t.add_row(
            e["workload"],
            e["policy"],
            f"{e['app_e2e_mean_s']:.0f}",
            f"{e['app_e2e_p99_s']:.0f}",
            f"{e['abnormal_agents']:.0f}",
            f"{e['agents_done']:.0f}",
            f"{e['output_tok_s']:.0f}",
            _x(e, "e2e_x_smg", E2E_SMG),
            _x(e, "e2e_x_mori", E2E_MORI),
            _x(e, "abnormal_x_mori", ABNORMAL_MORI),
        )
    return t


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=200)
    run = functools.partial(run_one, family="dag", tasks=TASKS)
    rows = run_all(jobs(args), run, args.jobs, console)
    summary = summarize(rows)
    sc = load_scenario(args.scenario)
    rates = ", ".join(f"{w} {RATES[w] * args.rate_x:g}/s" for w in args.workloads)
    title = (
        f"{sc.preset}, GPU KV {sc.gpu_tokens:,} tokens, CPU ratio {sc.cpu_ratio[0]:g}, "
        f"open loop ({rates}) over {args.duration:g} s, {args.seeds} seeds"
        + "".join(f", {k}={v}" for k, v in args.set)
    )
    console.print(table(summary, title))
    if args.json_out:
        doc = {"title": title, "args": vars(args), "summary": summary, "runs": rows}
        Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        console.print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
