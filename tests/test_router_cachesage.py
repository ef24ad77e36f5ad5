"""The live router with `mori+cachesage` in front of an emulated replica: agent identity
from headers or anchors, the learnt hand-over chain, survival scores pushed to the engine
with the hints, and warm-up requests (OpenAI SDK clients, real processes)."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.router_harness import assert_clean, client, fast_stack, metric

ROLES = ["Planner", "Coder", "Tester"]
SYSTEM = {role: f"You are the {role}. " + f"{role} rules and tool schemas. " * 60 for role in ROLES}
SYSTEM["selector"] = "You pick who speaks next. " * 40


@pytest.fixture(scope="module")
def stack():
    with fast_stack("mori+cachesage") as urls:
        yield urls


def ask(api, pid: str, role: str, parent: str | None, text: str, named: bool = True) -> None:
    headers = {"X-Parent-Id": parent} if parent else {}
    if named:
        headers["X-Agent-Role"] = role
    api.chat.completions.create(
        model="default",
        messages=[{"role": "system", "content": SYSTEM[role]}, {"role": "user", "content": text}],
        max_tokens=4,
        extra_body={"program_id": pid},
        extra_headers=headers,
    )


def task(api, n: int, named: bool = True) -> None:
    """A supervisor task: the selector hands turns to Planner -> Coder -> Tester, twice."""
    root = f"task{n}"
    for lap in range(2):
        for role in ROLES:
            ask(api, root, "selector", None, f"task {n} lap {lap}: who next?", named)
            ask(api, f"{root}.{role}", role, root, f"task {n} lap {lap} for {role}", named)
    for pid in [root, *(f"{root}.{r}" for r in ROLES)]:
        httpx.post(f"{api.base_url}programs/{pid}/end", timeout=5)


def describe(base: str, pid: str) -> dict:
    return httpx.get(f"{base}/v1/programs/{pid}", timeout=5).json()


def test_identity_comes_from_the_header_or_the_anchor(stack):
    base, _ = stack
    api = client(base)
    ask(api, "solo-a", "Coder", None, "one", named=False)
    ask(api, "solo-b", "Coder", None, "two", named=False)
    ask(api, "solo-c", "Coder", None, "three", named=True)
    a, b, c = (describe(base, p)["agent"] for p in ("solo-a", "solo-b", "solo-c"))
    assert a == b and a.startswith("anchor-")  # same system prompt, same identity
    assert c == "Coder"  # the header wins
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "x"}], "parent_id": 7},
        timeout=5,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "parent_id"


def test_learnt_chain_pushes_scores_and_warms_the_next_role(stack):
    base, replica = stack
    api = client(base)
    for n in range(9):  # 9 tasks x 5 hand-overs: past the learner's warm-up
        task(api, n)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        scores = httpx.get(replica + "/mori/residency", timeout=5).json()["anchor_scores"]
        if scores:
            break
        time.sleep(0.2)
    assert set(scores) >= set(ROLES)  # pushed with the hints
    ask(api, "live", "selector", None, "a new task: who first?")
    ask(api, "live.Planner", "Planner", "live", "plan it")  # Planner's turn: Coder is next
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not metric(base, "mori_warmups_total", outcome="ok"):
        time.sleep(0.2)
    assert metric(base, "mori_warmups_total", outcome="ok") >= 1
    assert describe(base, "live.Planner")["predicted_next_agent"][0] == "Coder"
    for pid in ("live", "live.Planner", "solo-a", "solo-b", "solo-c"):
        httpx.post(f"{base}/v1/programs/{pid}/end", timeout=5)
    assert_clean(base)
