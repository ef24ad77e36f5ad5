"""`mori emulate`: one emulated SGLang replica over HTTP, timed by the replica cost model.

The router, the replay clients and the demo need something that answers like SGLang on a
machine without a GPU. This is the imperative shell around `router.sim.model.ReplicaEngine`
(pure, virtual clock): it maps wall time to the engine's clock (scaled by --time-scale),
drives `advance()` at `next_event_time()` from one asyncio task, and turns the engine's
events into OpenAI answers (streamed or not) with SGLang's usage fields.

What is emulated: POST /v1/chat/completions, /v1/completions and /v1/messages (the
Anthropic API as SGLang serves it, router/sim/anthropic.py), GET /get_server_info,
POST /abort_request, GET /health, GET /v1/models, and the MORI hint protocol
(POST /mori/hints, GET /mori/residency; docs/hint-protocol.md). Prompt tokens are counted
with the convention of `router.replay.prompts` (4 characters per token), so a prompt that
repeats the program's previous call is recognised as a cached prefix.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.policy.types import EngineMode, Hint
from router.presets import PRESETS, get_preset, price_summary
from router.protocol.accounting import CACHE_DETAILS_FLAG, ENGINE_TIMES_FLAG
from router.replay import prompts
from router.sim import anthropic
from router.sim import model as cost_model
from router.wire.errors import ApiError

log = logging.getLogger("mori.emulate")

DEFAULT_PRESET = "h100-8b"
STREAM_TICK_S = 0.05  # wall seconds between token chunks while a stream is decoding
HINT_VALUES = tuple(h.value for h in Hint)
PROGRAM_MEMORY = 4096  # programs whose last context text is kept for prefix matching


# --- request parsing ------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """What one inference request asks of the engine, already validated."""

    rid: str
    program_id: str
    chat: bool
    stream: bool
    include_usage: bool
    cache_details: bool  # the request set return_cached_tokens_details
    engine_times: bool  # ... mori_engine_times (its engine-clock times in the answer)
    prompt_text: str
    input_tokens: int
    output_tokens: int
    model: str
    tool_call: dict | None  # {"name", "arguments"} when the answer is a tool call
    finish_reason: str  # "length" when max_tokens cut the answer, else "stop"
    anchor_chars: int = 0  # the prompt's leading tools + system messages (an agent's anchor)


def _need(cond: bool, message: str, param: str | None = None) -> None:
    if not cond:
        raise ApiError(400, message, param=param)


def _int_param(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    _need(
        isinstance(value, int) and not isinstance(value, bool), f"{name} must be an integer", name
    )
    _need(value >= 1, f"{name} must be >= 1", name)
    return value


def _prompt_of(body: dict, chat: bool) -> str:
    if chat:
        messages = body.get("messages")
        _need(
            isinstance(messages, list) and messages, "messages must be a non-empty list", "messages"
        )
        for i, m in enumerate(messages):
            _need(isinstance(m, dict), f"messages[{i}] must be an object", "messages")
            _need(isinstance(m.get("role"), str), f"messages[{i}].role is required", "messages")
        tools = body.get("tools")
        _need(tools is None or isinstance(tools, list), "tools must be a list", "tools")
        try:
            return prompts.render_chat(messages, tools)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        # Token ids: one token each; render them so repeats share a prefix.
        return "".join(f"{t % 10000:04d}" for t in prompt)
    _need(isinstance(prompt, str) and prompt != "", "prompt must be a non-empty string", "prompt")
    return prompt


def _program_of(body: dict, prompt_text: str) -> str:
    """The program: SGLang's `session_id`, else `program_id`, else the first message's hash."""
    for name in ("session_id", "program_id"):
        value = body.get(name)
        if value is not None:
            _need(isinstance(value, str) and value.strip() != "", f"{name} must be a string", name)
            return value
    messages = body.get("messages")
    first = json.dumps(messages[0], sort_keys=True) if messages else prompt_text[:256]
    return "anon-" + hashlib.blake2b(first.encode(), digest_size=6).hexdigest()


def _natural_length(prompt_text: str) -> int:
    """Tokens a request 'wants' without ignore_eos: 16-64, a hash of the prompt."""
    digest = hashlib.blake2b(prompt_text.encode("utf-8", "surrogatepass"), digest_size=2)
    return 16 + int(digest.hexdigest(), 16) % 49  # (JSON may carry lone surrogates)


def _tool_call_of(body: dict) -> dict | None:
    """A tool call answer when the request forces one (`tool_choice`) or asks via
    `mori_tool_call` ({"name", "arguments"}); deterministic, for pass-through tests."""
    tools = body.get("tools") or []
    asked = body.get("mori_tool_call")
    if asked is not None:
        _need(
            isinstance(asked, dict) and isinstance(asked.get("name"), str),
            "mori_tool_call must be an object with a name",
            "mori_tool_call",
        )
        return {"name": asked["name"], "arguments": asked.get("arguments", {})}
    choice = body.get("tool_choice")
    if not tools or choice in (None, "auto", "none"):
        return None
    names = [t.get("function", {}).get("name") for t in tools if isinstance(t, dict)]
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        _need(name in names, "tool_choice names a function that is not in tools", "tool_choice")
    else:
        _need(
            choice == "required",
            "tool_choice must be auto, none, required or a function",
            "tool_choice",
        )
        name = names[0]
    spec = next(t["function"] for t in tools if t.get("function", {}).get("name") == name)
    required = (spec.get("parameters") or {}).get("required") or []
    return {"name": name, "arguments": {p: "x" for p in required}}


def _anchor_chars(body: dict, chat: bool) -> int:
    """Length of the prompt's anchor: the tools and the leading system / developer
    messages, which every session of an agent role repeats byte for byte."""
    if not chat:
        return 0
    head = prompts.render_chat([], body.get("tools"))
    lead = []
    for m in body["messages"]:
        if m.get("role") not in ("system", "developer"):
            break
        lead.append(m)
    return len(head) + sum(len(prompts.render_message(m)) for m in lead)


def parse_job(body: Any, chat: bool, model_name: str) -> Job:
    """Validate an OpenAI request body (400 on anything the emulator cannot serve)."""
    _need(isinstance(body, dict), "the request body must be a JSON object")
    prompt_text = _prompt_of(body, chat)
    max_tokens = _int_param(body, "max_completion_tokens") or _int_param(body, "max_tokens")
    ignore_eos = body.get("ignore_eos", False)
    _need(isinstance(ignore_eos, bool), "ignore_eos must be a boolean", "ignore_eos")
    _need(not ignore_eos or max_tokens is not None, "ignore_eos needs max_tokens", "max_tokens")
    natural = _natural_length(prompt_text)
    output = max_tokens if ignore_eos else min(natural, max_tokens or natural)
    stream = body.get("stream", False)
    _need(isinstance(stream, bool), "stream must be a boolean", "stream")
    options = body.get("stream_options") or {}
    _need(isinstance(options, dict), "stream_options must be an object", "stream_options")
    rid = body.get("rid") or f"req-{uuid.uuid4().hex[:16]}"
    _need(isinstance(rid, str), "rid must be a string", "rid")
    model = body.get("model") or model_name
    _need(isinstance(model, str), "model must be a string", "model")
    return Job(
        rid=rid,
        program_id=_program_of(body, prompt_text),
        chat=chat,
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        cache_details=body.get(CACHE_DETAILS_FLAG) is True,
        engine_times=body.get(ENGINE_TIMES_FLAG) is True,
        prompt_text=prompt_text,
        input_tokens=prompts.count_tokens(prompt_text),
        output_tokens=output,
        model=model,
        tool_call=_tool_call_of(body) if chat else None,
        finish_reason="length" if output == max_tokens else "stop",
        anchor_chars=_anchor_chars(body, chat),
    )


# --- the replica: wall clock <-> engine clock -------------------------------------------
@dataclass
class Flight:
    """One request in the engine, as its HTTP handler waits on it."""

    job: Job
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    first_token: bool = False
    done: bool = False
    aborted: bool = False
    cached_device: int = 0
    cached_host: int = 0
    times: dict[str, float] = field(default_factory=dict)  # engine clock: arrived, first, done
    time_scale: float = 1.0  # engine seconds per wall second (the replica's --time-scale)


class EmulatedReplica:
    """Owns the ReplicaEngine; every engine call happens on the event loop thread."""

    def __init__(self, engine: cost_model.ReplicaEngine, time_scale: float, info: dict) -> None:
        self.engine = engine
        self.time_scale = time_scale
        self.info = info
        self.flights: dict[str, Flight] = {}
        self.epoch = -1
        # program -> the text its next prompt should start with (last prompt + answer)
        self.contexts: OrderedDict[str, str] = OrderedDict()
        self.origin_s = time.monotonic()  # engine time 0, on the monotonic clock
        self._wake = asyncio.Event()
        self._active_area = 0.0  # integral of device tokens held by running requests
        self._area_t = 0.0

    def _clock(self) -> float:
        """The engine time for the next engine call, after accounting KV use up to it."""
        now = self.now()
        active = self.engine.usage()["device_active_tokens"]
        self._active_area += max(0.0, now - self._area_t) * active
        self._area_t = max(self._area_t, now)
        return now

    def now(self) -> float:
        """The engine's clock: wall seconds since start times the time scale."""
        return (time.monotonic() - self.origin_s) * self.time_scale

    # driver ---------------------------------------------------------------------------
    async def drive(self) -> None:
        """Advance the engine at its next event (or every tick while tokens stream)."""
        while True:
            timeout = self._sleep_s()
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
            self._step()

    def _sleep_s(self) -> float | None:
        t = self.engine.next_event_time()
        sleep = None if t is None else max(0.0, (t - self.now()) / self.time_scale)
        if any(f.first_token and not f.done for f in self.flights.values()):
            sleep = STREAM_TICK_S if sleep is None else min(sleep, STREAM_TICK_S)
        return sleep

    def _step(self) -> None:
        for event in self.engine.advance(self._clock()):
            flight = self.flights.get(event.rid)
            if flight is None:
                continue
            if isinstance(event, cost_model.FirstToken):
                flight.first_token = True
                flight.cached_device = event.cached_device
                flight.cached_host = event.cached_host
                flight.times["first"] = event.t
            elif isinstance(event, cost_model.Done):
                flight.first_token = flight.done = True
                flight.times.setdefault("first", event.t)
                flight.times["done"] = event.t
        for flight in self.flights.values():
            flight.changed.set()

    # requests -------------------------------------------------------------------------
    def submit(self, job: Job) -> Flight:
        if job.rid in self.flights:
            raise ApiError(400, f"a request with rid {job.rid!r} is already running", param="rid")
        limit = self.info["max_total_num_tokens"]
        if job.input_tokens + job.output_tokens > limit:
            raise ApiError(
                400,
                f"prompt ({job.input_tokens}) + max_tokens ({job.output_tokens}) tokens exceed "
                f"the replica's KV capacity ({limit} tokens)",
                param="messages" if job.chat else "prompt",
                code="context_length_exceeded",
            )
        flight = Flight(job, time_scale=self.time_scale)
        self.flights[job.rid] = flight
        previous = self.contexts.pop(job.program_id, "")
        reused = prompts.common_prefix_tokens(job.prompt_text, previous)
        self.contexts[job.program_id] = job.prompt_text + _answer_text(job)
        while len(self.contexts) > PROGRAM_MEMORY:
            self.contexts.popitem(last=False)
        flight.times["arrived"] = now = self._clock()
        self.engine.submit(
            job.rid, job.program_id, job.input_tokens, job.output_tokens, now, reused, _anchor(job)
        )
        self._wake.set()
        return flight

    def abort(self, rid: str) -> bool:
        flight = self.flights.get(rid)
        if flight is None or flight.done:
            return False
        self.engine.abort(rid, self._clock())
        flight.aborted = flight.done = True
        flight.changed.set()
        self._wake.set()
        return True

    def finish(self, flight: Flight) -> None:
        """Forget a request whose handler is leaving (aborting it if still running)."""
        if not flight.done:
            self.abort(flight.job.rid)
        self.flights.pop(flight.job.rid, None)

    async def wait(self, flight: Flight) -> None:
        await flight.changed.wait()
        flight.changed.clear()

    def generated(self, flight: Flight) -> int:
        if flight.done and not flight.aborted:
            return flight.job.output_tokens
        return min(self.engine.generated(flight.job.rid, self.now()), flight.job.output_tokens)

    # hints ----------------------------------------------------------------------------
    def apply_hints(
        self,
        epoch: int,
        full: bool,
        hints: dict[str, str],
        scores: dict[str, float] | None = None,
        agents: dict[str, str] | None = None,
    ) -> dict:
        if epoch < self.epoch:  # a router that took over before the last one: refused
            return {"epoch": self.epoch, "stale": True, "residency": {}}
        self.epoch = epoch
        typed = {pid: Hint(h) for pid, h in hints.items()}
        residency = self.engine.apply_hints(typed, self._clock(), full)
        if scores is not None or agents:
            self.engine.apply_scores(scores or self.engine.tree.scores, agents, self._clock())
        self._wake.set()
        return {
            "epoch": epoch,
            "stale": False,
            "residency": {
                p: {"device_tokens": d, "host_tokens": h} for p, (d, h) in residency.items()
            },
        }

    def residency(self) -> dict:
        self._step()  # bring the engine up to now first
        return {
            **self.engine.usage(),
            "device_active_token_seconds": self._active_area,
            "engine_time_s": self._area_t,
            "epoch": self.epoch,
            "programs": self.engine.programs(),
            "anchor_scores": dict(self.engine.tree.scores),
        }


