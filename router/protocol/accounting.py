"""What a response tells the router: token usage, prompt-cache hits, the tool calls it ends in.

OpenAI and Anthropic answers (streamed or not) are read here. The stream filters also
drop what the router forced when the client did not ask for it (the usage chunk of
`stream_options.include_usage`, SGLang's `sglext` cache details), so clients see exactly
the stream they requested.

Prompt-cache hits, as SGLang (0.5.17 and 0.5.23 alike) reports them:
- `usage.prompt_tokens_details.cached_tokens`: all cached prompt tokens, sent only when the
  server runs with `--enable-cache-report` (`mori-sglang` turns it on) and the count is > 0;
- the device/host split, only when the request sets `return_cached_tokens_details: true`
  (CACHE_DETAILS_FLAG) and some prompt token was cached: at the top level of a plain
  answer, or in a stream as its own chunk `{"choices": [], "sglext": {"cached_tokens_details":
  {"device": D, "host": H}}}` just before the usage chunk;
- on Anthropic answers, `usage.cache_read_input_tokens` (cached, left out at 0; the usage's
  `input_tokens` are the rest of the prompt), and the split, with the MORI plugin
  (engine_patches/messages.py), as `sglext` at the top level of a message or of a stream's
  `message_delta` event.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from router.policy.predictor import tool_key_of_calls
from router.wire import codec

# Request field that makes SGLang report its device/host split of cached prompt tokens.
CACHE_DETAILS_FLAG = "return_cached_tokens_details"
# `mori emulate` only: the request's arrival, first token and end on the engine clock, in
# `sglext.engine_times` of the streamed answer (`mori calibrate` times the emulator by them)
ENGINE_TIMES_FLAG = "mori_engine_times"


class CacheHits(NamedTuple):
    """Where one call's prompt tokens came from: device KV, host KV (loaded back), computed."""

    device: int
    host: int
    miss: int


@dataclass
class Usage:
    """What the engine reported for one call (None fields: not reported)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    tool: str | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    cached_device: int | None = None  # sglext.cached_tokens_details (sent only on a hit)
    cached_host: int | None = None
    # sglext.engine_times (an engine that reports them: the emulator): the engine's own
    # wall seconds for the call, arrival to end, without the HTTP path either way
    engine_s: float | None = None

    @property
    def context_tokens(self) -> int | None:
        if self.prompt_tokens is None:
            return None
        return self.prompt_tokens + (self.completion_tokens or 0)

    def hits(self) -> CacheHits | None:
        """The call's device/host/miss split, or None when the engine reported no usage.
        SGLang leaves out every cache figure when nothing was cached (and, without
        --enable-cache-report, always: `mori-sglang` turns it on), so no figures is an
        all-miss; a cached count without a split (an engine with one tier) is device hits."""
        if self.prompt_tokens is None:
            return None
        if self.cached_device is not None:
            device, host = self.cached_device, self.cached_host or 0
        else:
            device, host = self.cached_tokens or 0, 0
        return CacheHits(device, host, max(self.prompt_tokens - device - host, 0))


def tool_key(calls: list[Any]) -> str | None:
    """The predictor's key for the tool calls a response ends in ("bash:pytest"); None
    when it ends in none (the policy is told only about tool calls)."""
    calls = [c for c in calls if isinstance(c, dict)]
    return tool_key_of_calls(calls) if calls else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# --- OpenAI ---------------------------------------------------------------------------
def openai_usage(doc: dict[str, Any], usage: Usage) -> None:
    """Fold one answer (or stream chunk) into `usage`: token counts and cache hits."""
    u = doc.get("usage")
    if isinstance(u, dict):
        usage.prompt_tokens = _int(u.get("prompt_tokens"))
        usage.completion_tokens = _int(u.get("completion_tokens"))
        details = u.get("prompt_tokens_details")
        if isinstance(details, dict):
            usage.cached_tokens = _int(details.get("cached_tokens"))
    fold_sglext(doc, usage)


def fold_sglext(doc: dict[str, Any], usage: Usage) -> None:
    """Fold SGLang's `sglext` into `usage`: the device/host split of the cached prompt
    (`cached_tokens_details`) and, where the engine reports it, its own time for the call
    (`engine_times`: its clock's arrival and end, over its time scale)."""
    ext = doc.get("sglext")
    if not isinstance(ext, dict):
        return
    split = ext.get("cached_tokens_details")
    if isinstance(split, dict):
        usage.cached_device = _int(split.get("device")) or 0
        usage.cached_host = _int(split.get("host")) or 0
    times = ext.get("engine_times")
    if isinstance(times, dict):
        usage.engine_s = _engine_s(times)


def _engine_s(times: dict[str, Any]) -> float | None:
    """Wall seconds from `arrived` to `done` on an engine clock running `time_scale` times
    real time; None unless all three are numbers and the span is not negative."""
    arrived, done, scale = (times.get(k) for k in ("arrived", "done", "time_scale"))
    numbers = (arrived, done, scale)
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in numbers):
        return None
    span = (done - arrived) / scale if scale > 0 else -1.0
    return span if span >= 0 else None


