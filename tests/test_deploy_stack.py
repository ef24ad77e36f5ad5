"""The deployment run for real: a Docker engine builds the images of docker/ and runs the demo
stack of docker/compose.demo.yaml (two emulated replicas, the router, Prometheus), the replay
profile drives traffic through it, and the GPU stack's images are built up to the point that
needs a GPU.

Slow (image builds, containers; docs/deployment.md has the wall time):

    python -m pytest -m slow tests/test_deploy_stack.py

The engine: the caller's (DOCKER_HOST, or the default socket) when one answers, else a private
one started by scripts/local_dockerd.sh and stopped afterwards. The images' inputs come from
scripts/local_images.sh (a Debian base made with debootstrap, a wheelhouse made with
`pip wheel`, Prometheus from Debian's package, an SGLang stand-in), so nothing is pulled from
Docker Hub and no build step reaches a package registry; MORI_DEPLOY_TEST_PUBLIC=1 builds on the
public images instead (a machine with Docker Hub), which leaves the GPU stack out (its base is a
~20 GB CUDA image). Grafana has no local image here (no Debian package): it is not started.

Everything the test starts it removes: containers, network and volumes (`down -v` of its own
compose project), the images it tagged, and the engine if it started it. The base images and
the wheelhouse stay in the engine and ~/.cache/mori/docker: they are what makes a re-run fast.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_patches.launch import build_argv
from tests.servers import free_port
from tests.test_deploy import COMPOSE, argv_of, compose_cli, load_compose, replicas

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
PUBLIC = os.environ.get("MORI_DEPLOY_TEST_PUBLIC") == "1"
TAG = "deploy-test"  # MORI_TAG of every image this test builds, removed at the end
DEMO_SERVICES = ["replica-0", "replica-1", "router", "prometheus"]
TIME_SCALE = 20  # emulators and replay both run 20x faster than real time
REPLAY_S = 15
ADMIN_KEY = "admin-key"


def sh(argv: list[str], env: dict[str, str], timeout: float = 600) -> str:
    """Run argv, return its stdout; a failure shows its output."""
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert done.returncode == 0, (
        f"{argv} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


def engine_answers(env: dict[str, str]) -> bool:
    if shutil.which("docker") is None:  # local_dockerd.sh installs docker.io, CLI included
        return False
    probe = ["docker", "version", "--format", "{{.Server.Version}}"]
    return subprocess.run(probe, env=env, capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def docker_env() -> Iterator[dict[str, str]]:
    """The environment of every docker command: DOCKER_HOST of an engine that answers."""
    env = dict(os.environ)
    if engine_answers(env):
        yield env
        return
    if os.geteuid() != 0:
        pytest.skip("no Docker engine answers, and starting one (dockerd) needs root")
    out = sh(["bash", str(SCRIPTS / "local_dockerd.sh"), "start"], env, timeout=300)
    env["DOCKER_HOST"] = out.split("DOCKER_HOST=", 1)[1].split()[0]
    started = "# already running" not in out
    try:
        yield env
    finally:
        if started:
            sh(["bash", str(SCRIPTS / "local_dockerd.sh"), "stop"], env)


@pytest.fixture(scope="module")
def compose_env(docker_env: dict[str, str]) -> dict[str, str]:
    """docker_env plus the image inputs (local ones unless MORI_DEPLOY_TEST_PUBLIC=1)."""
    env = {**docker_env, "MORI_TAG": TAG}
    if not PUBLIC:
        env_file = Path(sh(["bash", str(SCRIPTS / "local_images.sh")], env, timeout=1200).strip())
        for line in env_file.read_text().splitlines():
            key, value = line.split("=", 1)
            env[key] = value
    return env


def compose(kind: str, project: str, env_file: Path) -> list[str]:
    """The compose command for one of docker/'s files, as its own project. The empty env file
    keeps a user's docker/.env out: the test sets what it needs in the environment."""
    cli = compose_cli()
    if cli is None:
        pytest.skip("no compose binary: apt-get install -y docker-compose (or the compose plugin)")
    return [*cli, "-p", project, "-f", str(COMPOSE[kind]), "--env-file", str(env_file)]


