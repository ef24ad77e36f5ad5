"""Every policy on every corpus, load and CPU ratio, averaged over seeds, in one command.

    python bench/policy_matrix.py                                  # the full matrix (~10 min)
    python bench/policy_matrix.py --corpora claude-x0.25 --programs 80 --seeds 0
    python bench/policy_matrix.py --write bench/results/2026-11-23-policy-matrix.md
    python bench/policy_matrix.py --sweep aging_s=0,120,300 --seeds 0 1   # mori variants
    python bench/policy_matrix.py --seeds 0 --duration 600 --json before.json  # parity:
    python bench/policy_matrix.py --seeds 0 --duration 600 --compare before.json  # same figures?

    python bench/policy_matrix.py --deployments h200-moe-x3 --programs 50 80 --cpu-ratio 1 \
        --corpora generated claude-x0.5 --duration 1800            # the 3-replica cells

Simulated (`mori sim`'s engine model, one virtual hour per run by default). Deployments:
`h100-8b` (one H100 + Llama-3.1-8B replica), `h100-8b-x2` (two of them) and `h200-moe-x3`
(three H200 + Qwen3-30B-A3B replicas, MORI's Fig. 10); `--programs` counts programs per
replica, as the paper does (80 on three replicas: 240 programs). Per cell (deployment x
corpus x programs x CPU ratio) it prints, for each policy, the mean over seeds of output
tok/s, TTFT mean / p99 / max, requests in the engine, the share of prompt tokens
recomputed (miss) and the share of programs that ran on more than one replica (churn),
then `mori`'s ratio to the best baseline (smg, ta, ta+o, continuum, and mori-paper where
it runs) and its TTFT p99 against 2x smg's, the targets of docs/policy.md. Requests still
held when a run ends are counted in TTFT max (their wait so far), so starvation cannot
hide.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from datetime import date
from functools import cache
from pathlib import Path

import yaml
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from router.replay.trace import TraceProgram, load_trace  # noqa: E402
from router.sim.simulator import SimConfig, simulate  # noqa: E402

CORPORA = {  # name -> (trace, token scale)
    "generated": ("traces/generated-claude-code.jsonl", 1.0),
    "generated-32k": ("traces/generated-claude-code-32k.jsonl", 1.0),
    "claude-x0.25": ("traces/claude-code-sample.jsonl", 0.25),
    "claude-x0.5": ("traces/claude-code-sample.jsonl", 0.5),
}
DEPLOYMENTS = {  # name -> (preset, replicas)
    "h100-8b": ("h100-8b", 1),
    "h100-8b-x2": ("h100-8b", 2),
    "h200-moe-x3": ("h200-30b-moe", 3),
}
POLICIES = ["mori", "mori-priced", "mori-paper", "continuum", "ta+o", "ta", "smg"]
BASELINES = ("smg", "ta", "ta+o", "continuum", "mori-paper")
TARGET_TPUT = 0.98  # mori >= 0.98x the best baseline's output tok/s
TARGET_P99 = 2.0  # mori's TTFT p99 <= 2x smg's
SWEPT: set[str] = set()  # knobs given by --sweep (shown in the policy column)
METRICS = (
    "output_tok_s", "ttft_mean_s", "ttft_p99_s", "ttft_max_s", "running_mean", "churn",
    "failed_steps", "ttft_p99_inflight_s", "start_wait_p99_s",
)  # fmt: skip
TIE = 1.05  # in-flight TTFT p99 within 5 % of smg's is a tie


@dataclass(frozen=True)
class Run:
    deployment: str
    corpus: str
    programs: int
    cpu_ratio: float
    seed: int
    policy: str
    duration_s: float
    settings: tuple[tuple[str, object], ...] = ()

    @property
    def label(self) -> str:
        """The policy's name in the tables: a swept variant shows its setting."""
        swept = [f"{k}={v}" for k, v in self.settings if k in SWEPT]
        return f"{self.policy}[{','.join(swept)}]" if swept else self.policy


@cache
def _trace(path: str) -> list[TraceProgram]:
    return load_trace(ROOT / path)


