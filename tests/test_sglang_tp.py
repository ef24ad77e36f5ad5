"""The patch at tensor parallelism 2 on CPU: two scheduler ranks (gloo), each applying every
hint batch at the same point of its loop (and agreeing on the outcome through the cache's
all-reduce): offload and load-back work, and the server keeps serving afterwards (a rank
whose tree diverged would hang the next collective)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import pytest

from tests.sglang.server import REAL_ENGINE, Server, tiny_engine

pytestmark = REAL_ENGINE

PROMPT = 24
FLAGS = ["--tp", "2", "--max-total-tokens", "256", "--hicache-ratio", "2"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    bind = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}  # SGLang's CPU path: one core per rank
    with tiny_engine(tmp_path_factory.mktemp("sglang-tp2"), FLAGS, env=bind) as server:
        yield server


def generate(engine: Server, program: str) -> dict:
    rng = random.Random(program)
    body = {
        "input_ids": [20 + int(program[1:]), *(rng.randrange(30, 300) for _ in range(PROMPT - 1))],
        "session_id": program,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True},
    }
    r = httpx.post(f"{engine.url}/generate", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["meta_info"]


def hints(engine: Server, epoch: int, types: dict[str, str]) -> dict:
    r = httpx.post(f"{engine.url}/mori/hints", json={"epoch": epoch, "hints": types}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["residency"]


def test_offload_and_load_back_at_tp2(engine: Server):
    for p in ("p1", "p2"):
        generate(engine, p)
    offloaded = hints(engine, 1, {"p1": "idle", "p2": "busy"})
    assert offloaded["p1"] == {"device_tokens": 0, "host_tokens": PROMPT}
    assert offloaded["p2"] == {"device_tokens": PROMPT, "host_tokens": PROMPT}
    assert hints(engine, 2, {"p1": "busy"})["p1"]["device_tokens"] == PROMPT
    assert generate(engine, "p1")["cached_tokens_details"] == {"device": PROMPT - 1, "host": 0}
    for i in range(3, 15):  # the pools overflow: eviction and backups on both ranks
        generate(engine, f"p{i}")
    assert hints(engine, 3, {"p3": "idle"})["p3"]["device_tokens"] == 0
    assert generate(engine, "p2")["cached_tokens"] == PROMPT - 1  # still serving, still hits