def _anchor(job: Job) -> cost_model.SharedPrefix | None:
    """The anchor a program without cached context shares with every program that sends
    the same tools and system prompt (named by their hash): stored once, as in SGLang."""
    tokens = job.anchor_chars // prompts.CHARS_PER_TOKEN
    if tokens <= 0 or tokens > job.input_tokens:
        return None
    text = job.prompt_text[: tokens * prompts.CHARS_PER_TOKEN]
    key = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    return cost_model.SharedPrefix(tokens, anchor=key)


def _answer_text(job: Job) -> str:
    """How the answer appears in the program's next prompt (as the agent appends it)."""
    text = prompts.output_text(job.rid, job.output_tokens)
    if not job.chat:
        return text
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if job.tool_call is not None:
        message["tool_calls"] = _tool_calls(job)
    return prompts.render_message(message)


# --- OpenAI answers ---------------------------------------------------------------------
def _usage(flight: Flight, completion_tokens: int) -> dict:
    """SGLang's usage with --enable-cache-report: the cached total (left out when 0), no
    device/host split."""
    job = flight.job
    usage = {
        "prompt_tokens": job.input_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": job.input_tokens + completion_tokens,
    }
    if cached := flight.cached_device + flight.cached_host:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _sglext(flight: Flight) -> dict:
    """SGLang's `sglext` field: the device/host split, only when the request asked for it
    and something was cached (router/protocol/accounting.py reads it); and, asked for with
    ENGINE_TIMES_FLAG, the request's times on the engine clock and its time scale (the
    router takes the engine's own time off a step to measure its round trip)."""
    ext: dict = {}
    if flight.job.cache_details and flight.cached_device + flight.cached_host:
        ext["cached_tokens_details"] = {"device": flight.cached_device, "host": flight.cached_host}
    if flight.job.engine_times:
        ext["engine_times"] = {**flight.times, "time_scale": flight.time_scale}
    return {"sglext": ext} if ext else {}


