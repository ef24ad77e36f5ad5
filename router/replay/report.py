"""Reports over `RunResult`s: a rich table, MORI's ratios, JSON, CSV and PNG plots.

Shared by `mori sim`, the live replay and the demo: everything here takes a list of
RunResult (one per policy x concurrency x CPU-ratio cell, and per run when a cell is
repeated) and knows nothing of where it came from. Repeated runs of a cell (the demo's
`--reps`, one seed each) are shown as their mean; MORI's ratios are taken run by run
(MORI against each policy on the same seed) and shown as mean and range. The plots have the
shape of MORI Figs. 7-9: throughput and TTFT versus concurrency, one line per policy, one
panel per CPU ratio (a bar per policy when there is one concurrency).
"""

from __future__ import annotations

import csv
import json
import textwrap
from collections.abc import Iterable
from dataclasses import fields, replace
from pathlib import Path
from statistics import fmean

from rich import box
from rich.console import Console
from rich.table import Table

from router.replay.records import RunResult

REFERENCE = "mori"
NARROW_WIDTH = 80  # the default table and the legend fit a fresh terminal

# Every registered policy in words, for the legend under the tables (a test checks that
# none is missing and that each fits one 80-column line).
POLICY_WORDS: dict[str, str] = {
    "mori": "MORI: program-aware KV tiers, priced moves, tool timing",
    "mori-priced": "MORI without tool-time prediction",
    "mori-paper": "MORI as its paper states it (idleness tiers only)",
    "mori+cachesage": "MORI + CacheSage's learned agent transitions",
    "mori+space": "MORI + Tokencake's space scheduler (app graphs)",
    "mori-priced+space": "mori-priced + Tokencake's space scheduler",
    "mori+tokendance": "MORI + TokenDance's collective scheduling of rounds",
    "continuum": "Continuum: pins a program's KV for a tool-call TTL",
    "ta": "ThunderAgent: program-aware pause/resume, no host tier",
    "ta+o": "ThunderAgent + offload to the engine's LRU host tier",
    "smg": "SGLang-gateway-like cache-aware routing, no gate",
}
COLUMN_WORDS = (
    "out tok/s (higher is better) and TTFT (time to first token, lower is better) are on the "
    "trace clock, what a real-time run would show; GPU KV use = mean share of the GPU KV "
    "budget held by running requests; "
    "device hit, miss = share of prompt tokens found in GPU KV, recomputed (the rest was "
    "loaded from host DRAM); churn = share of programs whose steps ran on more than one "
    "replica; CPU ratio = host KV budget / GPU KV budget; in-flight TTFT = the steps of "
    "programs that have run one; start wait = a program's first attempt to its first token "
    "(times it was told to come back included); failed steps = steps the client gave up on "
    "(the SDKs' two retries spent)."
)

