"""Shared scaffolding of the router tests: real `mori emulate` replicas and a real
`mori serve` process on free ports, plus the leak check every fault test ends with."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import uvicorn
import yaml
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.servers import free_port, mori, spawn

FAST = {  # background loops fast enough for tests to observe them within a second
    "tick_s": 0.2,
    "hint_sync_s": 1.0,
    "capacity_refresh_s": 5.0,
    "health_interval_s": 0.3,
    "health_timeout_s": 1.0,
    "health_failures": 2,
    "request_timeout_s": 10.0,
    "gate_timeout_s": 10.0,
    "log_level": "warning",
}


@contextlib.contextmanager
def emulator(*args: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """One emulated SGLang replica; yields its base URL and process (to kill it)."""
    port = free_port()
    with spawn(mori("emulate", "--port", str(port), *args), port) as proc:
        yield f"http://127.0.0.1:{port}", proc


@contextlib.contextmanager
def emulators(count: int, *args: str) -> Iterator[list[str]]:
    """`count` emulated SGLang replicas; yields their base URLs."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(emulator(*args))[0] for _ in range(count)]


@contextlib.contextmanager
def router(
    replicas: list[Any], log: Path | None = None, ready: str = "/health", **settings: Any
) -> Iterator[str]:
    """A `mori serve` process configured by a YAML file; yields its base URL once `ready`
    answers 200 (`/health`: a replica is in service; `/metrics`: the router is up). Its
    output goes to the file `log` when given."""
    with router_process(replicas, log, ready, **settings) as (url, _):
        yield url


