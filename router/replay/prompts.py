"""Prompt text for replaying token-count traces, and the token counting it is built for.

A trace only records token counts, but a serving system caches *text* (token ids) by
prefix. So replay synthesises a conversation per program whose rendered prompt has about
`input_tokens` tokens and whose first `reused_tokens` tokens repeat the previous call's
prompt and answer, exactly like an agent that appends the tool result to its history.

Token counting convention (shared with the emulator, `mori emulate`): a chat request is
rendered as `<role>content\\n` per message (tools, when given, first as their JSON) and
every started group of `CHARS_PER_TOKEN` characters is one token. Against a real SGLang
the counts are approximate (its tokenizer decides), but the prefix structure is the same,
so its radix cache sees the reuse the trace describes.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

CHARS_PER_TOKEN = 4
# 3-letter words + a space: one token each under CHARS_PER_TOKEN, so text is easy to size.
WORDS = [
    "the",
    "and",
    "for",
    "run",
    "fix",
    "add",
    "log",
    "map",
    "key",
    "set",
    "get",
    "put",
    "new",
    "old",
    "top",
    "end",
    "use",
    "try",
    "let",
    "var",
    "def",
    "API",
    "src",
    "lib",
    "doc",
    "bin",
    "dir",
    "cfg",
    "env",
    "tmp",
    "out",
    "err",
    "arg",
    "cmd",
    "git",
    "pip",
    "npm",
    "web",
    "row",
    "col",
    "sum",
]
# Prefix cuts this close to the full history keep it whole (traces round reuse to pages).
KEEP_HISTORY_SLACK_TOKENS = 256
# A program's first prompt opens with a short task message, its context after it: a reuse
# that drops back into the context (a trace's cache break or compaction) keeps the
# conversation's start, as an agent's does, so a router naming programs by that start
# (router.protocol.identity) still sees one program; a reuse shorter than the task is a
# new conversation.
TASK_TOKENS = 32

Message = dict[str, Any]


def count_tokens(text: str) -> int:
    """Tokens of `text`: every started group of CHARS_PER_TOKEN characters."""
    return -(-len(text) // CHARS_PER_TOKEN)


def content_text(content: Any) -> str:
    """The text of an OpenAI message `content`: a string, text parts, or nothing."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p
        )
    raise ValueError("content must be a string, a list of content parts or null")


def render_message(message: Message) -> str:
    text = content_text(message.get("content"))
    if message.get("tool_calls"):
        text += json.dumps(message["tool_calls"], sort_keys=True, separators=(",", ":"))
    return f"<{message.get('role', '')}>{text}\n"


def render_chat(messages: Sequence[Message], tools: Sequence[Any] | None = None) -> str:
    """The prompt text a chat request stands for (what the emulator counts and caches)."""
    head = json.dumps(list(tools), sort_keys=True, separators=(",", ":")) + "\n" if tools else ""
    return head + "".join(render_message(m) for m in messages)


def common_prefix_tokens(a: str, b: str) -> int:
    """Whole tokens two texts share from their start."""
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; binary search keeps it in C
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo // CHARS_PER_TOKEN


def filler(rng: random.Random, chars: int) -> str:
    """`chars` characters of word salad (deterministic for a seeded rng)."""
    words: list[str] = []
    size = 0
    while size < chars:
        words.append(rng.choice(WORDS) + " ")
        size += CHARS_PER_TOKEN
    return "".join(words)[: max(0, chars)]


def output_text(seed: str, tokens: int) -> str:
    """`tokens` tokens of deterministic answer text for `seed` (used by the emulator)."""
    start = int(hashlib.blake2b(seed.encode(), digest_size=4).hexdigest(), 16)
    return "".join(WORDS[(start + 7 * i) % len(WORDS)] + " " for i in range(tokens))


def _seed(*parts: object) -> int:
    return int(hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest(), 16)


def _message_with_tokens(role: str, tokens: int, rng: random.Random) -> Message:
    """A message rendering to exactly `tokens` tokens (at least its own markup)."""
    overhead = len(render_message({"role": role, "content": ""}))
    return {"role": role, "content": filler(rng, tokens * CHARS_PER_TOKEN - overhead)}


def _cut(messages: list[Message], tokens: int) -> list[Message]:
    """The messages whose rendering is (about) the first `tokens` tokens of the history."""
    budget = tokens * CHARS_PER_TOKEN
    kept: list[Message] = []
    for m in messages:
        size = len(render_message(m))
        if size <= budget:
            kept.append(m)
            budget -= size
            continue
        text = content_text(m.get("content"))
        markup = size - len(text)
        if budget > markup:
            kept.append({"role": m["role"], "content": text[: budget - markup]})
        break
    return kept


