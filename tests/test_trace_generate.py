"""The Claude-Code-like generator reproduces MORI section 3, and `mori trace` works end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.cli import main
from router.replay.generate import generate, load_preset
from router.replay.trace import TraceProgram, TraceStep, load_trace, program_to_dict
from router.replay.trace_stats import Nominal, busy_phases_s, trace_stats

ROOT = Path(__file__).resolve().parents[1]
PRESET = load_preset("claude-code")


@pytest.fixture(scope="module")
def corpus() -> list[TraceProgram]:
    return list(generate(PRESET, 300, seed=11))


def test_same_seed_same_corpus_other_seed_differs():
    first = [program_to_dict(p) for p in generate(PRESET, 20, seed=3)]
    assert first == [program_to_dict(p) for p in generate(PRESET, 20, seed=3)]
    assert first != [program_to_dict(p) for p in generate(PRESET, 20, seed=4)]


def test_statistics_match_mori_section_3(corpus):
    s = trace_stats(corpus, 2.0, PRESET.nominal)
    assert s.short_call_share == pytest.approx(0.87, abs=0.02)
    assert s.long_time_share == pytest.approx(0.58, abs=0.06)
    assert s.busy_p50_s == pytest.approx(20, abs=4)
    assert s.busy_p90_s == pytest.approx(81, abs=16)
    assert 12 <= s.long_p99_s <= 40
    assert s.long_max_s >= 60  # a tail to minutes (subagents)
    assert 20 <= s.steps_p50 <= 80  # tens of steps
    assert 20_000 <= s.peak_context_p50 <= PRESET.max_context_tokens
    assert s.subagents >= 3


def test_contexts_grow_append_only_with_rare_compaction(corpus):
    compactions = steps = 0
    for program in corpus:
        anchor = (PRESET.subagents.get(program.agent) or PRESET.main).anchor_tokens
        for prev, step in zip(program.steps, program.steps[1:], strict=False):
            steps += 1
            if step.reused_tokens == prev.input_tokens + prev.output_tokens:
                assert step.input_tokens > step.reused_tokens
            else:
                compactions += 1
                assert step.reused_tokens == anchor and step.input_tokens < prev.input_tokens
    assert 0 < compactions < 0.05 * steps


def test_tools_sit_on_their_side_of_the_threshold(corpus):
    calls = [s for p in corpus for s in p.steps[:-1]]
    for name in ("Read", "Edit", "Grep", "Glob", "TodoWrite", "Write"):
        durations = [s.tool_s for s in calls if s.tool == name]
        assert durations and max(durations) < 2.0, name
    for name in ("WebFetch", "WebSearch", "Task"):
        durations = [s.tool_s for s in calls if s.tool == name]
        assert durations and min(durations) >= 2.0, name
    assert all(p.steps[-1].tool is None and p.steps[-1].tool_s == 0 for p in corpus)


def test_parents_wait_for_their_subagents(corpus):
    by_id = {p.program_id: p for p in corpus}
    nominal = PRESET.nominal
    children = [p for p in corpus if p.parent_id is not None]
    assert {c.agent for c in children} <= set(PRESET.subagents)
    for parent in (by_id[pid] for pid in {c.parent_id for c in children}):
        assert parent.parent_id is None  # no nested subagents
        elapsed = 0.0
        for step in parent.steps:
            elapsed += nominal.inference_s(step)
            if step.tool == "Task":
                kids = [c for c in children if c.parent_id == parent.program_id]
                started = [k for k in kids if k.start_s == pytest.approx(elapsed, abs=0.01)]
                assert started, "each Task step starts its subagents when its response ends"
                longest = max(nominal.lifetime_s(k) for k in started)
                assert step.tool_s == pytest.approx(longest + PRESET.spawn_overhead_s, abs=0.01)
            elapsed += step.tool_s


def test_busy_phase_spans_the_steps_around_a_run_of_short_calls():
    nominal = Nominal(ttft_s=1.0, decode_tok_s=100.0)  # every step below: 1 s + 100/100 = 2 s
    gaps = [0.5, 0.5, 30.0, 1.0, 0.0]  # run of 2 calls, a long call, a run reaching the end
    steps = [TraceStep(1000, 100, 0, g) for g in gaps]
    program = TraceProgram("p", tuple(steps))
    assert busy_phases_s(program, 2.0, nominal) == [3 * 2.0 + 1.0, 2 * 2.0 + 1.0]


@pytest.mark.parametrize("preset", ["claude-code", "claude-code-32k"])
def test_committed_corpus_is_what_the_preset_generates(preset):
    committed = load_trace(ROOT / "traces" / f"generated-{preset}.jsonl")
    assert committed == list(generate(load_preset(preset), 200, seed=7))


def test_preset_inherits_from_its_base():
    small = load_preset("claude-code-32k")
    assert small.max_context_tokens == 32000 and small.main.anchor_tokens == 4000
    assert small.main.steps == PRESET.main.steps  # merged key by key from the base
    assert small.busy_tools == PRESET.busy_tools
    peaks = [max(s.input_tokens for s in p.steps) for p in generate(small, 50, seed=1)]
    assert max(peaks) <= small.max_context_tokens


def test_cli_generate_validate_stats(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps cells to the terminal width
    out = tmp_path / "g.jsonl"
    assert main(["trace", "generate", "--programs", "12", "--seed", "5", "--out", str(out)]) == 0
    assert load_trace(out) == list(generate(PRESET, 12, seed=5))
    assert main(["trace", "validate", str(out)]) == 0
    assert f"{len(load_trace(out))} programs" in capsys.readouterr().out
    assert main(["trace", "stats", "--json", str(out)]) == 0
    stats = json.loads(capsys.readouterr().out)[str(out)]
    assert stats["programs"] == len(load_trace(out)) and 0 < stats["short_call_share"] < 1
    assert (
        main(["trace", "stats", str(out), str(ROOT / "traces" / "claude-code-sample.jsonl")]) == 0
    )
    table = capsys.readouterr().out
    assert "busy phase p90" in table and "claude-code-sample.jsonl" in table


def test_cli_reports_bad_input_without_a_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"program_id": "a", "steps": [{"input_tokens": 5, "output_tokens": -1}]}\n')
    assert main(["trace", "validate", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:1: steps[0].output_tokens: must be >= 0, got -1" in err
    assert "Traceback" not in err
    preset = tmp_path / "p.yaml"
    preset.write_text("name: x\nbusy_calls: {median: 0}\n")
    assert main(["trace", "generate", "--preset", str(preset), "--out", str(bad)]) == 1
    assert "busy_calls.median" in capsys.readouterr().err
    assert main(["trace", "generate", "--preset", "nope", "--out", str(bad)]) == 1
    assert "claude-code" in capsys.readouterr().err
