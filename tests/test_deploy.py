"""The deployment files in docker/: both compose files validate, every setting they pass reaches
a real CLI that accepts it, Prometheus scrapes the compose services on their real ports, and the
Grafana dashboard draws only series that a running router exports.

No Docker engine is needed: `docker compose config` (or Debian's `docker-compose` 1.29) only
reads the files, and the processes the demo stack runs (`mori emulate`, `mori serve`) are
started here directly with the compose files' own arguments and environment. The same stack
built and run in Docker: tests/test_deploy_stack.py (slow).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from engine_patches.launch import REQUIRED, build_argv
from engine_patches.plugin import SUPPORTED
from router.cli import build_parser
from router.config import RouterConfig, load_config
from router.replay.corpus import scale_program
from router.replay.trace import load_trace
from tests.servers import free_port, mori, spawn

REPO = Path(__file__).resolve().parents[1]
IMAGE_LINE = "0.5.17"  # the supported SGLang line whose image runs on torch 2.11 (the GPU hosts)
DOCKER = REPO / "docker"
COMPOSE = {"gpu": DOCKER / "compose.yaml", "demo": DOCKER / "compose.demo.yaml"}
ENV_EXAMPLE = DOCKER / ".env.example"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "mori.json"
ROUTER_IMAGE = "mori-router"
# The series the issue asks the dashboard to draw (programs/tokens per tier, idleness, moves,
# gate wait, TTFT, output tok/s, hint failures, replica health).
REQUIRED_SERIES = {
    "mori_programs",
    "mori_tier_tokens",
    "mori_program_idleness_bucket",
    "mori_moves_total",
    "mori_gate_wait_seconds_bucket",
    "mori_ttft_seconds_bucket",
    "mori_output_tokens_total",
    "mori_hint_pushes_total",
    "mori_hint_unsupported_total",
    "mori_replica_healthy",
}

_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")
_METRIC = re.compile(r"\bmori_[a-z_]+\b")


# --- reading the compose files the way compose does --------------------------------------
def env_example() -> dict[str, str]:
    """KEY=VALUE lines of docker/.env.example (comments and blank lines skipped)."""
    env = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            env[key.strip()] = value.strip()
    return env


def interpolate(node: Any, env: dict[str, str]) -> Any:
    """${VAR}, ${VAR-default}, ${VAR:-default}: env value, else the default, else ""."""
    if isinstance(node, str):
        return _VAR.sub(lambda m: env.get(m[1]) or (m[2] or ""), node)
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    return node


def load_compose(kind: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    return interpolate(yaml.safe_load(COMPOSE[kind].read_text()), env or {})


def argv_of(service: dict[str, Any]) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else list(command)


def flag(argv: list[str], name: str) -> str:
    for i, arg in enumerate(argv):
        if arg == name:
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} missing from {argv}")


def replicas(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found = {n: s for n, s in compose["services"].items() if re.fullmatch(r"replica-\d+", n)}
    assert len(found) >= 2, "a stack needs at least two replicas for routing to matter"
    return found


def mount_source(compose: dict[str, Any], service: str, target: str) -> Path:
    for volume in compose["services"][service]["volumes"]:
        source, dest, *_ = volume.split(":")
        if dest == target:
            return (DOCKER / source).resolve()
    raise AssertionError(f"{service} mounts nothing at {target}")


def compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if (
        docker
        and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
    ):
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


ENVS = {"defaults": None, ".env.example": env_example()}
CASES = [(kind, env) for kind in COMPOSE for env in ENVS]


# --- the compose files validate ------------------------------------------------------------
@pytest.mark.parametrize("kind", COMPOSE)
@pytest.mark.parametrize("env_file", [False, True], ids=["defaults", "env-example"])
def test_compose_config_validates(kind: str, env_file: bool) -> None:
    cli = compose_cli()
    if cli is None:
        pytest.skip("no compose binary: apt-get install -y docker-compose (or the compose plugin)")
    argv = [*cli, "-f", str(COMPOSE[kind])]
    argv += ["--env-file", str(ENV_EXAMPLE)] if env_file else []
    argv += ["--profile", "replay"] if kind == "demo" else []
    # Settings in the caller's shell would override the files; validate the files alone.
    env = {k: v for k, v in os.environ.items() if k not in env_example()}
    result = subprocess.run([*argv, "config", "-q"], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("kind", "env"), CASES)
def test_router_prometheus_and_replicas_agree(kind: str, env: str) -> None:
    compose = load_compose(kind, ENVS[env])
    services = compose["services"]
    urls = {f"http://{name}:{flag(argv_of(s), '--port')}" for name, s in replicas(compose).items()}
    router_env = services["router"]["environment"]
    assert set(router_env["MORI_REPLICAS"].split(",")) == urls
    router_port = router_env["MORI_PORT"]
    assert any(p.endswith(f":{router_port}") for p in services["router"]["ports"])

    prom = mount_source(compose, "prometheus", "/etc/prometheus/prometheus.yml")
    jobs = {
        job["job_name"]: {t for sc in job["static_configs"] for t in sc["targets"]}
        for job in yaml.safe_load(prom.read_text())["scrape_configs"]
    }
    assert jobs.pop("mori-router") == {f"router:{router_port}"}
    if kind == "gpu":  # SGLang serves /metrics; the emulator does not, so the demo skips it
        assert jobs.pop("replicas") == {u.removeprefix("http://") for u in urls}
    assert not jobs, f"unexpected scrape jobs {jobs}"


@pytest.mark.parametrize("env", ENVS)
def test_gpu_replicas_each_own_one_gpu(env: str) -> None:
    compose = load_compose("gpu", ENVS[env])
    seen: list[str] = []
    for name, service in replicas(compose).items():
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"], name
        seen += device["device_ids"]
    assert len(seen) == len(set(seen)), f"two replicas share a GPU: {seen}"


@pytest.mark.parametrize(("kind", "env"), CASES)
def test_router_settings_are_real_router_fields(kind: str, env: str) -> None:
    compose = load_compose(kind, ENVS[env])
    router_env = compose["services"]["router"]["environment"]
    unknown = {
        k for k in router_env if k.removeprefix("MORI_").lower() not in RouterConfig.model_fields
    }
    assert not unknown, f"not router settings: {unknown}"
    config_file = mount_source(compose, "router", "/etc/mori/router.yaml")
    config = load_config(config_file, env=router_env)
    assert {r.url for r in config.replicas} == set(router_env["MORI_REPLICAS"].split(","))
    assert config.port == int(router_env["MORI_PORT"])
    assert config.policy == router_env["MORI_POLICY"]


def test_replica_budgets_can_come_from_the_env() -> None:
    """docs/deployment.md: a YAML list in MORI_REPLICAS sets per-replica token budgets."""
    compose = load_compose("gpu", env_example())
    env = {
        **compose["services"]["router"]["environment"],
        "MORI_REPLICAS": "[{url: http://replica-0:30000, gpu_tokens: 300000, cpu_tokens: 600000},"
        " {url: http://replica-1:30000}]",
    }
    config = load_config(mount_source(compose, "router", "/etc/mori/router.yaml"), env=env)
    budgets = [(r.url, r.gpu_tokens, r.cpu_tokens) for r in config.replicas]
    assert budgets == [
        ("http://replica-0:30000", 300000, 600000),
        ("http://replica-1:30000", None, None),
    ]


@pytest.mark.parametrize(("kind", "env"), CASES)
def test_mori_commands_parse_with_the_real_cli(kind: str, env: str) -> None:
    compose = load_compose(kind, ENVS[env])
    mori_services = {
        name: s
        for name, s in compose["services"].items()
        if s.get("image", "").startswith(ROUTER_IMAGE + ":")
    }
    assert "router" in mori_services
    for name, service in mori_services.items():
        argv = argv_of(service)
        args = build_parser(argv[0]).parse_args(argv)  # SystemExit(2) on an unknown flag
        if argv[0] == "replay":
            assert (REPO / args.trace).is_file(), f"{name}: {args.trace} not in the image"


@pytest.mark.parametrize("env", ENVS)
def test_demo_replay_corpus_fits_the_demo_replicas(env: str) -> None:
    """Every step the replay service sends (prompt + output, at its token scale) fits a
    replica's GPU KV budget: a larger one is refused with 400 context_length_exceeded."""
    services = load_compose("demo", ENVS[env])["services"]
    args = build_parser("replay").parse_args(argv_of(services["replay"]))
    budget = min(
        build_parser("emulate").parse_args(argv_of(s)).gpu_tokens
        for s in replicas(load_compose("demo", ENVS[env])).values()
    )
    corpus = [scale_program(p, args.token_scale) for p in load_trace(REPO / args.trace)]
    steps = [st for p in corpus for st in p.steps]
    longest = max(st.input_tokens + st.output_tokens for st in steps)
    assert longest <= budget, f"{args.trace} x{args.token_scale}: {longest} > {budget} tokens"


