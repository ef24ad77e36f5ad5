"""The Kubernetes base (docker/kustomization.yaml, docker/kubernetes/), validated offline: the
kustomization is built here the way kustomize builds it (resources, generated ConfigMaps,
namespace, labels), every built-in object is checked against the Kubernetes API's schemas
(the `kubernetes-validate` package ships them), and the objects are checked against each
other and against MORI: Services and monitors select pods that exist, on ports they name;
the router pair names every replica pod and runs as standbys with settings the router
accepts; HAProxy gets the committed config and the routers' pod names; each replica asks
for one GPU and its flags pass the MORI launcher; the dashboard is the compose stacks' one.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from engine_patches.launch import REQUIRED, build_argv
from router.config import load_config

DOCKER = Path(__file__).resolve().parents[1] / "docker"
KUSTOMIZATION = DOCKER / "kustomization.yaml"
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the base is written for (schemas: strict)
OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor"}  # CRDs: no schema in the package


def build() -> list[dict[str, Any]]:
    """The objects `kubectl apply -k docker/` creates (generated names without the hash)."""
    kust = yaml.safe_load(KUSTOMIZATION.read_text())
    objects = [
        doc
        for path in kust["resources"]
        for doc in yaml.safe_load_all((DOCKER / path).read_text())
        if doc
    ]
    for gen in kust.get("configMapGenerator", []):
        data = {}
        for entry in gen["files"]:
            key, _, path = entry.rpartition("=")
            data[key or Path(path).name] = (DOCKER / path).read_text()
        labels = gen.get("options", {}).get("labels", {})
        meta = {"name": gen["name"], "labels": labels}
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
    for obj in objects:
        if obj["kind"] != "Namespace":
            obj["metadata"]["namespace"] = kust["namespace"]
        for pair in kust.get("labels", []):
            obj["metadata"].setdefault("labels", {}).update(pair["pairs"])
    return objects


OBJECTS = build()


def one(kind: str, name: str) -> dict[str, Any]:
    found = [o for o in OBJECTS if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def workloads() -> list[dict[str, Any]]:
    return [o for o in OBJECTS if o["kind"] in ("StatefulSet", "Deployment")]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def env_of(workload: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container(workload).get("env", [])}


def selected(selector: dict[str, str]) -> list[dict[str, Any]]:
    """The workloads whose pods carry every label of `selector`."""
    return [
        w
        for w in workloads()
        if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
    ]


def port_names(workload: dict[str, Any]) -> set[str]:
    return {p["name"] for p in container(workload).get("ports", [])}


@pytest.mark.parametrize(
    "obj",
    [o for o in OBJECTS if o["kind"] not in OPERATOR_KINDS],
    ids=lambda o: f"{o['kind']}/{o['metadata']['name']}",
)
def test_objects_validate_against_the_kubernetes_schemas(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # raises on any error


def test_a_broken_object_is_refused() -> None:
    """The validation can fail: a typo'd field and a wrong type are errors."""
    bad = copy.deepcopy(one("StatefulSet", "mori-router"))
    bad["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    bad = copy.deepcopy(one("Service", "mori"))
    bad["spec"]["ports"][0]["port"] = "eight thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_services_select_pods_on_named_ports() -> None:
    for svc in (o for o in OBJECTS if o["kind"] == "Service"):
        (target,) = selected(svc["spec"]["selector"])
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in port_names(target), svc["metadata"]["name"]
    for sts in (o for o in OBJECTS if o["kind"] == "StatefulSet"):
        headless = one("Service", sts["spec"]["serviceName"])
        assert headless["spec"]["clusterIP"] == "None"
        assert selected(headless["spec"]["selector"]) == [sts]


def test_monitors_scrape_the_routers_and_the_replicas() -> None:
    service_monitor = one("ServiceMonitor", "mori-router")
    assert service_monitor["apiVersion"] == "monitoring.coreos.com/v1"
    (svc,) = [
        o
        for o in OBJECTS
        if o["kind"] == "Service"
        and service_monitor["spec"]["selector"]["matchLabels"].items()
        <= o["metadata"]["labels"].items()
    ]
    assert selected(svc["spec"]["selector"]) == [one("StatefulSet", "mori-router")]
    assert {e["port"] for e in service_monitor["spec"]["endpoints"]} <= {
        p["name"] for p in svc["spec"]["ports"]
    }
    pod_monitor = one("PodMonitor", "mori-replica")
    (replicas,) = selected(pod_monitor["spec"]["selector"]["matchLabels"])
    assert replicas is one("StatefulSet", "mori-replica")
    for endpoint in pod_monitor["spec"]["podMetricsEndpoints"]:
        assert endpoint["port"] in port_names(replicas) and endpoint["path"] == "/metrics"
    assert "--enable-metrics" in container(replicas)["args"]


def test_each_replica_has_one_gpu_and_the_mori_flags() -> None:
    replicas = one("StatefulSet", "mori-replica")
    assert container(replicas)["resources"]["limits"] == {"nvidia.com/gpu": 1}
    argv = build_argv(container(replicas)["args"])  # LaunchError on a contradicting flag
    assert all(flag in argv for flag in REQUIRED)
    assert argv[argv.index("--port") + 1] == str(container(replicas)["ports"][0]["containerPort"])


def test_the_router_pair_names_every_replica_and_stands_by() -> None:
    routers, replicas = one("StatefulSet", "mori-router"), one("StatefulSet", "mori-replica")
    assert routers["spec"]["replicas"] == 2
    env = env_of(routers)
    config = load_config(env=env)  # every MORI_* setting is a real router field
    assert config.standby and config.host == "0.0.0.0"
    port = replicas["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    service = replicas["spec"]["serviceName"]
    assert [r.url for r in config.replicas] == [
        f"http://mori-replica-{i}.{service}:{port}" for i in range(replicas["spec"]["replicas"])
    ]
    assert container(routers)["ports"][0]["containerPort"] == config.port


def test_haproxy_gets_the_committed_config_and_the_routers_pod_names() -> None:
    proxy = one("Deployment", "mori-proxy")
    (volume,) = proxy["spec"]["template"]["spec"]["volumes"]
    config = one("ConfigMap", volume["configMap"]["name"])
    assert config["data"]["haproxy.cfg"] == (DOCKER / "haproxy" / "ha.cfg").read_text()
    (mount,) = container(proxy)["volumeMounts"]
    assert container(proxy)["args"][-1] == f"{mount['mountPath']}/haproxy.cfg"
    env = env_of(proxy)
    port = one("StatefulSet", "mori-router")["spec"]["template"]["spec"]["containers"][0]
    suffix = f".mori-router.$(POD_NAMESPACE).svc.cluster.local:{port['ports'][0]['containerPort']}"
    assert env["MORI_PRIMARY"] == "mori-router-0" + suffix
    assert env["MORI_STANDBY"] == "mori-router-1" + suffix
    bind_port = int(env["MORI_PROXY_BIND"].rsplit(":", 1)[1])
    assert [p["containerPort"] for p in container(proxy)["ports"]] == [bind_port]


def test_the_dashboard_is_the_compose_stacks_one() -> None:
    dashboard = one("ConfigMap", "mori-grafana-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    text = (DOCKER / "grafana" / "dashboards" / "mori.json").read_text()
    assert dashboard["data"] == {"mori.json": text}
    assert json.loads(text)["title"]
