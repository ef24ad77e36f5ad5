"""Instructions per event and per tick (valgrind's callgrind): tick_bench's load, counted.

    python bench/tick_instructions.py                          # this tree, 10 ticks
    python bench/tick_instructions.py --held --ticks 30         # + requests held
    python bench/tick_instructions.py --trees /tmp/parent .     # A/B: each tree's router/

Times on a shared VM move by +-30 % between minutes (bench/results/2026-11-29-event-
instructions.md), so a speed-up of 10 % cannot be told from noise with `tick_bench.py`
alone. The instructions the interpreter executes for the same decisions do not move
(two runs of one tree agree to 0.2 %): this counts them, for the event calls and for each
tick apart, with the same state and churn as `tick_bench.py` (its `build`, `pick`, `play`)
and the digest of every move, so equal digests mean the same decisions. Needs valgrind,
its headers (callgrind.h) and a C compiler; ~2.5 minutes per tree at 10,000 programs
(building the state under valgrind is most of it). A tree is a checkout (or a `git
archive` of one) holding `router/`; this script's own `tick_bench.py` runs against it.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOGGLE_C = """#include <valgrind/callgrind.h>
void toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void dump(void) { CALLGRIND_DUMP_STATS; }
"""


def child(args: argparse.Namespace) -> None:
    """Under callgrind: count the event calls and each tick, each section its own dump."""
    sys.path.insert(0, str(Path(args.tree).resolve()))
    import router.policy  # noqa: F401  the tree's, imported before tick_bench adds this one's

    sys.path.insert(1, str(HERE))
    import tick_bench as tb

    assert Path(router.policy.__file__).is_relative_to(Path(args.tree).resolve())

    lib = ctypes.CDLL(args.lib)
    knobs = tb.HELD if args.held else None
    policy, rng = tb.build("mori", args.programs, args.replicas, args.seed, knobs)
    made: list = []
    events = 0
    for i in range(args.ticks):
        now = tb.T0 + i * policy.config.tick_s
        picked = tb.pick(policy, rng, max(2, args.programs // 100))
        lib.toggle()
        events += tb.play(policy, picked, now, made)
        lib.toggle()
        lib.dump()
        policy.hint_updates()
        lib.toggle()
        made.append(policy.tick(now + policy.config.tick_s))
        lib.toggle()
        lib.dump()
    digest = hashlib.blake2b(digest_size=6)
    for batch in made:
        digest.update(
            repr([(m.program_id, str(m.src), str(m.dst), m.reason) for m in batch]).encode()
        )
    print(f"events {events} digest {digest.hexdigest()}")


def totals(out_dir: Path) -> list[int]:
    """Instructions of each dump, in dump order."""
    dumps = sorted(out_dir.glob("cg.out.*"), key=lambda f: int(f.suffix[1:]))
    counts = []
    for dump in dumps:
        for line in dump.read_text().splitlines():
            if line.startswith(("summary:", "totals:")):
                counts.append(int(line.split()[1]))
                break
    return counts


def count(tree: str, args: argparse.Namespace, lib: Path, work: Path) -> str:
    """One tree under callgrind: a table row."""
    out_dir = Path(tempfile.mkdtemp(dir=work))
    command = [
        "valgrind", "--tool=callgrind", "--collect-atstart=no",
        f"--callgrind-out-file={out_dir / 'cg.out'}",
        sys.executable, __file__, "--child", "--tree", tree, "--lib", str(lib),
        "--programs", str(args.programs), "--replicas", str(args.replicas),
        "--ticks", str(args.ticks), "--seed", str(args.seed), *(["--held"] if args.held else []),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONHASHSEED": "0"}  # the PATH `main` found valgrind on; a fixed hash
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: callgrind run failed:\n{done.stderr[-2000:]}")
    words = done.stdout.split()
    events, digest = int(words[words.index("events") + 1]), words[words.index("digest") + 1]
    counts = totals(out_dir)
    ev, ticks = counts[0::2], counts[1::2]
    return (
        f"| {tree} | {events} | {sum(ev) / events / 1e3:.1f} | "
        f"{sum(ticks) / len(ticks) / 1e6:.2f} | {max(ticks) / 1e6:.2f} | {digest} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", default=[str(HERE.parent)])
    parser.add_argument("--programs", type=int, default=10_000)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--ticks", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--held", action="store_true", help="no priced move pays (tick_bench)")
    parser.add_argument("--jobs", type=int, default=2, help="trees counted at once")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--lib", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    missing = [tool for tool in ("valgrind", "cc") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"tick_instructions needs {' and '.join(missing)} on PATH")
    with tempfile.TemporaryDirectory() as work:
        lib = Path(work) / "toggle.so"
        source = Path(work) / "toggle.c"
        source.write_text(TOGGLE_C)
        built = subprocess.run(
            ["cc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(source)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if built.returncode != 0:
            raise SystemExit(
                f"cannot build the callgrind toggle (valgrind headers?):\n{built.stderr}"
            )
        load = f"{args.programs} programs x {args.replicas} replicas, {args.ticks} ticks"
        print(f"tick_bench's load, {load}{' (held)' if args.held else ''}: instructions")
        with ThreadPoolExecutor(args.jobs) as pool:  # each tree a valgrind process
            rows = list(pool.map(lambda tree: count(tree, args, lib, Path(work)), args.trees))
        print("\n| tree | events | k instr / event | M instr / tick, mean | max | digest |")
        print("|---|---:|---:|---:|---:|---|")
        print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
