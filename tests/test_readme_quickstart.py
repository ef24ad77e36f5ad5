"""The README's quick start for the live stack without a GPU runs as written: two emulated
replicas, the router, an OpenAI SDK call through it and the admin view of the program, then
everything stops. Only its ports change (to free ones) and `mori` / `python` are this
checkout's CLI and interpreter."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.servers import free_port, stop

REPO = Path(__file__).resolve().parents[1]
SECTION = "### The live stack without a GPU"


def quick_start() -> str:
    """The first bash block under the README's live-stack section."""
    section = (REPO / "README.md").read_text().split(SECTION, 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S)[1]


def _on_free_ports(script: str) -> str:
    for port in ("30001", "30002", "8000"):
        script = re.sub(rf"\b{port}\b", str(free_port()), script)
    return script


def _this_checkout(bin_dir: Path) -> dict[str, str]:
    """PATH with `mori` and `python` running this checkout's code with this interpreter."""
    for name, command in (("mori", f'"{sys.executable}" -m router.cli'), ("python", "")):
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\nexec {command or sys.executable} "$@"\n')
        path.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def _outliving(group: int, within_s: float) -> bool:
    """Whether a process of `group` is still alive `within_s` seconds from now."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.skipif(shutil.which("curl") is None, reason="the quick start calls curl")
def test_the_readmes_live_stack_quick_start_runs(tmp_path):
    script = _on_free_ports(quick_start())
    log = tmp_path / "quick-start.log"  # a file, not a pipe: a server left running holds a pipe
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["bash", "-c", script],
            cwd=REPO,
            env=_this_checkout(tmp_path),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # every server it starts is in its group
        )
    try:
        proc.wait(timeout=120)
        left = _outliving(proc.pid, within_s=15)  # its `kill %1 %2 %3` stops every server
    finally:
        stop(proc)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text()
    assert proc.returncode == 0, out
    assert not left, "a server outlived the quick start's kill"
    assert "CompletionUsage(completion_tokens=" in out, out  # the SDK's answer
    assert '"program_id":"task-1","tier":"gpu"' in out, out  # /v1/programs lists it
    assert "Traceback" not in out and "WARNING" not in out, out