# (field, header, format) of the main table (`--wide`); shares are printed as percentages.
# Headers are two lines (what, then the unit or kind), so the default table fits 80 columns.
COLUMNS: list[tuple[str, str, str]] = [
    ("output_tok_s", "out\ntok/s", "{:.1f}"),
    ("steps_s", "steps/s", "{:.3f}"),
    ("ttft_mean_s", "TTFT s\nmean", "{:.2f}"),
    ("ttft_p50_s", "TTFT s\np50", "{:.2f}"),
    ("ttft_p99_s", "TTFT s\np99", "{:.1f}"),
    ("ttft_max_s", "TTFT s\nmax", "{:.1f}"),
    ("gpu_util", "GPU KV\nuse", "{:.0%}"),
    ("hit_device", "device\nhit", "{:.0%}"),
    ("hit_host", "host\nhit", "{:.0%}"),
    ("miss", "miss", "{:.0%}"),
    ("churn", "churn", "{:.1%}"),
    # overload: steps that failed (the gate's timeout, retried as the SDKs do), the TTFT of
    # the steps of programs in flight, and what starts waited from their first attempt
    ("failed_steps", "failed\nsteps", "{:d}"),
    ("ttft_p99_inflight_s", "in-flight\nTTFT p99", "{:.1f}"),
    ("start_wait_p99_s", "start s\nwait p99", "{:.1f}"),
    # multi-agent apps (tasks): end-to-end latency and abnormal agent instances
    ("app_e2e_mean_s", "app e2e s\nmean", "{:.1f}"),
    ("app_e2e_p99_s", "app e2e s\np99", "{:.1f}"),
    ("abnormal_agents", "abnormal\nagents", "{:d}"),
    # All-Gather rounds (TokenDance): round latency, and KV stored per live agent
    ("round_latency_mean_s", "round s\nmean", "{:.2f}"),
    ("round_latency_p99_s", "round s\np99", "{:.2f}"),
    ("kv_tokens_per_agent", "KV per\nagent", "{:.0f}"),
]
# The default table fits 80 columns: throughput, TTFT p99 of all steps and of the steps of
# programs in flight, what starts waited, recomputed prompt tokens, failed steps (TTFT mean
# is in the ratio table; KV use, hits and churn in `--wide`).
NARROW = (
    "output_tok_s", "ttft_p99_s", "ttft_p99_inflight_s", "start_wait_p99_s", "miss",
    "failed_steps",
)  # fmt: skip
CELL_HEADERS = ("conc", "CPU\nratio")
JSON_FIELDS = ["policy", "concurrency", "cpu_ratio"] + [c[0] for c in COLUMNS]
# How each metric is printed, so that the plots' values read as the table's do.
FORMATS = {field: fmt for field, _, fmt in COLUMNS}
HIGHER, LOWER = "↑ higher better", "↓ lower better"
# (ratio key, RunResult field, header, which way favours MORI) of MORI's ratios to each
# policy: a ratio of a higher-is-better metric favours MORI above 1, of a lower-is-better
# one below 1, and the header says which.
RATIOS = (
    ("throughput_ratio", "output_tok_s", "out tok/s", HIGHER),
    ("ttft_ratio", "ttft_mean_s", "TTFT mean", LOWER),
    ("ttft_p99_ratio", "ttft_p99_s", "TTFT p99", LOWER),
)
# (metric, axis label, file suffix) of the plots.
PLOTS = (
    ("output_tok_s", "output throughput (tok/s), higher is better", "throughput"),
    ("ttft_mean_s", "mean TTFT (s), lower is better", "ttft"),
    ("ttft_p99_s", "TTFT p99 (s), lower is better", "ttft-p99"),
)
# The waits of the two kinds of steps side by side: a program's next step, and a start.
KINDS = (("ttft_p99_inflight_s", "in-flight step TTFT p99"), ("start_wait_p99_s", "start wait p99"))


def console(stderr: bool = False) -> Console:
    """The console reports print on: the terminal's width, 80 columns when piped (the wide
    table widens itself, see `print_results`)."""
    return Console(stderr=stderr)


def _cell(r: RunResult) -> tuple[int, float]:
    return r.concurrency, r.cpu_ratio


def _sorted(results: Iterable[RunResult]) -> list[RunResult]:
    return sorted(results, key=lambda r: (r.cpu_ratio, r.concurrency, *_policy_order(r.policy)))


def _policy_order(policy: str) -> tuple[bool, str]:
    """MORI first, then the others by name."""
    return policy != REFERENCE, policy


def _groups(results: Iterable[RunResult]) -> dict[tuple[str, int, float], list[RunResult]]:
    """The runs of each (policy, concurrency, CPU ratio), in their order."""
    out: dict[tuple[str, int, float], list[RunResult]] = {}
    for r in results:
        out.setdefault((r.policy, *_cell(r)), []).append(r)
    return out


def aggregate(results: list[RunResult]) -> list[RunResult]:
    """One result per (policy, cell): the mean of its runs (a lone run as it is). The mean
    carries `runs` and `seeds` in its extras."""
    out = []
    for runs in _groups(results).values():
        if len(runs) == 1:
            out.append(runs[0])
            continue
        mean = {}
        for f in fields(RunResult):
            values = [getattr(r, f.name) for r in runs]
            if isinstance(values[0], float):
                mean[f.name] = fmean(values)
            elif isinstance(values[0], int) and f.name != "concurrency":
                mean[f.name] = round(fmean(values))
        seeds = [r.extra.get("seed") for r in runs]
        out.append(
            replace(runs[0], **mean, agent_latency_s={}, extra={"runs": len(runs), "seeds": seeds})
        )
    return out


