"""What MORI does with an SGLang it cannot hint: a plain SGLang that merely has the plugin
installed keeps serving and answers the hint routes with 501, which the router counts as
"hints unsupported" (not as errors) while it serves through it; mori-sglang on a configuration
whose cache the patch cannot attach to stops at start with one line."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.router_harness import metric, router
from tests.servers import free_port
from tests.sglang.server import (
    CPU_FLAGS,
    PYTHON,
    REAL_ENGINE,
    REPO,
    ROUTER_SETTINGS,
    Server,
    build_tiny_model,
    installed_version,
    launch,
    server_env,
)

pytestmark = REAL_ENGINE


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not PYTHON.exists():
        pytest.fail(f"SGLang venv missing at {PYTHON}: run scripts/install_sglang_cpu.sh")
    return build_tiny_model(tmp_path_factory.mktemp("refusal") / "tiny")


@pytest.fixture(scope="module")
def plain(model: Path) -> Iterator[Server]:
    """sglang.launch_server itself (no mori-sglang, no HiCache), the plugin installed."""
    with launch(
        ["-m", "sglang.launch_server"], model, model.parent, ["--max-total-tokens", "512"]
    ) as s:
        yield s


def test_plain_sglang_answers_hints_unsupported_and_the_router_serves_through(plain: Server):
    for r in (
        httpx.post(f"{plain.url}/mori/hints", json={"epoch": 1, "hints": {"p": "busy"}}),
        httpx.get(f"{plain.url}/mori/residency"),
    ):
        assert r.status_code == 501, r.text
        assert r.json()["error"]["message"].startswith("hints unsupported"), r.text
    with router([plain.url], tick_s=0.2, hint_sync_s=0.5, **ROUTER_SETTINGS) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
        out = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            extra_body={"program_id": "plain-1", "ignore_eos": True},  # random weights
        )  # fmt: skip
        assert out.usage.completion_tokens == 2
        assert metric(base, "mori_hint_unsupported_total") >= 1
        assert metric(base, "mori_hint_pushes_total", result="error") == 0


def test_mori_sglang_refuses_a_cache_it_cannot_hint(model: Path):
    """0.5.17 builds UnifiedRadixCache (as it does for hybrid and DSA models) when told to;
    the patch hooks HiRadixCache only, so the server must not start."""
    version = installed_version()
    if version != "0.5.17":
        pytest.skip(f"sglang {version}: every full-attention model takes the patched tree core")
    argv = [str(PYTHON), "-m", "engine_patches.launch", "--model-path", str(model), *CPU_FLAGS]
    argv += ["--port", str(free_port()), "--max-total-tokens", "512"]
    env = {**server_env(), "SGLANG_ENABLE_UNIFIED_RADIX_TREE": "1"}
    done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "MORI cannot hint this server: it runs UnifiedRadixCache" in done.stdout + done.stderr
