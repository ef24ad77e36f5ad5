"""The SGLang Model Gateway, the external baseline: where it is installed and how it starts.

The gateway is published on PyPI as `smg` (1.13; formerly `sglang-router`, 0.3.2). Each
lives in its own venv, never in the project's:

    python3 -m venv ~/.cache/mori-smg/venv && ~/.cache/mori-smg/venv/bin/pip install 'smg==1.13.*'
    python3 -m venv ~/.cache/mori-gw/venv
    ~/.cache/mori-gw/venv/bin/pip install sglang-router==0.3.2

It finds its workers' model through `/v1/models` and routes only requests that name it;
`default` (what `mori replay` sends) is made an alias of it.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx

SMG_PYTHON = Path.home() / ".cache/mori-smg/venv/bin/python"
GATEWAY_PYTHON = Path.home() / ".cache/mori-gw/venv/bin/python"
MODULES = {"smg": "smg.launch_router", "sglang-router": "sglang_router.launch_router"}
PYTHONS = {"smg": SMG_PYTHON, "sglang-router": GATEWAY_PYTHON}


def gateway_argv(
    name: str,
    workers: list[str],
    port: int,
    metrics_port: int,
    policy: str = "cache_aware",
    python: Path | None = None,
) -> list[str]:
    """The command that starts gateway `name` in front of `workers` on `port`; `policy` is
    its routing policy (`cache_aware`: the gateway's default prefix-affinity routing)."""
    argv = [str(python or PYTHONS[name]), "-m", MODULES[name], "--worker-urls", *workers]
    argv += ["--policy", policy, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--prometheus-port", str(metrics_port), "--log-level", "warn"]
    if name == "smg":
        model = httpx.get(workers[0] + "/v1/models", timeout=10.0).json()["data"][0]["id"]
        argv += ["--model-alias", f"default={model}"]
    return argv


def wait_serving(url: str, timeout_s: float = 60.0) -> None:
    """Until the gateway lists a model: it answers /health before it has registered its
    workers, and a request before that is refused (503 "No models available")."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/v1/models", timeout=2.0).json().get("data"):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"gateway at {url} listed no model within {timeout_s:g} s")