def _finish_reason(flight: Flight) -> str:
    if flight.aborted:
        return "abort"
    if flight.job.tool_call is not None:
        return "tool_calls"
    return flight.job.finish_reason


def _tool_calls(job: Job) -> list[dict]:
    call = job.tool_call or {}
    args = call.get("arguments", {})
    return [
        {
            "index": 0,
            "id": "call_" + hashlib.blake2b(job.rid.encode(), digest_size=6).hexdigest(),
            "type": "function",
            "function": {
                "name": call.get("name"),
                "arguments": args if isinstance(args, str) else json.dumps(args),
            },
        }
    ]


def _base(job: Job, created: int, kind: str) -> dict:
    return {"id": job.rid, "object": kind, "created": created, "model": job.model}


def full_answer(flight: Flight, created: int) -> dict:
    """The non-streamed answer once the request is done."""
    job = flight.job
    n = job.output_tokens if not flight.aborted else 0
    text = prompts.output_text(job.rid, n)
    if job.chat:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if job.tool_call is not None:
            message["tool_calls"] = _tool_calls(job)
        choice = {"index": 0, "message": message, "finish_reason": _finish_reason(flight)}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": _finish_reason(flight)}
        kind = "text_completion"
    answer = {**_base(job, created, kind), "choices": [choice], "usage": _usage(flight, n)}
    return answer | _sglext(flight)


