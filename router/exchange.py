"""One proxied inference request, from arrival to its last byte, as an ASGI response.

The whole life of a request runs inside one `try`/`finally` chain so that every exit
(answer, engine error, gate timeout, client disconnect, cancellation) leaves the policy
consistent: a gated request is `cancel`led, a forwarded one gets its `on_response`,
and an engine request whose client left is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from router.accounting import (
    AnthropicStream,
    OpenAIStream,
    Usage,
    anthropic_body,
    openai_body,
    without_sglext,
)
from router.agent_identity import Anchor
from router.controller import Router
from router.engines import Replica
from router.errors import ApiError, anthropic_error_body, error_body
from router.gate import GateTimeout, ProgramEnded
from router.outliers import Attempt

log = logging.getLogger("mori.exchange")

SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class _Retry(Exception):
    """The replica failed before the client saw a byte: another replica may serve it."""

    def __init__(self, why: str, certain: bool = False) -> None:
        super().__init__(why)
        # certain: the replica is at fault (it refused the connection, or it was already
        # drained); else the request may be, and a health probe decides (Router.confirm)
        self.certain = certain


def replica_fault(error: httpx.TransportError) -> bool:
    """Whether a transport failure is the replica's doing. Building the request (a header
    httpx refuses, a pool limit of ours) is not: such a request must never drain a replica."""
    return not isinstance(
        error, httpx.LocalProtocolError | httpx.UnsupportedProtocol | httpx.PoolTimeout
    )


class ClientGone(Exception):
    """Sending to the client failed: it disconnected."""


@dataclass
class Call:
    """The parsed request, ready to forward."""

    path: str  # upstream path, e.g. /v1/chat/completions
    anthropic: bool
    content: bytes  # the engine's body (router/intake.py: program_id out, session_id in)
    rid: str  # the engine request id (aborts name it)
    program_id: str
    stream: bool
    client_wants_usage: bool
    client_wants_details: bool  # the client itself set return_cached_tokens_details
    prompt_chars: int
    arrival: float
    headers: dict[str, str]
    agent: str | None = None  # agent role: explicit, else its anchor's hash (agent_identity)
    anchor: Anchor | None = None  # tools + leading system messages (CacheSage warms them)
    parent: str | None = None  # the program this one works for (X-Parent-Id)
    app: str | None = None  # the application (agent graph) its task runs (X-App-Id)


class Exchange(Response):
    """ASGI response that gates, forwards, relays and accounts for one `Call`."""

    def __init__(self, router: Router, call: Call) -> None:  # no Response.__init__: no body
        self.background = None
        self.router = router
        self.call = call
        self.rid = call.rid
        self.started = False  # response headers went to the client
        self.first_byte_at: float | None = None  # first streamed byte from the engine
        self.outcome = "ok"
        self.replica: Replica | None = None
        # the current attempt for the outlier books: True served, False the replica
        # failed it, None neither (the client left, or the request could not be sent)
        self.verdict: bool | None = None
        self.failed_on: list[Replica] = []  # replicas an attempt of this request failed on

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve the request in this task; a watcher cancels it if the client leaves."""
        task = asyncio.current_task()
        assert task is not None
        watch = asyncio.ensure_future(self._watch(receive, task))
        try:
            await self._run(send)
        except asyncio.CancelledError:
            if self.outcome != "client_disconnect":
                raise
            task.uncancel()  # the cancellation was ours: the request is over, not the server
        finally:
            watch.cancel()

    async def _watch(self, receive: Receive, task: asyncio.Task) -> None:
        await _disconnected(receive)
        self.outcome = "client_disconnect"
        task.cancel()

    # the request's life --------------------------------------------------------------
    async def _run(self, send: Send) -> None:
        r = self.router
        r.in_flight += 1
        try:
            deadline = self.call.arrival + r.config.gate_timeout_s
            async with r.gate.turn(self.call.program_id, deadline):
                await self._attempts(send, deadline)
        except GateTimeout:
            self.outcome = "timeout"
            r.metrics.gate_timeouts.inc()
            retry = str(max(1, int(r.config.tick_s)))
            await self._error(
                send,
                ApiError(
                    503,
                    "the program could not be placed on a GPU in time; retry later",
                    code="gate_timeout",
                    headers={"retry-after": retry},
                ),
            )
        except ProgramEnded:
            self.outcome = "ended"
            message = "the program was ended while this request waited for a GPU"
            await self._error(send, ApiError(409, message, code="program_ended"))
        except ApiError as e:
            self.outcome = "error"
            await self._error(send, e)
        except ClientGone:
            self.outcome = "client_disconnect"
        finally:
            r.in_flight -= 1
            label = self.replica.url if self.replica else "-"
            r.metrics.requests.labels(label, self.outcome).inc()
            r.metrics.latency.labels(label).observe(r.clock() - self.call.arrival)

    async def _attempts(self, send: Send, deadline: float) -> None:
        r, pid, policy = self.router, self.call.program_id, self.router.policy
        tokens = r.estimate_tokens(pid, self.call.prompt_chars)
        budget = policy.largest_gpu_budget()
        if budget is not None and tokens > budget:
            raise ApiError(
                400,
                f"the prompt is about {tokens} tokens, more than any replica's GPU KV budget "
                f"({budget} tokens)",
                param="messages",
                code="context_length_exceeded",
            )
        r.observe_request(self.call)
        for _ in range(r.config.max_retries + 1):
            try:
                moves = policy.on_request(pid, r.clock(), tokens)
            except ValueError as e:  # a second request in flight despite the turn lock
                raise ApiError(409, str(e), code="program_busy") from None
            r.apply(moves)
            replica = r.replicas[await self._gated(deadline)]
            self.replica = replica
            usage = Usage()
            try:
                await r.hint_acked(pid)  # its busy hint (load-back) reaches the engine first
                sent_at = r.clock()
                usage = await self._forward(replica, send)
                self._price(replica, usage, sent_at)
                return
            except _Retry as e:
                r.metrics.requests.labels(replica.url, "retried").inc()
                if e.certain:
                    r.drain(replica, str(e), "connect")
                else:
                    await r.confirm(replica, str(e), "failed")
            finally:
                now = r.clock()
                r.apply(policy.on_response(pid, now, usage.context_tokens))
                if usage.tool:
                    r.apply(policy.on_tool_start(pid, now, usage.tool, agent=self.call.agent))
        raise ApiError(502, "no engine replica answered the request", code="upstream_unavailable")

    def _price(self, replica: Replica, usage: Usage, sent_at: float) -> None:
        """Tell the policy what this step cost inside the engine (its prices follow the
        replica's own timings): prompt and cache split from the usage, time to the first
        streamed byte, decode time. A plain answer's first byte is its last: no sample."""
        hits, first = usage.hits(), self.first_byte_at
        if hits is None or first is None:
            return
        done = self.router.clock()
        prompt = usage.prompt_tokens or 0
        self.router.policy.observe_step(
            replica.url, prompt, hits.device, hits.host, first - sent_at,
            usage.completion_tokens or 0, done - first,
        )  # fmt: skip

    async def _gated(self, deadline: float) -> str:
        """Wait for the program's replica; on any exit but success the request is cancelled."""
        r, pid = self.router, self.call.program_id
        held_from = r.clock()
        try:
            url = await r.gate.until_routed(pid, lambda: r.policy.route(pid), deadline)
        except BaseException:
            r.apply(r.policy.cancel(pid, r.clock()))
            raise
        r.metrics.gate_wait.observe(r.clock() - held_from)
        return url

    # forwarding ----------------------------------------------------------------------
    async def _forward(self, replica: Replica, send: Send) -> Usage:
        """One attempt on `replica`, in the outlier books: cut (TimeoutError from its
        cutoff) when the replica is drained while the attempt is silent."""
        r = self.router
        self.verdict = None
        cutoff = asyncio.timeout(None)
        attempt = r.outliers.begin(replica.url, cutoff)
        try:
            async with cutoff:
                return await self._relay(replica, send, attempt)
        except TimeoutError:
            if attempt.cut_reason is None:
                raise
            self.verdict = False
            if not self.started:
                raise _Retry(attempt.cut_reason, certain=True) from None
            log.warning(
                "request %s on %s cut mid-stream: %s", self.rid, replica.url, attempt.cut_reason
            )
            await self._fail_stream(send, "the engine replica stopped responding mid-stream")
            return Usage()
        finally:
            # one failure per request and replica: a request that fails on every retry
            # (it may be the cause) adds one to the streak, not max_retries + 1
            verdict = None if self.verdict is False and replica in self.failed_on else self.verdict
            if verdict is False:
                self.failed_on.append(replica)
            if r.outliers.end(attempt, verdict):
                failures = r.config.outlier_failures
                r.drain(replica, f"{failures} requests in a row failed", "failures")

    async def _relay(self, replica: Replica, send: Send, attempt: Attempt) -> Usage:
        headers = {"content-type": "application/json", **self.call.headers}
        complete = False
        try:
            upstream = await replica.open(self.call.path, self.call.content, headers)
        except httpx.TransportError as e:
            if not replica_fault(e):
                raise ApiError(
                    400, "the request could not be sent to the engine", code="invalid_request"
                ) from None
            self.verdict = False
            connect = isinstance(e, httpx.ConnectError | httpx.ConnectTimeout)
            raise _Retry(f"{type(e).__name__} before the response started", connect) from None
        attempt.last_byte = self.router.clock()
        try:
            if upstream.status_code >= 400:
                self.verdict = True  # an answer, even an error: the replica is serving
                await self._relay_error(upstream, send)
                complete = True
                return Usage()
            relay = self._relay_stream if self.call.stream else self._relay_body
            usage = await relay(upstream, replica, send, attempt)
            complete = True
            if self.verdict is None:
                self.verdict = True
            return usage
        finally:
            if not complete:
                self.router.spawn(replica.abort(self.rid))
            await upstream.aclose()

    async def _relay_body(
        self, upstream: httpx.Response, replica: Replica, send: Send, attempt: Attempt
    ) -> Usage:
        try:
            content = await upstream.aread()
        except httpx.TransportError as e:
            self.verdict = False
            raise _Retry(f"{type(e).__name__} while reading the answer") from None
        usage = (anthropic_body if self.call.anthropic else openai_body)(content)
        if not self.call.anthropic and not self.call.client_wants_details:
            content = without_sglext(content)
        now = self.router.clock()
        self.router.metrics.ttft.labels(replica.url).observe(now - self.call.arrival)
        ctype = upstream.headers.get("content-type", "application/json").encode()
        await self._send(send, upstream.status_code, [(b"content-type", ctype)], content)
        self._account(replica, usage)
        return usage

    async def _relay_stream(
        self, upstream: httpx.Response, replica: Replica, send: Send, attempt: Attempt
    ) -> Usage:
        parser = (
            AnthropicStream(self.call.client_wants_usage)
            if self.call.anthropic
            else OpenAIStream(self.call.client_wants_usage, self.call.client_wants_details)
        )
        clock = self.router.clock
        try:
            async for chunk in upstream.aiter_raw():
                attempt.last_byte = clock()
                out = parser.feed(chunk)
                if not self.started:
                    if not out:
                        continue
                    self.first_byte_at = self.router.clock()
                    self.router.metrics.ttft.labels(replica.url).observe(
                        self.first_byte_at - self.call.arrival
                    )
                    await self._start(send, 200, SSE_HEADERS)
                if out:
                    await self._body(send, out, more=True)
        except httpx.TransportError as e:
            self.verdict = False
            if not self.started:
                raise _Retry(f"{type(e).__name__} before the first byte") from None
            log.warning("replica %s failed mid-stream: %s", replica.url, e)
            self.router.spawn(
                self.router.confirm(replica, f"{type(e).__name__} mid-stream", "failed")
            )
            await self._fail_stream(send, "the engine replica failed mid-stream")
            return parser.finish()
        tail = parser.flush()
        if not self.started:
            await self._start(send, 200, SSE_HEADERS)
        await self._body(send, tail, more=False)
        usage = parser.finish()
        self._account(replica, usage)
        return usage

    async def _relay_error(self, upstream: httpx.Response, send: Send) -> None:
        """Pass an engine error on in the client API's shape, whatever the engine sent."""
        status = upstream.status_code
        try:
            content = await upstream.aread()
            doc = json.loads(content)
        except (httpx.TransportError, ValueError):
            doc = None
        if not _error_shaped(doc, self.call.anthropic):
            message = str(_error_message(doc) or f"engine answered {status}")
            content = (anthropic_error_body if self.call.anthropic else error_body)(status, message)
        self.outcome = "error"
        await self._send(send, status, [(b"content-type", b"application/json")], content)

    def _account(self, replica: Replica, usage: Usage) -> None:
        r, pid = self.router, self.call.program_id
        if usage.prompt_tokens is not None:
            r.metrics.prompt_tokens.labels(replica.url).inc(usage.prompt_tokens)
            r.learn_tokens(pid, self.call.prompt_chars, usage.prompt_tokens)
        if usage.completion_tokens is not None:
            r.metrics.output_tokens.labels(replica.url).inc(usage.completion_tokens)
        r.metrics.record_hits(replica.url, usage)

    # sending ---------------------------------------------------------------------------
    def _headers(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        out = [*headers, (b"x-mori-program-id", self.call.program_id.encode())]
        if self.replica is not None:  # lets replay clients measure churn across replicas
            out.append((b"x-mori-replica", self.replica.url.encode()))
        return out

    async def _start(self, send: Send, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        try:
            await send(
                {"type": "http.response.start", "status": status, "headers": self._headers(headers)}
            )
        except OSError:
            raise ClientGone from None

    async def _body(self, send: Send, data: bytes, more: bool) -> None:
        try:
            await send({"type": "http.response.body", "body": data, "more_body": more})
        except OSError:
            raise ClientGone from None

    async def _send(self, send: Send, status: int, headers: list, content: bytes) -> None:
        await self._start(send, status, [*headers, (b"content-length", str(len(content)).encode())])
        await self._body(send, content, more=False)

    async def _fail_stream(self, send: Send, message: str) -> None:
        """End a started stream with an error event the client's SDK raises on."""
        self.outcome = "error"
        error = ApiError(502, message, code="upstream_error")
        await self._body(send, error.sse(self.call.anthropic), more=False)

    async def _error(self, send: Send, error: ApiError) -> None:
        if self.started:  # mid-stream: the status is gone, tell the client in the stream
            with contextlib.suppress(ClientGone):
                await self._body(send, error.sse(self.call.anthropic), more=False)
            return
        headers = [(k.encode(), v.encode()) for k, v in error.headers.items()]
        with contextlib.suppress(ClientGone):
            await self._send(
                send,
                error.status,
                [(b"content-type", b"application/json"), *headers],
                error.body(self.call.anthropic),
            )


def _error_shaped(doc: Any, anthropic: bool) -> bool:
    """Whether an engine's error body already has the client API's error shape."""
    if not isinstance(doc, dict):
        return False
    if anthropic:
        return doc.get("type") == "error" and isinstance(doc.get("error"), dict)
    return isinstance(doc.get("error"), dict | str)


def _error_message(doc: Any) -> Any:
    """The message of an engine error body in any common shape (FastAPI, OpenAI, Anthropic)."""
    if not isinstance(doc, dict):
        return None
    inner = doc.get("error")
    if isinstance(inner, dict):
        return inner.get("message")
    return inner if isinstance(inner, str) else doc.get("detail") or doc.get("message")


async def _disconnected(receive: Receive) -> None:
    """Return when the client goes away (the request body was already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
