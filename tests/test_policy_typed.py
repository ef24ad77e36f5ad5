"""The policy core's annotations are true: mypy finds no error in `router/policy`.

Why a test: the core is pure, typed Python, and its annotations had drifted from what runs
(the prices declared `int` where a victim pool passes numpy arrays of contexts, a turn's
odds declared `float` where `None` comes back); a reader, or a compiler of the core
(bench/results/2026-12-02-policy-compiled.md: mypyc checks the annotations at run time),
trusts them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_finds_no_error_in_the_policy_core() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--no-incremental",
            "--cache-dir",
            os.devnull,
            "router/policy",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