@pytest.mark.parametrize("env", ENVS)
def test_sglang_replicas_get_the_mori_flags(env: str) -> None:
    for name, service in replicas(load_compose("gpu", ENVS[env])).items():
        argv = build_argv(argv_of(service))  # LaunchError on a flag that contradicts MORI
        for required in REQUIRED:
            assert required in argv, f"{name}: {required} missing"


@pytest.mark.sglang
def test_sglang_replica_command_parses_with_pinned_sglang() -> None:
    """The GPU replicas' flags, after the launcher's additions, against SGLang's own parser
    (the installed test line: both supported lines parse the same flags)."""
    from tests.sglang.server import PYTHON as python

    if not python.exists():
        pytest.fail(f"no SGLang venv at {python.parents[1]}: run scripts/install_sglang_cpu.sh")
    probe = (
        "import argparse, json, sys\n"
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "from sglang.srt.server_args import ServerArgs\n"
        "p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p)\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    a = p.parse_args(argv)\n"
        "    got = [a.radix_eviction_policy, a.hicache_write_policy, a.enable_metrics]\n"
        "    print(json.dumps(got))\n"
    )
    services = replicas(load_compose("gpu", env_example()))
    argvs = [build_argv(argv_of(s)) for s in services.values()]
    out = subprocess.run(
        [str(python), "-c", probe, json.dumps(argvs)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    parsed = [json.loads(line) for line in out.stdout.strip().splitlines()[-len(argvs) :]]
    assert parsed == [["mori", "write_through", True]] * len(argvs)


# --- images --------------------------------------------------------------------------------
def dockerfile(name: str) -> str:
    return (DOCKER / name).read_text()


@pytest.mark.parametrize("name", ["Dockerfile.router", "Dockerfile.sglang"])
def test_dockerfile_copies_existing_paths(name: str) -> None:
    for line in dockerfile(name).splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            for source in line.split()[1:-1]:
                assert (REPO / source).exists(), f"{name}: COPY {source} does not exist"


def build_args(name: str) -> dict[str, str]:
    """ARG NAME=default lines of a Dockerfile (the build arguments with a default)."""
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile(name), re.M))


