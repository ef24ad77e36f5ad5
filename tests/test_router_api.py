"""End to end: the OpenAI SDK -> a real `mori serve` -> two real `mori emulate` replicas."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.router_harness import (
    ScriptedReplica,
    assert_clean,
    chat,
    client,
    emulators,
    metric,
    programs,
    router,
    serve,
)
from tests.servers import free_port, mori, spawn

EMULATOR_ARGS = ("--time-scale", "20")
BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "run a shell command",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}


def _big(program_id: str) -> dict:
    """~8000 chars (~2000 tokens) that share nothing with another program's prompt (the tiers
    count a prompt two programs share once, as the engine stores it)."""
    return chat(program_id, f"{program_id} " + "word " * 1600)


@pytest.fixture(scope="module")
def replicas():
    with emulators(2, *EMULATOR_ARGS) as urls:
        yield urls


@pytest.fixture(scope="module")
def base(replicas):
    with router(replicas) as url:
        yield url


def test_chat_plain_and_streamed(base):
    c = client(base)
    answer = c.chat.completions.create(**chat("plain-1"))
    assert answer.choices[0].message.content
    assert answer.usage.prompt_tokens > 0 and answer.usage.completion_tokens > 0

    chunks = list(c.chat.completions.create(**chat("plain-1", "next step"), stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert all(ch.usage is None and ch.choices for ch in chunks)  # forced usage not leaked

    asked = list(
        c.chat.completions.create(
            **chat("plain-1", "third"), stream=True, stream_options={"include_usage": True}
        )
    )
    assert asked[-1].usage is not None and asked[-1].usage.completion_tokens > 0

    view = httpx.get(base + "/v1/programs/plain-1").json()
    assert view["steps"] == 3 and view["status"] == "acting" and view["tier"] == "gpu"
    # context tokens come from the engine's usage, not from the estimate
    assert (
        view["context_tokens"] == asked[-1].usage.prompt_tokens + asked[-1].usage.completion_tokens
    )
    assert len(view["recent_cycles"]) == 2


def test_router_counts_prompt_tokens_by_cache_source(base):
    """The router asks the engine for its device/host split and counts every prompt token
    by source; a client that asked for the split too gets it, one that did not never sees
    it (test_chat_plain_and_streamed: no choice-less chunk leaks)."""
    c = client(base)
    sources = ("device", "host", "miss")
    before = {s: metric(base, "mori_prompt_cache_tokens_total", source=s) for s in sources}
    first = c.chat.completions.create(**chat("hits-1", "context " * 150))
    messages = [
        {"role": "user", "content": "context " * 150},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "tool result"},
    ]
    args = {
        **chat("hits-1", extra_body={"return_cached_tokens_details": True}),
        "messages": messages,
    }
    second = c.chat.completions.create(**args)
    split = second.model_extra["sglext"]["cached_tokens_details"]
    assert split["device"] > first.usage.prompt_tokens and split["host"] == 0
    after = {s: metric(base, "mori_prompt_cache_tokens_total", source=s) for s in sources}
    counted = {s: after[s] - before[s] for s in sources}
    assert counted == {
        "device": split["device"],
        "host": 0,
        "miss": first.usage.prompt_tokens + second.usage.prompt_tokens - split["device"],
    }


def test_streamed_answers_price_the_replica(base):
    """Each streamed answer's engine times (measured by the data plane that relayed it)
    reach the policy's prices; a plain answer, whose first byte is its last, does not."""
    c = client(base)

    def samples() -> int:
        reps = httpx.get(base + "/v1/replicas").json()["data"]
        return sum(r["prices"]["samples"] for r in reps)

    before = samples()
    for i in range(3):  # ~400 uncached prompt tokens each: past the price's minimum
        c.chat.completions.create(**chat(f"price-{i}", f"{i} " + "context " * 200))
    time.sleep(0.2)
    assert samples() == before
    for i in range(4):
        stream = c.chat.completions.create(
            **chat(f"price-s{i}", f"{i} " + "context " * 200), stream=True
        )
        assert [chunk for chunk in stream]
    deadline = time.monotonic() + 5  # an attempt's report may trail the answer by ms
    while samples() < before + 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert samples() == before + 4
    for pid in [*(f"price-{i}" for i in range(3)), *(f"price-s{i}" for i in range(4))]:
        httpx.post(f"{base}/v1/programs/{pid}/end").raise_for_status()  # the engines forget


