"""The two wire APIs a replay speaks, each with its own SDK: OpenAI chat completions and
Anthropic Messages (what Claude Code speaks).

One step is the same request either way: the conversation so far, exactly `max_tokens`
answer tokens (SGLang's `ignore_eos`), SGLang's device/host split of the cached prompt
(`return_cached_tokens_details`), streamed. The program id rides where each API's clients
put it: the body's `program_id` on chat, `metadata.user_id` on Messages (the router reads
both, docs/router.md "Program identity"). Leading system messages become Messages'
`system`, so an engine renders the same prompt from both (SGLang puts `system` first as a
system message). Each call fills an `Answer` as the stream goes, so a failure half-way
still says which replica served it and what arrived.

The chat conversation goes in `extra_body`, which the OpenAI SDK merges into the JSON body
after its request transform: the transform walks every message against the union of
message types (~0.15 ms a message whatever its length, measured with openai 3.57), ~10 ms of
CPU for a 50-message step, on the one event loop that runs every replayed agent; that
stalled the other agents' sends and first tokens (5x compressed, 50 ms of trace time a
request). The body on the wire is the same bytes (`tests/test_replay.py`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import openai

if TYPE_CHECKING:  # imported by `sender` for the Messages API alone: ~1.7 s of imports
    import anthropic

from router.protocol.accounting import CACHE_DETAILS_FLAG, Usage, anthropic_doc, openai_usage

API_NAMES = ("openai", "anthropic")


def errors() -> tuple[type[Exception], ...]:
    """What a failed call raises: the OpenAI SDK's and httpx's errors, and, once a Messages
    sender has loaded it, the Anthropic SDK's and its HTTP library's (httpx in older
    releases, httpx2 in newer ones, which refuse an httpx client): a transport failure
    mid-stream surfaces as the library's own error."""
    found: tuple[type[Exception], ...] = (openai.OpenAIError, httpx.HTTPError)
    if (sdk := sys.modules.get("anthropic")) is not None:
        http = sys.modules[sdk.DefaultAsyncHttpxClient.__mro__[1].__module__.split(".")[0]]
        found += (sdk.AnthropicError, http.HTTPError)
    return found


@dataclass(frozen=True)
class Call:
    """One step's request, API-neutral."""

    model: str
    messages: list[dict[str, Any]]
    max_tokens: int
    program: str | None  # None: the request names no program (a harness's header may)
    headers: dict[str, str]


@dataclass
class Answer:
    """What the streamed answer brought so far."""

    replica: str | None = None  # the router's x-mori-replica header
    routed: str | None = None  # the program the router filed it under (x-mori-program-id)
    first: float | None = None  # trace time of the first content token
    parts: list[str] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)

    def add(self, text: str, now: float) -> None:
        if self.first is None:
            self.first = now
        self.parts.append(text)


Send = Callable[[Answer, Call], Awaitable[None]]


@contextlib.asynccontextmanager
async def sender(
    api: str, chat: openai.AsyncOpenAI, key: str, timeout_s: float, now: Callable[[], float]
) -> AsyncIterator[Send]:
    """The `Send` of API `api`: on the OpenAI client `chat`, or on an Anthropic client of
    the same server (its own HTTP client: the SDK may stand on another HTTP library)."""
    if api == "openai":
        yield lambda answer, call: _openai(chat, now, answer, call)
        return
    import anthropic  # noqa: PLC0415 - the Messages API's SDK, loaded when it is spoken

    async with anthropic.AsyncAnthropic(
        base_url=str(chat.base_url).rstrip("/").removesuffix("/v1"),
        api_key=key,
        timeout=timeout_s,
        max_retries=0,
        http_client=anthropic.DefaultAsyncHttpxClient(trust_env=False),
    ) as messages:
        yield lambda answer, call: _anthropic(messages, now, answer, call)


async def _openai(
    client: openai.AsyncOpenAI, now: Callable[[], float], answer: Answer, call: Call
) -> None:
    raw = await client.chat.completions.with_raw_response.create(
        model=call.model,
        messages=[],  # the slot keeps the key's place; the conversation rides in extra_body
        max_tokens=call.max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={
            "messages": call.messages,
            "ignore_eos": True,
            CACHE_DETAILS_FLAG: True,
            **({"program_id": call.program} if call.program else {}),
        },
        extra_headers=call.headers,
    )
    _answered(answer, raw.headers)
    # the SDK's stream (its SSE decoding, its errors) with each chunk left a dict: a
    # ChatCompletionChunk model costs ~190 us to build against ~30 us, on the one loop
    # that times every replayed agent
    async for chunk in raw.parse(to=openai.AsyncStream[dict]):
        choices = chunk.get("choices")
        text = choices and (choices[0].get("delta") or {}).get("content")
        if text:
            answer.add(text, now())
        if not choices or chunk.get("usage") is not None:  # usage, sglext chunks
            openai_usage(chunk, answer.usage)


async def _anthropic(
    client: anthropic.AsyncAnthropic, now: Callable[[], float], answer: Answer, call: Call
) -> None:
    system, turns = split_system(call.messages)
    raw = await client.messages.with_raw_response.create(
        model=call.model,
        messages=turns,  # type: ignore[arg-type]
        max_tokens=call.max_tokens,
        stream=True,
        extra_body={"ignore_eos": True, CACHE_DETAILS_FLAG: True},
        extra_headers=call.headers,
        **({"system": system} if system else {}),
        **({"metadata": {"user_id": call.program}} if call.program else {}),
    )
    _answered(answer, raw.headers)
    async for event in await raw.parse():
        if event.type == "content_block_delta" and event.delta.type == "text_delta":
            if event.delta.text:
                answer.add(event.delta.text, now())
        elif event.type in ("message_start", "message_delta"):
            anthropic_doc(event.to_dict(), answer.usage)


def _answered(answer: Answer, headers: Any) -> None:
    """What the router's answer headers say: the replica, and the program it filed it under."""
    answer.replica = headers.get("x-mori-replica")
    answer.routed = headers.get("x-mori-program-id")


def split_system(messages: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """Messages' `system` (the leading system messages' text) and the other turns."""
    lead = 0
    while lead < len(messages) and messages[lead].get("role") == "system":
        lead += 1
    system = "\n".join(str(m.get("content") or "") for m in messages[:lead])
    return system, messages[lead:]
