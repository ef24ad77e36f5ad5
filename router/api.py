"""The router's HTTP face: OpenAI / Anthropic inference endpoints, admin API, /metrics.

`create_app(config)` builds a FastAPI app whose lifespan owns one `Router`. Inference
requests are validated here (cheaply: the engine validates the rest) and handed to an
`Exchange`, which gates, forwards and accounts for them.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from router import identity
from router.config import RouterConfig
from router.controller import Router
from router.errors import ApiError
from router.exchange import Call, Exchange
from router.intake import Hints, Intake, agent_role, parse_json_object, read_body
from router.policy import Policy
from router.policy.types import Placement, Tier
from router.sanitize import LabelError, check_label, forwarded_headers, header_text

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
    intake = Intake(config.worker_parse_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            intake.close()
            await router.stop()

    app = RouterApp(title="MORI router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = router
    _install_error_handlers(app)
    auth = Auth(config)

    async def proxy(request: Request, kind: str) -> Response:
        key = auth.client(request)
        raw = await read_body(request, config.max_body_bytes, config.body_timeout_s)
        prepared = await intake.prepare(kind, raw, request_hints(request, key))
        call = Call(
            path=INFERENCE_PATHS[kind],
            anthropic=kind == "messages",
            content=prepared.content,
            rid=prepared.rid,
            program_id=prepared.program_id,
            stream=prepared.stream,
            client_wants_usage=prepared.client_wants_usage,
            client_wants_details=prepared.client_wants_details,
            prompt_chars=prepared.prompt_chars,
            arrival=router.clock(),
            headers=forwarded_headers(request.headers),
            agent=prepared.agent,
            anchor=prepared.anchor,
            parent=prepared.parent,
            app=prepared.app,
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
        raw = await read_body(request, config.max_body_bytes, config.body_timeout_s)
        body = parse_json_object(raw)
        try:
            tool = check_label(body.get("tool"), "tool")
        except LabelError as e:
            raise ApiError(400, str(e), param="tool") from None
        predict = body.get("predict_time")
        if predict is not None and (not _number(predict) or predict < 0):
            raise ApiError(400, "`predict_time` must be a number of seconds >= 0", "predict_time")
        agent = agent_role(body.get("agent"), request_hints(request, None).agent)
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

    # applications (agent graphs: mori+space) ---------------------------------------------
    def graphs_policy() -> Any:
        if not hasattr(router.policy, "register_app"):
            raise ApiError(
                400,
                f"policy {router.policy.name!r} does not schedule by application graph "
                "(run the router with --policy mori+space or mori-priced+space)",
                code="unsupported_by_policy",
            )
        return router.policy

    @app.post("/v1/apps")
    async def register_app(request: Request) -> dict[str, Any]:
        """An application's agent graph: `{"app_id": ..., "edges": [[from, to], ...]}`;
        its requests then name it (`app_id` in the body or `X-App-Id`) and their role."""
        key = auth.client(request)
        body = parse_json_object(
            await read_body(request, config.max_body_bytes, config.body_timeout_s)
        )
        try:
            app_id = identity.namespace(key) + check_label(body.get("app_id"), "app_id")
        except LabelError as e:
            raise ApiError(400, str(e), param="app_id") from None
        policy = graphs_policy()
        try:
            shapes = policy.register_app(app_id, body.get("edges"))
        except ValueError as e:
            raise ApiError(400, str(e), param="edges") from None
        return app_view(app_id, shapes)

    def app_of(request: Request, app_id: str) -> tuple[Any, str]:
        policy = graphs_policy()
        if not auth.is_admin(request):
            app_id = identity.namespace(auth.client(request)) + app_id
        if app_id not in policy.graphs.registered and app_id not in policy.graphs.inferred:
            raise ApiError(404, f"no application {app_id!r}", param="app_id")
        return policy, app_id

    @app.get("/v1/apps/{app_id:path}")
    async def get_app(request: Request, app_id: str) -> dict[str, Any]:
        policy, app_id = app_of(request, app_id)
        return app_view(app_id, policy.graphs.shapes_of(app_id), app_id in policy.graphs.inferred)

    @app.delete("/v1/apps/{app_id:path}")
    async def delete_app(request: Request, app_id: str) -> dict[str, Any]:
        policy, app_id = app_of(request, app_id)
        if not policy.graphs.unregister(app_id):
            raise ApiError(404, f"{app_id!r} is inferred, not registered", param="app_id")
        return {"app_id": app_id, "deleted": True}

    @app.get("/v1/apps")
    async def list_apps(request: Request) -> dict[str, Any]:
        auth.admin(request)
        graphs = graphs_policy().graphs
        data = [app_view(a, graphs.shapes_of(a)) for a in graphs.registered]
        data += [app_view(a, graphs.shapes_of(a), True) for a in graphs.inferred]
        return {"object": "list", "data": data, **router.policy.space_view()}

    @app.get("/v1/replicas")
    async def replicas(request: Request) -> dict[str, Any]:
        auth.admin(request)
        data = [replica_view(router, url) for url in router.replicas]
        return {"object": "list", "policy": router.policy.name, "data": data}

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
        anthropic = scope["path"] == "/v1/messages"
        try:
            response = await handler(Request(scope, receive))
        except ApiError as e:
            response = e.response(anthropic)
        except Exception:
            log.exception("inference request failed in the router")
            error = ApiError(500, "internal router error", code="internal_error")
            response = error.response(anthropic)
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


def app_view(app_id: str, shapes: dict, inferred: bool = False) -> dict[str, Any]:
    """An application's roles with their place in its graph."""
    roles = {r: {"depth": s.depth, "out_degree": s.out_degree} for r, s in shapes.items()}
    return {"object": "app", "app_id": app_id, "inferred": inferred, "roles": roles}


# --- request parsing --------------------------------------------------------------------
def request_hints(request: Request, key: str | None) -> Hints:
    """The headers `prepare` reads, decoded as UTF-8 (400 naming the header if not)."""
    try:
        program_id = header_text(request.headers, "x-program-id")
        agent = header_text(request.headers, "x-agent-role")
        parent = header_text(request.headers, "x-parent-id")
        app = header_text(request.headers, "x-app-id")
    except LabelError as e:
        raise ApiError(400, str(e), param=e.field, code="invalid_value") from None
    namespace = identity.namespace(key)
    return Hints(program_id or None, agent or None, namespace, parent or None, app or None)


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


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
    def shaped(request: Request, error: ApiError) -> Response:
        return error.response(anthropic=request.url.path.startswith("/v1/messages"))

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return shaped(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        return shaped(request, ApiError(exc.status_code, message))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        return shaped(request, ApiError(400, "invalid request parameters"))

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> Response:
        return shaped(request, ApiError(500, "internal router error", code="internal_error"))
