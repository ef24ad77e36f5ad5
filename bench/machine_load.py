"""How busy the rest of a shared machine is, for timed runs that must not be slowed by it.

On the 2-vCPU box the real-engine runs share, another session's tests or simulations (even
niced) slow SGLang's CPU forward several-fold. `wait_quiet` holds a run back until the
machine is idle enough; `CpuSplit` measures the CPU each part of a run (the engine's
processes, the router, the replay client) and everything outside this process tree used,
so a run taken beside other work is marked in its table and the stack's own share is known.
Linux /proc only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def _busy_share(window_s: float = 2.0) -> float:
    """Share of all CPUs busy over `window_s` (from /proc/stat)."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    total0, idle0 = sample()
    time.sleep(window_s)
    total1, idle1 = sample()
    return 1 - (idle1 - idle0) / max(1, total1 - total0)


def wait_quiet(
    max_wait_s: float, busy_below: float = 0.2, say: Callable[[str], None] = print
) -> float:
    """Wait (up to `max_wait_s`) until under `busy_below` of the CPUs are busy; returns the
    last busy share measured. Call it while nothing of this run is running."""
    deadline = time.monotonic() + max_wait_s
    busy = _busy_share()
    while busy >= busy_below and time.monotonic() < deadline:
        say(f"waiting for the machine to quiet down ({100 * busy:.0f} % busy)")
        time.sleep(10.0)
        busy = _busy_share()
    return busy


def _ticks() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, utime + stime ticks) of every process."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            out[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    return out


# a process of a real-engine run -> its part (first match in its command line or name)
PARTS = (
    ("sglang::scheduler", "engine scheduler"),
    ("sglang::detokenizer", "engine detokenizer"),
    ("engine_patches.launch", "engine HTTP + tokenizer"),
    ("router.plane.worker", "router worker"),
    ("router.cli serve", "router"),
    ("router.cli replay", "replay client"),
)


def _part(pid: int) -> str:
    try:
        text = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        text += " " + Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "other"
    return next((name for key, name in PARTS if key in text), "other")


class CpuSplit:
    """CPU used between start and now, per part of this process's tree (the engine's
    processes, the router, the replay client) and by everything outside it."""

    def __init__(self) -> None:
        self._start = _ticks()
        self._t0 = time.monotonic()

    def cores(self) -> dict[str, float]:
        """Mean CPUs each part kept busy since the start ("others": outside the tree)."""
        now = _ticks()
        mine = {os.getpid()}
        grew = True
        while grew:  # this process's descendants, whatever their depth
            before = len(mine)
            mine |= {pid for pid, (ppid, _) in now.items() if ppid in mine}
            grew = len(mine) > before
        wall = max(1e-9, time.monotonic() - self._t0)
        out: dict[str, float] = {}
        for pid, (_, ticks) in now.items():
            used = (ticks - self._start.get(pid, (0, 0))[1]) * TICK_S / wall
            part = _part(pid) if pid in mine else "others"
            out[part] = out.get(part, 0.0) + used
        return out
