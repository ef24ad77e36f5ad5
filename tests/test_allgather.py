"""All-Gather rounds in the simulator (issue 23): the generator's layouts, the trace format's
named blocks, the segment index's exact sharing, approximate reuse as a model, and the
round metrics every report carries."""

from __future__ import annotations

import pytest

from router.policy.types import EngineMode, Segment
from router.presets import get_preset
from router.replay.allgather import GATHER_TOOL
from router.replay.corpus import scale_program
from router.replay.generate import Dist
from router.replay.generators import generate, load_preset
from router.replay.records import StepRecord, round_latencies
from router.replay.trace import TraceError, dump_trace, load_trace, parse_lines
from router.sim.approx import ApproxReuse, ApproxStore
from router.sim.model import FirstToken, ReplicaEngine, SharedPrefix
from router.sim.segments import PromptBlocks
from router.sim.simulator import SimConfig, simulate

PRESET = get_preset("a100-qwen14b")


def small(layout: str = "history_first", agents: int = 3):
    return load_preset("allgather-genagents").model_copy(
        update={"layout": layout, "agents": agents, "rounds": Dist(median=4)}
    )


def test_a_round_waits_for_every_agent_and_gathers_the_others_answers():
    programs = list(generate(small(), 1, 0))
    assert [p.parent_id for p in programs] == [None, "s0-t0000", "s0-t0000"]
    a0 = programs[0]
    step = a0.steps[2]
    assert step.round == "r2" and a0.steps[1].tool == GATHER_TOOL
    assert set(step.after) == {(p.program_id, 1) for p in programs}  # the barrier
    # history first: the whole last context, then its answer, the others', the task
    assert step.reused_tokens == a0.steps[1].input_tokens + a0.steps[1].output_tokens
    ids = [sid for sid, _ in step.segments]
    assert ids == ["answer/0/1", "answer/1/1", "answer/2/1", "task/2"]
    assert step.segments_kept == 3 + 4  # round 0: system, persona, task; round 1: 4 more
    other = programs[1].steps[2]
    assert [sid for sid, _ in other.segments][:3] == ["answer/1/1", "answer/2/1", "answer/0/1"]


def test_shared_first_is_the_same_workload_laid_out_for_a_prefix_cache():
    history = list(generate(small(), 2, 5))
    shared = list(generate(small("shared_first"), 2, 5))
    for h, s in zip(history, shared, strict=True):
        assert [x.output_tokens for x in h.steps] == [x.output_tokens for x in s.steps]
        assert [x.input_tokens for x in h.steps][0] == [x.input_tokens for x in s.steps][0]
    first = shared[0].steps[3]
    ids = [sid for sid, _ in first.segments]
    assert ids[:3] == ["answer/0/2", "answer/1/2", "answer/2/2"]  # one order for all
    assert ids[-1] == "persona/0"  # the private part comes last
    # every agent's round-3 prompt starts with the same blocks up to the task
    blocks = PromptBlocks()
    heads = []
    for p in shared[:3]:
        for step in p.steps[:4]:
            segs = blocks.advance(p.program_id, p, step, "task")
        heads.append([s.chain for s in segs[:-1]])
    assert heads[0] == heads[1] == heads[2]


def test_named_blocks_round_trip_and_bad_ones_are_refused(tmp_path):
    programs = list(generate(small(), 1, 0))
    path = tmp_path / "ag.jsonl"
    dump_trace(programs, path)
    assert load_trace(path) == programs
    bad = '{"program_id": "p", "steps": [{"input_tokens": 10, "output_tokens": 1, '
    with pytest.raises(TraceError, match="segments.*> input_tokens"):
        parse_lines([bad + '"segments": [["a", 8], ["b", 8]]}]}'])
    with pytest.raises(TraceError, match="segments_kept"):
        parse_lines([bad + '"segments_kept": 2}]}'])
    with pytest.raises(TraceError, match=r"\[id, tokens >= 1\]"):
        parse_lines([bad + '"segments": [["a", 0]]}]}'])


def test_scaling_keeps_named_blocks_inside_the_prompt():
    program = list(generate(small(), 1, 0))[0]
    half = scale_program(program, 0.5)
    blocks = PromptBlocks()
    for step in half.steps:
        segs = blocks.advance("p", half, step, "t")
        assert sum(s.tokens for s in segs) <= step.input_tokens


def run(engine, rid, pid, tokens, now, prefix, reused=None) -> tuple[int, int]:
    engine.submit(rid, pid, tokens, 10, now, reused_tokens=reused, prefix=prefix)
    events = []
    while (t := engine.next_event_time()) is not None:
        events += engine.advance(t)
    first = next(e for e in events if isinstance(e, FirstToken) and e.rid == rid)
    return first.cached_device, first.cached_host