def run_one(run: Run) -> tuple[Run, dict[str, float]]:
    trace, scale = CORPORA[run.corpus]
    preset, replicas = DEPLOYMENTS[run.deployment]
    cfg = SimConfig(
        policy=run.policy,
        preset=preset,
        replicas=replicas,
        concurrency=run.programs * replicas,
        cpu_ratio=run.cpu_ratio,
        duration_s=run.duration_s,
        token_scale=scale,
        seed=run.seed,
        policy_config=dict(run.settings),
    )
    result = simulate(_trace(trace), cfg)
    row = {m: getattr(result, m, None) or result.extra.get(m, 0.0) for m in METRICS}
    row["ttft_max_s"] = max(row["ttft_max_s"], result.extra["held_max_wait_s"])
    row["miss"] = result.miss
    return run, row


def mean_rows(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}


def verdicts(
    cell: dict[str, dict[str, float]], name: str = "mori"
) -> dict[str, float | bool | str]:
    """`name` (a mori variant) against the best baseline of the cell and smg's tail."""
    present = [b for b in BASELINES if b in cell]
    if name not in cell or not present:
        return {}
    best = max(present, key=lambda b: cell[b]["output_tok_s"])
    ratio = cell[name]["output_tok_s"] / max(cell[best]["output_tok_s"], 1e-9)
    mine = cell[name]
    out: dict[str, float | bool | str] = {"best": best, "tput_ratio": ratio}
    out["failed_ok"] = mine["failed_steps"] == 0  # a cell with failed steps is no win
    out["tput_ok"] = ratio >= TARGET_TPUT and bool(out["failed_ok"])
    if "smg" in cell:
        p99 = mine["ttft_p99_s"] / max(cell["smg"]["ttft_p99_s"], 1e-9)
        out["p99_ratio"], out["p99_ok"] = p99, p99 <= TARGET_P99
        smg = max(cell["smg"]["ttft_p99_inflight_s"], 1.0)  # under a second: a tie
        inflight = mine["ttft_p99_inflight_s"] / smg
        out["inflight_ratio"], out["inflight_ok"] = inflight, inflight <= TIE
    return out


def scorecard(cells: dict, names: list[str]) -> list[str]:
    """Per mori variant: in how many cells each target holds, and its mean tok/s ratio."""
    lines = []
    for name in names:
        vs = [v for v in (verdicts(c, name) for c in cells.values()) if v]
        if not vs:
            continue
        tput = sum(bool(v["tput_ok"]) for v in vs)
        failed = sum(not v["failed_ok"] for v in vs)
        p99 = sum(bool(v.get("p99_ok", True)) for v in vs)
        inflight = sum(bool(v.get("inflight_ok", True)) for v in vs)
        both = sum(bool(v["tput_ok"]) and bool(v.get("inflight_ok", True)) for v in vs)
        mean = statistics.fmean(float(v["tput_ratio"]) for v in vs)
        lines.append(
            f"{name}: tok/s >= {TARGET_TPUT}x best baseline in {tput}/{len(vs)} cells "
            f"(cells with failed steps: {failed}), in-flight TTFT p99 <= {TIE}x smg's in "
            f"{inflight}/{len(vs)}, both in {both}/{len(vs)}; TTFT p99 <= {TARGET_P99}x smg "
            f"in {p99}/{len(vs)}; mean ratio to the best baseline {mean:.3f}"
        )
    return lines


def _value(text: str) -> object:
    """A knob's value as YAML reads it (60 -> int, 0.5 -> float, true -> bool)."""
    return yaml.safe_load(text)


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next(x.split(":", 1)[1].strip() for x in out.splitlines() if "Model name" in x)
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return f"{model} ({os.cpu_count()} vCPU), Python {platform.python_version()}"


