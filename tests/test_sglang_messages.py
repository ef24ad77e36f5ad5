"""Anthropic Messages on a real SGLang (CPU, both lines): the engine patch carries the
router's program id through SGLang's own Messages entrypoint (engine_patches/messages.py).

Through `mori serve`, with the Anthropic SDK, a program moved to the CPU tier (hint `idle`)
and back (`busy`) has its KV offloaded and loaded back exactly as the same program over
chat completions (tests/offload_cycle.py); `/mori/residency` names the router's ids only and
the router adopts nothing. Before the patch carried `session_id`, SGLang stamped a Messages
request's KV with no program: the router's program held nothing on the engine.
"""

from __future__ import annotations

import time
from pathlib import Path

import anthropic
import httpx
import pytest

from tests.offload_cycle import residency, run_cycle, sender, wait_for
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
def server(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("sglang-messages")
    model = build_tiny_model(work / "tiny")
    with patched_servers(1, model, work, FLAGS) as (srv,):
        yield srv


def _flush(srv: Server) -> None:
    """An empty radix tree (and residency), once the engine is idle."""
    wait_for(
        lambda: httpx.post(srv.url + "/flush_cache", timeout=30).status_code == 200,
        60,
        "an idle engine to flush its cache",
    )


def test_a_messages_program_moves_exactly_as_a_chat_program(server: Server, tmp_path: Path):
    spec = [{"url": server.url, "gpu_tokens": 150, "cpu_tokens": 2000}]
    settings = {"tick_s": 0.2, "gate_timeout_s": 60.0, "reconcile_s": 0.5, **ROUTER_SETTINGS}
    with router(spec, log=tmp_path / "router.log", **settings) as base:
        cycles = {}
        for api in ("chat", "messages"):
            _flush(server)  # both start from the same empty tree
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
