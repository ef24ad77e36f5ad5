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


def test_policy_matrix_counts_no_cell_with_failed_steps_as_a_win_and_plots_the_frontier(
    tmp_path: Path,
) -> None:
    """A swept knob over one short overloaded cell: the verdict of a variant that failed
    steps is no win, whatever its throughput, and the frontier plot is written."""
    from bench.policy_matrix import main, verdicts

    row = {"output_tok_s": 100.0, "failed_steps": 0, "ttft_p99_s": 1.0}
    row |= {"ttft_p99_inflight_s": 1.0}
    cell = {"mori": {**row, "failed_steps": 3, "output_tok_s": 150.0}, "smg": row}
    assert verdicts(cell)["tput_ok"] is False
    assert verdicts({**cell, "mori": {**row, "output_tok_s": 150.0}})["tput_ok"] is True
    png = tmp_path / "frontier.png"
    argv = ["--corpora", "generated-32k", "--programs", "20", "--cpu-ratio", "1", "--seeds", "0"]
    argv += ["--policies", "mori", "smg", "--duration", "120", "--jobs", "1"]
    argv += ["--sweep", "max_step_wait_s=60,120", "--frontier", str(png)]
    assert main(argv) == 0
    assert png.stat().st_size > 10_000


def test_harness_identity_counts_splits_merges_and_parents() -> None:
    """The confusion counts the harness-identity figure reports (bench/harness_identity.py)."""
    from bench.harness_identity import confusion

    routed = {
        "a": {"s1/fa"},  # a root, seen as one program
        "a.sub": {"s1/fb"},  # its subagent, filed under it
        "a.sub2": {"s1/fc"},  # another, filed under nobody
        "b": {"s2/fa", "s2/fz"},  # a root split in two
        "c": {"fp-1"},  # two roots merged into one program,
        "d": {"fp-1"},  # ... and each filed as a subagent of `a`
        "d.sub": {"s4/fd"},  # a subagent filed under the wrong parent
    }
    parents = {"a.sub": "a", "a.sub2": "a", "d.sub": "d"}
    under = {"s1/fb": "s1/fa", "fp-1": "s1/fa", "s4/fd": "s1/fa"}
    counts = confusion(routed, parents, under)
    assert dict(counts) == {
        "instances": 7,
        "router_programs": 7,
        "merged": 1,
        "split": 1,
        "roots": 3,
        "root_as_sub": 2,
        "subagents": 3,
        "parent_ok": 1,
        "parent_lost": 1,
        "wrong": 1,
    }


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


def test_policy_matrix_refuses_a_bad_knob_before_it_simulates() -> None:
    """A knob value of the wrong kind or range is a usage error naming it (exit 2), not a
    worker's traceback after the pool started (or a simulator clock that never moves)."""
    cell = ["--duration", "60", "--programs", "10", "--seeds", "0", "--policies", "mori"]
    cell += ["--corpora", "generated", "--cpu-ratio", "1", "--jobs", "1"]
    for extra, said in (
        (["--set", "window=2.5"], "window=2.5: Input should be a valid integer"),
        (["--sweep", "tick_s=0,5"], "tick_s must be > 0 in the simulator, got 0.0"),
    ):
        argv = [sys.executable, "bench/policy_matrix.py", *cell, *extra]
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr


def test_forward_log_says_in_one_line_what_is_not_a_forward_log(tmp_path: Path) -> None:
    """A path with no forward log, or a file that is not one, is a usage error (exit 2)
    naming it, not a traceback."""
    preset = ROOT / "bench" / "results" / "2026-11-29-cpu-512x8.json"
    garbage = tmp_path / "x.forwards"
    garbage.write_text("not json\n")
    for path, said in ((tmp_path / "none.forwards", "no forward log"), (garbage, "Expecting")):
        argv = [sys.executable, "bench/forward_log.py", str(path), "--preset-file", str(preset)]
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and said in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_emulator_hop_measures_each_step_beyond_the_engines_time() -> None:
    """Two programs of two steps on a real `mori emulate`: four steps measured, and the
    wall time a step took beyond its engine's is positive (the answer cannot come back
    before the engine is done)."""
    done = subprocess.run(
        [sys.executable, "bench/emulator_hop.py", "--programs", "2", "--steps", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    row = next(line for line in done.stdout.splitlines() if " n " in line).split()
    assert row[row.index("n") + 1] == "4"
    assert float(row[row.index("mean") + 1]) > 0
