"""The replica cost model: eviction orders, load-back vs recompute, batching, queueing, hints."""

from __future__ import annotations

import pytest

from router.policy.types import EngineMode, Hint
from router.presets import PRESETS, get_preset
from router.sim.model import CostModel, Done, FirstToken, ReplicaEngine

PRESET = get_preset("h100-8b")
TYPED = EngineMode("typed", True)
LRU = EngineMode("lru", True)


def drain(engine: ReplicaEngine, until: float = float("inf")) -> tuple[list, float]:
    """Run the engine until it has nothing scheduled (or `until`); events and last time."""
    events, t = [], 0.0
    while (nt := engine.next_event_time()) is not None and nt <= until:
        events += engine.advance(nt)
        t = nt
    return events, t


def run_step(engine, rid, pid, tokens, now, output=10):
    engine.submit(rid, pid, tokens, output, now)
    events, t = drain(engine)
    first = next(e for e in events if isinstance(e, FirstToken) and e.rid == rid)
    return first, t


def test_presets_derive_kv_bytes_and_budget():
    assert PRESET.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert 400_000 < PRESET.gpu_kv_tokens < 500_000
    for preset in PRESETS.values():
        assert preset.gpu_kv_tokens > 100_000
        assert preset.host_kv_tokens(2) == 2 * preset.gpu_kv_tokens
    with pytest.raises(ValueError, match="known: h100-8b"):
        get_preset("nope")


def test_host_load_back_is_cheaper_than_recompute():
    cost = CostModel(PRESET)
    assert cost.load_s(50_000) * 5 < cost.prefill_s(50_000, 0)
    # and the engine shows it: a host hit makes the first token come sooner than a miss
    host = ReplicaEngine(PRESET, TYPED, 100_000, 100_000)
    run_step(host, "a", "p", 40_000, 0.0)
    host.apply_hints({"p": Hint.IDLE}, 10.0)
    assert host.residency("p") == (0, 40_010)
    first, _ = run_step(host, "b", "p", 40_100, 10.0)
    assert (first.cached_device, first.cached_host) == (0, 40_010)
    miss = ReplicaEngine(PRESET, EngineMode("lru", False), 100_000, 0)
    first_miss, _ = run_step(miss, "b", "p", 40_100, 10.0)
    assert first_miss.cached_host == first_miss.cached_device == 0
    assert (first.t - 10.0) * 5 < first_miss.t - 10.0


def test_decode_slows_with_batch_and_context():
    cost = CostModel(PRESET)
    assert cost.decode_step_s(64, 200_000) > cost.decode_step_s(8, 200_000)
    assert cost.decode_step_s(8, 400_000) > cost.decode_step_s(8, 50_000)
    moe = CostModel(get_preset("h200-30b-moe"))  # more experts touched by a bigger batch
    assert moe.decode_step_s(32, 0) > moe.decode_step_s(1, 0)


def test_batched_decode_takes_longer_per_request_than_alone():
    alone = ReplicaEngine(PRESET, TYPED, 400_000, 0)
    events, t_alone = drain_after(alone, [("r0", "p0")])
    crowd = ReplicaEngine(PRESET, TYPED, 400_000, 0)
    events, t_crowd = drain_after(crowd, [(f"r{i}", f"p{i}") for i in range(32)])
    assert sum(isinstance(e, Done) for e in events) == 32
    assert t_crowd > t_alone


def drain_after(engine, reqs):
    for rid, pid in reqs:
        engine.submit(rid, pid, 8_000, 200, 0.0)
    return drain(engine)


def test_a_request_submitted_mid_decode_joins_the_next_iteration():
    """SGLang's scheduler looks at its waiting queue every iteration: a request that fits
    is prefilled at the next iteration boundary, not after the running batch's whole decode
    run (live, a program's busy hint reaches the emulator before its request, so nothing
    else interrupts the run)."""
    engine = ReplicaEngine(PRESET, TYPED, 400_000, 0)
    engine.submit("a", "pa", 8_000, 2_000, 0.0)  # a long decode run
    events, t = drain(engine, until=1.0)
    assert any(isinstance(e, FirstToken) and e.rid == "a" for e in events)
    step = engine.cost.decode_step_s(1, 8_000 + 2_000)
    engine.submit("b", "pb", 1_000, 10, t + 0.001)
    nxt = engine.next_event_time()
    assert nxt is not None and nxt <= t + 0.001 + 2 * step  # the run ends at the next boundary
    events, _ = drain(engine)
    first_b = next(e.t for e in events if isinstance(e, FirstToken) and e.rid == "b")
    done_a = next(e.t for e in events if isinstance(e, Done) and e.rid == "a")
    assert first_b < t + 0.5 < done_a


