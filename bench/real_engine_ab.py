"""MORI against the plain gateway on the real engine: a patched SGLang replica on CPU.

    python bench/real_engine_ab.py                      # mori, ta+o, smg; 2 runs each, 120 s
    python bench/real_engine_ab.py --runs 1 --duration 60 --policies mori,smg
    python bench/real_engine_ab.py --write bench/results/2026-11-23-real-engine-ab.md
    python bench/real_engine_ab.py --policies mori,smg,smg-gateway --max-total-tokens 3072 12288
    python bench/real_engine_ab.py --model-shape 512x8     # a model whose misses cost seconds
    python bench/real_engine_ab.py --keep out/ab           # each replay's per-step CSV too
    python bench/real_engine_ab.py --policies "mori,mori[band_waiver_steps=0],smg"  # a knob
    python bench/real_engine_ab.py --predict --model-shape 512x8 1024x8 \
        --max-total-tokens 4096 6144 --json out/ab.json    # real beside the simulator's prediction

`smg-gateway` is the real SGLang Model Gateway (`smg` 1.13, its cache-aware policy, installed
as bench/gateways.py says) in front of the same fresh engine, instead of `mori serve`.
Several `--max-total-tokens` sweep the memory pressure: each budget is a block of runs.

One SGLang replica (the newest supported line from scripts/install_sglang_cpu.sh, or
MORI_SGLANG_VERSION) started by `mori-sglang` on the tiny random-weight test model, with a
small device pool (`--max-total-tokens`, default 6144) and a host tier twice that, so a few
programs overflow it. For each run and policy, interleaved (run 1: mori, ta+o, smg; run
2: ...), a fresh engine, `mori serve --policy P` (tick 1 s) and a closed-loop `mori replay`
of the generated 32k corpus at token scale 0.1 through it. Each row: output tok/s, TTFT
mean / p99, the device / host / miss split of prompt tokens (from SGLang's own cache
report), and the mean number of requests running in the engine (SGLang's
`sglang:num_running_reqs`, sampled every second). Then `mori`'s ratio to each baseline.

On CPU a miss is cheap (the tiny model prefills fast) and an idle engine is not: the
policy's prices, learned from the engine's own timings, decide how much it gates.

`--predict` first calibrates a fresh engine of each model shape (`mori calibrate`, ~5 min;
or takes `--preset-file`), then after each budget's runs simulates the same cells with that
preset and prints real beside predicted (bench/engine_prediction.py); `--json OUT` writes
`{"cells": [{"device_tokens", "model_shape", "policy", "real", "predicted", ...}]}`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

import httpx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.engine_prediction import (  # noqa: E402
    ENGINE_TOK_S,
    METRICS,
    compare,
    mean_row,
    predict,
    sim_config,
)
from bench.gateways import SMG_PYTHON, gateway_argv, wait_serving  # noqa: E402
from bench.machine_load import CpuSplit, wait_quiet  # noqa: E402
from engine_patches.forward_log import ENV as FORWARD_LOG  # noqa: E402
from router.calibrate.forwards import forward_speed, read_forwards, tokens_by  # noqa: E402
from router.calibrate.speed import Speed, probe_speed  # noqa: E402
from router.presets import at_speed, read_preset, write_preset  # noqa: E402
from router.sim.model import CostModel  # noqa: E402
from tests.servers import free_port, mori, spawn  # noqa: E402
from tests.sglang.server import build_tiny_model, installed_version, patched_servers  # noqa: E402

TRACE = ROOT / "traces/generated-claude-code-32k.jsonl"
HICACHE_RATIO = 2  # host tier = this x the device pool


def running_sampler(url: str, stop: threading.Event, out: list[float]) -> None:
    """Sample the engine's running-request gauge every second until `stop`."""
    while not stop.wait(1.0):
        with contextlib.suppress(httpx.HTTPError, ValueError):
            text = httpx.get(url + "/metrics", timeout=2.0).text
            values = [
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("sglang:num_running_reqs")
            ]
            if values:
                out.append(sum(values))


GATEWAY = "smg-gateway"