def replay_result(dc: list[str], env: dict[str, str], into: Path) -> tuple[int, dict[str, Any]]:
    """The replay container's exit code and its results/replay.json, copied out as the docs say."""
    (container,) = sh([*dc, "ps", "-aq", "replay"], env).split()
    code = sh(["docker", "inspect", "--format", "{{.State.ExitCode}}", container], env)
    sh(["docker", "cp", f"{container}:/opt/mori/results", str(into)], env)
    return int(code), json.loads((into / "replay.json").read_text())


def wait_for(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll check() (None or an exception: not yet) until it returns a value."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value is not None:
                return value
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            last = e
        time.sleep(1)
    raise AssertionError(f"{what}: not after {timeout_s} s (last: {last!r})")


@pytest.fixture(scope="module")
def demo(compose_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The demo stack up (replicas, router, Prometheus), one replay run through it; yields the
    replay's exit code and JSON, the router's URL and Prometheus's URL. Down at the end."""
    tmp = tmp_path_factory.mktemp("demo")
    (tmp / "empty.env").touch()
    router_port, prometheus_port = free_port(), free_port()
    env = {
        **compose_env,
        "PUBLISH_ADDRESS": "127.0.0.1",
        "ROUTER_PORT": str(router_port),
        "PROMETHEUS_PORT": str(prometheus_port),
        "EMU_TIME_SCALE": str(TIME_SCALE),
        "MORI_TICK_S": "0.25",
        "REPLAY_DURATION_S": str(REPLAY_S),
        "REPLAY_CONCURRENCY": "8",
        # Keys on: a comma-separated list and the admin key, through compose into the router,
        # and the replay authenticating with one of them.
        "MORI_API_KEYS": "key-a,key-b",
        "MORI_ADMIN_KEY": ADMIN_KEY,
        "REPLAY_API_KEY": "key-b",
    }
    dc = [*compose("demo", f"mori-test-{os.getpid()}", tmp / "empty.env"), "--profile", "replay"]
    try:
        sh([*dc, "up", "-d", "--build", *DEMO_SERVICES], env, timeout=1200)
        router = f"http://127.0.0.1:{router_port}"
        wait_for(lambda: httpx.get(router + "/health").status_code == 200 or None, 120, "router")
        sh([*dc, "up", "replay"], env, timeout=REPLAY_S + 180)  # attached: returns when it exits
        code, result = replay_result(dc, env, tmp / "results")
        yield {
            "replay_exit": code,
            "replay": result,
            "router": router,
            "prometheus": f"http://127.0.0.1:{prometheus_port}",
        }
    finally:
        subprocess.run([*dc, "down", "-v", "--remove-orphans"], env=env, capture_output=True)
        subprocess.run(["docker", "rmi", f"mori-router:{TAG}"], env=env, capture_output=True)


def test_replay_runs_through_the_dockerized_router(demo: dict) -> None:
    assert demo["replay_exit"] == 0
    (row,) = demo["replay"]["results"]
    assert row["endpoint"] == "http://router:8000" and row["mode"] == "live", row
    assert row["policy"] == "mori" and row["time_scale"] == TIME_SCALE, row
    assert row["steps_s"] > 0 and row["output_tok_s"] > 0 and row["failed_steps"] == 0, row
    assert abs(row["wall_s"] - REPLAY_S) < 5, row


def test_router_sees_both_replicas_healthy_with_hints(demo: dict) -> None:
    health = httpx.get(demo["router"] + "/health").json()
    assert health == {"status": "ok", "healthy_replicas": 2}, health
    replicas_url = demo["router"] + "/v1/replicas"
    assert httpx.get(replicas_url, headers={"authorization": "Bearer key-a"}).status_code == 403
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    listed = httpx.get(replicas_url, headers=admin).json()["data"]
    assert {r["url"] for r in listed} == {"http://replica-0:30000", "http://replica-1:30000"}
    for r in listed:
        assert r["healthy"] and r["hints_supported"], r
        assert r["gpu"]["budget_tokens"] == 200000 and r["cpu"]["budget_tokens"] == 400000, r


def test_router_metrics_count_the_replayed_requests(demo: dict) -> None:
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(httpx.get(demo["router"] + "/metrics").text)
        for s in family.samples
    }
    ok = {
        dict(labels)["replica"]: value
        for (name, labels), value in samples.items()
        if name == "mori_requests_total" and dict(labels)["outcome"] == "ok"
    }
    assert set(ok) == {"http://replica-0:30000", "http://replica-1:30000"}, ok
    # Every step the replay finished is a request answered ok (in-flight ones at the end aside).
    steps = demo["replay"]["results"][0]["steps_s"] * demo["replay"]["results"][0]["wall_s"]
    assert sum(ok.values()) >= steps * 0.9, (ok, steps)
    healthy = {
        dict(labels)["replica"]: value
        for (name, labels), value in samples.items()
        if name == "mori_replica_healthy"
    }
    assert set(healthy.values()) == {1.0}, healthy


def test_prometheus_scrapes_the_router(demo: dict) -> None:
    prometheus = demo["prometheus"]

    def router_target_up() -> dict | None:
        targets = httpx.get(prometheus + "/api/v1/targets").json()["data"]["activeTargets"]
        (router,) = [t for t in targets if t["labels"]["job"] == "mori-router"]
        return router if router["health"] == "up" else None

    target = wait_for(router_target_up, 30, "the router's scrape target up")
    assert target["scrapeUrl"] == "http://router:8000/metrics"

    def scraped_requests() -> float | None:
        query = {"query": 'sum(mori_requests_total{outcome="ok"})'}
        result = httpx.get(prometheus + "/api/v1/query", params=query).json()["data"]["result"]
        return float(result[0]["value"][1]) if result and float(result[0]["value"][1]) > 0 else None

    assert wait_for(scraped_requests, 30, "requests counted by Prometheus") > 0


@pytest.mark.skipif(PUBLIC, reason="the GPU stack's base is the ~20 GB CUDA image of SGLang")
def test_gpu_stack_builds_and_stops_where_a_gpu_is_needed(
    compose_env: dict[str, str], tmp_path: Path
) -> None:
    """docker/compose.yaml's images build on the SGLang stand-in (version check, plugin entry
    point, launcher); the launcher in the image accepts the replicas' command; starting a
    replica then fails exactly on the GPU reservation (no NVIDIA runtime here)."""
    (tmp_path / "empty.env").touch()
    dc = compose("gpu", f"mori-gpu-test-{os.getpid()}", tmp_path / "empty.env")
    try:
        services = replicas(load_compose("gpu"))
        sh([*dc, "build", *services], compose_env, timeout=1200)
        probe = (
            "import json, sys; from engine_patches.launch import build_argv; "
            "print(json.dumps(build_argv(sys.argv[1:])))"
        )
        run = ["docker", "run", "--rm", "--entrypoint", "python3", f"mori-sglang:{TAG}"]
        for name, service in services.items():
            in_image = json.loads(sh([*run, "-c", probe, *argv_of(service)], compose_env))
            assert in_image == build_argv(argv_of(service)), name
        runtimes = sh(["docker", "info", "--format", "{{json .Runtimes}}"], compose_env)
        if "nvidia" not in runtimes:
            up = subprocess.run(
                [*dc, "up", "-d", "--no-build", "replica-0"],
                env=compose_env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert up.returncode != 0
            assert 'could not select device driver "nvidia"' in up.stdout + up.stderr, up.stderr
    finally:
        subprocess.run(
            [*dc, "down", "-v", "--remove-orphans"], env=compose_env, capture_output=True
        )
        subprocess.run(
            ["docker", "rmi", f"mori-sglang:{TAG}"], env=compose_env, capture_output=True
        )
