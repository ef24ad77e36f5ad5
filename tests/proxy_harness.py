"""HAProxy in front of real `mori serve` processes, with the committed configs of
docker/haproxy/ (addresses from the environment, as in production): the active/standby
pair (ha.cfg) and cells (cells.cfg). Used by the proxy tests and bench/failover.py."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.router_harness import router_process
from tests.servers import free_port, spawn

HAPROXY_DIR = Path(__file__).resolve().parents[1] / "docker" / "haproxy"
HA_CONFIG = HAPROXY_DIR / "ha.cfg"
CELLS_CONFIG = HAPROXY_DIR / "cells.cfg"
CELL_HEADER = "x-mori-cell"  # the cell that answered (cells.cfg sets it)


def haproxy_missing() -> str | None:
    """Why the proxy tests cannot run here, or None (scripts/test.sh installs Debian's)."""
    return None if shutil.which("haproxy") else "haproxy is not installed (apt-get install haproxy)"


def address(url: str) -> str:
    """host:port of a base URL, as HAProxy's server lines take it."""
    return url.removeprefix("http://")


@contextlib.contextmanager
def haproxy(config: Path, log: Path | None = None, **servers: str) -> Iterator[str]:
    """`haproxy -f config` on a free port with `servers` (MORI_PRIMARY=host:port, ...) in
    its environment; yields the proxy's base URL once `/health` answers 200 through it."""
    port = free_port()
    env = {"MORI_PROXY_BIND": f"127.0.0.1:{port}", **servers}
    with spawn(["haproxy", "-f", str(config)], port, env=env, log=log):
        yield f"http://127.0.0.1:{port}"


def check_config(config: Path, **servers: str) -> subprocess.CompletedProcess:
    """`haproxy -c`: the file parses and every referenced variable is set."""
    env = {**os.environ, "MORI_PROXY_BIND": "127.0.0.1:1", **servers}
    return subprocess.run(
        ["haproxy", "-c", "-f", str(config)], env=env, capture_output=True, text=True, timeout=30
    )


@contextlib.contextmanager
def with_cells(count: int) -> Iterator[Path]:
    """cells.cfg with `count` cells: a server line per cell added as the file says to."""
    text = CELLS_CONFIG.read_text()
    last = re.findall(r"^ *server cell-\d+ .*$", text, flags=re.M)[-1]
    extra = [
        f'    server cell-{i} "${{MORI_CELL_{i}}}" id {i + 1} check'
        for i in range(len(re.findall(r"^ *server cell-", text, flags=re.M)), count)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cells.cfg"
        path.write_text(text.replace(last, "\n".join([last, *extra])))
        yield path


@dataclass
class Pair:
    """An active/standby pair behind ha.cfg: the proxy and each router's URL and process."""

    proxy: str
    primary: str
    standby: str
    procs: dict[str, subprocess.Popen]

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal every process of router `name` (`primary`/`standby`): the owner and its
        data-plane workers, as a crashed host takes them all."""
        os.killpg(self.procs[name].pid, sig)


@contextlib.contextmanager
def ha_pair(replicas: list[Any], logs: Path | None = None, **settings: Any) -> Iterator[Pair]:
    """Two routers with `standby: true` over `replicas`, HAProxy (ha.cfg) in front; the
    first request through the proxy makes the primary active."""
    settings = {"standby": True, "workers": 1, **settings}
    log = (lambda name: logs / f"{name}.log") if logs else (lambda name: None)
    with (
        router_process(replicas, log("primary"), **settings) as (primary, p_proc),
        router_process(replicas, log("standby"), **settings) as (standby, s_proc),
        haproxy(
            HA_CONFIG, log("haproxy"), MORI_PRIMARY=address(primary), MORI_STANDBY=address(standby)
        ) as proxy,
    ):
        yield Pair(proxy, primary, standby, {"primary": p_proc, "standby": s_proc})
