"""Intake: from the bytes a client sent to the request the exchange forwards.

`read_body` takes the body off the wire within a size limit and a deadline (a client that
announces more than it sends is cut off with 408 instead of holding its connection).
`prepare` is a pure function: parse, check what the router relies on, resolve the program,
and encode the engine's body. `Intake` runs it inline for ordinary bodies and in a worker
process for large ones, because CPython's JSON codec holds the GIL: a 12 MiB body of many
small objects takes ~0.9 s to decode and re-encode, which inline would freeze every other
stream on the router for that long (a thread would not help).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import os
import secrets
from collections.abc import Mapping
from typing import Any, NamedTuple

from starlette.requests import ClientDisconnect, Request

from router.policy.labels import LabelError, check_label
from router.policy.types import NO_HINTS, AgentHints
from router.protocol import identity
from router.protocol.accounting import CACHE_DETAILS_FLAG, ENGINE_TIMES_FLAG
from router.protocol.agent_identity import Anchor, anchor_of
from router.protocol.sanitize import header_text
from router.protocol.segments import RawSegment, prompt_segments
from router.wire import codec
from router.wire.errors import ApiError

log = logging.getLogger("mori.intake")

MAX_DEPTH = 64  # JSON nesting the router accepts (tool schemas need ~10; engines recurse)


class _Rids:
    """Request ids unique across the router's processes: a random prefix per process and a
    counter (a random id per request cost a getrandom syscall, 2 % of the request path)."""

    def __init__(self) -> None:
        self.renew()
        os.register_at_fork(after_in_child=self.renew)  # a fork must not repeat the parent's

    def renew(self) -> None:
        self.prefix, self.count = secrets.token_hex(8), itertools.count()

    def next(self) -> str:
        return f"{self.prefix}{next(self.count):08x}"


_RIDS = _Rids()


class Prepared(NamedTuple):
    """What the exchange needs of one inference request (small, so it pickles cheaply;
    immutable and built per request: a NamedTuple costs a quarter of a frozen dataclass)."""

    program_id: str
    agent: str | None
    stream: bool
    client_wants_usage: bool
    client_wants_details: bool  # the client set return_cached_tokens_details itself
    rid: str
    # the engine's body: program_id, agent, parent_id, app_id and round_id out, session_id (and
    # rid) in
    content: bytes
    prompt_chars: int  # characters of text the engine's chat template will see
    anchor: Anchor | None = None  # tools + leading system messages (agent identity, warm-ups)
    parent: str | None = None  # the program this one works for (namespaced)
    app: str | None = None  # the application (agent graph) its task runs (namespaced)
    segments: tuple[RawSegment, ...] = ()  # the prompt, message by message (segments.py)
    round: str | None = None  # the All-Gather round the application names (namespaced)
    identity: identity.Identity | None = None  # where the program id came from, its session
    hints: AgentHints = NO_HINTS  # the request's priority and expected output length


class Hints(NamedTuple):
    """The request's headers that `prepare` reads (already decoded), and the key namespace."""

    program_id: str | None = None
    agent: str | None = None
    namespace: str = ""
    parent: str | None = None  # X-Parent-Id
    app: str | None = None  # X-App-Id
    round: str | None = None  # X-Round-Id
    sessions: tuple[tuple[str, str | None], ...] = ()  # harness session headers (identity)
    priority: str | None = None  # X-Mori-Priority
    osl: str | None = None  # X-Mori-Osl


def request_hints(headers: Mapping[str, str], key: str | None) -> Hints:
    """The headers `prepare` reads, decoded as UTF-8 (400 naming the header if not; a
    harness's session header is never refused, see router.protocol.identity)."""
    try:
        program_id = header_text(headers, "x-program-id")
        agent = header_text(headers, "x-agent-role")
        parent = header_text(headers, "x-parent-id")
        app = header_text(headers, "x-app-id")
        round_id = header_text(headers, "x-round-id")
        priority = header_text(headers, "x-mori-priority")
        osl = header_text(headers, "x-mori-osl")
    except LabelError as e:
        raise ApiError(400, str(e), param=e.field, code="invalid_value") from None
    namespace = identity.namespace(key)
    return Hints(
        program_id or None,
        agent or None,
        namespace,
        parent or None,
        app or None,
        round_id or None,
        identity.session_headers(headers),
        priority or None,
        osl or None,
    )


# --- reading --------------------------------------------------------------------------
async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, refusing more than `limit` bytes without reading them all (413), and a
    body not complete within `timeout_s` (408; the server then drops the connection).

    A client that leaves mid-body gets a 499 nobody reads (the server drops it): no
    router state exists for the request yet, so there is nothing else to undo."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body larger than {limit} bytes", code="body_too_large")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(
                        413, f"request body larger than {limit} bytes", code="body_too_large"
                    )
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(
            408, f"request body not received within {timeout_s:g} s", code="body_timeout"
        ) from None
    except ClientDisconnect:  # e.g. a replay cancelled at shutdown: nothing was started yet
        raise ApiError(499, "client closed the request", code="client_disconnect") from None
    return b"".join(chunks)


