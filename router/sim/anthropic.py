"""The emulator's Anthropic Messages API, shaped as SGLang with the MORI plugin serves
`/v1/messages` (0.5.17 and 0.5.23 alike).

SGLang translates a Messages request into an OpenAI chat request, runs it, and translates
the answer back (`sglang/srt/entrypoints/anthropic/serving.py`); the emulator does the
same, so what the router sees on the wire matches a real replica:

- request: `model`, `messages` (role user/assistant/system, string or content blocks),
  `max_tokens` >= 1 are required; `system`, `tools` (`input_schema`), `tool_choice`
  (auto/any/tool/none), `stop_sequences`, `temperature`, `top_p`, `stream`, `metadata`
  are read. SGLang's request model drops every other field; the MORI plugin carries
  SGLang's own request fields in CARRIED into the chat request (engine_patches/messages.py),
  so a Messages request runs under the router's program (`session_id`), can be aborted
  (`rid`), and can ask for exact lengths and the cache split, as a chat request can.
- answer: `{"id": "msg_...", "type": "message", "role": "assistant", "content": [text,
  tool_use...], "model", "stop_reason" (end_turn, max_tokens, tool_use), "usage":
  {"input_tokens": prompt - cached, "cache_read_input_tokens": cached (when > 0),
  "output_tokens"}}`, plus the chat answer's `sglext` (the device/host split) when the
  request asked for it.
- stream: `message_start` (input usage, output 0), `content_block_start` /
  `content_block_delta` (`text_delta`, `input_json_delta`) / `content_block_stop` per
  block, `message_delta` (stop_reason, output usage, and `sglext` as above),
  `message_stop`; no `ping` events.
- errors: `{"type": "error", "error": {"type", "message"}}` with the HTTP status.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from router.protocol.accounting import CACHE_DETAILS_FLAG
from router.replay.prompts import CHARS_PER_TOKEN
from router.wire.errors import ApiError

# SGLang request fields the MORI plugin carries from a Messages request into its chat request.
CARRIED = ("session_id", "rid", "ignore_eos", CACHE_DETAILS_FLAG)
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ROLES = ("user", "assistant", "system")


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise ApiError(400, message)


def to_chat(body: Any) -> dict[str, Any]:
    """The OpenAI chat request SGLang makes of a Messages request (400 when invalid)."""
    _need(isinstance(body, dict), "the request body must be a JSON object")
    model, max_tokens, messages = body.get("model"), body.get("max_tokens"), body.get("messages")
    _need(isinstance(model, str) and model != "", "model: Field required")
    _need(
        isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0,
        "max_tokens: must be a positive integer",
    )
    _need(isinstance(messages, list), "messages: Input should be a valid list")
    chat: list[dict[str, Any]] = []
    system = _system_text(body.get("system"))
    if system:
        chat.append({"role": "system", "content": system})
    for i, message in enumerate(messages):
        chat.extend(_message(message, i))
    out: dict[str, Any] = {
        "model": model,
        "messages": chat,
        "max_tokens": max_tokens,
        "stream": bool(body.get("stream") or False),
    }
    for name, chat_name in (("temperature", "temperature"), ("top_p", "top_p")):
        if body.get(name) is not None:
            out[chat_name] = body[name]
    tools = _tools(body.get("tools"))
    if tools:
        out["tools"] = tools
    choice = _tool_choice(body.get("tool_choice"), tools)
    if choice is not None:
        out["tool_choice"] = choice
    if out["stream"]:
        out["stream_options"] = {"include_usage": True}
    return out | {name: body[name] for name in CARRIED if body.get(name) is not None}


def _system_text(system: Any) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system if system.strip() else ""
    _need(isinstance(system, list), "system: must be a string or a list of content blocks")
    return "\n".join(b["text"] for b in system if _block(b, "system") == "text" and b.get("text"))


def _block(block: Any, where: str) -> str:
    _need(isinstance(block, dict) and isinstance(block.get("type"), str), f"{where}: bad block")
    return block["type"]


def _message(message: Any, i: int) -> list[dict[str, Any]]:
    """One Messages turn as OpenAI messages (tool results become `tool` messages)."""
    where = f"messages.{i}"
    _need(isinstance(message, dict), f"{where}: Input should be a valid dictionary")
    role, content = message.get("role"), message.get("content")
    _need(role in ROLES, f"{where}.role: Input should be 'user', 'assistant' or 'system'")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    _need(isinstance(content, list), f"{where}.content: must be a string or a list of blocks")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    out: list[dict[str, Any]] = []
    for block in content:
        kind = _block(block, f"{where}.content")
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {})
            function = {"name": str(block.get("name", "")), "arguments": arguments}
            calls.append({"id": str(block.get("id", "")), "type": "function", "function": function})
        elif kind == "tool_result" and role == "user":
            result = block.get("content")
            text = result if isinstance(result, str) else _system_text(result or [])
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text})
    turn: dict[str, Any] = {"role": role, "content": "".join(texts)}
    if calls:
        turn["tool_calls"] = calls
    if texts or calls or role == "assistant":
        out.append(turn)
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    _need(isinstance(tools, list), "tools: Input should be a valid list")
    out = []
    for i, tool in enumerate(tools):
        _need(isinstance(tool, dict) and isinstance(tool.get("name"), str), f"tools.{i}: bad tool")
        schema = tool.get("input_schema")
        if schema is None and tool.get("type") not in (None, "custom"):
            continue  # Anthropic server tools: SGLang skips them
        _need(isinstance(schema, dict), f"tools.{i}.input_schema: Field required")
        function = {"name": tool["name"], "description": tool.get("description") or ""}
        out.append({"type": "function", "function": {**function, "parameters": schema}})
    return out


def _tool_choice(choice: Any, tools: list[dict[str, Any]]) -> Any:
    if choice is None:
        return "auto" if tools else None
    _need(isinstance(choice, dict), "tool_choice: Input should be a valid dictionary")
    kind = choice.get("type")
    _need(kind in ("auto", "any", "tool", "none"), "tool_choice.type: unknown")
    if kind == "none":
        return "none"
    _need(bool(tools) or kind == "auto", f"tool_choice={kind!r} requires at least one tool")
    if kind == "tool":
        names = [t["function"]["name"] for t in tools]
        _need(choice.get("name") in names, "tool_choice references a tool not in tools")
        return {"type": "function", "function": {"name": choice["name"]}}
    return "required" if kind == "any" else ("auto" if tools else None)


# --- answers -------------------------------------------------------------------------
def usage(prompt: int, cached: int, output: int | None) -> dict[str, int]:
    """Anthropic usage from the OpenAI counts: cached prompt tokens are reported apart."""
    out = {"input_tokens": max(prompt - cached, 0)}
    if cached:
        out["cache_read_input_tokens"] = cached
    if output is not None:
        out["output_tokens"] = output
    return out


def message(chat: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed Messages answer from the emulator's chat completion."""
    choice = chat["choices"][0]
    content: list[dict[str, Any]] = []
    if choice["message"].get("content"):
        content.append({"type": "text", "text": choice["message"]["content"]})
    for call in choice["message"].get("tool_calls") or []:
        fn = call["function"]
        content.append(
            {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": _args(fn)}
        )
    u = chat["usage"]
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)  # left out at 0
    answer = {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "content": content or [{"type": "text", "text": ""}],
        "model": chat["model"],
        "stop_reason": STOP_REASONS.get(choice["finish_reason"], "end_turn"),
        "usage": usage(u["prompt_tokens"], cached, u["completion_tokens"]),
    }
    return answer | ({"sglext": chat["sglext"]} if "sglext" in chat else {})


