"""One inference request on a data-plane worker: parse, ask the owner, forward, relay.

The worker never decides placement: it sends the owner a `Ticket` and forwards to the
replica the owner names, relaying the engine's bytes to the client (the forced usage
chunk removed, errors reshaped for the client's API) and reporting an `Outcome` per
attempt. A failure before the client's first byte is reported as a retry, and the owner
names another replica or the error to answer. A client that leaves is told to nobody but
the owner (its gated request is cancelled) and the engine (its request is aborted).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from router.engines.outliers import Attempt, Attempts
from router.engines.replicas import Replica
from router.protocol.accounting import (
    AnthropicStream,
    OpenAIStream,
    Usage,
    anthropic_body,
    openai_body,
    without_sglext,
)
from router.protocol.auth import Auth
from router.protocol.intake import Intake, Prepared, request_hints
from router.protocol.link import ERROR, Outcome, Ticket
from router.protocol.sanitize import forwarded_headers
from router.wire.errors import ApiError, anthropic_error_body, error_body
from router.wire.server import BodyTooLarge, Request
from router.wire.upstream import (
    Broken,
    ConnectFailed,
    Connection,
    InvalidRequest,
    Response,
    Upstream,
)

log = logging.getLogger("mori.relay")

KIND_OF_PATH = {
    b"/v1/chat/completions": "chat",
    b"/v1/completions": "completions",
    b"/v1/messages": "messages",
}
PATH_OF_KIND = {kind: path for path, kind in KIND_OF_PATH.items()}
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
JSON = (b"content-type", b"application/json")


def text_headers(request: Request) -> dict[str, str]:
    """Header names and values as text (Latin-1, as ASGI servers hand them over)."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in request.headers}


