"""`mori sim SCENARIO.yaml --trace FILE`: compare policies on simulated replicas.

The scenario YAML names the hardware x model preset and the defaults of a sweep; flags
override them. Every (policy, concurrency, CPU ratio) cell is one simulated run; cells run
in parallel processes (`--jobs`). Prints a table per sweep plus MORI's ratios, and with
`--json OUT.json` writes the JSON, a CSV next to it and throughput / TTFT plots.
"""

from __future__ import annotations

import argparse
import itertools
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, fields
from functools import lru_cache
from pathlib import Path

import yaml

from router.policy import PolicyConfig, policy_names
from router.presets import PRESETS, get_preset, price_summary
from router.replay.records import RunResult
from router.replay.trace import TraceError, TraceProgram, load_trace
from router.sim.approx import ApproxReuse
from router.sim.simulator import SimConfig, policy_knob, simulate


@dataclass
class Scenario:
    """A scenario file's contents (every key optional except `preset`)."""

    preset: str
    replicas: int = 1
    duration_s: float = 3600.0
    token_scale: float = 1.0
    seed: int = 0
    start_jitter_s: float = 5.0
    trace: str | None = None
    policies: list[str] = field(default_factory=lambda: ["mori", "ta+o", "ta", "smg"])
    concurrency: list[int] = field(default_factory=lambda: [20, 50, 80])
    cpu_ratio: list[float] = field(default_factory=lambda: [1.0, 2.0])
    policy: dict = field(default_factory=dict)  # PolicyConfig overrides (tick_s, window...)
    gpu_tokens: int | None = None  # device KV budget per replica (None: the preset's)
    hop_s: float = 0.0  # router <-> engine latency, one way (SimConfig.hop_s)
    description: str = ""


def load_scenario(path: str | Path) -> Scenario:
    """Read and check a scenario YAML; ValueError says what is wrong and where."""
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"{path}: cannot read scenario: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: invalid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a scenario is a YAML mapping")
    known = {f.name for f in fields(Scenario)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{path}: unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}")
    if "preset" not in raw:
        raise ValueError(f"{path}: missing 'preset' (one of {', '.join(PRESETS)})")
    for key in ("policies", "concurrency", "cpu_ratio"):
        if key in raw and not isinstance(raw[key], list):
            raw[key] = [raw[key]]
    try:
        return Scenario(**raw)
    except TypeError as e:
        raise ValueError(f"{path}: {e}") from None


def _csv(kind, name: str):
    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: not a comma list: {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"{name}: empty list")
        return values

    return parse


def _policies(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [n for n in names if n not in policy_names()]
    if unknown or not names:
        known = ", ".join(policy_names())
        bad = unknown[0] if unknown else text
        raise argparse.ArgumentTypeError(f"unknown policy {bad!r}; known: {known}")
    return names


def _setting(text: str) -> tuple[str, object]:
    """KNOB=VALUE for a PolicyConfig field; the value is read as YAML (60, 0.5, true)."""
    name, sep, raw = text.partition("=")
    known = {f.name for f in fields(PolicyConfig)}
    if not sep or name.strip() not in known:
        raise argparse.ArgumentTypeError(
            f"--set takes KNOB=VALUE with KNOB one of: {', '.join(sorted(known))}"
        )
    try:
        return name.strip(), policy_knob(name.strip(), yaml.safe_load(raw))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--set {e}") from None


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="scenario YAML (configs/sim/*.yaml)")
    parser.add_argument("--trace", help="trace JSONL corpus (default: the scenario's 'trace')")
    parser.add_argument(
        "--preset-file",
        help="a preset file (`mori calibrate --out`) instead of the scenario's preset "
        "(default: none)",
    )
    parser.add_argument(
        "--policies",
        type=_policies,
        help="comma list, e.g. mori,ta+o,ta,smg (default: the scenario's, else mori,ta+o,ta,smg)",
    )
    parser.add_argument(
        "--concurrency",
        type=_csv(int, "--concurrency"),
        help="closed-loop programs, comma list (default: the scenario's, else 20,50,80)",
    )
    parser.add_argument(
        "--cpu-ratio",
        type=_csv(float, "--cpu-ratio"),
        help="host KV / GPU KV budget, comma list (default: the scenario's, else 1,2)",
    )
    parser.add_argument(
        "--duration",
        type=float,
        help="virtual seconds per cell (default: the scenario's, else 3600)",
    )
    parser.add_argument(
        "--token-scale",
        type=float,
        help="multiply every token count (default: the scenario's, else 1)",
    )
    parser.add_argument("--replicas", type=int, help="replicas (default: the scenario's)")
    parser.add_argument(
        "--gpu-tokens", type=int, help="device KV budget per replica (default: the preset's)"
    )
    parser.add_argument(
        "--window", type=int, help="idleness window W in cycles (default: the scenario's, else 4)"
    )
    parser.add_argument(
        "--hop-s",
        type=float,
        help="router <-> engine latency one way, trace seconds: what a live stack adds "
        "(its wall latency x its time scale) (default: the scenario's, else 0)",
    )
    parser.add_argument(
        "--seed", type=int, help="corpus order and start jitter (default: the scenario's, else 0)"
    )
    parser.add_argument(
        "--set",
        dest="settings",
        action="append",
        type=_setting,
        default=[],
        metavar="KNOB=VALUE",
        help="a policy knob for every cell (repeatable), e.g. --set aging_s=60",
    )
    parser.add_argument(
        "--approx",
        action="store_true",
        help="TokenDance's approximate reuse of gathered blocks, modelled (router/sim/approx.py)",
    )
    parser.add_argument("--jobs", type=int, default=2, help="parallel processes")
    parser.add_argument(
        "--json", dest="json_out", help="write results JSON (+ .csv, plots) (default: none)"
    )
    parser.add_argument(
        "--wide", action="store_true", help="results table with every metric (over 80 columns)"
    )


