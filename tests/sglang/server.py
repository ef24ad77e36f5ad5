"""TEST SCAFFOLDING: start a MORI-patched SGLang server on CPU for the tests.

The venv comes from scripts/install_sglang_cpu.sh: the version in MORI_SGLANG_VERSION (default:
the newest supported), its path from the installer itself (content-addressed), or MORI_SGLANG_VENV.
The venv carries the CPU shim (shim/); this checkout goes on the server's PYTHONPATH, so the
plugin entry point loads this checkout's engine_patches. The log goes to a file (SGLang is chatty;
a pipe nobody reads would block it) and is shown on failure.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.servers import free_port, kill, wait_for

PORT_RETRIES = 3  # fresh ports tried when one is taken before the engine binds it
BIND_FAILED = b"error while attempting to bind on address"

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
INSTALLER = REPO / "scripts/install_sglang_cpu.sh"
VERSION_VAR = "MORI_SGLANG_VERSION"
# Every real-engine test module: `pytestmark = REAL_ENGINE`.
REAL_ENGINE = [
    pytest.mark.sglang,
    pytest.mark.skipif(
        os.environ.get("MORI_SKIP_SGLANG") == "1", reason="MORI_SKIP_SGLANG=1: real engine off"
    ),
]


def venv_path() -> Path:
    """The venv the installer makes for MORI_SGLANG_VERSION (it prints it without installing)."""
    if os.environ.get("MORI_SGLANG_VENV"):
        return Path(os.environ["MORI_SGLANG_VENV"])
    argv = ["bash", str(INSTALLER), "--print-venv", *filter(None, [os.environ.get(VERSION_VAR)])]
    return Path(subprocess.run(argv, check=True, capture_output=True, text=True).stdout.strip())


VENV = venv_path()
PYTHON = VENV / "bin" / "python"

# Settings of a router in front of these servers: SGLang's /health runs a one-token probe
# and answers after at least 1 s when idle, beyond the 1 s timeout of the emulator tests.
ROUTER_SETTINGS = {"health_timeout_s": 5.0}

# Small pools so a handful of short programs already overflow the device tier.
CPU_FLAGS = [
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch",
    "--disable-overlap-schedule",
    "--sleep-on-idle",
    "--hicache-io-backend", "direct",
    "--hicache-mem-layout", "layer_first",
    "--skip-server-warmup",
]  # fmt: skip


@functools.cache
def installed_version() -> str:
    """The SGLang version in the test venv."""
    probe = "import importlib.metadata as m; print(m.version('sglang'))"
    done = subprocess.run([str(PYTHON), "-c", probe], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def server_env() -> dict[str, str]:
    return {
        **os.environ,
        "SGLANG_USE_CPU_ENGINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": str(REPO),
    }


def build_tiny_model(out: Path, hidden: int = 64, layers: int = 2) -> Path:
    """The random-weight test model (tiny_model.py) at `out`; wider and deeper ones make a
    prefill, hence a cache miss, cost more relative to a decode step. The build is
    deterministic (fixed seed), so each shape is built once per process and copied (a build
    imports torch and transformers: ~6 s, paid by every engine test module before)."""
    shutil.copytree(_built_model(hidden, layers), out)
    return out


@functools.cache
def _built_model(hidden: int, layers: int) -> Path:
    out = Path(tempfile.mkdtemp(prefix=f"mori-tiny-{hidden}x{layers}-")) / "model"
    atexit.register(shutil.rmtree, out.parent, ignore_errors=True)
    subprocess.run(
        [str(PYTHON), str(HERE / "tiny_model.py"), str(out), "--hidden", str(hidden),
         "--layers", str(layers)],
        env=server_env(), check=True, capture_output=True, timeout=180,
    )  # fmt: skip
    return out


class Server:
    """A running patched server: base URL, log file, process."""

    def __init__(self, proc: subprocess.Popen, port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def generate(self, program: str, input_ids: list[int], timeout: float = 60) -> dict:
        """One token for `program` (stamped by its session id) on the native endpoint."""
        body = {
            "input_ids": input_ids,
            "session_id": program,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True},
        }
        r = httpx.post(f"{self.url}/generate", json=body, timeout=timeout)
        assert r.status_code == 200, r.text
        return r.json()

    def push_hints(self, body: dict) -> dict:
        """A `/mori/hints` batch that must be accepted."""
        r = httpx.post(f"{self.url}/mori/hints", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def flush(self, timeout_s: float = 60) -> None:
        """An empty radix tree, device and host (and residency), once the engine is idle
        (SGLang refuses `/flush_cache` while requests run); hints and roles stay."""
        wait_for(self._flushed, timeout_s, "the engine to go idle and flush its cache")

    def _flushed(self) -> bool:
        return httpx.post(f"{self.url}/flush_cache", timeout=30).status_code == 200

    def residency(self) -> dict:
        """The patch's `/mori/residency` view."""
        r = httpx.get(f"{self.url}/mori/residency", timeout=30)
        assert r.status_code == 200, r.text
        return r.json()


