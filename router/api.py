"""The router's HTTP face: OpenAI / Anthropic inference endpoints, admin API, /metrics.

`create_app(config)` builds a FastAPI app whose lifespan owns one `Router`. Inference
requests are validated here (cheaply: the engine validates the rest) and handed to an
`Exchange`, which gates, forwards and accounts for them.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from router import identity
from router.agent_identity import anchor_of
from router.config import RouterConfig
from router.controller import Router
from router.errors import ApiError
from router.exchange import PASSED_HEADERS, Call, Exchange
from router.policy import Policy
from router.policy.types import Placement, Tier

log = logging.getLogger("mori.api")

INFERENCE_PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "messages": "/v1/messages",
}


def create_app(
    config: RouterConfig,
    policy: Policy | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> FastAPI:
    """The ASGI app of `mori serve` (also used in-process by tests and benchmarks)."""
    router = Router(config, policy=policy, clock=clock)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = RouterApp(title="MORI router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = router
    _install_error_handlers(app)
    auth = Auth(config)

    async def proxy(request: Request, kind: str) -> Response:
        key = auth.client(request)
        raw = await read_body(request, config.max_body_bytes)
        body = parse_json_object(raw)
        validate(kind, body)
        try:
            program_id = identity.resolve(body, request.headers, key)
        except identity.IdentityError as e:
            raise ApiError(400, str(e), param="program_id") from None
        body.pop("program_id", None)
        if isinstance(body.get("extra_body"), dict):
            body["extra_body"].pop("program_id", None)
        agent = agent_role(body.pop("agent", None), request.headers.get("x-agent-role"))
        anchor = anchor_of(body)
        parent = _parent(body.pop("parent_id", None), request.headers.get("x-parent-id"))
        stream = bool(body.get("stream", False))
        options = body.get("stream_options")
        call = Call(
            path=INFERENCE_PATHS[kind],
            anthropic=kind == "messages",
            body=body,
            program_id=program_id,
            stream=stream,
            client_wants_usage=isinstance(options, dict) and bool(options.get("include_usage")),
            prompt_chars=len(raw),
            arrival=router.clock(),
            headers={h: request.headers[h] for h in PASSED_HEADERS if h in request.headers},
            agent=agent or (anchor.agent if anchor else None),
            anchor=anchor,
            parent=identity.namespace(key) + parent if parent else None,
        )
        return Exchange(router, call)

    app.fast_paths = {
        path: functools.partial(proxy, kind=kind) for kind, path in INFERENCE_PATHS.items()
    }

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        auth.client(request)
        for url in router.policy.tiers.replicas():
            with contextlib.suppress(Exception):
                r = await router.client.get(url + "/v1/models", timeout=config.health_timeout_s)
                if r.status_code == 200:
                    return Response(r.content, media_type="application/json")
        raise ApiError(503, "no healthy replica answered /v1/models", code="upstream_unavailable")

    # programs --------------------------------------------------------------------------
    def program_of(request: Request, program_id: str) -> str:
        """Admin callers name the full id; clients name their own (namespaced by key)."""
        if auth.is_admin(request):
            return program_id
        return identity.namespace(auth.client(request)) + program_id

    def known(program_id: str) -> None:
        if program_id not in router.policy.programs:
            raise ApiError(404, f"no live program {program_id!r}", param="program_id")

    @app.post("/v1/programs/{program_id:path}/end")
    async def end_program(request: Request, program_id: str) -> dict[str, Any]:
        pid = program_of(request, program_id)
        known(pid)
        router.end_program(pid)
        return {"program_id": pid, "ended": True}

    @app.post("/v1/programs/{program_id:path}/tool_start")
    async def tool_start(request: Request, program_id: str) -> dict[str, Any]:
        pid = program_of(request, program_id)
        body = parse_json_object(await read_body(request, config.max_body_bytes))
        tool = body.get("tool")
        predict = body.get("predict_time")
        if not isinstance(tool, str) or not tool:
            raise ApiError(400, "`tool` must be a non-empty string", param="tool")
        if predict is not None and (not _number(predict) or predict < 0):
            raise ApiError(400, "`predict_time` must be a number of seconds >= 0", "predict_time")
        agent = agent_role(body.get("agent"), request.headers.get("x-agent-role"))
        known(pid)
        router.apply(router.policy.on_tool_start(pid, router.clock(), tool, agent, predict))
        return {"program_id": pid, "tool": tool}

    @app.post("/v1/programs/{program_id:path}/tool_end")
    async def tool_end(request: Request, program_id: str) -> dict[str, Any]:
        pid = program_of(request, program_id)
        known(pid)
        router.apply(router.policy.on_tool_end(pid, router.clock()))
        return {"program_id": pid}

    @app.get("/v1/programs")
    async def list_programs(request: Request) -> dict[str, Any]:
        auth.admin(request)
        now = router.clock()
        return {
            "object": "list",
            "policy": router.policy.name,
            "gate": {"waiting": router.gate.waiting, "turns": router.gate.turns},
            "in_flight": router.in_flight,
            "data": [router.policy.describe(pid, now) for pid in list(router.policy.programs)],
        }

    @app.get("/v1/programs/{program_id:path}")
    async def get_program(request: Request, program_id: str) -> dict[str, Any]:
        auth.admin(request)
        view = router.policy.describe(program_id, router.clock())
        if view is None:
            raise ApiError(404, f"no live program {program_id!r}", param="program_id")
        return view

    @app.get("/v1/replicas")
    async def replicas(request: Request) -> dict[str, Any]:
        auth.admin(request)
        return {"object": "list", "data": [replica_view(router, url) for url in router.replicas]}

    # operations --------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        healthy = len(router.policy.tiers.replicas())
        status = 200 if healthy else 503
        body = {"status": "ok" if healthy else "unavailable", "healthy_replicas": healthy}
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        router.metrics.refresh_tiers(router.policy)
        router.metrics.gate_waiting.set(router.gate.waiting)
        return Response(router.metrics.render(), media_type=router.metrics.content_type)

    return app


class RouterApp(FastAPI):
    """FastAPI app whose inference endpoints skip the middleware stack.

    Those are the hot path: FastAPI's exception, telemetry, body-limit and routing layers
    cost ~15% of the router's CPU per request. Their errors are still OpenAI-shaped.
    """

    fast_paths: dict[str, Callable[[Request], Awaitable[Response]]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = None
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.fast_paths.get(scope["path"])
        if handler is None:
            await super().__call__(scope, receive, send)
            return
        try:
            response = await handler(Request(scope, receive))
        except ApiError as e:
            response = e.response()
        except Exception:
            log.exception("inference request failed in the router")
            response = ApiError(500, "internal router error", code="internal_error").response()
        await response(scope, receive, send)


def replica_view(router: Router, url: str) -> dict[str, Any]:
    tiers, replica = router.policy.tiers, router.replicas[url]
    view: dict[str, Any] = {
        "url": url,
        "healthy": tiers.healthy.get(url, False),
        "failed_checks": replica.failures,
        "hints_supported": replica.hints_supported,
    }
    for tier in (Tier.GPU, Tier.CPU):
        place = Placement(tier, url)
        view[tier.value] = {
            "programs": tiers.count(place),
            "used_tokens": tiers.used(place),
            "budget_tokens": tiers.budget(place),
        }
    return view


# --- request parsing --------------------------------------------------------------------
async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing more than `limit` bytes without reading them all (413).

    A client that leaves mid-body gets a 499 nobody reads (the server drops it): no
    router state exists for the request yet, so there is nothing else to undo."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body larger than {limit} bytes", code="body_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(
                    413, f"request body larger than {limit} bytes", code="body_too_large"
                )
            chunks.append(chunk)
    except ClientDisconnect:  # e.g. a replay cancelled at shutdown: nothing was started yet
        raise ApiError(499, "client closed the request", code="client_disconnect") from None
    return b"".join(chunks)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise ApiError(400, "request body is empty; send a JSON object", code="invalid_json")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        raise ApiError(400, "request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    return body


def _reject_constant(name: str) -> Any:
    """NaN and Infinity are not JSON; engines choke on them."""
    raise ValueError(f"{name} is not valid JSON")


def agent_role(field: Any, header: str | None) -> str | None:
    """The agent role (e.g. "planner", "coder") tool durations are learnt per: body
    `agent` first, then the `X-Agent-Role` header; None when neither is given."""
    if field is None:
        return (header or "").strip() or None
    ok = isinstance(field, str) and bool(field.strip())
    _require(ok, "`agent` must be a non-empty string", "agent")
    return field.strip()


def _parent(field: Any, header: str | None) -> str | None:
    """The program this one works for (a subagent's parent: its task for the agent runtime
    layer): body `parent_id`, then the `X-Parent-Id` header."""
    value = field if field is not None else ((header or "").strip() or None)
    ok = value is None or (isinstance(value, str) and 0 < len(value) <= identity.MAX_ID_CHARS)
    limit = identity.MAX_ID_CHARS
    _require(ok, f"`parent_id` must be a string of 1 to {limit} characters", "parent_id")
    return value


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


# --- auth -----------------------------------------------------------------------------
class Auth:
    """Client keys (Authorization: Bearer, or Anthropic's x-api-key) and the admin key."""

    def __init__(self, config: RouterConfig) -> None:
        self.keys = [k.encode() for k in config.api_keys]
        self.admin_key = config.admin_key.encode() if config.admin_key else None

    @staticmethod
    def _presented(request: Request) -> str | None:
        header = request.headers.get("authorization", "")
        if header[:7].lower() == "bearer ":
            return header[7:].strip()
        return request.headers.get("x-api-key")

    def client(self, request: Request) -> str | None:
        """The caller's client key (None when no keys are configured); 401 otherwise."""
        if not self.keys:
            return None
        key = self._presented(request)
        if key is not None and any(hmac.compare_digest(key.encode(), k) for k in self.keys):
            return key
        raise ApiError(401, "missing or invalid API key", code="invalid_api_key")

    def is_admin(self, request: Request) -> bool:
        if self.admin_key is None:
            return False
        key = self._presented(request)
        return key is not None and hmac.compare_digest(key.encode(), self.admin_key)

    def admin(self, request: Request) -> None:
        """Admin endpoints: the admin key; without one configured, any valid client key."""
        if self.admin_key is None:
            self.client(request)
            return
        if not self.is_admin(request):
            raise ApiError(403, "this endpoint needs the admin key", code="admin_only")


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        return ApiError(exc.status_code, message).response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        return ApiError(400, "invalid request parameters").response()

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> Response:
        return ApiError(500, "internal router error", code="internal_error").response()
