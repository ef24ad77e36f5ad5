"""End to end, overload (OpenAI SDK -> `mori serve` -> `mori emulate`): a start the door
cannot let in before the gate's timeout is told at once to come back (429, Retry-After,
`start_deferred`), keeps its place, and is served when it does; the replay client comes
back as told and counts the start's wait from its first attempt, not as a failed step."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from router.replay.client import Replay, ReplayConfig
from router.replay.trace import TraceProgram, TraceStep
from tests.router_harness import assert_clean, chat, client, emulators, metric, programs, router

TICK_S = 0.2
GATE_S = 2.0  # the door refuses a start held 0.8 x this long (REFUSE_AT)


@pytest.fixture(scope="module")
def replica():
    with emulators(1, "--time-scale", "20") as (url,):
        yield {"url": url, "gpu_tokens": 8000, "cpu_tokens": 8000}


def _door_shut_by(c: openai.OpenAI, pid: str) -> None:
    """`pid` ran a step: the door's load limit (set tiny) is passed while it is in flight."""
    c.chat.completions.create(**chat(pid, "in flight " * 50))


def test_a_start_the_door_cannot_let_in_is_told_to_come_back_and_keeps_its_place(replica):
    knobs = {"tick_s": TICK_S, "gate_timeout_s": GATE_S, "door_load": 1e-6}
    with router([replica], **knobs) as base:
        c = client(base)
        _door_shut_by(c, "running")
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as err:
            c.chat.completions.create(**chat("newcomer", "hello"))
        waited = time.monotonic() - started
        assert waited < GATE_S, f"answered after {waited:.1f} s, not before the gate timeout"
        assert err.value.code == "start_deferred"
        headers = err.value.response.headers
        assert float(headers["retry-after"]) >= 1 and int(headers["retry-after-ms"]) >= 1
        view = {p["program_id"]: p for p in programs(base)["data"]}
        assert view["newcomer"]["start_queue_position"] == 0
        assert metric(base, "mori_starts_deferred_total") == 1
        httpx_post_end(base, "running")
        answer = c.chat.completions.create(**chat("newcomer", "hello"))  # it came back
        assert answer.choices[0].message.content
        assert metric(base, "mori_start_wait_seconds_count") == 2  # `running` started too
        assert metric(base, "mori_step_ttft_seconds_count", kind="start") == 2
        assert metric(base, "mori_requests_total", outcome="deferred") == 1
        assert_clean(base)


def httpx_post_end(base: str, pid: str) -> None:
    httpx.post(f"{base}/v1/programs/{pid}/end", timeout=5).raise_for_status()


def test_the_replay_client_comes_back_when_told_and_counts_the_wait_as_the_starts(replica):
    """Two one-step programs, one client at a time each; the second's start is deferred
    while the first is in flight (tiny door load), and is served once the first ends: no
    failed step, one refused start, its wait counted from the first attempt."""
    knobs = {"tick_s": TICK_S, "gate_timeout_s": GATE_S, "door_load": 1e-6}
    steps = (TraceStep(input_tokens=200, output_tokens=4, reused_tokens=0, tool_s=3.0),) * 2
    corpus = [TraceProgram(f"t{i}", steps) for i in range(2)]
    with router([replica], **knobs) as base:
        config = ReplayConfig(base, concurrency=2, duration_s=20.0, programs=2, start_jitter_s=0.0)
        result = asyncio.run(Replay(corpus, config).run())
        assert result.failed_steps == 0
        assert result.refused_starts >= 1
        assert result.start_wait_p99_s > GATE_S * 0.8  # it waited out a refusal at least
        assert_clean(base)


def test_a_deferred_start_over_messages_says_so_in_a_header(replica):
    """Anthropic's error body has no code: the refusal is named by `x-mori-error`, with
    the Retry-After the SDK reads, in an Anthropic-shaped 429 (ids of its own: the
    replica is shared with the tests above, and a new router adopts what it holds)."""
    import anthropic

    knobs = {"tick_s": TICK_S, "gate_timeout_s": GATE_S, "door_load": 1e-6}
    with router([replica], **knobs) as base:
        _door_shut_by(client(base), "running-m")
        messages = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
        with pytest.raises(anthropic.RateLimitError) as err:
            messages.messages.create(
                model="default",
                max_tokens=4,
                messages=[{"role": "user", "content": "hello"}],
                metadata={"user_id": "newcomer-m"},
            )
        headers = err.value.response.headers
        assert headers["x-mori-error"] == "start_deferred" and "retry-after" in headers
        assert err.value.body["error"]["type"] == "rate_limit_error"
        httpx_post_end(base, "running-m")
