"""The live router driving `mori+predict`: copy cost from the config, policy wake-ups,
tool keys and agent roles from responses, and the tool hooks seen in the admin API."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.config import load_config
from router.controller import Router, policy_config
from router.policy import PolicyConfig
from router.policy.predictive import PredictivePolicy
from router.policy.types import ReplicaCapacity
from router.sim.presets import PRESETS


def test_load_time_per_token_comes_from_the_config_as_in_the_simulator():
    preset = PRESETS["h100-8b"]
    default = policy_config(load_config(None, {"replicas": ["http://r:1"]}, env={}))
    assert default.load_s_per_token == pytest.approx(
        preset.kv_bytes_per_token / preset.pcie_bytes_s
    )
    moe = PRESETS["b200-70b-tp2"]
    env = {"MORI_KV_BYTES_PER_TOKEN": str(moe.kv_bytes_per_token), "MORI_PCIE_GBPS": "100"}
    tuned = policy_config(load_config(None, {"replicas": ["http://r:1"]}, env=env))
    assert tuned.load_s_per_token == pytest.approx(moe.kv_bytes_per_token / moe.pcie_bytes_s)


# --- wake-ups: the controller ticks the policy when `next_wakeup` asks -------------------
def _moves(router: Router, reason: str) -> float:
    text = router.metrics.render().decode()
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "mori_moves_total" and s.labels.get("reason") == reason
    )


async def test_predicted_load_back_runs_on_a_wakeup_between_ticks():
    """A offloads at tool start for gated B; once B is gone, A's KV is loaded back just
    before its predicted tool end. The router's tick loop is 10 minutes, so only the
    policy's wake-up can do it, and it must not spin while it waits."""
    url = "http://127.0.0.1:9"  # never contacted: the test drives the policy events itself
    config = load_config(None, {"replicas": [url], "tick_s": 600}, env={})
    policy = PredictivePolicy(PolicyConfig(tick_s=0.2, predict_lead_s=1.5))
    ticks: list[float] = []
    tick = policy.tick
    policy.tick = lambda now: ticks.append(now) or tick(now)  # count, then run for real
    router = Router(config, policy=policy)
    policy.add_replica(url, ReplicaCapacity(3000, 10_000))
    try:
        now = router.clock()
        router.apply(policy.on_request("A", now, 2000))
        assert policy.route("A") == url
        router.apply(policy.on_response("A", now, 2000))
        router.apply(policy.on_request("B", now, 2000))
        assert policy.route("B") is None  # no room: B waits at the gate

        started = router.clock()
        router.apply(policy.on_tool_start("A", started, "Read", predict_s=4.0))  # 2.25 s
        assert policy.describe("A", started)["tier"] == "cpu" and policy.route("B") == url
        router.apply(policy.on_response("B", router.clock(), 2000))
        router.end_program("B")
        assert policy.describe("A", router.clock())["tier"] == "cpu"  # not due yet

        due = started + 2.25 - policy.load_s(policy.programs["A"]) - 1.5
        while policy.describe("A", router.clock())["tier"] == "cpu":
            assert router.clock() < due + 2.0, "no wake-up promoted A"
            await asyncio.sleep(0.01)
        assert router.clock() >= due - 0.01
        assert _moves(router, "promote_predicted") == 1
        assert 1 <= len(ticks) <= 3  # one timer (maybe re-armed once if it fired early)
    finally:
        await router.stop()