@pytest.mark.parametrize(("kind", "env"), CASES)
def test_compose_build_args_are_the_dockerfiles(kind: str, env: str) -> None:
    """Every image built by compose gets exactly its Dockerfile's arguments, and compose's
    defaults are the Dockerfile's own (the public images, no wheelhouse)."""
    for name, service in load_compose(kind, ENVS[env])["services"].items():
        if "build" not in service:
            continue
        wanted = build_args(Path(service["build"]["dockerfile"]).name)
        args = service["build"].get("args", {})
        assert set(args) == set(wanted), f"{name}: build args {sorted(args)}, want {sorted(wanted)}"
        if env == "defaults":
            assert args == wanted, name


def test_router_image_is_slim_non_root_and_checks_health() -> None:
    text = dockerfile("Dockerfile.router")
    assert build_args("Dockerfile.router")["PYTHON_IMAGE"] == "python:3.11-slim"
    assert text.rstrip().split("\nFROM ")[-1].startswith("${PYTHON_IMAGE}\n")  # the final stage
    assert re.search(r"^USER (?!root|0\b)\S+$", text, re.M)
    assert re.search(r"^HEALTHCHECK .*\n?.*/health", text, re.M)
    assert re.search(r'^ENTRYPOINT \["mori"\]$', text, re.M)
    runtime = [r for r in importlib.metadata.requires("mori") or [] if "extra ==" not in r]
    heavy = [r for r in runtime if re.match(r"(torch|sglang)\b", r)]
    assert not heavy, f"the router image must not pull {heavy}"


def test_sglang_image_is_the_pinned_official_one_with_the_plugin() -> None:
    text = dockerfile("Dockerfile.sglang")
    default = re.search(r"^ARG SGLANG_IMAGE=(\S+)$", text, re.M)[1]
    assert default == f"lmsysorg/sglang:v{IMAGE_LINE}-cu130" and IMAGE_LINE in SUPPORTED
    compose_default = load_compose("gpu")["services"]["replica-0"]["build"]["args"]["SGLANG_IMAGE"]
    assert compose_default == default
    assert "pip install --no-deps ." in text
    assert re.search(r'^ENTRYPOINT \["mori-sglang"\]$', text, re.M)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'mori-sglang = "engine_patches.launch:main"' in pyproject
    assert '[project.entry-points."sglang.srt.plugins"]' in pyproject


