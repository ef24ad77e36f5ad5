"""The Anthropic Messages API end to end: `mori emulate` serves `/v1/messages` as SGLang
0.5.17 does, and the router passes it through with Anthropic-shaped errors, with the
Anthropic SDK as the client (and the OpenAI SDK beside it on the same router)."""

from __future__ import annotations

import os
import signal
import time

import anthropic
import httpx
import pytest

from tests.offload_cycle import residency, run_cycle, sender
from tests.router_harness import assert_clean, chat, client, emulator, metric, programs, router

BASH = {
    "name": "Bash",
    "description": "run a shell command",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
}


def sdk(base: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=30)


def stream(c: anthropic.Anthropic, text: str, user: str, max_tokens: int):
    """A streamed Messages call of program `user` (a context manager over its events)."""
    return c.messages.stream(
        model="m",
        max_tokens=max_tokens,
        messages=[{"role": "user", "content": text}],
        metadata={"user_id": user},
    )


def ask(c: anthropic.Anthropic, text: str, **kwargs):
    messages = kwargs.pop("messages", [{"role": "user", "content": text}])
    return c.messages.create(
        model="m", max_tokens=kwargs.pop("max_tokens", 12), messages=messages, **kwargs
    )


@pytest.fixture(scope="module")
def replica():
    with emulator("--time-scale", "5", "--gpu-tokens", "4000") as (url, _):
        yield url


def test_emulator_answers_messages_like_sglang(replica):
    c = sdk(replica)
    m = ask(c, "word " * 40, system="be brief")
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.content[0].type == "text" and len(m.content[0].text) == 4 * m.usage.output_tokens
    assert m.stop_reason in ("end_turn", "max_tokens")
    first = m.usage.input_tokens
    # the next turn re-sends the history: its prefix is reported as cache reads
    history = [
        {"role": "user", "content": "word " * 40},
        {"role": "assistant", "content": m.content[0].text},
        {"role": "user", "content": "and now?"},
    ]
    again = ask(c, "", messages=history, system="be brief")
    assert again.usage.cache_read_input_tokens >= first
    assert again.usage.input_tokens < first
    assert c.messages.count_tokens(model="m", messages=history, system="be brief").input_tokens > 0


def test_emulator_streams_tool_use_events(replica):
    c = sdk(replica)
    kinds = []
    with c.messages.stream(
        model="m",
        max_tokens=10,
        messages=[{"role": "user", "content": "list the files"}],
        tools=[BASH],
        tool_choice={"type": "any"},
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "ping" not in kinds
    assert final.stop_reason == "tool_use"
    call = final.content[-1]
    assert call.type == "tool_use" and call.name == "Bash" and call.input == {"command": "x"}
    assert final.usage.output_tokens == 10


def test_emulator_errors_are_anthropic_shaped(replica):
    c = sdk(replica)
    with pytest.raises(anthropic.BadRequestError) as bad:
        ask(c, "hi", max_tokens=0)
    assert bad.value.body["type"] == "error"
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError, match="tool"):
        ask(c, "hi", tool_choice={"type": "tool", "name": "nope"}, tools=[BASH])
    r = httpx.post(replica + "/v1/messages", content=b"{oops")
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_both_sdks_through_the_router():
    fast = ("--time-scale", "5")
    with emulator(*fast) as (a, _), emulator(*fast) as (b, _), router([a, b]) as base:
        c = sdk(base)
        m = ask(c, "hello", metadata={"user_id": "anth-1"})
        assert m.content[0].text
        view = httpx.get(base + "/v1/programs/anth-1").json()
        assert view["context_tokens"] == m.usage.input_tokens + m.usage.output_tokens
        with stream(c, "go on", "anth-2", max_tokens=6) as events:
            assert events.get_final_message().usage.output_tokens <= 6
        # the next turn's cached prefix is counted as a hit, and its split stays the
        # router's unless the client asks for it too
        history = [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": m.content[0].text},
            {"role": "user", "content": "and then?"},
        ]
        hits = _hits(base)
        again = ask(c, "", messages=history, metadata={"user_id": "anth-1"})
        assert again.usage.cache_read_input_tokens > 0 and "sglext" not in again.model_extra
        assert _hits(base) - hits == again.usage.cache_read_input_tokens
        details = {"return_cached_tokens_details": True}
        with c.messages.stream(
            model="m", max_tokens=4, messages=history, metadata={"user_id": "anth-1"},
            extra_body=details,
        ) as events:  # fmt: skip
            delta = [e for e in events if e.type == "message_delta"][0]
        split = delta.model_extra["sglext"]["cached_tokens_details"]
        assert split["device"] + split["host"] >= again.usage.cache_read_input_tokens
        with c.messages.stream(
            model="m", max_tokens=4, messages=history, metadata={"user_id": "anth-1"}
        ) as events:  # a cached prefix, no split asked: the router's own is removed
            assert all("sglext" not in (e.model_extra or {}) for e in events)
            assert events.get_final_message().usage.cache_read_input_tokens > 0
        # token counting needs no program: a replica counts, as SGLang does
        counted = c.messages.count_tokens(model="m", messages=history).input_tokens
        assert counted == sdk(a).messages.count_tokens(model="m", messages=history).input_tokens
        with pytest.raises(anthropic.BadRequestError):
            c.messages.count_tokens(model="m", messages="nope")  # type: ignore[arg-type]
        openai_answer = client(base).chat.completions.create(**chat("oai-1"))
        assert openai_answer.choices[0].message.content
        # the router's own errors on /v1/messages are Anthropic-shaped too
        with pytest.raises(anthropic.BadRequestError, match="metadata.user_id"):
            ask(c, "hi", metadata={"user_id": "bad\x00id"})
        with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
            ask(c, "hi", max_tokens=0)
        assert {p["program_id"] for p in programs(base)["data"]} == {
            "anth-1",
            "anth-2",
            "oai-1",
        }
        assert_clean(base)