def split_policies(text: str) -> list[str]:
    """Comma-separated policies; a variant `name[key=value;key=value]` keeps its commas-free
    settings in brackets (`mori[band_waiver_steps=0]`)."""
    return [p.strip() for p in re.split(r",(?![^\[]*\])", text) if p.strip()]


def variant(label: str) -> tuple[str, list[str]]:
    """(policy name, `key=value` settings) of a label such as `mori[aging_s=60;window=8]`."""
    match = re.fullmatch(r"([^\[\]]+)(?:\[([^\[\]]*)\])?", label)
    if match is None:
        raise ValueError(f"bad policy {label!r}: expected NAME or NAME[key=value;...]")
    settings = [kv.strip() for kv in (match.group(2) or "").split(";") if kv.strip()]
    return match.group(1), settings


def router_argv(args: argparse.Namespace, policy: str, engine: str, port: int) -> list[str]:
    """`mori serve --policy POLICY` (and a variant's settings), or the real gateway for
    `smg-gateway`."""
    if policy == GATEWAY:
        return gateway_argv("smg", [engine], port, free_port(), python=args.smg_python)
    name, settings = variant(policy)
    sets = [a for kv in [f"tick_s={args.tick_s}", *settings] for a in ("--set", kv)]
    return mori(
        "serve", "--replicas", engine, "--port", str(port), "--policy", name, *sets,
        "--log-level", "warning",
    )  # fmt: skip


def _stem(policy: str) -> str:
    """A file name for a policy label (a variant's brackets and settings made plain)."""
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", policy).strip("_")


def engine_flags(device_tokens: int) -> list[str]:
    """The engine every run (and its calibration) gets: the device pool, a host tier."""
    return [
        "--max-total-tokens", str(device_tokens), "--hicache-ratio", str(HICACHE_RATIO),
        "--enable-metrics",
    ]  # fmt: skip


def calibrate(args: argparse.Namespace, model: Path, work: Path, budget: int, shape: str) -> Path:
    """`mori calibrate` on a fresh engine like the runs' (its preset file)."""
    out = work / f"preset-{shape}.json"
    wait_quiet(args.quiet_wait)
    split = CpuSplit()
    forwards = work / f"calibration-{shape}.forwards"
    env = {FORWARD_LOG: str(forwards)} if args.keep is not None else None
    with patched_servers(1, model, work, engine_flags(budget), env=env) as (engine,):
        argv = mori("calibrate", "--endpoint", engine.url, "--out", str(out))
        argv += ["--reps", str(args.calibrate_reps)]
        done = subprocess.run(argv, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"mori calibrate failed ({done.returncode})")
    used = ", ".join(f"{k} {v:.2f}" for k, v in split.cores().items())
    print(f"calibration of {shape}, cores used meanwhile: {used}")
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        for f in (out, out.with_suffix(".png"), *work.glob(f"{forwards.name}.*")):
            shutil.copy2(f, args.keep / f.name)
    return out


def speed_probe(url: str, preset: Path, within_s: float = 60.0) -> Speed:
    """The fresh engine's speed against `preset` (router/calibrate/speed.py, ~20 s), then
    its cache emptied: the run starts as cold as without the probe. SGLang refuses to
    flush (400) while a request is still in its scheduler (a probe's last stream may end
    at the client before it leaves there): asked again until it has."""
    speed = asyncio.run(probe_speed(url, read_preset(preset)))
    deadline = time.monotonic() + within_s
    while (flushed := httpx.post(f"{url}/flush_cache", timeout=60)).status_code == 400:
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    flushed.raise_for_status()
    return speed