def without_sglext(content: bytes) -> bytes:
    """A plain answer without the `sglext` cache details the router asked for itself."""
    doc = _json_object(content) if b'"sglext"' in content else None
    if doc is None or "sglext" not in doc:
        return content
    doc.pop("sglext")
    return codec.dumps(doc)


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


_READ_MARKERS = (b'"usage"', b'"sglext"', b'"tool_calls"')  # an event the filter must read
_DONE = (b"data: [DONE]", b"data:[DONE]")
_SHORT = 32  # an event this short may be the end marker (with its whitespace)
_NULL_USAGE = re.compile(rb'"usage"\s*:\s*null')  # every chunk of some engines says so


class OpenAIStream:
    """Reads an OpenAI SSE stream event by event, passing bytes through unchanged except
    the forced usage and cache-details chunks (dropped, or the forced field removed from a
    chunk that also carries choices, unless the client asked)."""

    def __init__(self, client_wants_usage: bool, client_wants_details: bool = True) -> None:
        self.client_wants_usage = client_wants_usage
        self.client_wants_details = client_wants_details
        self.usage = Usage()
        self.ended = False  # the `[DONE]` event went by: the client has the whole answer
        self._buffer = b""
        self._names: dict[int, str] = {}  # tool call index -> function name
        self._args: dict[int, list[str]] = {}  # tool call index -> argument fragments

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to send on for this chunk (whole events only; partial ones wait).

        The events before the first one that names a field the router reads go on as
        they are, joined in one call: most events of an answer are plain content deltas,
        and looking at them one by one was most of the filter's cost."""
        self._buffer += chunk.replace(b"\r\n", b"\n") if b"\r" in chunk else chunk
        if b"\n\n" not in self._buffer:
            return b""
        buffer = self._buffer
        *events, self._buffer = buffer.split(b"\n\n")
        marks = [at for mark in _READ_MARKERS if (at := buffer.find(mark)) >= 0]
        # a mark holds no newline, so the separators before it are the split's own
        plain = buffer.count(b"\n\n", 0, min(marks)) if marks else len(events)
        out = [b"\n\n".join(events[:plain]) + b"\n\n"] if plain else []
        if not self.ended and plain and b"[DONE]" in out[0]:
            self.ended = any(e.strip() in _DONE for e in events[:plain])
        for event in events[plain:]:
            out.append(self._event(event))
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return self._event(rest) if rest.strip() else b""

    def finish(self) -> Usage:
        if not self._names:  # most answers: no tool call
            return self.usage
        calls = [
            {"function": {"name": name, "arguments": "".join(self._args.get(i, []))}}
            for i, name in sorted(self._names.items())
        ]
        self.usage.tool = tool_key(calls)
        return self.usage

    def _event(self, event: bytes) -> bytes:
        out = event + b"\n\n"
        if len(event) < _SHORT and event.strip() in _DONE:
            self.ended = True
            return out
        has_usage = b'"usage"' in event and not _NULL_USAGE.search(event)
        has_ext = b'"sglext"' in event
        if not has_usage and not has_ext and b'"tool_calls"' not in event:
            self.ended = self.ended or event.strip() in _DONE
            return out
        doc = _sse_json(event)
        if doc is None:
            return out
        if has_usage or has_ext:
            openai_usage(doc, self.usage)
            wanted = {"usage": self.client_wants_usage, "sglext": self.client_wants_details}
            forced = [k for k, want in wanted.items() if doc.get(k) is not None and not want]
            if forced:
                if not doc.get("choices"):
                    return b""
                for key in forced:
                    doc.pop(key)
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
    """Fold an Anthropic `usage` object into `usage`: the prompt is its input tokens, cache
    reads and cache writes; the cache reads are its cached prefix (a stream's
    `message_delta` may carry the output alone: the prompt counts stay)."""
    if not isinstance(u, dict):
        return
    prompt = [
        _int(u.get(k))
        for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    ]
    if prompt[0] is not None:
        usage.prompt_tokens = sum(p or 0 for p in prompt)
        usage.cached_tokens = prompt[1]
    if _int(u.get("output_tokens")) is not None:
        usage.completion_tokens = u["output_tokens"]


