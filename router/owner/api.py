"""The policy owner's HTTP face: admin API, program endpoints, /health, /metrics.

`create_app(config)` builds the FastAPI app whose lifespan owns the one `Router`. It is
served on the owner's private loopback port; the data-plane workers (router/plane/worker.py)
serve the public port, handle the inference endpoints themselves and relay every other
request here unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from router.config import RouterConfig
from router.owner.controller import Router
from router.policy import Policy
from router.policy.labels import LabelError, check_label
from router.policy.types import Placement, Tier
from router.protocol import identity
from router.protocol.auth import Auth
from router.protocol.intake import agent_role, parse_json_object, read_body, request_hints
from router.wire.errors import ApiError
from router.wire.upstream import UpstreamError

log = logging.getLogger("mori.api")


def create_app(
    config: RouterConfig,
    policy: Policy | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> FastAPI:
    """The owner's ASGI app (also used in-process by tests)."""
    router = Router(config, policy=policy, clock=clock)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="MORI router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = router
    _install_error_handlers(app)
    auth = Auth(config)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        auth.client(request.headers)
        for url in router.policy.tiers.replicas():
            with contextlib.suppress(UpstreamError):
                status, content = await router.upstream.call(
                    url, b"GET", b"/v1/models", timeout_s=config.health_timeout_s
                )
                if status == 200:
                    return Response(content, media_type="application/json")
        raise ApiError(503, "no healthy replica answered /v1/models", code="upstream_unavailable")

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        """Anthropic token counting: no program and no KV, so the first healthy replica
        that answers counts (every replica serves the one model); its answer, errors
        included (Anthropic-shaped, as SGLang and the emulator send them), is relayed."""
        auth.client(request.headers)
        body = await request.body()
        path = b"/v1/messages/count_tokens"
        for url in router.policy.tiers.replicas():
            with contextlib.suppress(UpstreamError):
                status, content = await router.upstream.call(
                    url, b"POST", path, body, timeout_s=config.request_timeout_s
                )
                return Response(content, status_code=status, media_type="application/json")
        raise ApiError(503, "no healthy replica answered count_tokens", code="upstream_unavailable")

    # programs --------------------------------------------------------------------------
    def program_of(request: Request, program_id: str) -> str:
        """Admin callers name the full id; clients name their own (namespaced by key)."""
        if auth.is_admin(request.headers):
            return program_id
        return identity.namespace(auth.client(request.headers)) + program_id

    async def known(program_id: str) -> None:
        """A program event is traffic: a standby takes over first (router/owner/leadership.py)."""
        await router.ensure_active()
        if program_id not in router.policy.programs:
            raise ApiError(404, f"no live program {program_id!r}", param="program_id")

    @app.post("/v1/programs/{program_id:path}/end")
    async def end_program(request: Request, program_id: str) -> dict[str, Any]:
        pid = program_of(request, program_id)
        await known(pid)
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
        agent = agent_role(body.get("agent"), request_hints(request.headers, None).agent)
        if predict is not None:  # trace seconds, as every duration the router is given
            predict /= config.time_scale
        await known(pid)
        router.tool_event(
            pid, lambda now: router.policy.on_tool_start(pid, now, tool, agent, predict)
        )
        return {"program_id": pid, "tool": tool}

    @app.post("/v1/programs/{program_id:path}/tool_end")
    async def tool_end(request: Request, program_id: str) -> dict[str, Any]:
        pid = program_of(request, program_id)
        await known(pid)
        router.tool_event(pid, lambda now: router.policy.on_tool_end(pid, now))
        return {"program_id": pid}

    @app.get("/v1/programs")
    async def list_programs(request: Request) -> dict[str, Any]:
        auth.admin(request.headers)
        now = router.clock()
        return {
            "object": "list",
            "policy": router.policy.name,
            "gate": {"waiting": router.gate.waiting, "turns": router.gate.turns},
            "in_flight": router.in_flight,
            "data": [describe(pid, now) for pid in list(router.policy.programs)],
        }

    @app.get("/v1/programs/{program_id:path}")
    async def get_program(request: Request, program_id: str) -> dict[str, Any]:
        auth.admin(request.headers)
        view = describe(program_id, router.clock())
        if view is None:
            raise ApiError(404, f"no live program {program_id!r}", param="program_id")
        return view

    def describe(program_id: str, now: float) -> dict[str, Any] | None:
        """The policy's view of a live program, with its identity's source and parent."""
        view = router.policy.describe(program_id, now)
        return None if view is None else {**view, **router.sessions.of(program_id)}

    @app.get("/v1/sessions")
    async def list_sessions(request: Request) -> dict[str, Any]:
        auth.admin(request.headers)
        return {"object": "list", "data": router.sessions.view()}

    # applications (agent graphs: mori+space) ---------------------------------------------
    def graphs_policy() -> Any:
        """The policy's space scheduler (`router.policy.space`), which holds the graphs."""
        if not router.policy.capabilities.apps:
            raise ApiError(
                400,
                f"policy {router.policy.name!r} does not schedule by application graph "
                "(run the router with --policy mori+space or mori-priced+space)",
                code="unsupported_by_policy",
            )
        return router.policy.space

    @app.post("/v1/apps")
    async def register_app(request: Request) -> dict[str, Any]:
        """An application's agent graph: `{"app_id": ..., "edges": [[from, to], ...]}`;
        its requests then name it (`app_id` in the body or `X-App-Id`) and their role."""
        key = auth.client(request.headers)
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
        if not auth.is_admin(request.headers):
            app_id = identity.namespace(auth.client(request.headers)) + app_id
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
        auth.admin(request.headers)
        space = graphs_policy()
        graphs = space.graphs
        data = [app_view(a, graphs.shapes_of(a)) for a in graphs.registered]
        data += [app_view(a, graphs.shapes_of(a), True) for a in graphs.inferred]
        return {"object": "list", "data": data, **space.space_view()}

    @app.get("/v1/replicas")
    async def replicas(request: Request) -> dict[str, Any]:
        auth.admin(request.headers)
        data = [replica_view(router, url) for url in router.replicas]
        return {"object": "list", "policy": router.policy.name, **role(router), "data": data}

    # operations --------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        healthy = len(router.policy.tiers.replicas())
        status = 200 if healthy else 503
        body = {"status": "ok" if healthy else "unavailable", "healthy_replicas": healthy}
        body.update(role(router))
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        router.metrics.refresh_tiers(router.policy)
        router.metrics.gate_waiting.set(router.gate.waiting)
        return Response(router.metrics.render(), media_type=router.metrics.content_type)

    return app


def role(router: Router) -> dict[str, Any]:
    """Whether this router steers the replicas now, and its last hint epoch."""
    return {"role": "active" if router.active else "standby", "epoch": router.epoch}


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
    prices = router.policy.prices.get(url)
    if prices is not None:  # measured from streamed answers (Exchange._price)
        view["prices"] = prices.view()
    return view


def app_view(app_id: str, shapes: dict, inferred: bool = False) -> dict[str, Any]:
    """An application's roles with their place in its graph."""
    roles = {r: {"depth": s.depth, "out_degree": s.out_degree} for r, s in shapes.items()}
    return {"object": "app", "app_id": app_id, "inferred": inferred, "roles": roles}


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


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
