"""`mori demo`: the whole stack on one machine, no GPU: two emulated replicas, the router,
and a closed-loop replay of the committed agent corpus, once per policy (MORI, the
ThunderAgent+offload baseline and the SGLang-gateway-like baseline by default), then the
results side by side with MORI's ratios.

The replicas are `mori emulate` with small KV budgets, so two dozen agent programs do not fit
on the GPU tier and the policy's tiering decisions show in the numbers. Everything runs
`--time-scale` times faster than real time (engine clock, tool sleeps and the router's
timers alike), so a minute of wall time replays several minutes of agent work. `--reps N`
repeats the comparison N times, the policies interleaved (A B C A B C ...) so that a slow
spell of the machine hits every policy alike, each repetition on its own seed; the report
gives the mean and range of MORI's ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from router.policy import PolicyConfig, make_policy, policy_names
from router.presets import get_preset, price_summary
from router.replay.cli import add_api_argument, replay_with_progress
from router.replay.client import ReplayConfig
from router.replay.records import RunResult
from router.replay.report import console as report_console
from router.replay.report import print_results, write_reports
from router.replay.trace import TraceError, TraceProgram, load_trace
from router.sim.simulator import SimConfig, simulate

REPO = Path(__file__).resolve().parents[1]
TRACE_CANDIDATES = ("traces/generated-claude-code-32k.jsonl", "traces/generated-claude-code.jsonl")
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies
FALLBACK_TRACE = ("traces/claude-code-sample.jsonl", 0.05)  # Claude-sized contexts: scale down
# a run under this share of its simulated twin's tokens is called out (the README cell runs
# 0.97-1.01 at x5 on a 2-vCPU box in a normal hour; 0.77 in a slow one)
SLOW_RUN = 0.9


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--duration", type=float, default=45.0, help="wall seconds to replay, per policy and run"
    )
    parser.add_argument("--concurrency", type=int, default=24, help="closed-loop agent programs")
    parser.add_argument(
        "--policies",
        "--policy",
        dest="policies",
        default="mori,ta+o,smg",
        help="comma list of router policies to compare, each on a fresh stack; known: "
        f"{', '.join(policy_names())}",
    )
    parser.add_argument(
        "--reps",
        type=int,
        default=1,
        help="run the comparison this many times, policies interleaved, seeds --seed, "
        "--seed + 1, ...; the report shows means and the range of MORI's ratios (one run's "
        "ratios and wall time move with the machine's load: 3 shows the spread)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=5.0,
        help="speed-up over real time (engines, tool calls, router timers)",
    )
    parser.add_argument("--trace", help="trace corpus (default: the committed generated one)")
    parser.add_argument(
        "--token-scale",
        type=float,
        help="multiply the trace's token counts (default 0.25 for the generated corpus)",
    )
    parser.add_argument("--gpu-tokens", type=int, default=16000, help="GPU KV tokens per replica")
    parser.add_argument(
        "--host-tokens", type=int, default=32000, help="host (DRAM) KV tokens per replica"
    )
    parser.add_argument("--replicas", type=int, default=2, help="emulated replicas")
    parser.add_argument(
        "--preset",
        default="h100-8b",
        help="the cost model the emulated replicas run (router/presets.py)",
    )
    parser.add_argument(
        "--preset-file",
        help="a preset file (`mori calibrate --out`) for the replicas instead of --preset "
        "(default: none)",
    )
    parser.add_argument("--out", default="out/demo", help="where the JSON/CSV/plots and logs go")
    parser.add_argument(
        "--seed", type=int, default=0, help="corpus order and start jitter of the first run"
    )
    parser.add_argument(
        "--wide", action="store_true", help="results table with every metric (over 80 columns)"
    )
    add_api_argument(parser)
    parser.add_argument(
        "--keep-running",
        action="store_true",
        help="leave the last policy's router and replicas up after its replay (Ctrl-C stops)",
    )


def pick_trace(explicit: str | None, token_scale: float | None) -> tuple[Path, float]:
    """The corpus and token scale: given, else the generated corpus, else the real sample."""
    if explicit:
        return Path(explicit), token_scale or 1.0
    for base in (Path.cwd(), REPO):
        for name in TRACE_CANDIDATES:
            if (base / name).is_file():
                return base / name, token_scale or 0.25
        if (base / FALLBACK_TRACE[0]).is_file():
            return base / FALLBACK_TRACE[0], token_scale or FALLBACK_TRACE[1]
    raise FileNotFoundError("no trace corpus found (traces/*.jsonl); pass --trace FILE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """The demo's server processes: started in order, each waited for (or a group of them
    together: `ready`), all stopped on exit."""

    def __init__(self, logs: Path, console: Console) -> None:
        self.logs = logs
        self.console = console
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.urls: dict[str, str] = {}
        self._starting: list[tuple[str, subprocess.Popen, str]] = []  # not waited for yet

    def start(
        self, name: str, argv: list[str], url: str, env: dict | None = None, wait: bool = True
    ) -> None:
        """`mori ARGV` as process `name`, once `url`/health answers (`wait=False`: at
        `ready`, so that servers that need not wait for each other start side by side)."""
        self.start_command(name, [sys.executable, "-m", "router.cli", *argv], url, env, wait)

    def start_command(
        self,
        name: str,
        command: list[str],
        url: str,
        env: dict | None = None,
        wait: bool = True,
    ) -> None:
        """Any server (a benchmark's external gateway) as process `name`, once it is up."""
        log = (self.logs / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # Ctrl-C reaches us only; we stop the children
            preexec_fn=_die_with(os.getpid()),
        )
        self.procs.append((name, proc))
        self.urls[name] = url
        self._starting.append((name, proc, url))
        if wait:
            self.ready()

    def ready(self) -> None:
        """Wait for every process started and not yet waited for to answer its health."""
        while self._starting:
            name, proc, url = self._starting.pop(0)
            self._wait_healthy(name, proc, url + "/health")

    def _wait_healthy(self, name: str, proc: subprocess.Popen, url: str, timeout_s=60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = (self.logs / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=1.0).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"{name} not healthy at {url} after {timeout_s:g} s")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every process group, then SIGKILL what is left after one shared grace
        period (not one per process: a stack of three slow stoppers must not take 30 s)."""
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for _, proc in reversed(self.procs):
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()
        self._starting.clear()


def _die_with(parent: int) -> Callable[[], None] | None:
    """A child's pre-exec hook: SIGTERM it when the demo dies, even by SIGKILL (which no
    handler of ours sees), so no orphaned stack keeps its ports (Linux; elsewhere None)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def hook() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the demo died before the prctl took effect
            os._exit(1)

    return hook


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """`kill` of the demo cleans up like Ctrl-C does."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _preset_flags(args: argparse.Namespace) -> list[str]:
    """The emulators' cost model (bench scripts that reuse the stack may not set one)."""
    if getattr(args, "preset_file", None):
        return ["--preset-file", args.preset_file]
    return ["--preset", getattr(args, "preset", "h100-8b")]