def test_streamed_answers_measure_the_round_trip_to_the_replica(base):
    """A streamed step's time from the gate letting it in to its answer at the router,
    less what the data plane timed at the engine, is the round trip the door's load
    discounts: measured per replica, shown in /v1/replicas and on /metrics."""
    c = client(base)
    for i in range(4):
        stream = c.chat.completions.create(**chat(f"trip-{i}", f"{i} hello"), stream=True)
        assert [chunk for chunk in stream]
    deadline = time.monotonic() + 5  # an attempt's report may trail the answer by ms
    measured: dict[str, float] = {}
    while not measured and time.monotonic() < deadline:
        reps = httpx.get(base + "/v1/replicas").json()["data"]
        prices = {r["url"]: r.get("prices", {}) for r in reps}
        measured = {url: p["round_trip_s"] for url, p in prices.items() if "round_trip_s" in p}
        time.sleep(0.05)
    assert measured and all(0.0 < s < 1.0 for s in measured.values()), measured
    for url, s in measured.items():  # a report trailing its answer moves the median by 5 %
        gauge = metric(base, "mori_replica_round_trip_seconds", replica=url)
        assert gauge == pytest.approx(s, rel=0.15, abs=1e-4)
    for i in range(4):
        httpx.post(f"{base}/v1/programs/trip-{i}/end").raise_for_status()


def test_completions_and_models(base):
    c = client(base)
    text = c.completions.create(
        model="default", prompt="def f():", max_tokens=4, extra_body={"program_id": "cmp-1"}
    )
    assert text.choices[0].text and text.usage.completion_tokens > 0
    (served,) = c.models.list().data  # the replicas' one model, as the first healthy one lists it
    # Any `model` name is passed through: the engine serves its one model and echoes the name
    # asked for, as SGLang does (docs/router.md, "Models").
    for name in (served.id, "default", "no-such-model"):
        out = c.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            extra_body={"program_id": "models-1"},
        )  # fmt: skip
        assert out.model == name and out.usage.completion_tokens == 2


def test_program_id_from_header_and_fingerprint(base):
    r = httpx.post(
        base + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"x-program-id": "hdr-1"},
    )
    assert r.status_code == 200 and r.headers["x-mori-program-id"] == "hdr-1"
    convo = [{"role": "system", "content": "agent"}, {"role": "user", "content": "task 77"}]
    first = httpx.post(base + "/v1/chat/completions", json={"messages": convo, "max_tokens": 2})
    longer = [*convo, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]
    second = httpx.post(base + "/v1/chat/completions", json={"messages": longer, "max_tokens": 2})
    pid = first.headers["x-mori-program-id"]
    assert pid.startswith("fp-") and second.headers["x-mori-program-id"] == pid
    assert httpx.get(base + f"/v1/programs/{pid}").json()["steps"] == 2


def test_tool_calls_pass_through(base):
    c = client(base)
    forced = {"tools": [BASH_TOOL], "tool_choice": "required"}
    answer = c.chat.completions.create(**chat("tools-1"), **forced)
    call = answer.choices[0].message.tool_calls[0]
    assert answer.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "bash" and "command" in json.loads(call.function.arguments)

    chunks = list(c.chat.completions.create(**chat("tools-1", "again"), **forced, stream=True))
    names = [
        tc.function.name
        for ch in chunks
        if ch.choices and ch.choices[0].delta.tool_calls
        for tc in ch.choices[0].delta.tool_calls
        if tc.function and tc.function.name
    ]
    assert names == ["bash"]
    assert_clean(base)


def test_programs_spread_over_replicas_and_hints_reach_engines():
    """Each replica's GPU tier holds one big program: two programs need both replicas.
    Own replicas: another router's full hint sync would mark these programs inactive."""
    with emulators(2, *EMULATOR_ARGS) as replicas:
        specs = [{"url": url, "gpu_tokens": 3000, "cpu_tokens": 3000} for url in replicas]
        with router(specs) as base:
            c = client(base)
            for i in range(2):
                c.chat.completions.create(**_big(f"spread-{i}"))
            placed = {p["program_id"]: p["replica"] for p in programs(base)["data"]}
            assert {placed["spread-0"], placed["spread-1"]} == set(replicas)
            _hints_follow_placement(base, placed["spread-0"])


