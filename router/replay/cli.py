"""`mori replay TRACE --endpoint URL`: closed-loop live replay of a trace (MORI 6.1).

Drives N concurrent agent programs against any OpenAI-compatible endpoint (a `mori serve`
router, an SGLang server, `mori emulate`), over chat completions or, with `--api anthropic`,
over Anthropic Messages as Claude Code speaks it, and reports what `mori sim` reports: the
same table, JSON, CSV and plots, so live and simulated cells sit side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
from dataclasses import asdict, fields
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from router.replay.apis import API_NAMES
from router.replay.client import IDENTITIES, Replay, ReplayConfig
from router.replay.records import RunResult, StepRecord
from router.replay.trace import TraceError, TraceProgram, load_trace


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="trace JSONL corpus (traces/*.jsonl)")
    parser.add_argument(
        "--endpoint",
        default="http://127.0.0.1:8000",
        help="API base URL (router, SGLang or emulator; default :8000)",
    )
    add_api_argument(parser)
    parser.add_argument("--concurrency", type=int, default=8, help="closed-loop clients")
    parser.add_argument("--duration", type=float, default=60.0, help="wall seconds to run")
    parser.add_argument(
        "--programs",
        type=int,
        help="stop once this many programs have been replayed (default: run for --duration)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="divide tool sleeps by this (match the emulators' --time-scale)",
    )
    parser.add_argument(
        "--token-scale", type=float, default=1.0, help="multiply every token count of the trace"
    )
    parser.add_argument(
        "--policy-label",
        help="the policy name the result row carries (default: asked of the router)",
    )
    parser.add_argument(
        "--cpu-ratio",
        type=float,
        help="the CPU ratio the result row carries (default: the router's host / GPU budgets)",
    )
    parser.add_argument("--seed", type=int, default=0, help="corpus order and start jitter")
    parser.add_argument("--model", help="model name to request (default: the endpoint's first)")
    parser.add_argument("--api-key", default="none", help="API key for the endpoint")
    parser.add_argument(
        "--identity",
        choices=IDENTITIES,
        default="program-id",
        help="how requests name their program: program-id in the body (default), none (the "
        "router fingerprints the conversation), or a harness's session header shared by a "
        "root program and its subagents, nothing in the body (claude-code: "
        "X-Claude-Code-Session-Id, codex: session-id, opencode: x-opencode-session)",
    )
    parser.add_argument(
        "--json",
        dest="json_out",
        help="write results JSON (+ .csv, steps CSV, plots) (default: none)",
    )
    parser.add_argument(
        "--wide", action="store_true", help="results table with every metric (over 80 columns)"
    )


def add_api_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api",
        choices=API_NAMES,
        default="openai",
        help="wire API: OpenAI chat completions (OpenAI SDK, program id in the body) or "
        "Anthropic Messages (Anthropic SDK, program id in metadata.user_id)",
    )


def write_steps_csv(records: list[StepRecord], path: Path) -> Path:
    """Every measured step, one line each (for looking at what a summary hides)."""
    names = [f.name for f in fields(StepRecord)]
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        writer.writerows(asdict(r) for r in records)
    return path


def replay_with_progress(
    corpus: list[TraceProgram],
    config: ReplayConfig,
    console: Console,
    json_out: str | Path | None = None,
    title: str = "",
    show_table: bool = True,
    wide: bool = False,
) -> RunResult:
    """Run one replay with a progress bar, print its table, write the reports."""
    from router.replay.report import print_results, write_reports

    run = Replay(corpus, config)
    stats = TextColumn("{task.fields[stats]}")
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        stats,
        console=console,
    ) as bar:
        task = bar.add_task(f"{config.concurrency} programs", total=1.0, stats="")

        def tick(fraction: float) -> None:
            p = run.progress
            trace_s = max(fraction * config.duration_s * config.time_scale, 1e-9)
            text = f"{p.steps} steps, {p.output_tokens / trace_s:.0f} out tok/s"
            if p.failed:
                text += f", [red]{p.failed} failed[/red]"
            if p.deferred:
                text += f", {p.deferred} starts deferred"
            bar.update(task, completed=fraction, stats=text)

        result = asyncio.run(run.run(tick))
    if show_table:
        print_results(console, [result], title or f"live replay at {config.endpoint}", wide)
    for error, count in sorted(run.progress.errors.items()):
        console.print(f"[yellow]{count} steps failed: {error}[/yellow]")
    if json_out:
        meta = {"endpoint": config.endpoint, "errors": run.progress.errors}
        paths = write_reports([result], json_out, title, meta)
        paths.append(write_steps_csv(run.records, Path(json_out).with_suffix(".steps.csv")))
        for path in paths:
            console.print(f"wrote {path}")
    return result


def run(args: argparse.Namespace) -> int:
    from router.replay.report import console as report_console

    console = report_console()
    try:
        corpus = load_trace(args.trace)
        config = ReplayConfig(
            endpoint=args.endpoint,
            api=args.api,
            concurrency=args.concurrency,
            duration_s=args.duration,
            programs=args.programs,
            time_scale=args.time_scale,
            token_scale=args.token_scale,
            seed=args.seed,
            policy_label=args.policy_label,
            cpu_ratio=args.cpu_ratio,
            model=args.model,
            api_key=args.api_key,
            identity=args.identity,
        )
    except (TraceError, ValueError) as e:
        console.print(f"[red]mori replay: {e}[/red]")
        return 2
    title = f"{Path(args.trace).name} via {args.endpoint}, {args.duration:g} s wall"
    if args.api != "openai":
        title += f", {args.api} API"
    if args.time_scale != 1.0:
        title += f" x{args.time_scale:g} time"
    try:
        replay_with_progress(corpus, config, console, args.json_out, title, wide=args.wide)
    except ConnectionError as e:
        console.print(f"[red]mori replay: {e}[/red]")
        return 1
    except KeyboardInterrupt:
        console.print("[yellow]mori replay: interrupted[/yellow]")
        return 130
    return 0