def start_stack(args: argparse.Namespace, policy: str, stack: Stack) -> str:
    """Replicas with the engine behaviour the policy expects, then the router: its URL."""
    mode = make_policy(policy, PolicyConfig()).engine_mode
    urls = []
    for i in range(args.replicas):
        port = free_port()
        argv = [
            "emulate",
            "--port",
            str(port),
            "--time-scale",
            str(args.time_scale),
            "--gpu-tokens",
            str(args.gpu_tokens),
            "--host-tokens",
            str(args.host_tokens),
            "--eviction",
            mode.eviction,
            *_preset_flags(args),
        ]
        if not mode.host_tier:
            argv.append("--no-host-tier")
        urls.append(f"http://127.0.0.1:{port}")
        stack.start(f"replica{i}", argv, urls[-1], wait=False)
    stack.ready()  # the replicas start side by side; the router once they answer
    port = free_port()
    env = {"MORI_TIME_SCALE": str(args.time_scale)}  # the router's timers keep pace
    argv = [
        "serve",
        "--replicas",
        ",".join(urls),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        policy,
        "--log-level",
        "warning",
    ]
    router = f"http://127.0.0.1:{port}"
    stack.start("router", argv, router, env)
    return router


def run(args: argparse.Namespace) -> int:
    console = report_console()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in policy_names()]
    if unknown or not policies:
        console.print(
            f"[red]mori demo: unknown policy {', '.join(map(repr, unknown)) or '(none)'}; "
            f"known: {', '.join(policy_names())}[/red]"
        )
        return 2
    try:
        if args.reps < 1:
            raise ValueError("--reps must be at least 1")
        trace, token_scale = pick_trace(args.trace, args.token_scale)
        corpus = load_trace(trace)
        config = ReplayConfig(
            endpoint="",  # set once the router is up
            api=args.api,
            concurrency=args.concurrency,
            duration_s=args.duration,
            time_scale=args.time_scale,
            token_scale=token_scale,
            seed=args.seed,
            policy_label=policies[0],
            cpu_ratio=args.host_tokens / args.gpu_tokens,
        )
    except (FileNotFoundError, TraceError, ValueError) as e:
        console.print(f"[red]mori demo: {e}[/red]")
        return 2
    _introduce(args, trace, config, console)
    runs = [(rep, policy) for rep in range(args.reps) for policy in policies]  # interleaved
    try:
        with _sigterm_as_interrupt():
            results = []
            for i, (rep, policy) in enumerate(runs):
                keep = args.keep_running and i == len(runs) - 1
                run_config = dataclasses.replace(config, policy_label=policy, seed=args.seed + rep)
                label = (
                    f"run {rep + 1}/{args.reps}, seed {run_config.seed}: " if args.reps > 1 else ""
                )
                result = _demo_policy(args, policy, corpus, run_config, console, keep, label)
                if result is None:  # --keep-running: the stack was held until it stopped
                    return 1
                results.append(result)
            _report(results, args, trace, corpus, token_scale, console)
            return 0
    except KeyboardInterrupt:
        console.print("[yellow]mori demo: interrupted, shutting down[/yellow]")
        return 130
    except RuntimeError as e:
        console.print(f"[red]mori demo: {e}[/red]")
        return 1


