"""Anthropic Messages on a real SGLang (CPU, both lines): the engine patch carries the
router's program id through SGLang's own Messages entrypoint (engine_patches/messages.py).

Through `mori serve`, with the Anthropic SDK, a program moved to the CPU tier (hint `idle`)
and back (`busy`) has its KV offloaded and loaded back exactly as the same program over
chat completions (tests/offload_cycle.py); `/mori/residency` names the router's ids only and
the router adopts nothing. Before the patch carried `session_id`, SGLang stamped a Messages
request's KV with no program: the router's program held nothing on the engine.

The same two replicas then serve a router over chat completions (both in use), after the
Messages tests: they flush the tree before each run, and read one replica's residency.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest
from openai import OpenAI

from tests.offload_cycle import residency, run_cycle, sender
from tests.router_harness import metric, router
from tests.sglang.server import (
    REAL_ENGINE,
    ROUTER_SETTINGS,
    Server,
    build_tiny_model,
    patched_servers,
)

pytestmark = REAL_ENGINE

FLAGS = ["--max-total-tokens", "512", "--max-running-requests", "4"]
A_TEXT, B_TEXT = "run " * 60, "fix " * 120  # ~60 tokens: a fits the GPU tier, not with b


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    """Two patched replicas (started side by side: start-up is mostly imports). Each
    Messages test starts from a flushed tree; a new router takes over the hint epoch of
    the last one, as a restarted router does."""
    work = tmp_path_factory.mktemp("sglang-messages")
    with patched_servers(2, build_tiny_model(work / "tiny"), work, FLAGS) as pair:
        yield pair


@pytest.fixture(scope="module")
def server(replicas: list[Server]) -> Server:
    return replicas[0]


def test_a_messages_program_moves_exactly_as_a_chat_program(server: Server, tmp_path: Path):
    spec = [{"url": server.url, "gpu_tokens": 150, "cpu_tokens": 2000}]
    settings = {"tick_s": 0.2, "gate_timeout_s": 60.0, "reconcile_s": 0.5, **ROUTER_SETTINGS}
    with router(spec, log=tmp_path / "router.log", **settings) as base:
        cycles = {}
        for api in ("chat", "messages"):
            server.flush()  # both start from the same empty tree
            send = sender(base, api, max_tokens=2)
            a, b = f"{api}-a", f"{api}-b"
            cycles[api] = run_cycle(base, server.url, send, a, b, A_TEXT, B_TEXT, timeout_s=60)
        time.sleep(1.5)  # reconcile ran
        held = residency(server.url)
        adopted = metric(base, "mori_reconciled_programs_total", kind="adopted")
    assert cycles["messages"] == cycles["chat"], cycles
    offloaded = cycles["chat"].offloaded
    # the device keeps only what a shares with b (the chat template's `<|im_start|>user\n`)
    assert offloaded["device_tokens"] <= 3 and offloaded["host_tokens"] >= 60, offloaded
    assert offloaded["hinted"] and cycles["chat"].back["hint"] == "busy"
    assert cycles["chat"].cached >= 60, cycles
    assert set(held) <= {"messages-a", "messages-b"}, held  # the router's ids, nothing else
    assert held["messages-a"]["host_tokens"] > 0, held
    assert adopted == 0


def test_messages_stream_carries_the_split_and_the_rid(server: Server):
    """Straight to the engine: a streamed Messages request that asks for the cache split
    gets it on `message_delta`; one with a `rid` is aborted by it; a carried field of the
    wrong type is a 400 in Anthropic's shape."""
    c = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    turn = [{"role": "user", "content": "program 7 step 1 tool call result ok"}]
    extra = {"session_id": "direct-1", "return_cached_tokens_details": True}
    c.messages.create(model="m", max_tokens=2, messages=turn, extra_body=extra)
    with c.messages.stream(model="m", max_tokens=2, messages=turn, extra_body=extra) as events:
        delta = [e for e in events if e.type == "message_delta"][0]
    split = delta.model_extra["sglext"]["cached_tokens_details"]
    assert split["device"] > 0, delta
    assert residency(server.url)["direct-1"]["device_tokens"] > 0

    # a decode the machine may finish before the abort lands: a few tries, one must be cut
    assert any(_aborted_by_rid(c, turn, f"messages-rid-{i}") for i in range(3))

    with pytest.raises(anthropic.BadRequestError, match="session_id") as bad:
        c.messages.create(model="m", max_tokens=2, messages=turn, extra_body={"session_id": 7})
    assert bad.value.body["type"] == "error"


def _aborted_by_rid(c: anthropic.Anthropic, turn: list[dict], rid: str) -> bool:
    """A 400-token Messages stream with `rid`, aborted by it at its first text: whether it
    ended short (when the abort lands after the last token it ends whole)."""
    body = {"session_id": rid, "rid": rid, "ignore_eos": True}
    with c.messages.stream(model="m", max_tokens=400, messages=turn, extra_body=body) as events:
        stream = iter(events)
        while next(stream).type != "content_block_delta":  # decoding
            pass
        r = httpx.post(
            f"{c.base_url}".rstrip("/") + "/abort_request", json={"rid": rid}, timeout=30
        )
        assert r.status_code == 200
        rest = list(stream)
    assert rest[-1].type == "message_stop"
    output = [e.usage.output_tokens for e in rest if e.type == "message_delta"]
    return not output or output[0] < 400


def test_router_in_front_of_two_patched_replicas(replicas: list[Server]):
    """`mori serve` -> two real patched CPU replicas: a short replayed agent trace (programs
    with growing contexts and tool gaps), and the router's hints show in each replica's
    residency next to the KV the programs left there."""
    with (
        router(  # a CPU engine on a busy machine is slow: 10 s bounds are for emulators
            [r.url for r in replicas], tick_s=0.2, gate_timeout_s=60.0, **ROUTER_SETTINGS
        ) as base,
    ):
        client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
        programs = [f"trace-{i}" for i in range(6)]
        history = {p: f"program {p} task" for p in programs}
        for step in range(3):  # closed loop: send, wait, "run the tool", send the next step
            for p in programs:
                out = client.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": history[p]}],
                    max_tokens=3,
                    extra_body={"program_id": p},
                )
                history[p] += f" {out.choices[0].message.content} tool result {step}"
            time.sleep(0.2)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # hints are pushed after moves and on full syncs
            views = [r.residency() for r in replicas]
            hinted = {p for v in views for p, s in v["programs"].items() if v["epoch"] >= 0}
            if set(programs) <= hinted:
                break
            time.sleep(0.5)
        assert set(programs) <= hinted, views
        for p in programs:  # each program's KV sits on a replica that knows its type
            held = [v["programs"][p] for v in views if p in v["programs"]]
            assert any(s["device_tokens"] + s["host_tokens"] > 0 for s in held), (p, views)
            assert all(s["hint"] in {"busy", "idle", "inactive"} for s in held)
