"""The graph API of `mori+space` on the live router in front of an emulated replica:
an app registers its agent graph (`POST /v1/apps`), its requests name it (`app_id` in
the body or `X-App-Id`) and their role through the OpenAI SDK, the router places them in
the graph and tells the engine its agent types; without a registered graph it infers one
from subagents; bad graphs get OpenAI-style 400s."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.router_harness import assert_clean, client, fast_stack

EDGES = [["Planner", "Searcher"], ["Searcher", "Writer"], ["Planner", "Writer"]]


@pytest.fixture(scope="module")
def stack():
    with fast_stack("mori+space") as urls:
        yield urls


def ask(api, pid: str, role: str, app: str | None, parent: str | None = None) -> None:
    headers = {"X-Agent-Role": role, **({"X-Parent-Id": parent} if parent else {})}
    body = {"program_id": pid, **({"app_id": app} if app else {})}
    api.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": f"{role} works on {pid}"}],
        max_tokens=4,
        extra_body=body,
        extra_headers=headers,
    )


def end(base: str, *pids: str) -> None:
    for pid in pids:
        assert httpx.post(f"{base}/v1/programs/{pid}/end", timeout=5).status_code == 200


def test_registered_graph_places_requests_and_reaches_the_engine(stack):
    base, replica = stack
    r = httpx.post(f"{base}/v1/apps", json={"app_id": "research", "edges": EDGES}, timeout=5)
    assert r.status_code == 200, r.text
    roles = r.json()["roles"]
    assert roles["Writer"] == {"depth": 3, "out_degree": 0}
    assert roles["Planner"] == {"depth": 1, "out_degree": 2}
    api = client(base)
    ask(api, "t1", "Writer", "research")
    ask(api, "t1.s", "Searcher", None, parent="t1")  # the app comes with its parent
    view = httpx.get(f"{base}/v1/programs/t1.s", timeout=5).json()
    assert view["agent_type"] == "research/Searcher" and view["depth"] == 2
    writer = httpx.get(f"{base}/v1/programs/t1", timeout=5).json()
    assert writer["priority"] > view["priority"]  # deeper in the graph: first
    listing = httpx.get(f"{base}/v1/apps", timeout=5).json()
    assert [a["app_id"] for a in listing["data"]] == ["research"]
    assert "critical" in listing and "replicas" in listing
    deadline, scores = time.monotonic() + 10, {}
    while time.monotonic() < deadline and not scores:  # pushed with the next hints
        scores = httpx.get(f"{replica}/mori/residency", timeout=5).json()["anchor_scores"]
        time.sleep(0.1)
    assert scores == {"research/Writer": 1.0}  # the critical type: its KV goes last
    end(base, "t1.s", "t1")
    assert httpx.delete(f"{base}/v1/apps/research", timeout=5).json()["deleted"] is True
    assert httpx.get(f"{base}/v1/apps/research", timeout=5).status_code == 404
    assert_clean(base)


def test_graph_is_inferred_from_subagents_without_registration(stack):
    base, _ = stack
    api = client(base)
    ask(api, "u1", "Lead", "coder")
    ask(api, "u1.a", "Programmer", None, parent="u1")
    ask(api, "u1.b", "Reviewer", "coder", parent="u1.a")
    app = httpx.get(f"{base}/v1/apps/coder", timeout=5).json()
    assert app["inferred"] is True
    assert app["roles"]["Reviewer"]["depth"] == 3  # Lead -> Programmer -> Reviewer
    end(base, "u1.b", "u1.a", "u1")
    assert_clean(base)


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"app_id": "x", "edges": [["a", "b"], ["b", "a"]]}, "edges", "cycle"),
        ({"app_id": "x", "edges": "a->b"}, "edges", "list"),
        ({"edges": [["a", "b"]]}, "app_id", "string"),
    ],
)
def test_bad_graphs_get_a_400_naming_the_field(stack, body, param, says):
    base, _ = stack
    r = httpx.post(f"{base}/v1/apps", json=body, timeout=5)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"]


def test_bad_app_id_on_a_request_is_a_400(stack):
    base, _ = stack
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "x"}], "app_id": 7},
        timeout=5,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "app_id"