def _build(args) -> tuple[Scenario, list[SimConfig]]:
    sc = load_scenario(args.scenario)
    for attr, key in (("duration", "duration_s"), ("token_scale", "token_scale")):
        if getattr(args, attr) is not None:
            setattr(sc, key, getattr(args, attr))
    for key in (
        "replicas", "seed", "trace", "policies", "concurrency", "cpu_ratio", "gpu_tokens", "hop_s"
    ):  # fmt: skip
        if getattr(args, key) is not None:
            setattr(sc, key, getattr(args, key))
    if getattr(args, "preset_file", None):
        sc.preset = args.preset_file
    if args.window is not None:
        sc.policy = {**sc.policy, "window": args.window}
    sc.policy = {**sc.policy, **dict(args.settings)}
    if not sc.trace:
        raise ValueError("no trace: pass --trace FILE (or set 'trace' in the scenario)")
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    configs = [
        SimConfig(
            policy=policy,
            preset=sc.preset,
            replicas=sc.replicas,
            concurrency=conc,
            cpu_ratio=ratio,
            duration_s=sc.duration_s,
            token_scale=sc.token_scale,
            seed=sc.seed,
            start_jitter_s=sc.start_jitter_s,
            policy_config=dict(sc.policy),
            gpu_tokens=sc.gpu_tokens,
            approx=ApproxReuse() if getattr(args, "approx", False) else None,
            hop_s=sc.hop_s,
        )
        for ratio, conc, policy in itertools.product(sc.cpu_ratio, sc.concurrency, sc.policies)
    ]
    return sc, configs


@lru_cache(maxsize=4)
def _corpus(path: str) -> list[TraceProgram]:
    return load_trace(path)


def _run_cell(trace: str, config: SimConfig) -> RunResult:
    return simulate(_corpus(trace), config)


def run_cells(trace: str, configs: list[SimConfig], jobs: int, on_done=None) -> list[RunResult]:
    """Run every cell (in `jobs` processes when > 1); `on_done(result)` as each finishes."""
    if jobs == 1 or len(configs) == 1:
        results = []
        for config in configs:
            results.append(_run_cell(trace, config))
            if on_done:
                on_done(results[-1])
        return results
    results = []
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(_run_cell, trace, c) for c in configs]
        for fut in as_completed(futures):
            results.append(fut.result())
            if on_done:
                on_done(results[-1])
    return results


def run(args) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from router.replay.report import console as report_console
    from router.replay.report import print_results, write_reports

    console = report_console()
    try:
        sc, configs = _build(args)
        _corpus(sc.trace)  # validate before starting workers
    except (ValueError, TraceError) as e:
        console.print(f"[red]mori sim: {e}[/red]")
        return 2
    console.print(
        f"cost model of {sc.preset}: {price_summary(get_preset(sc.preset))}", highlight=False
    )
    title = f"{sc.preset} x{sc.replicas}, {Path(sc.trace).name}, {sc.duration_s:g} s"
    if sc.gpu_tokens:
        title += f", GPU KV {sc.gpu_tokens:,} tokens"
    if sc.token_scale != 1.0:
        title += f", tokens x{sc.token_scale:g}"
    if args.approx:
        title += ", approximate reuse (modelled)"
    columns = ("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("simulating cells", total=len(configs))

        def done(r: RunResult) -> None:
            progress.advance(task)
            progress.console.log(
                f"{r.policy:>6} conc={r.concurrency} cpu={r.cpu_ratio:g}: "
                f"{r.output_tok_s:.1f} tok/s, TTFT {r.ttft_mean_s:.2f} s "
                f"({r.extra.get('sim_wall_s', 0):.1f} s wall)"
            )

        results = run_cells(sc.trace, configs, args.jobs, done)
    print_results(console, results, title, args.wide)
    if args.json_out:
        meta = {"scenario": str(args.scenario), "trace": sc.trace, "preset": sc.preset}
        meta.update(replicas=sc.replicas, duration_s=sc.duration_s, token_scale=sc.token_scale)
        meta.update(seed=sc.seed, policy_config=sc.policy, gpu_tokens=sc.gpu_tokens)
        for path in write_reports(results, args.json_out, title, meta):
            console.print(f"wrote {path}")
    return 0