def body_now(request: Request, limit: int) -> bytes | None:
    """The body if it has all arrived (most requests: head and body come in one read),
    else None; a body over the size limit is a 413 (refused before reading when declared)."""
    declared = request.header(b"content-length")
    too_large = declared is not None and declared.isdigit() and int(declared) > limit
    if too_large or request.size > limit:
        raise ApiError(413, f"request body larger than {limit} bytes", code="body_too_large")
    return request.content() if request.complete else None


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body within the size limit (413) and the deadline (408; the connection is then
    closed)."""
    body = body_now(request, limit)
    if body is not None:
        return body
    try:
        return await request.body(limit, timeout_s)
    except BodyTooLarge:
        raise ApiError(
            413, f"request body larger than {limit} bytes", code="body_too_large"
        ) from None
    except TimeoutError:
        raise ApiError(
            408, f"request body not received within {timeout_s:g} s", code="body_timeout"
        ) from None


class OwnerAsk(Protocol):
    """What a relay asks the owner about its request (the worker's end of the link)."""

    def open(self, ticket: Ticket) -> int: ...

    async def next(self, seq: int) -> tuple[int, Any]: ...

    def report(self, seq: int, outcome: Outcome) -> None: ...

    def cancel(self, seq: int) -> None: ...

    def forget(self, seq: int) -> None: ...


@dataclass(frozen=True, slots=True)
class RelayKit:
    """What a relay works with, handed over by its worker once: a relay reads these and
    never the worker itself."""

    link: OwnerAsk
    auth: Auth
    intake: Intake
    attempts: Attempts
    upstream: Upstream
    replicas: Mapping[str, Replica]
    spawn: Callable[[Coroutine[Any, Any, object]], None]  # a job that outlives its request
    max_body_bytes: int
    body_timeout_s: float
    anchors: bool  # tickets carry request anchors (the owner's policy warms them)


class Relay:
    """The worker's side of one inference request."""

    def __init__(self, kit: RelayKit, request: Request, kind: str) -> None:
        self.kit = kit
        self.request = request
        self.conn = request.conn
        self.kind = kind
        self.anthropic = kind == "messages"
        self.program_id: str | None = None
        self.replica: str | None = None
        self.started = False  # the answer's head went to the client
        self.sent = 0.0  # time.monotonic() when the current attempt was sent
        self.outcome = Outcome()  # of the current attempt
        self.answered = False  # the current attempt's stream reached its end marker

    async def run(self) -> None:
        w = self.kit
        try:
            headers = text_headers(self.request)
            key = w.auth.client(headers)
            raw = body_now(self.request, w.max_body_bytes)
            if raw is None:
                raw = await read_body(self.request, w.max_body_bytes, w.body_timeout_s)
            hints = request_hints(headers, key)
            prepared = w.intake.inline(self.kind, raw, hints)
            if prepared is None:
                prepared = await w.intake.prepare(self.kind, raw, hints)
            self.program_id = prepared.program_id
            forward = [(k.encode(), v.encode()) for k, v in forwarded_headers(headers).items()]
            ticket = Ticket(
                prepared.program_id,
                prepared.prompt_chars,
                time.monotonic(),
                prepared.agent,
                prepared.anchor if w.anchors else None,
                prepared.parent,
                prepared.app,
                prepared.segments,
                prepared.round,
                prepared.identity,
                prepared.hints,
            )
            await self._exchange(ticket, prepared, [JSON, *forward])
        except ApiError as e:
            self._error(e)

    async def _exchange(
        self, ticket: Ticket, prepared: Prepared, headers: list[tuple[bytes, bytes]]
    ) -> None:
        link = self.kit.link
        seq = link.open(ticket)
        attempting = False
        try:
            while True:
                kind, value = await link.next(seq)
                if kind == ERROR:
                    raise value
                attempting = True
                outcome = await self._attempt(value, prepared, headers)
                link.report(seq, outcome)
                attempting = False
                if outcome.retry is None:
                    return
        except asyncio.CancelledError:  # the client left
            if attempting and self.answered:  # after the whole streamed answer: served
                link.report(seq, self.outcome)
            elif attempting:  # the attempt is over: neither served nor the replica's fault
                link.report(seq, Outcome(status="client_disconnect"))
            else:  # held by the owner (gated): it cancels the request there
                link.cancel(seq)
            raise
        finally:
            link.forget(seq)

    # one attempt -----------------------------------------------------------------------
    async def _attempt(
        self, url: str, prepared: Prepared, headers: list[tuple[bytes, bytes]]
    ) -> Outcome:
        """Forward to `url` and relay; the Outcome says how it went (also when the client
        leaves: reported, then the cancellation goes on)."""
        w = self.kit
        self.replica = url
        outcome = self.outcome = Outcome()
        self.answered = False
        attempt = w.attempts.begin(url)
        complete = False
        self.sent = time.monotonic()
        try:
            try:
                response = await w.upstream.request(
                    url,
                    b"POST",
                    PATH_OF_KIND[self.kind],
                    prepared.content,
                    headers,
                    on_connection=lambda conn: _bind(attempt, conn),
                )
            except InvalidRequest:
                outcome.status = "error"
                self._error(ApiError(400, "the request could not be sent to the engine"))
                complete = True
                return outcome
            except ConnectFailed as e:
                return _retry(outcome, str(e), certain=True)
            except Broken as e:
                if attempt.cut_reason is not None:
                    return _retry(outcome, attempt.cut_reason, certain=True)
                return _retry(outcome, f"{e} (before the response started)")
            attempt.last_byte = w.attempts.clock()
            try:
                if response.status >= 400:
                    outcome.verdict = True  # an answer, even an error: the replica serves
                    await self._relay_error(response, outcome)
                elif prepared.stream:
                    await self._relay_stream(response, prepared, attempt, outcome)
                else:
                    await self._relay_body(response, prepared, attempt, outcome)
                complete = outcome.retry is None and outcome.suspect is None
            finally:
                response.close()
            return outcome
        finally:
            w.attempts.end(attempt)
            if not complete and not self.answered:  # a whole answer needs no abort
                w.spawn(w.replicas[url].abort(prepared.rid))

    async def _relay_body(
        self, response: Response, prepared: Prepared, attempt: Attempt, outcome: Outcome
    ) -> None:
        try:
            content = await response.read()
        except Broken as e:
            cut = attempt.cut_reason
            _retry(outcome, cut or f"{e} (while reading the answer)", certain=cut is not None)
            return
        outcome.usage = (anthropic_body if self.anthropic else openai_body)(content)
        if not prepared.client_wants_details:
            content = without_sglext(content)
        outcome.ttft = time.monotonic()
        outcome.verdict = True
        ctype = response.header(b"content-type") or b"application/json"
        self._send(response.status, [(b"content-type", ctype)], content)

    async def _relay_stream(
        self, response: Response, prepared: Prepared, attempt: Attempt, outcome: Outcome
    ) -> None:
        parser = (
            AnthropicStream(prepared.client_wants_details)
            if self.anthropic
            else OpenAIStream(prepared.client_wants_usage, prepared.client_wants_details)
        )
        conn, clock = self.conn, self.kit.attempts.clock
        last = b""  # the answer's last bytes: they go out with the end marker, in one write
        try:
            async for chunk in response:
                attempt.last_byte = clock()
                out = parser.feed(chunk)
                if not out:
                    continue
                if not self.started:
                    outcome.ttft = time.monotonic()
                    self._start(200, SSE_HEADERS)
                if response.complete and not response.chunks:
                    last = out
                    continue
                conn.write(out)
                if conn.writable is not None:  # the client reads slower than we write
                    await conn.drain()
        except asyncio.CancelledError:
            if parser.ended:  # the client left once it had the whole answer: served
                self._served(outcome, parser)
            raise
        except Broken as e:
            outcome.verdict = False
            cut = attempt.cut_reason
            if not self.started:
                _retry(outcome, cut or f"{e} (before the first byte)", certain=cut is not None)
                return
            if cut is not None:
                log.warning("request on %s cut mid-stream: %s", self.replica, cut)
                self._fail_stream(outcome, "the engine replica stopped responding mid-stream")
                return
            log.warning("replica %s failed mid-stream: %s", self.replica, e)
            outcome.suspect = f"{e} (mid-stream)"
            outcome.usage = parser.finish()
            self._fail_stream(outcome, "the engine replica failed mid-stream")
            return
        tail = parser.flush()
        if not self.started:
            self._start(200, SSE_HEADERS)
        conn.end(last + tail)
        self._served(outcome, parser)

    def _served(self, outcome: Outcome, parser: OpenAIStream | AnthropicStream) -> None:
        """A whole streamed answer: its usage and, for the policy's prices, its times."""
        self.answered = True
        outcome.usage = parser.finish()
        outcome.verdict = True
        if outcome.ttft is not None:
            outcome.step = (outcome.ttft - self.sent, time.monotonic() - outcome.ttft)

    async def _relay_error(self, response: Response, outcome: Outcome) -> None:
        """Pass an engine error on in the client API's shape, whatever the engine sent."""
        status = response.status
        try:
            content = await response.read()
            doc = json.loads(content)
        except (Broken, ValueError):
            content, doc = b"", None
        if not _error_shaped(doc, self.anthropic):
            message = str(_error_message(doc) or f"engine answered {status}")
            content = (anthropic_error_body if self.anthropic else error_body)(status, message)
        outcome.status = "error"
        self._send(status, [JSON], content)

    # answering -------------------------------------------------------------------------
    def _headers(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        out = list(headers)
        if self.program_id is not None:
            out.append((b"x-mori-program-id", self.program_id.encode()))
        if self.replica is not None:  # lets replay clients measure churn across replicas
            out.append((b"x-mori-replica", self.replica.encode()))
        return out

    def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.conn.start(status, self._headers(headers))

    def _send(self, status: int, headers: list[tuple[bytes, bytes]], content: bytes) -> None:
        self.started = True
        self.conn.send(status, self._headers(headers), content)

    def _fail_stream(self, outcome: Outcome, message: str) -> None:
        """End a started stream with an error event the client's SDK raises on."""
        outcome.status = "error"
        self.conn.end(ApiError(502, message, code="upstream_error").sse(self.anthropic))

    def _error(self, error: ApiError) -> None:
        if self.started:  # mid-stream: the status is gone, tell the client in the stream
            self.conn.end(error.sse(self.anthropic))
            return
        headers = [JSON, *((k.encode(), v.encode()) for k, v in error.headers.items())]
        self._send(error.status, headers, error.body(self.anthropic))


def _bind(attempt: Attempt, conn: Connection) -> None:
    """A cut of the attempt fails its engine connection (the reader raises Broken)."""
    attempt.cutoff = lambda reason: conn.fail(Broken(reason))


def _retry(outcome: Outcome, why: str, certain: bool = False) -> Outcome:
    outcome.verdict, outcome.retry, outcome.certain = False, why, certain
    outcome.usage = Usage()
    return outcome


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