def _hints_follow_placement(base: str, replica: str) -> None:
    def engine_hints() -> dict[str, str]:
        rows = httpx.get(replica + "/mori/residency").json()["programs"]
        return {pid: row["hint"] for pid, row in rows.items()}

    deadline = time.monotonic() + 5
    while engine_hints().get("spread-0") != "busy" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_hints().get("spread-0") == "busy"

    assert httpx.post(base + "/v1/programs/spread-0/end").json()["ended"] is True
    deadline = time.monotonic() + 5
    while engine_hints().get("spread-0") not in (None, "inactive") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_hints().get("spread-0") in (None, "inactive")
    assert httpx.get(base + "/v1/programs/spread-0").status_code == 404


def test_admin_views_and_metrics(base, replicas):
    client(base).chat.completions.create(**chat("metrics-1"))
    reps = httpx.get(base + "/v1/replicas").json()["data"]
    assert [r["url"] for r in reps] == replicas and all(r["healthy"] for r in reps)
    assert all(r["gpu"]["budget_tokens"] > 0 and r["cpu"]["budget_tokens"] > 0 for r in reps)
    text = httpx.get(base + "/metrics").text
    for name in (
        "mori_programs",
        "mori_moves_total",
        "mori_requests_total",
        "mori_ttft_seconds_bucket",
        "mori_hint_pushes_total",
        "mori_replica_healthy",
    ):
        assert name in text
    assert metric(base, "mori_requests_total", outcome="ok") >= 1


@pytest.fixture
def tight(replicas):
    """One replica whose GPU tier holds one ~2000-token program, and no CPU tier; the
    paper's policy, which never moves an idle program for a new one (the gate's own
    mechanics are under test; the default's displacement: test_router_admission.py)."""
    spec = {"url": replicas[0], "gpu_tokens": 3000, "cpu_tokens": 0}
    with router([spec], gate_timeout_s=3.0, policy="mori-paper") as url:
        yield url


def test_gate_holds_until_room_then_promotes(tight):
    c = client(tight)
    c.chat.completions.create(**_big("first"))
    result: dict = {}

    def second():
        started = time.monotonic()
        result["answer"] = c.chat.completions.create(**_big("second"))
        result["waited"] = time.monotonic() - started

    worker = threading.Thread(target=second)
    worker.start()
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        view = programs(tight)
        if view["gate"]["waiting"] == 1:
            break
        time.sleep(0.02)
    held = {p["program_id"]: p for p in view["data"]}
    assert view["gate"]["waiting"] == 1 and held["second"]["status"] == "gated"
    assert held["second"]["tier"] == "waiting" and held["first"]["tier"] == "gpu"
    time.sleep(0.3)
    assert worker.is_alive()  # still held: there is no room
    httpx.post(tight + "/v1/programs/first/end").raise_for_status()
    worker.join(5)
    assert result["answer"].choices[0].message.content and result["waited"] >= 0.3
    assert programs(tight)["data"][0]["tier"] == "gpu"
    assert metric(tight, "mori_gate_wait_seconds_sum") >= 0.3
    assert_clean(tight)


def test_gate_timeout_answers_503_with_retry_after(tight):
    c = client(tight)
    for p in programs(tight)["data"]:  # an earlier test's program would hold the one slot
        httpx.post(f"{tight}/v1/programs/{p['program_id']}/end").raise_for_status()
    c.chat.completions.create(**_big("holder"))
    with pytest.raises(openai.APIStatusError) as err:
        c.chat.completions.create(**_big("starved"))
    assert err.value.status_code == 503
    assert err.value.response.headers["retry-after"]
    assert err.value.body["code"] == "gate_timeout"
    view = assert_clean(tight)
    starved = next(p for p in view["data"] if p["program_id"] == "starved")
    assert starved["status"] == "acting" and starved["steps"] == 0
    assert metric(tight, "mori_gate_timeouts_total") == 1


