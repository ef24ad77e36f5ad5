"""Active/standby failover under load: kill -9 the active router mid-replay, against the same
replay without a kill.

Two emulated replicas, two `mori serve --set standby=true` routers, HAProxy in front with the
committed docker/haproxy/ha.cfg, and a closed-loop `mori replay` of the generated corpus
through the proxy (streamed answers, the OpenAI SDK without retries, so every failure is
counted). In the kill run, just before the kill the replicas' own residency says which
replica holds each program's KV; then the primary's whole process group gets SIGKILL.
Reported, side by side with the run without a kill (same seed, same corpus order):

- failover: from the kill to the first token of the first request sent after it (what a
  client sees), and the router's own takeover (`mori_takeover_seconds`: the residency
  read, the fencing epoch and the full hint sync on the standby);
- streams in flight at the kill, those it cut (they end with the client's error: HAProxy
  ends them without the chunked body's last chunk) and the longest time from the kill to
  the end of any of them (no hang);
- requests that failed after the kill, before and after the takeover;
- KV affinity: of the programs the replicas held at the kill, the share whose next
  request went to the replica that held their KV, and the prompt share those requests found
  cached (from the replicas' own usage reports) before the kill and after it;
- throughput (output tokens per trace second) of each run, and their ratio.

    python bench/failover.py                       # both runs, about 2 x 50 s
    python bench/failover.py --duration 60 --kill-at 20 --json out/failover.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router.demo import pick_trace  # noqa: E402
from router.replay.client import Replay, ReplayConfig  # noqa: E402
from router.replay.records import StepRecord  # noqa: E402
from router.replay.trace import load_trace  # noqa: E402
from tests.proxy_harness import Pair, ha_pair  # noqa: E402
from tests.router_harness import emulators  # noqa: E402

HIT_WINDOW_S = 5.0  # wall seconds before / after the kill for the cached-share comparison


@dataclass
class Outcome:
    """One run's figures (times in wall seconds)."""

    kill: bool
    output_tok_s: float
    steps: int
    failed: int
    errors: dict[str, int]
    facts: dict[str, Any] = field(default_factory=dict)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=40.0, help="wall seconds per run")
    parser.add_argument("--kill-at", type=float, default=15.0, help="wall seconds into the run")
    parser.add_argument("--concurrency", type=int, default=20, help="closed-loop programs")
    parser.add_argument("--time-scale", type=float, default=5.0)
    parser.add_argument("--token-scale", type=float, default=0.25)
    parser.add_argument("--gpu-tokens", type=int, default=40000, help="per replica")
    parser.add_argument("--host-tokens", type=int, default=80000, help="per replica")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", default="kill,none", help="kill, none, or both (in order)")
    parser.add_argument("--logs", default="out/failover", help="the servers' logs")
    parser.add_argument("--json", help="write the figures here")
    return parser.parse_args(argv)


Check = Callable[[Pair, list[str], "Outcome"], None]


def run_once(args: argparse.Namespace, kill: bool, check: Check | None = None) -> Outcome:
    """One replay through the pair; with `kill`, the primary is killed at `kill_at`.
    `check(pair, replicas, outcome)` runs after the replay, before the stack stops."""
    trace, scale = pick_trace(None, args.token_scale)
    logs = Path(args.logs) / ("kill" if kill else "none")
    logs.mkdir(parents=True, exist_ok=True)
    emu = ["--time-scale", str(args.time_scale), "--gpu-tokens", str(args.gpu_tokens)]
    emu += ["--host-tokens", str(args.host_tokens)]
    settings = {"time_scale": args.time_scale, "tick_s": 5.0, "hint_sync_s": 30.0}
    settings |= {"gate_timeout_s": 300.0, "request_timeout_s": 600.0}  # trace seconds
    with emulators(2, *emu) as replicas, ha_pair(replicas, logs, **settings) as pair:
        config = ReplayConfig(
            endpoint=pair.proxy,
            concurrency=args.concurrency,
            duration_s=args.duration,
            time_scale=args.time_scale,
            token_scale=scale,
            seed=args.seed,
        )
        run = Replay(load_trace(trace), config)
        outcome = asyncio.run(_replay(run, pair, replicas, args.kill_at if kill else None))
        outcome.facts["takeover_s"] = {
            name: _metric(url, "mori_takeover_seconds_sum")
            for name, url in (("primary", pair.primary), ("standby", pair.standby))
            if not (kill and name == "primary")
        }
        if check is not None:
            check(pair, replicas, outcome)
    return outcome


async def _replay(run: Replay, pair: Pair, replicas: list[str], kill_at: float | None) -> Outcome:
    killed: dict[str, Any] = {}

    async def killer() -> None:
        await asyncio.sleep(kill_at)
        killed["held"] = await _holders(replicas)
        killed["epoch"] = (await _get(pair.primary + "/health"))["epoch"]
        killed["at"] = run.now()
        pair.kill("primary")

    task = asyncio.create_task(killer()) if kill_at is not None else None
    result = await run.run()
    if task is not None:
        await task
    outcome = Outcome(
        kill=kill_at is not None,
        output_tok_s=result.output_tok_s,
        steps=len(run.records),
        failed=sum(not r.ok for r in run.records),
        errors=dict(run.progress.errors),
    )
    if killed:
        outcome.facts = _across_the_kill(run.records, killed, run.config.time_scale)
    return outcome


