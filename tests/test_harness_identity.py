"""Agent harnesses as they are, end to end: program identity from the session header each
harness sends on its own (set with the SDKs' `default_headers`, as the harness sets it),
subagents under their parent's session kept apart, and agent hints read off the request.
Real `mori serve` in front of a real `mori emulate`, the OpenAI and Anthropic SDKs as
clients."""

from __future__ import annotations

import uuid

import anthropic
import httpx
import openai
import pytest

from tests.router_harness import assert_clean, client, emulator, metric, programs, router

HARNESS_HEADERS = (  # as Dynamo's router reads them, in its order
    "X-Dynamo-Session-ID",
    "X-Claude-Code-Session-Id",  # Claude Code >= 2.1.86
    "session-id",  # Codex CLI
    "session_id",  # older Codex, other clients
    "x-opencode-session",  # OpenCode
)
MAIN = ("You are the main coding agent.", "Fix the failing test in parser.py.")
SUBAGENTS = (
    ("You are an Explore subagent.", "Find every caller of parse()."),
    ("You are an Explore subagent.", "Find the tests that cover parse()."),
)


@pytest.fixture(scope="module")
def base():
    with (
        emulator("--time-scale", "50", "--gpu-tokens", "60000") as (replica, _),
        router([replica]) as url,
    ):
        yield url


def _openai_turn(c: openai.OpenAI, system: str, history: list[dict]) -> tuple[str, str]:
    """One call of a conversation; returns (the program the router filed it under, answer)."""
    raw = c.chat.completions.with_raw_response.create(
        model="default",
        messages=[{"role": "system", "content": system}, *history],
        max_tokens=4,
    )
    return raw.headers["x-mori-program-id"], raw.parse().choices[0].message.content


def _anthropic_turn(c: anthropic.Anthropic, system: str, history: list[dict]) -> tuple[str, str]:
    raw = c.messages.with_raw_response.create(
        model="default",
        system=system,
        messages=history,
        max_tokens=4,
        # what Claude Code sends besides its header: one value for the whole session
        metadata={"user_id": "user_0123_account__session_shared"},
    )
    return raw.headers["x-mori-program-id"], raw.parse().content[0].text


def _sdk(kind: str, base: str, header: str, session: str):
    if kind == "openai":
        return client(base, default_headers={header: session}), _openai_turn
    sdk = anthropic.Anthropic(
        base_url=base, api_key="none", max_retries=0, default_headers={header: session}
    )
    return sdk, _anthropic_turn


def _conversation(c, turn, system: str, task: str, steps: int) -> str:
    """`steps` calls of one growing conversation; all under one program, which it returns."""
    history: list[dict] = [{"role": "user", "content": task}]
    seen = set()
    for i in range(steps):
        pid, answer = turn(c, system, history)
        seen.add(pid)
        history += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"tool result {i}"},
        ]
    assert len(seen) == 1, seen
    return seen.pop()


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
@pytest.mark.parametrize("header", HARNESS_HEADERS)
def test_a_main_conversation_and_two_subagents_under_one_session_header(base, header, sdk):
    session = str(uuid.uuid4())
    c, turn = _sdk(sdk, base, header, session)
    main = _conversation(c, turn, *MAIN, steps=2)
    subs = [_conversation(c, turn, *sub, steps=2) for sub in SUBAGENTS]
    main_again = _conversation(c, turn, *MAIN, steps=3)  # the main conversation goes on
    assert main_again == main and len({main, *subs}) == 3
    assert all(pid.startswith(session + "/fp-") for pid in (main, *subs))
    view = {p["program_id"]: p for p in programs(base)["data"]}
    assert (view[main]["identity"], view[main]["parent"]) == (header, None)
    for pid in subs:
        assert (view[pid]["identity"], view[pid]["parent"]) == (header, main)
    sessions = httpx.get(base + "/v1/sessions", timeout=5).json()["data"]
    (mine,) = [s for s in sessions if s["session"] == session]
    assert mine["main"] == main and sorted(mine["subagents"]) == sorted(subs)
    assert_clean(base)


def test_explicit_ids_beat_the_session_header_and_a_bad_header_is_ignored(base):
    session = str(uuid.uuid4())
    c = client(base, default_headers={"X-Claude-Code-Session-Id": session})
    raw = c.chat.completions.with_raw_response.create(
        model="default",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"program_id": "explicit-1"},
    )
    assert raw.headers["x-mori-program-id"] == "explicit-1"
    assert httpx.get(base + "/v1/programs/explicit-1").json()["identity"] == "program_id"
    before = metric(base, "mori_identity_ignored_total", header="session-id")
    bad = client(base, default_headers={"session-id": "x" * 300, "x-opencode-session": session})
    raw = bad.chat.completions.with_raw_response.create(
        model="default", messages=[{"role": "user", "content": "hello"}], max_tokens=2
    )
    assert raw.headers["x-mori-program-id"].startswith(session + "/")  # the next header
    assert metric(base, "mori_identity_ignored_total", header="session-id") == before + 1
    assert_clean(base)


def test_agent_hints_reach_the_policy_and_bad_ones_are_refused(base):
    c = client(base, default_headers={"X-Mori-Priority": "2", "X-Mori-Osl": "64"})
    hinted = {"nvext": {"agent_hints": {"priority": 9, "speculative_prefill": True}}}
    c.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"program_id": "hinted-1", **hinted},  # the body's priority wins
    )
    view = httpx.get(base + "/v1/programs/hinted-1").json()
    assert (view["priority"], view["osl"]) == (9, 64)
    with pytest.raises(openai.BadRequestError, match="nvext.agent_hints.osl"):
        c.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body={"nvext": {"agent_hints": {"osl": -1}}},
        )
    sdk = anthropic.Anthropic(
        base_url=base, api_key="none", max_retries=0, default_headers={"X-Mori-Priority": "high"}
    )
    with pytest.raises(anthropic.BadRequestError, match="X-Mori-Priority"):
        sdk.messages.create(
            model="default", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    assert_clean(base)
