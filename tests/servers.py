"""Test scaffolding: start real server processes (`mori emulate`, `mori serve`, SGLang)
on free loopback ports and stop them cleanly, so tests talk HTTP to real servers."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx


def wait_for(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll `check` every 0.1 s until it returns something true (returned), or fail."""
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def spawn(
    args: list[str],
    port: int,
    health_path: str = "/health",
    timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    log: Path | None = None,
) -> Iterator[subprocess.Popen]:
    """Run `args` (argv), wait until GET health_path answers 200, kill the group on exit.
    Its output goes to `log` when given (a file never blocks a chatty server), else a pipe."""
    out = log.open("wb") if log is not None else subprocess.PIPE
    proc = subprocess.Popen(
        args,
        env={**os.environ, **(env or {})},
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_healthy(proc, f"http://127.0.0.1:{port}{health_path}", timeout_s)
        yield proc
    finally:
        stop(proc)
        if log is not None:
            out.close()


def mori(*argv: str) -> list[str]:
    """argv running the `mori` CLI of this checkout with the current interpreter."""
    return [sys.executable, "-m", "router.cli", *argv]


def stop(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM to the process group, SIGKILL after `grace_s`."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        kill(proc)


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL to the process group (started with `start_new_session`), then reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else "(see its log)"
            raise RuntimeError(f"server exited with {proc.returncode} before {url} was up:\n{out}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    stop(proc)
    raise TimeoutError(f"{url} not healthy after {timeout_s}s")
