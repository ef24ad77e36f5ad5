"""Live replay: prompt synthesis, and `mori replay` against a real `mori emulate` over HTTP."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from router.protocol.accounting import CACHE_DETAILS_FLAG
from router.replay.apis import Answer, Call, sender
from router.replay.client import Replay, ReplayConfig
from router.replay.prompts import (
    Conversation,
    TokenDrift,
    common_prefix_tokens,
    count_tokens,
    render_chat,
)
from router.replay.report import JSON_FIELDS
from router.replay.trace import TraceProgram, TraceStep, dump_trace
from tests.router_harness import programs, router, serve_app
from tests.servers import free_port, mori, spawn

STEPS = (
    TraceStep(400, 20, 0, 0.5),
    TraceStep(700, 30, 420, 0.3),
    TraceStep(900, 10, 720, 0.0),
)


@pytest.fixture(scope="module")
def emulator():
    port = free_port()
    argv = mori("emulate", "--port", str(port), "--time-scale", "20", "--gpu-tokens", "40000")
    with spawn(argv, port):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
def corpus_file(tmp_path):
    programs = [
        TraceProgram("main-a", STEPS, agent="main", anchor_tokens=200),
        TraceProgram("main-b", STEPS[:2] + (TraceStep(800, 5, 0, 0.0),), agent="main"),
        TraceProgram(
            "child",
            (TraceStep(300, 8, 0, 0.2), TraceStep(350, 8, 300, 0.0)),
            parent_id="main-a",
            start_s=0.5,
            agent="explore",
        ),
    ]
    path = tmp_path / "corpus.jsonl"
    dump_trace(programs, path)
    return path, programs


def test_conversation_sizes_prompts_and_repeats_the_previous_call():
    conv = Conversation("p", agent="main", anchor_tokens=100)
    first = conv.next_messages(400, 0)
    assert count_tokens(render_chat(first)) == 400
    answer = "abcd" * 20
    conv.record_answer(answer)
    second = conv.next_messages(700, 420)
    assert count_tokens(render_chat(second)) == 700
    previous = render_chat(first + [{"role": "assistant", "content": answer}])
    assert render_chat(second).startswith(previous)


def test_conversation_compaction_keeps_only_the_reused_prefix():
    conv = Conversation("p")
    first = conv.next_messages(3000, 0)
    conv.record_answer("xyz " * 10)
    second = conv.next_messages(1200, 1000)
    shared = common_prefix_tokens(render_chat(first), render_chat(second))
    assert 990 <= shared <= 1000
    assert count_tokens(render_chat(second)) == 1200


def test_same_agent_shares_the_anchor_prefix_only():
    a = render_chat(Conversation("a", "main", 300).next_messages(600, 0))
    b = render_chat(Conversation("b", "main", 300).next_messages(600, 0))
    c = render_chat(Conversation("c", "other", 300).next_messages(600, 0))
    assert 295 <= common_prefix_tokens(a, b) <= 302
    assert common_prefix_tokens(a, c) < 5


def _engine_count(messages: list[dict]) -> int:
    """A tokenizer unlike the convention: 6 template tokens per message, and an answer
    re-tokenized into twice its convention count."""
    answers = [m for m in messages if m["role"] == "assistant"]
    return (
        count_tokens(render_chat(messages))
        + 6 * len(messages)
        + sum(count_tokens(render_chat([m])) for m in answers)
    )


@pytest.mark.parametrize("learn", [True, False])
def test_prompts_take_the_engines_count_from_its_usage(learn):
    """Told what the engine counted, later prompts hold the trace's tokens as the engine
    counts them (within 3 %); untold, they hold 8-15 % more here (SGLang: 14-18 %)."""
    drift = TokenDrift()
    errors = []
    for k in range(4):
        conv = Conversation(f"p{k}", agent="main", anchor_tokens=100, drift=drift)
        for i, (tokens, reused) in enumerate(((400, 0), (700, 420), (900, 720), (1300, 910))):
            sent = conv.next_messages(tokens, reused)
            counted = _engine_count(sent)
            if learn:
                conv.record_usage(counted)
            if k >= 2 and i >= 1:  # once the drift of a first prompt and a step is known
                errors.append(counted / tokens - 1)
            conv.record_answer("abcd " * (20 + 15 * i))
    if learn:
        assert max(abs(e) for e in errors) <= 0.03, errors
        assert drift.first > 0 and drift.growth > 0
    else:
        assert min(errors) > 0.05 and drift.first == drift.growth == 0


def test_replay_against_emulator_records_steps_and_cache_hits(emulator, corpus_file):
    _, programs = corpus_file
    config = ReplayConfig(
        emulator,
        concurrency=2,
        duration_s=3.0,
        time_scale=20,
        start_jitter_s=0.0,
        policy_label="direct",
    )
    run = Replay(programs, config)
    result = asyncio.run(run.run())
    ok = [r for r in run.records if r.ok]
    assert len(ok) >= 6 and not run.progress.errors
    instances = {r.program_id for r in ok}
    assert any("child" in pid for pid in instances), "subagents run as extra clients"
    assert all(r.arrival_s <= r.first_token_s <= r.finish_s for r in ok)
    later = [r for r in ok if r.input_tokens in (700, 900)]
    assert later and all(r.cached_device > 0 for r in later), "prefix reuse reaches the engine"
    assert {r.output_tokens for r in ok} <= {20, 30, 10, 5, 8}
    assert result.output_tok_s > 0 and result.hit_device > 0.3
    assert result.extra["duration_s"] == pytest.approx(60.0)
    assert 0 < result.gpu_util < 1
    assert run.drift.first == run.drift.growth == 0, "the emulator counts as the prompts do"


def test_replay_over_anthropic_messages_records_what_chat_records(emulator, corpus_file):
    """`api="anthropic"`: the Anthropic SDK over `/v1/messages` through the router, the
    program id in `metadata.user_id`: exact answer lengths and the cache split reach the
    client as over chat, and the engine holds each program under its replay id."""
    _, corpus = corpus_file
    spec = {"url": emulator, "gpu_tokens": 40000, "cpu_tokens": 60000}
    with router([spec]) as base:
        config = ReplayConfig(
            base, api="anthropic", concurrency=2, duration_s=3.0, time_scale=20, start_jitter_s=0
        )
        run = Replay(corpus, config)
        result = asyncio.run(run.run())
    ok = [r for r in run.records if r.ok]
    assert len(ok) >= 6 and not run.progress.errors
    assert {r.output_tokens for r in ok} <= {20, 30, 10, 5, 8}  # ignore_eos reached the engine
    later = [r for r in ok if r.input_tokens in (700, 900)]
    assert later and all(r.cached_device > 0 for r in later), "prefix reuse reaches the engine"
    assert result.hit_device > 0.3
    held = httpx.get(emulator + "/mori/residency", timeout=5).json()["programs"]
    assert {r.program_id for r in ok} <= set(held)


def test_replay_cli_writes_the_sim_json_shape(emulator, corpus_file, tmp_path):
    path, _ = corpus_file
    out = tmp_path / "live.json"
    argv = mori(
        "replay",
        str(path),
        "--endpoint",
        emulator + "/v1",
        "--concurrency",
        "2",
        "--duration",
        "2",
        "--time-scale",
        "20",
        "--json",
        str(out),
    )
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(out.read_text())
    row = doc["results"][0]
    assert set(JSON_FIELDS) <= set(row)
    assert row["policy"] == "direct" and row["concurrency"] == 2 and row["output_tok_s"] > 0
    assert row["cpu_ratio"] == 2.0  # asked of the engine: host tokens / GPU tokens
    for suffix in (".csv", ".steps.csv", "-throughput.png", "-ttft.png"):
        assert (tmp_path / f"live{suffix}").stat().st_size > 0


def test_live_replay_asks_the_router_for_its_policy_and_cpu_ratio(emulator, corpus_file):
    _, programs = corpus_file
    spec = {"url": emulator, "gpu_tokens": 40000, "cpu_tokens": 60000}
    with router([spec], policy="ta+o") as base:
        config = ReplayConfig(base + "/v1", concurrency=1, duration_s=1.0, time_scale=20)
        result = asyncio.run(Replay(programs, config).run())
    assert (result.policy, result.cpu_ratio) == ("ta+o", 1.5)


def test_replay_cli_rejects_bad_input(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"program_id": "x", "steps": []}\n')
    done = subprocess.run(mori("replay", str(bad)), capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "at least one step" in done.stdout
    port = free_port()
    good = tmp_path / "good.jsonl"
    dump_trace([TraceProgram("p", STEPS)], good)
    argv = mori("replay", str(good), "--endpoint", f"http://127.0.0.1:{port}", "--duration", "1")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "cannot list models" in done.stdout


def test_live_replay_keeps_hand_overs_and_forks(emulator):
    """`after`: a role's turn starts once the selector's dispatch ended, and the selector's
    next call once the turn ended; a fork's first prompt repeats its parent's start."""
    steps = (
        TraceStep(300, 5, 0, 4.0, "worker"),  # nominal 4 s: the hand-over comes sooner
        TraceStep(400, 5, 300, 0.0, after=(("sup.w", 0),)),
    )
    corpus = [
        TraceProgram("sup", steps, agent="selector", anchor_tokens=100),
        TraceProgram(
            "sup.w",
            (TraceStep(500, 5, 0, 0.0, after=(("sup", 0),)),),
            parent_id="sup",
            start_s=3.0,
            agent="worker",
        ),
        TraceProgram(
            "sup.f", (TraceStep(450, 5, 0, 0.0),), parent_id="sup", start_s=0.5, inherit_tokens=250
        ),
    ]
    config = ReplayConfig(emulator, concurrency=1, duration_s=1.5, time_scale=10, start_jitter_s=0)
    run = Replay(corpus, config)
    asyncio.run(run.run())
    ok = [r for r in run.records if r.ok]
    sup0 = next(r for r in ok if r.input_tokens == 300)
    work = next(r for r in ok if r.input_tokens == 500)
    sup1 = next(r for r in ok if r.input_tokens == 400)
    assert work.arrival_s == pytest.approx(sup0.finish_s, abs=0.5)  # not at start_s = 3 s
    assert sup1.arrival_s == pytest.approx(work.finish_s, abs=0.5)  # not after 4 s
    fork = next(r for r in ok if r.input_tokens == 450)
    assert fork.cached_device >= 100  # the parent's system message at least (the emulator
    # shares anchors across programs; the fork's prompt repeats 250 tokens, tested below)


def test_a_fork_repeats_its_parents_start_byte_for_byte():
    parent = Conversation("p", agent="main", anchor_tokens=100)
    first = parent.next_messages(400, 0)
    fork = Conversation("f", agent="main", inherit_tokens=250)
    fork.inherit(first)
    forked = fork.next_messages(600, 0)
    assert count_tokens(render_chat(forked)) == 600
    assert 248 <= common_prefix_tokens(render_chat(first), render_chat(forked)) <= 251


def test_live_replay_tells_the_router_each_tool_call_and_each_end(emulator):
    """A replayed answer cannot end in the trace's tool call, so the replay names it the way
    an agent without tool calls does (`tool_start`): the router's priced policy predicts per
    tool, as in `mori sim`. Programs still running when the run stops are ended, also behind
    API keys (the key-less end used to be refused, leaving them to the idle lease)."""
    steps = (TraceStep(300, 5, 0, 6.0, "Bash:pytest"), TraceStep(400, 5, 300, 0.0))
    corpus = [TraceProgram("t", steps, agent="main")]
    spec = {"url": emulator, "gpu_tokens": 40000, "cpu_tokens": 60000}
    with router([spec], api_keys=["key-a"]) as base:
        config = ReplayConfig(
            base + "/v1", api_key="key-a", concurrency=1, duration_s=3.0, start_jitter_s=0
        )
        run = Replay(corpus, config)
        seen: list[dict] = []

        def mine(program: dict) -> bool:  # the router adopts what the shared emulator holds
            return run.run_tag in program["program_id"]

        async def replay_and_watch() -> None:
            task = asyncio.create_task(run.run())
            while not task.done() and not seen:
                await asyncio.sleep(0.1)
                view = await asyncio.to_thread(programs, base, "key-a")
                seen.extend(p for p in view["data"] if mine(p) and p["last_tool"])
            await task

        asyncio.run(replay_and_watch())
        assert seen and seen[0]["last_tool"] == "Bash:pytest", seen
        assert seen[0]["status"] == "acting"
        assert not [p for p in programs(base, "key-a")["data"] if mine(p)]


@pytest.mark.parametrize("identity", ["claude-code", "codex", "opencode", "none"])
def test_live_replay_names_programs_as_the_harness_does(emulator, corpus_file, identity):
    """With a harness's identity no request carries a program id or a parent: the root
    program's session header, shared by its subagent, is all the router gets, and the
    router still sees each replayed program as one program of its own, the subagent under
    its parent (`none`: fingerprints only, the parent is lost). Tool calls and ends go to
    the ids the router answered with, behind an API key too. (main-b's restart, a step
    reusing nothing, is left out: a harness's restarted conversation is a new program.)"""
    _, corpus = corpus_file
    corpus = [p for p in corpus if p.program_id != "main-b"]
    spec = {"url": emulator, "gpu_tokens": 40000, "cpu_tokens": 60000}
    with router([spec], api_keys=["key-a"]) as base:
        config = ReplayConfig(
            base + "/v1",
            api_key="key-a",
            concurrency=2,
            duration_s=2.0,
            time_scale=20,
            start_jitter_s=0,
            identity=identity,
        )
        run = Replay(corpus, config)
        asyncio.run(run.run())
        auth = {"authorization": "Bearer key-a"}
        sessions = httpx.get(base + "/v1/sessions", headers=auth, timeout=5).json()["data"]
        left = {p["program_id"] for p in programs(base, "key-a")["data"]}
    assert all(r.ok for r in run.records) and run.routed
    routed = {pid: ids.pop() for pid, ids in run.routed.items() if len(ids) == 1}
    assert len(routed) == len(run.routed) == len(set(routed.values()))  # no split, no merge
    parent_of = {sub: s["main"] for s in sessions for sub in s["subagents"]}
    children = [pid for pid, parent in run.parents.items() if parent and pid in routed]
    assert children, "the subagent ran"
    for pid in children:
        expected = routed[run.parents[pid]] if identity != "none" else None
        assert parent_of.get(routed[pid]) == expected
    assert not left & set(routed.values())  # every program was ended by the id it had


def test_a_tool_call_runs_while_the_router_is_told_of_it():
    """The replayed agent tells the router its tool call and runs it at once, as a harness
    does: a slow answer to the notice does not lengthen the call (told first, then slept,
    every call lasted the notice's round trip too: time the simulator's tool times do not
    have). The next request still waits for the notice's answer, so the router sees the
    call begin before the program's next step."""
    slow_s, tool_s = 0.6, 0.6
    seen: dict[str, list[float]] = {"answered": [], "told": [], "asked": []}

    async def chat(request: Request) -> Response:
        seen["asked"].append(time.monotonic())
        usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
        chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": "x"}}]}

        async def events():
            yield "data: " + json.dumps(chunk) + "\n\n"
            yield "data: " + json.dumps({"id": "c", "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
            seen["answered"].append(time.monotonic())

        return StreamingResponse(events(), media_type="text/event-stream")

    async def tool_start(request: Request) -> Response:
        await asyncio.sleep(slow_s)
        seen["told"].append(time.monotonic())
        return JSONResponse({})

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/programs/{pid:path}/tool_start", tool_start, methods=["POST"]),
            Route("/v1/programs/{pid:path}/end", lambda _: JSONResponse({}), methods=["POST"]),
        ]
    )
    steps = (TraceStep(300, 1, 0, tool_s, "Bash"), TraceStep(400, 1, 300, 0.0))
    with serve_app(app) as base:
        config = ReplayConfig(
            base + "/v1",
            concurrency=1,
            duration_s=2.5,
            start_jitter_s=0,
            programs=1,
            policy_label="double",
            cpu_ratio=1.0,
            model="m",
        )
        asyncio.run(Replay([TraceProgram("t", steps, agent="main")], config).run())
    assert len(seen["asked"]) >= 2 and seen["told"], seen
    gap = seen["asked"][1] - seen["answered"][0]
    assert seen["asked"][1] >= seen["told"][0]  # the notice was answered first
    assert gap < slow_s + tool_s - 0.3, gap  # ~max(notice, call), not their sum


def test_the_chat_body_skips_the_sdk_transform_yet_sends_the_same_bytes():
    """The replay hands the conversation to the OpenAI SDK in `extra_body` (its per-message
    request transform stalled every replayed agent): what reaches the server is byte for
    byte the body of the SDK's typed call, messages in their place."""
    bodies: list[bytes] = []

    async def chat(request: Request) -> Response:
        bodies.append(await request.body())
        chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": "x"}}]}

        async def events():
            yield "data: " + json.dumps(chunk) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    messages = [{"role": "system", "content": "s"}] + [
        {"role": "user" if i % 2 else "assistant", "content": f'turn {i} é "q"'} for i in range(9)
    ]
    call = Call("m", messages, 7, "prog-1", {"x-test": "1"})

    async def both(base: str) -> Answer:
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="k") as client:
            typed = await client.chat.completions.create(
                model="m",
                messages=messages,  # type: ignore[arg-type]
                max_tokens=7,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, CACHE_DETAILS_FLAG: True, "program_id": "prog-1"},
                extra_headers={"x-test": "1"},
            )
            async for _ in typed:
                pass
            answer = Answer()
            async with sender("openai", client, "k", 10.0, time.monotonic) as send:
                await send(answer, call)
            return answer

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    with serve_app(app) as base:
        answer = asyncio.run(both(base))
    assert answer.parts == ["x"]
    assert len(bodies) == 2 and json.loads(bodies[1])["messages"] == messages
    assert bodies[1] == bodies[0]
