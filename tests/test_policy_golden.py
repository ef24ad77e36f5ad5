"""Every registered policy makes the moves its golden trace recorded, call for call.

The traces and the driver are in `tests/policy_golden.py`; a change meant to keep the
policies' behaviour (a refactor, a speed-up) must pass as it is. A change meant to alter
it regenerates the records (`python -m tests.policy_golden --write`) and says why in its
commit.
"""

from __future__ import annotations

import pytest

from router.policy import REGISTRY
from tests.policy_golden import (
    GOLDEN,
    first_difference,
    golden_path,
    read_golden,
    record,
    trace_name,
    traces,
)


def test_every_registered_policy_has_its_golden_traces() -> None:
    want = {golden_path(policy, replicas).name for policy, replicas in traces()}
    have = {path.name for path in GOLDEN.glob("*.jsonl.gz")}
    assert have == want, f"missing {sorted(want - have)}, stale {sorted(have - want)}"


@pytest.mark.parametrize(("policy", "replicas"), list(traces()), ids=lambda v: str(v))
def test_the_policy_makes_the_recorded_moves(policy: str, replicas: int) -> None:
    diff = first_difference(read_golden(policy, replicas), record(policy, replicas))
    assert diff is None, f"{trace_name(policy, replicas)}: {diff}"


def test_a_changed_decision_is_caught_and_shown() -> None:
    """The comparison can fail: mori with its growth band always held (no waiver) parts
    from its golden trace, and the message shows the call where it does."""
    diff = first_difference(read_golden("mori", 1), record("mori", 1, band_waiver_steps=0))
    assert diff is not None and "- golden:" in diff and "+ now:" in diff


def test_the_registry_and_the_traces_agree() -> None:
    assert sorted({policy for policy, _ in traces()}) == sorted(REGISTRY)
