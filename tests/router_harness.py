"""Shared scaffolding of the router tests: real `mori emulate` replicas and a real
`mori serve` process on free ports, plus the leak check every fault test ends with."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml
from prometheus_client.parser import text_string_to_metric_families

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
def router(replicas: list[Any], **settings: Any) -> Iterator[str]:
    """A `mori serve` process configured by a YAML file; yields its base URL."""
    port = free_port()
    config = {**FAST, **settings, "replicas": replicas, "port": port, "host": "127.0.0.1"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "router.yaml"
        path.write_text(yaml.safe_dump(config))
        with spawn(mori("serve", "--config", str(path)), port):
            yield f"http://127.0.0.1:{port}"


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