def test_same_program_requests_take_turns(base):
    c = client(base)
    answers: list = []
    threads = [
        threading.Thread(
            target=lambda i=i: answers.append(c.chat.completions.create(**chat("turns", f"q{i}")))
        )
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(answers) == 4
    assert httpx.get(base + "/v1/programs/turns").json()["steps"] == 4
    assert_clean(base)


def test_anthropic_messages_pass_through_and_account():
    replica = ScriptedReplica()
    with serve(replica) as url, router([url]) as base:
        r = httpx.post(
            base + "/v1/messages",
            json={
                "model": "m",
                "max_tokens": 64,
                "metadata": {"user_id": "anth-1"},
                "messages": [{"role": "user", "content": "list files"}],
            },
            headers={"anthropic-version": "2023-06-01"},
        )
        assert r.status_code == 200 and r.json()["content"][0]["name"] == "Bash"
        assert replica.last_body["session_id"] == "anth-1"
        assert replica.last_body["metadata"] == {"user_id": "anth-1"}
        view = httpx.get(base + "/v1/programs/anth-1").json()
        assert view["context_tokens"] == 40 + 60 + 7  # input incl. cached + output
        assert view["status"] == "acting" and view["steps"] == 1


def test_serve_from_flags_and_env_without_a_file(replicas):
    port = free_port()
    argv = mori(
        "serve", "--replicas", ",".join(replicas), "--port", str(port), "--host", "127.0.0.1"
    )
    env = {"MORI_ADMIN_KEY": "adm", "MORI_TICK_S": "0.5", "MORI_PORT": "1"}  # the flag wins
    with spawn(argv, port, env=env):
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(base + "/v1/replicas").status_code == 403
        reps = httpx.get(base + "/v1/replicas", headers={"authorization": "Bearer adm"}).json()
        assert [r["url"] for r in reps["data"]] == replicas
        assert client(base).chat.completions.create(**chat("flags-1")).choices


def test_every_documented_metric_is_exposed(base):
    client(base).chat.completions.create(**chat("names-1"))
    table = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    documented = re.findall(r"^\| `(mori_[a-z_]+)`", table, flags=re.M)
    assert len(documented) >= 15
    text = httpx.get(base + "/metrics").text
    exposed = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    for name in documented:
        assert any(e == name or e.startswith(name + "_") for e in exposed), name
    assert {e.split("_bucket")[0] for e in exposed if e.startswith("mori_")} <= {
        *documented,
        *(e for e in exposed if e.endswith(("_created", "_sum", "_count"))),
    }


def test_tool_start_and_end_endpoints(base):
    client(base).chat.completions.create(**chat("hooks-1"))
    r = httpx.post(
        base + "/v1/programs/hooks-1/tool_start", json={"tool": "pytest", "predict_time": 3}
    )
    assert r.status_code == 200 and r.json() == {"program_id": "hooks-1", "tool": "pytest"}
    assert httpx.post(base + "/v1/programs/hooks-1/tool_end").status_code == 200
    bad = httpx.post(
        base + "/v1/programs/hooks-1/tool_start", json={"tool": "x", "predict_time": -1}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "predict_time"
    assert client(base).chat.completions.create(**chat("hooks-1", "next")).choices
    assert httpx.get(base + "/v1/programs/hooks-1").json()["steps"] == 2


@pytest.mark.parametrize("policy", ["mori-priced", "mori-paper", "continuum", "ta", "ta+o", "smg"])
def test_every_policy_serves(replicas, policy):
    """The shell drives every registered policy the same way (baselines send no hints)."""
    pid = f"pol-{policy}"  # a router adopts what the shared emulators still hold of others
    with router(replicas, policy=policy) as url:
        c = client(url)
        forced = {"tools": [BASH_TOOL], "tool_choice": "required"}
        assert c.chat.completions.create(**chat(pid), **forced).choices[0].message.tool_calls
        chunks = list(c.chat.completions.create(**chat(pid, "more"), stream=True))
        assert chunks and all(ch.usage is None for ch in chunks)
        view = assert_clean(url)  # also lists programs adopted from the shared emulators
        mine = next(p for p in view["data"] if p["program_id"] == pid)
        assert view["policy"] == policy and mine["steps"] == 2
