"""Tool-call duration predictor (Tokencake 4.1): cold start, EWMA, equation 1, tool keys."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.policy.predictor import (
    COLD_START_S,
    DurationPredictor,
    shell_first_word,
    tool_key,
    tool_key_of_calls,
    tool_kind,
)


def openai_call(name: str, **arguments) -> dict:
    return {
        "id": "call_1",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def test_cold_start_orders_kinds():
    p = DurationPredictor()
    read, bash, task = p.predict("main", "Read"), p.predict("main", "Bash"), p.predict("m", "Task")
    assert read < 1.0 < bash < task
    assert p.predict("main", "human") == COLD_START_S["human"]
    assert p.predict("main", "SomethingNew") == COLD_START_S["unknown"]
    assert (
        p.predict("main", "Bash:ls") < p.predict("main", "Bash") < p.predict("main", "Bash:pytest")
    )


def test_first_observation_replaces_cold_start_then_ewma():
    p = DurationPredictor(ewma_alpha=0.5)
    p.observe("main", "Bash:pytest", 10.0)
    assert p.predict("main", "Bash:pytest") == 10.0
    p.observe("main", "Bash:pytest", 20.0)
    assert p.predict("main", "Bash:pytest") == pytest.approx(15.0)


def test_ewma_converges_to_a_new_level():
    p = DurationPredictor(ewma_alpha=0.3)
    for _ in range(5):
        p.observe("main", "Grep", 0.2)
    for _ in range(30):
        p.observe("main", "Grep", 4.0)
    assert p.predict("main", "Grep") == pytest.approx(4.0, rel=1e-3)


def test_history_falls_back_from_role_to_tool_to_base_name():
    p = DurationPredictor()
    p.observe("explorer", "Bash:pytest", 40.0)
    assert p.predict("explorer", "Bash:pytest") == 40.0
    assert p.predict("main", "Bash:pytest") == 40.0  # any role's history for the key
    assert p.predict("main", "Bash:cargo") == 40.0  # base tool "Bash" history
    p.observe("main", "Bash:pytest", 2.0)
    assert p.predict("main", "Bash:pytest") == 2.0
    assert p.predict("explorer", "Bash:pytest") == 40.0  # roles stay separate


def test_hint_is_blended_by_equation_1():
    p = DurationPredictor(hint_alpha=0.25)
    p.observe("main", "Bash", 8.0)
    assert p.predict("main", "Bash", hint_s=40.0) == pytest.approx(0.25 * 40.0 + 0.75 * 8.0)
    assert p.predict("main", "Bash", hint_s=None) == 8.0
    full = DurationPredictor(hint_alpha=1.0)
    assert full.predict("main", "Read", hint_s=12.0) == 12.0


@given(
    hist=st.floats(0.0, 1e4),
    hint=st.floats(0.0, 1e4),
    alpha=st.floats(0.0, 1.0),
)
def test_blend_lies_between_hint_and_history(hist, hint, alpha):
    p = DurationPredictor(hint_alpha=alpha)
    p.observe(None, "X", hist)
    got = p.predict(None, "X", hint_s=hint)
    assert min(hist, hint) - 1e-6 <= got <= max(hist, hint) + 1e-6


def test_bad_parameters_are_rejected():
    with pytest.raises(ValueError):
        DurationPredictor(ewma_alpha=0.0)
    with pytest.raises(ValueError):
        DurationPredictor(hint_alpha=1.5)


@pytest.mark.parametrize(
    ("command", "word"),
    [
        ("pytest -q tests", "pytest"),
        ("cd /repo && FOO=1 timeout 60 python -m pytest -x", "pytest"),
        ("/usr/bin/ls -la", "ls"),
        ("sudo apt-get install -y jq", "apt-get"),
        (["git", "status"], "git"),
        ("cd somewhere", None),
        ('echo "unbalanced', "echo"),
    ],
)
def test_shell_first_word(command, word):
    assert shell_first_word(command) == word


def test_tool_key_from_openai_and_anthropic_calls():
    assert tool_key(openai_call("Bash", command="npm test")) == "Bash:npm"
    assert tool_key(openai_call("Read", file_path="a.py")) == "Read"
    assert tool_key({"type": "tool_use", "name": "Bash", "input": {"command": "ls"}}) == "Bash:ls"
    bad_json = {"type": "function", "function": {"name": "Bash", "arguments": "{not json"}}
    assert tool_key(bad_json) == "Bash"
    assert tool_key({"type": "function", "function": {}}) == "unknown"


def test_parallel_calls_take_the_longest_kind_and_no_calls_mean_human():
    calls = [openai_call("Read", file_path="a"), openai_call("Task", prompt="x")]
    assert tool_key_of_calls(calls) == "Task"
    assert tool_key_of_calls([]) == "human"
    assert tool_key_of_calls(None) == "human"


def test_tool_kind():
    assert tool_kind("Read") == "file"
    assert tool_kind("Bash:pytest") == "shell_long"
    assert tool_kind("Bash:ls") == "shell_fast"
    assert tool_kind("Bash:weird") == "shell"
    assert tool_kind("Task") == "subagent"
    assert tool_kind("human") == "human"
    assert tool_kind("unknown") == "unknown"
    assert tool_kind("pytest") == "shell_long"  # a bare command word (router labels)
    assert tool_kind("cat") == "shell_fast"


def test_error_stats_per_kind():
    p = DurationPredictor()
    for actual in (1.0, 2.0, 3.0, 4.0, 10.0):
        p.observe("main", "Bash:make", actual, predicted_s=2.0)
    p.observe("main", "Read", 0.05, predicted_s=0.5)
    p.observe("main", "Read", 0.5)  # not scored: no prediction given
    stats = p.error_stats()
    assert set(stats) == {"shell_long", "file"}
    shell = stats["shell_long"]
    assert shell.n == 5
    assert shell.abs_p50_s == 1.0  # errors 1, 0, 1, 2, 8
    assert shell.abs_p90_s == 8.0
    assert shell.rel_p50 == pytest.approx(0.5)  # rel errors 1, 0, 1/3, 1/2, 8/10
    assert shell.rel_p90 == pytest.approx(1.0)
    assert shell.mean_actual_s == pytest.approx(4.0)
    assert stats["file"].rel_p50 == pytest.approx(0.45 / 0.1)  # actual floored at 0.1 s