@dataclass
class TokenDrift:
    """How many more tokens the engine counts in a prompt than this module's convention,
    learnt from the engine's usage, so a replay sends the trace's token counts as the
    engine counts them. A real tokenizer adds its chat template's markers to every message
    and re-tokenizes a model's answer into more tokens than it generated (a random-weight
    model's into 1.5-5x): uncorrected, SGLang saw 14-18 % more prompt tokens than the trace
    gave (bench/results/2026-11-28-model-vs-engine.md). One per replay: one tokenizer.
    Against the emulator (which counts by the convention) it stays 0."""

    first: float = 0.0  # mean drift of a program's first prompt
    growth: float = 0.0  # mean growth of a program's drift from one prompt to the next
    _firsts: int = 0
    _steps: int = 0

    def learn_first(self, drift: int) -> None:
        self._firsts += 1
        self.first += (drift - self.first) / self._firsts

    def learn_growth(self, growth: int) -> None:
        self._steps += 1
        self.growth += (growth - self.growth) / self._steps


@dataclass
class Conversation:
    """The growing chat of one replayed program.

    `next_messages(...)` gives the request for the next step; `record_answer(text)` appends
    what the server answered, so the next prompt repeats it as the agent would;
    `record_usage(prompt_tokens)` tells it what the engine counted in the prompt it sent.
    """

    program_id: str
    agent: str | None = None
    anchor_tokens: int = 0
    seed: int = 0
    inherit_tokens: int = 0  # a fork: the first prompt repeats this much of the parent's
    drift: TokenDrift = field(default_factory=TokenDrift)  # shared by a replay's programs
    messages: list[Message] = field(default_factory=list)
    _inherited: list[Message] = field(default_factory=list, init=False)
    _rng: random.Random = field(init=False)
    _sent: int = field(default=0, init=False)  # the last prompt's tokens, by the convention
    _drift: int | None = field(default=None, init=False)  # the engine's count less _sent

    def __post_init__(self) -> None:
        self._rng = random.Random(_seed(self.seed, self.program_id))

    def next_messages(
        self, input_tokens: int, reused_tokens: int, blocks: Sequence[tuple[str, int]] = ()
    ) -> list[Message]:
        """Messages of about `input_tokens` tokens, as the engine counts them, sharing
        `reused_tokens` with the history. Named `blocks` (scoped id, tokens: the trace's
        `segments`) beyond the reused part are one message each, whose text follows from
        the id alone, so two agents' prompts that hold the same block hold the same text
        (a round's gathered answers); the last message takes the engine's drift."""
        expected = self.drift.first if self._drift is None else self._drift + self.drift.growth
        input_tokens -= round(expected)  # a tokenizer that counts fewer gets more text
        if not self.messages and not blocks:
            self.messages = self._first(input_tokens)
            return self._send()
        history = count_tokens(render_chat(self.messages)) if self.messages else 0
        counted = history + (self._drift or 0)  # the history as the engine counts it
        if reused_tokens < counted - KEEP_HISTORY_SLACK_TOKENS:
            kept = reused_tokens * history // max(1, counted)
            self.messages = _cut(self.messages, kept)  # the agent compacted
            if self._drift is not None:
                self._drift = self._drift * kept // max(1, history)
            history = count_tokens(render_chat(self.messages))
        end = 0
        for block_id, tokens in blocks:
            end += tokens
            if end > history:  # not in the history yet
                rng = random.Random(_seed(self.seed, "block", block_id))
                self.messages.append(_message_with_tokens("user", tokens, rng))
                history += tokens
        if input_tokens > history:
            self.messages.append(_message_with_tokens("user", input_tokens - history, self._rng))
        return self._send()

    def _send(self) -> list[Message]:
        self._sent = count_tokens(render_chat(self.messages))
        return list(self.messages)

    def record_usage(self, prompt_tokens: int) -> None:
        """The engine counted `prompt_tokens` in the prompt last sent: the drift it shows
        (and its growth since the previous prompt) sizes the next prompts."""
        drift = prompt_tokens - self._sent
        if self._drift is None:
            self.drift.learn_first(drift)
        else:
            self.drift.learn_growth(drift - self._drift)
        self._drift = drift

    def inherit(self, parent_messages) -> None:
        """A forked subagent: its first prompt starts with the parent's conversation, cut
        at `inherit_tokens` tokens (byte-identical, so an engine shares the prefix)."""
        self._inherited = _cut(list(parent_messages), self.inherit_tokens)

    def record_answer(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})

    def _first(self, input_tokens: int) -> list[Message]:
        if self._inherited:
            shared = count_tokens(render_chat(self._inherited))
            rest = max(input_tokens - shared, 0)
            return [*self._inherited, _message_with_tokens("user", rest, self._rng)]
        anchor = min(self.anchor_tokens, input_tokens)
        if anchor <= 0:
            return self._opening(input_tokens)
        # The agent role's shared prefix: the same text in every program of that role.
        role_rng = random.Random(_seed(self.seed, "anchor", self.agent))
        system = _message_with_tokens("system", anchor, role_rng)
        return [system, *self._opening(input_tokens - anchor)]

    def _opening(self, tokens: int) -> list[Message]:
        """The first user messages, `tokens` tokens in all: the task (`TASK_TOKENS`), then
        the context; one message when there is too little for two."""
        if tokens < 2 * TASK_TOKENS:
            return [_message_with_tokens("user", tokens, self._rng)]
        task = _message_with_tokens("user", TASK_TOKENS, self._rng)
        return [task, _message_with_tokens("user", tokens - TASK_TOKENS, self._rng)]