def _constant(results: list[RunResult]) -> dict[str, str]:
    """The cell coordinates every row shares: a column each would repeat, said once in the
    title instead (the demo's table then fits 80 columns)."""
    out = {}
    if len({r.concurrency for r in results}) == 1:
        out["conc"] = f"{results[0].concurrency} programs"
    if len({r.cpu_ratio for r in results}) == 1:
        out["CPU\nratio"] = f"CPU ratio {results[0].cpu_ratio:g}"
    return out


def _table(title: str) -> Table:
    """A report table: a rule under the header, two spaces between columns, no edges, and
    as wide as its title (up to 80 columns) so that the title is one line."""
    return Table(
        title=title,
        min_width=min(len(title), NARROW_WIDTH),
        header_style="bold",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        padding=(0, 0, 0, 1),  # with the box's blank divider, two spaces between columns
    )


def results_table(results: list[RunResult], title: str = "results", wide: bool = False) -> Table:
    """One row per policy and cell (the mean of repeated runs), grouped by CPU ratio then
    concurrency. The default columns fit an 80-column terminal; `wide` shows every metric."""
    rows = _sorted(aggregate(results))
    columns = [c for c in COLUMNS if wide or c[0] in NARROW]
    shared = _constant(rows) if rows else {}
    notes = list(shared.values())
    runs = max((r.extra.get("runs", 1) for r in rows), default=1)
    if runs > 1:
        notes.append(f"mean of {runs} runs")
    if notes:
        title = f"{title} ({', '.join(notes)})"
    table = _table(title)
    longest = max((len(r.policy) for r in rows), default=6)
    table.add_column("policy", no_wrap=True, min_width=longest)  # never cut a policy name
    cell_headers = [h for h in CELL_HEADERS if h not in shared]
    for header in cell_headers + [c[1] for c in columns]:
        table.add_column(header, justify="right", no_wrap=True)
    for r in rows:
        cell = {"conc": str(r.concurrency), "CPU\nratio": f"{r.cpu_ratio:g}"}
        values = [fmt.format(getattr(r, key)) for key, _, fmt in columns]
        table.add_row(r.policy, *(cell[h] for h in cell_headers), *values)
    return table


def legend(results: list[RunResult]) -> str:
    """The policies of `results` and the table's columns in words."""
    names = sorted({r.policy for r in results}, key=_policy_order)
    width = max((len(p) for p in names), default=0)
    lines = ["policies:"]
    for p in names:
        text = f"{p:<{width}}  {POLICY_WORDS.get(p, '')}".rstrip()
        lines += _wrap(text, "  ", " " * (width + 4))
    lines += _wrap(COLUMN_WORDS, "", "  ")
    return "\n".join(lines)


def _wrap(text: str, first: str, then: str) -> list[str]:
    return textwrap.wrap(
        text, NARROW_WIDTH, initial_indent=first, subsequent_indent=then, break_on_hyphens=False
    )


def print_results(console: Console, results: list[RunResult], title: str, wide: bool) -> None:
    """The results table, MORI's ratios and the legend. The default table is at most 80
    columns wide whatever the terminal (or pipe); `wide` tables are never cut to the
    terminal (long lines wrap instead)."""
    width = console.width
    console.width = max(width, 200) if wide else min(width, NARROW_WIDTH)
    try:
        console.print(results_table(results, title, wide))
        table = ratio_table(results)
        if table is not None:
            console.print(table)
        console.print(legend(results), highlight=False, markup=False)
    finally:
        console.width = width


def ratios(results: list[RunResult], reference: str = REFERENCE) -> list[dict]:
    """`reference`'s output tok/s, mean TTFT and TTFT p99 relative to each other policy, per
    cell and run: runs are paired by seed (the same workload), one row per pair."""
    by_run: dict[tuple, dict[str, RunResult]] = {}
    for r in results:
        by_run.setdefault((*_cell(r), r.extra.get("seed")), {})[r.policy] = r
    out = []
    for (conc, ratio, seed), run in sorted(by_run.items(), key=_run_order):
        ref = run.get(reference)
        if ref is None:
            continue
        for name, other in sorted(run.items()):
            if name == reference:
                continue
            row = {"concurrency": conc, "cpu_ratio": ratio, "versus": name, "seed": seed}
            for key, metric, _, _ in RATIOS:
                row[key] = _div(getattr(ref, metric), getattr(other, metric))
            out.append(row)
    return out


