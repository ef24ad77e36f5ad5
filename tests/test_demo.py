"""`mori demo`: the embedded stack (2 emulated replicas + router + replay) runs and cleans up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
import pytest
from rich.console import Console

from router.cli import build_parser
from router.demo import _twins, pick_trace
from router.replay.records import RunResult
from router.replay.report import JSON_FIELDS, POLICY_WORDS
from router.replay.trace import load_trace
from tests.servers import mori


def _no_listener(url: str) -> bool:
    try:
        httpx.get(url, timeout=1.0)
    except httpx.TransportError:
        return True
    return False


POLICIES = ["mori", "smg", "continuum"]


def test_short_demo_compares_policies_interleaved_and_stops_its_servers(tmp_path):
    argv = mori(
        "demo", "--duration", "3", "--concurrency", "6", "--policies", ",".join(POLICIES),
        "--reps", "2", "--out", str(tmp_path),
    )  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "demo.json").read_text())
    runs = [(row["policy"], row["seed"]) for row in report["results"]]
    assert sorted(runs) == sorted((p, seed) for p in POLICIES for seed in (0, 1))
    for row in report["results"]:
        assert set(JSON_FIELDS) <= set(row) and row["concurrency"] == 6
        assert row["output_tok_s"] > 0 and row["steps_s"] > 0 and row["failed_steps"] == 0
        assert 0 < row["hit_device"] + row["hit_host"] <= 1
    summary = {r["versus"]: r for r in report["ratio_summary"]}
    assert set(summary) == {"smg", "continuum"}
    assert all(r["runs"] == 2 and r["throughput_ratio"]["mean"] > 0 for r in summary.values())
    # interleaved: A B C A B C
    started = [ln.split(": router up")[0].split()[-1] for ln in done.stdout.splitlines()
               if ": router up" in ln]  # fmt: skip
    assert started == POLICIES * 2, done.stdout
    # what a newcomer reads: the clock, the policies in words, units, all within 80 columns
    assert max(len(line) for line in done.stdout.splitlines()) <= 80, done.stdout
    assert "x5 faster than real time" in done.stdout and "trace clock" in done.stdout
    assert all(POLICY_WORDS[p] in done.stdout for p in POLICIES), done.stdout
    assert "TTFT s" in done.stdout and "GPU KV" in done.stdout and "churn" in done.stdout
    text = " ".join(done.stdout.split())  # titles wrap at 80 columns
    assert "mean of 2 runs" in text and "mori relative to each policy" in text
    # each run beside the simulator on its cell, in the table and the JSON
    assert "against the simulator on its cell" in text, done.stdout
    twins = {(t["policy"], t["seed"]): t for t in report["meta"]["simulated"]}
    assert set(twins) == set(runs)
    for row in report["results"]:
        twin = twins[(row["policy"], row["seed"])]
        assert twin["output_tok_s"] > 0
        assert twin["live_over_sim"] == pytest.approx(row["output_tok_s"] / twin["output_tok_s"])
    for name in ("demo.csv", "demo-throughput.png", "demo-ttft.png", "demo-ttft-p99.png"):
        assert (tmp_path / name).is_file(), name
    for policy in POLICIES:
        for seed in (0, 1):
            logs = tmp_path / "logs" / policy / f"seed{seed}"
            router_log = (logs / "router.log").read_text()
            metrics = (logs / "router-metrics.txt").read_text()  # the router's own costs
            assert "mori_gate_wait_seconds_count" in metrics and "mori_tick_seconds" in metrics
            for name in ("replica0", "replica1"):
                first = (logs / f"{name}.log").read_text().splitlines()[0]
                url = first.split(" on ")[1].split()[0]
                assert _no_listener(url + "/health"), (
                    f"{name} still up after the demo: {router_log}"
                )


def test_demo_defaults_compare_mori_with_both_baselines():
    args = build_parser("demo").parse_args(["demo"])
    assert args.policies == "mori,ta+o,smg" and args.reps == 1 and args.seed == 0


def test_demo_rejects_unknown_policy(tmp_path):
    done = subprocess.run(
        mori("demo", "--policy", "nope", "--out", str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2 and "unknown policy 'nope'" in done.stdout
    done = subprocess.run(
        mori("demo", "--reps", "0", "--out", str(tmp_path)), capture_output=True, text=True
    )
    assert done.returncode == 2 and "--reps must be at least 1" in done.stdout


def _keep_running(tmp_path) -> tuple[subprocess.Popen, str]:
    """`mori demo --keep-running` of one policy, once its stack is up: (process, router)."""
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
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        # as from a terminal: a suite started in the background by a non-interactive shell
        # runs with SIGINT ignored, which its children would inherit (and keep, rightly)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "stays up" in line or proc.poll() is not None:
            break
    router = next((ln.split()[1] for ln in lines if ln.startswith("router: ")), None)
    if router is None:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("".join(lines))
    health = router.removesuffix("/v1") + "/health"
    assert httpx.get(health).status_code == 200
    return proc, health


def test_keep_running_stack_stops_on_interrupt(tmp_path):
    proc, health = _keep_running(tmp_path)
    try:
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 130
        assert _no_listener(health)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_killed_demo_takes_its_stack_with_it(tmp_path):
    """SIGKILL reaches no handler: the children go because the kernel tells them their
    parent died (they run in sessions of their own, so nothing else would reach them)."""
    proc, health = _keep_running(tmp_path)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while not _no_listener(health) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _no_listener(health)


def test_a_run_far_under_its_simulated_twin_is_called_out():
    """A run that made under 90 % of the tokens its cell makes in the simulator is named as
    the machine's doing (the stack's latency at a compressed clock), not left to read as
    the policy's; one at its twin is not."""
    args = build_parser("demo").parse_args(["demo", "--duration", "3", "--concurrency", "6"])
    trace, token_scale = pick_trace(None, None)
    corpus = load_trace(trace)

    def run(tok_s: float) -> RunResult:
        return RunResult(
            "smg", 6, 2.0, tok_s, 1.0, 1, 1, 1, 1, 0.5, 0.5, 0, 0.5, 0, extra={"seed": 0}
        )

    console = Console(record=True, width=80)
    (twin,) = _twins([run(1.0)], args, corpus, token_scale, console)
    assert twin["output_tok_s"] > 10 and twin["live_over_sim"] < 0.9
    assert "weighs on the results" in " ".join(console.export_text().split())
    console = Console(record=True, width=80)
    _twins([run(twin["output_tok_s"])], args, corpus, token_scale, console)
    assert "weighs on the results" not in " ".join(console.export_text().split())
