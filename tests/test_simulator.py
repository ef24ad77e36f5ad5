"""The discrete-event simulator on tiny traces: closed loop, gate time, determinism."""

from __future__ import annotations

from dataclasses import replace

import pytest

from router.policy import REGISTRY
from router.policy.base import Policy
from router.policy.types import Move, Placement, Tier
from router.replay.corpus import scale_program
from router.replay.trace import TraceProgram, TraceStep
from router.sim.simulator import SimConfig, Simulation


class ForwardAll(Policy):
    """Every request goes straight to r0's GPU tier (no budget): the engine decides."""

    name = "forward-all"

    def _admit(self, p, now) -> list[Move]:
        return [self.move(p, Placement(Tier.GPU, "r0"), "admit", now)]

    def _rebalance(self, now) -> list[Move]:
        return []


class TickOnly(ForwardAll):
    """Admits only on a tick, so every request waits at the gate until the next one."""

    name = "tick-only"

    def _admit(self, p, now) -> list[Move]:
        return []

    def _rebalance(self, now) -> list[Move]:
        gpu = Placement(Tier.GPU, "r0")
        return [self.move(p, gpu, "admit", now) for p in self.every_held()]


@pytest.fixture
def test_policies(monkeypatch):
    monkeypatch.setitem(REGISTRY, "forward-all", f"{__name__}:ForwardAll")
    monkeypatch.setitem(REGISTRY, "tick-only", f"{__name__}:TickOnly")


def prog(pid, steps, parent=None, start=0.0):
    return TraceProgram(pid, tuple(TraceStep(*s) for s in steps), parent, start)


TWO_STEPS = prog("a", [(2_000, 50, 0, 7.0), (2_300, 40, 2_050, 0.0)])


def run(corpus, **kw):
    kw.setdefault("start_jitter_s", 0.0)
    sim = Simulation(corpus, SimConfig(**kw))
    return sim, sim.run()


def test_closed_loop_waits_tool_s_after_each_response(test_policies):
    sim, result = run([TWO_STEPS], policy="forward-all", concurrency=1, duration_s=60)
    recs = [r for r in sim.records if r.program_id == sim.records[0].program_id]
    first, second = recs[0], recs[1]
    assert second.arrival_s == pytest.approx(first.finish_s + 7.0)
    assert second.cached_device == 2_050  # the previous context was reused from device
    # one slot: the next program instance starts right when the previous one ends
    nxt = next(r for r in sim.records if r.program_id != first.program_id)
    assert nxt.arrival_s == pytest.approx(second.finish_s)
    assert result.steps_s == pytest.approx(len(sim.records) / 60, rel=0.05)
    assert 0 < result.hit_device < 1 and result.miss > 0


