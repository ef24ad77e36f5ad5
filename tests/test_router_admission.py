"""End to end, the default policy's admission (OpenAI SDK -> `mori serve` -> `mori emulate`):
idle programs give their room to new ones at once, impossible contexts fail fast, and an
ended program's held request is answered at once."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.router_harness import assert_clean, chat, client, emulators, programs, router

TICK_S = 0.2


def _sized(program_id: str, tokens: int) -> dict:
    """A prompt of about `tokens` tokens that shares nothing with another program's (the
    tiers count a prompt two programs share once, as the engine stores it)."""
    return chat(program_id, f"{program_id} " + "word " * (tokens * 4 // 5))  # ~4 chars a token


@pytest.fixture(scope="module")
def replicas():
    with emulators(2, "--time-scale", "20") as urls:
        yield urls


def test_abandoned_programs_do_not_block_a_new_one(replicas):
    """Four programs take both replicas' GPU tiers and never come back; a new program is
    served within two ticks, not held until its gate timeout."""
    specs = [{"url": u, "gpu_tokens": 5000, "cpu_tokens": 20_000} for u in replicas]
    with router(specs, tick_s=TICK_S, gate_timeout_s=8.0) as base:
        c = client(base)
        for i in range(4):
            c.chat.completions.create(**_sized(f"abandoned-{i}", 2000))
        tiers = {p["program_id"]: p["tier"] for p in programs(base)["data"]}
        assert list(tiers.values()) == ["gpu"] * 4
        started = time.monotonic()
        answer = c.chat.completions.create(**_sized("newcomer", 2000))
        waited = time.monotonic() - started
        assert answer.choices[0].message.content
        assert waited < 2 * TICK_S + 1.0, f"held {waited:.2f} s"
        tiers = {p["program_id"]: p["tier"] for p in programs(base)["data"]}
        assert tiers["newcomer"] == "gpu" and "cpu" in tiers.values()
        assert_clean(base)


def test_context_larger_than_every_replica_fails_fast(replicas):
    specs = [{"url": u, "gpu_tokens": 3000, "cpu_tokens": 6000} for u in replicas]
    with router(specs, tick_s=TICK_S, gate_timeout_s=8.0) as base:
        started = time.monotonic()
        with pytest.raises(openai.BadRequestError) as err:
            client(base).chat.completions.create(**_sized("huge", 8000))
        assert time.monotonic() - started < 2.0
        assert err.value.body["code"] == "context_length_exceeded"
        assert err.value.body["param"] == "messages"
        assert_clean(base)


def test_ending_a_program_answers_its_held_request_at_once():
    """(Its own replica: a router adopts the programs a shared engine still holds.)"""
    with emulators(1, "--time-scale", "20") as (url,):
        spec = {"url": url, "gpu_tokens": 3000, "cpu_tokens": 0}
        with router([spec], tick_s=TICK_S, gate_timeout_s=20.0, policy="mori-paper") as base:
            _end_while_held(base)


def _end_while_held(base: str) -> None:
    c = client(base)
    c.chat.completions.create(**_sized("holder", 2000))
    result: dict = {}

    def held():
        started = time.monotonic()
        try:
            c.chat.completions.create(**_sized("held", 2000))
        except openai.APIStatusError as e:
            result["error"] = e
        result["waited"] = time.monotonic() - started

    worker = threading.Thread(target=held)
    worker.start()
    deadline = time.monotonic() + 5
    while programs(base)["gate"]["waiting"] != 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    httpx.post(base + "/v1/programs/held/end").raise_for_status()
    worker.join(5)
    assert result["error"].status_code == 409 and result["waited"] < 5.0
    assert result["error"].body["code"] == "program_ended"
    assert_clean(base)
