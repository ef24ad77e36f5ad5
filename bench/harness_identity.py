"""Program identity from harness session headers, live: does the router see the trace's
programs and parents when requests carry only a harness's session header?

    python bench/harness_identity.py                        # Claude sample x0.05, 2 reps
    python bench/harness_identity.py --identities program-id,claude-code --reps 1

Each run gets a fresh stack (the demo's: `mori emulate` replicas behind `mori serve`,
policy mori) and one closed-loop `mori replay` whose requests name their program as
`--identity` says: `program-id` (the body's `program_id`, the parent in X-Parent-Id), or
as a harness does, with no id in the body and only the root program's session header,
shared by its subagents (claude-code: X-Claude-Code-Session-Id, codex: session-id,
opencode: x-opencode-session), or `none`. Runs are interleaved, repetition i with seed
`--seed` + i.

Confusion, counted over the replayed program instances that had an answered request, from
the program id each answer carried (x-mori-program-id) and the router's sessions
(`GET /v1/sessions`): `split` instances the router saw as more than one program,
`merged` router programs that served more than one instance; among roots, `as sub` those
the router filed under a parent; among subagents, `parent ok` those filed under the
router's program of their trace parent, `wrong` under another, `lost` under none.
`program-id` names parents explicitly, so its parent columns are not counted (-). `miss`
is the share of prompt tokens the engines computed afresh: a program the router split or
merged would lose its KV affinity and show there first.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from collections import Counter
from datetime import date
from pathlib import Path

import httpx
from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from router.demo import Stack, start_stack  # noqa: E402
from router.replay.client import IDENTITIES, Replay, ReplayConfig  # noqa: E402
from router.replay.records import RunResult  # noqa: E402
from router.replay.trace import load_trace  # noqa: E402

BASELINE = "program-id"


def confusion(
    routed: dict[str, set[str]], parents: dict[str, str | None], router_parent: dict[str, str]
) -> Counter[str]:
    """How the router's programs match the replayed ones (see the module docstring):
    `routed` maps each instance to the router programs its answers named, `parents` each
    instance to its trace parent's instance, `router_parent` each router program filed
    under a parent to that parent."""
    counts: Counter[str] = Counter(instances=len(routed))
    served: Counter[str] = Counter(pid for ids in routed.values() for pid in ids)
    counts["merged"] = sum(n > 1 for n in served.values())
    counts["router_programs"] = len(served)
    for instance, ids in routed.items():
        if len(ids) != 1:
            counts["split"] += 1
            continue
        (mine,) = ids
        parent = parents.get(instance)
        if parent is None:
            counts["roots"] += 1
            counts["root_as_sub"] += mine in router_parent
            continue
        counts["subagents"] += 1
        expected = routed.get(parent, set())
        got = router_parent.get(mine)
        key = "parent_lost" if got is None else "parent_ok" if {got} == expected else "wrong"
        counts[key] += 1
    return counts


def one_run(args: argparse.Namespace, identity: str, corpus) -> tuple[RunResult, Counter[str]]:
    with tempfile.TemporaryDirectory(prefix="mori-identity-") as logs:
        stack = Stack(Path(logs), Console(stderr=True))
        try:
            router = start_stack(args, "mori", stack)
            config = ReplayConfig(
                endpoint=router,
                concurrency=args.concurrency,
                duration_s=args.duration,
                time_scale=args.time_scale,
                token_scale=args.token_scale,
                seed=args.seed,
                policy_label=identity,
                cpu_ratio=args.host_tokens / args.gpu_tokens,
                identity=identity,
            )
            run = Replay(corpus, config)
            result = asyncio.run(run.run())
            if run.progress.errors:
                print(f"{identity}: failed steps {run.progress.errors}", file=sys.stderr)
            sessions = httpx.get(router + "/v1/sessions", timeout=10).json()["data"]
            under = {sub: s["main"] for s in sessions for sub in s["subagents"]}
            counts = confusion(run.routed, run.parents, under)
            counts["failed"] = result.extra["failed_steps"]
            return result, counts
        finally:
            stack.stop()


def _row(identity: str, result: RunResult, counts: Counter[str], base: float) -> str:
    ratio = result.output_tok_s / base if base else 0.0
    parents = (
        ["-"] * 3
        if identity == BASELINE
        else [str(counts[k]) for k in ("parent_ok", "wrong", "parent_lost")]
    )
    root_as_sub = "-" if identity == BASELINE else str(counts["root_as_sub"])
    cells = [
        identity,
        f"{result.output_tok_s:.1f}",
        f"{ratio:.3f}",
        f"{result.ttft_mean_s:.2f}",
        f"{result.miss:.1%}",
        str(counts["failed"]),
        f"{counts['instances']} / {counts['router_programs']}",
        str(counts["split"]),
        str(counts["merged"]),
        f"{counts['roots']}",
        root_as_sub,
        f"{counts['subagents']}",
        *parents,
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| identity | out tok/s | / program-id | TTFT mean s | miss | failed steps | instances / "
    "router programs | split | merged | roots | as sub | subagents | parent ok | wrong | lost |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--identities", default="program-id,claude-code,codex,opencode")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--duration", type=float, default=45.0, help="wall seconds per run")
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--time-scale", type=float, default=5.0)
    p.add_argument("--gpu-tokens", type=int, default=16000)
    p.add_argument("--host-tokens", type=int, default=32000)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--trace", default=str(ROOT / "traces" / "claude-code-sample.jsonl"))
    p.add_argument("--token-scale", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write", type=Path, help="append the results as Markdown")
    args = p.parse_args(argv)
    identities = [x.strip() for x in args.identities.split(",") if x.strip()]
    unknown = [x for x in identities if x not in IDENTITIES]
    if unknown or BASELINE not in identities:
        p.error(f"--identities: {BASELINE} and any of {', '.join(IDENTITIES)}; got {unknown}")
    console = Console()
    corpus = load_trace(args.trace)
    load = os.getloadavg()[0]
    lines = [
        f"## {date.today().isoformat()} - live, {args.replicas} emulated replicas, policy mori",
        "",
        f"`python bench/harness_identity.py {' '.join(argv or sys.argv[1:])}` "
        f"(1-min load at start {load:.1f}; {Path(args.trace).name} x{args.token_scale:g}, "
        f"{args.concurrency} programs, {args.duration:g} s wall x{args.time_scale:g})",
        "",
        *HEADER,
    ]
    ratios: dict[str, list[float]] = {x: [] for x in identities}
    base_seed = args.seed
    for rep in range(args.reps):
        args.seed = base_seed + rep
        shift = rep % len(identities)  # each identity takes its turn at each position
        rows = {x: one_run(args, x, corpus) for x in identities[shift:] + identities[:shift]}
        rows = {x: rows[x] for x in identities}
        base = rows[BASELINE][0].output_tok_s
        lines.append(f"| **rep {rep + 1}, seed {args.seed}** |" + " |" * 14)
        for identity, (result, counts) in rows.items():
            ratios[identity].append(result.output_tok_s / base if base else 0.0)
            lines.append(_row(identity, result, counts, base))
            console.print(lines[-1], markup=False)
    lines.append("")
    for identity in identities:
        if identity != BASELINE:
            r = ratios[identity]
            lines.append(
                f"- {identity} / program-id: output tok/s {statistics.fmean(r):.3f}x "
                f"({min(r):.3f}-{max(r):.3f} over reps)"
            )
    console.print("\n".join(lines), markup=False)
    if args.write:
        with args.write.open("a") as fh:
            fh.write("\n".join(lines) + "\n\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