def test_requests_queue_when_kv_does_not_fit():
    engine = ReplicaEngine(PRESET, TYPED, 30_000, 0)
    engine.submit("a", "pa", 20_000, 500, 0.0)
    engine.submit("b", "pb", 20_000, 500, 0.0)  # cannot fit next to a's reserved context
    assert engine.usage()["queued"] == 1
    events, _ = drain(engine)
    done_a = next(e.t for e in events if isinstance(e, Done) and e.rid == "a")
    first_b = next(e.t for e in events if isinstance(e, FirstToken) and e.rid == "b")
    assert first_b > done_a  # b waited inside the engine until a freed its KV
    assert engine.usage()["queued"] == 0


def test_request_larger_than_device_fails_cleanly():
    engine = ReplicaEngine(PRESET, TYPED, 10_000, 0)
    engine.submit("big", "p", 20_000, 10, 1.0)
    assert engine.advance(1.0) == [Done("big", 1.0, ok=False)]


def _fill(engine, pids, size=20_000):
    t = 0.0
    for i, pid in enumerate(pids):
        _, t = run_step(engine, f"r{i}", pid, size, t + 1.0)
    return t


def test_lru_evicts_least_recent_first():
    engine = ReplicaEngine(PRESET, EngineMode("lru", False), 62_000, 0)
    t = _fill(engine, ["old", "mid", "new"])  # 3 x 20_010 tokens on device
    run_step(engine, "x", "other", 15_000, t + 1.0)
    assert engine.residency("old")[0] < 20_010
    assert engine.residency("mid")[0] == engine.residency("new")[0] == 20_010


def test_typed_eviction_order_on_device_and_host():
    engine = ReplicaEngine(PRESET, TYPED, 62_000, 45_000)
    t = _fill(engine, ["busy", "idle", "gone"])
    # hints arrive while everything is still on device; typed ranks ignore recency
    engine.apply_hints({"busy": Hint.BUSY, "gone": Hint.INACTIVE}, t)
    run_step(engine, "x", "other", 15_000, t + 1.0)
    assert engine.residency("gone")[0] < 20_010  # inactive went first on device
    assert engine.residency("busy")[0] == 20_010
    engine.apply_hints({"idle": Hint.IDLE}, t + 5)  # idle: device copy dropped, host kept
    dev, host = engine.residency("idle")
    assert dev == 0 and host == 20_010


@pytest.mark.parametrize("mode", [TYPED, LRU])
def test_host_keeps_backups_of_tokens_still_on_device(mode):
    """HiRadixCache.evict_host skips nodes still on device: with every host token backing a
    device copy, a new write-through is refused (partly) instead of evicting one."""
    engine = ReplicaEngine(PRESET, mode, 100_000, 41_000)
    _fill(engine, ["a", "b"])  # both on device and on host: 40_020 of 41_000 host tokens
    run_step(engine, "x", "third", 20_000, 10.0)
    assert engine.residency("a") == engine.residency("b") == (20_010, 20_010)
    assert engine.residency("third") == (20_010, 41_000 - 40_020)  # backup refused past that


def test_idle_keeps_a_device_copy_whose_backup_was_refused():
    engine = ReplicaEngine(PRESET, TYPED, 100_000, 41_000)
    _fill(engine, ["a", "b"])
    run_step(engine, "x", "third", 20_000, 10.0)  # backed up 980 of 20_010 tokens
    engine.apply_hints({"third": Hint.IDLE}, 20.0)
    assert engine.residency("third") == (20_010, 980)  # offloading would lose 19_030 tokens


@pytest.mark.parametrize("mode", [TYPED, LRU])
def test_host_copy_becomes_evictable_once_device_copy_is_gone(mode):
    engine = ReplicaEngine(PRESET, mode, 50_000, 45_000)
    t = _fill(engine, ["old", "new"])
    run_step(engine, "x", "third", 20_000, t + 1.0)  # device evicts 10_030 of "old" (LRU)
    # ...whose host copy of those tokens is now host-only: the third program's backup takes it
    assert engine.residency("old") == (9_980, 9_980)
    assert engine.residency("new") == (20_010, 20_010)
    assert engine.residency("third") == (20_010, 45_000 - 20_010 - 9_980)


def test_host_evicts_idle_only_copies_before_busy_ones_when_typed():
    """Both tiers rank inactive, idle, busy: a host victim is always a program's only copy,
    and a busy program's is the one it needs next (not the paper's host order)."""
    engine = ReplicaEngine(PRESET, TYPED, 50_000, 60_000)
    t = _fill(engine, ["busy", "idle"])  # busy is the least recent one
    engine.apply_hints({"busy": Hint.BUSY, "idle": Hint.IDLE}, t)  # idle: host-only copy
    run_step(engine, "x", "third", 35_000, t + 1.0)  # device evicts 5_020 of busy's tokens
    # third's write-through needs 15_030 host tokens: host-only ones, idle's go first
    assert engine.residency("busy") == (14_990, 20_010)
    assert engine.residency("idle") == (0, 20_010 - 15_030)


def test_lru_ignores_hints_but_reports_residency():
    engine = ReplicaEngine(PRESET, LRU, 100_000, 100_000)
    _fill(engine, ["p"])
    assert engine.apply_hints({"p": Hint.IDLE}, 100.0) == {"p": (20_010, 20_010)}


