"""The live router driving `mori`'s time scheduler: copy cost from the config, policy wake-ups,
tool keys and agent roles from responses, and the tool hooks seen in the admin API."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.config import load_config
from router.owner.api import create_app
from router.owner.controller import Router
from router.policy import PolicyConfig
from router.policy.ladder import MORI
from router.policy.types import ReplicaCapacity
from router.presets import PRESETS
from router.protocol.accounting import AnthropicStream, OpenAIStream, anthropic_body, openai_body
from tests.router_harness import (
    ScriptedReplica,
    assert_clean,
    chat,
    client,
    emulators,
    router,
    serve,
)


def test_load_time_per_token_comes_from_the_config_as_in_the_simulator():
    preset = PRESETS["h100-8b"]
    default = load_config(None, {"replicas": ["http://r:1"]}, env={}).policy_config()
    assert default.load_s_per_token == pytest.approx(
        preset.kv_bytes_per_token / preset.pcie_bytes_s
    )
    moe = PRESETS["b200-70b-tp2"]
    env = {"MORI_KV_BYTES_PER_TOKEN": str(moe.kv_bytes_per_token), "MORI_PCIE_GBPS": "100"}
    tuned = load_config(None, {"replicas": ["http://r:1"]}, env=env).policy_config()
    assert tuned.load_s_per_token == pytest.approx(moe.kv_bytes_per_token / moe.pcie_bytes_s)


# --- wake-ups: the controller ticks the policy when `next_wakeup` asks -------------------
def _moves(live: Router, reason: str) -> float:
    text = live.metrics.render().decode()
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "mori_moves_total" and s.labels.get("reason") == reason
    )


async def test_predicted_load_back_runs_on_a_wakeup_between_ticks():
    """A offloads at tool start for gated B; once B is gone, A's KV is loaded back just
    before its predicted tool end. The router's tick loop is 10 minutes, so only the
    policy's wake-up can do it, and it must not spin while it waits."""
    url = "http://127.0.0.1:9"  # never contacted: the test drives the policy events itself
    config = load_config(None, {"replicas": [url], "tick_s": 600}, env={})
    # the time scheduler alone (priced displacement off: B would move A at once; the door
    # open: A's expected growth alone would fill this tiny replica and keep B out)
    policy = MORI(
        PolicyConfig(tick_s=0.2, predict_lead_s=1.5, displace_margin=1e9, door_load=100.0)
    )
    ticks: list[float] = []
    tick = policy.tick
    policy.tick = lambda now: ticks.append(now) or tick(now)  # count, then run for real
    live = Router(config, policy=policy)
    policy.add_replica(url, ReplicaCapacity(3000, 10_000))
    try:
        now = live.clock()
        live.apply(policy.on_request("A", now, 2000))
        assert policy.route("A") == url
        live.apply(policy.on_response("A", now, 2000))
        live.apply(policy.on_request("B", now, 2000))
        assert policy.route("B") is None  # no room: B waits at the gate

        started = live.clock()
        live.apply(policy.on_tool_start("A", started, "Read", predict_s=4.0))  # 2.25 s
        assert policy.describe("A", started)["tier"] == "cpu" and policy.route("B") == url
        live.apply(policy.on_response("B", live.clock(), 2000))
        live.end_program("B")
        assert policy.describe("A", live.clock())["tier"] == "cpu"  # not due yet

        due = started + 2.25 - policy.timed.load_s(policy.programs["A"]) - 1.5
        while policy.describe("A", live.clock())["tier"] == "cpu":
            assert live.clock() < due + 2.0, "no wake-up promoted A"
            await asyncio.sleep(0.01)
        assert live.clock() >= due - 0.01
        assert _moves(live, "promote_predicted") == 1
        assert 1 <= len(ticks) <= 3  # one timer (maybe re-armed once if it fired early)
    finally:
        await live.stop()


# --- tool keys: what a response ends in, keyed as the predictor keys it ------------------
def _sse(doc: dict) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def test_streamed_parallel_tool_calls_give_the_predictor_key_of_the_longest():
    deltas = [
        {"index": 0, "id": "a", "function": {"name": "Read", "arguments": '{"path": "x"}'}},
        {"index": 1, "id": "b", "function": {"name": "Bash", "arguments": '{"command": "cd'}},
        {"index": 1, "function": {"arguments": ' src && timeout 60 python -m pytest -x"}'}},
    ]
    raw = b"".join(_sse({"choices": [{"index": 0, "delta": {"tool_calls": [d]}}]}) for d in deltas)
    stream = OpenAIStream(client_wants_usage=False)
    for i in range(0, len(raw), 7):
        stream.feed(raw[i : i + 7])
    assert stream.finish().tool == "Bash:pytest"
    plain = OpenAIStream(client_wants_usage=False)
    plain.feed(_sse({"choices": [{"index": 0, "delta": {"content": "done"}}]}))
    assert plain.finish().tool is None  # no tool call: the policy is not told about one


