"""Every benchmark script starts: `python bench/X.py --help` exits 0.

A script's own folder comes first on its import path, so a bench module named like a
project package (bench/kernels.py vs the `kernels` package) shadows it for every script
that imports the package, directly or through the simulator; the scripts put the project
first. Run as a user runs them, one process each, so an import error anywhere fails here.
"""

from __future__ import annotations

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
