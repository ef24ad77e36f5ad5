"""Cost per call of the agent runtime layer's primitives, CacheSage's in particular.

CacheSage (§4, "Cost") reports ~1 us per observed block touch and single-digit us per
score, with coordinator state under 25 KB at 24 agents. Here the router observes requests
(not block touches: a request stands for all its blocks), so the figures are per request
event, per anchor score, per forecast, and per act (the call the shells make after every
policy event), on a learner fed the supervisor workloads' own speaker sequences.

    python3 bench/runtime_cost.py                      # 6- and 24-agent workloads
    python3 bench/runtime_cost.py --agents 6,12,24 --events 200000
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project first: bench/kernels.py must not shadow `kernels`
from router.policy.cachesage import CacheSage  # noqa: E402
from router.policy.runtime import AgentEvent, EventKind, Item, ItemKind  # noqa: E402

SESSIONS = 8  # live tasks at a time (the multi-agent scenario's concurrency)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", default="6,24", help="agent alphabet sizes, comma list")
    ap.add_argument("--events", type=int, default=100_000, help="request events per size")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


TURNS = 40  # turns per task; then its programs end and a new task takes the slot


def events(agents: int, count: int, rng: random.Random) -> list[AgentEvent]:
    """Supervisor traffic: per task a selector request, then the next role's request (a
    sparse Markov chain: each role hands to one of three successors); a finished task's
    programs end."""
    roles = [f"role{i}" for i in range(agents)]
    succ = {r: rng.sample(roles, 3) for r in roles}
    current = {s: rng.choice(roles) for s in range(SESSIONS)}
    out = []
    for i in range(count // 2):
        s, lap = i % SESSIONS, i // SESSIONS
        task = f"t{s}-{lap // TURNS}"
        nxt = rng.choices(succ[current[s]], weights=[6, 3, 1])[0]
        current[s] = nxt
        out.append(AgentEvent(EventKind.REQUEST, float(i), task, "selector", task, 700))
        out.append(AgentEvent(EventKind.REQUEST, float(i), f"{task}.{nxt}", nxt, task, 1000))
        if lap % TURNS == TURNS - 1:
            out += [AgentEvent(EventKind.END, float(i), f"{task}.{r}") for r in roles]
            out.append(AgentEvent(EventKind.END, float(i), task))
    return out


def per_call_us(fn, args: list) -> float:
    start = time.perf_counter()
    for a in args:
        fn(a)
    return (time.perf_counter() - start) / len(args) * 1e6


def measure(agents: int, count: int, seed: int) -> dict:
    rng = random.Random(seed)
    cs = CacheSage(lambda pid: "r0", lambda: ["r0"])
    stream = events(agents, count, rng)
    observe = per_call_us(cs.observe, stream)
    anchors = [Item(ItemKind.ANCHOR, f"role{rng.randrange(agents)}") for _ in range(20_000)]
    programs = [Item(ItemKind.PROGRAM, e.program_id) for e in stream[-2_000:]] * 10
    cs.act(0.0)
    score = per_call_us(cs.score, anchors)
    odds = per_call_us(cs.score, programs)
    predict = per_call_us(cs.predict, [0.0] * 2_000)

    def act_after_turn(e: AgentEvent) -> None:  # the shells' pattern: an event, then act
        cs.observe(e)
        cs.act(e.now)

    act = per_call_us(act_after_turn, events(agents, 20_000, rng)) - observe
    learner = cs.learner
    return {
        "agents": agents,
        "observe_us": observe,
        "score_anchor_us": score,
        "score_program_us": odds,
        "predict_us": predict,
        "act_us": act,
        "r": learner.r(),
        "active": cs.active,
        "state_kb": learner.state_bytes() / 1024,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = [measure(int(a), args.events, args.seed) for a in args.agents.split(",")]
    table = Table(title=f"CacheSage per call ({args.events:,} request events, {SESSIONS} tasks)")
    for col in (
        "agents",
        "observe us",
        "score anchor us",
        "score program us",
        "predict us",
        "act us",
        "learnt R",
        "state KB",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["agents"]),
            f"{r['observe_us']:.2f}",
            f"{r['score_anchor_us']:.2f}",
            f"{r['score_program_us']:.2f}",
            f"{r['predict_us']:.1f}",
            f"{r['act_us']:.2f}",
            f"{r['r']:.2f}" + ("" if r["active"] else " (inactive)"),
            f"{r['state_kb']:.1f}",
        )
    Console(width=160).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
