"""Reports over `RunResult`s: a rich table, MORI's ratios, JSON, CSV and PNG plots.

Shared by `mori sim` and the live replay: everything here takes a list of RunResult
(one per policy x concurrency x CPU-ratio cell) and knows nothing of where it came from.
The plots have the shape of MORI Figs. 7-9: throughput and TTFT versus concurrency, one
line per policy, one panel per CPU ratio.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from router.replay.records import RunResult

REFERENCE = "mori"

# (field, header, format) of the main table (`--wide`); shares are printed as percentages.
COLUMNS: list[tuple[str, str, str]] = [
    ("output_tok_s", "out tok/s", "{:.1f}"),
    ("steps_s", "steps/s", "{:.3f}"),
    ("ttft_mean_s", "TTFT mean", "{:.2f}"),
    ("ttft_p50_s", "TTFT p50", "{:.2f}"),
    ("ttft_p99_s", "TTFT p99", "{:.2f}"),
    ("ttft_max_s", "TTFT max", "{:.1f}"),
    ("gpu_util", "GPU KV", "{:.0%}"),
    ("hit_device", "device", "{:.0%}"),
    ("hit_host", "host", "{:.0%}"),
    ("miss", "miss", "{:.0%}"),
    ("churn", "churn", "{:.1%}"),
    # multi-agent apps (tasks): end-to-end latency and abnormal agent instances
    ("app_e2e_mean_s", "app e2e mean", "{:.1f}"),
    ("app_e2e_p99_s", "app e2e p99", "{:.1f}"),
    ("abnormal_agents", "abnormal agents", "{:d}"),
    # All-Gather rounds (TokenDance): round latency, and KV stored per live agent
    ("round_latency_mean_s", "round mean", "{:.2f}"),
    ("round_latency_p99_s", "round p99", "{:.2f}"),
    ("kv_tokens_per_agent", "KV/agent", "{:.0f}"),
]
# The default table fits 80 columns: throughput, TTFT, KV use and where prompts were found.
NARROW = ("output_tok_s", "ttft_mean_s", "ttft_p99_s", "gpu_util", "hit_device", "miss")
JSON_FIELDS = ["policy", "concurrency", "cpu_ratio"] + [c[0] for c in COLUMNS]


def console(stderr: bool = False) -> Console:
    """A console for reports: piped into a file, rich would assume 80 columns."""
    out = Console(stderr=stderr)
    return out if out.is_terminal else Console(stderr=stderr, width=160)


def _cell(r: RunResult) -> tuple[int, float]:
    return r.concurrency, r.cpu_ratio


def _sorted(results: Iterable[RunResult]) -> list[RunResult]:
    return sorted(results, key=lambda r: (r.cpu_ratio, r.concurrency, r.policy))


def results_table(results: list[RunResult], title: str = "results", wide: bool = False) -> Table:
    """One row per cell, grouped by CPU ratio then concurrency. The default columns fit an
    80-column terminal; `wide` shows every metric (print it with `print_wide`)."""
    columns = [c for c in COLUMNS if wide or c[0] in NARROW]
    table = Table(title=title, header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
    longest = max((len(r.policy) for r in results), default=6)
    table.add_column("policy", no_wrap=True, min_width=longest)  # never cut a policy name
    for header in ["conc", "cpu ratio"] + [c[1] for c in columns]:
        table.add_column(header, justify="right", no_wrap=not wide and " " not in header)
    for r in _sorted(results):
        values = [fmt.format(getattr(r, key)) for key, _, fmt in columns]
        table.add_row(r.policy, str(r.concurrency), f"{r.cpu_ratio:g}", *values)
    return table


def print_results(console: Console, results: list[RunResult], title: str, wide: bool) -> None:
    """The results table, then MORI's ratios; `wide` tables are never cut to the terminal
    (long lines wrap instead)."""
    width = console.width
    if wide:
        console.width = max(width, 200)  # the terminal wraps what it cannot show
    try:
        console.print(results_table(results, title, wide))
    finally:
        console.width = width
    table = ratio_table(results)
    if table is not None:
        console.print(table)


def ratios(results: list[RunResult], reference: str = REFERENCE) -> list[dict]:
    """`reference`'s output tok/s and mean TTFT relative to each other policy, per cell."""
    by_cell: dict[tuple[int, float], dict[str, RunResult]] = {}
    for r in results:
        by_cell.setdefault(_cell(r), {})[r.policy] = r
    out = []
    for (conc, ratio), cell in sorted(by_cell.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ref = cell.get(reference)
        if ref is None:
            continue
        for name, other in sorted(cell.items()):
            if name == reference:
                continue
            out.append(
                {
                    "concurrency": conc,
                    "cpu_ratio": ratio,
                    "versus": name,
                    "throughput_ratio": _div(ref.output_tok_s, other.output_tok_s),
                    "ttft_ratio": _div(ref.ttft_mean_s, other.ttft_mean_s),
                }
            )
    return out


def _div(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def ratio_table(results: list[RunResult], reference: str = REFERENCE) -> Table | None:
    rows = ratios(results, reference)
    if not rows:
        return None
    table = Table(
        title=f"{reference} relative to each policy", header_style="bold", box=box.SIMPLE_HEAD
    )
    for header in ["conc", "cpu ratio", "versus", "out tok/s ratio", "TTFT mean ratio"]:
        table.add_column(header, justify="right")
    for row in rows:
        tput, ttft = row["throughput_ratio"], row["ttft_ratio"]
        table.add_row(
            str(row["concurrency"]),
            f"{row['cpu_ratio']:g}",
            row["versus"],
            "-" if tput is None else f"{tput:.2f}x",
            "-" if ttft is None else f"{ttft:.2f}x",
        )
    return table


def write_json(results: list[RunResult], path: Path, meta: dict | None = None) -> None:
    """{"results": [{policy, concurrency, cpu_ratio, metrics..., extras...}], "ratios": [...]}"""
    doc: dict = {"results": [r.to_dict() for r in _sorted(results)], "ratios": ratios(results)}
    if meta:
        doc["meta"] = meta
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def write_csv(results: list[RunResult], path: Path) -> None:
    """The JSON's result rows, one line each; extra keys after the standard ones."""
    rows = [r.to_dict() for r in _sorted(results)]
    extras = sorted({k for row in rows for k in row} - set(JSON_FIELDS))
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=JSON_FIELDS + extras)
        writer.writeheader()
        writer.writerows(rows)


def plot(results: list[RunResult], path: Path, title: str = "") -> list[Path]:
    """Throughput and TTFT versus concurrency: `<stem>-throughput.png`, `<stem>-ttft.png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cpu_ratios = sorted({r.cpu_ratio for r in results})
    policies = sorted({r.policy for r in results}, key=lambda p: (p != REFERENCE, p))
    written = []
    for metric, label, suffix in (
        ("output_tok_s", "output throughput (tok/s)", "throughput"),
        ("ttft_mean_s", "mean TTFT (s)", "ttft"),
    ):
        fig, axes = plt.subplots(
            1, len(cpu_ratios), figsize=(4.5 * len(cpu_ratios), 3.6), squeeze=False, sharey=True
        )
        for ax, ratio in zip(axes[0], cpu_ratios, strict=True):
            panel = [r for r in results if r.cpu_ratio == ratio]
            if len({r.concurrency for r in panel}) == 1:
                _bars(ax, panel, policies, metric)
            else:
                _lines(ax, panel, policies, metric)
            ax.set_title(f"CPU ratio {ratio:g}x")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel(label)
        if title:
            fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        out = path.with_name(f"{path.stem}-{suffix}.png")
        fig.savefig(out, dpi=120)
        plt.close(fig)
        written.append(out)
    return written


def _lines(ax, panel: list[RunResult], policies: list[str], metric: str) -> None:
    """Metric versus concurrency, one line per policy (MORI Figs. 7-9)."""
    for policy in policies:
        pts = sorted((r.concurrency, getattr(r, metric)) for r in panel if r.policy == policy)
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o", label=policy)
    ax.set_xlabel("concurrent programs")
    ax.legend()


def _bars(ax, panel: list[RunResult], policies: list[str], metric: str) -> None:
    """One concurrency only (a demo, a single live replay): a bar per policy reads better."""
    by_policy = {r.policy: getattr(r, metric) for r in panel}
    names = [p for p in policies if p in by_policy]
    ax.bar(names, [by_policy[p] for p in names], color=[f"C{i}" for i in range(len(names))])
    ax.set_xlabel(f"policy ({panel[0].concurrency} concurrent programs)")


def write_reports(
    results: list[RunResult], json_path: str | Path, title: str = "", meta: dict | None = None
) -> list[Path]:
    """JSON at `json_path`, a CSV next to it, and the two PNG plots; returns the paths."""
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    csv_path = json_path.with_suffix(".csv")
    write_json(results, json_path, meta)
    write_csv(results, csv_path)
    return [json_path, csv_path, *plot(results, json_path, title)]
