"""Every benchmark script starts: `python bench/X.py --help` exits 0.

A script's own folder comes first on its import path, so a bench module named like a
project package (bench/kernels.py vs the `kernels` package) shadows it for every script
that imports the package, directly or through the simulator; the scripts put the project
first. Run as a user runs them, one process each, so an import error anywhere fails here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(
    p.name for p in (ROOT / "bench").glob("*.py") if '__name__ == "__main__"' in p.read_text()
)


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_starts(script: str) -> None:
    done = subprocess.run(
        [sys.executable, f"bench/{script}", "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout


def test_real_engine_ab_runs_a_policy_variant_with_its_settings() -> None:
    from bench.real_engine_ab import router_argv, split_policies

    labels = split_policies("mori,mori[band_waiver_steps=0;aging_s=60], smg")
    assert labels == ["mori", "mori[band_waiver_steps=0;aging_s=60]", "smg"]
    args = type("Args", (), {"tick_s": 1.0})()
    argv = router_argv(args, labels[1], "http://127.0.0.1:1", 2)
    assert argv[argv.index("--policy") + 1] == "mori"
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    assert sets == ["tick_s=1.0", "band_waiver_steps=0", "aging_s=60"]


def test_real_engine_ab_refuses_a_malformed_variant_before_starting_anything() -> None:
    done = subprocess.run(
        [sys.executable, "bench/real_engine_ab.py", "--policies", "mori[aging_s=60"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "bad policy 'mori[aging_s=60'" in done.stderr


def test_policy_matrix_compare_passes_on_the_same_figures_and_names_a_moved_one(
    tmp_path: Path,
) -> None:
    """The parity check of a change meant to keep behaviour: the same command on the same
    code reproduces every figure; one figure changed in the earlier file is reported."""
    cell = ["--duration", "60", "--programs", "10", "--seeds", "0", "--policies", "mori", "smg"]
    cell += ["--corpora", "generated", "--cpu-ratio", "1", "--jobs", "1"]

    def matrix(*extra: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "bench/policy_matrix.py", *cell, *extra]
        return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)

    before = tmp_path / "before.json"
    assert matrix("--json", str(before)).returncode == 0
    same = matrix("--compare", str(before))
    assert same.returncode == 0 and "2 runs, 0 differ" in same.stdout
    rows = json.loads(before.read_text())
    rows[0]["output_tok_s"] += 0.5
    before.write_text(json.dumps(rows))
    moved = matrix("--compare", str(before))
    assert moved.returncode == 1 and "output_tok_s" in moved.stdout and "1 differ" in moved.stdout
