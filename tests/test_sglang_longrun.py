"""Thousands of programs through one patched engine: its per-program state stays bounded.

Each program sends one request sharing a system prefix with every other program, then the
router's way of ending it follows (an `inactive` hint). Without forgetting, the engine would
remember every program it ever saw, and the shared prefix's node every program that ever
matched it (and every eviction decision would walk that set).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import httpx
import pytest

from engine_patches.residency import MAX_NODE_PROGRAMS
from tests.sglang.server import REAL_ENGINE, Server, tiny_engine

pytestmark = REAL_ENGINE

PROGRAMS = 2000
BATCH = 100  # programs per round; each round ends with their `inactive` hints
SYSTEM = [7, 8, 9, 10, 11, 12, 13, 14]  # every program's shared prefix
FLAGS = ["--max-total-tokens", "512", "--hicache-ratio", "2", "--max-running-requests", "16"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with tiny_engine(tmp_path_factory.mktemp("sglang-longrun"), FLAGS) as server:
        yield server


async def _round(http: httpx.AsyncClient, url: str, names: list[str], epoch: int) -> None:
    async def one(program: str) -> None:
        rng = random.Random(program)
        body = {
            "input_ids": SYSTEM + [rng.randrange(30, 300) for _ in range(8)],
            "session_id": program,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        }
        (await http.post(f"{url}/generate", json=body)).raise_for_status()

    await asyncio.gather(*(one(p) for p in names))
    ended = {"epoch": epoch, "hints": dict.fromkeys(names, "inactive")}
    (await http.post(f"{url}/mori/hints", json=ended)).raise_for_status()


async def _run(url: str) -> list[dict]:
    states = []
    limits = httpx.Limits(max_connections=32)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        for start in range(0, PROGRAMS, BATCH):
            names = [f"long-{i}" for i in range(start, start + BATCH)]
            await _round(http, url, names, epoch=start + 1)
            doc = (await http.get(f"{url}/mori/residency")).json()
            states.append({**doc["state"], "listed": len(doc["programs"])})
    return states


def test_engine_state_stays_bounded_over_thousands_of_programs(engine: Server):
    states = asyncio.run(_run(engine.url))
    # The device pool (512 tokens) and host pool (~1024) hold a few dozen 16-token programs:
    # the engine's bookkeeping follows what it holds, not the 2000 programs it has seen.
    held_bound = 1536 // 8
    for state in states:
        assert state["widest_node"] <= MAX_NODE_PROGRAMS, state
        assert state["programs"] <= held_bound and state["hinted"] <= held_bound, state
        assert state["listed"] <= held_bound and state["nodes"] <= held_bound, state
    assert len(states) == PROGRAMS // BATCH
