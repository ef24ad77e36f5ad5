"""The differential check's samples: the same reduction of tier tokens, program views, engine
usages and move counts on the live and the simulated side (bench/live_vs_sim.py)."""

from __future__ import annotations

import pytest

from router.policy import PolicyConfig, make_policy
from router.policy.types import Placement, ReplicaCapacity, Tier
from router.presets import get_preset
from router.replay.timeline import compare, sample, series
from router.sim.model import ReplicaEngine
from router.sim.simulator import SimConfig, Simulation


def view(pid: str, tier: str, status: str, tokens: int, replica: str | None = None, **kw):
    base = {"program_id": pid, "tier": tier, "replica": replica, "status": status}
    return base | {"context_tokens": tokens, "steps": 1, "last_tool": None} | kw


def test_a_sample_books_tiers_per_replica_and_says_why_requests_are_held():
    views = [
        view("a", "gpu", "acting", 100, "r0", predicted_tool_s=3.0),
        view("b", "gpu", "reasoning", 200, "r1"),
        view("c", "cpu", "gated", 300, "r1"),
        view("d", "waiting", "gated", 400),
        view("e", "waiting", "gated", 50, steps=0),
        view("f", "cpu", "acting", 70, "r0", predicted_tool_s=None),
    ]
    engines = {
        "r1": {"device_used_tokens": 250, "queued": 2, "admitted": 4, "queue_wait_s": 2.0},
        "r0": {"device_used_tokens": 90, "host_used_tokens": 500},
    }
    tiers = {("r0", "gpu"): 100, ("r1", "gpu"): 200, ("r0", "cpu"): 70, ("r1", "cpu"): 300}
    s = sample(12.0, tiers, views, engines, {"demote": 3})
    assert s.gpu_tier == [100, 200] and s.cpu_tier == [70, 300]
    assert s.device == [90, 250] and s.host == [500, 0] and s.queued == [0, 2]
    assert s.queue_wait_s == [0.0, 0.5]
    assert s.held == {"cpu": 1, "returning": 1, "new": 1}
    assert (s.acting, s.tool_known) == (2, 1)  # f's tool call is not known to the policy
    assert s.moves == {"demote": 3}


def test_compare_puts_time_means_side_by_side_and_the_moves_at_the_end():
    engines = {"r0": {"device_used_tokens": 100}}
    live = [
        sample(t, {("r0", "gpu"): n}, [view("a", "gpu", "acting", n, "r0")], engines, {"demote": t})
        for t, n in ((5, 100), (10, 300))
    ]
    views = [view("a", "gpu", "acting", 100, "r0")]
    sim = [sample(5, {("r0", "gpu"): 100}, views, engines, {"demote": 1})]
    rows = {r.metric: r for r in compare(live, sim)}
    assert rows["gpu_tier[r0]"].live == 200 and rows["gpu_tier[r0]"].ratio == 2.0
    assert rows["moves demote"].live == 10 and rows["moves demote"].sim == 1
    assert series(live)["device[r0]"] == [100, 100]


def test_the_simulator_probe_sees_what_the_policy_and_engines_hold():
    """Sampled from a real simulated run: the router's GPU tier never exceeds the engine's
    budget, and whatever the engine holds in HBM fits it too."""
    from router.replay.trace import load_trace

    corpus = load_trace("traces/generated-claude-code-32k.jsonl")
    config = SimConfig(
        policy="mori", replicas=2, concurrency=8, duration_s=60, token_scale=0.25,
        gpu_tokens=16000, cpu_ratio=2,
    )  # fmt: skip
    seen = []

    def probe(sim: Simulation) -> None:
        views = [sim.policy.describe(pid, sim.now) for pid in sim.policy.programs]
        engines = {n: e.usage() | e.stats for n, e in sim.engines.items()}
        tiers = {
            (n, tier.value): sim.policy.tiers.used(Placement(tier, n))
            for n in sim.engines
            for tier in (Tier.GPU, Tier.CPU)
        }
        seen.append(sample(sim.now, tiers, views, engines, sim.moves))

    Simulation(corpus, config).run(probe=probe)
    assert len(seen) >= 10
    assert all(max(s.gpu_tier) <= 16000 and max(s.device) <= 16000 for s in seen)
    assert any(sum(s.gpu_tier) > 0 for s in seen) and seen[-1].moves


@pytest.mark.parametrize("eviction", ["typed", "lru"])
def test_engine_queue_stats_count_the_wait_of_admitted_requests(eviction):
    from router.policy.types import EngineMode

    engine = ReplicaEngine(get_preset("h100-8b"), EngineMode(eviction, True), 30_000, 0)
    engine.submit("a", "pa", 20_000, 500, 0.0)
    engine.submit("b", "pb", 20_000, 500, 0.0)  # waits for a's KV
    while (t := engine.next_event_time()) is not None:
        engine.advance(t)
    assert engine.stats["admitted"] == 2
    assert engine.stats["queue_wait_s"] > 1.0  # b waited out a's whole request


def test_policy_views_feed_a_sample_directly():
    policy = make_policy("mori", PolicyConfig())
    policy.add_replica("r0", ReplicaCapacity(1000, 1000))
    policy.on_request("p", 0.0, 100)
    views = [policy.describe(pid, 0.5) for pid in policy.programs]
    tiers = {("r0", "gpu"): policy.tiers.used(Placement(Tier.GPU, "r0"))}
    s = sample(0.5, tiers, views, {"r0": {}}, {})
    assert s.gpu_tier == [100] and s.held == {"cpu": 0, "returning": 0, "new": 0}