LAUNCHER = ["-m", "engine_patches.launch"]  # mori-sglang


@contextlib.contextmanager
def patched_servers(
    count: int,
    model: Path,
    log_dir: Path,
    extra: list[str],
    timeout_s: float = 240.0,
    entry: list[str] = LAUNCHER,
    env: dict[str, str] | None = None,
) -> Iterator[list[Server]]:
    """`count` patched servers started side by side (start-up is mostly imports: overlap it);
    `entry` the module to run (another one: `sglang.launch_server` without the launcher)."""
    argv = [str(PYTHON), *entry, "--model-path", str(model), "--host", "127.0.0.1"]
    full_env = {**server_env(), **(env or {})}

    def start() -> Server:
        port = free_port()
        log = log_dir / f"sglang-{port}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [*argv, "--port", str(port), *CPU_FLAGS, *extra], env=full_env, cwd=REPO,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        return Server(proc, port, log)

    servers: list[Server] = []
    try:
        servers += [start() for _ in range(count)]
        for i in range(count):
            for _ in range(PORT_RETRIES):
                try:
                    _wait_ready(servers[i], timeout_s)
                    break
                except PortTaken:  # the free port was taken before the engine bound it
                    kill(servers[i].proc)
                    servers[i] = start()
            else:
                _wait_ready(servers[i], timeout_s)
        yield servers
    finally:
        # killed, not stopped: SIGTERM to the group reaches the scheduler first, and SGLang
        # takes a child's exit for a crash and sleeps 5 s before its diagnostics (to the main
        # process alone: it drains for ~10 s). The engine keeps nothing a test reads after.
        for server in servers:
            kill(server.proc)


@contextlib.contextmanager
def launch(entry: list[str], model: Path, log_dir: Path, extra: list[str]) -> Iterator[Server]:
    with patched_servers(1, model, log_dir, extra, entry=entry) as (server,):
        yield server


@contextlib.contextmanager
def tiny_engine(
    work: Path, flags: list[str], env: dict[str, str] | None = None
) -> Iterator[Server]:
    """One patched server on the tiny model built in `work`; fails (never skips) when the
    SGLang venv is missing."""
    if not PYTHON.exists():
        pytest.fail(f"SGLang venv missing at {VENV}: run scripts/install_sglang_cpu.sh")
    model = build_tiny_model(work / "tiny")
    with patched_servers(1, model, work, flags, env=env) as (server,):
        yield server


class PortTaken(RuntimeError):
    """The engine could not bind its port: another process took it between `free_port`
    and the engine's bind (seen on a busy CI box; the engine then lingers ~10 s and exits)."""


def _wait_ready(server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.log.exists() and BIND_FAILED in server.log.read_bytes():
            raise PortTaken(f"port {server.port} taken:\n{server.log_tail()}")
        if server.proc.poll() is not None:
            raise RuntimeError(f"sglang exited with {server.proc.returncode}:\n{server.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.url}/model_info", timeout=2.0).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"sglang not ready after {timeout_s}s:\n{server.log_tail()}")
