"""SGLang's Anthropic Messages entrypoint, carrying what a chat request carries.

SGLang serves `/v1/messages` by translating the request into a chat request, running that,
and translating the answer back (`sglang/srt/entrypoints/anthropic/serving.py`, alike in
0.5.17 and 0.5.23). Its request model declares Anthropic's fields only, so the SGLang fields
the router adds to every request are dropped there: without `session_id` the request's KV is
stamped with no program (the router's hints never reach it, and `/mori/residency` never shows
it), without `rid` the router cannot abort it. The patch

- carries the SGLang request fields in CARRIED from the raw Messages body into the chat
  request SGLang builds of it (a value of the wrong type is a 400 in Anthropic's shape), so a
  Messages request runs under the router's program exactly as a chat request does;
- returns the device/host split of the cached prompt (SGLang's `sglext`, when the request
  set `return_cached_tokens_details`) the way a chat answer does: at the top level of a
  message, and on a stream's `message_delta` event (the chat stream's own `sglext` chunk,
  which SGLang's translation skips, is read on the way).

Everything else (the translation, tool use, thinking, usage, errors) stays SGLang's own.
Installed in the HTTP process only (sglang_common.register_common).
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import AsyncIterator
from typing import Any

_S = "sglang.srt.entrypoints"
SERVING = f"{_S}.anthropic.serving.AnthropicServing"
CHAT = f"{_S}.openai.serving_chat.OpenAIServingChat"
# What the hooks below patch (mori-sglang checks they exist).
TARGETS = (
    f"{SERVING}._handle_non_streaming",
    f"{SERVING}._handle_streaming",
    f"{SERVING}._convert_response",
    f"{SERVING}._generate_anthropic_stream",
    f"{SERVING}._error_response",
    f"{CHAT}._generate_chat_stream",
    f"{_S}.anthropic.protocol.AnthropicMessagesResponse",
)

# SGLang chat request fields carried from a Messages body, with the JSON type each must have.
CARRIED: dict[str, type] = {
    "session_id": str,  # the program (the router's id): stamps the KV
    "rid": str,  # the request id /abort_request names
    "ignore_eos": bool,  # exactly max_tokens tokens (trace replays)
    "return_cached_tokens_details": bool,  # the device/host split of the cached prompt
}
SPLIT_STATE = "mori_sglext"  # request.state attribute: the chat stream's sglext, when seen


class CarryError(ValueError):
    """A carried field of the wrong type (answered 400)."""


def carried(body: Any) -> dict[str, Any]:
    """The CARRIED fields a Messages body sets (a JSON null counts as unset)."""
    out = {}
    for name, kind in CARRIED.items():
        value = body.get(name) if isinstance(body, dict) else None
        if value is None:
            continue
        if not isinstance(value, kind) or (kind is str and not value.strip()):
            raise CarryError(
                f"{name}: must be a {'non-empty string' if kind is str else 'boolean'}"
            )
        out[name] = value
    return out


async def _around_handle(
    original: Any, serving: Any, chat: Any, anthropic: Any, raw: Any, *a: Any, **k: Any
) -> Any:
    """`_handle_non_streaming` / `_handle_streaming`: the chat request takes the carried
    fields before SGLang validates and runs it (the body was read already: it is cached)."""
    try:
        fields = carried(await raw.json())
    except CarryError as e:
        return serving._error_response(
            status_code=400, error_type="invalid_request_error", message=str(e)
        )
    for name, value in fields.items():
        setattr(chat, name, value)
    return await original(serving, chat, anthropic, raw, *a, **k)


@functools.cache
def _with_sglext() -> type:
    from sglang.srt.entrypoints.anthropic.protocol import AnthropicMessagesResponse

    class MessagesResponseWithSglext(AnthropicMessagesResponse):
        """A message with the chat answer's `sglext` beside its usage."""

        sglext: dict[str, Any] | None = None

    return MessagesResponseWithSglext


def _after_convert_response(message: Any, serving: Any, response: Any, *a: Any, **k: Any) -> Any:
    """A non-streamed message keeps the chat answer's `sglext` (the split it asked for)."""
    ext = getattr(response, "sglext", None)
    if ext is None:
        return message
    fields = {name: getattr(message, name) for name in type(message).model_fields}
    return _with_sglext().model_construct(**fields, sglext=ext.model_dump())


def _around_chat_stream(
    original: Any, chat: Any, adapted: Any, request: Any, raw: Any, *a: Any, **k: Any
) -> Any:
    """The chat stream under an Anthropic stream: its `sglext` chunk is kept for the
    `message_delta` event (other chat streams pass untouched)."""
    stream = original(chat, adapted, request, raw, *a, **k)
    state = getattr(raw, "state", None)
    if getattr(state, SPLIT_STATE, None) is None:
        return stream
    return _watch_sglext(stream, state)


async def _watch_sglext(stream: Any, state: Any) -> AsyncIterator[str]:
    async with contextlib.aclosing(stream):
        async for line in stream:
            if '"sglext"' in line and line.startswith("data: "):
                doc = json.loads(line[len("data: ") :])
                if isinstance(doc, dict) and doc.get("sglext"):
                    setattr(state, SPLIT_STATE, doc["sglext"])
            yield line


def _around_anthropic_stream(
    original: Any,
    serving: Any,
    adapted: Any,
    chat: Any,
    anthropic: Any,
    raw: Any,
    *a: Any,
    **k: Any,
) -> Any:
    """An Anthropic stream whose request asked for the split carries it on `message_delta`."""
    stream = original(serving, adapted, chat, anthropic, raw, *a, **k)
    if not getattr(chat, "return_cached_tokens_details", False):
        return stream
    setattr(raw.state, SPLIT_STATE, {})  # before the stream opens its chat stream
    return _add_sglext(stream, raw.state)


async def _add_sglext(stream: Any, state: Any) -> AsyncIterator[str]:
    async with contextlib.aclosing(stream):
        async for frame in stream:
            ext = getattr(state, SPLIT_STATE)
            if ext and frame.startswith("event: message_delta\ndata: "):
                head, data = frame.split("\ndata: ", 1)
                doc = json.loads(data) | {"sglext": ext}
                frame = f"{head}\ndata: {json.dumps(doc, separators=(',', ':'))}\n\n"
            yield frame


def register() -> None:
    """The hooks (HTTP process): SGLang applies them before it serves."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    around = HookType.AROUND
    for target, hook, kind in (
        (f"{SERVING}._handle_non_streaming", _around_handle, around),
        (f"{SERVING}._handle_streaming", _around_handle, around),
        (f"{SERVING}._convert_response", _after_convert_response, HookType.AFTER),
        (f"{SERVING}._generate_anthropic_stream", _around_anthropic_stream, around),
        (f"{CHAT}._generate_chat_stream", _around_chat_stream, around),
    ):
        HookRegistry.register(target, hook, kind)
