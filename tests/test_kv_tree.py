"""The shared-prefix cache model: anchors and forked prefixes stored once and hit across
programs, with the typed/host tier semantics of the per-program model, survival scores and
anchor warm-ups (router/sim/kv_tree.py through router/sim/model.py)."""

from __future__ import annotations

import pytest

from router.policy.types import EngineMode, Hint
from router.presets import get_preset
from router.sim.model import FirstToken, ReplicaEngine, SharedPrefix

PRESET = get_preset("h100-8b")
TYPED = EngineMode("typed", True)
LRU = EngineMode("lru", True)
MAIN = SharedPrefix(4_000, anchor="main")


def drain(engine: ReplicaEngine) -> tuple[list, float]:
    events, t = [], 0.0
    while (nt := engine.next_event_time()) is not None:
        events += engine.advance(nt)
        t = nt
    return events, t


def step(engine, rid, pid, tokens, now, output=10, reused=None, prefix=None) -> tuple:
    """Run one request to completion; (cached_device, cached_host, finish time)."""
    engine.submit(rid, pid, tokens, output, now, reused_tokens=reused, prefix=prefix)
    events, t = drain(engine)
    first = next(e for e in events if isinstance(e, FirstToken) and e.rid == rid)
    return first.cached_device, first.cached_host, t


def test_an_anchor_is_stored_once_and_hit_by_every_program_of_the_role():
    engine = ReplicaEngine(PRESET, TYPED, 100_000, 100_000)
    assert step(engine, "a", "pa", 6_000, 0.0, prefix=MAIN)[:2] == (0, 0)
    assert step(engine, "b", "pb", 7_000, 5.0, prefix=MAIN)[:2] == (4_000, 0)
    # one anchor + two private tails, not two anchors
    assert engine.usage()["device_used_tokens"] == 4_000 + 2_010 + 3_010
    assert engine.residency("pb") == (7_010, 7_010)  # the anchor counts for each user
    # another role, or a different anchor size, is another segment
    other = SharedPrefix(4_000, anchor="Explore")
    assert step(engine, "c", "pc", 5_000, 9.0, prefix=other)[:2] == (0, 0)


def test_a_program_reuses_its_own_path_through_the_anchor():
    engine = ReplicaEngine(PRESET, TYPED, 100_000, 100_000)
    step(engine, "a1", "pa", 6_000, 0.0, prefix=MAIN)
    assert step(engine, "a2", "pa", 8_000, 5.0, reused=6_010, prefix=MAIN)[:2] == (6_010, 0)
    # compaction: the prompt keeps only the anchor; the stale tail is freed at once
    assert step(engine, "a3", "pa", 5_000, 9.0, reused=4_000, prefix=MAIN)[:2] == (4_000, 0)
    assert engine.usage()["device_used_tokens"] == 5_010
    assert engine.usage()["host_used_tokens"] == 5_010


def test_a_forked_subagent_hits_the_parents_context_and_both_keep_it():
    engine = ReplicaEngine(PRESET, TYPED, 100_000, 100_000)
    step(engine, "p1", "parent", 10_000, 0.0, prefix=MAIN)
    fork = SharedPrefix(7_000, program="parent")
    assert step(engine, "c1", "child", 9_000, 5.0, prefix=fork)[:2] == (7_000, 0)
    assert engine.usage()["device_used_tokens"] == 10_010 + 2_010  # 7_000 tokens stored once
    # the parent goes on from its whole context, the child from its own
    assert step(engine, "p2", "parent", 11_000, 9.0, reused=10_010)[:2] == (10_010, 0)
    assert step(engine, "c2", "child", 9_500, 12.0, reused=9_010)[:2] == (9_010, 0)


def test_idle_offload_keeps_a_shared_anchor_on_device():
    engine = ReplicaEngine(PRESET, TYPED, 100_000, 100_000)
    step(engine, "a", "pa", 6_000, 0.0, prefix=MAIN)
    step(engine, "b", "pb", 6_000, 5.0, prefix=MAIN)
    engine.apply_hints({"pa": Hint.IDLE}, 10.0)
    assert engine.residency("pa") == (4_000, 6_010)  # its tail left the device, not the anchor
    engine.apply_hints({"pa": Hint.BUSY}, 11.0)  # load-back brings the tail
    assert engine.residency("pa") == (6_010, 6_010)
    dev, host, _ = step(engine, "a2", "pa", 6_500, 11.5, reused=6_010)
    assert (dev, host) == (6_010, 0)  # loaded ahead: on device when matched, as SGLang counts


def test_an_anchor_outlives_its_users_tails_and_the_host_drops_only_host_only_tokens():
    engine = ReplicaEngine(PRESET, TYPED, 20_000, 30_000)
    step(engine, "a", "pa", 9_000, 0.0, prefix=MAIN)
    engine.apply_hints({"pa": Hint.INACTIVE}, 1.0)
    step(engine, "x", "other", 14_000, 2.0)  # evicts 3_020 leaf-first: from pa's tail only
    assert engine.residency("pa") == (5_990, 9_010)  # the host keeps every backed-up token
    assert step(engine, "b", "pb", 6_000, 5.0, prefix=MAIN)[:2] == (4_000, 0)
    assert engine.residency("pa") == (4_000, 9_010)  # pb took the rest of the tail


