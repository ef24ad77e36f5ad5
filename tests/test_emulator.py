"""`mori emulate` over HTTP with the OpenAI SDK: answers, usage, caching, hints, aborts, errors."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from router.replay.prompts import count_tokens, render_chat
from tests.servers import free_port, mori, spawn

GPU_TOKENS = 2000
HOST_TOKENS = 4000
USER = [{"role": "user", "content": "x"}]


@pytest.fixture(scope="module")
def emulator():
    port = free_port()
    argv = mori(
        "emulate",
        "--port",
        str(port),
        "--time-scale",
        "5",
        "--gpu-tokens",
        str(GPU_TOKENS),
        "--host-tokens",
        str(HOST_TOKENS),
    )
    with spawn(argv, port):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
def client(emulator):
    return openai.OpenAI(base_url=emulator + "/v1", api_key="none", max_retries=0)


def _ask(client, program: str, messages: list, max_tokens: int, **kw):
    extra = {"ignore_eos": True, "session_id": program, "return_cached_tokens_details": True}
    return client.chat.completions.create(
        model="m",
        messages=messages,
        max_tokens=max_tokens,
        extra_body={**extra, **kw.pop("extra_body", {})},
        **kw,
    )


def _cached(answer) -> tuple[int, int, int]:
    """(cached_tokens, device, host) as SGLang reports them: the split in `sglext`, sent
    only when something was cached."""
    split = (answer.model_extra.get("sglext") or {}).get("cached_tokens_details")
    split = split or {"device": 0, "host": 0}
    details = answer.usage.prompt_tokens_details  # left out when nothing was cached
    return details.cached_tokens if details else 0, split["device"], split["host"]


def test_non_streaming_counts_prompt_and_gives_exact_tokens(client):
    messages = [{"role": "user", "content": "word " * 200}]
    r = _ask(client, "plain", messages, 37)
    assert r.usage.prompt_tokens == count_tokens(render_chat(messages))
    assert r.usage.completion_tokens == 37
    assert len(r.choices[0].message.content) == 37 * 4
    assert r.choices[0].finish_reason == "length"
    assert _cached(r) == (0, 0, 0)


def test_without_ignore_eos_stops_early_under_max_tokens(client):
    messages = [{"role": "user", "content": "short answer please"}]
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=500)
    assert 16 <= r.usage.completion_tokens <= 64
    assert r.choices[0].finish_reason == "stop"


def test_streaming_chunks_and_final_usage(client):
    messages = [{"role": "user", "content": "stream " * 100}]
    stream = _ask(
        client, "streamer", messages, 25, stream=True, stream_options={"include_usage": True}
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert len(text) == 25 * 4
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 25


def test_repeated_prefix_is_cached_on_device(client):
    messages = [{"role": "user", "content": "context " * 150}]
    first = _ask(client, "grower", messages, 10)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "tool result " * 20},
    ]
    second = _ask(client, "grower", messages, 10)
    previous = first.usage.prompt_tokens + first.usage.completion_tokens
    cached, device, host = _cached(second)
    # the whole previous context (prompt + answer, plus the answer's markup) is reused
    assert previous <= cached <= previous + 4
    assert (device, host) == (cached, 0)
    # a different program with the same text does not hit this program's cache
    other = _ask(client, "stranger", messages, 10)
    assert _cached(other)[0] == 0
    assert "sglext" not in other.model_extra  # nothing cached: no split, as in SGLang
    unasked = _ask(
        client, "grower", messages, 10, extra_body={"return_cached_tokens_details": False}
    )
    assert "sglext" not in unasked.model_extra
    assert unasked.usage.prompt_tokens_details.cached_tokens > 0


def test_streamed_split_comes_in_its_own_chunk_before_usage(client):
    messages = [{"role": "user", "content": "split " * 120}]
    first = _ask(client, "splitter", messages, 5)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}]
    stream = _ask(
        client, "splitter", messages, 5, stream=True, stream_options={"include_usage": True}
    )
    tail = [chunk.model_dump(exclude_none=True) for chunk in stream if not chunk.choices]
    assert [sorted(set(c) & {"sglext", "usage"}) for c in tail] == [["sglext"], ["usage"]]
    split = tail[0]["sglext"]["cached_tokens_details"]
    assert (
        split["device"] + split["host"]
        == tail[1]["usage"]["prompt_tokens_details"]["cached_tokens"]
        > 0
    )


def test_evicted_program_loads_back_from_host(emulator, client):
    """Tiny device budget: three programs of 600 tokens push the first one to host."""
    first = [{"role": "user", "content": "alpha " * 380}]
    r = _ask(client, "evict-a", first, 8)
    for name in ("evict-b", "evict-c", "evict-d"):
        _ask(client, name, [{"role": "user", "content": f"{name} " * 300}], 8)
    residency = httpx.get(emulator + "/mori/residency").json()["programs"]["evict-a"]
    assert residency["device_tokens"] < residency["host_tokens"]
    again = first + [{"role": "assistant", "content": r.choices[0].message.content}]
    cached, device, host = _cached(_ask(client, "evict-a", again, 8))
    assert host > 0 and cached == device + host


def test_hints_change_residency(emulator, client):
    _ask(client, "hinted", [{"role": "user", "content": "hint me " * 100}], 10)
    before = httpx.get(emulator + "/mori/residency").json()["programs"]["hinted"]
    assert before["device_tokens"] > 0
    idle = httpx.post(emulator + "/mori/hints", json={"epoch": 100, "hints": {"hinted": "idle"}})
    assert idle.status_code == 200
    assert idle.json()["residency"]["hinted"] == {
        "device_tokens": 0,
        "host_tokens": before["host_tokens"],
    }
    state = httpx.get(emulator + "/mori/residency").json()["programs"]["hinted"]
    assert state["hint"] == "idle"
    busy = httpx.post(emulator + "/mori/hints", json={"epoch": 101, "hints": {"hinted": "busy"}})
    assert busy.json()["residency"]["hinted"]["device_tokens"] == before["host_tokens"]
    stale = httpx.post(emulator + "/mori/hints", json={"epoch": 5, "hints": {"hinted": "idle"}})
    assert stale.json() == {"epoch": 101, "stale": True, "residency": {}}  # the replica's epoch
    after = httpx.get(emulator + "/mori/residency").json()
    assert after["programs"]["hinted"]["hint"] == "busy" and after["epoch"] == 101


@pytest.mark.parametrize(
    "batch",
    [{"epoch": 1, "hints": {"p": "sleepy"}}, {"epoch": "x", "hints": {}}, {"epoch": 1}, [1, 2]],
)
def test_malformed_hint_batch_is_400(emulator, batch):
    r = httpx.post(emulator + "/mori/hints", json=batch)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_abort_ends_a_running_stream(emulator, client):
    rid = "abort-me"
    stream = _ask(
        client,
        "aborted",
        [{"role": "user", "content": "long "}],
        1500,
        stream=True,
        extra_body={"rid": rid},
    )
    finish, tokens = None, 0
    for chunk in stream:
        if not chunk.choices:
            continue
        if chunk.choices[0].delta.content and tokens == 0:
            threading.Thread(
                target=httpx.post,
                args=(emulator + "/abort_request",),
                kwargs={"json": {"rid": rid}},
            ).start()
        tokens += len(chunk.choices[0].delta.content or "") // 4
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "abort"
    assert tokens < 1500
    assert httpx.post(emulator + "/abort_request", json={"rid": rid}).json()["aborted"] is False


def test_tool_choice_gives_a_tool_call(client):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "Bash",
                "parameters": {
                    "type": "object",
                    "properties": {"command": {"type": "string"}},
                    "required": ["command"],
                },
            },
        }
    ]
    r = _ask(
        client,
        "tooler",
        [{"role": "user", "content": "run it"}],
        5,
        tools=tools,
        tool_choice="required",
    )
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "Bash" and call.function.arguments == '{"command": "x"}'
    asked = _ask(
        client,
        "tooler",
        [{"role": "user", "content": "run"}],
        5,
        tools=tools,
        extra_body={"mori_tool_call": {"name": "Bash", "arguments": {"command": "pytest -q"}}},
    )
    assert asked.choices[0].message.tool_calls[0].function.arguments == '{"command": "pytest -q"}'


def test_completions_endpoint(emulator):
    c = openai.OpenAI(base_url=emulator + "/v1", api_key="none", max_retries=0)
    r = c.completions.create(
        model="m", prompt="abcd" * 50, max_tokens=12, extra_body={"ignore_eos": True}
    )
    assert r.usage.prompt_tokens == 50 and r.usage.completion_tokens == 12
    assert len(r.choices[0].text) == 48


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"content": "no role"}]}, "messages"),
        ({"model": "m", "messages": USER, "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "messages": USER, "ignore_eos": True}, "max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": "x" * 8000}]}, "messages"),
    ],
)
def test_bad_requests_are_openai_400s(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/chat/completions", body=body, cast_to=object)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param


def test_invalid_json_and_unknown_path(emulator):
    r = httpx.post(emulator + "/v1/chat/completions", content=b"{nope")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    missing = httpx.get(emulator + "/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_server_info_and_models(emulator):
    info = httpx.get(emulator + "/get_server_info").json()
    assert info["max_total_num_tokens"] == GPU_TOKENS
    assert info["hicache_host_tokens"] == HOST_TOKENS
    models = httpx.get(emulator + "/v1/models").json()
    assert models["data"][0]["id"] == info["model_path"]


def test_programs_with_the_same_system_prompt_share_its_kv(emulator, client):
    """The anchor (tools + leading system messages) is stored once: a new program of the
    same role hits it on its first request; another role's does not."""
    system = {"role": "system", "content": "You are the Coder of this team. " * 20}
    other = {"role": "system", "content": "You are the Critic of this team. " * 20}
    _ask(client, "role-a1", [system, {"role": "user", "content": "task one"}], 5)
    first = _ask(client, "role-a2", [system, {"role": "user", "content": "task two"}], 5)
    anchor = count_tokens(render_chat([system])) - 1  # whole tokens inside the anchor
    assert _cached(first)[1] >= anchor
    stranger = _ask(client, "role-b1", [other, {"role": "user", "content": "task one"}], 5)
    assert _cached(stranger)[0] < 10


def test_hint_batches_carry_survival_scores(emulator):
    body = {"epoch": 200, "hints": {}, "scores": {"Coder": 0.8}, "agents": {"role-a1": "Coder"}}
    assert httpx.post(emulator + "/mori/hints", json=body).status_code == 200
    assert httpx.get(emulator + "/mori/residency").json()["anchor_scores"] == {"Coder": 0.8}
    for bad in ({"scores": {"Coder": 1.5}}, {"scores": [1]}, {"agents": {"p": 3}}):
        r = httpx.post(emulator + "/mori/hints", json={"epoch": 201, "hints": {}, **bad})
        assert r.status_code == 400, bad
