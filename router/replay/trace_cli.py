"""`mori trace generate|validate|stats`: make, check and summarise trace corpora."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from router.replay.generators import generate, load_preset
from router.replay.trace import dump_trace, load_trace
from router.replay.trace_stats import CACHESAGE_TARGETS, MORI_TARGETS, Nominal, trace_stats


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    gen = sub.add_parser("generate", help="write a synthetic corpus from a generator preset")
    gen.add_argument("--preset", default="claude-code", help="name in traces/presets or a path")
    gen.add_argument(
        "--programs", type=int, default=200, help="main programs or tasks (plus subagents)"
    )
    gen.add_argument("--seed", type=int, default=0, help="same preset + seed = same corpus")
    gen.add_argument("--out", type=Path, required=True, help="output JSONL file")

    val = sub.add_parser("validate", help="check trace files; exit 1 naming the first defect")
    val.add_argument("files", nargs="+", type=Path)

    stats = sub.add_parser("stats", help="MORI section 3 statistics of trace files, side by side")
    stats.add_argument("files", nargs="+", type=Path)
    stats.add_argument("--threshold", type=float, default=2.0, help="short/long call split (s)")
    stats.add_argument(
        "--ttft-s", type=float, default=Nominal.ttft_s, help="nominal per-step latency (s)"
    )
    stats.add_argument(
        "--decode-tok-s", type=float, default=Nominal.decode_tok_s, help="nominal decode rate"
    )
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    try:
        return {"generate": _generate, "validate": _validate, "stats": _stats}[args.action](args)
    # TraceError and pydantic's ValidationError are ValueErrors: bad input, not a crash.
    except (OSError, ValueError, yaml.YAMLError) as e:
        err.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
        return 1


def _generate(args: argparse.Namespace) -> int:
    if args.programs < 1:
        raise ValueError("--programs must be at least 1")
    preset = load_preset(args.preset)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    dump_trace(generate(preset, args.programs, args.seed), args.out)
    programs = load_trace(args.out)  # what we wrote must pass our own validator
    subagents = sum(p.parent_id is not None for p in programs)
    Console().print(
        f"wrote {len(programs)} programs ({subagents} subagents) to {args.out} "
        f"[dim](preset {preset.name}, seed {args.seed})[/dim]"
    )
    return 0


def _validate(args: argparse.Namespace) -> int:
    console = Console()
    for path in args.files:
        programs = load_trace(path)
        steps = sum(len(p.steps) for p in programs)
        console.print(f"[green]ok[/green] {path}: {len(programs)} programs, {steps} steps")
    return 0


def _stats(args: argparse.Namespace) -> int:
    nominal = Nominal(args.ttft_s, args.decode_tok_s)
    results = {str(p): trace_stats(load_trace(p), args.threshold, nominal) for p in args.files}
    if args.json:
        print(json.dumps({name: asdict(s) for name, s in results.items()}, indent=2))
        return 0
    table = Table(
        title=f"trace stats ({args.threshold:g} s threshold, "
        f"step = {nominal.ttft_s:g} s + out / {nominal.decode_tok_s:g} tok/s)"
    )
    table.add_column("statistic")
    for name in results:
        table.add_column(Path(name).name, justify="right")
    table.add_column("MORI §3 / CacheSage §3.1", justify="right", style="dim")
    columns = [s.rows() for s in results.values()]
    for i, (key, label, _) in enumerate(columns[0]):
        target = MORI_TARGETS.get(key)
        shown = "" if target is None else (f"{target:.0%}" if target < 1 else f"{target:g} s")
        shown = CACHESAGE_TARGETS.get(key, shown)
        table.add_row(label, *(col[i][2] for col in columns), shown)
    Console().print(table)
    return 0