def _sse(doc: dict) -> bytes:
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


def _chunk(job: Job, created: int, delta: dict | None, text: str, finish: str | None) -> bytes:
    if job.chat:
        choice = {"index": 0, "delta": delta or {}, "finish_reason": finish}
        return _sse({**_base(job, created, "chat.completion.chunk"), "choices": [choice]})
    choice = {"index": 0, "text": text, "finish_reason": finish}
    return _sse({**_base(job, created, "text_completion"), "choices": [choice]})


async def _pieces(replica: EmulatedReplica, flight: Flight) -> AsyncIterator[str]:
    """The answer's text as the engine generates it: "" at the first token, then each
    newly generated piece (whole tokens), until the request is done."""
    job = flight.job
    text = prompts.output_text(job.rid, job.output_tokens)
    sent = 0
    while not flight.first_token and not flight.done:
        await replica.wait(flight)
    yield ""
    while True:
        n = replica.generated(flight)
        if n > sent:
            yield text[sent * prompts.CHARS_PER_TOKEN : n * prompts.CHARS_PER_TOKEN]
            sent = n
        if flight.done:
            return
        await replica.wait(flight)


async def stream_answer(
    replica: EmulatedReplica, flight: Flight, created: int
) -> AsyncIterator[bytes]:
    """SSE chunks: role, then new tokens as the engine generates them, finish, usage."""
    job = flight.job
    chars = 0
    try:
        async for piece in _pieces(replica, flight):
            if piece:
                chars += len(piece)
                yield _chunk(job, created, {"content": piece}, piece, None)
            elif job.chat:
                yield _chunk(job, created, {"role": "assistant", "content": ""}, "", None)
        if job.tool_call is not None and not flight.aborted:
            yield _chunk(job, created, {"tool_calls": _tool_calls(job)}, "", None)
        yield _chunk(job, created, {}, "", _finish_reason(flight))
        kind = "chat.completion.chunk" if job.chat else "text_completion"
        if ext := _sglext(flight):  # its own chunk before the usage chunk, as SGLang sends it
            yield _sse({**_base(job, created, kind), "choices": [], **ext})
        if job.include_usage:
            usage = _usage(flight, chars // prompts.CHARS_PER_TOKEN)
            yield _sse({**_base(job, created, kind), "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"
    finally:
        replica.finish(flight)


async def stream_messages(replica: EmulatedReplica, flight: Flight) -> AsyncIterator[bytes]:
    """The Anthropic event stream of a `/v1/messages` request (router/sim/anthropic.py)."""
    job = flight.job

    def start_usage() -> dict[str, int]:
        cached = flight.cached_device + flight.cached_host
        return anthropic.usage(job.input_tokens, cached, 0)

    def finish() -> tuple[list[dict], str, dict]:
        calls = _tool_calls(job) if job.tool_call is not None and not flight.aborted else []
        return calls, _finish_reason(flight), _sglext(flight)

    try:
        async for event in anthropic.stream(
            job.model, _pieces(replica, flight), start_usage, finish
        ):
            yield event
    finally:
        replica.finish(flight)


# --- the HTTP app -----------------------------------------------------------------------
async def _json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except ValueError:
        raise ApiError(400, "the request body is not valid JSON") from None


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(replica: EmulatedReplica) -> FastAPI:
    """The FastAPI app of one emulated replica (the driver task runs in its lifespan)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(replica.drive())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app = FastAPI(title="mori emulate", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> Response:
        return e.response(anthropic=request.url.path.startswith("/v1/messages"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
        return await _api_error(request, ApiError(e.status_code, str(e.detail)))

    async def infer(request: Request, job: Job, anthropic_api: bool = False) -> Response:
        flight = replica.submit(job)
        created = int(time.time())
        if job.stream:
            events = (
                stream_messages(replica, flight)
                if anthropic_api
                else stream_answer(replica, flight, created)
            )
            return StreamingResponse(events, media_type="text/event-stream")
        gone = asyncio.create_task(_until_disconnect(request))
        try:
            while not flight.done and not gone.done():
                waiting = asyncio.create_task(replica.wait(flight))
                await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
                waiting.cancel()
            answer = full_answer(flight, created)
            return JSONResponse(anthropic.message(answer) if anthropic_api else answer)
        finally:
            gone.cancel()
            replica.finish(flight)

    def openai_job(body: Any, chat: bool) -> Job:
        return parse_job(body, chat, replica.info["model_path"])

    def messages_job(body: Any) -> Job:
        """SGLang's view of a Messages request with the MORI plugin: its chat translation,
        with the SGLang fields the plugin carries (the program is `session_id`, as on chat)."""
        return openai_job(anthropic.to_chat(body), chat=True)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await infer(request, openai_job(await _json_body(request), chat=True))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await infer(request, openai_job(await _json_body(request), chat=False))

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await infer(request, messages_job(await _json_body(request)), anthropic_api=True)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict:
        body = await _json_body(request)
        job = messages_job({**body, "max_tokens": 1} if isinstance(body, dict) else body)
        return {"input_tokens": job.input_tokens}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/get_server_info")
    async def server_info() -> dict:
        # what the engine holds and queues now, for the live-vs-sim differential check
        usage = replica.engine.usage() | {
            k: replica.engine.stats[k] for k in ("admitted", "queue_wait_s")
        }
        # the engine clock's origin on this machine's monotonic clock: a client on the same
        # machine maps the answers' engine times to its own (bench/emulator_hop.py)
        return replica.info | {"mori_usage": usage, "clock_origin_s": replica.origin_s}

    @app.get("/v1/models")
    async def models() -> dict:
        name = replica.info["model_path"]
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "mori"}]}

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict:
        body = await _json_body(request)
        _need(isinstance(body, dict) and isinstance(body.get("rid"), str), "rid is required", "rid")
        return {"rid": body["rid"], "aborted": replica.abort(body["rid"])}

    @app.post("/mori/hints")
    async def hints(request: Request) -> dict:
        body = await _json_body(request)
        _need(isinstance(body, dict), "a hint batch must be a JSON object")
        epoch, full, batch = body.get("epoch"), body.get("full", False), body.get("hints")
        _need(
            isinstance(epoch, int) and not isinstance(epoch, bool),
            "epoch must be an integer",
            "epoch",
        )
        _need(isinstance(full, bool), "full must be a boolean", "full")
        _need(isinstance(batch, dict), "hints must be an object: program id -> type", "hints")
        for pid, hint in batch.items():
            _need(hint in HINT_VALUES, f"hint for {pid!r} must be one of {HINT_VALUES}", "hints")
        scores, agents = body.get("scores"), body.get("agents") or {}
        _need(scores is None or _is_scores(scores), "scores must map agents to 0..1", "scores")
        _need(_is_names(agents), "agents must map program ids to agent names", "agents")
        return replica.apply_hints(epoch, full, batch, scores, agents)

    @app.get("/mori/residency")
    async def residency() -> dict:
        return replica.residency()

    return app


def _is_scores(scores: Any) -> bool:
    return isinstance(scores, dict) and all(
        isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v <= 1
        for v in scores.values()
    )


def _is_names(agents: Any) -> bool:
    return isinstance(agents, dict) and all(isinstance(v, str) and v for v in agents.values())


# --- CLI --------------------------------------------------------------------------------
def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        default=DEFAULT_PRESET,
        choices=sorted(PRESETS),
        help="hardware x model cost model",
    )
    parser.add_argument(
        "--preset-file",
        help="a preset file (`mori calibrate --out`) instead of a named preset (default: none)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=30000, help="port to listen on")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="run the engine clock this many times faster than real time",
    )
    parser.add_argument(
        "--gpu-tokens", type=int, help="device KV budget in tokens (default: the preset's)"
    )
    parser.add_argument(
        "--host-tokens",
        type=int,
        help="host (DRAM) KV budget in tokens (default: --cpu-ratio x GPU)",
    )
    parser.add_argument(
        "--cpu-ratio",
        type=float,
        default=2.0,
        help="host KV budget as a multiple of the GPU budget",
    )
    parser.add_argument("--no-host-tier", action="store_true", help="no HiCache host tier")
    parser.add_argument(
        "--eviction",
        choices=("lru", "typed"),
        default="typed",
        help="lru: plain SGLang HiCache; typed: the MORI patch (hints honoured)",
    )
    parser.add_argument(
        "--model-name", default=None, help="model id to report (default: the preset's model)"
    )
    parser.add_argument("--log-level", default="warning", help="uvicorn log level")


def build_replica(args: argparse.Namespace) -> EmulatedReplica:
    """The engine and the server info an argparse namespace describes (errors: ValueError)."""
    preset = get_preset(args.preset_file or args.preset)
    if args.time_scale <= 0:
        raise ValueError("--time-scale must be > 0")
    gpu = args.gpu_tokens if args.gpu_tokens is not None else preset.gpu_kv_tokens
    host = (
        0
        if args.no_host_tier
        else (args.host_tokens if args.host_tokens is not None else int(args.cpu_ratio * gpu))
    )
    if gpu <= 0 or host < 0:
        raise ValueError("--gpu-tokens must be > 0 and --host-tokens >= 0")
    mode = EngineMode(eviction=args.eviction, host_tier=host > 0)
    engine = cost_model.ReplicaEngine(preset, mode, gpu, host)
    info = {
        "model_path": args.model_name or preset.model.name,
        "max_total_num_tokens": gpu,
        "hicache_host_tokens": host,
        "enable_hierarchical_cache": host > 0,
        "emulated": True,
        "preset": args.preset_file or preset.name,
        "prices": price_summary(preset),
        "eviction": args.eviction,
        "time_scale": args.time_scale,
        "mori_hints": True,
    }
    return EmulatedReplica(engine, args.time_scale, info)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper())
    try:
        replica = build_replica(args)
    except ValueError as e:
        print(f"mori emulate: {e}")
        return 2
    print(
        f"mori emulate: {replica.info['preset']} on http://{args.host}:{args.port} "
        f"(gpu {replica.info['max_total_num_tokens']} tokens, host "
        f"{replica.info['hicache_host_tokens']}, x{args.time_scale} time); the replica runs "
        f"this preset's cost model: {replica.info['prices']}",
        flush=True,
    )
    uvicorn.run(create_app(replica), host=args.host, port=args.port, log_level=args.log_level)
    return 0
