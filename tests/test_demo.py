"""`mori demo`: the embedded stack (2 emulated replicas + router + replay) runs and cleans up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx

from router.replay.report import JSON_FIELDS
from tests.servers import mori


def _no_listener(url: str) -> bool:
    try:
        httpx.get(url, timeout=1.0)
    except httpx.TransportError:
        return True
    return False


def test_short_demo_compares_policies_and_stops_its_servers(tmp_path):
    argv = mori("demo", "--duration", "6", "--concurrency", "6", "--out", str(tmp_path))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "demo.json").read_text())
    rows = {row["policy"]: row for row in report["results"]}
    assert set(rows) == {"mori", "ta+o", "smg"}  # the default comparison
    for row in rows.values():
        assert set(JSON_FIELDS) <= set(row) and row["concurrency"] == 6
        assert row["output_tok_s"] > 0 and row["steps_s"] > 0 and row["failed_steps"] == 0
        assert 0 < row["hit_device"] + row["hit_host"] <= 1
    assert sorted(r["versus"] for r in report["ratios"]) == ["smg", "ta+o"]
    assert "mori relative to each policy" in done.stdout
    assert (tmp_path / "demo.csv").is_file() and (tmp_path / "demo-throughput.png").is_file()
    for policy in rows:
        logs = tmp_path / "logs" / policy
        router_log = (logs / "router.log").read_text()
        for name in ("replica0", "replica1"):
            first = (logs / f"{name}.log").read_text().splitlines()[0]
            url = first.split(" on ")[1].split()[0]
            assert _no_listener(url + "/health"), f"{name} still up after the demo: {router_log}"


def test_demo_rejects_unknown_policy(tmp_path):
    done = subprocess.run(
        mori("demo", "--policy", "nope", "--out", str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2 and "unknown policy 'nope'" in done.stdout


def test_keep_running_stack_stops_on_interrupt(tmp_path):
    argv = mori(
        "demo",
        "--policy",
        "mori",
        "--duration",
        "3",
        "--concurrency",
        "2",
        "--keep-running",
        "--out",
        str(tmp_path),
    )
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        lines = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "stays up" in line or proc.poll() is not None:
                break
        router = next(ln.split()[1] for ln in lines if ln.startswith("router: "))
        assert httpx.get(router.removesuffix("/v1") + "/health").status_code == 200
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 130
        assert _no_listener(router.removesuffix("/v1") + "/health")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