def _introduce(
    args: argparse.Namespace,
    trace: Path,
    config: ReplayConfig,
    console: Console,
) -> None:
    """What is about to run and on which clock (the policies in words follow the results)."""
    reps = f", {args.reps} runs interleaved" if args.reps > 1 else ""
    console.print(
        f"[bold]mori demo[/bold]: {args.replicas} emulated replicas "
        f"({args.gpu_tokens} GPU + {args.host_tokens} host KV tokens each), "
        f"{args.concurrency} agent programs from {trace.name} "
        f"(tokens x{config.token_scale:g}), one fresh stack per policy{reps}"
        f"{'' if args.api == 'openai' else f', over the {args.api} API'}."
    )
    preset = _preset_flags(args)[1]
    console.print(
        f"The replicas are not an engine: they run the cost model of preset {preset} "
        f"(router/sim/model.py, the one `mori sim` runs), so the results show the router "
        f"carrying out the policy on that model. Its prices: {price_summary(get_preset(preset))}.",
        highlight=False,
    )
    trace_s = args.duration * args.time_scale
    console.print(
        f"Time: engines, tool calls and router timers run x{args.time_scale:g} faster than "
        f"real time, so each {args.duration:g} s wall-clock run replays {trace_s:g} s of agent "
        "work; tok/s and TTFT are on that trace clock (what a real-time run would show).",
        highlight=False,
    )


def _demo_policy(
    args: argparse.Namespace,
    policy: str,
    corpus: list[TraceProgram],
    config: ReplayConfig,
    console: Console,
    keep_running: bool,
    label: str = "",
) -> RunResult | None:
    """One policy on a fresh stack (engines matched to it); None if held up until stopped."""
    logs = Path(args.out) / "logs" / policy
    if args.reps > 1:
        logs = logs / f"seed{config.seed}"
    logs.mkdir(parents=True, exist_ok=True)
    stack = Stack(logs, console)
    try:
        router = start_stack(args, policy, stack)
        console.print(f"{label}[bold]{policy}[/bold]: router up at {router} (logs in {logs})")
        result = replay_with_progress(
            corpus, dataclasses.replace(config, endpoint=router), console, show_table=False
        )
        _keep_metrics(router, logs)
        if keep_running:
            _hold(router, stack, console)
            return None
        return result
    finally:
        stack.stop()