def one_run(
    args: argparse.Namespace,
    policy: str,
    model: Path,
    work: Path,
    device_tokens: int,
    preset: Path | None = None,
) -> dict:
    """A fresh engine, a router with `policy`, and the replay; returns the replay's row, with
    the engine's tokens in the window and (given the prediction's `preset`) how long its
    prefill and decode forwards took against that preset's prices: a run on a machine
    slower than at calibration shows here, apart from the model's error. With
    `--speed-probe` the engine's speed is probed first (`speed_probe`), for a prediction
    at that speed beside."""
    flags = engine_flags(device_tokens)
    forwards = work / f"{_stem(policy)}.forwards"  # the engine's per-forward timings
    with patched_servers(1, model, work, flags, env={FORWARD_LOG: str(forwards)}) as (engine,):
        probe = speed_probe(engine.url, preset) if preset and args.speed_probe else None
        probed_at = time.monotonic()  # the engine's forward log runs on this clock
        split = CpuSplit()
        port = free_port()
        with spawn(router_argv(args, policy, engine.url, port), port):
            if policy == GATEWAY:
                wait_serving(f"http://127.0.0.1:{port}")
            samples: list[float] = []
            stop = threading.Event()
            sampler = threading.Thread(target=running_sampler, args=(engine.url, stop, samples))
            sampler.start()
            out = work / f"{_stem(policy)}.json"
            try:
                replay = mori(
                    "replay", str(TRACE), "--endpoint", f"http://127.0.0.1:{port}",
                    "--token-scale", str(args.token_scale), "--concurrency",
                    str(args.concurrency), "--duration", str(args.duration),
                    "--seed", str(args.seed), "--json", str(out),
                )  # fmt: skip
                done = subprocess.run(
                    replay, capture_output=True, text=True, timeout=args.duration + 300
                )
                if done.returncode != 0:
                    raise RuntimeError(f"replay failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
            finally:
                stop.set()
                sampler.join()
                cpu = split.cores()  # before the stack stops
    row = json.loads(out.read_text())["results"][0]
    logged = [f for f in read_forwards(forwards) if f.start_s >= probed_at]  # the run's own
    computed = tokens_by(logged, args.duration) / args.duration
    speed = forward_speed(CostModel(read_preset(preset)), logged) if preset else {}
    if args.keep is not None:  # the replay's JSON, CSV and per-step CSV, for the tail's why
        kept = args.keep / f"{device_tokens}-{_stem(policy)}-{time.strftime('%H%M%S')}"
        kept.mkdir(parents=True, exist_ok=True)
        for f in work.glob(f"{_stem(policy)}.*"):
            if f.is_file():
                shutil.copy2(f, kept / f.name)
        shutil.copy2(engine.log, kept / "engine.log")
        (kept / "cpu.json").write_text(json.dumps(cpu, indent=1))
    for f in work.glob(f"{forwards.name}.*"):  # the next run's engine writes its own
        f.unlink()
    return {
        **{m: row[m] for m in METRICS if m != ENGINE_TOK_S},
        ENGINE_TOK_S: computed,  # from the engine's forward log: steps still running count
        "forwards_vs_price": speed,
        **({"probe": dataclasses.asdict(probe)} if probe else {}),
        "failed_steps": row.get("failed_steps", 0),  # refused or broken steps: not counted
        "running_mean": statistics.fmean(samples) if samples else 0.0,
        "others": cpu.get("others", 0.0),
        "cpu": cpu,  # cores per part of the stack over the run
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="mori,ta+o,smg")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--duration", type=float, default=120.0, help="wall seconds per run")
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--token-scale", type=float, default=0.1)
    parser.add_argument(
        "--max-total-tokens", type=int, nargs="+", default=[6144], help="device KV budgets"
    )
    parser.add_argument(
        "--model-shape",
        nargs="+",
        default=["64x2"],
        help="HIDDENxLAYERS of the random-weight model (several: one block each): "
        "512x8 prefills ~1,000 tokens/s on 2 cores, so a miss costs seconds as on a GPU",
    )
    parser.add_argument(
        "--predict",
        action="store_true",
        help="calibrate each shape's engine, then print the simulator's prediction beside",
    )
    parser.add_argument(
        "--preset-file", type=Path, help="with --predict: this preset instead of calibrating"
    )
    parser.add_argument("--json", type=Path, help="with --predict: write the cells here")
    parser.add_argument(
        "--speed-probe",
        action="store_true",
        help="with --predict: time each fresh engine first (router/calibrate/speed.py, ~20 s "
        "a run) and predict each run also at that speed (on 2026-12-02 it read 0.87-1.03 "
        "where the runs' forwards ran 0.94-1.16: an idle engine's speed, not a loaded one's)",
    )
    parser.add_argument(
        "--calibrate-reps", type=int, default=1, help="with --predict: the calibration's --reps"
    )
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=0.0,
        help="before each run, wait up to this many seconds for the rest of the machine to "
        "fall under 20 %% busy (bench/machine_load.py)",
    )
    parser.add_argument("--tick-s", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smg-python", type=Path, default=SMG_PYTHON)
    parser.add_argument("--write", type=Path, help="append the tables to this markdown file")
    parser.add_argument(
        "--keep",
        type=Path,
        help="copy every replay's JSON and per-step CSV, the engine's log and its per-forward "
        "timings (engine_patches/forward_log.py) under this folder",
    )
    args = parser.parse_args(argv)
    policies = split_policies(args.policies)
    for label in policies:
        try:
            variant(label)
        except ValueError as exc:
            parser.error(str(exc))
    if GATEWAY in policies and not args.smg_python.exists():
        parser.error(f"no gateway at {args.smg_python}: see bench/gateways.py to install it")
    console = Console(width=120)
    md: list[str] = []
    cells: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="mori-ab-") as tmp:
        work = Path(tmp)
        for shape in args.model_shape:
            hidden, layers = (int(x) for x in shape.split("x"))
            model = build_tiny_model(work / f"model-{shape}", hidden, layers)
            preset = args.preset_file
            if args.predict and preset is None:
                preset = calibrate(args, model, work, args.max_total_tokens[0], shape)
            for budget in args.max_total_tokens:
                rows = runs(args, policies, model, work, budget, console, preset)
                md += report(args, shape, budget, rows, console)
                if args.predict:
                    md += predicted(args, shape, budget, rows, preset, console, cells, work)
                    if args.json:
                        args.json.parent.mkdir(parents=True, exist_ok=True)
                        args.json.write_text(json.dumps({"cells": cells}, indent=1) + "\n")
    if args.write:
        command = " ".join(["python bench/real_engine_ab.py", *(argv or sys.argv[1:])])
        head = [f"## {date.today().isoformat()} - real SGLang {installed_version()} on CPU", ""]
        head += [f"`{command}` (shared 2-vCPU machine; load per run in the tables)", ""]
        with args.write.open("a") as fh:
            fh.write("\n".join(head + md) + "\n")
    return 0