def _run_order(item: tuple[tuple, dict]) -> tuple:
    (conc, ratio, seed), _ = item
    return ratio, conc, -1 if seed is None else seed


def _div(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def ratio_summary(rows: list[dict]) -> list[dict]:
    """Per cell and policy, each ratio's mean, min and max over the runs (None where a run
    had no ratio)."""
    by_pair: dict[tuple, list[dict]] = {}
    for row in rows:
        by_pair.setdefault((row["concurrency"], row["cpu_ratio"], row["versus"]), []).append(row)
    out = []
    for (conc, ratio, versus), runs in by_pair.items():
        summary: dict = {"concurrency": conc, "cpu_ratio": ratio, "versus": versus}
        summary["runs"] = len(runs)
        for key, _, _, _ in RATIOS:
            values = [r[key] for r in runs if r[key] is not None]
            summary[key] = (
                {"mean": fmean(values), "min": min(values), "max": max(values)} if values else None
            )
        out.append(summary)
    return out


def _ratio_text(stats: dict | None) -> str:
    if stats is None:
        return "-"
    low, high = f"{stats['min']:.2f}", f"{stats['max']:.2f}"
    return f"{stats['mean']:.2f}x" + ("" if low == high else f" ({low}-{high})")


def ratio_table(results: list[RunResult], reference: str = REFERENCE) -> Table | None:
    """MORI / each policy per cell: the mean over runs, and its range when runs differ."""
    rows = ratio_summary(ratios(results, reference))
    if not rows:
        return None
    runs = max(r["runs"] for r in rows)
    title = f"{reference} relative to each policy ({reference} / other"
    title += f"; mean (min-max) of {runs} runs)" if runs > 1 else ")"
    table = _table(title)
    shared = _constant(results)
    cell_headers = [h for h in CELL_HEADERS if h not in shared]
    for header in [*cell_headers, "versus"] + [f"{h} ratio\n{way}" for _, _, h, way in RATIOS]:
        table.add_column(header, justify="right")
    for row in rows:
        cell = {"conc": str(row["concurrency"]), "CPU\nratio": f"{row['cpu_ratio']:g}"}
        table.add_row(
            *(cell[h] for h in cell_headers),
            row["versus"],
            *(_ratio_text(row[key]) for key, _, _, _ in RATIOS),
        )
    return table


def write_json(results: list[RunResult], path: Path, meta: dict | None = None) -> None:
    """{"results": [{policy, concurrency, cpu_ratio, metrics..., extras...}] (every run),
    "ratios": [per run pair], "ratio_summary": [mean/min/max per cell and policy], "meta"}"""
    rows = ratios(results)
    doc: dict = {
        "results": [r.to_dict() for r in _sorted(results)],
        "ratios": rows,
        "ratio_summary": ratio_summary(rows),
    }
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
    """Throughput, mean TTFT and TTFT p99 versus concurrency: `<stem>-throughput.png`,
    `<stem>-ttft.png`, `<stem>-ttft-p99.png`. Large enough to read in a README (about
    1000 px a panel); bars carry their values, and the range of repeated runs as whiskers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cpu_ratios = sorted({r.cpu_ratio for r in results})
    policies = sorted({r.policy for r in results}, key=_policy_order)
    groups = _groups(results)
    written = []
    for metric, label, suffix in PLOTS:
        with plt.rc_context({"font.size": 12}):
            fig, axes = plt.subplots(
                1, len(cpu_ratios), figsize=(7 * len(cpu_ratios), 5), squeeze=False, sharey=True
            )
            for ax, ratio in zip(axes[0], cpu_ratios, strict=True):
                panel = {k: v for k, v in groups.items() if k[2] == ratio}
                draw = _bars if len({k[1] for k in panel}) == 1 else _lines
                draw(ax, panel, policies, metric)
                ax.set_title(f"CPU ratio {ratio:g} (host KV = {ratio:g}x GPU KV)")
                ax.grid(alpha=0.3, axis="y")
            axes[0][0].set_ylabel(label)
            if title:
                fig.suptitle(title)
            fig.tight_layout()
            out = path.with_name(f"{path.stem}-{suffix}.png")
            fig.savefig(out, dpi=150)
            plt.close(fig)
        written.append(out)
    return written + [_plot_kinds(results, path, title, plt)]


def _plot_kinds(results: list[RunResult], path: Path, title: str, plt) -> Path:
    """`<stem>-waits.png`: per policy, the TTFT p99 of steps of programs in flight beside
    the p99 of what starts waited (from their first attempt), per CPU ratio and
    concurrency: who waits under overload, a program mid-task or one not yet begun."""
    agg = aggregate(results)
    cells = sorted({_cell(r) for r in agg}, key=lambda c: (c[1], c[0]))
    policies = sorted({r.policy for r in agg}, key=_policy_order)
    by = {(r.policy, *_cell(r)): r for r in agg}
    with plt.rc_context({"font.size": 12}):
        fig, axes = plt.subplots(
            1, len(cells), figsize=(7 * len(cells), 5), squeeze=False, sharey=True
        )
        width = 0.8 / len(KINDS)
        for ax, cell in zip(axes[0], cells, strict=True):
            names = [p for p in policies if (p, *cell) in by]
            for k, (metric, label) in enumerate(KINDS):
                values = [getattr(by[(p, *cell)], metric) for p in names]
                xs = [i + (k - (len(KINDS) - 1) / 2) * width for i in range(len(names))]
                bars = ax.bar(xs, values, width, label=label, color=f"C{k}")
                ax.bar_label(bars, [FORMATS[metric].format(v) for v in values], padding=2)
            ax.set_xticks(range(len(names)), names)
            ax.set_title(f"{cell[0]} programs, CPU ratio {cell[1]:g}")
            ax.grid(alpha=0.3, axis="y")
            ax.margins(y=0.12)
        axes[0][0].set_ylabel("seconds, lower is better")
        axes[0][0].legend()
        if title:
            fig.suptitle(textwrap.fill(title, 28 * len(cells) + 20), fontsize=11)
        fig.tight_layout()
        out = path.with_name(f"{path.stem}-waits.png")
        fig.savefig(out, dpi=150)
        plt.close(fig)
    return out


def _spread(runs: list[RunResult], metric: str) -> tuple[float, float, float]:
    """Mean, and how far below and above it the runs' min and max lie."""
    values = [getattr(r, metric) for r in runs]
    mean = fmean(values)
    return mean, mean - min(values), max(values) - mean


def _lines(ax, panel: dict, policies: list[str], metric: str) -> None:
    """Metric versus concurrency, one line per policy (MORI Figs. 7-9)."""
    for policy in policies:
        pts = sorted((k[1], *_spread(runs, metric)) for k, runs in panel.items() if k[0] == policy)
        if pts:
            xs, ys, lo, hi = zip(*pts, strict=True)
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=policy)
    ax.set_xlabel("concurrent programs")
    ax.legend()