def chain(*blocks: tuple[str, int]) -> SharedPrefix:
    segs = PromptBlocks()

    class P:  # the parts of a trace program PromptBlocks reads
        anchor_tokens = inherit_tokens = 0
        agent = None

    class S:
        segments = blocks
        segments_kept = 0
        input_tokens = sum(n for _, n in blocks)

    segs.advance("x", P, S, "task")
    return SharedPrefix(0, chain=segs.chain("x"))


def test_a_prefix_another_program_computed_is_found_by_its_blocks():
    engine = ReplicaEngine(PRESET, EngineMode("typed", True), 100_000, 100_000)
    assert run(engine, "a", "pa", 5_000, 0.0, chain(("sys", 1000), ("o1", 2000), ("pa", 2000))) == (
        0,
        0,
    )
    # another program, its own context empty: the common blocks are hit on device
    hit = run(engine, "b", "pb", 5_500, 5.0, chain(("sys", 1000), ("o1", 2000), ("pb", 2500)))
    assert hit == (3_000, 0)
    # stored once: one shared prefix, two private tails (plus their answers)
    assert engine.usage()["device_used_tokens"] == 3_000 + 2_010 + 2_510
    # a longer shared prefix beats a program's own shorter reuse (shared first: the round's
    # new answers come before the private tail)
    hit = run(
        engine, "a2", "pa", 6_000, 9.0,
        chain(("sys", 1000), ("o1", 2000), ("pb", 2500), ("tail", 500)), reused=3_000,
    )  # fmt: skip
    assert hit[0] == 5_500


def test_approximate_reuse_stores_and_prefills_less_and_is_modelled():
    reuse = ApproxReuse()
    store = ApproxStore(reuse, restore_s_per_token=1e-6)
    blocks = (Segment("c1", "hist/a", 1000), Segment("c2", "answer/b", 400))
    assert store.forward("a", "r0", blocks, 1400, 0) == (1400, 0, 0, 0)  # nobody holds it yet
    other = (Segment("d1", "hist/b", 800), Segment("d2", "answer/b", 400))
    store.arrive("b", other, 0)
    prompt, reused, recompute, restored = store.forward("b", "r0", other, 1200, 800)
    stored = round(400 * reuse.diff_share)
    assert prompt == 1200 - (400 - stored) and reused == 800
    assert recompute == round(400 * reuse.recompute_share) - stored
    assert restored == 400 and store.restore_s(restored) == pytest.approx(400e-6)
    # on another replica nothing is held: the full prompt
    assert store.forward("c", "r1", other, 1200, 0)[0] == 1200
    with pytest.raises(ValueError):
        ApproxReuse(diff_share=0.0)


def test_round_latency_counts_complete_rounds_only():
    def rec(pid, rnd, a, f):
        return StepRecord(pid, "r0", a, a + 0.1, f, 10, 1, session="t", round=rnd)

    records = [rec("x", "t/r0", 0.0, 2.0), rec("y", "t/r0", 0.5, 3.0), rec("x", "t/r1", 3.0, 4.0)]
    assert round_latencies(records) == [3.0]  # r1 lacks an agent: cut by the run's end


def test_every_report_carries_round_latency_and_kv_per_agent():
    corpus = list(generate(small(agents=4), 4, 0))
    exact = simulate(
        corpus, SimConfig(policy="mori", preset="a100-qwen14b", concurrency=2, duration_s=120)
    )
    approx = simulate(
        corpus,
        SimConfig(
            policy="mori",
            preset="a100-qwen14b",
            concurrency=2,
            duration_s=120,
            approx=ApproxReuse(),
        ),
    )
    for r in (exact, approx):
        assert r.rounds_done > 0 and 0 < r.round_latency_mean_s <= r.round_latency_p99_s
        assert r.kv_tokens_per_agent > 0
    assert approx.kv_tokens_per_agent < exact.kv_tokens_per_agent
    assert approx.extra["approx_mirrored_tokens"] > 0 and "approx_diff_share" not in exact.extra


def test_a_live_replay_renders_a_block_as_the_same_text_in_every_prompt():
    from router.replay.prompts import Conversation, count_tokens, render_chat

    a, b = Conversation("a", seed=1), Conversation("b", seed=1)
    shared = [("t/@sys", 40), ("t/answer/0/0", 12)]
    ma = a.next_messages(70, 0, [*shared, ("t/persona/a", 10)])
    mb = b.next_messages(90, 0, [*shared, ("t/persona/b", 30)])
    assert ma[:2] == mb[:2] and ma[2] != mb[2]  # the same blocks, then private text
    assert count_tokens(render_chat(ma)) == 70 and count_tokens(render_chat(mb)) == 90
    a.record_answer("x " * 8)  # the next prompt: the whole history, then one more block
    more = a.next_messages(100, 74, [*shared, ("t/persona/a", 10), ("t/answer/1/0", 20)])
    assert more[: len(ma) + 1] == [*ma, {"role": "assistant", "content": "x " * 8}]