async def _get(url: str) -> Any:
    async with httpx.AsyncClient(timeout=5) as http:
        return (await http.get(url)).json()


async def _holders(replicas: list[str]) -> dict[str, tuple[str, str]]:
    """program -> (the replica holding most of its tokens, its hint there), from the
    replicas' own residency."""
    best: dict[str, tuple[int, str, str]] = {}
    for url in replicas:
        for pid, row in (await _get(url + "/mori/residency"))["programs"].items():
            tokens = row["device_tokens"] + row["host_tokens"]
            if tokens > 0 and tokens > best.get(pid, (0, "", ""))[0]:
                best[pid] = (tokens, url, row["hint"])
    return {pid: (url, hint) for pid, (_, url, hint) in best.items()}


def _across_the_kill(records: list[StepRecord], killed: dict, scale: float) -> dict[str, Any]:
    """The kill run's figures from the client's records (trace clock -> wall seconds)."""
    at = killed["at"]
    after = sorted((r for r in records if r.arrival_s >= at), key=lambda r: r.arrival_s)
    served = [r for r in after if r.ok]
    first = min((r.first_token_s for r in served), default=float("nan"))
    takeover_at = min((r.arrival_s for r in served), default=float("inf"))
    cut = [r for r in records if r.arrival_s < at < r.finish_s]
    cut_failed = [r for r in cut if not r.ok]
    next_step: dict[str, StepRecord] = {}
    for r in served:
        next_step.setdefault(r.program_id, r)
    held = {p: v for p, v in killed["held"].items() if p in next_step}
    kept = [p for p, (url, _) in held.items() if next_step[p].replica == url]
    hits = [p for p in kept if next_step[p].cached_device + next_step[p].cached_host > 0]
    window = HIT_WINDOW_S * scale
    return {
        "failover_s": (first - at) / scale,
        "in_flight_at_kill": len(cut),
        "cut_by_the_kill": len(cut_failed),  # ended with the client's error
        "in_flight_ended_within_s": max(((r.finish_s - at) / scale for r in cut), default=0),
        "failed_before_takeover": sum(not r.ok for r in after if r.arrival_s < takeover_at),
        "failed_after_takeover": sum(not r.ok for r in after if r.arrival_s >= takeover_at),
        "programs_held": len(held),
        "held_by_hint": _count(hint for _, hint in held.values()),
        "next_on_holder": len(kept),
        "next_on_holder_with_hit": len(hits),
        "affinity": len(hits) / len(held) if held else float("nan"),
        "cached_share_before": _cached_share(records, at - window, at),
        "cached_share_next": _cached_share([next_step[p] for p in held], at, float("inf")),
        "old_epoch": killed["epoch"],
    }


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def _cached_share(records: list[StepRecord], start: float, end: float) -> float:
    """Cached prompt tokens / prompt tokens of the ok steps that finished in [start, end)."""
    rows = [r for r in records if r.ok and start <= r.finish_s < end]
    prompt = sum(r.input_tokens for r in rows)
    return sum(r.cached_device + r.cached_host for r in rows) / prompt if prompt else 0.0


def _metric(base: str, sample: str) -> float:
    text = httpx.get(base + "/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample:
                return s.value
    return 0.0


def report(outcomes: list[Outcome]) -> str:
    """The figures as markdown tables."""
    lines = ["| run | output tok/s | steps | failed | errors |", "|---|---|---|---|---|"]
    for o in outcomes:
        name = "kill -9 of the active router" if o.kill else "no kill"
        errors = ", ".join(f"{k}: {v}" for k, v in o.errors.items()) or "-"
        lines.append(f"| {name} | {o.output_tok_s:.1f} | {o.steps} | {o.failed} | {errors} |")
    runs = {o.kill: o for o in outcomes}
    if True in runs and False in runs:
        ratio = runs[True].output_tok_s / runs[False].output_tok_s
        lines.append(f"\nthroughput across the kill / without a kill: **{ratio:.3f}**")
    for o in outcomes:
        lines += ["", f"{'kill' if o.kill else 'no kill'}:", "", "| figure | value |", "|---|---|"]
        lines += [f"| {k} | {_fmt(v)} |" for k, v in o.facts.items()]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items())
    return str(value)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    outcomes = []
    for name in args.runs.split(","):
        started = time.monotonic()
        outcomes.append(run_once(args, kill=name.strip() == "kill"))
        print(f"{name}: {time.monotonic() - started:.0f} s", file=sys.stderr)
    print(report(outcomes))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([o.__dict__ for o in outcomes], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