def test_busy_hint_loads_back_and_its_tokens_count_as_device_hits():
    engine = ReplicaEngine(PRESET, TYPED, 100_000, 100_000)
    t = _fill(engine, ["p"])
    engine.apply_hints({"p": Hint.IDLE}, t + 1)
    assert engine.residency("p") == (0, 20_010)
    engine.apply_hints({"p": Hint.BUSY}, t + 2)
    assert engine.residency("p") == (20_010, 20_010)
    first, _ = run_step(engine, "next", "p", 20_100, t + 2.0001)
    # on device when matched, as SGLang counts a loaded-back node; still waits for the copy
    assert (first.cached_device, first.cached_host) == (20_010, 0)
    assert first.t >= t + 2 + engine.cost.load_s(20_010)


def test_a_swap_loads_back_into_the_room_its_offload_frees():
    """One batch lets "in" onto the device and "out" off it. The engine offloads first, so
    the load-back finds the room and "in"'s next request hits device; in the batch's own
    order ("in" first) the load-back would fail on a full device and load with the request."""
    engine = ReplicaEngine(PRESET, TYPED, 50_000, 100_000)
    t = _fill(engine, ["in", "out"])
    engine.apply_hints({"in": Hint.IDLE}, t + 1)
    run_step(engine, "x", "third", 25_000, t + 2)  # 45_020 of 50_000 device tokens held
    assert engine.residency("in") == (0, 20_010)
    engine.apply_hints({"in": Hint.BUSY, "out": Hint.IDLE}, t + 10)
    assert engine.residency("out") == (0, 20_010)
    assert engine.residency("in") == (20_010, 20_010)


def test_generated_streams_and_abort_frees_the_lock():
    engine = ReplicaEngine(PRESET, TYPED, 100_000, 0)
    engine.submit("r", "p", 1_000, 1_000, 0.0)
    first = next(e for e in drain(engine, until=0.5)[0] if isinstance(e, FirstToken))
    mid = first.t + 0.3
    engine.advance(mid)
    produced = engine.generated("r", mid)
    assert 1 < produced < 1_000
    engine.abort("r", mid)
    events, _ = drain(engine)
    assert not any(isinstance(e, Done) for e in events)
    assert engine.usage()["device_active_tokens"] == 0
    assert 1_000 < engine.residency("p")[0] < 2_000


def test_events_are_buffered_across_calls():
    engine = ReplicaEngine(PRESET, TYPED, 100_000, 0)
    engine.submit("a", "pa", 1_000, 1, 0.0)
    engine.submit("b", "pb", 1_000, 1, 100.0)  # runs the engine past a's completion first
    events = engine.advance(100.0)
    assert [type(e).__name__ for e in events] == ["FirstToken", "Done"]
    assert all(e.rid == "a" for e in events)


def test_abort_mid_prefill_frees_the_engine_at_the_next_chunk():
    """A client that leaves during a 333k-token prompt's prefill (70 s on an H100-8B): the
    engine stops at the end of the current 8192-token chunk, as SGLang's chunked prefill
    checks for aborts, and the next request starts then, not when the prompt is done."""
    engine = ReplicaEngine(PRESET, TYPED, PRESET.gpu_kv_tokens, 0)
    engine.submit("long", "big", 333_000, 10, 0.0)
    assert engine.next_event_time() > 60
    engine.abort("long", 1.0)
    chunk_s = engine.cost.prefill_s(PRESET.chunk_tokens, 0)
    assert engine.next_event_time() <= chunk_s * 4  # the chunk under way when it was aborted
    engine.submit("small", "other", 100, 1, 1.0)
    events, _ = drain(engine)
    first = next(e for e in events if isinstance(e, FirstToken))
    assert first.rid == "small" and first.t < 2.0
    assert not any(e.rid == "long" for e in events)
    assert engine.usage()["device_active_tokens"] == 0
    assert engine.stats["prefill_s"] < 3.0  # the abandoned chunks were never computed


def test_abort_of_one_prompt_moves_the_rest_of_its_batch_up():
    """Two prompts queued behind a running prefill enter one batch, a's compute first; a
    leaves early: b's compute starts at the end of a's current chunk."""
    engine = ReplicaEngine(PRESET, TYPED, PRESET.gpu_kv_tokens, 0)
    engine.submit("x", "px", 1_000, 5, 0.0)
    engine.submit("a", "pa", 100_000, 2, 0.001)  # both wait for x's prefill, then go together
    engine.submit("b", "pb", 20_000, 2, 0.001)
    start = engine.next_event_time()  # x's prefill ends, the batch [a, b] starts
    engine.advance(start)
    whole = engine.next_event_time() - start
    engine.abort("a", start + 0.1)
    events, _ = drain(engine)
    first_b = next(e for e in events if isinstance(e, FirstToken) and e.rid == "b")
    b_alone = engine.cost.prefill_s(20_000, 0)
    assert whole > 5 * b_alone  # a's 100k tokens dominate the batch
    assert first_b.t < start + 0.1 + engine.cost.prefill_s(PRESET.chunk_tokens, 0) + b_alone
