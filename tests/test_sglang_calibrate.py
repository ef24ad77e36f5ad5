"""`mori calibrate` against the real engine: SGLang on CPU with the MORI patch (the tests'
random-weight model). It times the whole schedule (prefills, device hits, host hits after
an idle hint, decode batches), fits, and writes a preset file that reports its residuals
and what the engine said it cached; `mori sim` runs on that preset."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

from bench.real_engine_ab import speed_probe
from engine_patches.forward_log import ENV as FORWARD_LOG
from router.calibrate.forwards import read_forwards
from router.presets import read_preset
from tests.servers import mori
from tests.sglang.server import REAL_ENGINE, installed_version, tiny_engine

pytestmark = REAL_ENGINE

FLAGS = ["--max-total-tokens", "2048", "--hicache-ratio", "2"]


def test_calibrate_times_the_real_engine_and_writes_a_preset(tmp_path: Path) -> None:
    out, log = tmp_path / "cpu.json", tmp_path / "forwards"
    with tiny_engine(tmp_path, FLAGS, env={FORWARD_LOG: str(log)}) as server:
        done = subprocess.run(
            mori(
                "calibrate", "--endpoint", server.url, "--out", str(out), "--reps", "1",
                "--decode-tokens", "8", "--forward-log", str(log),
            ),
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:] + server.log_tail()
        forwards = read_forwards(log)
        # the bench's probe before each predicted run: the engine's speed against the preset
        # just fitted to it, then its cache emptied (SGLang's /flush_cache)
        speed = speed_probe(server.url, out)
    assert 0.5 < speed.slowdown < 2 and speed.seconds > 0, speed
    doc = json.loads(out.read_text())
    assert doc["engine"]["server_info"]["version"] == installed_version()
    assert doc["preset"]["chunk_tokens"] == doc["engine"]["server_info"]["chunked_prefill_size"]
    residuals = doc["fit"]["residuals"]
    assert {"all_rms", "prefill_rms", "device-hit_rms", "host-hit_rms", "decode_rms"} <= set(
        residuals
    )
    assert all(math.isfinite(v) for v in residuals.values())
    assert set(doc["fit"]["spread"]) == set(doc["fit"]["fitted"])  # the held overhead: none
    assert doc["fit"]["prices"]["step_overhead_s"] == read_preset(out).step_overhead_s
    for row in doc["fit"]["probes"]:  # the engine's own report: each hit probe hit its tier
        probe, call = row["probe"], row["timings"][1]
        if probe["kind"] == "device-hit":
            assert call["cached_device"] >= probe["setup"][0]["tokens"] - 1, row
        elif probe["kind"] == "host-hit":
            assert call["cached_host"] > 0, row
    # the engine logged every forward the timed calls needed: a decode iteration per token
    # after the first, each prompt's uncached tokens in a prefill (setup calls add more)
    calls = [t for row in doc["fit"]["probes"] for t in row["timings"]]
    assert sum(f.reqs for f in forwards if f.decode) >= sum(t["output_tokens"] - 1 for t in calls)
    uncached = sum(t["prompt_tokens"] - t["cached_device"] - t["cached_host"] for t in calls)
    assert sum(n for f in forwards for n, _ in f.lens) >= uncached
    assert len(doc["fit"]["forwards"]) == len(forwards)
    assert {"forward-decode_rms", "forward-prefill_rms"} <= set(residuals)
    preset = read_preset(out)
    assert preset.gpu_kv_tokens == 2048 and preset.flops_s > 0
    sim = subprocess.run(
        mori(
            "sim", "configs/sim/h100-8b.yaml", "--preset-file", str(out), "--trace",
            "traces/generated-claude-code-32k.jsonl", "--token-scale", "0.05", "--policies",
            "smg", "--concurrency", "4", "--cpu-ratio", "2", "--duration", "60",
            "--gpu-tokens", "2048", "--jobs", "1",
        ),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert sim.returncode == 0, sim.stdout[-2000:] + sim.stderr[-2000:]