@contextlib.contextmanager
def router_process(
    replicas: list[Any],
    log: Path | None = None,
    ready: str = "/health",
    port: int | None = None,
    **settings: Any,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """`router`, yielding the process too (to kill it), on `port` when given (a restarted
    router keeps its address)."""
    port = port or free_port()
    config = {**FAST, **settings, "replicas": replicas, "port": port, "host": "127.0.0.1"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "router.yaml"
        path.write_text(yaml.safe_dump(config))
        with spawn(mori("serve", "--config", str(path)), port, ready, log=log) as proc:
            yield f"http://127.0.0.1:{port}", proc


@contextlib.contextmanager
def fast_stack(policy: str) -> Iterator[tuple[str, str]]:
    """A router with `policy` in front of one fast emulated replica (x50, 60k device KV
    tokens); yields the router's and the replica's base URLs."""
    with (
        emulator("--time-scale", "50", "--gpu-tokens", "60000") as (replica, _),
        router([replica], policy=policy) as base,
    ):
        yield base, replica


def client(base: str, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="EMPTY", max_retries=0, **kwargs)


def programs(base: str, key: str | None = None) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(base + "/v1/programs", headers=headers, timeout=5)
    r.raise_for_status()
    return r.json()


def assert_clean(base: str, timeout_s: float = 5.0, key: str | None = None) -> dict[str, Any]:
    """Nothing leaked: no request held or in flight, no program REASONING or GATED."""
    deadline = time.monotonic() + timeout_s
    while True:
        view = programs(base, key)
        stuck = [p for p in view["data"] if p["status"] != "acting"]
        clean = not stuck and view["gate"] == {"waiting": 0, "turns": 0} and view["in_flight"] == 0
        if clean:
            return view
        if time.monotonic() > deadline:
            raise AssertionError(f"router state leaked: gate={view['gate']} stuck={stuck}")
        time.sleep(0.05)


def chat(program_id: str, text: str = "hello", **kwargs: Any) -> dict[str, Any]:
    """Arguments of one chat call tagged with a program id."""
    return {
        "model": "default",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": kwargs.pop("max_tokens", 8),
        "extra_body": {"program_id": program_id, **kwargs.pop("extra_body", {})},
        **kwargs,
    }


def metric(base: str, sample: str, **labels: str) -> float:
    """The value of one sample on the router's /metrics (0 when absent)."""
    text = httpx.get(base + "/metrics", timeout=5).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


class ScriptedReplica:
    """A minimal engine double for faults the emulator does not stage: hint endpoint
    errors, and recording the aborts the router sends."""

    def __init__(
        self,
        hints_status: int = 200,
        tokens: int = 3,
        delay_s: float = 0.0,
        chat_status: int = 200,
        break_streams: bool = False,
        hint_delay_s: float = 0.0,
        count_prompt: bool = False,
        linger_s: float = 0.0,
    ) -> None:
        self.hints_status, self.tokens, self.delay_s = hints_status, tokens, delay_s
        self.chat_status = chat_status  # an engine answering every chat request with an error
        self.break_streams = break_streams  # streams cut off after their first chunk
        self.hint_delay_s = hint_delay_s
        self.count_prompt = count_prompt  # prompt tokens = 4 characters each, else always 5
        self.linger_s = linger_s  # a stream ends this long after its [DONE] event
        self.wedged = False  # set: every request hangs, /health included (a stopped engine)
        self.hint_calls = 0
        self.chat_calls = 0
        self.events: list[tuple[str, Any]] = []  # ("hints", batch) when answered, ("request", id)
        self.aborts: list[str] = []
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/get_server_info", self.info, methods=["GET"]),
                Route("/mori/hints", self.hints, methods=["POST"]),
                Route("/abort_request", self.abort, methods=["POST"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/messages", self.messages, methods=["POST"]),
            ]
        )

    async def health(self, request: Request) -> Response:
        await self._hang_if_wedged()
        return Response()

    async def _hang_if_wedged(self) -> None:
        if self.wedged:
            await asyncio.sleep(3600)

    async def info(self, request: Request) -> Response:
        return JSONResponse({"max_total_num_tokens": 50_000, "hicache_host_tokens": 100_000})

    async def hints(self, request: Request) -> Response:
        self.hint_calls += 1
        if self.hints_status != 200:
            return JSONResponse({"detail": "nope"}, status_code=self.hints_status)
        body = await request.json()
        await asyncio.sleep(self.hint_delay_s)
        self.events.append(("hints", body["hints"]))
        return JSONResponse({"epoch": body["epoch"], "stale": False, "residency": {}})

    async def abort(self, request: Request) -> Response:
        self.aborts.append((await request.json())["rid"])
        return JSONResponse({})

    async def messages(self, request: Request) -> Response:
        """Anthropic Messages: a tool_use answer with usage (non-streamed)."""
        self.last_body = await request.json()
        block = {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls -la"}}
        usage = {"input_tokens": 40, "cache_read_input_tokens": 60, "output_tokens": 7}
        answer = {"id": "m1", "type": "message", "role": "assistant", "model": "m"}
        return JSONResponse(
            {**answer, "content": [block], "stop_reason": "tool_use", "usage": usage}
        )

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        self.chat_calls += 1
        await self._hang_if_wedged()
        if self.chat_status != 200:
            return JSONResponse({"detail": "engine failure"}, status_code=self.chat_status)
        self.events.append(("request", body.get("session_id")))
        prompt = len(json.dumps(body.get("messages"))) // 4 if self.count_prompt else 5
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": self.tokens,
            "total_tokens": prompt + self.tokens,
        }
        if not body.get("stream"):
            message = {"role": "assistant", "content": "ok"}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            doc = {"id": body["rid"], "object": "chat.completion", "created": 0, "model": "m"}
            return JSONResponse({**doc, "choices": [choice], "usage": usage})

        async def events():
            for _ in range(self.tokens):
                delta = {"index": 0, "delta": {"content": "x"}, "finish_reason": None}
                yield "data: " + json.dumps({"id": body["rid"], "choices": [delta]}) + "\n\n"
                await asyncio.sleep(self.delay_s)
                if self.break_streams:  # the server drops the connection mid-body
                    raise ConnectionResetError("stream broken on purpose")
            yield "data: " + json.dumps({"id": body["rid"], "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
            await asyncio.sleep(self.linger_s)

        return StreamingResponse(events(), media_type="text/event-stream")


@contextlib.contextmanager
def serve(replica: ScriptedReplica) -> Iterator[str]:
    with serve_app(replica.app) as url:
        yield url


@contextlib.contextmanager
def serve_app(app: Starlette) -> Iterator[str]:
    """An ASGI app on a free port in a thread of this process; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(5)
