"""`mori calibrate` against `mori emulate`: the fit gives back the emulated preset's prices
(the self-check: the emulator runs the cost model, so this tests the probes and the fitter),
and the preset file it writes drives `mori sim` and `mori emulate`."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console
from scipy.optimize import least_squares

from router.calibrate.cli import TERMS, base_preset, recorded, usable
from router.calibrate.fit import ALWAYS_HELD, NAMES, Prices, _jacobian_workers, fit, replay
from router.calibrate.forwards import Forward, forward_speed, priced_s
from router.calibrate.probes import Timing, schedule
from router.calibrate.speed import probe_speed
from router.presets import at_speed, get_preset, read_preset, write_preset
from router.sim.model import CostModel
from tests.servers import free_port, mori, spawn

SELF_CHECK = 0.05  # every fitted price within 5 % of the emulated preset's
ZERO_SHARE = 0.01  # a share the preset sets to 0 (prefix attention, load serial) fits below this
ZERO_S = 1e-4  # ... and an overhead it sets to 0, below 0.1 ms
GOLDEN = Path(__file__).parent / "golden" / "calibrate"


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """`mori calibrate` of an emulated H100 + 8B replica (x4 time, a small schedule)."""
    out = tmp_path_factory.mktemp("calibrate") / "h100.json"
    port = free_port()
    argv = mori("emulate", "--port", str(port), "--preset", "h100-8b", "--time-scale", "4")
    with spawn(argv, port):
        done = subprocess.run(
            mori(
                "calibrate", "--endpoint", f"http://127.0.0.1:{port}", "--out", str(out),
                "--reps", "1", "--span", "8192",
            ),
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, done.stdout


def assert_recovered(fitted: Prices, true: Prices) -> None:
    for name in NAMES:
        got, want = getattr(fitted, name), getattr(true, name)
        if want:
            assert abs(got / want - 1) <= SELF_CHECK, (name, got, want)
        else:
            assert got <= (ZERO_SHARE if name in ("prefix_attention", "load_serial") else ZERO_S), (
                name,
                got,
            )


def test_self_check_recovers_the_emulated_presets_prices(calibrated) -> None:
    out, stdout = calibrated
    assert_recovered(Prices.of(read_preset(out)), Prices.of(get_preset("h100-8b")))
    assert "fitted prices" in stdout and "emulated" in stdout  # the tables were printed


def test_preset_file_says_what_was_measured_where_and_how_well(calibrated) -> None:
    out, _ = calibrated
    doc = json.loads(out.read_text())
    assert doc["date"] and doc["engine"]["server_info"]["emulated"] is True
    held = {TERMS[name][0] for name in ALWAYS_HELD}  # the per-iteration overhead
    for term, source in doc["sources"].items():
        assert source.startswith("estimate" if term in held else "measured: mori calibrate")
    kinds = {row["probe"]["kind"] for row in doc["fit"]["probes"]}
    assert kinds == {"prefill", "device-hit", "host-hit", "decode"}
    assert doc["fit"]["residuals"]["all_rms"] < 0.01  # the emulator's engine clock: exact
    assert out.with_suffix(".png").stat().st_size > 10_000
    for row in doc["fit"]["probes"]:  # the hit probes hit the tier they meant to
        tier = {"device-hit": "cached_device", "host-hit": "cached_host"}.get(row["probe"]["kind"])
        assert tier is None or row["timings"][1][tier] == row["probe"]["setup"][0]["tokens"]


def test_refit_gives_the_same_preset_from_the_record(calibrated, tmp_path: Path) -> None:
    out, _ = calibrated
    again = tmp_path / "again.json"
    done = subprocess.run(
        mori("calibrate", "--refit", str(out), "--out", str(again)),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:]
    assert_recovered(Prices.of(read_preset(again)), Prices.of(read_preset(out)))


def test_refit_says_which_probes_calls_left_after_their_blocker(tmp_path) -> None:
    """On a real engine's clock (the committed CPU calibration), calls that left once their
    blocker had answered put the HTTP path into what the fit takes for engine time: the
    fit keeps them and says which. The emulator times arrivals on its engine clock, where
    late calls are the rule (its blocker prefills in ~35 ms of wall time): not said."""
    doc = json.loads(Path("bench/results/2026-11-28-cpu-512x8.json").read_text())
    for i in (1, 4):
        timings = doc["fit"]["probes"][i]["timings"]
        for t in timings[1:]:
            t["sent"] = timings[0]["first"] + 0.001
    late = tmp_path / "late.json"
    late.write_text(json.dumps(doc))
    config = tmp_path / "config.json"  # the tests' 512x8 model (tests/sglang/tiny_model.py)
    config.write_text(json.dumps({
        "vocab_size": 512, "hidden_size": 512, "intermediate_size": 1024,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    }))  # fmt: skip
    done = subprocess.run(
        mori(
            "calibrate", "--refit", str(late), "--out", str(tmp_path / "a.json"),
            "--model-config", str(config),
        ),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:]
    said = " ".join(done.stdout.split())
    assert "2 of 23 probes (1, 4): a call left after its blocker's first token" in said
    _, probes, timings, _ = recorded(late)
    console = Console(record=True, width=200)
    usable(console, probes, timings, client_clock=False)  # the emulator's engine clock
    assert "left after" not in console.export_text()


def test_sim_and_emulate_take_the_preset_file(calibrated, tmp_path: Path) -> None:
    out, _ = calibrated
    sim = subprocess.run(
        mori(
            "sim", "configs/sim/h100-8b.yaml", "--preset-file", str(out),
            "--trace", "traces/generated-claude-code-32k.jsonl", "--policies", "smg",
            "--concurrency", "4", "--cpu-ratio", "1", "--duration", "60", "--jobs", "1",
            "--gpu-tokens", "60000",
        ),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert sim.returncode == 0, sim.stdout[-2000:] + sim.stderr[-2000:]
    assert "measured (mori calibrate" in " ".join(sim.stdout.split())
    port = free_port()
    argv = mori("emulate", "--port", str(port), "--preset-file", str(out), "--gpu-tokens", "5000")
    with spawn(argv, port):
        info = httpx.get(f"http://127.0.0.1:{port}/get_server_info").json()
    assert info["preset"] == str(out) and "measured" in info["prices"]


def test_speed_probe_measures_how_much_slower_the_replica_runs_than_its_preset(
    tmp_path: Path,
) -> None:
    """An emulated replica running the h100-8b preset 1.5 times slower: the probe against
    h100-8b says so, and against that slower preset says 1 (the emulator runs the cost
    model: what is tested is the probes' timing and the one-factor fit, whose replay
    keeps the idle gaps of calls that reached the engine late, which no speed stretches)."""
    slowdown = 1.5
    h100 = dataclasses.replace(get_preset("h100-8b"), kv_tokens=16384)
    slower = write_preset(tmp_path / "slower.json", at_speed(h100, slowdown))
    port = free_port()
    argv = mori("emulate", "--port", str(port), "--preset-file", str(slower), "--time-scale", "4")
    with spawn(argv, port):
        speed = asyncio.run(probe_speed(f"http://127.0.0.1:{port}", h100))
        again = asyncio.run(probe_speed(f"http://127.0.0.1:{port}", read_preset(slower)))
    assert speed.slowdown == pytest.approx(slowdown, rel=0.03), speed
    assert speed.prefill == pytest.approx(slowdown, rel=0.03), speed
    assert speed.decode == pytest.approx(slowdown, rel=0.03), speed
    assert again.slowdown == pytest.approx(1.0, rel=0.03), again


@given(
    slowdown=st.floats(0.2, 5.0),
    new=st.integers(1, 40_000),
    prefix=st.integers(0, 60_000),
    batch=st.integers(1, 256),
)
def test_at_speed_multiplies_every_time_the_model_prices(
    slowdown: float, new: int, prefix: int, batch: int
) -> None:
    for preset in (get_preset("h100-8b"), get_preset("h200-30b-moe"), cpu_like(3.3e9)):
        base, slow = CostModel(preset), CostModel(at_speed(preset, slowdown))
        for priced in (
            lambda m: m.prefill_s(new, prefix),
            lambda m: m.forwards_s(new),
            lambda m: m.decode_step_s(batch, prefix),
            lambda m: m.load_s(new),
        ):
            assert priced(slow) == pytest.approx(slowdown * priced(base), rel=1e-9)


def test_at_speed_refuses_what_is_no_slowdown() -> None:
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="positive factor"):
            at_speed(get_preset("h100-8b"), bad)


def test_calibrate_refuses_a_dead_endpoint_in_one_line(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run(
        mori("calibrate", "--endpoint", dead, "--out", str(tmp_path / "x.json")),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "mori calibrate:" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr
    assert not (tmp_path / "x.json").exists()


def cpu_like(pcie_bytes_s: float):
    """An engine unlike the GPU presets: torch SDPA recomputes the cached prefix's
    attention, the host copy takes turns with the forward, each forward has an overhead,
    attention is dear, the decode's KV read runs at half the weights' rate (it gathers each
    sequence's rows first); 6,144 device tokens in chunks of 4,096."""
    h100 = get_preset("h100-8b")
    return dataclasses.replace(
        h100,
        gpu=dataclasses.replace(h100.gpu, pcie_bytes_s=pcie_bytes_s),
        attn_eff=0.1,
        prefix_attention=1.0,
        load_serial=1.0,
        prefill_overhead_s=0.02,
        kv_read_eff=0.5,
        chunk_tokens=4096,
        kv_tokens=6144,
    )


def fit_own_timings(engine, forwards=()):
    """Fit the timings `engine`'s own model gives the schedule (from a start the probes
    alone set; the base preset only lends the model's shape, chunk size and pool), with
    `forwards` (the engine's log) beside them."""
    probes = schedule(4608, 6144, reps=1, decode_tokens=16)
    sent = []
    for p in probes:
        prefix = p.setup[0].tokens if p.setup else 0
        hit = (0, prefix) if p.idle else (prefix, 0)
        sent.append(
            [Timing(0.0, 0, 0, p.blocker.tokens, 1, 0, 0)]
            + [Timing(0.001, 0, 0, c.tokens, c.output, *hit) for c in p.calls]
        )
    measured = replay(probes, sent, engine, 2 * 6144)
    base = dataclasses.replace(get_preset("h100-8b"), chunk_tokens=4096, kv_tokens=6144)
    return fit(probes, measured, base, 2 * 6144, forwards=forwards)


def logged(engine, slower: float = 1.0) -> list[Forward]:
    """A forward log of decode iterations (1-32 sequences, 100-6,000 tokens) and prefill
    batches (one or two prompts on a cached prefix) as `engine`'s model prices them, the
    decode iterations `slower` times that."""
    cost, rng, out = CostModel(engine), random.Random(3), []
    for i in range(300):
        reqs = rng.choice((1, 2, 4, 8, 16, 32))
        f = Forward(i, 0.0, True, reqs, rng.randint(100 * reqs, 6000), ())
        if i % 3 == 0:
            lens = tuple(
                (rng.randint(16, 2048), rng.choice((0, 512, 2048))) for _ in range(i % 2 + 1)
            )
            f = Forward(i, 0.0, False, len(lens), sum(n + c for n, c in lens), lens)
        took = priced_s(cost, f) * (slower if f.decode else 1.0)
        out.append(dataclasses.replace(f, took_s=took))
    return out


def test_fitter_recovers_the_engine_terms_gpu_kernels_lack() -> None:
    engine = cpu_like(3.3e9)  # slow enough that a long prefix's load outlasts its compute
    result = fit_own_timings(engine)
    assert_recovered(result.prices, Prices.of(engine))
    assert "load_s" not in result.undetermined()


def test_fitter_fits_the_engines_own_forwards_beside_the_probes() -> None:
    """Forwards the engine logged, priced exactly as the replay prices its iterations and
    batches, leave the recovered prices where the probes put them; forwards 30 % slower
    than the probes' decode pull the decode prices up (halfway: the forwards weigh as
    much as the probes), and the preset reports their residuals."""
    engine = cpu_like(3.3e9)
    probes = schedule(4608, 6144, reps=1, decode_tokens=16)  # fit_own_timings' schedule
    exact = fit_own_timings(engine, logged(engine))
    assert_recovered(exact.prices, Prices.of(engine))
    assert exact.residuals(probes)["forward-decode_rms"] < 0.01
    slow = fit_own_timings(engine, logged(engine, slower=1.3))
    cost, truth = CostModel(slow.prices.preset(engine, "x", "x", {})), CostModel(engine)
    ratio = cost.decode_step_s(4, 8000) / truth.decode_step_s(4, 8000)
    assert 1.08 < ratio < 1.3, ratio
    assert slow.residuals(probes)["forward-decode_median"] < 0  # still under the forwards


def test_fitter_says_when_the_probes_cannot_pin_a_price_down() -> None:
    """With every host load shorter than its compute, a batch takes compute + share x load:
    the load rate and the overlap share trade off, and the fit must say so."""
    result = fit_own_timings(cpu_like(50e9))
    assert {"load_s", "load_serial"} <= set(result.undetermined())


def test_fit_of_a_suite_run_whose_first_search_took_another_branch() -> None:
    """The probes of one CI-like run against the emulator (exact: the preset replays them
    to the float): searched from the regressions and restarted from its best end only,
    the fit ended with load serial 0.10 and pair_s 8 % off; the searches from the shares'
    corners find the preset."""
    described, probes, timings, _ = recorded(GOLDEN / "emulator-other-branch.json")
    base, host_pool = base_preset(described, argparse.Namespace(model_config=None))
    result = fit(probes, timings, base, host_pool)
    assert_recovered(result.prices, Prices.of(get_preset("h100-8b")))


@pytest.mark.parametrize("seed", [7, 25, 28])
def test_fit_recovers_the_prices_when_calls_reach_the_engine_staggered(seed: int) -> None:
    """A busy box delivers a probe's calls after its blocker ended, each at its own time:
    the replay is then a staircase of whole iterations whose first search can stop on a
    flat step. These are the 3 of seeds 0-39 whose first search stopped 70-90 % off (a CI
    run stopped so on the emulator); the fit's other searches must find the prices."""
    h100 = get_preset("h100-8b")
    pool = h100.gpu_kv_tokens
    rng = random.Random(seed)
    probes = schedule(8192, pool, reps=1, decode_tokens=16)
    sent = []
    for p in probes:
        prefix = p.setup[0].tokens if p.setup else 0
        hit = (0, prefix) if p.idle else (prefix, 0)
        late = [Timing(rng.uniform(0.1, 0.2), 0, 0, c.tokens, c.output, *hit) for c in p.calls]
        sent.append([Timing(0.0, 0, 0, p.blocker.tokens, 1, 0, 0), *late])
    result = fit(probes, replay(probes, sent, h100, 2 * pool), h100, 2 * pool)
    assert_recovered(result.prices, Prices.of(h100))


def test_forward_speed_says_how_much_slower_the_engine_ran_than_priced() -> None:
    """What `bench/real_engine_ab.py --predict` prints per run: a log whose decode took 1.3x
    the prices and whose prefills took them exactly."""
    engine = cpu_like(3.3e9)
    speed = forward_speed(CostModel(engine), logged(engine, slower=1.3))
    assert speed == pytest.approx({"prefill": 1.0, "decode": 1.3})


def test_the_jacobian_workers_fit_to_the_bit_what_one_process_fits(monkeypatch) -> None:
    """The fit maps its finite-difference steps over forked workers (a closure, run as it
    is): the search ends where scipy's own map takes it, to the float, in as many steps."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    calls = [0]

    def residuals(z: np.ndarray) -> np.ndarray:
        calls[0] += 1
        return np.asarray([z[0] ** 2 - 2.0, z[0] * z[1] - 3.0, np.sin(z[1]) - 0.5 * z[0]])

    search = {"diff_step": 1e-3, "bounds": ([1e-9, 1e-9], [10.0, 10.0])}
    with _jacobian_workers(residuals, 2) as workers:
        assert workers is not None
        apart = least_squares(residuals, [1.0, 1.0], workers=workers, **search)
    here = calls[0]  # the workers' evaluations are counted in their own copies
    alone = least_squares(residuals, [1.0, 1.0], **search)
    assert apart.x.tolist() == alone.x.tolist() and apart.nfev == alone.nfev
    assert apart.njev == alone.njev > 1
    assert calls[0] - here > here  # alone, the Jacobian's steps ran here too
