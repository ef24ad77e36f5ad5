"""Cost of one rebalance tick at scale, per policy.

    python bench/tick_bench.py                       # 1 000 and 10 000 programs, 8 replicas
    python bench/tick_bench.py --programs 10000 --ticks 100 --policies mori
    python bench/tick_bench.py --programs 10000 --policies mori --held   # + requests held
    python bench/tick_bench.py --write bench/results/2026-11-22-tick.md

Targets (docs/policy.md, "Cost at scale"): at 10 000 programs over 8 replicas, MORI's tick
<= 5 ms p99 and one arrival or response <= 30 us, with and without requests held at the gate.

The state is a realistic mix under pressure: contexts of 2k-64k tokens (log-uniform),
GPU and CPU budgets each about a third of all context (so a third of the programs sit in
WAITING), 10 % of programs REASONING, 5 % with a request held at the gate, heavy-tailed
tool calls. Between ticks about 1 % of programs answer (with grown context) or send their
next request, so every tick has real work: moves, swaps, promotions, lease checks.
Only the `tick` call is timed (and, apart, the event calls between ticks).

With it MORI admits every request at its arrival (its priced moves pay), so no request is
held at a tick. `--held` also runs each policy with no priced move paying
(`displace_margin=1e6`), the load under which ~500 requests wait at every tick: the cost
of the paper's passes over held requests (rows `NAME/held`).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from router.policy import PolicyConfig, make_policy  # noqa: E402
from router.policy.base import Policy  # noqa: E402
from router.policy.types import Move, ReplicaCapacity, Status, Tier  # noqa: E402

TARGET_MS = 5.0  # tick p99
HELD = {"displace_margin": 1e6}  # `--held`: no priced move pays, requests stay held
T0 = 10_000.0  # the clock when measured ticks start; histories happen before it


def _tokens(rng: random.Random) -> int:
    return int(2048 * 32 ** rng.random())  # log-uniform 2k..64k


def _tool_s(rng: random.Random) -> float:
    return rng.choice((0.2, 0.5, 1.0, 3.0)) if rng.random() < 0.8 else rng.uniform(10, 300)


def build(
    name: str, programs: int, replicas: int, seed: int, knobs: dict | None = None
) -> tuple[Policy, random.Random]:
    """Every program runs 1-4 cycles on roomy replicas, then budgets shrink to pressure."""
    rng = random.Random(seed)
    policy = make_policy(name, PolicyConfig(**{"lease_s": 3600.0, **(knobs or {})}))
    names = [f"r{i}" for i in range(replicas)]
    for r in names:
        policy.add_replica(r, ReplicaCapacity(2**40, 2**40))
    for i in range(programs):
        pid, tokens = f"p{i}", _tokens(rng)
        t = T0 - rng.uniform(60, 1200)
        for _ in range(rng.randint(1, 4)):
            policy.on_request(pid, t, tokens)
            t += rng.uniform(0.5, 8.0)
            tokens += rng.randint(100, 2000)
            policy.on_response(pid, t, tokens)
            t = min(t + _tool_s(rng), T0 - 1)
    total = sum(p.context_tokens for p in policy.programs.values())
    for r in names:
        policy.set_capacity(r, ReplicaCapacity(total // (3 * replicas), total // (3 * replicas)))
    policy.tick(T0 - 1)
    acting = [p for p in policy.programs.values() if p.status is Status.ACTING]
    on_gpu = [p for p in acting if p.placement.tier is Tier.GPU]
    off_gpu = [p for p in acting if p.placement.tier is not Tier.GPU]
    for p in rng.sample(on_gpu, min(len(on_gpu), programs // 10)):
        policy.on_request(p.program_id, T0 - 0.5, p.context_tokens + 50)
    for p in rng.sample(off_gpu, min(len(off_gpu), programs // 20)):
        policy.on_request(p.program_id, T0 - 0.5, p.context_tokens + 50)
    policy.hint_updates()
    return policy, rng


Churn = tuple[list, list[int], list]  # programs that answer, their grown contexts, that ask


def pick(policy: Policy, rng: random.Random, events: int) -> Churn:
    """About `events` programs to answer (REASONING) or send their next request (ACTING)."""
    reasoning = [p for p in policy.programs.values() if p.status is Status.REASONING]
    acting = [p for p in policy.programs.values() if p.status is Status.ACTING]
    answers = rng.sample(reasoning, min(len(reasoning), events // 2))
    asks = rng.sample(acting, min(len(acting), events // 2))
    return answers, [p.context_tokens + rng.randint(50, 900) for p in answers], asks


def play(policy: Policy, picked: Churn, start: float, made: list[list[Move]]) -> int:
    """The answers and requests of `picked`, spread over the tick period from `start`; the
    moves they made go to `made`. Returns the number of events."""
    answers, grown, asks = picked
    for k, (p, tokens) in enumerate(zip(answers, grown, strict=True)):
        made.append(policy.on_response(p.program_id, start + k * 1e-3, tokens))
    for k, p in enumerate(asks):
        if p.status is Status.ACTING:
            t = start + 2.0 + k * 1e-3
            made.append(policy.on_request(p.program_id, t, p.context_tokens + 100))
    return len(answers) + len(asks)


def churn(
    policy: Policy, rng: random.Random, start: float, events: int, made: list[list[Move]]
) -> tuple[float, int]:
    """`play` of `pick`: returns the CPU milliseconds the event calls took (admission runs
    there) and their count."""
    picked = pick(policy, rng, events)
    started = time.thread_time_ns()
    count = play(policy, picked, start, made)
    spent = (time.thread_time_ns() - started) / 1e6
    policy.hint_updates()
    return spent, count


def measure(
    name: str, programs: int, replicas: int, ticks: int, seed: int, knobs: dict | None = None
) -> tuple[list[float], list[float], float, float, float, str]:
    """Per tick: wall and CPU (this thread) milliseconds, moves, held requests; plus the
    mean CPU microseconds of one request/response event, and a digest of every move made
    (equal digests: the same decisions). On a shared machine the CPU time is what the tick
    itself costs; the wall time adds whatever else ran."""
    policy, rng = build(name, programs, replicas, seed, knobs)
    tick_s = policy.config.tick_s
    wall, cpu, moves, held, event_ms, events = [], [], 0, 0, 0.0, 0
    made: list[list[Move]] = []
    for i in range(ticks):
        now = T0 + i * tick_s
        spent, count = churn(policy, rng, now, max(2, programs // 100), made)
        event_ms, events = event_ms + spent, events + count
        now += tick_s
        held += len(policy.every_held())
        started, started_cpu = time.perf_counter_ns(), time.thread_time_ns()
        made.append(policy.tick(now))
        cpu.append((time.thread_time_ns() - started_cpu) / 1e6)
        wall.append((time.perf_counter_ns() - started) / 1e6)
        moves += len(made[-1])
    digest = hashlib.blake2b(digest_size=6)
    for batch in made:
        digest.update(
            repr([(m.program_id, str(m.src), str(m.dst), m.reason) for m in batch]).encode()
        )
    return (
        wall,
        cpu,
        moves / ticks,
        held / ticks,
        1000 * event_ms / max(1, events),
        digest.hexdigest(),
    )


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next(
            line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line
        )
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return f"{model}, Python {platform.python_version()}"


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def row(label: str, programs: int, args: argparse.Namespace, knobs: dict) -> list[str]:
    """One table row: `label`'s policy measured on `programs` programs with `knobs`."""
    name = label.removesuffix("/held")
    wall, cpu, moves, held, event_us, digest = measure(
        name, programs, args.replicas, args.ticks, args.seed, knobs
    )
    stats = (percentile(wall, 0.5), percentile(wall, 0.99))
    stats += (percentile(cpu, 0.5), percentile(cpu, 0.99), statistics.fmean(cpu), event_us)
    cells = [label, str(programs), str(args.replicas), str(len(wall)), f"{held:.0f}"]
    cells += [f"{moves:.1f}"] + [f"{v:.2f}" for v in stats]
    return cells + [digest] if args.digest else cells


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, nargs="+", default=[1000, 10_000])
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--ticks", type=int, default=60)
    parser.add_argument("--policies", nargs="+", default=["mori", "ta", "smg"])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--write", type=Path, help="append the table to this markdown file")
    parser.add_argument(
        "--digest", action="store_true",
        help="a digest of every move each run made: equal digests, the same decisions "
        "(a speed-up meant to keep behaviour, checked at scale)",
    )  # fmt: skip
    parser.add_argument(
        "--held", action="store_true",
        help=f"also run each policy with requests held at the gate ({HELD})",
    )  # fmt: skip
    parser.add_argument(
        "--set", dest="settings", nargs="*", default=[], metavar="KNOB=VALUE",
        help="policy knobs, e.g. displace_margin=1000000 (no move pays: requests stay held)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    knobs = {k: yaml.safe_load(v) for k, _, v in (s.partition("=") for s in args.settings)}

    title = f"tick cost, {args.replicas} replicas (target MORI <= {TARGET_MS} ms p99, 30 us/event)"
    table = Table(title=title)
    load = os.getloadavg()[0]
    heads = ("policy", "programs", "replicas", "ticks", "held/tick", "moves/tick")
    heads += ("wall p50 ms", "wall p99 ms", "cpu p50 ms", "cpu p99 ms", "cpu mean ms")
    heads += ("event cpu us",) + (("digest",) if args.digest else ())
    for col in heads:
        table.add_column(col, justify="right")
    rows = []
    cases = [("", knobs)] + ([("/held", {**knobs, **HELD})] if args.held else [])
    for name in args.policies:
        for label, case in cases:
            for n in args.programs:
                rows.append(row(name + label, n, args, case))
                table.add_row(*rows[-1])
    Console(width=170).print(table)
    if args.write:
        command = " ".join(["python bench/tick_bench.py", *(argv if argv else sys.argv[1:])])
        lines = [
            f"## {date.today().isoformat()} - {machine()}",
            "",
            f"`{command}` (1-min load average at start: {load:.1f})",
            "",
            "| " + " | ".join(heads) + " |",
            "|---|" + "---:|" * (len(heads) - 1),
            *("| " + " | ".join(row) + " |" for row in rows),
            "",
        ]
        with args.write.open("a") as fh:
            fh.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