def _hits(base: str) -> float:
    """Prompt tokens the router counted as found in KV (device and host)."""
    return sum(
        metric(base, "mori_prompt_cache_tokens_total", source=source)
        for source in ("device", "host")
    )


def test_replica_killed_under_anthropic_streams_makes_the_sdk_raise():
    slow = ("--time-scale", "0.05")  # a 16-64 token answer streams for seconds
    with emulator(*slow) as (url_a, proc_a), emulator(*slow) as (url_b, proc_b):
        procs = {url_a: proc_a, url_b: proc_b}
        with router([url_a, url_b]) as base:
            c = sdk(base)
            with stream(c, "tell me a long story", "victim", max_tokens=64) as answer:
                events = iter(answer)
                assert next(events).type == "message_start"
                doomed = httpx.get(base + "/v1/programs/victim").json()["last_replica"]
                os.killpg(procs[doomed].pid, signal.SIGKILL)
                with pytest.raises(anthropic.APIStatusError, match="failed mid-stream"):
                    for _ in events:
                        pass
            assert_clean(base)
            # the program's next step is served by the surviving replica
            assert ask(c, "again", metadata={"user_id": "victim"}).content
            assert httpx.get(base + "/v1/programs/victim").json()["last_replica"] != doomed
            assert_clean(base)


def test_a_messages_program_moves_exactly_as_a_chat_program():
    """Through the router, a program over Messages reaches the engine under the router's
    id, as over chat: moved to the CPU tier, the engine drops its device copy and keeps the
    host copy; moved back, its next step finds its context cached. Nothing else is named on
    the engine, and reconcile adopts nothing (before, the engine named a Messages request
    by its first message: the router's program held nothing, and that name was adopted)."""
    spec = [{"url": "", "gpu_tokens": 2500, "cpu_tokens": 20000}]
    with emulator("--time-scale", "20") as (replica, _):
        spec[0]["url"] = replica
        with router(spec, reconcile_s=0.3) as base:
            cycles = {
                api: run_cycle(
                    base,
                    replica,
                    sender(base, api, 16),
                    f"{api}-a",
                    f"{api}-b",
                    "word " * 800,
                    "other " * 1300,
                )  # fmt: skip
                for api in ("chat", "messages")
            }
            time.sleep(1.0)  # reconcile ran a few times
            assert cycles["messages"] == cycles["chat"]
            offloaded = cycles["chat"].offloaded
            assert offloaded["device_tokens"] == 0 and offloaded["host_tokens"] > 1000, offloaded
            assert cycles["chat"].cached > 1000 and cycles["chat"].back["hint"] == "busy"
            named = {f"{api}-{p}" for api in cycles for p in "ab"}
            assert set(residency(replica)) == named
            assert metric(base, "mori_reconciled_programs_total", kind="adopted") == 0
            assert programs(base)["data"] == []
