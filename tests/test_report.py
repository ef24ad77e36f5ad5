"""Reports: JSON shape, CSV rows, PNG files, MORI's ratios, the rich tables, the plots' values."""

from __future__ import annotations

import csv
import json
import re

from rich.console import Console

from router.policy import policy_names
from router.replay.records import RunResult
from router.replay.report import (
    POLICY_WORDS,
    _bars,
    _groups,
    print_results,
    ratio_summary,
    ratio_table,
    ratios,
    results_table,
    write_reports,
)

KEYS = {
    "policy",
    "concurrency",
    "cpu_ratio",
    "output_tok_s",
    "steps_s",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "ttft_max_s",
    "gpu_util",
    "hit_device",
    "hit_host",
    "miss",
    "churn",
}


def result(policy, conc, ratio, tput, ttft=2.0, seed=None):
    extra = {"preset": "h100-8b"} if seed is None else {"seed": seed}
    return RunResult(
        policy, conc, ratio, tput, tput / 300, ttft, ttft, 3 * ttft, 4 * ttft,
        0.9, 0.5, 0.3, 0.2, 0.0, extra=extra,
    )  # fmt: skip


RESULTS = [
    result(policy, conc, ratio, tput * conc / 20, ttft)
    for ratio in (1.0, 2.0)
    for conc in (20, 80)
    for policy, tput, ttft in (("mori", 600, 2.0), ("ta+o", 400, 4.0), ("smg", 300, 8.0))
]