def render(cells: dict, policies: list[str], console: Console) -> list[str]:
    """One rich table per deployment and corpus; returns the same as Markdown lines."""
    md: list[str] = []
    for group in dict.fromkeys(k[:2] for k in cells):
        title = f"{group[1]} on {group[0]}"
        table = Table(title=f"{title} (mean over seeds)", header_style="bold")
        heads = ["programs", "cpu", "policy", "tok/s", "TTFT mean", "p99", "max", "in engine"]
        heads += ["miss", "churn", "failed", "in-flight p99", "start p99"]
        heads += ["mori/best (higher better)", "in-flight p99/smg (lower better)"]
        for h in heads:
            table.add_column(h, justify="left" if h == "policy" else "right")
        md += [f"### {title}", "", "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
        for (deployment, corpus, programs, ratio), cell in cells.items():
            if (deployment, corpus) != group:
                continue
            v = verdicts(cell, next(p for p in policies if p in cell))
            for i, name in enumerate(p for p in policies if p in cell):
                m = cell[name]
                row = [str(programs), f"{ratio:g}", name, f"{m['output_tok_s']:.1f}"]
                row += [f"{m['ttft_mean_s']:.1f}", f"{m['ttft_p99_s']:.0f}"]
                row += [f"{m['ttft_max_s']:.0f}", f"{m['running_mean']:.1f}"]
                row += [f"{m['miss']:.0%}", f"{m['churn']:.1%}", f"{m['failed_steps']:.0f}"]
                row += [f"{m['ttft_p99_inflight_s']:.0f}", f"{m['start_wait_p99_s']:.0f}"]
                if i == 0 and v:
                    tick = lambda ok: "" if ok else " MISS"  # noqa: E731
                    row.append(f"{v['tput_ratio']:.2f}x vs {v['best']}{tick(v['tput_ok'])}")
                    row.append(
                        f"{v['inflight_ratio']:.2f}x{tick(v['inflight_ok'])}"
                        if "inflight_ratio" in v
                        else ""
                    )
                else:
                    row += ["", ""]
                table.add_row(*map(escape, row), end_section=i == len(cell) - 1)
                md.append("| " + " | ".join(row) + " |")
        console.print(table)
        md.append("")
    return md


def plot_frontier(cells: dict, labels: list[str], knob: str, path: Path) -> None:
    """One panel per cell: output tok/s against in-flight TTFT p99 (lower is better) for each
    value of the swept `knob` (a line, the policy's default starred) and for each baseline (a
    point, its failed steps beside it: a failed step is worse than any wait)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from router.policy.base import PolicyConfig

    default = getattr(PolicyConfig(), knob, None)
    swept = [label for label in labels if label.startswith("mori[")]
    cols = min(4, len(cells))
    rows = -(-len(cells) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4.2 * rows), squeeze=False)
    panels = zip(axes.flat, cells.items(), strict=False)  # a grid may have spare panels
    for ax, ((deployment, corpus, programs, ratio), cell) in panels:
        pts = [(cell[lb]["ttft_p99_inflight_s"], cell[lb]["output_tok_s"], lb) for lb in swept]
        ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], "o-", color="C0", label="mori")
        for x, y, label in pts:
            value = _value(label.split("=", 1)[1].rstrip("]"))
            star = value == default
            ax.annotate(f"{value:g}" + (" (default)" if star else ""), (x, y), fontsize=8)
            if star:
                ax.plot([x], [y], "*", ms=16, color="C3")
        for i, name in enumerate(b for b in BASELINES if b in cell):
            m = cell[name]
            ax.plot(m["ttft_p99_inflight_s"], m["output_tok_s"], "s", color=f"C{i + 1}")
            failed = f", {m['failed_steps']:.0f} failed" if m["failed_steps"] else ""
            ax.annotate(f"{name}{failed}", (m["ttft_p99_inflight_s"], m["output_tok_s"]),
                        fontsize=8, color=f"C{i + 1}")  # fmt: skip
        ax.set_title(f"{corpus}, {programs} programs, CPU {ratio:g} ({deployment})", fontsize=9)
        ax.set_xlabel("in-flight step TTFT p99 (s), lower is better")
        ax.set_ylabel("output tok/s, higher is better")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(cells) :]:
        ax.axis("off")
    fig.suptitle(f"mori's {knob} against throughput and the in-flight tail (mean over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deployments", nargs="+", default=["h100-8b"], choices=DEPLOYMENTS)
    parser.add_argument("--corpora", nargs="+", default=list(CORPORA), choices=list(CORPORA))
    parser.add_argument("--programs", nargs="+", type=int, default=[20, 50, 80], help="per replica")
    parser.add_argument("--cpu-ratio", nargs="+", type=float, default=[1.0, 2.0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3])
    parser.add_argument("--policies", nargs="+", default=POLICIES)
    parser.add_argument("--duration", type=float, default=3600.0)
    parser.add_argument("--set", dest="settings", nargs="*", default=[], metavar="KNOB=VALUE",
                        help="knobs of the mori policies (e.g. aging_s=120)")  # fmt: skip
    parser.add_argument("--sweep", metavar="KNOB=V1,V2", help="mori variants, one per value")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path, help="write every run's metrics as JSON")
    parser.add_argument("--write", type=Path, help="append the tables as Markdown")
    parser.add_argument(
        "--frontier",
        type=Path,
        metavar="PNG",
        help="with --sweep: plot each cell's output tok/s against its in-flight TTFT p99, the "
        "swept values as a line (the default starred), the baselines as points",
    )
    parser.add_argument(
        "--compare", type=Path, metavar="JSON",
        help="exit 1 unless every run's figures equal those of this --json file (a change "
        "meant to keep behaviour: run the same command on the parent with --json first)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    settings = tuple((k, _value(v)) for k, _, v in (s.partition("=") for s in args.settings))

    def family(policy: str) -> tuple[tuple[str, object], ...]:
        return settings if policy.startswith("mori") else ()  # --set is for MORI's knobs

    variants = [settings]
    if args.sweep:
        knob, _, values = args.sweep.partition("=")
        SWEPT.add(knob)
        variants = [(*settings, (knob, _value(v))) for v in values.split(",")]
    runs = [
        Run(d, c, n, r, s, p, args.duration, variant if p == "mori" else family(p))
        for d in args.deployments
        for c in args.corpora
        for n in args.programs
        for r in args.cpu_ratio
        for s in args.seeds
        for p in args.policies
        for variant in (variants if p == "mori" else [()])
    ]
    for variant in dict.fromkeys(run.settings for run in runs):  # here, not in a worker
        try:
            SimConfig(policy_config=dict(variant))
        except ValueError as e:
            parser.error(str(e))
    labels = list(dict.fromkeys(run.label for run in runs))
    results: list[tuple[Run, dict[str, float]]] = []
    with Progress(transient=True) as progress, ProcessPoolExecutor(args.jobs) as pool:
        task = progress.add_task("simulating", total=len(runs))
        for done in pool.map(run_one, runs, chunksize=1):
            results.append(done)
            progress.advance(task)
    cells: dict[tuple[str, str, int, float], dict[str, dict[str, float]]] = {}
    cell_of = lambda r: (r.deployment, r.corpus, r.programs, r.cpu_ratio)  # noqa: E731
    for key in dict.fromkeys(cell_of(r) for r, _ in results):
        by_policy: dict[str, list[dict[str, float]]] = {}
        for run, row in results:
            if cell_of(run) == key:
                by_policy.setdefault(run.label, []).append(row)
        cells[key] = {p: mean_rows(rows) for p, rows in by_policy.items()}
    console = Console(width=140)
    md = render(cells, labels, console)
    summary = scorecard(cells, [label for label in labels if label.startswith("mori")])
    for line in summary:
        console.print(line, markup=False)
    if args.frontier and args.sweep:
        knob = args.sweep.partition("=")[0]
        plot_frontier(cells, labels, knob, args.frontier)
        console.print(f"frontier plot: {args.frontier}")
    rows = [{**run.__dict__, "settings": dict(run.settings), **row} for run, row in results]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.write:
        command = " ".join(["python bench/policy_matrix.py", *(argv or sys.argv[1:])])
        head = [f"## {date.today().isoformat()} - {machine()}", "", f"`{command}`", ""]
        head += [f"- {line}" for line in summary] + [""]
        with args.write.open("a") as fh:
            fh.write("\n".join(head + md) + "\n")
    if args.compare:
        differences = compare(json.loads(args.compare.read_text()), rows)
        for line in differences:
            console.print(line, markup=False)
        console.print(f"{len(rows)} runs, {len(differences)} differ from {args.compare}")
        return 1 if differences else 0
    return 0


def compare(before: list[dict], after: list[dict]) -> list[str]:
    """Per run (its cell, seed, policy and settings), the figures that differ between two
    `--json` files' rows, exactly: the simulator runs on a virtual clock, so a change that
    keeps the policies' behaviour keeps every figure to the last digit."""
    figures = set(METRICS) | {"miss"}

    def key(row: dict) -> str:
        return json.dumps({k: v for k, v in row.items() if k not in figures}, sort_keys=True)

    old = {key(row): row for row in before}
    out = []
    for row in after:
        was = old.get(key(row))
        if was is None:
            out.append(f"{key(row)}: not in the earlier file")
            continue
        moved = [f"{m} {was[m]!r} -> {row[m]!r}" for m in sorted(figures) if was.get(m) != row[m]]
        if moved:
            out.append(f"{key(row)}: {', '.join(moved)}")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