# --- parsing --------------------------------------------------------------------------
def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object no deeper than MAX_DEPTH, or a 400 saying what is wrong."""
    if not raw:
        raise ApiError(400, "request body is empty; send a JSON object", code="invalid_json")
    try:
        body = codec.loads(raw)
    except (ValueError, RecursionError):
        raise ApiError(400, "request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    if raw.count(b"{") + raw.count(b"[") > MAX_DEPTH and not _shallow(body, MAX_DEPTH):
        raise ApiError(
            400, f"request body is nested deeper than {MAX_DEPTH} levels", code="invalid_json"
        )
    return body


def _shallow(doc: Any, limit: int) -> bool:
    """No object/array chain deeper than `limit` (iterative: deep input cannot recurse).
    `parse_json_object` asks only when the body has more than `limit` opening brackets:
    a chain needs one per level, so fewer cannot be too deep."""
    level, depth = [doc], 1
    while level:
        if depth > limit:
            return False
        below = []
        for node in level:
            below.extend(c for c in (node.values() if isinstance(node, dict) else node)
                         if isinstance(c, dict | list))  # fmt: skip
        level, depth = below, depth + 1
    return True


def agent_role(field: Any, header: str | None) -> str | None:
    """The agent role (e.g. "planner", "coder") tool durations are learnt per: body
    `agent` first, then the `X-Agent-Role` header; None when neither is given."""
    if field is not None:
        return _label(field, "agent")
    return _label(header, "X-Agent-Role") if header else None


def _label(value: Any, field: str) -> str:
    try:
        return check_label(value, field)
    except LabelError as e:
        raise ApiError(400, str(e), param=field, code="invalid_value") from None


def prepare(kind: str, raw: bytes, hints: Hints) -> Prepared:
    """Parse and check one inference request and build the engine's body (pure; may run
    in the worker process). Raises ApiError (400) for anything the router cannot forward."""
    body = parse_json_object(raw)
    validate(kind, body)
    try:
        who = identity.resolve(body, hints.program_id, hints.namespace, hints.sessions)
    except LabelError as e:
        raise ApiError(400, str(e), param=e.field, code="invalid_program_id") from None
    program_id = who.program_id
    body.pop("program_id", None)
    if isinstance(body.get("extra_body"), dict):
        body["extra_body"].pop("program_id", None)
    agent = agent_role(body.pop("agent", None), hints.agent)
    anchor = anchor_of(body)
    parent = body.pop("parent_id", None)
    parent = _label(parent, "parent_id") if parent is not None else hints.parent
    app = body.pop("app_id", None)
    app = _label(app, "app_id") if app is not None else hints.app
    round_id = body.pop("round_id", None)
    if round_id is not None:
        round_id = _label(round_id, "round_id")
    elif hints.round is not None:
        round_id = _label(hints.round, "X-Round-Id")
    segments = prompt_segments(body)
    rid = body.get("rid")
    rid = _label(rid, "rid") if rid is not None else _RIDS.next()
    stream = bool(body.get("stream", False))
    options = body.get("stream_options")
    wants_details = bool(body.get(CACHE_DETAILS_FLAG))
    # SGLang's fields, on Messages too: the MORI plugin carries them through SGLang's
    # Anthropic entrypoint (engine_patches/messages.py; a plain SGLang drops them there)
    body["session_id"] = program_id
    body["rid"] = rid
    body[CACHE_DETAILS_FLAG] = True  # SGLang's device/host split, for the hit counts
    # the engine's own time for the step, where it reports one (the emulator; SGLang ignores
    # the field): what the round trip to the replica takes off a step (Exchange)
    body[ENGINE_TIMES_FLAG] = True
    if stream and kind != "messages":  # Anthropic streams always carry their usage
        body["stream_options"] = {**(options or {}), "include_usage": True}
    return Prepared(
        program_id=program_id,
        agent=agent or (anchor.agent if anchor else None),
        stream=stream,
        client_wants_usage=isinstance(options, dict) and bool(options.get("include_usage")),
        client_wants_details=wants_details,
        rid=rid,
        content=codec.dumps(body),
        prompt_chars=prompt_chars(body),
        anchor=anchor,
        parent=hints.namespace + parent if parent else None,
        app=hints.namespace + app if app else None,
        segments=segments,
        round=hints.namespace + round_id if round_id else None,
        identity=who,
        hints=agent_hints(body.get("nvext"), hints),
    )


MAX_HINT = 2**31 - 1  # hints are 32-bit signed integers, as engines take a priority


def agent_hints(nvext: Any, headers: Hints) -> AgentHints:
    """The request's agent hints: Dynamo's `nvext.agent_hints` (`priority`, `osl`), else
    the headers `X-Mori-Priority` and `X-Mori-Osl`; a bad value is a 400 naming it. The
    body is passed on untouched (an engine that knows the hints may use them too)."""
    given = nvext.get("agent_hints") if isinstance(nvext, dict) else None
    given = given if isinstance(given, dict) else {}
    priority = _hint(given.get("priority"), "nvext.agent_hints.priority", -MAX_HINT)
    if priority is None:
        priority = _hint(headers.priority, "X-Mori-Priority", -MAX_HINT, text=True)
    osl = _hint(given.get("osl"), "nvext.agent_hints.osl", 0)
    if osl is None:
        osl = _hint(headers.osl, "X-Mori-Osl", 0, text=True)
    if priority is None and osl is None:
        return NO_HINTS
    return AgentHints(priority or 0, osl)


def _hint(value: Any, field: str, least: int, text: bool = False) -> int | None:
    """An integer hint in [least, MAX_HINT] (a header's decimal text when `text`),
    None when absent, else a 400."""
    if value is None:
        return None
    if text:
        try:
            value = int(value, 10)
        except ValueError:
            value = None
    ok = isinstance(value, int) and not isinstance(value, bool) and least <= value <= MAX_HINT
    _require(ok, f"`{field}` must be an integer from {least} to {MAX_HINT}", field)
    return value


PROMPT_FIELDS = ("messages", "prompt", "system", "tools", "functions")


def prompt_chars(body: dict[str, Any]) -> int:
    """Characters of the text that becomes the prompt (every string under the prompt
    fields, decoded): the token estimate before the engine's first usage report. The raw
    body would count JSON escapes (a \\uXXXX is 6 bytes for one character) and fields
    that never reach the prompt, and a request could be refused as too long for any GPU."""
    total, stack = 0, [body.get(field) for field in PROMPT_FIELDS]
    while stack:
        value = stack.pop()
        kind = type(value)  # parsed JSON holds exactly these types: no isinstance needed
        if kind is str:
            total += len(value)
        elif kind is dict:
            stack.extend(value.values())
        elif kind is list:
            stack.extend(value)
    return total


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _require(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise ApiError(400, message, param=param, code="invalid_value")


def validate(kind: str, body: dict[str, Any]) -> None:
    """Reject what the router itself relies on, before a request takes a gate slot."""
    if kind in ("chat", "messages"):
        msgs = body.get("messages")
        _require(
            isinstance(msgs, list) and bool(msgs) and all(isinstance(m, dict) for m in msgs),
            "`messages` must be a non-empty array of message objects",
            "messages",
        )
        _require(
            all(isinstance(m.get("role"), str) for m in msgs),
            "every message needs a string `role`",
            "messages",
        )
    else:
        prompt = body.get("prompt")
        _require(
            isinstance(prompt, str | list) and bool(prompt),
            "`prompt` must be a non-empty string or array",
            "prompt",
        )
    if kind == "messages":
        _require(
            _positive_int(body.get("max_tokens")),
            "`max_tokens` must be an integer >= 1",
            "max_tokens",
        )
    for field in ("max_tokens", "max_completion_tokens", "n"):
        if body.get(field) is not None:
            _require(_positive_int(body[field]), f"`{field}` must be an integer >= 1", field)
    for field in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        if body.get(field) is not None:
            _require(_number(body[field]), f"`{field}` must be a number", field)
    if "stream" in body:
        _require(isinstance(body["stream"], bool | None), "`stream` must be a boolean", "stream")
    if body.get("model") is not None:
        _require(isinstance(body["model"], str), "`model` must be a string", "model")
    if body.get("stream_options") is not None:
        _require(
            isinstance(body["stream_options"], dict),
            "`stream_options` must be an object",
            "stream_options",
        )
    if body.get("tools") is not None:
        _require(isinstance(body["tools"], list), "`tools` must be an array", "tools")


# --- size-aware preparation -----------------------------------------------------------
class Intake:
    """Runs `prepare` inline for bodies up to `inline_bytes`, in a worker process above
    (`worker_parse_bytes` in the config).

    The worker starts on the first large body (most deployments never send one) and is
    replaced if it dies; while it is broken, large bodies are prepared inline."""

    def __init__(self, inline_bytes: int) -> None:
        self.inline_bytes = inline_bytes
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def inline(self, kind: str, raw: bytes, hints: Hints) -> Prepared | None:
        """The request prepared here and now if its body is small enough, else None
        (then `prepare` it): most requests never need to await."""
        return prepare(kind, raw, hints) if len(raw) <= self.inline_bytes else None

    async def prepare(self, kind: str, raw: bytes, hints: Hints) -> Prepared:
        prepared = self.inline(kind, raw, hints)
        if prepared is not None:
            return prepared
        if self._pool is None:
            context = multiprocessing.get_context("spawn")  # no copy of the event loop's state
            self._pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=context)
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._pool, prepare, kind, raw, hints
            )
        except concurrent.futures.process.BrokenProcessPool:
            log.warning("request parser process died; parsing this body inline")
            self.close()
            return prepare(kind, raw, hints)

    def close(self) -> None:
        """Stop the parser process and wait for the pool's manager thread: left running, it
        races the interpreter's exit hook for the pool's wake-up pipe (CPython 3.11's
        `_python_exit` writes to it as the thread closes it: an EBADF traceback at exit)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