def _args(fn: dict[str, Any]) -> dict[str, Any]:
    try:
        args = json.loads(fn["arguments"])
    except (TypeError, ValueError):
        return {}
    return args if isinstance(args, dict) else {}


def event(doc: dict[str, Any]) -> bytes:
    return f"event: {doc['type']}\ndata: {json.dumps(doc, separators=(',', ':'))}\n\n".encode()


async def stream(
    model: str,
    pieces: AsyncIterator[str],
    start_usage: Callable[[], dict[str, int]],
    finish: Callable[[], tuple[list[dict[str, Any]], str, dict[str, Any]]],
) -> AsyncIterator[bytes]:
    """The Messages event stream of one answer. `pieces` yields "" at the first token, then
    the text as it is generated; `start_usage()` is read at the first token, `finish()`
    (tool calls, OpenAI finish reason, the `sglext` field or nothing) after the last."""
    head = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant"}
    index = chars = 0
    async for piece in pieces:
        if not piece:
            message = {**head, "content": [], "model": model, "usage": start_usage()}
            yield event({"type": "message_start", "message": message})
            continue
        if index == 0:
            block = {"type": "text", "text": ""}
            yield event({"type": "content_block_start", "index": 0, "content_block": block})
            index = 1
        chars += len(piece)
        delta = {"type": "text_delta", "text": piece}
        yield event({"type": "content_block_delta", "index": 0, "delta": delta})
    if index == 1:
        yield event({"type": "content_block_stop", "index": 0})
    calls, reason, ext = finish()
    for call in calls:
        fn = call["function"]
        block = {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": {}}
        yield event({"type": "content_block_start", "index": index, "content_block": block})
        delta = {"type": "input_json_delta", "partial_json": fn["arguments"]}
        yield event({"type": "content_block_delta", "index": index, "delta": delta})
        yield event({"type": "content_block_stop", "index": index})
        index += 1
    output = {"output_tokens": chars // CHARS_PER_TOKEN}
    delta = {"stop_reason": STOP_REASONS.get(reason, "end_turn")}
    yield event({"type": "message_delta", "delta": delta, "usage": output, **ext})
    yield event({"type": "message_stop"})