def test_gate_delay_counts_in_ttft(test_policies):
    sim, result = run([TWO_STEPS], policy="tick-only", concurrency=1, duration_s=30)
    gated = sim.records[1]  # arrives mid-interval, released by the next 5 s tick
    assert gated.first_token_s >= 5 * (gated.arrival_s // 5 + 1)
    _, direct = run([TWO_STEPS], policy="forward-all", concurrency=1, duration_s=30)
    assert result.ttft_mean_s > direct.ttft_mean_s + 1.0


def test_the_hop_delays_each_request_to_its_engine_and_each_answer_back(test_policies):
    """hop_s: the engine gets a forwarded request a hop later and its client the answer a
    hop after the engine finished; so the client's step takes two hops more, and the next
    step (after the same tool call) starts two hops later."""
    direct, _ = run([TWO_STEPS], policy="forward-all", concurrency=1, duration_s=60)
    hopped, _ = run([TWO_STEPS], policy="forward-all", concurrency=1, duration_s=60, hop_s=0.25)
    for a, b in zip(direct.records[:4], hopped.records[:4], strict=True):
        assert b.first_token_s - b.arrival_s == pytest.approx(a.first_token_s - a.arrival_s + 0.5)
        assert b.finish_s - b.first_token_s == pytest.approx(a.finish_s - a.first_token_s)
    first, second = hopped.records[0], hopped.records[1]
    assert second.arrival_s == pytest.approx(first.finish_s + 7.0)  # the client's tool call
    assert second.arrival_s == pytest.approx(direct.records[1].arrival_s + 0.5)
    with pytest.raises(ValueError, match="hop_s"):
        SimConfig(hop_s=-0.1)


def test_subagents_start_after_parent_start(test_policies):
    corpus = [TWO_STEPS, prog("child", [(500, 10, 0, 0.0)], parent="a", start=3.0)]
    sim, _ = run(corpus, policy="forward-all", concurrency=1, duration_s=5)
    child = [r for r in sim.records if r.program_id.startswith("child#")]
    assert child and child[0].arrival_s == pytest.approx(3.0)


def test_deterministic_for_a_seed():
    corpus = [
        prog(f"p{i}", [(3_000 + 100 * i, 80, 0, 2.0 + i), (3_500 + 100 * i, 60, 3_000, 0.0)])
        for i in range(6)
    ]
    kw = dict(policy="mori", concurrency=4, duration_s=120, start_jitter_s=3.0)
    _, a = run(corpus, seed=1, **kw)
    _, b = run(corpus, seed=1, **kw)
    _, c = run(corpus, seed=2, **kw)
    strip = lambda r: {k: v for k, v in r.to_dict().items() if k != "sim_wall_s"}  # noqa: E731
    assert strip(a) == strip(b)
    assert strip(a) != strip(c)


@pytest.mark.parametrize("policy", ["mori", "ta", "ta+o", "smg"])
def test_every_policy_runs_under_memory_pressure(policy):
    corpus = [
        prog(
            f"p{i}", [(60_000, 200, 0, 20.0), (61_000, 200, 60_200, 1.0), (62_000, 100, 61_200, 0)]
        )
        for i in range(10)
    ]
    sim, result = run(corpus, policy=policy, concurrency=10, duration_s=300)
    assert result.steps_s > 0 and result.output_tok_s > 0
    assert 0 < result.gpu_util <= 1
    assert result.hit_device + result.hit_host + result.miss == pytest.approx(1)
    assert len({r.program_id for r in sim.records}) >= 10  # no slot starved


def test_token_scale_multiplies_tokens_and_keeps_reuse_valid():
    scaled = scale_program(TWO_STEPS, 0.5)
    assert [s.input_tokens for s in scaled.steps] == [1_000, 1_150]
    assert scaled.steps[1].reused_tokens == 1_025
    assert (
        scaled.steps[1].reused_tokens
        <= scaled.steps[0].input_tokens + scaled.steps[0].output_tokens
    )


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match="concurrency"):
        SimConfig(concurrency=0)
    with pytest.raises(ValueError, match="unknown preset"):
        SimConfig(preset="tpu")
    with pytest.raises(ValueError, match="unknown policy setting 'windw'"):
        SimConfig(policy_config={"windw": 3})
    with pytest.raises(ValueError, match="'time_scale' .the simulator's clock is the trace's"):
        SimConfig(policy_config={"time_scale": 5})  # a live router's setting
    # a value of the wrong kind or range names its knob (a window of 2.5 crashed in a
    # worker's first step; a tick of -1 left the clock standing: a hang)
    with pytest.raises(ValueError, match=r"window=2\.5: .*valid integer"):
        SimConfig(policy_config={"window": 2.5})
    with pytest.raises(ValueError, match="lease_s='soon': .*valid number"):
        SimConfig(policy_config={"lease_s": "soon"})
    with pytest.raises(ValueError, match="tick_s must be > 0 in the simulator, got -1"):
        SimConfig(policy_config={"tick_s": -1})
    assert SimConfig(policy_config={"aging_s": 60, "window": 8.0}).policy_config == {
        "aging_s": 60.0,
        "window": 8,
    }


def test_mori_sim_cli_writes_reports_and_rejects_bad_input(tmp_path, capsys):
    import json

    from router.cli import main
    from router.replay.trace import dump_trace

    trace = tmp_path / "t.jsonl"
    dump_trace(
        [prog(f"p{i}", [(5_000, 50, 0, 1.0), (5_200, 40, 5_050, 0)]) for i in range(3)], trace
    )
    scenario = tmp_path / "s.yaml"
    scenario.write_text("preset: h100-8b\nduration_s: 60\npolicies: [mori, smg]\n")
    out = tmp_path / "r" / "res.json"
    argv = ["sim", str(scenario), "--trace", str(trace), "--concurrency", "2", "--cpu-ratio", "1"]
    assert main([*argv, "--jobs", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {r["policy"] for r in doc["results"]} == {"mori", "smg"}
    assert doc["ratios"][0]["versus"] == "smg"
    assert out.with_suffix(".csv").exists() and (out.parent / "res-ttft.png").exists()
    assert "mori relative to each policy" in capsys.readouterr().out

    assert main(["sim", str(scenario)]) == 2  # no trace anywhere
    assert "no trace" in capsys.readouterr().out
    scenario.write_text("preset: h100-8b\nduraton_s: 60\n")
    assert main(["sim", str(scenario), "--trace", str(trace)]) == 2
    assert "unknown key 'duraton_s'" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["sim", str(scenario), "--policies", "mori,nope"])
    assert "unknown policy 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sim", str(scenario), "--set", "window=2.5"])
    assert "--set window=2.5: Input should be a valid integer" in capsys.readouterr().err
    scenario.write_text("preset: h100-8b\nduration_s: 60\npolicy: {tick_s: 0}\n")
    assert main(argv) == 2  # a scenario's knobs are checked as --set's are
    assert "tick_s must be > 0 in the simulator, got 0" in capsys.readouterr().out