@pytest.mark.parametrize("scored", [False, True])
def test_survival_scores_order_inactive_anchors_when_typed(scored):
    engine = ReplicaEngine(PRESET, EngineMode("typed", False), 12_000, 0)
    planner, coder = SharedPrefix(3_000, anchor="Planner"), SharedPrefix(3_000, anchor="Coder")
    step(engine, "p", "p-planner", 3_500, 0.0, prefix=planner)  # older
    step(engine, "c", "p-coder", 3_500, 1.0, prefix=coder)
    engine.apply_hints({"p-planner": Hint.INACTIVE, "p-coder": Hint.INACTIVE}, 2.0)
    if scored:
        engine.apply_scores({"Planner": 0.9, "Coder": 0.1}, None, 2.0)
    step(engine, "x", "other", 8_990, 3.0)  # evicts 4_020: both 510-token tails, one anchor
    kept = "Planner" if scored else "Coder"  # with no scores, LRU keeps the newer one
    gone = "Coder" if scored else "Planner"
    assert engine.tree.anchors[kept, 3_000].dev == 3_000
    assert (gone, 3_000) not in engine.tree.anchors


def test_lru_engines_ignore_scores():
    engine = ReplicaEngine(PRESET, EngineMode("lru", False), 12_000, 0)
    step(engine, "p", "p-planner", 3_500, 0.0, prefix=SharedPrefix(3_000, anchor="Planner"))
    step(engine, "c", "p-coder", 3_500, 1.0, prefix=SharedPrefix(3_000, anchor="Coder"))
    engine.apply_scores({"Planner": 1.0}, None, 2.0)
    step(engine, "x", "other", 8_990, 3.0)
    assert ("Planner", 3_000) not in engine.tree.anchors
    assert engine.tree.anchors["Coder", 3_000].dev == 3_000


def test_warm_loads_a_host_anchor_back_and_counts_it_as_a_device_hit():
    engine = ReplicaEngine(PRESET, TYPED, 20_000, 40_000)
    step(engine, "a", "pa", 6_000, 0.0, prefix=MAIN)
    engine.apply_hints({"pa": Hint.INACTIVE}, 1.0)
    step(engine, "x", "other", 19_990, 2.0)  # pushes everything of pa off the device
    assert engine.tree.anchors["main", 4_000].dev == 0
    engine.apply_hints({"other": Hint.INACTIVE}, 10.0)
    assert engine.warm("main", 4_000, 10.0) == "loaded"
    assert engine.warm("main", 4_000, 10.0) == "resident"
    dev, host, _ = step(engine, "b", "pb", 5_000, 11.0, prefix=MAIN)
    assert (dev, host) == (4_000, 0)  # on device when matched, as SGLang counts it
    assert engine.stats["warm_loaded_tokens"] == 4_000


def test_warm_prefills_a_missing_anchor_only_when_nothing_waits():
    engine = ReplicaEngine(PRESET, TYPED, 50_000, 50_000)
    engine.submit("q", "pq", 40_000, 100, 0.0)
    engine.submit("r", "pr", 40_000, 100, 0.0)  # waits for memory
    assert engine.warm("main", 4_000, 0.001) == "busy"
    drain(engine)
    engine.apply_hints({"pq": Hint.INACTIVE, "pr": Hint.INACTIVE}, 100.0)
    assert engine.warm("main", 4_000, 100.0) == "queued"
    drain(engine)
    assert engine.stats["warm_prefill_tokens"] == 4_000
    assert step(engine, "b", "pb", 5_000, 200.0, prefix=MAIN)[:2] == (4_000, 0)


def test_warm_never_evicts_what_ranks_above_the_anchor():
    engine = ReplicaEngine(PRESET, TYPED, 10_000, 0)
    step(engine, "a", "pa", 9_000, 0.0)  # busy by default: ranks above an unused anchor
    assert engine.warm("main", 4_000, 1.0) == "queued"
    drain(engine)
    assert engine.stats["warm_prefill_tokens"] == 0
    assert engine.residency("pa") == (9_010, 0)


def test_a_partial_reuse_drops_the_stale_tail_on_both_tiers():
    engine = ReplicaEngine(PRESET, TYPED, 100_000, 100_000)
    step(engine, "a1", "p", 20_000, 0.0)
    dev, host, _ = step(engine, "a2", "p", 25_000, 5.0, reused=12_000)
    assert (dev, host) == (12_000, 0)
    assert engine.usage()["device_used_tokens"] == engine.usage()["host_used_tokens"] == 25_010
    engine.apply_hints({"p": Hint.IDLE}, 9.0)
    _, host, _ = step(engine, "a3", "p", 26_000, 10.0, reused=25_010)
    assert host == 25_010