def _twins(
    results: list[RunResult],
    args: argparse.Namespace,
    corpus: list[TraceProgram],
    token_scale: float,
    console: Console,
) -> list[dict]:
    """Each run's cell in the simulator (`mori sim`: the cost model the replicas run, the
    router inside the engine). A run well under its twin lost time to the stack's latency
    or to a box that fell behind the compressed clock (bench/results/2026-11-29-time-scale.md),
    not to the policy: the table says so, rather than leaving a reader to guess."""
    twins = []
    preset = _preset_flags(args)[1]  # a preset's name or file: SimConfig takes either
    with console.status("simulating each run's twin"):
        for r in results:
            cfg = SimConfig(
                policy=r.policy,
                preset=preset,
                replicas=args.replicas,
                concurrency=args.concurrency,
                cpu_ratio=args.host_tokens / args.gpu_tokens,
                duration_s=args.duration * args.time_scale,
                token_scale=token_scale,
                seed=r.extra.get("seed", args.seed),
                gpu_tokens=args.gpu_tokens,
            )
            sim = simulate(corpus, cfg).output_tok_s
            live = r.output_tok_s / sim if sim > 0 else 0.0
            twins.append(
                {"policy": r.policy, "seed": cfg.seed, "output_tok_s": sim, "live_over_sim": live}
            )
    table = Table(title="each run against the simulator on its cell (out tok/s)")
    for column in ("policy", "seed", "live", "simulated", "live / sim"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for r, twin in zip(results, twins, strict=True):
        table.add_row(r.policy, str(twin["seed"]), f"{r.output_tok_s:.1f}",
                      f"{twin['output_tok_s']:.1f}", f"{twin['live_over_sim']:.2f}")  # fmt: skip
    console.print(table)
    if any(t["live_over_sim"] < SLOW_RUN for t in twins):
        console.print(
            f"[yellow]a run made under {SLOW_RUN:.0%} of its simulated tokens: at x"
            f"{args.time_scale:g} the machine's latency weighs on the results (more on a "
            "policy that gates at the router, as MORI does); --time-scale 2.5 halves it[/yellow]"
        )
    return twins


def _keep_metrics(router: str, logs: Path) -> None:
    """The router's /metrics at the end of the run, beside its log: its own costs (tick
    time, hint acknowledgement waits, gate waits) read after the stack is gone."""
    with contextlib.suppress(httpx.HTTPError):
        (logs / "router-metrics.txt").write_text(httpx.get(f"{router}/metrics", timeout=10).text)


def _hold(router: str, stack: Stack, console: Console) -> None:
    """--keep-running: print the URLs and wait until Ctrl-C or a server exits."""
    console.print(f"\nrouter: {router}/v1 (metrics {router}/metrics, {router}/v1/programs)")
    for name, url in stack.urls.items():
        if name != "router":
            console.print(f"{name}: {url} ({url}/mori/residency)")
    console.print(f"logs: {stack.logs}; the stack stays up until Ctrl-C")
    while all(p.poll() is None for _, p in stack.procs):
        time.sleep(1.0)
    console.print("[red]a server of the stack exited; shutting down[/red]")


def _report(
    results: list[RunResult],
    args: argparse.Namespace,
    trace: Path,
    corpus: list[TraceProgram],
    token_scale: float,
    console: Console,
) -> None:
    """The policies side by side, MORI's ratios, each run beside its simulated twin, and
    the JSON/CSV/plots."""
    print_results(console, results, trace.name, args.wide)  # the table adds cell and runs
    twins = _twins(results, args, corpus, token_scale, console)
    meta = {
        "trace": str(trace),
        "reps": args.reps,
        "seeds": sorted({r.extra.get("seed") for r in results}),
        "time_scale": args.time_scale,
        "api": args.api,
        "wall_s_per_run": args.duration,
        "replicas": args.replicas,
        "gpu_tokens": args.gpu_tokens,
        "host_tokens": args.host_tokens,
        "simulated": twins,
    }
    plots_title = f"mori demo: {trace.name}"
    for path in write_reports(results, Path(args.out) / "demo.json", plots_title, meta):
        console.print(f"wrote {path}")