def test_hand_overs_start_steps_when_the_steps_they_wait_for_end(test_policies):
    """`after`: a subagent's turn starts when the step that dispatched it ends, and the
    parent's next step when the turn ends, whatever the nominal times say."""
    parent = TraceProgram(
        "sup",
        (
            TraceStep(1_000, 5, 0, 50.0, "worker"),  # nominal gap 50 s: the worker's turn
            TraceStep(1_100, 5, 1_000, 0.0, after=(("sup.w", 1),)),
        ),
    )
    worker = TraceProgram(
        "sup.w",
        (
            TraceStep(2_000, 20, 0, 0.3, "python", after=(("sup", 0),)),
            TraceStep(2_400, 20, 2_020, 0.0),
        ),
        parent_id="sup",
        start_s=30.0,  # nominal; the hand-over comes much sooner
    )
    sim, _ = run([parent, worker], policy="forward-all", concurrency=1, duration_s=20)
    records = sorted(sim.records, key=lambda r: r.arrival_s)
    assert [r.program_id.split("#")[0] for r in records[:4]] == ["sup", "sup.w", "sup.w", "sup"]
    sup0, w0, w1, sup1 = records[:4]
    assert w0.arrival_s == pytest.approx(sup0.finish_s)  # dispatched at once, not at 30 s
    assert w1.arrival_s == pytest.approx(w0.finish_s + 0.3)  # its own tool call
    assert sup1.arrival_s == pytest.approx(w1.finish_s)  # not after the nominal 50 s


def test_a_forked_subagent_hits_its_parents_context(test_policies):
    parent = TraceProgram(
        "main",
        (TraceStep(9_000, 50, 0, 10.0, "Task"), TraceStep(9_500, 50, 9_050, 0.0)),
        agent="main",
        anchor_tokens=3_000,
    )
    fork = TraceProgram("main.fork", (TraceStep(8_000, 50, 0, 0.0),), parent_id="main", start_s=2.0)
    fork = replace(fork, inherit_tokens=6_000)
    sim, _ = run([parent, fork], policy="forward-all", concurrency=1, duration_s=8)
    child = next(r for r in sim.records if r.program_id.startswith("main.fork"))
    assert child.cached_device == 6_000  # the parent's first 6k tokens, stored once
    assert sim.engines["r0"].usage()["device_used_tokens"] == 9_050 + 2_050


def test_engine_tokens_count_a_step_still_decoding_at_the_end(test_policies):
    """`engine_tok_s` counts every output token the engine computed by the end, as the real
    engine's forward log does; the answered steps' `output_tok_s` misses a step cut by the
    end. One program whose only step decodes 100,000 tokens: none is answered in 30 s, yet
    the engine decoded one a iteration after its prefill."""
    long = prog("a", [(2_000, 100_000, 0, 0.0)])
    sim, result = run([long], policy="forward-all", concurrency=1, duration_s=30)
    assert result.output_tok_s == 0
    engine = next(iter(sim.engines.values()))
    first = engine.cost.prefill_s(2_000, 0) + engine.cost.forwards_s(2_000)
    iteration = engine.cost.decode_step_s(1, 2_000)
    expected = 1 + (30 - first) / iteration  # the prefill's token, then one per iteration
    assert result.extra["engine_tok_s"] * 30 == pytest.approx(expected, rel=0.05)
    done, _ = run([TWO_STEPS], policy="forward-all", concurrency=1, duration_s=60)
    answered = sum(r.output_tokens for r in done.records if r.finish_s <= 60)
    assert next(iter(done.engines.values())).generated_by(60) >= answered


def test_the_decode_batch_is_counted_apart_from_the_prefill_batch(test_policies):
    """`running_mean` counts the batch being prefilled too; `decoding_mean` the decode
    batch alone, as SGLang's `num_running_reqs` gauge does (the real-engine bench compares
    that gauge with it). One program at a time: the two differ by the share of time its
    one request spends in prefill."""
    long_prompts = prog("a", [(60_000, 200, 0, 0.0), (61_000, 200, 60_200, 0.0)])
    _, result = run([long_prompts], policy="forward-all", concurrency=1, duration_s=60)
    extra = result.extra
    assert extra["prefill_busy"] > 0.05  # the prompts take a visible share of the time
    assert extra["decoding_mean"] < extra["running_mean"]
    gap = extra["running_mean"] - extra["decoding_mean"]
    assert gap == pytest.approx(extra["prefill_busy"], abs=0.015)


def test_a_modelled_hop_is_measured_as_the_live_shell_measures_it():
    """With `hop_s` the router hears each step two hops after the engine's time for it:
    the policy's round trip to its replica comes out as those two hops, as the live
    shell's would (the gate's admission to the answer, less the engine's part); without a
    hop none is measured (the router sits in the engine)."""
    corpus = [prog(f"p{i}", [(2_000, 50, 0, 1.0), (2_300, 40, 2_050, 1.0)] * 3) for i in range(4)]
    for hop in (0.0, 0.02):
        sim, _ = run(corpus, policy="mori", concurrency=4, duration_s=60, hop_s=hop)
        trips = [prices.round_trip_s for prices in sim.policy.prices.values()]
        assert trips == pytest.approx([2 * hop], rel=0.1), trips