# --- Grafana ------------------------------------------------------------------------------
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def exprs() -> list[str]:
    board = dashboard()
    found = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    found += [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return found


@pytest.mark.parametrize("kind", COMPOSE)
def test_grafana_provisioning_loads_the_dashboard(kind: str) -> None:
    compose = load_compose(kind)
    grafana = compose["services"]["grafana"]
    provisioning = mount_source(compose, "grafana", "/etc/grafana/provisioning")
    dashboards = mount_source(compose, "grafana", "/var/lib/grafana/dashboards")
    (provider,) = yaml.safe_load((provisioning / "dashboards/mori.yml").read_text())["providers"]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (dashboards / Path(home).name).resolve() == DASHBOARD
    (source,) = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["url"] == "http://prometheus:9090" and "prometheus" in compose["services"]
    variable = next(v for v in dashboard()["templating"]["list"] if v["name"] == "datasource")
    assert variable["current"]["value"] == source["uid"]


def test_dashboard_panels_are_well_formed() -> None:
    panels = dashboard()["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for p in panels:
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
            assert all(t["expr"].strip() for t in p["targets"]), p["title"]


# --- against a running router ---------------------------------------------------------------
def set_flag(argv: list[str], name: str, value: str) -> list[str]:
    """argv with `name`'s value replaced (the flag must be there)."""
    out = list(argv)
    out[out.index(name) + 1] = value
    return out


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The demo stack without Docker: its emulator, router and replay service, each run with the
    compose file's own arguments and settings (ports, URLs, paths made local, clocks x20).

    Yields the replay's JSON result and the router's /metrics afterwards, as sample name ->
    label names seen on it (empty while a family has no sample yet)."""
    services = load_compose("demo")["services"]
    replica_port, router_port = free_port(), free_port()
    emulate = argv_of(services["replica-0"])
    for name, value in [("--port", replica_port), ("--host", "127.0.0.1"), ("--time-scale", 20)]:
        emulate = set_flag(emulate, name, str(value))
    serve = set_flag(argv_of(services["router"]), "--config", str(REPO / "configs/router.yaml"))
    env = {
        **services["router"]["environment"],
        "MORI_REPLICAS": f"http://127.0.0.1:{replica_port}",
        "MORI_PORT": str(router_port),
        "MORI_HOST": "127.0.0.1",
        "MORI_TICK_S": "0.2",
        "MORI_LOG_LEVEL": "warning",
    }
    base = f"http://127.0.0.1:{router_port}"
    out = tmp_path_factory.mktemp("replay") / "replay.json"
    replay = argv_of(services["replay"])
    for name, value in [
        ("--endpoint", base),
        ("--duration", 3),
        ("--time-scale", 20),
        ("--json", out),
    ]:
        replay = set_flag(replay, name, str(value))
    with spawn(mori(*emulate), replica_port), spawn(mori(*serve), router_port, env=env):
        done = subprocess.run(mori(*replay), cwd=REPO, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        time.sleep(0.5)  # a tick or two after the last step: gauges refreshed
        text = httpx.get(base + "/metrics", timeout=5).text
    exported: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
        for suffix in suffixes.get(family.type, [""]):
            exported.setdefault(family.name + suffix, set())
        for sample in family.samples:
            exported.setdefault(sample.name, set()).update(sample.labels)
    yield {"replay": json.loads(out.read_text()), "metrics": exported}


def test_demo_replay_runs_through_the_router(demo_run: dict[str, Any]) -> None:
    (row,) = demo_run["replay"]["results"]
    assert row["steps_s"] > 0 and row["output_tok_s"] > 0 and row["failed_steps"] == 0, row
    assert row["policy"] == "mori" and row["time_scale"] == 20, row
    assert demo_run["metrics"]["mori_requests_total"] == {"replica", "outcome"}


def test_dashboard_uses_only_series_the_router_exports(demo_run: dict[str, Any]) -> None:
    live_metrics = demo_run["metrics"]
    used = {name for expr in exprs() for name in _METRIC.findall(expr)}
    assert used, "the dashboard draws nothing"
    assert not used - live_metrics.keys(), f"not exported: {sorted(used - live_metrics.keys())}"
    assert not REQUIRED_SERIES - used, f"not drawn: {sorted(REQUIRED_SERIES - used)}"


def test_dashboard_labels_exist_on_their_series(demo_run: dict[str, Any]) -> None:
    """Every label a query groups by or matches on is carried by a series of that query."""
    live_metrics = demo_run["metrics"]
    contract = docs_labels()
    for expr in exprs():
        names = set(_METRIC.findall(expr))
        labels = set().union(*(live_metrics.get(n) or contract[_family(n)] for n in names))
        used = {x.strip() for g in re.findall(r"by \(([^)]*)\)", expr) for x in g.split(",")}
        used |= set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"", expr))
        assert not used - labels - {"le"}, f"{expr}: no label {used - labels - {'le'}}"


def _family(sample: str) -> str:
    return re.sub(r"_(total|bucket|sum|count)$", "", sample)


def docs_labels() -> dict[str, set[str]]:
    """Label names per metric from docs/metrics.md, for families with no sample yet."""
    out = {}
    for line in (REPO / "docs/metrics.md").read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("mori_"):
            labels = set() if cells[2] == "-" else {x.strip() for x in cells[2].split(",")}
            out[_family(cells[0])] = labels
    return out


def test_deployment_docs_name_the_files_and_commands() -> None:
    text = (REPO / "docs/deployment.md").read_text()
    for needle in (
        "docker/compose.yaml",
        "docker/compose.demo.yaml",
        "--profile replay",
        "MORI_REPLICAS",
        "nvidia-smi",
    ):
        assert needle in text, needle
