"""Which agent role a request comes from: the shared coordinate of the agent runtime layer.

An explicit name wins (body `agent`, header `X-Agent-Role`). Without one, the request's
*anchor* names it: the tool definitions and leading system (or developer) messages that every
session of an agent role sends byte for byte, ahead of its own history. As CacheSage does
with the engine's block hashes (skip the chat template's first blocks, hash the next ones),
the identity is a hash of blocks [`skip`, `skip` + `take`) of the rendered anchor, blocks of
`BLOCK_TOKENS` tokens at `CHARS_PER_TOKEN` characters each; the router sees messages before
any chat template, so nothing needs skipping by default. Two roles whose anchors agree on
the hashed blocks share an identity (take more blocks if they do).

The anchor itself is kept too: a warm-up request replays it (CacheSage §3.4).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

CHARS_PER_TOKEN = 4  # the router's token estimate (router.owner.controller, router.replay.prompts)
BLOCK_TOKENS = 16
SKIP_BLOCKS = 0
TAKE_BLOCKS = 4
WARM_USER_TEXT = "."  # CacheSage's warm-up: the anchor, a one-character user message


@dataclass(frozen=True)
class Anchor:
    """A request's anchor: its system messages (and Anthropic `system`) and tools."""

    system: tuple[Any, ...]  # the leading system / developer messages, as sent
    tools: tuple[Any, ...]
    chars: int  # rendered length (tools JSON + message texts)
    digest: str  # hash of the identity blocks

    @property
    def agent(self) -> str:
        return f"anchor-{self.digest}"

    @property
    def tokens(self) -> int:
        return self.chars // CHARS_PER_TOKEN

    def warm_body(self, program_id: str) -> dict[str, Any]:
        """A chat request that computes the anchor and one output token, nothing else."""
        body: dict[str, Any] = {
            "messages": [*self.system, {"role": "user", "content": WARM_USER_TEXT}],
            "max_tokens": 1,
            "session_id": program_id,
        }
        if self.tools:
            body["tools"] = list(self.tools)
        return body


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def anchor_of(
    body: Mapping[str, Any], skip: int = SKIP_BLOCKS, take: int = TAKE_BLOCKS
) -> Anchor | None:
    """The anchor of a chat request (OpenAI or Anthropic), None when it has neither tools
    nor a leading system message (nothing that recurs across sessions)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    system: list[Any] = []
    texts: list[str] = []
    if isinstance(body.get("system"), str | list):  # Anthropic keeps it outside the messages
        texts.append(_text(body["system"]))
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer"):
            break
        system.append(dict(m))
        texts.append(_text(m.get("content")))
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    rendered = "".join(texts) + (json.dumps(tools, sort_keys=True) if tools else "")
    if not rendered:
        return None
    block = BLOCK_TOKENS * CHARS_PER_TOKEN
    blocks = rendered[skip * block : (skip + take) * block] or rendered
    digest = hashlib.blake2b(blocks.encode(), digest_size=6).hexdigest()
    return Anchor(tuple(system), tuple(tools), len(rendered), digest)


class AnchorBook:
    """The last anchor seen per agent (bounded, least recently seen dropped first)."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._anchors: OrderedDict[str, Anchor] = OrderedDict()

    def remember(self, agent: str, anchor: Anchor) -> None:
        self._anchors[agent] = anchor
        self._anchors.move_to_end(agent)
        while len(self._anchors) > self.capacity:
            self._anchors.popitem(last=False)

    def get(self, agent: str) -> Anchor | None:
        return self._anchors.get(agent)