def runs(args, policies, model, work, budget, console, preset) -> dict[str, list[dict]]:
    """`--runs` interleaved repetitions (A B C A B C ...) of every policy on `budget`; with a
    preset (`--predict`), each run's forwards against its prices too."""
    rows: dict[str, list[dict]] = {p: [] for p in policies}
    for run in range(args.runs):
        for policy in policies:
            wait_quiet(args.quiet_wait, say=console.print)
            started, load = time.monotonic(), os.getloadavg()[0]
            row = one_run(args, policy, model, work, budget, preset) | {"load": load}
            rows[policy].append(row)
            speed = ", ".join(f"{k} {v:.2f}" for k, v in row.get("forwards_vs_price", {}).items())
            if "probe" in row:
                speed += f"; probed before: {row['probe']['slowdown']:.2f}"
            console.print(
                f"{budget} tokens, run {run + 1} {escape(policy)}: {row['output_tok_s']:.1f} tok/s "
                f"({time.monotonic() - started:.0f} s, load {load:.1f}, others "
                f"{row['others']:.2f} cores{', forwards / price: ' + speed if speed else ''})"
            )
    return rows


def report(
    args, shape: str, budget: int, rows: dict[str, list[dict]], console: Console
) -> list[str]:
    """The budget's table and mori's ratios (tok/s, TTFT p99, misses) as Markdown lines."""
    title = (
        f"real SGLang {installed_version()} on CPU, model {shape}, "
        f"{budget} device tokens, {args.runs} runs"
    )
    table = Table(title=title)
    heads = ["policy", "out tok/s", "steps/s (failed)", "TTFT mean / p99 s"]
    heads += ["device / host / miss %", "running", "load", "others"]
    for h in heads:
        table.add_column(h, justify="left" if h == "policy" else "right")
    md = [
        f"### model {shape}, {budget} device tokens",
        "",
        "| " + " | ".join(heads) + " |",
    ]
    md.append("|---|" + "---:|" * (len(heads) - 1))
    for policy, results in rows.items():
        cells = [
            ", ".join(f"{r['output_tok_s']:.1f}" for r in results),
            ", ".join(f"{r['steps_s']:.2f} ({r['failed_steps']})" for r in results),
            ", ".join(f"{r['ttft_mean_s']:.2f} / {r['ttft_p99_s']:.1f}" for r in results),
            ", ".join(
                f"{100 * r['hit_device']:.1f} / {100 * r['hit_host']:.1f} / {100 * r['miss']:.1f}"
                for r in results
            ),
            f"{statistics.fmean(r['running_mean'] for r in results):.2f}",
            ", ".join(f"{r['load']:.1f}" for r in results),
            ", ".join(f"{r['others']:.2f}" for r in results),
        ]
        table.add_row(escape(policy), *cells)
        md.append("| " + " | ".join([policy, *cells]) + " |")
    console.print(table)

    def mean(policy: str, key: str) -> float:
        return statistics.fmean(r[key] for r in rows[policy])

    ratios = []
    if "mori" in rows:
        for other in (p for p in rows if p != "mori"):
            tput = mean("mori", "output_tok_s") / max(mean(other, "output_tok_s"), 1e-9)
            p99 = mean("mori", "ttft_p99_s") / max(mean(other, "ttft_p99_s"), 1e-9)
            misses = mean("mori", "miss") / max(mean(other, "miss"), 1e-9)
            ratios.append(
                f"mori / {other}: output tok/s {tput:.2f}x, TTFT p99 {p99:.2f}x, "
                f"misses {misses:.2f}x"
            )
    for line in ratios:
        console.print(escape(line))
    return [*md, "", *(f"- {r}" for r in ratios), ""]