def _bars(ax, panel: dict, policies: list[str], metric: str) -> None:
    """One concurrency only (a demo, a single live replay): a bar per policy, its value above
    it rounded as the table rounds it; repeated runs draw their range as a whisker."""
    by_policy = {k[0]: _spread(runs, metric) for k, runs in panel.items()}
    names = [p for p in policies if p in by_policy]
    means, lo, hi = zip(*(by_policy[p] for p in names), strict=True)
    whiskers = [lo, hi] if any(lo) or any(hi) else None
    ax.bar(names, means, yerr=whiskers, capsize=6, color=[f"C{i}" for i in range(len(names))])
    for x, (mean, top) in enumerate(zip(means, hi, strict=True)):
        ax.annotate(
            FORMATS[metric].format(mean),
            (x, mean + top),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontweight="bold",
        )
    ax.margins(y=0.12)  # room for the values above the tallest bar
    (conc,) = {k[1] for k in panel}
    runs = max(len(r) for r in panel.values())
    spread = f"; mean of {runs} runs, whiskers: range" if runs > 1 else ""
    ax.set_xlabel(f"policy ({conc} concurrent programs{spread})")


def write_reports(
    results: list[RunResult], json_path: str | Path, title: str = "", meta: dict | None = None
) -> list[Path]:
    """JSON at `json_path`, a CSV next to it, and the four PNG plots; returns the paths."""
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    csv_path = json_path.with_suffix(".csv")
    write_json(results, json_path, meta)
    write_csv(results, csv_path)
    return [json_path, csv_path, *plot(results, json_path, title)]
