"""CacheSage's survival scores in a real SGLang on CPU, either line (MORI_SGLANG_VERSION;
engine_patches/anchor_scores.py through sglang_common): a predicted role's anchor survives
the pressure that evicts it under plain (typed) LRU.

One patched server runs the same sequence twice, its cache flushed between: the first
time it is not told the agents' survival scores with the hints, the second time it is. Two
roles, A and B, each have two programs whose prompts start with the role's 40-token anchor
(so the radix tree holds it once, shared); A's programs run first (A's anchor is the older
one). Every A/B program is then typed inactive, and unhinted (busy) programs push the
device pool over: their private tails go first, then one anchor. Plain LRU drops A's
anchor; with A scored 0.9 and B 0.1, B's goes. A stale batch's scores are ignored like its
hints.
"""

from __future__ import annotations

import random
from pathlib import Path

import httpx

from tests.sglang.server import REAL_ENGINE, Server, tiny_engine

pytestmark = REAL_ENGINE

FLAGS = [
    "--max-total-tokens", "256",
    "--hicache-ratio", "2",
    "--max-running-requests", "2",
    "--chunked-prefill-size", "128",
]  # fmt: skip
ANCHOR = {"A": list(range(20, 60)), "B": list(range(60, 100))}  # the tiny model: 512 ids
PROGRAMS = {"a1": "A", "a2": "A", "b1": "B", "b2": "B"}


def prompt(program: str) -> list[int]:
    if program in PROGRAMS:
        tail = 100 + 10 * list(PROGRAMS).index(program)
        return ANCHOR[PROGRAMS[program]] + list(range(tail, tail + 8))
    rng = random.Random(program)  # a 40-token prompt no one shares (distinct first token)
    return [150 + int(program[1:]), *(rng.randrange(170, 399) for _ in range(39))]


def generate(server: Server, program: str) -> dict:
    return server.generate(program, prompt(program), timeout=120)


def residency(server: Server) -> dict:
    view = server.residency()
    assert "programs" in view, view
    return view


def on_device(server: Server) -> dict[str, int]:
    programs = residency(server)["programs"]
    return {p: programs.get(p, {}).get("device_tokens", 0) for p in PROGRAMS}


def first_anchor_lost(server: Server) -> str:
    """Run busy programs until one role's anchor left the device; that role (the other
    role's programs still hold their whole anchor on device then)."""
    anchor = len(ANCHOR["A"])
    for n in range(12):
        generate(server, f"x{n}")
        device = on_device(server)
        gone = {PROGRAMS[p] for p, tokens in device.items() if tokens < anchor}
        if gone:
            assert len(gone) == 1, device  # one anchor at a time
            kept = [t for p, t in device.items() if PROGRAMS[p] not in gone]
            assert min(kept) >= anchor, device
            return gone.pop()
    raise AssertionError(f"no anchor left the device: {on_device(server)}")


def test_a_predicted_anchor_survives_pressure_that_evicts_it_under_lru(tmp_path: Path):
    with tiny_engine(tmp_path, FLAGS) as server:
        load(server)
        inactive = dict.fromkeys(PROGRAMS, "inactive")
        server.push_hints({"epoch": 1, "hints": inactive, "agents": PROGRAMS})
        assert residency(server)["anchor_scores"] == {}
        assert first_anchor_lost(server) == "A"  # typed LRU: the older anchor goes first

        server.flush()  # the same sequence again, now with the roles' scores
        assert not any(on_device(server).values()), on_device(server)
        load(server)
        answer = server.push_hints(
            {"epoch": 2, "hints": inactive, "agents": PROGRAMS, "scores": {"A": 0.9, "B": 0.1}},
        )
        assert set(answer["residency"]) == set(PROGRAMS)
        assert residency(server)["anchor_scores"] == {"A": 0.9, "B": 0.1}
        stale = server.push_hints({"epoch": 0, "hints": {}, "scores": {"A": 0.0, "B": 1.0}})
        assert stale["stale"] and residency(server)["anchor_scores"] == {"A": 0.9, "B": 0.1}
        assert residency(server)["state"]["agents"] == len(PROGRAMS)
        bad = httpx.post(
            f"{server.url}/mori/hints", json={"epoch": 3, "hints": {}, "scores": {"A": 2}}
        )
        assert bad.status_code == 400 and "scores" in bad.json()["error"]["message"]
        assert first_anchor_lost(server) == "B"  # A is predicted: B's anchor goes instead


def load(server: Server) -> None:
    """A's programs first (A's anchor is the older one), every one whole on device."""
    for program in PROGRAMS:
        generate(server, program)
    device = on_device(server)
    assert all(tokens >= 48 for tokens in device.values()), device
