"""Every registered policy makes the moves its golden trace recorded, call for call.

The traces and the driver are in `tests/policy_golden.py`; a change meant to keep the
policies' behaviour (a refactor, a speed-up) must pass as it is. A change meant to alter
it regenerates the records (`python -m tests.policy_golden --write`) and says why in its
commit.
"""

from __future__ import annotations

import dataclasses

import pytest

from router.config import RouterConfig
from router.policy import REGISTRY, make_policy
from router.policy.base import Policy
from router.policy.engine import MoriEngine
from tests.policy_golden import (
    CONFIG,
    GOLDEN,
    REPLICAS,
    Driver,
    first_difference,
    golden_path,
    load_lines,
    read_golden,
    record,
    record_scaled,
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


def _policy_classes() -> set[type[Policy]]:
    """Every class behind a registered policy, and the classes it derives from."""
    made = {type(make_policy(name)) for name in REGISTRY}
    return {k for cls in made for k in cls.__mro__ if issubclass(k, Policy) and k is not Policy}


def _overridden_twice(cls: type[Policy]) -> dict[str, list[str]]:
    """Methods defined by more than one class of `cls`'s chain below `Policy`."""
    chain = [k for k in cls.__mro__ if issubclass(k, Policy) and k is not Policy]
    defined: dict[str, list[str]] = {}
    for k in chain:
        for attr, value in vars(k).items():
            if callable(value) or isinstance(value, property | staticmethod | classmethod):
                defined.setdefault(attr, []).append(k.__name__)
    return {attr: owners for attr, owners in defined.items() if len(owners) > 1}


def test_no_policy_method_is_overridden_twice_along_a_chain() -> None:
    """The policies are the engine with stages, and baselines of their own: along any
    class chain below `Policy` a method is defined once (no override of an override, so
    no `super()` chain of three), and every MORI rung is the one engine class."""
    for cls in _policy_classes():
        assert not _overridden_twice(cls), f"{cls.__name__}: {_overridden_twice(cls)}"
    rungs = {type(make_policy(name)) for name in REGISTRY if name.startswith("mori")}
    assert rungs == {MoriEngine}


def test_the_override_check_can_fail() -> None:
    """A class that overrides an override is caught (the check above is not vacuous)."""

    class Twice(MoriEngine):
        def tick(self, now: float) -> list:
            return super().tick(now)

    assert _overridden_twice(Twice) == {"tick": ["Twice", "MoriEngine"]}


@pytest.mark.parametrize("policy", list(REGISTRY))
def test_a_router_running_faster_than_real_time_makes_the_same_moves(policy: str) -> None:
    """A live router at `--time-scale` k (clock k times faster, its timers divided by k:
    `mori demo`, a fast replay) answers the load call for call as the simulator does at
    k = 1: every duration built into a policy (cold-start tool times, the door's gain
    rates, Tokencake's wait term, Continuum's cold TTL) is read in trace seconds. k = 4:
    a power of 2 scales every float exactly. One replica: the fixes this guards each
    showed there (three replicas cost the suite twice as long for no other catch)."""
    replicas = 1
    diff = first_difference(
        record_scaled(policy, replicas, 1.0), record_scaled(policy, replicas, 4.0)
    )
    assert diff is None, f"{trace_name(policy, replicas)} at x4: {diff}"


def test_the_door_gain_keeps_pace_with_a_fast_router() -> None:
    """The door's gain rises and falls over trace seconds (a door bound tight enough that
    the gain decides: door_load 0.3)."""
    for replicas in REPLICAS:
        plain, fast = (record_scaled("mori", replicas, k, door_load=0.3) for k in (1.0, 4.0))
        assert first_difference(plain, fast) is None


def test_a_policy_reading_its_fast_clock_as_trace_time_is_caught() -> None:
    """The comparison can fail: a router whose timers are divided but whose policy takes
    its clock for trace time (`time_scale` 1, the bug this guards) parts from the load."""
    config = RouterConfig(replicas=["http://replica:1"], time_scale=4.0, **CONFIG)
    blind = dataclasses.replace(config.policy_config(), time_scale=1.0)
    fast = load_lines(Driver("mori", 1, blind, clock_scale=4.0))
    assert first_difference(record_scaled("mori", 1, 1.0), fast) is not None


def test_the_aging_default_is_trace_seconds_too() -> None:
    config = RouterConfig(replicas=["http://replica:1"], time_scale=5.0).policy_config()
    engine = make_policy("mori", config)
    assert isinstance(engine, MoriEngine)
    assert engine.aging_s == pytest.approx(make_policy("mori").aging_s / 5)
