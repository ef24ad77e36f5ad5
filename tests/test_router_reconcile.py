"""The router's tiers against the engines' `/mori/residency`: a restarted router rebuilds the
previous one's tiers from what the engines hold, and a CPU-tier program whose host copy the
engine dropped stops counting as held."""

from __future__ import annotations

import time

import httpx
import openai

from router.owner.reconcile import Held, parse_residency, reconcile
from router.policy import make_policy
from router.policy.types import WAITING, Hint, Placement, ReplicaCapacity, Tier
from tests.router_harness import chat, client, emulator, emulators, metric, programs, router

GPU, CPU = Tier.GPU, Tier.CPU


def _policy():
    policy = make_policy("mori")
    for r in ("r0", "r1"):
        policy.add_replica(r, ReplicaCapacity(gpu_tokens=10_000, cpu_tokens=20_000))
    return policy


def test_unknown_programs_are_adopted_on_the_tier_their_hint_names():
    policy = _policy()
    views = {
        "r0": {
            "a": Held("r0", 900, 900, Hint.BUSY),
            "b": Held("r0", 0, 700, Hint.IDLE),
            "ended": Held("r0", 0, 500, Hint.INACTIVE),
            "empty": Held("r0", 0, 0, Hint.BUSY),
        },
        "r1": {"b": Held("r1", 0, 300, Hint.IDLE)},  # a smaller stale copy elsewhere
    }
    outcome = reconcile(policy, views, now=10.0)
    assert outcome.adopted == {"a": Placement(GPU, "r0"), "b": Placement(CPU, "r0")}
    assert policy.route("a") is None  # acting: no request in flight
    assert policy.programs["b"].context_tokens == 700 and not policy.programs["b"].is_new
    assert policy.tiers.used(Placement(GPU, "r0")) == 900
    assert policy.tiers.used(Placement(CPU, "r0")) == 700
    assert reconcile(policy, views, now=11.0).adopted == {}  # known now: nothing to do


def test_a_takeover_adopts_waiting_programs_with_their_home():
    """`inactive` programs that still hold KV: left alone by the periodic check (often ended
    ones), adopted into WAITING at a takeover with the replica holding them as their home."""
    views = {
        "r0": {"w": Held("r0", 0, 800, Hint.INACTIVE)},
        "r1": {"w": Held("r1", 0, 100, Hint.INACTIVE)},
    }
    assert reconcile(_policy(), views, now=1.0).adopted == {}
    policy = _policy()
    assert reconcile(policy, views, now=1.0, waiting=True).adopted == {"w": WAITING}
    p = policy.programs["w"]
    assert p.last_replica == "r0" and p.context_tokens == 800 and not p.is_new
    assert policy.tiers.used(Placement(GPU, "r0")) == policy.tiers.used(Placement(CPU, "r0")) == 0


def test_a_cpu_tier_program_whose_host_copy_is_gone_leaves_the_tier():
    policy = _policy()
    reconcile(policy, {"r0": {"b": Held("r0", 0, 700, Hint.IDLE)}}, now=1.0)
    outcome = reconcile(policy, {"r0": {}}, now=2.0)  # HiCache dropped it
    assert outcome.lost == ["b"] and policy.programs["b"].placement == WAITING
    assert policy.tiers.used(Placement(CPU, "r0")) == 0
    silent = _policy()  # a replica that did not answer is no evidence of loss
    reconcile(silent, {"r0": {"b": Held("r0", 0, 700, Hint.IDLE)}}, now=1.0)
    assert reconcile(silent, {}, now=2.0).lost == []


def test_parse_residency_skips_malformed_rows():
    doc = {"programs": {
        "ok": {"hint": "idle", "hinted": True, "device_tokens": 0, "host_tokens": 5},
        "mine": {"hint": "busy", "device_tokens": 3, "host_tokens": 3},
        "bad": {"hint": "hot", "device_tokens": 0, "host_tokens": 5},
        "worse": "nope",
    }}  # fmt: skip
    assert parse_residency("r", doc) == {
        "ok": Held("r", 0, 5, Hint.IDLE),
        "mine": Held("r", 3, 3, Hint.BUSY, hinted=False),  # no `hinted`: no router named it
    }
    assert parse_residency("r", ["not", "a", "dict"]) == {}


def test_programs_no_router_named_are_never_adopted():
    """The engine's own names (KV of requests that reached it without the router's id, typed
    by default) may be other names of known programs: adopting them counts tokens twice."""
    policy = _policy()
    views = {"r0": {"anon-1": Held("r0", 900, 900, Hint.BUSY, hinted=False),
                    "anon-2": Held("r0", 0, 700, Hint.IDLE, hinted=False)},
             "r1": {"named": Held("r1", 0, 300, Hint.IDLE),
                    "anon-1": Held("r1", 50, 50, Hint.BUSY, hinted=False)}}  # fmt: skip
    assert reconcile(policy, views, now=1.0).adopted == {"named": Placement(CPU, "r1")}
    assert set(policy.programs) == {"named"}
    assert policy.tiers.used(Placement(GPU, "r0")) == 0


