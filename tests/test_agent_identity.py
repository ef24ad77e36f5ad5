"""Agent identity from a request's anchor (tools + leading system messages)."""

from __future__ import annotations

import json

from router.protocol.agent_identity import BLOCK_TOKENS, CHARS_PER_TOKEN, AnchorBook, anchor_of

TOOLS = [{"type": "function", "function": {"name": "python", "parameters": {}}}]


def body(system: str, user: str, tools=None) -> dict:
    out = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    return {**out, "tools": tools} if tools else out


def test_sessions_of_a_role_share_an_identity_and_roles_differ():
    coder = "You are the Coder. Write Python that solves the task. " * 20
    critic = "You are the Critic. Find the flaws in the last answer. " * 20
    a, b = anchor_of(body(coder, "task 1", TOOLS)), anchor_of(body(coder, "task 2", TOOLS))
    c = anchor_of(body(critic, "task 1", TOOLS))
    assert a is not None and b is not None and c is not None
    assert a.agent == b.agent != c.agent
    assert a.tokens == (len(coder) + len(json.dumps(TOOLS))) // CHARS_PER_TOKEN


def test_skip_and_take_choose_the_hashed_blocks():
    block = BLOCK_TOKENS * CHARS_PER_TOKEN
    shared, tail_a, tail_b = "H" * block, "a" * block, "b" * block
    a, b = body(shared + tail_a, "x"), body(shared + tail_b, "x")
    assert anchor_of(a, skip=0, take=1).agent == anchor_of(b, skip=0, take=1).agent
    assert anchor_of(a, skip=1, take=1).agent != anchor_of(b, skip=1, take=1).agent


def test_no_anchor_no_identity_and_anthropic_system_counts():
    assert anchor_of({"messages": [{"role": "user", "content": "hi"}]}) is None
    assert anchor_of({"prompt": "hi"}) is None
    anthropic = {"system": "You are the Planner.", "messages": [{"role": "user", "content": "x"}]}
    assert anchor_of(anthropic) is not None


def test_the_warm_up_replays_the_anchor_with_a_one_character_question():
    anchor = anchor_of(body("You are the Tester.", "a long task", TOOLS))
    warm = anchor.warm_body("mori-warm/x")
    assert warm["messages"][0] == {"role": "system", "content": "You are the Tester."}
    assert warm["messages"][1] == {"role": "user", "content": "."}
    assert warm["max_tokens"] == 1 and warm["tools"] == TOOLS
    book = AnchorBook(capacity=2)
    for i in range(3):
        book.remember(f"agent{i}", anchor)
    assert book.get("agent0") is None and book.get("agent2") is anchor