def anthropic_doc(doc: dict[str, Any], usage: Usage) -> None:
    """Fold a Messages answer, or a stream's `message_start` / `message_delta` event, into
    `usage`: its usage and the cache split beside it."""
    message = doc.get("message") if doc.get("type") == "message_start" else doc
    if isinstance(message, dict):
        anthropic_usage(message.get("usage"), usage)
    fold_sglext(doc, usage)


def anthropic_body(content: bytes) -> Usage:
    usage = Usage()
    doc = _json_object(content)
    if doc is None:
        return usage
    anthropic_doc(doc, usage)
    blocks = doc.get("content") if isinstance(doc.get("content"), list) else []
    usage.tool = tool_key(
        [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use"]
    )
    return usage


class AnthropicStream:
    """Reads a Messages SSE stream for usage and its tool_use blocks; passes every event on,
    whole events only (so an error event can always follow cleanly), unchanged but for the
    cache split the router asked for itself (removed unless the client asked too)."""

    def __init__(self, client_wants_details: bool = True) -> None:
        self.client_wants_details = client_wants_details
        self.usage = Usage()
        self.ended = False  # `message_stop` went by: the client has the whole answer
        self._buffer = b""
        self._calls: dict[Any, tuple[str, list[str]]] = {}  # block index -> (name, input)

    def feed(self, chunk: bytes) -> bytes:
        self._buffer += chunk.replace(b"\r\n", b"\n") if b"\r" in chunk else chunk
        if b"\n\n" not in self._buffer:
            return b""
        *events, self._buffer = self._buffer.split(b"\n\n")
        return b"".join(self._event(e) for e in events)

    def flush(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return self._event(rest) if rest.strip() else b""

    def finish(self) -> Usage:
        calls = [{"name": name, "input": "".join(args)} for name, args in self._calls.values()]
        self.usage.tool = tool_key(calls)
        return self.usage

    def _event(self, event: bytes) -> bytes:
        out = event + b"\n\n"
        if b'"usage"' not in event and b"tool_use" not in event and b"input_json" not in event:
            if b"message_stop" in event:
                doc = _sse_json(event)
                self.ended = self.ended or (doc is not None and doc.get("type") == "message_stop")
            return out
        doc = _sse_json(event)
        if doc is None:
            return out
        kind = doc.get("type")
        if kind in ("message_start", "message_delta"):
            anthropic_doc(doc, self.usage)
            if "sglext" in doc and not self.client_wants_details:
                doc.pop("sglext")
                out = b"event: " + kind.encode() + b"\ndata: " + codec.dumps(doc) + b"\n\n"
        elif kind == "content_block_start":
            block = doc.get("content_block")
            if isinstance(block, dict) and block.get("type") == "tool_use":
                self._calls[doc.get("index")] = (str(block.get("name") or ""), [])
        elif kind == "content_block_delta" and doc.get("index") in self._calls:
            delta = doc.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("partial_json"), str):
                self._calls[doc["index"]][1].append(delta["partial_json"])
        return out


def _sse_json(event: bytes) -> dict[str, Any] | None:
    """The JSON object in an SSE event's data lines, or None."""
    if b"\n" not in event:  # one line, as engines send: no join
        data = event[5:].strip() if event.startswith(b"data:") else b""
    else:
        lines = event.split(b"\n")
        data = b"".join(line[5:].strip() for line in lines if line.startswith(b"data:"))
    if not data or data == b"[DONE]":
        return None
    try:
        doc = codec.loads(data)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None