def test_anthropic_tool_use_blocks_give_the_predictor_key():
    blocks = [
        {"type": "text", "text": "let me look"},
        {"type": "tool_use", "id": "t1", "name": "Grep", "input": {"pattern": "x"}},
        {"type": "tool_use", "id": "t2", "name": "Task", "input": {"prompt": "review"}},
    ]
    assert anthropic_body(json.dumps({"content": blocks}).encode()).tool == "Task"
    events = [
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text"}},
        {"type": "content_block_start", "index": 1, "content_block": blocks[1] | {"input": {}}},
        {
            "type": "content_block_start",
            "index": 2,
            "content_block": {"type": "tool_use", "name": "Bash"},
        },
        {
            "type": "content_block_delta",
            "index": 2,
            "delta": {"type": "input_json_delta", "partial_json": '{"command": "make'},
        },
        {
            "type": "content_block_delta",
            "index": 2,
            "delta": {"type": "input_json_delta", "partial_json": ' -j8"}'},
        },
    ]
    stream = AnthropicStream()
    stream.feed(b"".join(b"event: x\n" + _sse(e) for e in events))
    assert stream.finish().tool == "Bash:make"
    one = {"choices": [{"message": {"tool_calls": [{"function": {"name": "Edit"}}]}}]}
    assert openai_body(json.dumps(one).encode()).tool == "Edit"


# --- end to end: OpenAI SDK -> mori serve --policy mori -> mori emulate -----------
BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def predict_base():
    with (
        emulators(1, "--time-scale", "20") as replicas,
        router(replicas, policy="mori") as url,
    ):
        yield url


def test_tool_calls_and_tool_start_reach_the_predictor(predict_base):
    c = client(predict_base)
    call = {"name": "bash", "arguments": {"command": "cd repo && pytest -x tests"}}
    extra = {"agent": "tester", "mori_tool_call": call}
    answer = c.chat.completions.create(**chat("pred-1", extra_body=extra), tools=[BASH_TOOL])
    assert answer.choices[0].finish_reason == "tool_calls"
    view = httpx.get(predict_base + "/v1/programs/pred-1").json()
    assert view["last_tool"] == "bash:pytest" and view["agent"] == "tester"
    assert view["predicted_tool_s"] == 30.0  # cold start of a long shell command
    assert 0 < view["predicted_tool_end_s"] <= 30.0

    hint = {"tool": "bash:pytest", "predict_time": 100}
    r = httpx.post(predict_base + "/v1/programs/pred-1/tool_start", json=hint)
    assert r.status_code == 200
    view = httpx.get(predict_base + "/v1/programs/pred-1").json()
    assert view["predicted_tool_s"] == 65.0  # Tokencake eq. 1: 0.5 * 100 + 0.5 * 30
    assert view["agent"] is None  # this call named no role

    httpx.post(predict_base + "/v1/programs/pred-1/tool_end").raise_for_status()
    assert httpx.get(predict_base + "/v1/programs/pred-1").json()["predicted_tool_end_s"] is None
    role = {"X-Agent-Role": "planner"}
    plain = c.chat.completions.create(**chat("pred-1", "next"), extra_headers=role)
    assert plain.choices[0].finish_reason != "tool_calls"
    view = httpx.get(predict_base + "/v1/programs/pred-1").json()
    assert view["last_tool"] == "bash:pytest" and view["steps"] == 2  # no new tool call
    assert_clean(predict_base)


def test_a_tool_start_that_overtakes_its_answers_report_is_kept():
    """An agent posts `tool_start` as soon as it has read `[DONE]`, while the engine is
    still ending its stream (here for 1 s), so before the owner hears the step is over.
    The tool call must still reach the policy once the step ends, in the program's order
    (without it the policy dropped it: no forecast, moves priced as recomputes)."""
    engine = ScriptedReplica(linger_s=1.0)
    with serve(engine) as url, router([url], policy="mori") as base:
        for step in range(2):
            body = {**chat("early", f"s{step}"), "stream": True}
            with httpx.stream("POST", base + "/v1/chat/completions", json=body) as answer:
                lines = answer.iter_lines()
                while next(lines) != "data: [DONE]":
                    pass
                hint = {"tool": "bash:pytest", "predict_time": 40}
                r = httpx.post(base + "/v1/programs/early/tool_start", json=hint)
                assert r.status_code == 200
                view = httpx.get(base + "/v1/programs/early").json()
                assert view["status"] == "reasoning"  # the engine is still ending its stream
                list(lines)
            time.sleep(0.2)
            view = httpx.get(base + "/v1/programs/early").json()
            assert view["status"] == "acting" and view["last_tool"] == "bash:pytest"
            assert view["predicted_tool_s"] is not None, "the early tool start was dropped"
        assert_clean(base)


