"""Round awareness on the live router, end to end: an All-Gather app of four agents talks to
`mori serve` through the OpenAI SDK, in front of two emulated SGLang replicas.

Round 0 names itself (`round_id`), round 1 does not: the router infers it from the prompts
(each agent's new messages are the others' answers). The router hashes every message into
segments, shows each agent's round, its members and the segments they share in
`/v1/programs` and the metrics, and `mori+tokendance` places the round's agents on one
replica (they share a long system prompt and scenario), where `mori` spreads them
(Best-Fit-Decreasing, one program at a time): the contrast shows the co-placement is the
collective policy's doing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.router_harness import assert_clean, client, emulators, metric, router

AGENTS = 4
SYSTEM = "You are a resident of a simulated town; answer in one short sentence. " * 60
SCENARIO = "Scenario: a hurricane makes landfall tomorrow; the town council meets tonight. " * 30


@contextlib.contextmanager
def stack(policy: str) -> Iterator[str]:
    with (
        emulators(2, "--time-scale", "50", "--gpu-tokens", "60000") as replicas,
        router(replicas, policy=policy) as base,
    ):
        yield base


def persona(i: int) -> str:
    return f"You are agent {i}, with a private memory of your own. " * 4


def round_trip(base: str, prompts: list[list[dict]], round_id: str | None) -> list[str]:
    """One round: every agent's request at once; their answers."""
    api = client(base)
    extra = {"round_id": round_id} if round_id else {}

    def ask(i: int) -> str:
        answer = api.chat.completions.create(
            model="default",
            messages=prompts[i],
            max_tokens=8,
            extra_body={"program_id": f"agent{i}", **extra},
        )
        return answer.choices[0].message.content or ""

    with ThreadPoolExecutor(AGENTS) as pool:
        return list(pool.map(ask, range(AGENTS)))


def first_prompts() -> list[list[dict]]:
    return [
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": SCENARIO},
            {"role": "user", "content": persona(i)},
        ]
        for i in range(AGENTS)
    ]


def gathered(prompts: list[list[dict]], answers: list[str]) -> list[list[dict]]:
    """Round 1 (TokenDance Eq. 2): each agent's history, its answer, then the others'
    answers in its own order, then the round's task."""
    out = []
    for i, prompt in enumerate(prompts):
        others = [(i + k) % AGENTS for k in range(1, AGENTS)]
        heard = [{"role": "user", "content": f"agent {j} said: {answers[j]}"} for j in others]
        task = {"role": "user", "content": "What do you do next?"}
        out.append([*prompt, {"role": "assistant", "content": answers[i]}, *heard, task])
    return out


def view(base: str, pid: str) -> dict:
    r = httpx.get(f"{base}/v1/programs/{pid}", timeout=5)
    r.raise_for_status()
    return r.json()


def end_all(base: str) -> None:
    for i in range(AGENTS):
        assert httpx.post(f"{base}/v1/programs/agent{i}/end", timeout=5).status_code == 200


def test_round_is_identified_and_its_agents_share_one_replica() -> None:
    with stack("mori+tokendance") as base:
        prompts = first_prompts()
        answers = round_trip(base, prompts, "town/r0")
        views = [view(base, f"agent{i}") for i in range(AGENTS)]
        rnd = views[0]["round"]
        assert rnd["round_id"] == "town/r0" and rnd["explicit"] is True
        assert sorted(rnd["members"]) == [f"agent{i}" for i in range(AGENTS)]
        assert len(rnd["shared_segments"]) == 2  # the system prompt and the scenario
        assert rnd["shared_tokens"] >= (len(SYSTEM) + len(SCENARIO)) // 4
        assert len({v["replica"] for v in views}) == 1, [v["replica"] for v in views]
        replica = views[0]["replica"]
        assert metric(base, "mori_rounds") == 1
        assert metric(base, "mori_round_programs") == AGENTS
        # three of the four agents' shared prefix is counted once on their replica
        shared = metric(base, "mori_shared_tokens", replica=replica, tier="gpu")
        assert shared >= (AGENTS - 1) * rnd["shared_tokens"]

        round_trip(base, gathered(prompts, answers), None)  # no round id: inferred
        views = [view(base, f"agent{i}") for i in range(AGENTS)]
        rnd = views[0]["round"]
        assert rnd["explicit"] is False and rnd["round_id"].startswith("auto-")
        assert sorted(rnd["members"]) == [f"agent{i}" for i in range(AGENTS)]
        assert {v["round"]["round_id"] for v in views} == {rnd["round_id"]}
        # the others' answers are the same blocks at other offsets in every prompt
        assert len(rnd["gathered_segments"]) >= AGENTS
        assert {v["replica"] for v in views} == {replica}  # they stay together
        end_all(base)
        assert_clean(base)
        assert metric(base, "mori_rounds") == 0


def test_mori_places_the_same_agents_one_by_one() -> None:
    """Without collective scheduling the round is identified all the same, but its agents
    are spread over both replicas."""
    with stack("mori") as base:
        round_trip(base, first_prompts(), "town/r0")
        views = [view(base, f"agent{i}") for i in range(AGENTS)]
        assert sorted(views[0]["round"]["members"]) == [f"agent{i}" for i in range(AGENTS)]
        assert len({v["replica"] for v in views}) == 2
        end_all(base)
        assert_clean(base)


@pytest.mark.parametrize("where", ["body", "header"])
def test_a_bad_round_id_is_a_400_naming_it(where: str) -> None:
    with stack("mori") as base:
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        headers = {}
        if where == "body":
            body["round_id"] = 7
        else:
            headers["X-Round-Id"] = "r" * 300  # longer than any label
        r = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=5)
        assert r.status_code == 400, r.text
        assert "round" in r.json()["error"]["param"].lower()
