"""A request's prompt as segments: one per message (TokenDance §4.1's round-aware interface,
without changing clients).

TokenDance's applications mark block boundaries with a separator token; a router already
sees the boundaries: the messages. Each message (and the tool definitions, and Anthropic's
`system`) becomes a segment with two ids:

- `content`: a hash of its role and text alone: the same gathered answer in two agents'
  prompts has one content id wherever it sits;
- `chain`: a hash of the chain before it and its content: equal chain ids mean the two
  prompts are identical up to there, the only thing an engine's prefix cache shares.

Segments carry their size in characters; the owner turns them into tokens at the router's
fixed estimate (`CHARS_PER_TOKEN`), the same for every program, so a segment two programs
share is counted the same for both. At most `MAX_SEGMENTS` leading messages are kept (what
is shared sits at the start; a prompt of thousands of messages costs no more).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from router.policy.types import Segment
from router.protocol.agent_identity import CHARS_PER_TOKEN

MAX_SEGMENTS = 512
DIGEST_BYTES = 8

# (chain id, content id, characters) per segment: small and picklable for the owner link
RawSegment = tuple[str, str, int]


def _digest(text: str) -> str:
    return hashlib.blake2b(
        text.encode("utf-8", "surrogatepass"), digest_size=DIGEST_BYTES
    ).hexdigest()


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text, and others as JSON
        return "".join(
            str(p.get("text", "")) if isinstance(p, dict) and "text" in p else _json(p)
            for p in content
        )
    return "" if content is None else _json(content)


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _parts(body: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(role, text) of every block the prompt is made of, in order."""
    parts: list[tuple[str, str]] = []
    tools = body.get("tools") or body.get("functions")
    if tools:
        parts.append(("tools", _json(tools)))
    if body.get("system") is not None:  # Anthropic's system prompt sits outside the messages
        parts.append(("system", _text(body["system"])))
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if not isinstance(m, dict):
                continue
            text = _text(m.get("content"))
            if m.get("tool_calls"):
                text += _json(m["tool_calls"])
            parts.append((str(m.get("role", "")), text))
    elif isinstance(body.get("prompt"), str):
        parts.append(("prompt", body["prompt"]))
    return parts[:MAX_SEGMENTS]


def prompt_segments(body: Mapping[str, Any]) -> tuple[RawSegment, ...]:
    """The request's segments, in prompt order (see the module docstring)."""
    out: list[RawSegment] = []
    chain = ""
    for role, text in _parts(body):
        content = _digest(f"{role}\0{text}")
        chain = _digest(f"{chain}\0{content}")
        out.append((chain, content, len(text)))
    return tuple(out)


def as_policy(raw: tuple[RawSegment, ...]) -> tuple[Segment, ...]:
    """The segments as the policy counts them, in tokens (at least one each)."""
    return tuple(
        Segment(chain, content, max(1, -(-chars // CHARS_PER_TOKEN)))
        for chain, content, chars in raw
    )
