"""Loading and validating trace files: the real sample loads, every defect is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.replay.trace import (
    TraceError,
    TraceProgram,
    TraceStep,
    dump_trace,
    load_trace,
)

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "traces" / "claude-code-sample.jsonl"


def program(pid: str = "p1", **overrides) -> dict:
    raw = {
        "program_id": pid,
        "parent_id": None,
        "start_s": 0.0,
        "agent": "main",
        "steps": [
            {"input_tokens": 1000, "output_tokens": 50, "reused_tokens": 0, "tool_s": 0.4},
            {"input_tokens": 1300, "output_tokens": 20, "reused_tokens": 1050, "tool_s": 0.0},
        ],
    }
    raw.update(overrides)
    return raw


def write(tmp_path: Path, *lines) -> Path:
    path = tmp_path / "t.jsonl"
    text = [x if isinstance(x, str) else json.dumps(x) for x in lines]
    path.write_text("\n".join(text) + "\n")
    return path


def error(tmp_path: Path, *lines) -> TraceError:
    with pytest.raises(TraceError) as info:
        load_trace(write(tmp_path, *lines))
    return info.value


def test_real_sample_loads_with_subagents():
    programs = load_trace(SAMPLE)
    assert len(programs) == 41
    ids = {p.program_id for p in programs}
    subagents = [p for p in programs if p.parent_id is not None]
    assert subagents and all(p.parent_id in ids for p in subagents)
    assert {p.agent for p in subagents} == {"Explore"}
    assert sum(len(p.steps) for p in programs) == 3083


def test_valid_file_round_trips_with_blank_lines_and_extra_fields(tmp_path):
    child = program("c1", parent_id="p1", start_s=3.5, agent="Explore", source="unit-test")
    path = write(tmp_path, program(), "", "   ", child)
    loaded = load_trace(path)
    assert loaded[1].extra == {"source": "unit-test"}
    assert loaded[1].parent_id == "p1" and loaded[1].start_s == 3.5
    assert loaded[0].steps[1] == TraceStep(1300, 20, 1050, 0.0)
    out = tmp_path / "again.jsonl"
    dump_trace(loaded, out)
    assert load_trace(out) == loaded


def test_optional_fields_take_defaults(tmp_path):
    raw = {"program_id": "x", "steps": [{"input_tokens": 10, "output_tokens": 1}]}
    (p,) = load_trace(write(tmp_path, raw))
    assert p == TraceProgram("x", (TraceStep(10, 1),))


def test_error_names_file_line_field_and_reason(tmp_path):
    bad = program("p2")
    bad["steps"][1]["reused_tokens"] = 5000
    err = error(tmp_path, program(), bad)
    assert (err.line, err.field) == (2, "steps[1].reused_tokens")
    assert "input+output = 1050" in err.reason
    assert str(err).startswith(f"{tmp_path / 't.jsonl'}:2: steps[1].reused_tokens: 5000")


@pytest.mark.parametrize(
    ("mutate", "field", "reason"),
    [
        (lambda r: r.pop("program_id"), "program_id", "required"),
        (lambda r: r.update(program_id=""), "program_id", "empty"),
        (lambda r: r.update(program_id=7), "program_id", "must be a string"),
        (lambda r: r.update(start_s=-1), "start_s", ">= 0"),
        (lambda r: r.update(steps=[]), "steps", "at least one step"),
        (lambda r: r.update(anchor_tokens=99999), "anchor_tokens", "first prompt"),
        (lambda r: r.update(parent_id="p1"), "parent_id", "own parent"),
        (lambda r: r["steps"][0].pop("input_tokens"), "steps[0].input_tokens", "missing"),
        (lambda r: r["steps"][0].update(output_tokens=-3), "steps[0].output_tokens", ">= 0"),
        (lambda r: r["steps"][0].update(output_tokens=True), "steps[0].output_tokens", "integer"),
        (lambda r: r["steps"][0].update(input_tokens=10.5), "steps[0].input_tokens", "integer"),
        (lambda r: r["steps"][0].update(tool_s=-0.1), "steps[0].tool_s", ">= 0"),
        (lambda r: r["steps"][0].update(tool_s="fast"), "steps[0].tool_s", "number"),
        (lambda r: r["steps"][0].update(reused_tokens=1), "steps[0].reused_tokens", "first step"),
        (lambda r: r["steps"][0].update(tool_sec=1.0), "steps[0].tool_sec", "unknown step field"),
        (lambda r: r["steps"][1].update(tool_s=2.0), "steps[1].tool_s", "last step"),
        (lambda r: r["steps"].__setitem__(0, 5), "steps[0]", "JSON object"),
    ],
)
def test_each_defect_is_reported(tmp_path, mutate, field, reason):
    raw = program()
    mutate(raw)
    err = error(tmp_path, raw)
    assert err.line == 1 and err.field == field
    assert reason in err.reason


def test_non_finite_numbers_are_rejected(tmp_path):
    text = json.dumps(program()).replace('"tool_s": 0.4', '"tool_s": NaN')
    err = error(tmp_path, text)
    assert err.field == "steps[0].tool_s" and "finite" in err.reason


def test_bad_json_and_non_object_lines(tmp_path):
    err = error(tmp_path, program(), '{"program_id": "p2", ')
    assert err.line == 2 and err.field is None and "invalid JSON" in err.reason
    assert "JSON object" in error(tmp_path, "[1, 2]").reason


def test_duplicate_ids_unknown_parents_and_cycles(tmp_path):
    err = error(tmp_path, program(), program("p2"), program())
    assert (err.line, err.field) == (3, "program_id") and "line 1" in err.reason
    err = error(tmp_path, program(), program("c", parent_id="ghost"))
    assert (err.line, err.field) == (2, "parent_id") and "'ghost'" in err.reason
    err = error(tmp_path, program("a", parent_id="b"), program("b", parent_id="a"))
    assert err.field == "parent_id" and "loops" in err.reason


def test_parent_may_come_after_child(tmp_path):
    loaded = load_trace(write(tmp_path, program("c", parent_id="p1"), program()))
    assert [p.program_id for p in loaded] == ["c", "p1"]


def test_empty_and_missing_files(tmp_path):
    assert "no programs" in error(tmp_path, "", "").reason
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "absent.jsonl")
