"""The supervisor-style multi-agent generator reproduces CacheSage §3.1, and `mori trace`
reports R and the anchor share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.cli import main
from router.replay.generate import PRESET_DIR
from router.replay.generators import generate, load_preset
from router.replay.multiagent import HANDOFF_TOOL, SupervisorPreset
from router.replay.trace import load_trace, program_to_dict
from router.replay.trace_stats import speaker_sequences, trace_stats, transition_r

WORKLOADS = ["multiagent-mmlu", "multiagent-mtbench", "multiagent-gaia", "multiagent-gsm8k"]


def test_the_presets_are_the_four_workloads_and_the_chain():
    names = sorted(p.stem for p in PRESET_DIR.glob("multiagent-*.yaml"))
    assert names == sorted([*WORKLOADS, "multiagent-chain"])


@pytest.mark.parametrize("name", WORKLOADS)
@pytest.mark.parametrize("seed", [0, 1])
def test_workloads_match_cachesage_section_3(name, seed):
    preset = load_preset(name)
    s = trace_stats(list(generate(preset, 50, seed)), nominal=preset.nominal)
    assert 0.40 <= s.transition_r <= 0.48
    assert 0.34 <= s.anchor_share <= 0.52
    assert 950 <= s.turns <= 1_450  # 50 tasks ~ 950-1,400 turns
    assert s.agents == 6 and s.tasks == 50


def test_the_chain_is_the_high_structure_case():
    preset = load_preset("multiagent-chain")
    s = trace_stats(list(generate(preset, 50, 0)), nominal=preset.nominal)
    assert s.agents == 12
    assert s.transition_r > 0.85


def test_roles_contexts_grow_append_only_from_their_anchor():
    preset = load_preset("multiagent-gsm8k")
    programs = list(generate(preset, 20, seed=5))
    for p in programs:
        anchor = (
            preset.roles[p.agent].anchor_tokens if p.parent_id else preset.selector.anchor_tokens
        )
        assert p.anchor_tokens == anchor and p.steps[0].input_tokens > anchor
        for prev, step in zip(p.steps, p.steps[1:], strict=False):
            if p.parent_id:  # a role sees its whole previous call again
                assert step.reused_tokens == prev.input_tokens + prev.output_tokens
            else:  # the selector's answer (a name) does not join the thread
                assert step.reused_tokens == prev.input_tokens
            assert step.input_tokens > step.reused_tokens


def test_the_selector_dispatches_each_turn_to_the_role_that_speaks_next():
    preset = load_preset("multiagent-mtbench")
    programs = list(generate(preset, 10, seed=2))
    by_id = {p.program_id: p for p in programs}
    for main_program in (p for p in programs if p.parent_id is None):
        dispatched = [s.tool for s in main_program.steps[:-1]]
        assert set(dispatched) <= set(preset.roles) and main_program.steps[-1].tool_s == 0
        nominal = preset.nominal
        t = 0.0
        first_turn: dict[str, float] = {}
        for step in main_program.steps[:-1]:
            t += nominal.inference_s(step)
            first_turn.setdefault(step.tool, t)
            t += step.tool_s
        for role, start in first_turn.items():
            child = by_id[f"{main_program.program_id}.{role}"]
            assert child.start_s == pytest.approx(start, abs=0.05)
            assert child.steps[-1].tool_s == 0
            handoffs = sum(s.tool == HANDOFF_TOOL for s in child.steps)
            assert handoffs == dispatched.count(role) - 1  # one gap between two turns


def test_mix_lowers_r_and_the_same_seed_gives_the_same_corpus():
    preset = load_preset("multiagent-chain")
    noisy = preset.model_copy(update={"mix": 0.6})
    r_clean = transition_r(speaker_sequences(list(generate(preset, 30, 3))))
    r_noisy = transition_r(speaker_sequences(list(generate(noisy, 30, 3))))
    assert r_noisy < r_clean - 0.3
    again = [program_to_dict(p) for p in generate(preset, 5, 9)]
    assert again == [program_to_dict(p) for p in generate(preset, 5, 9)]


def test_r_is_zero_for_an_independent_sequence_and_one_for_a_determined_one():
    assert transition_r([["a", "b"] * 50]) == pytest.approx(1.0)
    independent = [["a", "a", "b", "b"] * 50]  # next is a or b whatever the current one
    assert transition_r(independent) == pytest.approx(0.0, abs=0.02)


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"transitions": {"A": {"Z": 1}, "B": {"A": 1}}}, "unknown role 'Z'"),
        ({"transitions": {"A": {"B": 1}}}, "no row for role 'B'"),
        ({"selector": {"name": "A", "anchor_tokens": 10}}, "also a role"),
        ({"start": {"A": 0}}, "positive sum"),
    ],
)
def test_bad_presets_name_the_problem(patch, message):
    raw = {
        "name": "x",
        "task_tokens": {"median": 100},
        "turns": {"median": 5},
        "selector": {"anchor_tokens": 10},
        "roles": {
            "A": {"anchor_tokens": 10, "output_tokens": {"median": 5}},
            "B": {"anchor_tokens": 10, "output_tokens": {"median": 5}},
        },
        "start": {"A": 1},
        "transitions": {"A": {"B": 1}, "B": {"A": 1}},
    }
    with pytest.raises(ValueError, match=message):
        SupervisorPreset.model_validate({**raw, **patch})


def test_cli_generates_a_multiagent_corpus_and_reports_r(tmp_path: Path, capsys):
    out = tmp_path / "gaia.jsonl"
    assert (
        main(
            [
                "trace",
                "generate",
                "--preset",
                "multiagent-gaia",
                "--programs",
                "8",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    programs = load_trace(out)
    assert sum(p.parent_id is None for p in programs) == 8
    capsys.readouterr()
    assert main(["trace", "stats", "--json", str(out)]) == 0
    stats = json.loads(capsys.readouterr().out)[str(out)]
    assert stats["tasks"] == 8 and 0 < stats["transition_r"] < 1
    assert main(["trace", "stats", str(out)]) == 0
    assert "next-speaker R" in capsys.readouterr().out
    # the six-role base is not a workload on its own: a clear error, no traceback
    assert main(["trace", "generate", "--preset", "supervisor-six", "--out", str(out)]) == 1
    assert "transitions" in capsys.readouterr().err