def predicted(
    args, shape: str, budget: int, rows: dict[str, list[dict]], preset: Path, console, cells, work
) -> list[str]:
    """Simulate the budget's cells with `preset`, print and return real beside predicted,
    and add the cells to `cells`. With speed probes, each run is also simulated with the
    preset at the speed probed before it, and the mean of those is printed and kept beside
    (`predicted_at_probed_speed`)."""
    cell = {
        "concurrency": args.concurrency, "duration_s": args.duration, "seed": args.seed,
        "token_scale": args.token_scale, "tick_s": args.tick_s, "cpu_ratio": HICACHE_RATIO,
    }  # fmt: skip
    title = f"model {shape}, {budget} device tokens"
    configs = {label: sim_config(*variant(label), preset, budget, cell) for label in rows}
    at_calibration = predict(TRACE, configs)
    head = f"#### predicted by `mori sim` with {preset.name}"
    predictions = {head: at_calibration}
    if all("probe" in r for runs in rows.values() for r in runs):
        each = {
            f"{label}#{i}": sim_config(
                *variant(label), priced_at(preset, r["probe"]["slowdown"], work), budget, cell
            )
            for label, runs in rows.items()
            for i, r in enumerate(runs)
        }
        sims = predict(TRACE, each)
        at_probe = {
            label: mean_row([sims[f"{label}#{i}"] for i in range(len(runs))])
            for label, runs in rows.items()
        }
        predictions = {
            f"{head} at the calibration's speed": at_calibration,
            f"{head} at each run's probed speed": at_probe,
        }
    md: list[str] = []
    for k, (head, prediction) in enumerate(predictions.items()):
        table, lines, found = compare(title, rows, prediction)
        console.print(table)
        for line in lines:
            if line.startswith("- "):
                console.print(escape(line[2:]))
        md += [f"{head}: real / predicted (error)", "", *lines]
        for c in found if k == 0 else ():  # the first is the prediction; the other beside
            if len(predictions) > 1:
                c["predicted_at_probed_speed"] = at_probe[c["policy"]]
            cells.append({"device_tokens": budget, "model_shape": shape, **c})
    return md


def priced_at(preset: Path, slowdown: float, work: Path) -> Path:
    """`preset` at `slowdown` (router.presets.at_speed), as a preset file for the sim."""
    out = work / f"{preset.stem}-x{slowdown:.4f}.json"
    return write_preset(out, at_speed(read_preset(preset), slowdown))


if __name__ == "__main__":
    raise SystemExit(main())