def test_json_csv_and_plots_are_written(tmp_path):
    paths = write_reports(RESULTS, tmp_path / "out" / "run.json", title="t")
    names = sorted(p.name for p in paths)
    assert names == [
        "run-throughput.png", "run-ttft-p99.png", "run-ttft.png", "run-waits.png", "run.csv",
        "run.json",
    ]  # fmt: skip
    doc = json.loads((tmp_path / "out" / "run.json").read_text())
    assert len(doc["results"]) == len(RESULTS)
    assert all(set(row) >= KEYS for row in doc["results"])
    assert doc["results"][0]["preset"] == "h100-8b"  # extras flattened into the row
    rows = list(csv.DictReader((tmp_path / "out" / "run.csv").open()))
    assert len(rows) == len(RESULTS) and set(rows[0]) >= KEYS
    for png in ("run-throughput.png", "run-ttft.png", "run-ttft-p99.png"):
        data = (tmp_path / "out" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000


def test_ratios_compare_mori_to_every_other_policy_per_cell():
    rows = ratios(RESULTS)
    assert len(rows) == 2 * 2 * 2  # cpu ratios x concurrencies x other policies
    row = next(r for r in rows if r["versus"] == "ta+o" and r["concurrency"] == 80)
    assert row["throughput_ratio"] == 1.5
    assert row["ttft_ratio"] == 0.5 and row["ttft_p99_ratio"] == 0.5
    assert ratios([r for r in RESULTS if r.policy != "mori"]) == []


def test_tables_render():
    console = Console(record=True, width=200)
    console.print(results_table(RESULTS, "cells", wide=True))
    console.print(ratio_table(RESULTS))
    text = console.export_text()
    assert "ta+o" in text and "1.50x" in text and "tok/s" in text and "p50" in text


def test_default_tables_fit_80_columns_untruncated():
    """A fresh terminal is 80 columns: every cell is shown whole (no `49…`)."""
    console = Console(record=True, width=80)
    print_results(console, RESULTS + [result("mori+predict", 80, 2.0, 1234.5)], "cells", False)
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    assert "1234.5" in text and "mori+predict" in text and "1.50x" in text
    assert "p50" not in text and "churn" in text  # `--wide` adds the rest


def test_wide_tables_are_not_cut_at_80_columns():
    console = Console(record=True, width=80)
    print_results(console, RESULTS, "cells", wide=True)
    text = console.export_text()
    assert "…" not in text and "p50" in text and "abnormal" in text


# A demo with --reps 3: the policies interleaved, one seed per repetition.
REPS = [
    result(policy, 24, 2.0, tput + gain * seed, ttft, seed=seed)
    for seed in (0, 1, 2)
    for policy, tput, gain, ttft in (
        ("mori", 500, 30, 2.0), ("smg", 450, 0, 4.0), ("continuum", 480, 0, 3.0)
    )
]  # fmt: skip


def test_repeated_runs_pair_by_seed_and_summarise_mean_and_range():
    rows = ratios(REPS)
    assert len(rows) == 3 * 2 and {r["seed"] for r in rows} == {0, 1, 2}
    (smg,) = [r for r in ratio_summary(rows) if r["versus"] == "smg"]
    expected = [(500 + 30 * s) / 450 for s in (0, 1, 2)]
    assert smg["runs"] == 3
    assert smg["throughput_ratio"]["min"] == min(expected)
    assert smg["throughput_ratio"]["max"] == max(expected)
    assert abs(smg["throughput_ratio"]["mean"] - sum(expected) / 3) < 1e-12


def test_repeated_runs_print_means_and_ratio_ranges_within_80_columns():
    console = Console(record=True, width=160)  # a pipe: report.console() is 160 wide
    print_results(console, REPS, "demo", wide=False)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert "mean of 3 runs" in text and "24 programs" in text and "CPU ratio 2" in text
    assert "530.0" in text  # mori's mean over the seeds (500, 530, 560)
    assert f"{530 / 450:.2f}x ({500 / 450:.2f}-{560 / 450:.2f})" in text
    assert "conc" not in text  # one cell: its coordinates are in the title, not a column


def test_written_reports_keep_every_run_and_the_ratio_summary(tmp_path):
    write_reports(REPS, tmp_path / "demo.json")
    doc = json.loads((tmp_path / "demo.json").read_text())
    assert len(doc["results"]) == len(REPS)
    assert {(r["versus"], r["runs"]) for r in doc["ratio_summary"]} == {
        ("smg", 3),
        ("continuum", 3),
    }
    assert len(list(csv.DictReader((tmp_path / "demo.csv").open()))) == len(REPS)


def test_the_legend_names_every_policy_in_words():
    assert set(POLICY_WORDS) == set(policy_names())
    longest = max(map(len, POLICY_WORDS))
    assert all(2 + longest + 2 + len(words) <= 80 for words in POLICY_WORDS.values())
    console = Console(record=True, width=160)
    print_results(console, REPS, "demo", wide=False)
    text = console.export_text()
    for policy in ("mori", "smg", "continuum"):
        assert POLICY_WORDS[policy] in text
    assert "trace clock" in text


def _phrases_by_end(line: str) -> dict[int, str]:
    """A table line's cells (words apart by one space), by the column each ends at."""
    return {m.end(): m.group() for m in re.finditer(r"\S+(?: \S+)*", line)}


def test_ratio_headers_say_which_way_favours_mori():
    """tok/s ratios favour MORI above 1, TTFT ratios below 1: each header says so."""
    console = Console(record=True, width=80)
    console.print(ratio_table(RESULTS))
    lines = console.export_text().splitlines()
    (i,) = [n for n, line in enumerate(lines) if "out tok/s ratio" in line]
    header, ways = (_phrases_by_end(line) for line in lines[i : i + 2])  # right-justified
    under = {h: ways[end] for end, h in header.items() if h.endswith(" ratio")}
    assert under == {
        "out tok/s ratio": "↑ higher better",
        "TTFT mean ratio": "↓ lower better",
        "TTFT p99 ratio": "↓ lower better",
    }


def test_plot_values_are_rounded_as_the_table_rounds_them():
    """A bar's value reads as the table's cell: `1.80` beside `1.74`, not `1.8`; `9.4`, not
    `9.44` (the plots printed three significant digits whatever the table showed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [result("mori", 24, 2.0, 612.34, 1.8), result("smg", 24, 2.0, 480.0, 3.148)]
    console = Console(record=True, width=80)
    console.print(results_table(runs))
    lines = [line.split() for line in console.export_text().splitlines()]
    rows = {cells[0]: cells for cells in lines if cells and cells[0] in ("mori", "smg")}
    for metric in ("output_tok_s", "ttft_p99_s", "ttft_p99_inflight_s"):
        fig, ax = plt.subplots()
        _bars(ax, _groups(runs), ["mori", "smg"], metric)
        values = [text.get_text() for text in ax.texts]
        plt.close(fig)
        assert all(v in rows[p] for p, v in zip(["mori", "smg"], values, strict=True)), (
            metric,
            values,
            rows,
        )
