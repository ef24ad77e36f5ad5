"""The engine's own forward timings (`MORI_FORWARD_LOG`, engine_patches/forward_log.py) as
calibration data, and what the cost model prices each of them at.

A probe timed over HTTP sees a forward through the scheduler, the tokenizer, streaming and
the client; a decode probe's window mixes its iterations with whatever else ran. The
engine's log has every forward's mode, sequences, new and cached tokens and its duration:
the very quantities the model's decode iteration and prefill batch are functions of.
`mori calibrate --forward-log PATH` fits the prices to both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from router.sim.model import CostModel


@dataclass(frozen=True, slots=True)
class Forward:
    """One logged forward: a decode iteration or a prefill (extend) batch."""

    start_s: float  # the engine's monotonic clock
    took_s: float
    decode: bool
    reqs: int
    seq: int  # every token the batch's sequences hold
    lens: tuple[tuple[int, int], ...]  # an extend's (new, cached) per sequence

    @classmethod
    def of(cls, line: dict) -> Forward:
        decode = line["mode"] == "DECODE"
        # an extend's sequences; a line without them stands for one sequence (a decode: none)
        lens = line.get("lens") or (
            [] if decode or not line["new"] else [[line["new"], line["prefix"]]]
        )
        return cls(
            start_s=float(line["t0"]),
            took_s=float(line["t1"]) - float(line["t0"]),
            decode=decode,
            reqs=int(line["reqs"]),
            seq=int(line["seq"]),
            lens=tuple((int(n), int(p)) for n, p in lens),
        )


def read_forwards(path: Path) -> list[Forward]:
    """Every forward of a log: `path` itself, or the per-process files `path.<pid>` the
    engine wrote; decode and extend batches only (an idle pass computes nothing)."""
    files = [path] if path.is_file() else sorted(path.parent.glob(f"{path.name}.*"))
    if not files:
        raise ValueError(f"{path}: no forward log (MORI_FORWARD_LOG writes {path}.<pid>)")
    lines = [json.loads(x) for f in files for x in f.read_text().splitlines() if x.strip()]
    forwards = (Forward.of(x) for x in lines)
    return sorted((f for f in forwards if f.decode or f.lens), key=lambda f: f.start_s)


def priced_s(cost: CostModel, forward: Forward) -> float:
    """What the model says this forward takes: a decode iteration at its batch and
    context, or a prefill batch's forwards plus each sequence's new tokens on its prefix,
    sharing chunks as the simulated engine runs them."""
    if forward.decode:
        return cost.decode_step_s(forward.reqs, forward.seq)
    total, offset = cost.forwards_s(sum(n for n, _ in forward.lens)), 0
    for new, cached in forward.lens:
        total += cost.prefill_s(new, cached, offset)
        offset += new
    return total


def log_line(forward: Forward) -> dict:
    """A forward as the engine logs it (`Forward.of` reads it back): a preset file records
    its fit's forwards so that `--refit` fits them again."""
    return {
        "t0": round(forward.start_s, 6),
        "t1": round(forward.start_s + forward.took_s, 6),
        "mode": "DECODE" if forward.decode else "EXTEND",
        "reqs": forward.reqs,
        "new": forward.reqs if forward.decode else sum(n for n, _ in forward.lens),
        "prefix": sum(p for _, p in forward.lens),
        "seq": forward.seq,
        "lens": [list(x) for x in forward.lens],
    }


def tokens_by(forwards: list[Forward], span_s: float) -> int:
    """Output tokens the engine computed within `span_s` of its first forward, requests
    still running then included: one per sequence of a decode iteration, one per prompt a
    prefill batch ends (a prompt chunked over several forwards counts once per chunk: with
    prompts under the chunk size, as in the bench cells, there are none)."""
    if not forwards:
        return 0
    end = forwards[0].start_s + span_s
    done = [f for f in forwards if f.start_s + f.took_s <= end]
    return sum(f.reqs if f.decode else len(f.lens) for f in done)


def forward_speed(cost: CostModel, forwards: list[Forward]) -> dict[str, float]:
    """Measured over priced seconds of the prefill and of the decode forwards (1: the
    prices held; 1.2: the engine ran 20 % slower than priced)."""
    out = {}
    for kind, decode in (("prefill", False), ("decode", True)):
        mine = [f for f in forwards if f.decode == decode]
        priced = sum(priced_s(cost, f) for f in mine)
        if priced > 0:
            out[kind] = sum(f.took_s for f in mine) / priced
    return out