def test_a_program_ended_while_the_engines_were_read_is_not_adopted_back():
    """The engine still typed it when it answered (the router's `inactive` was not applied
    yet): the likely adoption seen once in a 45 s demo run over chat, before this rule."""
    policy = _policy()
    views = {"r0": {"gone": Held("r0", 900, 900, Hint.BUSY), "b": Held("r0", 0, 70, Hint.IDLE)}}
    outcome = reconcile(policy, views, now=1.0, ended={"gone"})
    assert outcome.adopted == {"b": Placement(CPU, "r0")} and "gone" not in policy.programs


def test_a_name_the_engine_gave_a_known_conversation_is_not_adopted():
    """A conversation the router serves as `known` also reached the engine without the
    router's id (sent to the replica directly here; SGLang's Messages entrypoint dropped the
    id before the engine patch carried it): the engine holds it under a name made of its
    first message. Reconcile, run every 0.2 s, adopts nothing: the router lists `known` only."""
    text = "word " * 300
    with emulator("--time-scale", "20") as (replica, _), router([replica], reconcile_s=0.2) as base:
        client(base).chat.completions.create(**chat("known", text))
        direct = openai.OpenAI(base_url=replica + "/v1", api_key="none", max_retries=0)
        direct.chat.completions.create(**{**chat("", text), "extra_body": {}})
        held = httpx.get(replica + "/mori/residency", timeout=5).json()["programs"]
        assert len(held) == 2 and "known" in held, held  # known, and the engine's own name
        time.sleep(1.0)
        assert metric(base, "mori_reconciled_programs_total", kind="adopted") == 0
        assert [p["program_id"] for p in programs(base)["data"]] == ["known"]


def _tiers(base: str) -> dict[str, tuple[str, str | None]]:
    return {
        p["program_id"]: (p["tier"], p["replica"])
        for p in programs(base)["data"]
        if p["tier"] != "waiting"
    }


def _engine_hints(urls: list[str]) -> dict[str, tuple[str, str]]:
    hints = {}
    for url in urls:
        for pid, row in httpx.get(url + "/mori/residency", timeout=5).json()["programs"].items():
            if row["hint"] != "inactive":
                hints[pid] = (row["hint"], url)
    return hints


def test_a_restarted_router_rebuilds_its_tiers_from_the_engines():
    """Router A places four ~1000-token programs on two replicas whose GPU tiers hold 2500
    tokens each; their second steps grow them past it, so a tick demotes one per replica to
    the CPU tier. A is stopped mid-run; router B, started fresh on the same replicas, shows
    the same program -> (tier, replica) map before any request, and the programs' next steps
    go back to the replica holding their KV and hit it."""
    with emulators(2, "--time-scale", "20") as urls:
        specs = [{"url": u, "gpu_tokens": 2500, "cpu_tokens": 20000} for u in urls]
        names = [f"job-{i}" for i in range(4)]
        history = {p: f"{p} " + "word " * 800 for p in names}
        with router(specs) as first:
            c = client(first)
            for text in ("", " tool result " + "word " * 250):
                for p in names:
                    history[p] += text
                    out = c.chat.completions.create(**chat(p, history[p]))
                    history[p] += out.choices[0].message.content
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # a tick demotes; the engines get the hints
                before = _tiers(first)
                expect = {p: ("busy" if t == "gpu" else "idle", r) for p, (t, r) in before.items()}
                if {t for t, _ in before.values()} == {"gpu", "cpu"} and _engine_hints(
                    urls
                ) == expect:
                    break
                time.sleep(0.1)
        assert {t for t, _ in before.values()} == {"gpu", "cpu"}, before
        assert _engine_hints(urls) == expect

        with router(specs) as second:
            assert _tiers(second) == before  # rebuilt before any request arrived
            c = client(second)
            ordered = sorted(before.items(), key=lambda item: item[1][0] != "gpu")
            for p, (tier, replica) in ordered:  # GPU-tier programs first, then the CPU ones
                raw = c.chat.completions.with_raw_response.create(
                    **chat(p, history[p] + " tool result", extra_body={
                        "return_cached_tokens_details": True})
                )  # fmt: skip
                assert raw.headers["x-mori-replica"] == replica, p
                split = raw.parse().model_extra["sglext"]["cached_tokens_details"]
                assert split["device"] + split["host"] > 1000, (p, split)
                if tier == "gpu":  # done: room for the CPU-tier programs' promotion
                    httpx.post(f"{second}/v1/programs/{p}/end", timeout=5).raise_for_status()