def test_agent_role_is_validated_and_stripped_before_forwarding():
    replica = ScriptedReplica()
    with serve(replica) as url, router([url], policy="mori") as base:
        body = {
            "model": "m",
            "max_tokens": 64,
            "agent": "explorer",
            "metadata": {"user_id": "anth-role"},
            "messages": [{"role": "user", "content": "list files"}],
        }
        assert httpx.post(base + "/v1/messages", json=body).status_code == 200
        assert "agent" not in replica.last_body
        view = httpx.get(base + "/v1/programs/anth-role").json()
        assert view["last_tool"] == "Bash:ls" and view["agent"] == "explorer"
        assert view["predicted_tool_s"] == 0.5  # `ls` is a fast shell command

        headed = {**body, "messages": [*body["messages"], {"role": "user", "content": "more"}]}
        del headed["agent"]
        r = httpx.post(base + "/v1/messages", json=headed, headers={"x-agent-role": "reviewer"})
        assert r.status_code == 200
        assert httpx.get(base + "/v1/programs/anth-role").json()["agent"] == "reviewer"

        bad = httpx.post(base + "/v1/messages", json={**body, "agent": 7})
        assert bad.status_code == 400 and bad.json()["type"] == "error"  # Anthropic-shaped
        assert bad.json()["error"]["message"] == "agent must be a string"
        assert_clean(base)


# --- a client that leaves while its body is being read -----------------------------------
async def test_client_gone_mid_body_is_not_an_error(caplog):
    """Replay cancelling in-flight requests at shutdown: the body never completes (the
    owner's endpoints; the data plane's are covered by the test below)."""
    path = "/v1/programs/p-1/tool_start"
    app = create_app(load_config(None, {"replicas": ["http://127.0.0.1:9"]}, env={}))
    messages = [
        {"type": "http.request", "body": b'{"messages": [{"role": "us', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"200")],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }
    with caplog.at_level(logging.DEBUG):
        await app(scope, receive, send)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert sent[0]["status"] == 499  # the server drops it: the client is gone
    live = app.state.router
    assert live.in_flight == 0 and live.gate.waiting == 0 and not live.policy.programs


def test_client_gone_mid_body_leaves_no_trace(tmp_path):
    """The same on the data plane: a client that sends half a body and hangs up is
    dropped quietly (no error logged, nothing created), and the router serves on."""
    log = tmp_path / "router.log"
    with emulators(1) as urls, router(urls, log=log, log_level="info") as base:
        port = int(base.rsplit(":", 1)[1])
        for path in ("/v1/chat/completions", "/v1/programs/p-1/tool_start"):
            with socket.create_connection(("127.0.0.1", port)) as sock:
                head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: 200\r\n"
                sock.sendall(head.encode() + b"content-type: application/json\r\n\r\n")
                sock.sendall(b'{"messages": [{"role": "us')
        client(base).chat.completions.create(**chat("after", "hello"))
        view = assert_clean(base)
        assert [p["program_id"] for p in view["data"]] == ["after"]
    text = log.read_text()
    assert "Traceback" not in text and " ERROR " not in text, text


def test_a_fast_router_reads_tool_durations_on_the_trace_clock():
    """At --time-scale 5 the policy's clock is wall time: a cold-start duration (30 trace
    seconds for a long shell command) and a client's `predict_time` (100 trace seconds)
    both reach it divided by 5, so Tokencake's blend is 0.5 * 20 + 0.5 * 6 wall seconds
    (before, the cold start stayed 30 and the hint 100: the forecasts five times long)."""
    with (
        emulators(1, "--time-scale", "5") as replicas,
        router(replicas, policy="mori", time_scale=5) as base,
    ):
        c = client(base)
        call = {"name": "bash", "arguments": {"command": "pytest -x tests"}}
        c.chat.completions.create(
            **chat("fast-1", extra_body={"mori_tool_call": call}), tools=[BASH_TOOL]
        )
        assert httpx.get(base + "/v1/programs/fast-1").json()["predicted_tool_s"] == 6.0
        hint = {"tool": "bash:pytest", "predict_time": 100}
        httpx.post(base + "/v1/programs/fast-1/tool_start", json=hint).raise_for_status()
        assert httpx.get(base + "/v1/programs/fast-1").json()["predicted_tool_s"] == 13.0
