"""What a response tells the router: token usage and the tool calls it ends in.

OpenAI and Anthropic answers (streamed or not) are read here. The stream filter also
drops the usage chunk the router forced (`stream_options.include_usage`) when the
client did not ask for it, so clients see exactly the stream they requested.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router import codec
from router.policy.predictor import tool_key_of_calls


@dataclass
class Usage:
    """What the engine reported for one call (None fields: not reported)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    tool: str | None = None

    @property
    def context_tokens(self) -> int | None:
        if self.prompt_tokens is None:
            return None
        return self.prompt_tokens + (self.completion_tokens or 0)


def tool_key(calls: list[Any]) -> str | None:
    """The predictor's key for the tool calls a response ends in ("bash:pytest"); None
    when it ends in none (the policy is told only about tool calls)."""
    calls = [c for c in calls if isinstance(c, dict)]
    return tool_key_of_calls(calls) if calls else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# --- OpenAI ---------------------------------------------------------------------------
def openai_usage(doc: dict[str, Any], usage: Usage) -> None:
    u = doc.get("usage")
    if isinstance(u, dict):
        usage.prompt_tokens = _int(u.get("prompt_tokens"))
        usage.completion_tokens = _int(u.get("completion_tokens"))


def _json_object(content: bytes) -> dict | None:
    """The answer body as a JSON object, or None: a garbled engine answer is relayed as is,
    it just carries no usage."""
    try:
        doc = codec.loads(content)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def openai_body(content: bytes) -> Usage:
    """Usage and tool call of a non-streamed chat/completions answer."""
    usage = Usage()
    doc = _json_object(content)
    if doc is None:
        return usage
    openai_usage(doc, usage)
    for choice in doc.get("choices") or []:
        message = choice.get("message") if isinstance(choice, dict) else None
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list) and calls:
            usage.tool = tool_key(calls)
            break
    return usage


class OpenAIStream:
    """Reads an OpenAI SSE stream event by event, passing bytes through unchanged except
    the forced usage chunk (dropped, or its `usage` removed, unless the client asked)."""

    def __init__(self, client_wants_usage: bool) -> None:
        self.client_wants_usage = client_wants_usage
        self.usage = Usage()
        self._buffer = b""
        self._names: dict[int, str] = {}  # tool call index -> function name
        self._args: dict[int, list[str]] = {}  # tool call index -> argument fragments

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to send on for this chunk (whole events only; partial ones wait)."""
        self._buffer += chunk.replace(b"\r\n", b"\n") if b"\r" in chunk else chunk
        if b"\n\n" not in self._buffer:
            return b""
        *events, self._buffer = self._buffer.split(b"\n\n")
        return b"".join(self._event(e) for e in events)

    def flush(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return self._event(rest) if rest.strip() else b""

    def finish(self) -> Usage:
        calls = [
            {"function": {"name": name, "arguments": "".join(self._args.get(i, []))}}
            for i, name in sorted(self._names.items())
        ]
        self.usage.tool = tool_key(calls)
        return self.usage

    def _event(self, event: bytes) -> bytes:
        out = event + b"\n\n"
        has_usage = b'"usage"' in event and b'"usage":null' not in event.replace(b" ", b"")
        if not has_usage and b'"tool_calls"' not in event:
            return out
        doc = _sse_json(event)
        if doc is None:
            return out
        if has_usage:
            openai_usage(doc, self.usage)
            if not self.client_wants_usage:
                if not doc.get("choices"):
                    return b""
                doc.pop("usage", None)
                out = b"data: " + codec.dumps(doc) + b"\n\n"
        self._tool_delta(doc)
        return out

    def _tool_delta(self, doc: dict[str, Any]) -> None:
        for choice in doc.get("choices") or []:
            delta = choice.get("delta") if isinstance(choice, dict) else None
            calls = delta.get("tool_calls") if isinstance(delta, dict) else None
            for call in calls if isinstance(calls, list) else []:
                index = call.get("index", 0) if isinstance(call, dict) else None
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(index, int) or not isinstance(fn, dict):
                    continue
                if fn.get("name") and isinstance(fn["name"], str):
                    self._names[index] = fn["name"]
                if isinstance(fn.get("arguments"), str):
                    self._args.setdefault(index, []).append(fn["arguments"])


# --- Anthropic ------------------------------------------------------------------------
def anthropic_usage(u: Any, usage: Usage) -> None:
    if not isinstance(u, dict):
        return
    prompt = [
        _int(u.get(k))
        for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    ]
    if prompt[0] is not None:
        usage.prompt_tokens = sum(p or 0 for p in prompt)
    if _int(u.get("output_tokens")) is not None:
        usage.completion_tokens = u["output_tokens"]


def anthropic_body(content: bytes) -> Usage:
    usage = Usage()
    doc = _json_object(content)
    if doc is None:
        return usage
    anthropic_usage(doc.get("usage"), usage)
    blocks = doc.get("content") if isinstance(doc.get("content"), list) else []
    usage.tool = tool_key(
        [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use"]
    )
    return usage


class AnthropicStream:
    """Reads a Messages SSE stream for usage and its tool_use blocks; passes every event
    unchanged, whole events only (so an error event can always follow cleanly)."""

    def __init__(self, client_wants_usage: bool = True) -> None:
        self.usage = Usage()
        self._buffer = b""
        self._calls: dict[Any, tuple[str, list[str]]] = {}  # block index -> (name, input)

    def feed(self, chunk: bytes) -> bytes:
        self._buffer += chunk.replace(b"\r\n", b"\n") if b"\r" in chunk else chunk
        if b"\n\n" not in self._buffer:
            return b""
        *events, self._buffer = self._buffer.split(b"\n\n")
        for e in events:
            self._event(e)
        return b"".join(e + b"\n\n" for e in events)

    def flush(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return rest + b"\n\n" if rest.strip() else b""

    def finish(self) -> Usage:
        calls = [{"name": name, "input": "".join(args)} for name, args in self._calls.values()]
        self.usage.tool = tool_key(calls)
        return self.usage

    def _event(self, event: bytes) -> None:
        if b'"usage"' not in event and b"tool_use" not in event and b"input_json" not in event:
            return
        doc = _sse_json(event)
        if doc is None:
            return
        kind = doc.get("type")
        if kind == "message_start" and isinstance(doc.get("message"), dict):
            anthropic_usage(doc["message"].get("usage"), self.usage)
        elif kind == "message_delta":
            anthropic_usage(doc.get("usage"), self.usage)
        elif kind == "content_block_start":
            block = doc.get("content_block")
            if isinstance(block, dict) and block.get("type") == "tool_use":
                self._calls[doc.get("index")] = (str(block.get("name") or ""), [])
        elif kind == "content_block_delta" and doc.get("index") in self._calls:
            delta = doc.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("partial_json"), str):
                self._calls[doc["index"]][1].append(delta["partial_json"])


def _sse_json(event: bytes) -> dict[str, Any] | None:
    """The JSON object in an SSE event's data lines, or None."""
    data = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
    if not data or data == b"[DONE]":
        return None
    try:
        doc = codec.loads(data)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None
