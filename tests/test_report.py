"""Reports: JSON shape, CSV rows, PNG files, MORI's ratios, the rich tables."""

from __future__ import annotations

import csv
import json

from rich.console import Console

from router.replay.records import RunResult
from router.replay.report import (
    print_results,
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


def result(policy, conc, ratio, tput, ttft=2.0):
    return RunResult(
        policy, conc, ratio, tput, tput / 300, ttft, ttft, 3 * ttft, 4 * ttft,
        0.9, 0.5, 0.3, 0.2, 0.0, extra={"preset": "h100-8b"},
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
    assert names == ["run-throughput.png", "run-ttft.png", "run.csv", "run.json"]
    doc = json.loads((tmp_path / "out" / "run.json").read_text())
    assert len(doc["results"]) == len(RESULTS)
    assert all(set(row) >= KEYS for row in doc["results"])
    assert doc["results"][0]["preset"] == "h100-8b"  # extras flattened into the row
    rows = list(csv.DictReader((tmp_path / "out" / "run.csv").open()))
    assert len(rows) == len(RESULTS) and set(rows[0]) >= KEYS
    for png in ("run-throughput.png", "run-ttft.png"):
        data = (tmp_path / "out" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000


def test_ratios_compare_mori_to_every_other_policy_per_cell():
    rows = ratios(RESULTS)
    assert len(rows) == 2 * 2 * 2  # cpu ratios x concurrencies x other policies
    row = next(r for r in rows if r["versus"] == "ta+o" and r["concurrency"] == 80)
    assert row["throughput_ratio"] == 1.5
    assert row["ttft_ratio"] == 0.5
    assert ratios([r for r in RESULTS if r.policy != "mori"]) == []


def test_tables_render():
    console = Console(record=True, width=200)
    console.print(results_table(RESULTS, "cells", wide=True))
    console.print(ratio_table(RESULTS))
    text = console.export_text()
    assert "ta+o" in text and "1.50x" in text and "out tok/s" in text and "TTFT p50" in text


def test_default_tables_fit_80_columns_untruncated():
    """A fresh terminal is 80 columns: every cell is shown whole (no `49…`)."""
    console = Console(record=True, width=80)
    print_results(console, RESULTS + [result("mori+predict", 80, 2.0, 1234.5)], "cells", False)
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    assert "1234.5" in text and "mori+predict" in text and "1.50x" in text
    assert "TTFT p50" not in text  # `--wide` adds the rest


def test_wide_tables_are_not_cut_at_80_columns():
    console = Console(record=True, width=80)
    print_results(console, RESULTS, "cells", wide=True)
    text = console.export_text()
    assert "…" not in text and "TTFT p50" in text and "churn" in text
