"""A run's state over time, live or simulated, in one shape: the differential check's data.

`mori sim` and the live stack (router + emulated replicas) must agree, and where they do
not, end-of-run figures only say *that* they differ. A timeline says where and when: every
few trace seconds, per replica, the GPU and CPU tiers as the router books them and what the
engine itself holds and queues (and how long its queue made requests wait), how many
requests the gate holds and why, the moves so far by reason, and how many acting programs
the policy knows the tool call of.

Both sides build their samples with `sample` from the same inputs: the tokens the tiers
book per replica (`Tiers.used`, which the live router exports as `mori_tier_tokens`; a
segment several programs share counts once), the policy's program views (`Policy.describe`,
served at `/v1/programs`), each engine's usage (`ReplicaEngine.usage` plus its queue stats;
the emulator serves them in `/get_server_info` as `mori_usage`), and the move counts (the
simulator's, or the router's `mori_moves_total`). `compare` reduces two timelines to
per-metric means side by side.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from statistics import fmean
from typing import Any

# Why the gate holds a request, from its program's view (the policy's promotion classes).
HELD_REASONS = ("cpu", "returning", "new")


@dataclass(slots=True)
class Sample:
    """The state at trace time `t`; per-replica lists follow the sorted replica names."""

    t: float
    gpu_tier: list[int] = field(default_factory=list)  # tokens the router books on GPU(r)
    cpu_tier: list[int] = field(default_factory=list)  # ... and on CPU(r)
    device: list[int] = field(default_factory=list)  # tokens the engine holds in HBM
    host: list[int] = field(default_factory=list)  # ... and in host DRAM
    queued: list[int] = field(default_factory=list)  # requests in the engine's queue
    queue_wait_s: list[float] = field(default_factory=list)  # mean wait so far in that queue
    held: dict[str, int] = field(default_factory=dict)  # gate: why -> requests
    acting: int = 0  # programs in a tool call (after at least one step)
    tool_known: int = 0  # ... whose tool call the policy knows
    moves: dict[str, int] = field(default_factory=dict)  # reason -> moves so far

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def held_reason(view: Mapping[str, Any]) -> str:
    """The promotion class a held request waits in: its program's KV on a CPU tier, a
    returning program off every tier, or a new program."""
    if view["tier"] == "cpu":
        return "cpu"
    return "returning" if view["steps"] > 0 else "new"


def sample(
    t: float,
    tiers: Mapping[tuple[str, str], int],
    views: Iterable[Mapping[str, Any]],
    engines: Mapping[str, Mapping[str, Any]],
    moves: Mapping[str, int],
) -> Sample:
    """One sample from the tiers' tokens ((replica, "gpu" | "cpu") -> tokens), program
    views, engine usages (by replica name) and move counts."""
    names = sorted(engines)
    out = Sample(t)
    out.gpu_tier = [int(tiers.get((name, "gpu"), 0)) for name in names]
    out.cpu_tier = [int(tiers.get((name, "cpu"), 0)) for name in names]
    held: Counter[str] = Counter()
    for view in views:
        if view["status"] == "gated":
            held[held_reason(view)] += 1
        elif view["status"] == "acting" and view["steps"] > 0:
            out.acting += 1
            known = view.get("predicted_tool_s", view.get("last_tool"))
            out.tool_known += known is not None
    for name in names:
        usage = engines[name]
        out.device.append(int(usage.get("device_used_tokens", 0)))
        out.host.append(int(usage.get("host_used_tokens", 0)))
        out.queued.append(int(usage.get("queued", 0)))
        admitted = usage.get("admitted", 0)
        out.queue_wait_s.append(usage.get("queue_wait_s", 0.0) / admitted if admitted else 0.0)
    out.held = {reason: held[reason] for reason in HELD_REASONS}
    out.moves = dict(moves)
    return out


@dataclass(frozen=True, slots=True)
class Row:
    """One metric of two timelines: its time means side by side."""

    metric: str
    live: float
    sim: float

    @property
    def ratio(self) -> float:
        return self.live / self.sim if self.sim else float("nan")


def series(timeline: list[Sample]) -> dict[str, list[float]]:
    """Each metric of a timeline as one number per sample (per replica where it has one)."""
    out: dict[str, list[float]] = {}
    for s in timeline:
        values: dict[str, float] = {"acting with a known tool": _share(s.tool_known, s.acting)}
        for name in ("gpu_tier", "cpu_tier", "device", "host", "queued", "queue_wait_s"):
            for i, v in enumerate(getattr(s, name)):
                values[f"{name}[r{i}]"] = v
        for reason, n in s.held.items():
            values[f"held {reason}"] = n
        for key, value in values.items():
            out.setdefault(key, []).append(value)
    return out


def compare(live: list[Sample], sim: list[Sample], end_moves: bool = True) -> list[Row]:
    """Time means of every metric, live beside simulated, plus the moves per reason at the
    end of each run (a run's last sample)."""
    a, b = series(live), series(sim)
    rows = [Row(k, fmean(a[k]) if a[k] else 0.0, fmean(b.get(k) or [0.0])) for k in a]
    if end_moves and live and sim:
        reasons = sorted(set(live[-1].moves) | set(sim[-1].moves))
        rows += [
            Row(f"moves {r}", live[-1].moves.get(r, 0), sim[-1].moves.get(r, 0)) for r in reasons
        ]
    return rows


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0
